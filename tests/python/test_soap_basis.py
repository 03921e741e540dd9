"""SOAP's eigenbasis as a function of its factor (python/asteria/refresh/basis.py, the canonical
bases of src/linalg.c): on a rank-deficient factor the ``eigh`` and ``soap_qr`` ops give the null
space a basis that depends on the factor's range (and the previous basis) only, the C pool and
the torch executor agree on it to rounding, it is unchanged by rounding-level perturbations of
the factor, and full-rank factors keep the plain decomposition's result bit for bit.

The rule is restated in plain torch in tests/python/reference.py, one block at a time, without
the fast paths of the implementations."""

import pytest
import torch

from asteria.refresh import ops
from asteria.refresh.host_pool import HostPoolEngine

from reference import canonical_qr, eigvecs_descending
from tolerance import rounding_tol

# ||F|| / eigenvalue gap of the factors here (the null space's gap included): at most 18 for
# deficient() with fewer rows than columns, 85 for the full-rank one (30 rows of 10; measured)
COND = 100


def basis_tol(dtype, n):
    """A basis from two eigensolvers / QRs (or one and the restatement) in dtype: n eps cond."""
    return rounding_tol(dtype, n=n, cond=COND)


def _align_signs(q, ref):
    s = torch.sign((q * ref).sum(0))
    s[s == 0] = 1
    return q * s


def restated_soap_qr(f, q):
    """One block: (Q_new, perm) by tests/python/reference.py's restatement."""
    fq = f @ q
    perm = torch.argsort((q * fq).sum(0), descending=True, stable=True)
    return canonical_qr(fq[:, perm], q[:, perm]), perm


def restated_eigh(f):
    """(Q, null mask) by the restatement."""
    n = f.shape[0]
    w = torch.linalg.eigvalsh(f).flip(0)
    return eigvecs_descending(f), w.abs() <= n * torch.finfo(f.dtype).eps * w.abs().max()


def deficient(batch, n, rows, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, rows, n, generator=g, dtype=torch.float64)
    return (x.transpose(1, 2) @ x).to(dtype)


def orthogonal(batch, n, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64)).Q.to(dtype)


@pytest.fixture(scope="module")
def eng():
    e = HostPoolEngine({"workers": 1, "pin": False})
    yield e
    e.close()


def c_op(eng, op, f, q=None):
    c_op.k = getattr(c_op, "k", 0) + 1
    res = eng.wait(eng.submit(op, f.contiguous(), None if q is None else q.contiguous(),
                              block=c_op.k, version=1, deadline=c_op.k, snapshot_step=c_op.k))
    assert res.status == 0, res.error
    return res.outputs


def _torch_op(op, f, q=None):
    return ops.OPS[op].reference(f, q, 0.0, 0.0, None)


def near_eigenbasis(f, seed=3):
    """Eigenvectors of a factor near f: the basis SOAP's power iteration holds, with which the
    dependent columns come last (the implementations' shortcut for that case)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(f.shape, generator=g, dtype=f.dtype) * 1e-3 * f.abs().amax()
    return torch.linalg.eigh(f + e + e.transpose(1, 2))[1].flip(-1).contiguous()


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("n,rows", [(8, 3), (12, 5), (30, 6), (24, 1)])
def test_soap_qr_matches_restatement_and_c(eng, n, rows, aligned):
    f = deficient(3, n, rows)
    q = near_eigenbasis(f) if aligned else orthogonal(3, n)
    want = [restated_soap_qr(f[b], q[b]) for b in range(3)]
    got_t, perm_t = _torch_op("soap_qr", f, q)
    got_c, perm_c = c_op(eng, "soap_qr", f, q)
    for b, (w, perm) in enumerate(want):
        assert torch.linalg.matrix_rank(f[b]) < n  # rank-deficient, or the test means nothing
        assert torch.equal(perm_t[b], perm) and torch.equal(perm_c[b], perm)
        for got in (got_t[b], got_c[b]):
            torch.testing.assert_close(got, w, rtol=0, atol=basis_tol(f.dtype, n))
            # orthonormal to n eps from the QR, n eps more from the product
            torch.testing.assert_close(got.T @ got, torch.eye(n, dtype=f.dtype), rtol=0,
                                       atol=rounding_tol(f.dtype, n=n, steps=2))
        torch.testing.assert_close(got_c[b], got_t[b], rtol=0, atol=basis_tol(f.dtype, n))


@pytest.mark.parametrize("n,rows", [(8, 3), (30, 6), (24, 1)])
def test_eigh_matches_restatement_and_c(eng, n, rows):
    f = deficient(2, n, rows)
    got_t, w_t = _torch_op("eigh", f)
    got_c, w_c = c_op(eng, "eigh", f)
    for b in range(2):
        want, null = restated_eigh(f[b])
        assert null.any()
        for got in (got_t[b], got_c[b]):
            aligned = got.clone()
            aligned[:, ~null] = _align_signs(got[:, ~null], want[:, ~null])
            torch.testing.assert_close(aligned, want, rtol=0, atol=basis_tol(f.dtype, n))
        # the null columns are canonical, so C and torch agree there whatever their LAPACK
        torch.testing.assert_close(got_c[b][:, null], got_t[b][:, null], rtol=0,
                                   atol=basis_tol(f.dtype, n))
    # eigenvalues from two LAPACKs: each within n eps ||F|| (absolute)
    torch.testing.assert_close(w_c, w_t, rtol=0,
                               atol=rounding_tol(f.dtype, n=n) * float(w_t.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("op", ["eigh", "soap_qr", "kl_qr"])
def test_rounding_perturbation_moves_the_basis_by_rounding(eng, op, dtype):
    """The same factor summed in two orders (as 1 and 4 ranks sum it) gives bases that differ
    by rounding, null space included (before: O(1) there)."""
    n, rows = 16, 4
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, rows, n, generator=g, dtype=torch.float64).to(dtype)
    f = x.transpose(1, 2) @ x
    f2 = sum(x[:, i, :, None] * x[:, i, None, :] for i in reversed(range(rows)))
    assert not torch.equal(f, f2)  # the sums differ by rounding
    q = orthogonal(2, n, dtype=dtype)
    basis = None if op == "eigh" else q
    for run in (lambda x: _torch_op(op, x, basis), lambda x: c_op(eng, op, x, basis)):
        a, b = run(f)[0], run(f2)[0]
        b = _align_signs(b[0], a[0]), _align_signs(b[1], a[1])
        diff = max(float((a[i] - b[i]).abs().max()) for i in range(2))
        assert diff < basis_tol(dtype, n), diff  # n eps cond, cond 100 (was 1e3 eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_full_rank_factor_keeps_the_plain_result(eng, dtype):
    """A full-rank factor: soap_qr is the plain QR of F Q[:, perm] bit for bit (torch), and the
    C op equals the C op's plain path (the result of today's kernels) to rounding."""
    n = 10
    f = deficient(2, n, 3 * n, dtype=dtype)
    q = orthogonal(2, n, dtype=dtype)
    fq = f @ q
    perm = torch.argsort((q * fq).sum(1), dim=-1, descending=True, stable=True)
    plain = torch.linalg.qr(torch.gather(fq, 2, perm.unsqueeze(1).expand_as(fq))).Q
    got, got_perm = _torch_op("soap_qr", f, q)
    assert torch.equal(got, plain) and torch.equal(got_perm, perm)
    got_c, _ = c_op(eng, "soap_qr", f, q)
    torch.testing.assert_close(got_c, plain, rtol=0, atol=basis_tol(dtype, n))
    w, v = torch.linalg.eigh(f)
    got_q, got_w = _torch_op("eigh", f)
    assert torch.equal(got_q, v.flip(-1)) and torch.equal(got_w, w.flip(-1))


def test_null_directions_keep_the_previous_basis(eng):
    """Where F is zero on a subspace the previous basis already spans, the refresh keeps those
    columns: a direction that stays null keeps its place (and SOAP its statistics there)."""
    n, r = 9, 3
    q = orthogonal(1, n)
    lam = torch.zeros(n, dtype=torch.float64)
    lam[:r] = torch.tensor([3.0, 2.0, 1.0])
    f = (q * lam) @ q.transpose(1, 2)
    for got, perm in (_torch_op("soap_qr", f, q), c_op(eng, "soap_qr", f, q)):
        qs = q[0][:, perm[0]]
        # the range columns span q's first r, the null columns are q's others (up to sign)
        null = got[0][:, r:]
        torch.testing.assert_close((null.T @ qs[:, r:]).abs(), torch.eye(n - r, dtype=f.dtype),
                                   rtol=0, atol=basis_tol(f.dtype, n))


def test_zero_factor_keeps_its_basis(eng):
    """F = 0 (every column dependent): the refresh returns the previous basis (sorted)."""
    n = 6
    q = orthogonal(1, n)
    f = torch.zeros(1, n, n, dtype=torch.float64)
    for got, perm in (_torch_op("soap_qr", f, q), c_op(eng, "soap_qr", f, q)):
        # q's columns through Gram-Schmidt twice: n eps each time
        torch.testing.assert_close(got[0], q[0][:, perm[0]], rtol=0,
                                   atol=rounding_tol(f.dtype, n=n, steps=2))
