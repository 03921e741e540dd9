"""asteria.Shampoo in mode="sync" against reference.ShampooRef, the plain-torch restatement of
DESIGN.md's Shampoo (Adam grafting, start_preconditioning_step, bias-corrected factors, inverse
root -1/(2*order)): parameters compared after every step, float64, refreshes every 5 steps.

Inverse roots are unique functions of their factor, so unlike SOAP / KL-Shampoo no eigenbasis
choice is involved; the models (models.py) are the same small square ones anyway.
"""

import pytest
import torch

from asteria.optim import Shampoo
from models import DTYPE, assert_lockstep, lockstep
from reference import ShampooRef
from tolerance import rounding_tol

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
    tol = rounding_tol(DTYPE, n=lam.numel(), cond=float(lam.max() / lam.min()))  # n eps cond(L)
    torch.testing.assert_close(st["b0.Linv1"], want, rtol=tol, atol=tol)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rank_deficient_factor_roots_agree_sync_and_async(dtype):
    """A (2, 16) weight: its right factor (16 x 16) has rank <= 2 per step, so at the first
    refresh (f = 2) it has a 12-dimensional null space. The two LAPACKs (torch's in sync, the
    C pool's OpenBLAS in async) return different noise-level eigenvalues there; eigenvalues
    below n eps_m lam_max are raised to that floor, so the roots agree (before the floor they
    differed by O(1) there)."""
    from models import require_c_extension

    require_c_extension()
    roots = {}
    for mode in ("sync", "async"):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(2, 16, dtype=dtype))
        runtime = {"mode": mode} if mode == "sync" else {"mode": "async", "staleness": 0,
                                                         "workers": 1}
        opt = Shampoo([w], lr=1e-2, precondition_frequency=2, runtime=runtime)
        for t in range(2):
            x = torch.randn(32, 16, dtype=dtype, generator=torch.Generator().manual_seed(t))
            opt.zero_grad()
            (x @ w.T).square().mean().backward()
            opt.step()
        roots[mode] = opt.state[w]["b0.Linv1"].double()
        opt.close()
    r_sync, r_async = roots["sync"], roots["async"]
    null = torch.linalg.eigvalsh(r_sync)[-12:]  # the null space has one root value
    assert (null.max() / null.min() - 1).item() < 1e-4
    rel = ((r_sync - r_async).norm() / r_sync.norm()).item()
    assert rel < (1e-3 if dtype == torch.float32 else 1e-9), rel


def test_inverse_root_floor_matches_restatement():
    """The torch engine's inverse root against a plain restatement of the floor rule."""
    from asteria.refresh.inline_torch import compute

    torch.manual_seed(1)
    g = torch.randn(16, 3, dtype=torch.float64)
    f = (g @ g.T).unsqueeze(0)  # rank 3 of 16
    (x,) = compute("inv_root", f, None, 4.0, 1e-12)
    lam, q = torch.linalg.eigh(f[0])
    floor = 16 * torch.finfo(torch.float64).eps * lam.max()
    want = q @ torch.diag((torch.maximum(lam, floor) + 1e-12) ** -0.25) @ q.T
    torch.testing.assert_close(x[0], want, rtol=1e-10, atol=0)
