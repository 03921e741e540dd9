"""HostPoolEngine (asteria/refresh/host_pool.py): every REFRESH op against plain torch.linalg
restatements of engine.py's table, batched and overlapping jobs, snapshots, dtypes, failures,
cancel, stats."""

import time
import types

import pytest
import torch

from asteria import _C
from asteria.refresh.engine import Result, SubmitOptions
from asteria.refresh.host_pool import HostPoolEngine, c_config
from job_delay import set_job_delay
from tolerance import rounding_tol


@pytest.fixture
def eng():
    e = HostPoolEngine({"workers": 2, "pin": False})
    yield e
    e.close()


@pytest.fixture
def eng1():
    e = HostPoolEngine({"workers": 1, "pin": False})
    yield e
    e.close()


def sym(batch, n, dtype=torch.float64, seed=0, eigs=None):
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64))
    lam = torch.arange(n, 0, -1, dtype=torch.float64) if eigs is None else \
        torch.as_tensor(eigs, dtype=torch.float64)
    return ((u * lam) @ u.transpose(-1, -2)).to(dtype)


def basis(batch, n, dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=torch.float64))[0].to(dtype)


def sign_align(q, ref):
    s = torch.sign((q * ref).sum(-2, keepdim=True))
    s[s == 0] = 1
    return q * s


def ids():
    ids.k = getattr(ids, "k", 0) + 1
    return dict(block=ids.k, version=1, deadline=ids.k, snapshot_step=10 * ids.k)


def submit_wait(e, op, f, q=None, **kw):
    args = ids()
    args.update(kw)
    t = e.submit(op, f, q, **args)
    res = e.wait(t)
    assert isinstance(res, Result) and res.ticket == t
    assert (res.block, res.version, res.snapshot_step) == (
        args["block"], args["version"], args["snapshot_step"])
    return res


def ref_eigh(f):
    w, q = torch.linalg.eigh(f.double())
    return q.flip(-1), w.flip(-1)


def ref_inv_root(f, p, eps):
    """With the op's floor on the eigenvalues: n eps_m max(w) of f's dtype (src/linalg.c)."""
    w, q = torch.linalg.eigh(f.double())
    floor = f.shape[-1] * torch.finfo(f.dtype).eps * w.amax(-1, keepdim=True)
    return (q * (torch.maximum(w, floor) + eps).pow(-1.0 / p).unsqueeze(-2)) @ q.transpose(-1, -2)


def ref_soap_qr(f, q):
    f, q = f.double(), q.double()
    est = torch.einsum("bij,bik,bkj->bj", q, f, q)
    perm = torch.argsort(est, dim=-1, descending=True, stable=True)
    qs = torch.gather(q, 2, perm.unsqueeze(1).expand_as(q))
    return torch.linalg.qr(f @ qs).Q, perm


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eigh(eng, dtype):
    f = sym(4, 24, dtype, seed=2)
    res = submit_wait(eng, "eigh", f)
    assert res.status == 0 and res.error == "" and not res.retried_f64
    q, w = res.outputs
    assert q.shape == (4, 24, 24) and w.shape == (4, 24)
    assert q.dtype == dtype and w.dtype == dtype and q.device == f.device
    qr, wr = ref_eigh(f)
    tol = rounding_tol(dtype, n=24, cond=24)  # eigh in dtype: n eps ||F|| / gap, eigenvalues 24..1
    torch.testing.assert_close(w.double(), wr, rtol=tol, atol=tol)
    torch.testing.assert_close(sign_align(q.double(), qr), qr, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p", [2, 4])
def test_inv_root(eng, dtype, p):
    eigs = torch.cat([torch.linspace(4.0, 0.5, 15), torch.tensor([-0.1])])  # one clamped at 0
    f = sym(3, 16, dtype, seed=3, eigs=eigs)
    res = submit_wait(eng, "inv_root", f, p=p, eps=1e-3)
    assert res.status == 0
    (x,) = res.outputs
    assert x.dtype == dtype
    ref = ref_inv_root(f, p, 1e-3)
    # eigenvectors off by n eps ||F|| / gap (4 / 0.25), scaled by the largest root (1e-3)^(-1/p)
    tol = rounding_tol(dtype, n=16, cond=16 * 1e-3 ** (-1 / p))
    torch.testing.assert_close(x.double(), ref, rtol=tol, atol=tol)


def test_newton_root(eng):
    f = sym(2, 12, torch.float64, seed=4, eigs=torch.linspace(2.0, 1.0, 12))
    res = submit_wait(eng, "newton_root", f, p=2, eps=1e-8)
    assert res.status == 0
    # not rounding: the iteration stops at NEWTON_TOL = 1e-6 (src/op_table.c), times cond 2
    torch.testing.assert_close(res.outputs[0], ref_inv_root(f, 2, 1e-8), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_soap_qr(eng, dtype):
    f, q0 = sym(3, 20, dtype, seed=5), basis(3, 20, dtype, seed=6)
    res = submit_wait(eng, "soap_qr", f, q0)
    assert res.status == 0
    qn, perm = res.outputs
    assert qn.dtype == dtype and perm.dtype == torch.int64 and perm.shape == (3, 20)
    qref, pref = ref_soap_qr(f, q0)
    assert torch.equal(perm, pref)
    tol = rounding_tol(dtype, n=20, cond=20)  # QR of F Q in dtype: n eps cond(F), eigenvalues 20..1
    torch.testing.assert_close(sign_align(qn.double(), qref), qref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kl_qr(eng, dtype):
    f, q0 = sym(2, 18, dtype, seed=7), basis(2, 18, dtype, seed=8)
    res = submit_wait(eng, "kl_qr", f, q0)
    assert res.status == 0
    qref = torch.linalg.qr(f.double() @ q0.double()).Q
    tol = rounding_tol(dtype, n=18, cond=18)  # QR of F Q in dtype: n eps cond(F), eigenvalues 18..1
    torch.testing.assert_close(sign_align(res.outputs[0].double(), qref), qref, rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_computed_in_float32(eng, dtype):
    f = sym(2, 8, torch.float32, seed=9).to(dtype)
    res = submit_wait(eng, "eigh", f)
    assert res.status == 0
    q, w = res.outputs
    assert q.dtype == dtype and w.dtype == dtype
    _, wr = ref_eigh(f.float())
    # the outputs rounded to dtype (eps |w|) after float32's eigh (n eps ||F||, n = ||F|| = 8)
    torch.testing.assert_close(w.double(), wr, rtol=rounding_tol(dtype),
                               atol=rounding_tol(torch.float32, n=8, cond=8))


def test_rejects_bad_inputs(eng):
    with pytest.raises(ValueError, match="unknown REFRESH op"):
        eng.submit("svd", sym(1, 4), **ids())
    with pytest.raises(ValueError, match="shape"):
        eng.submit("eigh", torch.zeros(4, 4, dtype=torch.float64), **ids())
    with pytest.raises(ValueError, match="basis"):
        eng.submit("kl_qr", sym(1, 4), **ids())
    with pytest.raises(ValueError, match="floating"):
        eng.submit("eigh", torch.zeros(1, 4, 4, dtype=torch.int64), **ids())
    with pytest.raises(ValueError, match="non-empty"):
        eng.submit("eigh", torch.zeros(0, 4, 4), **ids())
    with pytest.raises(ValueError, match="p > 0"):
        eng.submit("inv_root", sym(1, 4), **ids())
    assert eng.stats()["bytes_registered"] == 0  # a refused submit leaves nothing registered


def test_snapshot_and_strided_input(eng1):
    f = sym(2, 16, torch.float64, seed=10)
    ft = f.transpose(-1, -2)  # not contiguous (and equal to f: symmetric)
    assert not ft.is_contiguous()
    expected = ref_inv_root(f, 2, 1e-6)
    t = eng1.submit("inv_root", ft, p=2, eps=1e-6, **ids())
    f.fill_(float("nan"))  # the job computes on its snapshot
    res = eng1.wait(t)
    assert res.status == 0
    tol = rounding_tol(torch.float64, n=16, cond=16)  # eigh: n eps ||F|| / gap; roots <= 1
    torch.testing.assert_close(res.outputs[0], expected, rtol=tol, atol=tol)


def test_batched_overlapping_jobs(eng):
    mats = [sym(3, 32, torch.float64, seed=20 + i) for i in range(6)]
    tickets = [eng.submit("eigh", m, **ids()) for m in mats]
    assert len(set(tickets)) == 6 and all(t > 0 for t in tickets)
    t0 = time.monotonic()
    while not all(eng.ready(t) for t in tickets):
        assert time.monotonic() - t0 < 60
        time.sleep(0.001)
    for m, t in reversed(list(zip(mats, tickets))):
        res = eng.wait(t)
        assert res.status == 0
        tol = rounding_tol(torch.float64, n=32, cond=32)  # eigenvalues 32..1 to n eps ||F||
        torch.testing.assert_close(res.outputs[1], ref_eigh(m)[1], rtol=tol, atol=tol)
    s = eng.stats()
    assert s["jobs_submitted"] == 6 and s["jobs_done"] == 6
    assert s["bytes_registered"] == 0  # every buffer unregistered once collected
    with pytest.raises(ValueError, match="ticket"):
        eng.wait(tickets[0])
    with pytest.raises(ValueError, match="ticket"):
        eng.ready(999999)


def test_nan_input_fails_without_outputs(eng):
    f = sym(3, 8, torch.float64, seed=30)
    f[2, 1, 1] = float("nan")
    res = submit_wait(eng, "inv_root", f, p=2, eps=1e-6)
    assert res.status == _C.AST_ENONFINITE == -8
    assert res.outputs is None
    assert "AST_ENONFINITE" in res.error and "block 2 of the batch" in res.error
    f32 = sym(1, 8, torch.float32, seed=31)
    f32[0, 0, 0] = float("inf")
    res = submit_wait(eng, "eigh", f32)
    assert res.status == _C.AST_ENONFINITE and res.outputs is None
    eng.note_nonfinite()
    s = eng.stats()
    assert s["jobs_failed"] == 2 and s["nonfinite_skipped"] == 1
    assert s["bytes_registered"] == 0


def test_cancel_queued_job(eng1):
    big = sym(8, 384, torch.float64, seed=40)
    set_job_delay(eng1.runtime, 1000)  # it still runs 1 s after its start, whatever the load
    t_long = eng1.submit("eigh", big, **ids())
    set_job_delay(eng1.runtime, 0)
    small = sym(1, 8, torch.float64, seed=41)
    t_small = eng1.submit("eigh", small, **ids())
    t0 = time.monotonic()
    while eng1.stats()["jobs_running"] < 1:
        assert time.monotonic() - t0 < 10
        time.sleep(0.001)
    assert eng1.cancel(t_small) is True
    assert eng1.cancel(t_small) is False
    assert eng1.cancel(t_long) is False  # already running
    assert eng1.ready(t_small)
    res = eng1.wait(t_small)
    assert res.status == _C.AST_ECANCELED and res.outputs is None and "AST_ECANCELED" in res.error
    res = eng1.wait(t_long)
    assert res.status == 0
    tol = rounding_tol(torch.float64, n=384, cond=384)  # eigenvalues 384..1 to n eps ||F||
    torch.testing.assert_close(res.outputs[1], ref_eigh(big)[1], rtol=tol, atol=tol)
    s = eng1.stats()
    assert s["jobs_cancelled"] == 1 and s["jobs_done"] == 1 and s["bytes_registered"] == 0


def test_wait_timeout_keeps_ticket(eng1):
    big = sym(8, 384, torch.float64, seed=42)
    set_job_delay(eng1.runtime, 1000)  # not done at the wait below, whatever the load
    t = eng1.submit("eigh", big, **ids())
    with pytest.raises(TimeoutError):
        eng1.wait(t, timeout=0.0)
    assert eng1.wait(t).status == 0


def test_stats_and_installs(eng):
    base = eng.stats()
    assert base["jobs_submitted"] == 0 and base["workers"] == 2
    for _ in range(3):
        assert submit_wait(eng, "kl_qr", sym(1, 6), basis(1, 6)).status == 0
    eng.note_install(4, 9)
    eng.note_install(5, 6)
    s = eng.stats()
    assert s["jobs_submitted"] == 3 and s["jobs_done"] == 3 and s["jobs_failed"] == 0
    assert s["installs"] == 2 and s["max_install_lag"] == 5
    assert s["barrier_waits"] <= 3 and s["barrier_wait_ns"] >= 0


def test_close_idempotent_with_jobs_in_flight():
    e = HostPoolEngine({"workers": 1, "pin": False})
    big = sym(4, 384, torch.float64, seed=43)
    e.submit("eigh", big, **ids())
    e.submit("eigh", sym(1, 8), **ids())
    e.close()
    e.close()
    s = e.stats()  # the last counters stay readable
    assert s["jobs_submitted"] == 2
    with pytest.raises(RuntimeError, match="closed"):
        e.submit("eigh", big, **ids())
    assert e.cancel(1) is False


def test_config_object_mapping():
    cfg = types.SimpleNamespace(mode="async", staleness=3, install="eager", workers=None,
                                placement={"factors": "device", "roots": "host_pinned"},
                                device_budget_bytes=None, host_budget_bytes=1 << 30,
                                nvme_dir=None, trace=None, max_failures=4, pin=False)
    d = c_config(cfg).as_dict()  # C gets only the keys it reads
    assert d["workers"] is None and d["pin"] is False
    assert set(d) == set(_C.config_keys()) and "staleness" not in d
    assert "max_failures" not in d  # the schedule's key (the one failure count), not C's
    e = HostPoolEngine(cfg)
    try:
        c = e.runtime.config
        assert c["pin"] is False and c["workers"] is None and "max_failures" not in c
        assert e.stats()["workers"] >= 1  # None: the cores the training thread does not use
    finally:
        e.close()
    # the object's other keys are validated as the optimizer's runtime= is
    with pytest.raises(ValueError, match="'install'"):
        HostPoolEngine(types.SimpleNamespace(install="later"))
    with pytest.raises(ValueError, match="'workers'"):
        HostPoolEngine(types.SimpleNamespace(workers=0))
    with pytest.raises(ValueError, match="'max_failures'.*an integer >= 1"):
        HostPoolEngine(types.SimpleNamespace(max_failures=0))


def test_runtime_config_dataclass():
    from asteria.config import RuntimeConfig

    cfg = RuntimeConfig(workers=2, staleness=4, pin=False)
    e = HostPoolEngine(cfg)
    try:
        assert e.runtime.config["workers"] == 2 and e.runtime.config == cfg.c_config.as_dict()
        assert cfg.staleness == 4 and "staleness" not in e.runtime.config  # the schedule's key
        res = submit_wait(e, "eigh", sym(1, 5))
        assert res.status == 0
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_inputs_come_back_on_device(eng):
    f = sym(2, 64, torch.float32, seed=50).cuda()
    q0 = basis(2, 64, torch.float32, seed=51).cuda()
    res = submit_wait(eng, "soap_qr", f, q0)
    assert res.status == 0
    qn, perm = res.outputs
    assert qn.device == f.device and perm.device == f.device
    torch.cuda.synchronize()
    qref, pref = ref_soap_qr(f.cpu(), q0.cpu())
    assert torch.equal(perm.cpu(), pref)
    torch.testing.assert_close(sign_align(qn.double().cpu(), qref), qref, rtol=5e-3, atol=5e-3)
    res = submit_wait(eng, "eigh", f.to(torch.bfloat16))
    assert res.outputs[0].device == f.device and res.outputs[0].dtype == torch.bfloat16


# ---- soap_rotate ---------------------------------------------------------------------------

def ref_rotate(x, a, b):
    """A_new^T A_old X B_old^T B_new in float64, a None pair being the identity side."""
    x = x.double()
    if a is not None:
        a = a.double()
        x = a[:, 1].transpose(-1, -2) @ a[:, 0] @ x
    if b is not None:
        b = b.double()
        x = x @ b[:, 0].transpose(-1, -2) @ b[:, 1]
    return x


def rotate_tol(dtype, x):
    """soap_rotate's rounding in dtype: four products of m-term sums (m the larger side), whose
    terms add up to at most m max|X| (orthogonal factors)."""
    m = max(x.shape[-2:])
    return rounding_tol(dtype, n=m, steps=4, cond=m) * float(x.abs().max())


def rotate_inputs(batch, n, n1, dtype, seed, sides):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, n1, generator=g, dtype=torch.float64).to(dtype)
    a = torch.stack((basis(batch, n, dtype, seed=seed + 1), basis(batch, n, dtype, seed=seed + 2)),
                    1) if "a" in sides else None
    b = torch.stack((basis(batch, n1, dtype, seed=seed + 3),
                     basis(batch, n1, dtype, seed=seed + 4)), 1) if "b" in sides else None
    return x, a, b


ROTATE_CASES = [(s, shape) for s in ("ab", "a", "b") for shape in ((6, 6), (4, 9), (9, 4))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sides,shape", ROTATE_CASES)
def test_soap_rotate(eng, dtype, sides, shape):
    n, n1 = shape
    x, a, b = rotate_inputs(3, n, n1, dtype, seed=60 + n, sides=sides)
    x0 = x.clone()
    res = submit_wait(eng, "soap_rotate", x, a, b=b)
    assert res.status == 0 and res.error == "" and not res.retried_f64
    (out,) = res.outputs
    assert out.shape == (3, n, n1) and out.dtype == dtype and out.device == x.device
    assert torch.equal(x, x0)  # the input is not modified
    tol = rotate_tol(dtype, x)
    torch.testing.assert_close(out.double(), ref_rotate(x, a, b), rtol=0, atol=tol)
    assert eng.stats()["bytes_registered"] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("sides,shape", ROTATE_CASES)
def test_soap_rotate_torch_engine(dtype, sides, shape):
    from asteria.refresh.inline_torch import InlineTorchEngine

    n, n1 = shape
    x, a, b = rotate_inputs(3, n, n1, dtype, seed=70 + n1, sides=sides)
    e = InlineTorchEngine()
    res = e.wait(e.submit("soap_rotate", x, a, b=b, **ids()))
    assert res.status == 0
    (out,) = res.outputs
    assert out.shape == (3, n, n1) and out.dtype == dtype
    tol = rotate_tol(dtype, x)
    torch.testing.assert_close(out.double(), ref_rotate(x, a, b), rtol=0, atol=tol)
    # the C engine agrees with it
    c = HostPoolEngine({"workers": 1, "pin": False})
    try:
        cres = submit_wait(c, "soap_rotate", x, a, b=b)
        torch.testing.assert_close(cres.outputs[0], out, rtol=0, atol=2 * tol)  # both round
    finally:
        c.close()


def test_soap_rotate_snapshot_strided_and_low_precision(eng1):
    x, a, b = rotate_inputs(2, 5, 7, torch.float64, seed=80, sides="ab")
    expected = ref_rotate(x, a, b)
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, not contiguous
    assert not xt.is_contiguous()
    t = eng1.submit("soap_rotate", xt, a, b=b, **ids())
    for tensor in (xt, a, b):
        tensor.fill_(float("nan"))  # the job computes on its snapshots
    res = eng1.wait(t)
    assert res.status == 0
    tol = rotate_tol(torch.float64, x)
    torch.testing.assert_close(res.outputs[0], expected, rtol=0, atol=tol)
    x, a, b = rotate_inputs(2, 5, 7, torch.float32, seed=81, sides="ab")
    res = submit_wait(eng1, "soap_rotate", x.to(torch.bfloat16), a.to(torch.bfloat16),
                      b=b.to(torch.bfloat16))
    assert res.status == 0 and res.outputs[0].dtype == torch.bfloat16
    ref = ref_rotate(x.to(torch.bfloat16), a.to(torch.bfloat16), b.to(torch.bfloat16))
    # computed in float32, the output rounded to bfloat16 (eps |Y|)
    torch.testing.assert_close(res.outputs[0].double(), ref, rtol=rounding_tol(torch.bfloat16),
                               atol=rotate_tol(torch.float32, x))


def test_soap_rotate_donated_inputs_are_read_in_place(eng1):
    """SubmitOptions(donate=("f", "q", "b")): contiguous host inputs of the job's dtype are not
    snapshotted (the worker reads the caller's tensors, so a write after submit is seen);
    others still are."""
    x, a, b = rotate_inputs(2, 6, 5, torch.float64, seed=85, sides="ab")
    expected = ref_rotate(x, a, b)
    tol = rotate_tol(torch.float64, 2.0 * x)
    before = eng1.stats()
    given = SubmitOptions(donate=("f", "q", "b"))
    res = submit_wait(eng1, "soap_rotate", x, a, b=b, opts=given)
    assert res.status == 0
    torch.testing.assert_close(res.outputs[0], expected, rtol=0, atol=tol)
    after = eng1.stats()
    assert after["inputs_donated"] - before["inputs_donated"] == 3
    assert after["bytes_d2h_snapshots"] == before["bytes_d2h_snapshots"]
    # in place, really: the single worker is held busy by a first job, the donated X of a
    # second is overwritten before that one starts, and its result is of the new X
    big = torch.randn(4, 256, 256, dtype=torch.float64)
    slow = eng1.submit("eigh", big @ big.transpose(1, 2), **ids())
    x2 = x.clone()
    t = eng1.submit("soap_rotate", x2, a, b=b, opts=given, **ids())
    x2.mul_(2.0)
    assert eng1.wait(slow).status == 0
    res = eng1.wait(t)
    torch.testing.assert_close(res.outputs[0], 2.0 * expected, rtol=0, atol=tol)
    # a strided X is not the job's layout: snapshotted, the pairs still donated
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    mid = eng1.stats()
    t = eng1.submit("soap_rotate", xt, a, b=b, opts=given, **ids())
    xt.fill_(float("nan"))
    res = eng1.wait(t)
    torch.testing.assert_close(res.outputs[0], expected, rtol=0, atol=tol)
    assert eng1.stats()["inputs_donated"] - mid["inputs_donated"] == 2
    with pytest.raises(ValueError, match="unknown input"):
        eng1.submit("soap_rotate", x, a, b=b, opts=SubmitOptions(donate=("x",)), **ids())


def test_soap_rotate_nonfinite_fails(eng):
    x, a, b = rotate_inputs(3, 4, 6, torch.float64, seed=82, sides="ab")
    b[1, 0, 2, 3] = float("inf")
    res = submit_wait(eng, "soap_rotate", x, a, b=b)
    assert res.status == _C.AST_ENONFINITE and res.outputs is None
    assert "block 1 of the batch" in res.error
    from asteria.refresh.inline_torch import InlineTorchEngine

    e = InlineTorchEngine()
    res = e.wait(e.submit("soap_rotate", x, a, b=b, **ids()))
    assert res.status == _C.AST_ENONFINITE and res.outputs is None


def test_soap_rotate_check_op_errors(eng):
    from asteria.refresh.ops import check_op
    from asteria.refresh.inline_torch import InlineTorchEngine

    x, a, b = rotate_inputs(2, 4, 6, torch.float64, seed=83, sides="ab")
    for e in (eng, InlineTorchEngine()):
        with pytest.raises(ValueError, match="neither"):
            e.submit("soap_rotate", x, None, b=None, **ids())
        with pytest.raises(ValueError, match=r"\(batch, n, n1\)"):
            e.submit("soap_rotate", x[0], a, b=b, **ids())
        with pytest.raises(ValueError, match=r"A pair \(q\) must have shape \(2, 2, 4, 4\)"):
            e.submit("soap_rotate", x, a[:, 0], b=b, **ids())
        with pytest.raises(ValueError, match=r"B pair \(b\) must have shape \(2, 2, 6, 6\)"):
            e.submit("soap_rotate", x, a, b=b[:1], **ids())
        with pytest.raises(ValueError, match="A pair"):
            e.submit("soap_rotate", x, b, b=a, **ids())  # the pairs swapped
        with pytest.raises(ValueError, match="only soap_rotate"):
            e.submit("kl_qr", sym(1, 4), basis(1, 4), b=b, **ids())
    assert eng.stats()["bytes_registered"] == 0
    check_op("soap_rotate", (x, a, b))
    check_op("soap_rotate", (x, a))  # a 2-tuple: no B pair
    check_op("kl_qr", (sym(1, 4), basis(1, 4)))
    with pytest.raises(ValueError, match="soap_rotate"):
        check_op("nope", (x, a))
    with pytest.raises(ValueError, match="neither"):
        check_op("soap_rotate", (x, None))


def test_soap_rotate_runtime_submit_errors():
    """_C.Runtime.submit's n1 / in2 arguments reach the runtime's checks."""
    rt = _C.Runtime({"workers": 1, "pin": False})
    try:
        x = torch.zeros(1, 3, 2, dtype=torch.float64)
        a = torch.zeros(1, 2, 3, 3, dtype=torch.float64)
        out = torch.zeros(1, 3, 2, dtype=torch.float64)
        hs = [rt.register(t.data_ptr(), t.numel() * 8) for t in (x, a, out)]
        args = ("soap_rotate", "float64", 3, 1, x.data_ptr(), a.data_ptr(), out.data_ptr(), None)
        with pytest.raises(ValueError, match="n1"):
            rt.submit(*args, n1=0)
        with pytest.raises(ValueError, match="neither"):
            rt.submit("soap_rotate", "float64", 3, 1, x.data_ptr(), None, out.data_ptr(), None,
                      n1=2)
        with pytest.raises(Exception, match="in2"):
            rt.submit(*args, n1=2, in2=out.data_ptr() + 8)  # not inside a registered buffer
        with pytest.raises(ValueError, match="in2 must be NULL"):
            rt.submit("eigh", "float64", 3, 1, a.data_ptr(), None, a.data_ptr() + 72, None,
                      in2=x.data_ptr())
        with pytest.raises(ValueError, match="soap_rotate \\(6\\)"):
            rt.submit("rotate", "float64", 3, 1, x.data_ptr(), None, out.data_ptr(), None)
        t = rt.submit(6, "float64", 3, 1, x.data_ptr(), a.data_ptr(), out.data_ptr(), None,
                      n1=2)
        assert rt.wait(t, None).status == 0
        for h in hs:
            rt.unregister(h)
    finally:
        rt.close()


@pytest.mark.parametrize("shadow", [False, "host"])
def test_inputs_given_as_parts_equal_the_stacked_inputs(shadow):
    """f and q as lists of blocks: the job sees them stacked (through one shadow ring slot each,
    or one private buffer), with exactly the stacked inputs' result; no stack is made first."""
    e = HostPoolEngine({"workers": 1, "pin": False}, shadow=shadow)
    try:
        f, q = sym(3, 24, torch.float32, seed=7), basis(3, 24, torch.float32, seed=8)
        whole = submit_wait(e, "soap_qr", f, q)
        before = e.stats()
        t = e.submit("soap_qr", list(f.unbind(0)), list(q.unbind(0)), **ids())
        f.zero_()  # snapshotted at submit: later writes do not reach the job
        q.zero_()
        res = e.wait(t)
        assert res.status == 0
        for a, b in zip(res.outputs, whole.outputs):
            assert torch.equal(a, b)
        after = e.stats()
        assert after["inputs_donated"] == before["inputs_donated"]
        assert after["bytes_d2h_snapshots"] - before["bytes_d2h_snapshots"] == 2 * 3 * 24 * 24 * 4
        if shadow:
            assert after["snapshots_shadow"] - before["snapshots_shadow"] == 2
            assert after["snapshots_fallback"] == before["snapshots_fallback"]
    finally:
        e.close()


def test_parts_fall_back_to_a_private_stack_when_the_ring_is_too_small():
    e = HostPoolEngine({"workers": 1, "pin": False}, shadow="host", snapshot_ring_bytes=4096)
    try:
        f, q = sym(2, 32, torch.float64, seed=3), basis(2, 32, torch.float64, seed=4)
        ref = submit_wait(e, "soap_qr", f.clone(), q.clone())
        before = e.stats()
        res = submit_wait(e, "soap_qr", [f[0], f[1]], (q[0], q[1]))
        assert torch.equal(res.outputs[0], ref.outputs[0])
        assert torch.equal(res.outputs[1], ref.outputs[1])
        after = e.stats()
        assert after["snapshots_fallback"] - before["snapshots_fallback"] == 2
        assert after["snapshots_shadow"] == before["snapshots_shadow"]
    finally:
        e.close()


def test_bad_parts_are_rejected(eng1):
    f = sym(1, 8)[0]
    with pytest.raises(ValueError, match="at least one tensor"):
        eng1.submit("eigh", [], **ids())
    with pytest.raises(ValueError, match="part 1 is .*9, 9"):
        eng1.submit("eigh", [f, sym(1, 9)[0]], **ids())
    with pytest.raises(ValueError, match="part 1 is .*float32"):
        eng1.submit("eigh", [f, f.float()], **ids())
    with pytest.raises(ValueError, match="part 1 is str"):
        eng1.submit("eigh", (f, "f"), **ids())
    with pytest.raises(ValueError, match="needs a basis Q with the shape of F"):
        eng1.submit("soap_qr", [f, f], [f], **ids())
    assert eng1.stats()["jobs_submitted"] == 0
