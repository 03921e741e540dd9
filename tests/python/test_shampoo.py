"""asteria.Shampoo in mode="sync" against reference.ShampooRef, the plain-torch restatement of
DESIGN.md's Shampoo (Adam grafting, start_preconditioning_step, bias-corrected factors, inverse
root -1/(2*order)): parameters compared after every step, float64, refreshes every 5 steps.

Inverse roots are unique functions of their factor, so unlike SOAP / KL-Shampoo no eigenbasis
choice is involved; the models (models.py) are the same small square ones anyway.
"""

import pytest
import torch

from asteria.optim import Shampoo
from models import assert_lockstep, lockstep
from reference import ShampooRef

SYNC = {"mode": "sync"}


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_sync_matches_reference(kind):
    history, opt = lockstep(kind, lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5,
                                                    runtime=SYNC),
                            lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=5), steps=30)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["installs"] == stats["refreshes_submitted"] > 0


@pytest.mark.parametrize("hp", [
    dict(betas=(0.9, 1.0)),  # running-sum factors, no bias correction
    dict(start_preconditioning_step=12, weight_decay=0.05, epsilon=1e-6),
    dict(inverse_exponent_override=2, betas=(0.5, 0.99), grafting_beta2=0.9,
         grafting_epsilon=1e-6),
], ids=["running_sum", "late_start_weight_decay", "root_override"])
def test_sync_matches_reference_hyperparameters(hp):
    ref_hp = dict(hp)
    if "inverse_exponent_override" in ref_hp:
        ref_hp["inverse_root"] = ref_hp.pop("inverse_exponent_override")
    history, _ = lockstep("mlp", lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5,
                                                   runtime=SYNC, **hp),
                          lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=5, **ref_hp),
                          steps=25)
    assert_lockstep(history)


def test_preconditioning_starts_at_start_step():
    """Before start_preconditioning_step the direction is the grafted Adam one: with the start
    after the last step, Shampoo equals its grafting method alone."""
    history, opt = lockstep(
        "mlp", lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5,
                                 start_preconditioning_step=100, runtime=SYNC),
        lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=1000), steps=15)
    assert_lockstep(history)
    assert any("b0.Linv0" in st for st in opt.state.values())  # roots exist, unused


def test_nd_parameter_order_three_root():
    """A 3-D parameter has three factors, each with the inverse root -1/6."""
    history, opt = lockstep("tensor3", lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5,
                                                         runtime=SYNC),
                            lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=5), steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    c = 1 - 0.999 ** st["step"]
    lam, q = torch.linalg.eigh(st["b0.L1"] / c)
    # the root installed at k = 25 is that of L at k = 25 (this is the last step)
    want = q @ torch.diag((lam.clamp(min=0) + 1e-12) ** (-1 / 6)) @ q.T
    torch.testing.assert_close(st["b0.Linv1"], want, rtol=1e-9, atol=1e-9)


def test_max_preconditioner_dim_gives_identity():
    history, opt = lockstep(
        "tensor3", lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5,
                                     max_preconditioner_dim=4, runtime=SYNC),
        lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=5, max_preconditioner_dim=4),
        steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert "b0.L2" not in st and "b0.Linv2" not in st and "b0.Linv0" in st


def test_block_size_equals_blocks_as_separate_params():
    def blocks(model):
        tensors, grads = [], []
        for p in model.parameters():
            if p.dim() == 1:
                tensors.append(p.data)
                grads.append(lambda p=p: p.grad)
                continue
            for r in (slice(0, 5), slice(5, 8)):
                for c in (slice(0, 5), slice(5, 8)):
                    tensors.append(p.data[r, c])
                    grads.append(lambda p=p, r=r, c=c: p.grad[r, c])
        return tensors, lambda: [g() for g in grads]

    history, _ = lockstep(
        "mlp", lambda p: Shampoo(p, lr=3e-3, precondition_frequency=5, block_size=5,
                                 runtime=SYNC),
        lambda p: ShampooRef(p, lr=3e-3, precondition_frequency=5), steps=25, ref_views=blocks)
    assert_lockstep(history)
