"""asteria._C, the CPython binding of libasteria's runtime: config pass-through and its errors,
the AST_E* -> exception mapping, buffer registration, every REFRESH op against numpy, the GIL
released in wait, stats, close, module re-import, reference counts.

Buffers are numpy arrays (row-major, as linalg.h wants); addresses are passed as ints."""

import errno
import gc
import importlib
import importlib.util
import pathlib
import pickle
import re
import sys
import threading
import time

import numpy as np
import pytest

from asteria import _C
from job_delay import set_job_delay
from tolerance import rounding_tol

NP = {"float32": np.float32, "float64": np.float64}


@pytest.fixture
def rt():
    r = _C.Runtime({"workers": 2, "pin": False})
    yield r
    r.close()


@pytest.fixture
def rt1():
    """One worker: jobs run strictly one after another (queue tests)."""
    r = _C.Runtime({"workers": 1, "pin": False})
    yield r
    r.close()


def sym(rng, batch, n, dtype="float64", eigs=None):
    """Symmetric (batch, n, n) matrices with well separated eigenvalues (default 1..n)."""
    out = np.empty((batch, n, n), dtype=np.float64)
    lam = np.arange(n, 0, -1, dtype=np.float64) if eigs is None else np.asarray(eigs, float)
    for b in range(batch):
        u, _ = np.linalg.qr(rng.standard_normal((n, n)))
        out[b] = (u * lam) @ u.T
    return np.ascontiguousarray(out.astype(NP[dtype]))


def register(rt, *arrays):
    return [rt.register(a.ctypes.data, a.nbytes) for a in arrays]


def addr(a):
    return None if a is None else a.ctypes.data


def run(rt, op, dtype, f, q=None, out0=None, out1=None, **kw):
    """Register, submit, wait, unregister; returns the Result."""
    batch, n = f.shape[0], f.shape[1]
    arrays = [a for a in (f, q, out0, out1) if a is not None]
    handles = register(rt, *arrays)
    kw.setdefault("block", 1)
    kw.setdefault("version", 1)
    t = rt.submit(op, dtype, n, batch, addr(f), addr(q), addr(out0), addr(out1), **kw)
    res = rt.wait(t)
    for h in handles:
        rt.unregister(h)
    return res


def sign_align(q, ref):
    """q with each column's sign flipped to match ref (eigen/QR bases are defined up to sign)."""
    s = np.sign(np.einsum("...ij,...ij->...j", q, ref))
    s[s == 0] = 1
    return q * s[..., None, :]


def eig_tol(f):
    """Eigenvalues of f (float64) from two LAPACKs: each within n eps ||F|| (absolute)."""
    return rounding_tol("float64", n=f.shape[-1]) * float(np.abs(np.linalg.eigvalsh(f[0])).max())


def long_job(rt, block=1000, batch=8, n=512, delay_ms=1000):
    """Submit an eigh job that keeps one worker busy for a while: it sleeps ``delay_ms`` first
    (the test-only job delay, job_delay.py: jobs submitted after it do not), so it is still
    running ``delay_ms`` after its start whatever the machine's speed or load. Returns
    (ticket, keep-alive)."""
    rng = np.random.default_rng(7)
    f = rng.standard_normal((batch, n, n))
    f = np.ascontiguousarray(f + f.transpose(0, 2, 1))
    q = np.zeros_like(f)
    w = np.zeros((batch, n))
    handles = register(rt, f, q, w)
    set_job_delay(rt, delay_ms)
    t = rt.submit("eigh", "float64", n, batch, addr(f), None, addr(q), addr(w), block=block,
                  version=1)
    set_job_delay(rt, 0)
    return t, (f, q, w, handles)


def wait_running(rt, count=1, timeout=10.0):
    t0 = time.monotonic()
    while rt.stats()["jobs_running"] < count:
        assert time.monotonic() - t0 < timeout, "job never started"
        time.sleep(0.001)


# ---- config ----------------------------------------------------------------------------------


def test_config_keys_and_defaults():
    # only the keys libasteria reads; the optimizer's keys are asteria.RuntimeConfig's
    # (tests/python/test_config.py)
    keys = _C.config_keys()
    assert keys == ("workers", "cpuset", "pin", "trace")
    d = _C.default_config()
    assert set(d) == set(keys)
    assert d["workers"] is None and d["pin"] is True and d["cpuset"] is None
    assert d["trace"] is None


def test_config_pass_through(tmp_path):
    cfg = {"workers": 1, "pin": False, "cpuset": None, "trace": None}
    with _C.Runtime(cfg) as r:
        c = r.config
        assert c["workers"] == 1 and c["pin"] is False
        assert c["cpuset"] is None and c["trace"] is None
        assert r.stats()["workers"] == 1
        # The effective config is itself a valid config: it round-trips.
        with _C.Runtime(c) as r2:
            assert r2.config == c
    valid = _C.validate_config(cfg)
    assert isinstance(valid, _C.Config) and valid.as_dict() == c
    # A Config is taken as it is (validated once, when it was made), and pickles as a config
    # that is validated again where it is read back.
    with _C.Runtime(valid) as r3:
        assert r3.config == c
    assert pickle.loads(pickle.dumps(valid)) == valid
    with pytest.raises(TypeError):
        _C.Config()
    traced = _C.validate_config({"trace": str(tmp_path / "t.json"), "workers": 1, "pin": False})
    assert traced.as_dict()["trace"] == str(tmp_path / "t.json")


def test_config_bool_and_str_conversion():
    class Two:
        def __str__(self):
            return "2"

    with _C.Runtime({"workers": Two(), "pin": True}) as r:
        assert r.config["workers"] == 2 and r.config["pin"] is True
    assert _C.validate_config({"workers": "3"}).as_dict()["workers"] == 3
    with pytest.raises(ValueError, match="'workers'"):  # a bool is not a worker count
        _C.validate_config({"workers": True})


def test_unknown_key_names_key_and_allowed_keys():
    with pytest.raises(ValueError) as ei:
        _C.Runtime({"workers": 1, "bogus_key": 1})
    msg = str(ei.value)
    assert "'bogus_key'" in msg
    for key in _C.config_keys():
        assert key in msg
    assert ei.value.code == _C.AST_EINVAL == -1
    assert ei.value.name == "AST_EINVAL"
    with pytest.raises(ValueError, match="bogus_key"):
        _C.validate_config({"bogus_key": 0})
    with pytest.raises(ValueError, match="'staleness'"):  # the optimizer's key, not C's
        _C.validate_config({"staleness": 3})
    # the optimizer's schedule counts consecutive failures; libasteria keeps no streak
    with pytest.raises(ValueError, match="unknown runtime key 'max_failures'"):
        _C.validate_config({"max_failures": 3})


@pytest.mark.parametrize("key,value,allowed", [
    ("workers", 0, ["1..1024"]),
    ("workers", 1.5, ["1..1024"]),
    ("pin", "maybe", ["true", "false"]),
    ("trace", "/", ["a file path", "directory"]),
    ("trace", "/nonexistent-asteria/t.json", ["in an existing directory"]),
])
def test_bad_value_names_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ValueError) as ei:
        _C.Runtime({key: value})
    msg = str(ei.value)
    assert f"'{key}'" in msg
    for a in allowed:
        assert a in msg
    assert ei.value.code == _C.AST_EINVAL


def test_config_type_errors():
    with pytest.raises(TypeError):
        _C.Runtime([("workers", 1)])
    with pytest.raises(TypeError):
        _C.Runtime({1: 2})
    with pytest.raises(ValueError, match="null"):
        _C.Runtime({"trace": "a\0b"})


def test_config_refcounts_unchanged(tmp_path):
    value = object.__new__(type("V", (), {"__str__": lambda self: "2"}))
    path = str(tmp_path / "trace.json")  # a fresh str object
    cfg = {"workers": value, "pin": False, "cpuset": None, "trace": path}
    before = (sys.getrefcount(cfg), sys.getrefcount(value), sys.getrefcount(path))
    for _ in range(20):
        r = _C.Runtime(cfg)
        r.close()
        with pytest.raises(ValueError):
            _C.Runtime({**cfg, "pin": "bad"})
        _C.validate_config(cfg)
    del r
    gc.collect()
    after = (sys.getrefcount(cfg), sys.getrefcount(value), sys.getrefcount(path))
    assert after == before


# ---- errors ------------------------------------------------------------------------------------


def test_error_table_constants():
    assert _C.AST_OK == 0
    assert _C.AST_ENONFINITE == -8
    assert _C.AST_ERANGE == -21
    assert _C.AST_EINTR == -22
    assert len(_C.errorcode) == 22
    assert all(_C.err_name(code) == name for code, name in _C.errorcode.items())
    assert all(getattr(_C, name) == code for code, name in _C.errorcode.items())
    assert _C.err_name(-8) == "AST_ENONFINITE"
    assert "non-finite" in _C.strerror(-8)
    assert _C.err_name(12345) == "AST_EUNKNOWN"
    assert _C.strerror(1 << 40) == "unknown error"
    assert _C.OPS == {"eigh": 1, "inv_root": 2, "newton_root": 3, "soap_qr": 4, "kl_qr": 5,
                      "soap_rotate": 6, "gram_ema": 7}
    assert (_C.AST_OP_EIGH, _C.AST_OP_KL_QR) == (1, 5)


ERRORS_H = pathlib.Path(__file__).resolve().parents[2] / "include" / "asteria" / "errors.h"


def test_every_error_code_is_exported_from_the_c_table():
    """_C's AST_E* constants are exactly libasteria's error table: every entry of AST_ERRNO_MAP
    in include/asteria/errors.h (a code added there and not exported fails here), with the name
    and message ast_err_name / ast_strerror give it, and nothing else."""
    header = {f"AST_{name}": (int(val), msg) for name, val, msg in re.findall(
        r'X\((E\w+),\s*(-?\d+),\s*"([^"]*)"\)', ERRORS_H.read_text())}
    assert len(header) >= 22, f"AST_ERRNO_MAP not found in {ERRORS_H}"
    exported = {name: getattr(_C, name) for name in dir(_C) if name.startswith("AST_E")}
    assert exported == {name: code for name, (code, _) in header.items()}
    assert _C.errorcode == {code: name for name, (code, _) in header.items()}
    for name, (code, msg) in header.items():
        assert _C.err_name(code) == name and _C.strerror(code) == msg
    # and C knows no code the header lacks
    named = {_C.err_name(c) for c in range(-1, -1000, -1)} - {"AST_EUNKNOWN"}
    assert named == set(header)


OS_ERRNO = {"AST_ETIMEDOUT": errno.ETIMEDOUT, "AST_ENOSPC": errno.ENOSPC,
            "AST_EIO": errno.EIO, "AST_EACCES": errno.EACCES, "AST_ENOENT": errno.ENOENT}
EXPECTED_TYPE = {"AST_EINVAL": ValueError, "AST_ENOMEM": MemoryError,
                 "AST_ETIMEDOUT": TimeoutError, "AST_ENOSPC": OSError, "AST_EIO": OSError,
                 "AST_EACCES": PermissionError, "AST_ENOENT": FileNotFoundError}


@pytest.mark.parametrize("code", sorted(_C.errorcode, reverse=True))
def test_error_mapping(code):
    name = _C.errorcode[code]
    with pytest.raises(Exception) as ei:
        _C.raise_error(code, "some detail")
    exc = ei.value
    expected = EXPECTED_TYPE.get(name, _C.AsteriaError)
    assert type(exc) is expected
    assert exc.code == code and exc.name == name
    assert name in str(exc) and _C.strerror(code) in str(exc) and "some detail" in str(exc)
    if name in OS_ERRNO:
        assert exc.errno == OS_ERRNO[name]
    if expected is _C.AsteriaError:
        assert isinstance(exc, RuntimeError)


def test_unregistered_pointer_is_erange(rt):
    f = sym(np.random.default_rng(0), 1, 4)
    q = np.zeros_like(f)
    with pytest.raises(_C.AsteriaError) as ei:
        rt.submit("eigh", "float64", 4, 1, addr(f), None, addr(q), None)
    assert ei.value.code == _C.AST_ERANGE == -21
    assert ei.value.name == "AST_ERANGE"
    assert "in0" in str(ei.value) and "not inside a registered buffer" in str(ei.value)
    # An output buffer that is registered but one row too short is out of range too.
    small = np.zeros((4 * 4 - 1,))
    register(rt, f, small)
    with pytest.raises(_C.AsteriaError, match="out0") as ei:
        rt.submit("eigh", "float64", 4, 1, addr(f), None, addr(small), None)
    assert ei.value.code == _C.AST_ERANGE
    assert rt.last_error().startswith("AST_ERANGE")


def test_bad_submit_arguments(rt):
    f = sym(np.random.default_rng(0), 1, 4)
    x = np.zeros_like(f)
    register(rt, f, x)
    with pytest.raises(ValueError, match="kl_qr"):
        rt.submit("bogus", "float64", 4, 1, addr(f), None, addr(x), None)
    with pytest.raises(ValueError, match="float32"):
        rt.submit("eigh", "float16", 4, 1, addr(f), None, addr(x), None)
    with pytest.raises(ValueError, match="p > 0") as ei:
        rt.submit("inv_root", "float64", 4, 1, addr(f), None, addr(x), None, p=0.0)
    assert ei.value.code == _C.AST_EINVAL
    with pytest.raises(ValueError, match="in1"):  # soap_qr needs a basis
        rt.submit(_C.AST_OP_KL_QR, "float64", 4, 1, addr(f), None, addr(x), None)
    with pytest.raises(OverflowError):
        rt.submit("eigh", "float64", 4, 1, -1, None, addr(x), None)
    assert rt.stats()["jobs_submitted"] == 0


# ---- buffers ------------------------------------------------------------------------------------


def test_register_unregister(rt):
    a = np.zeros(1000)
    b = np.zeros(24, dtype=np.float32)
    base = rt.stats()["bytes_registered"]
    ha, hb = register(rt, a, b)
    assert ha != hb and ha > 0 and hb > 0
    assert rt.stats()["bytes_registered"] == base + 8000 + 96
    rt.unregister(ha)
    assert rt.stats()["bytes_registered"] == base + 96
    with pytest.raises(FileNotFoundError) as ei:
        rt.unregister(ha)
    assert ei.value.code == _C.AST_ENOENT and str(ha) in str(ei.value)
    rt.unregister(hb)
    assert rt.stats()["bytes_registered"] == base
    with pytest.raises(ValueError):
        rt.register(0, 8)
    with pytest.raises(OverflowError):
        rt.register(a.ctypes.data, -1)


def test_unregister_busy_until_collected(rt):
    f = sym(np.random.default_rng(1), 2, 8)
    q, w = np.zeros_like(f), np.zeros((2, 8))
    hf, hq, hw = register(rt, f, q, w)
    t = rt.submit("eigh", "float64", 8, 2, addr(f), None, addr(q), addr(w), block=3, version=1)
    # The job holds its buffers until its completion is collected, whether it ran or not.
    with pytest.raises(_C.AsteriaError) as ei:
        rt.unregister(hf)
    assert ei.value.code == _C.AST_EBUSY
    assert rt.wait(t).status == 0
    for h in (hf, hq, hw):
        rt.unregister(h)
    assert rt.stats()["bytes_registered"] == 0


# ---- ops vs numpy ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_eigh_descending(rt, dtype):
    rng = np.random.default_rng(2)
    batch, n = 3, 16
    f = sym(rng, batch, n, dtype)
    q, w = np.zeros_like(f), np.zeros((batch, n), dtype=NP[dtype])
    res = run(rt, "eigh", dtype, f, out0=q, out1=w, block=5, version=2, snapshot_step=40)
    assert (res.status, res.block, res.version, res.snapshot_step) == (0, 5, 2, 40)
    assert res.failed_index == -1 and res.worker in (0, 1)
    assert res.queued_ns <= res.started_ns <= res.done_ns
    wr, qr = np.linalg.eigh(f.astype(np.float64))
    wr, qr = wr[:, ::-1], qr[:, :, ::-1]
    assert np.all(np.diff(w, axis=1) < 0)
    tol = rounding_tol(dtype, n=n, cond=n)  # eigh in dtype: n eps ||F|| / gap, eigenvalues n..1
    np.testing.assert_allclose(w, wr, rtol=tol, atol=tol)
    np.testing.assert_allclose(sign_align(q, qr), qr, atol=tol)
    # Eigenvalues only (out1 alone is not allowed: Q is required, w optional).
    q2 = np.zeros_like(f)
    assert run(rt, "eigh", dtype, f, out0=q2, block=6).status == 0
    np.testing.assert_allclose(sign_align(q2, qr), qr, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("p", [2.0, 4.0])
def test_inv_root(rt, dtype, p):
    rng = np.random.default_rng(3)
    n, eps = 12, 1e-3
    # One negative eigenvalue: clamped at 0 before eps is added.
    eigs = np.concatenate([np.linspace(5.0, 0.5, n - 1), [-0.25]])
    f = sym(rng, 2, n, dtype, eigs=eigs)
    x = np.zeros_like(f)
    assert run(rt, "inv_root", dtype, f, out0=x, p=p, eps=eps).status == 0
    wl, v = np.linalg.eigh(f.astype(np.float64))
    floor = n * np.finfo(NP[dtype]).eps * wl.max(axis=1, keepdims=True)  # the op's (linalg.c)
    ref = (v * (np.maximum(wl, floor) + eps)[:, None, :] ** (-1.0 / p)) @ v.transpose(0, 2, 1)
    # eigenvectors off by n eps ||F|| / gap (5 / 0.45), scaled by the largest root eps^(-1/p)
    tol = rounding_tol(dtype, n=n, cond=11 * eps ** (-1 / p))
    np.testing.assert_allclose(x, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_newton_root(rt, dtype):
    rng = np.random.default_rng(4)
    n, eps, p = 10, 1e-6, 4
    f = sym(rng, 2, n, dtype, eigs=np.linspace(3.0, 1.0, n))
    x = np.zeros_like(f)
    assert run(rt, "newton_root", dtype, f, out0=x, p=p, eps=eps).status == 0
    wl, v = np.linalg.eigh(f.astype(np.float64))
    ref = (v * (wl + eps)[:, None, :] ** (-1.0 / p)) @ v.transpose(0, 2, 1)
    # not rounding: the iteration stops at NEWTON_TOL = 1e-6 (src/op_table.c), times cond 3
    np.testing.assert_allclose(x, ref, rtol=1e-4, atol=1e-4)


def ref_soap_qr(f, q):
    est = np.einsum("bij,bik,bkj->bj", q, f, q)
    perm = np.argsort(-est, axis=1, kind="stable")
    qs = np.take_along_axis(q, perm[:, None, :], axis=2)
    return np.linalg.qr(f @ qs)[0], perm


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_soap_qr(rt, dtype):
    rng = np.random.default_rng(5)
    batch, n = 3, 14
    f = sym(rng, batch, n, "float64")
    q0 = np.stack([np.linalg.qr(rng.standard_normal((n, n)))[0] for _ in range(batch)])
    f, q0 = f.astype(NP[dtype]), np.ascontiguousarray(q0.astype(NP[dtype]))
    qn = np.zeros_like(f)
    perm = np.full((batch, n), -1, dtype=np.int64)
    assert run(rt, "soap_qr", dtype, f, q=q0, out0=qn, out1=perm).status == 0
    qref, pref = ref_soap_qr(f.astype(np.float64), q0.astype(np.float64))
    np.testing.assert_array_equal(perm, pref)
    tol = rounding_tol(dtype, n=n, cond=n)  # QR of F Q in dtype: n eps cond(F), eigenvalues n..1
    np.testing.assert_allclose(sign_align(qn, qref), qref, atol=tol)
    # Q_new is orthonormal: n eps from the QR, n eps more from the product Q^T Q
    eye = np.broadcast_to(np.eye(n), (batch, n, n))
    np.testing.assert_allclose(qn.transpose(0, 2, 1) @ qn, eye,
                               atol=rounding_tol(dtype, n=n, steps=2))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kl_qr(rt, dtype):
    rng = np.random.default_rng(6)
    batch, n = 2, 9
    f = sym(rng, batch, n, dtype)
    q0 = np.ascontiguousarray(
        np.stack([np.linalg.qr(rng.standard_normal((n, n)))[0] for _ in range(batch)])
        .astype(NP[dtype]))
    qn = np.zeros_like(f)
    assert run(rt, "kl_qr", dtype, f, q=q0, out0=qn).status == 0
    qref = np.linalg.qr(f.astype(np.float64) @ q0.astype(np.float64))[0]
    tol = rounding_tol(dtype, n=n, cond=n)  # QR of F Q in dtype: n eps cond(F), eigenvalues n..1
    np.testing.assert_allclose(sign_align(qn, qref), qref, atol=tol)


def test_nonfinite_input_keeps_outputs(rt):
    rng = np.random.default_rng(8)
    f = sym(rng, 3, 6)
    f[1, 2, 3] = np.nan
    x = np.full_like(f, 7.0)
    res = run(rt, "inv_root", "float64", f, out0=x, p=2.0, eps=1e-6, block=11)
    assert res.status == _C.AST_ENONFINITE
    assert res.failed_index == 1
    # Blocks from the failing one on are untouched; the one before it was written.
    assert np.all(x[1:] == 7.0)
    assert not np.any(x[0] == 7.0)
    s = rt.stats()
    assert s["jobs_failed"] == 1 and s["jobs_done"] == 1


def test_repeated_failures_keep_their_own_status():
    """libasteria keeps no failure streak (the optimizer's schedule counts one): a block that
    fails again and again reports its own status every time, never AST_EFAILED."""
    with _C.Runtime({"workers": 1, "pin": False}) as r:
        f = np.full((1, 4, 4), np.inf)
        x = np.zeros_like(f)
        statuses = [run(r, "inv_root", "float64", f, out0=x, p=2.0, block=9, version=v).status
                    for v in range(1, 6)]
        assert statuses == [_C.AST_ENONFINITE] * 5
        assert np.all(x == 0.0)
        assert "AST_EFAILED" not in r.last_error()
        assert r.stats()["jobs_failed"] == 5


# ---- poll, wait, cancel ------------------------------------------------------------------------


def test_poll_collects_all(rt):
    rng = np.random.default_rng(9)
    jobs, keep = {}, []
    for b in range(6):
        f = sym(rng, 1, 8)
        q, w = np.zeros_like(f), np.zeros((1, 8))
        keep.append((f, q, w, register(rt, f, q, w)))
        t = rt.submit("eigh", "float64", 8, 1, addr(f), None, addr(q), addr(w), block=b,
                      version=1, deadline=b, snapshot_step=100 + b)
        jobs[t] = b
    got = {}
    t0 = time.monotonic()
    while len(got) < len(jobs):
        assert time.monotonic() - t0 < 30
        for r in rt.poll():
            got[r.ticket] = r
        time.sleep(0.001)
    assert rt.poll() == []
    for t, r in got.items():
        assert isinstance(r, _C.Result) and isinstance(r, tuple) and len(r) == 11
        assert r.status == 0 and r.block == jobs[t] and r.snapshot_step == 100 + jobs[t]
        assert r[0] == t
    for f, q, w, _ in keep:
        tol = rounding_tol("float64", n=8, cond=8)  # eigenvalues 8..1 to n eps ||F||
        np.testing.assert_allclose(w[0], np.linalg.eigvalsh(f[0])[::-1], atol=tol)
    # A collected ticket cannot be waited for again.
    with pytest.raises(FileNotFoundError) as ei:
        rt.wait(next(iter(jobs)))
    assert ei.value.code == _C.AST_ENOENT


def test_wait_timeout_then_result(rt1):
    t, keep = long_job(rt1)
    with pytest.raises(TimeoutError) as ei:
        rt1.wait(t, timeout=0.0)
    assert ei.value.code == _C.AST_ETIMEDOUT and ei.value.errno == errno.ETIMEDOUT
    res = rt1.wait(t, timeout=60.0)
    assert res.status == 0
    f, q, w, _ = keep
    np.testing.assert_allclose(w[0], np.linalg.eigvalsh(f[0])[::-1], rtol=0, atol=eig_tol(f))
    with pytest.raises(ValueError):
        rt1.wait(t, timeout=-1.0)


def test_wait_releases_gil(rt1):
    t, keep = long_job(rt1, batch=8)  # sleeps 1 s once started
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    try:
        wait_running(rt1)
        t0 = time.perf_counter()
        c0 = count[0]
        res = rt1.wait(t)
        c1 = count[0]
        waited = time.perf_counter() - t0
    finally:
        stop.set()
        th.join()
    assert res.status == 0
    # With the GIL held through the wait the spinning thread could not run at all.
    assert c1 - c0 > 1000, (c1 - c0, waited)
    # the runtime's own count of that wait: most of the job's 1 s sleep (the wait began as
    # soon as the job was seen running), and within the call as timed here
    s = rt1.stats()
    assert s["barrier_waits"] == 1 and 0.5e9 <= s["barrier_wait_ns"] <= waited * 1e9, (s, waited)


def test_cancel_queued_not_running(rt1):
    t_long, keep = long_job(rt1)
    f = sym(np.random.default_rng(10), 1, 8)
    q, w = np.zeros_like(f), np.full((1, 8), 3.0)
    register(rt1, f, q, w)
    t2 = rt1.submit("eigh", "float64", 8, 1, addr(f), None, addr(q), addr(w), block=2, version=1)
    wait_running(rt1)
    assert rt1.cancel(t2) is True
    assert rt1.cancel(t2) is False  # no longer queued
    assert rt1.cancel(t_long) is False  # running
    assert rt1.cancel(123456) is False  # unknown
    r2 = rt1.wait(t2)
    assert r2.status == _C.AST_ECANCELED and r2.started_ns == 0 and r2.worker == -1
    assert np.all(w == 3.0)
    assert rt1.wait(t_long).status == 0
    s = rt1.stats()
    assert s["jobs_cancelled"] == 1 and s["jobs_done"] == 1 and s["jobs_submitted"] == 2


def test_newer_version_supersedes_queued(rt1):
    t_long, keep = long_job(rt1)
    f = sym(np.random.default_rng(11), 1, 8)
    x1, x2 = np.zeros_like(f), np.zeros_like(f)
    register(rt1, f, x1, x2)
    t1 = rt1.submit("inv_root", "float64", 8, 1, addr(f), None, addr(x1), None, p=2.0, block=4,
                    version=1)
    t2 = rt1.submit("inv_root", "float64", 8, 1, addr(f), None, addr(x2), None, p=2.0, block=4,
                    version=2)
    assert rt1.wait(t1).status == _C.AST_ESUPERSEDED
    r2 = rt1.wait(t2)
    assert r2.status == 0 and r2.version == 2
    assert np.all(x1 == 0.0) and not np.all(x2 == 0.0)
    rt1.wait(t_long)
    assert rt1.stats()["jobs_superseded"] == 1


# ---- stats, close ------------------------------------------------------------------------------


def test_stats_counters_move(rt):
    s0 = rt.stats()
    assert set(s0) == {
        "jobs_submitted", "jobs_queued", "jobs_running", "jobs_done", "jobs_failed",
        "jobs_superseded", "jobs_cancelled", "jobs_retried_f64", "nonfinite_skipped",
        "installs", "max_install_lag", "last_installed_version_step", "barrier_waits",
        "barrier_wait_ns", "worker_busy_ns", "bytes_registered", "workers"}
    assert s0["workers"] == 2 and s0["jobs_submitted"] == 0 and s0["installs"] == 0
    f = sym(np.random.default_rng(12), 2, 32)
    x = np.zeros_like(f)
    assert run(rt, "inv_root", "float64", f, out0=x, p=2.0, eps=1e-8).status == 0
    rt.note_install(3, 5)
    rt.note_install(10, 11)
    rt.note_nonfinite()
    s = rt.stats()
    assert s["jobs_submitted"] == 1 and s["jobs_done"] == 1 and s["jobs_failed"] == 0
    assert s["installs"] == 2 and s["max_install_lag"] == 2
    assert s["last_installed_version_step"] == 11
    assert s["nonfinite_skipped"] == 1
    assert s["worker_busy_ns"] > 0
    assert s["jobs_queued"] == 0 and s["jobs_running"] == 0


def test_close_idempotent_and_final():
    r = _C.Runtime({"workers": 1, "pin": False})
    assert not r.closed and "workers=1" in repr(r)
    r.close()
    r.close()
    assert r.closed and "closed" in repr(r)
    for call in (r.stats, r.poll, r.note_nonfinite, r.last_error, lambda: r.config,
                 lambda: r.register(1, 1), lambda: r.wait(1), lambda: r.cancel(1)):
        with pytest.raises(_C.AsteriaError) as ei:
            call()
        assert ei.value.code == _C.AST_ESHUTDOWN
    with _C.Runtime({"workers": 1, "pin": False}) as r2:
        pass
    assert r2.closed


def test_close_waits_for_running_job():
    r = _C.Runtime({"workers": 1, "pin": False})
    t, (f, q, w, _) = long_job(r)
    g = sym(np.random.default_rng(13), 1, 8)
    x = np.full_like(g, 5.0)
    register(r, g, x)
    r.submit("inv_root", "float64", 8, 1, addr(g), None, addr(x), None, p=2.0, block=2,
             version=1)
    wait_running(r)
    r.close()
    # The running job finished before close returned; the queued one was dropped unrun.
    np.testing.assert_allclose(w[0], np.linalg.eigvalsh(f[0])[::-1], rtol=0, atol=eig_tol(f))
    assert np.all(x == 5.0)


def test_close_from_other_thread_waits_for_wait():
    r = _C.Runtime({"workers": 1, "pin": False})
    t, keep = long_job(r)
    out = {}

    def waiter():
        out["res"] = r.wait(t)

    th = threading.Thread(target=waiter)
    th.start()
    wait_running(r)
    time.sleep(0.3)  # the waiter is in r.wait by now: the job sleeps 1 s from its start
    r.close()  # must not free the runtime under the waiting thread
    th.join(60)
    assert not th.is_alive()
    assert out["res"].status == 0


def test_dealloc_without_close():
    r = _C.Runtime({"workers": 1, "pin": False})
    t, keep = long_job(r, batch=2)
    wait_running(r)  # a queued job would be dropped; a running one is finished first
    del r
    gc.collect()
    f, q, w, _ = keep
    np.testing.assert_allclose(w[0], np.linalg.eigvalsh(f[0])[::-1], rtol=0, atol=eig_tol(f))


# ---- module ------------------------------------------------------------------------------------


def test_reload_and_second_instance():
    mod = importlib.reload(_C)
    assert mod is _C
    with _C.Runtime({"workers": 1, "pin": False}) as r:
        f = sym(np.random.default_rng(14), 1, 5)
        x = np.zeros_like(f)
        assert run(r, "inv_root", "float64", f, out0=x, p=2.0).status == 0
    # Multi-phase init: a second, independent module object with its own types and exception.
    spec = importlib.util.find_spec("asteria._C")
    m2 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m2)
    assert m2 is not _C and m2.Runtime is not _C.Runtime
    assert m2.AsteriaError is not _C.AsteriaError
    with m2.Runtime({"workers": 1, "pin": False}) as r2:
        with pytest.raises(m2.AsteriaError) as ei:
            r2.submit("eigh", "float64", 4, 1, 4096, None, 8192, None)
        assert not isinstance(ei.value, _C.AsteriaError)
        assert ei.value.code == m2.AST_ERANGE
    assert m2.err_name(-8) == "AST_ENONFINITE"
    del m2, r2, ei
    gc.collect()
    assert _C.err_name(-21) == "AST_ERANGE"
