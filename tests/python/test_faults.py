"""Faults real training scripts run into, for SOAP, Shampoo and KL-Shampoo:

- the cycle collector switched off (OLMo-core's training policy): ``del opt`` frees the
  optimizer, its worker threads and buffers by reference counting alone;
- runtime values that cannot work raise ValueError naming their key at construction;
- a factor that overflowed: after ``max_failures`` failed refreshes of one block in a row the
  step raises naming the parameter and the cause, in both modes (``on_failure="keep"`` keeps
  the previous preconditioner with a warning); KL-Shampoo never turns finite gradients into
  non-finite parameters.
"""

import gc
import os
import warnings
import weakref

import pytest
import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from models import require_c_extension

torch.set_num_threads(1)

CLASSES = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
MODES = {"sync": {"mode": "sync"},
         "async": {"mode": "async", "staleness": 1, "workers": 1}}


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


# ---- 3. no reference cycle ----------------------------------------------------------------------

@pytest.mark.parametrize("runtime", [
    {"mode": "async", "staleness": 2, "workers": 2},
    {"mode": "async", "staleness": 2, "workers": 1,
     "placement": {"roots": "host", "eigenbases": "host"}},
    "nvme",
])
@pytest.mark.parametrize("name", CLASSES)
def test_optimizer_is_freed_with_the_cycle_collector_off(name, runtime, tmp_path):
    if runtime == "nvme":
        runtime = {"mode": "async", "staleness": 2, "workers": 1, "host_budget_bytes": 0,
                   "nvme_dir": str(tmp_path)}
    # torch.optim's first step imports torch._dynamo lazily; that import's own reference
    # cycles (importlib frames) hold the frames that called it, once per process: warm up
    warm = torch.nn.Linear(2, 2)
    torch.optim.AdamW(warm.parameters()).step()
    CLASSES[name](warm.parameters(), runtime={"mode": "sync"}).close()
    gc.collect()
    base = _threads()
    gc.disable()
    try:
        refs = []
        for _ in range(5):
            model = torch.nn.Linear(16, 16)
            opt = CLASSES[name](model.parameters(), lr=1e-3, precondition_frequency=2,
                                runtime=runtime)
            for _ in range(3):
                opt.zero_grad()
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
            assert len(opt.state) > 0
            refs.append(weakref.ref(opt))
            del opt
        assert [r() for r in refs] == [None] * len(refs)  # freed by reference counting
        assert _threads() <= base + 1, (base, _threads())
        if isinstance(runtime, dict) and "nvme_dir" in runtime:
            assert os.listdir(tmp_path) == []  # the records went with their optimizer
    finally:
        gc.enable()


# ---- 4. runtime values that cannot work ------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("key,value,match", [
    ("nvme_dir", "/tmp/a\0b", "embedded NUL"),
    ("trace", "/tmp/t\0.json", "embedded NUL"),
    ("cpuset", "0\0-1", "embedded NUL"),
    ("nvme_dir", "/tmp/\ud800x", "not valid UTF-8"),
    ("trace", "/tmp/\udcfftrace.json", "not valid UTF-8"),
    ("nvme_dir", "/etc/passwd", "an existing directory"),
    ("nvme_dir", "/nonexistent/asteria", "an existing directory"),
    ("trace", "/tmp", "a file path"),
    ("trace", "/nonexistent/dir/trace.json", "in an existing directory"),
    ("on_failure", "ignore", '"raise", "keep"'),
])
def test_bad_runtime_value_names_its_key(mode, key, value, match):
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=rf"runtime key '{key}'.*{match}"):
        SOAP([w], runtime={"mode": mode, key: value})


# ---- 5. runaway factors -------------------------------------------------------------------------

def _train_with_spike(opt, w, steps=12, spike_at=3, big=1e30):
    for t in range(steps):
        x = torch.randn(32, 6, generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        (x @ w.T).square().mean().backward()
        if t == spike_at:
            w.grad[0, 0] = big  # finite in float32, but its square is not
        opt.step()


@pytest.mark.parametrize("max_failures", [2, 4])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["soap", "shampoo"])
def test_overflowed_factor_raises_after_max_failures(name, mode, max_failures):
    """The optimizer's schedule is the one failure count, whatever the executor (async: the C
    pool), and the cause its message names is the job's own: libasteria keeps no streak of its
    own that would turn it into AST_EFAILED."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 6))
    opt = CLASSES[name]([w], lr=1e-2, precondition_frequency=2,
                        runtime={**MODES[mode], "max_failures": max_failures})
    if mode == "async":
        from asteria.refresh.host_pool import HostPoolEngine

        assert isinstance(opt.run.engine, HostPoolEngine)
    opt._asteria_name_params({w: "layer.weight"})
    with pytest.raises(RuntimeError, match=rf"parameter 0 \(layer.weight\), block 0, "
                                           rf"dimension \d failed {max_failures} times in a "
                                           rf"row \(its Kronecker factor is not finite") as ei:
        _train_with_spike(opt, w, steps=16)
    assert "AST_EFAILED" not in str(ei.value)
    assert torch.isfinite(w).all()
    # the step that raised is complete: the state can be saved
    sd = opt.state_dict()
    assert sd["state"][0]["step"] >= 4
    opt.close()


@pytest.mark.parametrize("mode", MODES)
def test_overflowed_factor_with_on_failure_keep_warns_once_and_trains(mode):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 6))
    opt = SOAP([w], lr=1e-2, precondition_frequency=2,
               runtime={**MODES[mode], "max_failures": 2, "on_failure": "keep"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_with_spike(opt, w, steps=16)
    msgs = [str(c.message) for c in caught if "failed 2 times in a row" in str(c.message)]
    assert len(msgs) == 2  # one per factor of the block, at the 2nd failure only
    assert "on_failure='keep'" in msgs[0]
    assert opt.asteria_stats()["refresh_failures"] >= 4
    opt.close()


@pytest.mark.parametrize("big", [1e15, 1e18, 1e20, 1e30, 3e38])
@pytest.mark.parametrize("mode", MODES)
def test_kl_shampoo_never_makes_finite_gradients_non_finite(mode, big):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 6))
    opt = KLShampoo([w], lr=1e-2, precondition_frequency=2, runtime=MODES[mode])
    before = {}

    def spy(t):
        if t == 3:
            before.update({k: v.clone() for k, v in opt.state[w].items()
                           if isinstance(v, torch.Tensor)})

    for t in range(12):
        x = torch.randn(32, 6, generator=torch.Generator().manual_seed(t))
        opt.zero_grad()
        (x @ w.T).square().mean().backward()
        if t == 3:
            w.grad[0, 0] = big
        spy(t)
        opt.step()
        assert torch.isfinite(w).all(), t
        for k, v in opt.state[w].items():
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                assert torch.isfinite(v).all(), (t, k)
    if big >= 1e20:  # the spike's step left the block as it was, and says so
        assert opt.asteria_stats()["overflow_skipped"] >= 1
    opt.close()


def test_kl_shampoo_overflow_guard_is_exact_otherwise():
    """Blocks that do not overflow get exactly the update they got before the guard: a stack
    of two blocks, one spiked, the other compared with a run without the spike."""
    from asteria.optim import functional as F

    runs = []
    for spike in (False, True):
        torch.manual_seed(0)
        g = torch.randn(2, 4, 4)
        if spike:
            g[1, 0, 0] = 1e30
        w = torch.randn(2, 4, 4)
        m = torch.randn(2, 4, 4)
        q = [torch.linalg.qr(torch.randn(2, 4, 4)).Q for _ in range(2)]
        fs = [torch.eye(4).expand(2, 4, 4).clone() for _ in range(2)]
        ss = [torch.rand(2, 4) + 0.5 for _ in range(2)]
        w1 = w.clone()
        ok = F.kl_step(w1, g, m, fs, q, ss, lr=0.1, beta1=0.9, shampoo_beta=0.95, eps=1e-8,
                       weight_decay=0.01, normalize_grads=False, clamp=[10.0, 10.0])
        runs.append((w, w1, m, fs, ss, ok))
    (_, w_a, m_a, f_a, s_a, ok_a), (w0_b, w_b, m_b, f_b, s_b, ok_b) = runs
    assert ok_a.tolist() == [True, True] and ok_b.tolist() == [True, False]
    assert torch.equal(w_a[0], w_b[0]) and torch.equal(m_a[0], m_b[0])
    assert torch.equal(w_b[1], w0_b[1])  # the overflowing block is untouched
    for x, y in zip(f_a + s_a, f_b + s_b):
        assert torch.equal(x[0], y[0])


# ---- non-finite gradients: the per-step check --------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_check_flags_nan_and_inf_not_huge_finite(dtype):
    """_finite flags a gradient holding NaN, +inf or -inf (anywhere, also next to huge values)
    and only those: the largest finite values of the dtype (1e38 in float32, its max in every
    dtype) and an empty gradient are finite; and SOAP skips exactly the flagged parameters."""
    top = torch.finfo(dtype).max
    cases = {"ok": None, "nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"),
             "1e38": min(1e38, top), "-max": -top, "nan_after_inf": "mix"}
    params = []
    for value in cases.values():
        p = torch.nn.Parameter(torch.ones(4, 3, dtype=dtype))
        p.grad = torch.full_like(p, 0.5)
        if value == "mix":
            p.grad[0, 0], p.grad[3, 2] = float("inf"), float("nan")
        elif value is not None:
            p.grad[2, 1] = value
            p.grad[1, 1] = p.grad[0, 1] = top  # a naive sum in the dtype would overflow
        params.append(p)
    empty = torch.nn.Parameter(torch.ones(0, 3, dtype=dtype))
    empty.grad = torch.zeros_like(empty)
    want = [True, False, False, False, True, True, False]
    opt = SOAP(params + [empty], runtime={"mode": "sync"})
    assert opt._finite(params + [empty]) == want + [True]
    assert opt._finite([params[0]]) == [True]
    assert opt._finite([params[1]]) == [False]
    if dtype in (torch.float32, torch.float64):
        opt.step()  # SOAP's first step: a finite block's factors start, a skipped one's not
        assert opt.asteria_stats()["nonfinite_skipped"] == want.count(False)
        assert [bool(opt.state[p]) for p in params] == want
        opt.step()
        assert [opt.state[p].get("step") for p in params] == [1 if ok else None for ok in want]
    opt.close()
