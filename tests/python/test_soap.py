"""asteria.SOAP in mode="sync" against reference.SOAPRef, the plain-torch restatement of
DESIGN.md's SOAP equations: parameters compared after every step, float64, with refreshes
(precondition_frequency 5, 30 steps: 5 refreshes after the first-step eigendecomposition).

Models (models.py) use square weight matrices and batches of more tokens than any width, so
every factor has distinct eigenvalues and its eigenbasis is unique up to signs (to which SOAP
is invariant); see the models.py docstring for why rectangular layers would not do.
"""

import pytest
import torch

from asteria.optim import SOAP
from asteria.optim import functional as F
from models import assert_lockstep, blocks_view, grid_blocks, lockstep, make_model
from reference import SOAPRef
from tolerance import rounding_tol

# One soap_step on O(1) blocks of side <= 6, batched or laid out another way (same float64 ops,
# other kernels or order): ~6 products in sequence, each a sum of <= 6 terms
STEP_TOL = rounding_tol(torch.float64, n=6, steps=6)
# One product (project, mode_mul, gram) of such blocks
PRODUCT_TOL = rounding_tol(torch.float64, n=6)

SYNC = {"mode": "sync"}


@pytest.mark.parametrize("kind", ["mlp", "block"])
def test_sync_matches_reference(kind):
    history, opt = lockstep(kind, lambda p: SOAP(p, precondition_frequency=5, runtime=SYNC),
                            lambda p: SOAPRef(p, precondition_frequency=5), steps=30)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    # one first-step round, then refreshes at k = 5, 10, ..., 25 (steps 6, 11, ..., 26)
    assert stats["installs"] == stats["refreshes_submitted"] > 0
    assert stats["max_install_lag"] == 0 and stats["refresh_failures"] == 0


@pytest.mark.parametrize("hp", [
    dict(normalize_grads=True),
    dict(correct_bias=False, shampoo_beta=0.9, betas=(0.9, 0.99)),
    dict(weight_decay=0.1, lr=1e-2, eps=1e-6),
], ids=["normalize_grads", "no_bias_correction", "weight_decay"])
def test_sync_matches_reference_hyperparameters(hp):
    history, _ = lockstep("mlp", lambda p: SOAP(p, precondition_frequency=5, runtime=SYNC, **hp),
                          lambda p: SOAPRef(p, precondition_frequency=5, **hp), steps=25)
    assert_lockstep(history)


def test_nd_parameter_one_factor_per_dimension():
    history, opt = lockstep("tensor3", lambda p: SOAP(p, precondition_frequency=5, runtime=SYNC),
                            lambda p: SOAPRef(p, precondition_frequency=5), steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert [st[f"b0.GG{i}"].shape for i in range(3)] == [(4, 4), (3, 3), (5, 5)]


def test_max_precond_dim_gives_identity():
    # dims 0 (4) and 1 (3) get a factor, dim 2 (5 > 4) none
    history, opt = lockstep(
        "tensor3", lambda p: SOAP(p, precondition_frequency=5, max_precond_dim=4, runtime=SYNC),
        lambda p: SOAPRef(p, precondition_frequency=5, max_precond_dim=4), steps=25)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert "b0.GG2" not in st and "b0.Q2" not in st and st["b0.Q1"].shape == (3, 3)


def test_merge_dims_equals_reference_on_merged_view():
    # (4, 3, 5) with max_precond_dim 15 merges to (12, 5), SOAP's rule
    def merged(model):
        w = model.w
        return [w.data.view(12, 5)], lambda: [w.grad.view(12, 5)]

    history, opt = lockstep(
        "tensor3",
        lambda p: SOAP(p, precondition_frequency=5, max_precond_dim=15, merge_dims=True,
                       runtime=SYNC),
        lambda p: SOAPRef(p, precondition_frequency=5, max_precond_dim=15), steps=25,
        ref_views=merged)
    assert_lockstep(history)
    (st,) = opt.state.values()
    assert st["b0.GG0"].shape == (12, 12) and st["b0.GG1"].shape == (5, 5)


@pytest.mark.parametrize("block_size", [4, 3])
def test_block_size_equals_blocks_as_separate_params(block_size):
    """Each block is an independent SOAP problem; block_size 3 on 8 x 8 leaves 2-wide edges."""
    history, opt = lockstep(
        "mlp",
        lambda p: SOAP(p, precondition_frequency=5, block_size=block_size, runtime=SYNC),
        lambda p: SOAPRef(p, precondition_frequency=5), steps=25,
        ref_views=blocks_view(block_size))
    assert_lockstep(history)
    weight = next(st for st in opt.state.values() if "b0.GG0" in st)
    assert sum(k.endswith(".exp_avg") for k in weight) == len(grid_blocks((8, 8), block_size))


def test_precondition_1d():
    """precondition_1d routes biases through SOAP (no update in the first step, unlike AdamW).
    The dimension is kept above max_precond_dim (identity factor): a 1-D factor starts as the
    rank-one g g^T, whose 7-fold zero eigenvalue has an arbitrary eigenbasis that rounding
    alone moves at O(1), in the reference as much as here."""
    history, opt = lockstep(
        "mlp", lambda p: SOAP(p, precondition_frequency=5, precondition_1d=True,
                              max_precond_dim=6, runtime=SYNC),
        lambda p: SOAPRef(p, precondition_frequency=5, precondition_1d=True, max_precond_dim=6),
        steps=12)
    assert_lockstep(history)
    bias = next(p for p in opt.state if p.dim() == 1)
    assert "b0.exp_avg" in opt.state[bias] and "exp_avg" not in opt.state[bias]
    _, after_first, _ = history[0]
    assert torch.equal(after_first[1], make_model("mlp").layers[0].bias.detach())


def test_functional_kernel_is_batched_per_block():
    """The kernels are plain functions over stacks: a stack of two blocks with different step
    counts gives each block what it gets alone."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    w, g, m, v = rand(2, 5, 3), rand(2, 5, 3), rand(2, 5, 3), rand(2, 5, 3).abs()
    factors = [rand(2, 5, 5), rand(2, 3, 3)]
    bases = [torch.linalg.qr(rand(2, 5, 5)).Q, torch.linalg.qr(rand(2, 3, 3)).Q]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, shampoo_beta=0.95, eps=1e-8, weight_decay=0.01,
              correct_bias=True, normalize_grads=False)
    single = []
    for b in range(2):
        ts = [t[b:b + 1].clone() for t in (w, g, m, v)]
        fs = [f[b:b + 1].clone() for f in factors]
        F.soap_step(*ts, fs, [q[b:b + 1] for q in bases], [3 + b], **hp)
        single.append((ts, fs))
    F.soap_step(w, g, m, v, factors, bases, [3, 4], **hp)
    for b, (ts, fs) in enumerate(single):
        for got, want in zip((w, g, m, v, *factors), (*ts, *fs)):
            torch.testing.assert_close(got[b:b + 1], want, rtol=STEP_TOL, atol=STEP_TOL)


@pytest.mark.parametrize("normalize_grads", [False, True])
@pytest.mark.parametrize("one_side", [False, True])
def test_functional_kernel_updates_a_list_of_weights_in_place(normalize_grads, one_side):
    """``w`` given as the list of the blocks themselves (whole parameters: no stack to copy
    back): each block is updated where it is, as the stack would be."""
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    w, g, m, v = rand(2, 5, 3), rand(2, 5, 3), rand(2, 5, 3), rand(2, 5, 3).abs()
    factors = [rand(2, 5, 5), None if one_side else rand(2, 3, 3)]
    bases = [torch.linalg.qr(rand(2, 5, 5)).Q,
             None if one_side else torch.linalg.qr(rand(2, 3, 3)).Q]
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, shampoo_beta=0.95, eps=1e-8, weight_decay=0.01,
              correct_bias=True, normalize_grads=normalize_grads)
    members = [w[0].clone().t().contiguous().t(), w[1].clone()]  # one of them column-major
    mine = [t.clone() for t in (m, v)] + [None if f is None else f.clone() for f in factors]
    F.soap_step(w, g, m, v, factors, bases, [3, 4], **hp)
    F.soap_step(members, g, mine[0], mine[1], mine[2:], bases, [3, 4], **hp)
    for b in range(2):
        torch.testing.assert_close(members[b], w[b], rtol=STEP_TOL, atol=STEP_TOL)
    for got, want in zip(mine, [m, v] + factors):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=STEP_TOL, atol=STEP_TOL)


@pytest.mark.parametrize("shape,sides", [((3, 5, 4), (True, True)), ((2, 6, 3), (False, True)),
                                         ((2, 4, 3, 5), (True, False, True))])
def test_soap_permute_moves_v_by_each_sort_order(shape, sides):
    """v_new[b] = v[b] with dimension i reordered by the sort order s_i of block b, exactly
    (DESIGN.md: v follows the eigenvalue order of the refreshed basis)."""
    g = torch.Generator().manual_seed(3)
    v = torch.rand(shape, generator=g, dtype=torch.float64)
    perms = [torch.stack([torch.randperm(shape[i + 1], generator=g) for _ in range(shape[0])])
             if on else None for i, on in enumerate(sides)]
    want = v.clone()
    for b in range(shape[0]):
        for i, perm in enumerate(perms):
            if perm is not None:
                want[b] = want[b].index_select(i, perm[b])  # restated: one block, one side
    got = v.clone()
    F.soap_permute(got, perms)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shape", [(2, 5, 3), (3, 4, 4), (2, 3, 6)])
def test_matrix_fast_path_equals_general_path(shape):
    """project / project_back / gram / mode_mul on a stack of matrices (direct bmms on
    transposed views) equal the general N-D path (dimension moved last, reshaped, bmm), and a
    whole soap_step (U's last product and weight decay accumulated into W, factors by baddbmm)
    equals the step of the same blocks with a trailing dimension of size 1 (the N-D path)."""
    gen = torch.Generator().manual_seed(5)

    def rand(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    B, m, n = shape
    x = rand(B, m, n)
    ql, qr = torch.linalg.qr(rand(B, m, m)).Q, torch.linalg.qr(rand(B, n, n)).Q
    for bases in ([ql, qr], [ql, None], [None, qr]):
        general, general_back = x, x  # the general path, dimension by dimension
        for i, q in enumerate(bases):
            if q is not None:
                general = F._mode_mul_nd(general, q, i)
                general_back = F._mode_mul_nd(general_back, q.transpose(1, 2), i)
        for got, want in ((F.project(x, bases), general),
                          (F.project_back(x, bases), general_back),
                          (F.project(x.unsqueeze(-1), bases + [None])[..., 0], general),
                          (F.project_back(x.unsqueeze(-1), bases + [None])[..., 0],
                           general_back)):
            torch.testing.assert_close(got, want, rtol=PRODUCT_TOL, atol=PRODUCT_TOL)
    for dim, q in ((0, ql), (1, qr)):
        torch.testing.assert_close(F.mode_mul(x, q, dim), F._mode_mul_nd(x, q, dim),
                                   rtol=PRODUCT_TOL, atol=PRODUCT_TOL)
        torch.testing.assert_close(F.gram(x, dim), F.gram(x.unsqueeze(-1), dim),
                                   rtol=PRODUCT_TOL, atol=PRODUCT_TOL)
    want = x @ x.transpose(1, 2), x.transpose(1, 2) @ x
    for dim in (0, 1):
        torch.testing.assert_close(F.gram(x, dim), want[dim], rtol=PRODUCT_TOL, atol=PRODUCT_TOL)

    cases = [(hp, bases, steps)
             for hp in (dict(normalize_grads=False, correct_bias=True),
                        dict(normalize_grads=True, correct_bias=True),
                        dict(normalize_grads=False, correct_bias=False))
             for bases in ([ql, qr], [ql, None], [None, qr])
             for steps in ([3] * B, list(range(2, 2 + B)))]  # one step size, one per block
    for hp, bases, steps in cases:
        w, g, mo, v = rand(B, m, n), rand(B, m, n), rand(B, m, n), rand(B, m, n).abs()
        factors = [None if q is None else rand(B, q.shape[1], q.shape[1]) for q in bases]
        args = dict(lr=1e-2, beta1=0.9, beta2=0.95, shampoo_beta=0.9, eps=1e-8,
                    weight_decay=0.1, **hp)
        nd = [t.clone().unsqueeze(-1) for t in (w, g, mo, v)]
        nd_factors = [None if f is None else f.clone() for f in factors] + [None]
        F.soap_step(w, g, mo, v, factors, bases, steps, **args)
        F.soap_step(*nd, nd_factors, bases + [None], steps, **args)
        for got, want in zip((w, g, mo, v, *factors), (*nd, *nd_factors)):
            if got is None:
                continue
            torch.testing.assert_close(got, want.squeeze(-1) if want.dim() == 4 else want,
                                       rtol=STEP_TOL, atol=STEP_TOL)
