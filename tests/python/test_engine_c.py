"""CEngine (asteria/engine_c.py): every REFRESH op against plain torch.linalg restatements of
engine.py's table, batched and overlapping jobs, snapshots, dtypes, failures, cancel, stats."""

import time
import types

import pytest
import torch

from asteria import _C
from asteria.engine import Result
from asteria.engine_c import CEngine, c_config

TOL = {torch.float64: 1e-10, torch.float32: 2e-4}


@pytest.fixture
def eng():
    e = CEngine({"workers": 2, "pin": False})
    yield e
    e.close()


@pytest.fixture
def eng1():
    e = CEngine({"workers": 1, "pin": False})
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
    w, q = torch.linalg.eigh(f.double())
    return (q * (w.clamp(min=0) + eps).pow(-1.0 / p).unsqueeze(-2)) @ q.transpose(-1, -2)


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
    tol = TOL[dtype] * 10
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
    tol = TOL[dtype] * 100
    torch.testing.assert_close(x.double(), ref, rtol=tol, atol=tol)


def test_newton_root(eng):
    f = sym(2, 12, torch.float64, seed=4, eigs=torch.linspace(2.0, 1.0, 12))
    res = submit_wait(eng, "newton_root", f, p=2, eps=1e-8)
    assert res.status == 0
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
    tol = TOL[dtype] * 20
    torch.testing.assert_close(sign_align(qn.double(), qref), qref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kl_qr(eng, dtype):
    f, q0 = sym(2, 18, dtype, seed=7), basis(2, 18, dtype, seed=8)
    res = submit_wait(eng, "kl_qr", f, q0)
    assert res.status == 0
    qref = torch.linalg.qr(f.double() @ q0.double()).Q
    tol = TOL[dtype] * 20
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
    torch.testing.assert_close(w.double(), wr, rtol=2e-2, atol=5e-2)


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
    torch.testing.assert_close(res.outputs[0], expected, rtol=1e-10, atol=1e-10)


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
        torch.testing.assert_close(res.outputs[1], ref_eigh(m)[1], rtol=1e-10, atol=1e-10)
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
    t_long = eng1.submit("eigh", big, **ids())
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
    torch.testing.assert_close(res.outputs[1], ref_eigh(big)[1], rtol=1e-9, atol=1e-9)
    s = eng1.stats()
    assert s["jobs_cancelled"] == 1 and s["jobs_done"] == 1 and s["bytes_registered"] == 0


def test_wait_timeout_keeps_ticket(eng1):
    big = sym(8, 384, torch.float64, seed=42)
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
    e = CEngine({"workers": 1, "pin": False})
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
                                nvme_dir=None, trace=None)
    d = c_config(cfg)
    assert d["workers"] is None and d["staleness"] == 3
    e = CEngine(cfg)
    try:
        c = e.runtime.config
        assert c["staleness"] == 3 and c["install"] == "eager" and c["workers"] is None
        assert c["placement"] == "factors=device,roots=host_pinned"
        assert c["host_budget_bytes"] == 1 << 30
        assert e.stats()["workers"] >= 1  # None: the cores the training thread does not use
    finally:
        e.close()
    with pytest.raises(ValueError, match="'install'"):
        CEngine(types.SimpleNamespace(install="later"))


def test_runtime_config_dataclass():
    from asteria.config import RuntimeConfig

    e = CEngine(RuntimeConfig(workers=2, staleness=4, pin=False))
    try:
        assert e.runtime.config["workers"] == 2 and e.runtime.config["staleness"] == 4
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
