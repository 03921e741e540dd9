"""asteria.KLShampoo in mode="sync" against reference.KLShampooRef, the plain-torch
restatement of DESIGN.md's KL-Shampoo (U from the current Q, s; factor and eigenvalue updates
from the PREVIOUS Q, s; QR refresh without sorting): parameters compared after every step,
float64 (compute_dtype=torch.float64), refreshes every 5 steps.

Models (models.py) use square weight matrices and batches of more tokens than any width, so
every factor has distinct eigenvalues and its eigenbasis is unique up to signs (to which
KL-Shampoo is invariant).
"""

import pytest
import torch

from asteria.optim import KLShampoo
from models import assert_lockstep, lockstep, run
from reference import KLShampooRef

SYNC = {"mode": "sync"}
F64 = dict(compute_dtype=torch.float64)


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_sync_matches_reference(kind):
    history, opt = lockstep(kind, lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5,
                                                      runtime=SYNC, **F64),
                            lambda p: KLShampooRef(p, lr=3e-3, precondition_frequency=5),
                            steps=30)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["installs"] == stats["refreshes_submitted"] > 0


@pytest.mark.parametrize("hp", [
    dict(using_clamping=False, init_factor=0.5),
    dict(max_clamp_value=2, shampoo_beta=0.9, weight_decay=0.1),  # the clamp at 10 is active
], ids=["no_clamping", "clamped"])
def test_sync_matches_reference_hyperparameters(hp):
    history, _ = lockstep("mlp", lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5,
                                                     runtime=SYNC, **F64, **hp),
                          lambda p: KLShampooRef(p, lr=3e-3, precondition_frequency=5, **hp),
                          steps=25)
    assert_lockstep(history)


def test_nd_parameter_one_factor_per_dimension():
    history, opt = lockstep("tensor3", lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5,
                                                           runtime=SYNC, **F64),
                            lambda p: KLShampooRef(p, lr=3e-3, precondition_frequency=5),
                            steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert [st[f"b0.s{i}"].shape for i in range(3)] == [(4,), (3,), (5,)]


def test_max_precond_dim_gives_identity():
    history, opt = lockstep(
        "tensor3", lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5, max_precond_dim=4,
                                       runtime=SYNC, **F64),
        lambda p: KLShampooRef(p, lr=3e-3, precondition_frequency=5, max_precond_dim=4),
        steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert "b0.S2" not in st and "b0.S1" in st


def test_compute_dtype_float32_default():
    """By default the state lives in float32 while the parameters stay float64; the run tracks
    the float64 one to float32 accuracy."""
    traj32, opt32 = run("mlp", lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5,
                                                   runtime=SYNC), 20)
    traj64, _ = run("mlp", lambda p: KLShampoo(p, lr=3e-3, precondition_frequency=5,
                                               runtime=SYNC, **F64), 20)
    weight = next(st for st in opt32.state.values() if "b0.S0" in st)
    assert {weight[k].dtype for k in weight if k != "step"} == {torch.float32}
    assert all(p.dtype == torch.float64 for p in traj32[-1])
    for a, b in zip(traj32[-1], traj64[-1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
