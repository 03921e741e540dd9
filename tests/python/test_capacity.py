"""The capacity model of the REFRESH work (asteria.refresh.cost, asteria.refresh.capacity;
the prediction check of benchmarks/cost_check.py), the split of a round between
host workers and a device (asteria.refresh.split, through the Engine interface), the device
executor's thread on CPU (asteria.refresh.device), staleness="auto" and the capacity report.

Timing checks are made robust for a noisy shared 2-core VM: the model is calibrated in the same
test, on the same pool and worker count, at other sizes than the rounds it predicts (so n^3
scaling and interpolation are exercised); calibration and rounds are interleaved and the
medians compared.
"""

import importlib.util
import math
import os

import pytest
import torch

from asteria import RuntimeConfig
from asteria.optim import SOAP
from asteria.optim.cadence import check_frequency
from asteria.refresh import cost as C
from asteria.refresh.engine import JobTiming, SubmitOptions
from asteria.refresh.inline_torch import InlineTorchEngine, compute
from capacity_clock import hold_capacity_clock
from job_delay import delay_jobs
from models import loss_and_grad, make_model, params_of, require_c_extension
from tolerance import rounding_tol


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def spd(batch, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, n, n, generator=g, dtype=dtype)
    return a @ a.transpose(-1, -2) / n + torch.eye(n, dtype=dtype)


def basis(batch, n, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=dtype)).Q


# ---- FLOP counts ----------------------------------------------------------------------------

def test_flop_counts():
    n = 10
    assert C.flops("eigh", n) == 9 * n ** 3
    assert C.flops("inv_root", n) == 11 * n ** 3
    assert C.flops("soap_qr", n) == pytest.approx(14 / 3 * n ** 3)
    assert C.flops("kl_qr", n) == pytest.approx(14 / 3 * n ** 3)
    assert C.flops("newton_root", n, p=4) == C.NEWTON_NOMINAL_ITERS * 10 * n ** 3
    assert C.flops("soap_rotate", 6, 4, sides=2) == 4 * 36 * 4 + 4 * 6 * 16
    assert C.flops("soap_rotate", 6, 4, sides=1) == 4 * 36 * 4
    # the figure: SOAP's QR refresh of a 2048 factor, about 40 GFLOP
    assert C.flops("soap_qr", 2048) / 1e9 == pytest.approx(40.1, abs=0.1)
    with pytest.raises(ValueError, match="unknown REFRESH op"):
        C.flops("svd", 4)
    job = C.JobSpec("soap_qr", torch.float32, 8, 3)
    assert job.flops == 3 * C.flops("soap_qr", 8)


def test_rates_scale_as_n3_and_interpolate():
    m = C.CostModel()
    m.add("host", "eigh", torch.float32, 100, 0.01)   # 9e6 FLOP in 10 ms: 0.9 GFLOP/s
    m.add("host", "eigh", torch.float32, 200, 0.04)   # 7.2e7 in 40 ms: 1.8 GFLOP/s
    j = lambda n: C.JobSpec("eigh", torch.float32, n, 1)  # noqa: E731
    assert m.entry_seconds("host", j(100)) == pytest.approx(0.01)
    assert m.entry_seconds("host", j(400)) == pytest.approx(0.04 * 8)   # n^3 from 200
    assert m.entry_seconds("host", j(50)) == pytest.approx(0.01 / 8)    # n^3 from 100
    mid = m.rate("host", "eigh", torch.float32, C.flops("eigh", 141))[0]
    assert 0.9e9 < mid < 1.8e9
    # at one size: the mean of the samples without the largest (one outlier dropped)
    for s in (0.03, 0.5, 0.04):
        m.add("host", "eigh", torch.float32, 300, s)
    assert m.entry_seconds("host", j(300)) == pytest.approx(0.035)
    # float64 unmeasured: half the float32 rate; bfloat16 priced as float32
    assert m.entry_seconds("host", C.JobSpec("eigh", torch.float64, 100, 1)) == \
        pytest.approx(0.02)
    assert m.entry_seconds("host", C.JobSpec("eigh", torch.bfloat16, 100, 1)) == \
        pytest.approx(0.01)
    # another op on the lane: the lane's rate; a lane with nothing: labelled defaults
    assert m.rate("host", "soap_qr", torch.float32, 1e7)[1] == "the lane's other ops"
    assert "prior" in m.rate("device", "eigh", torch.float32, 1e7)[1]
    assert "assumed" in m.rate("inline", "eigh", torch.float32, 1e7)[1]
    # a failed or unmeasured job teaches nothing
    m2 = C.CostModel()
    m2.observe(JobTiming(1, "host", "eigh", torch.float32, 8, 0, 2, 10, 20, "worker", ok=False))
    m2.observe(JobTiming(1, "host", "eigh", torch.float32, 8, 0, 2, 0, 0, ""))
    assert m2.observed == 0
    m2.observe(JobTiming(1, "host", "eigh", torch.float32, 8, 0, 2, 10, 2_000_010, "worker"))
    assert m2.entry_seconds("host", C.JobSpec("eigh", torch.float32, 8, 1)) == \
        pytest.approx(1e-3)


def test_makespan_and_assignment():
    m = C.CostModel({"host": 1.0})  # 1 GFLOP/s
    n = 1000  # soap_qr: 14/3 GFLOP per entry, 4.667 s
    e = C.flops("soap_qr", n) / 1e9
    jobs = [C.JobSpec("soap_qr", torch.float32, n, 3), C.JobSpec("soap_qr", torch.float32, n, 1)]
    assert C.makespan(m, jobs, 1) == pytest.approx(4 * e)
    assert C.makespan(m, jobs, 2) == pytest.approx(3 * e)  # whole jobs: 3 | 1
    assert C.split_makespan(m, jobs, {"host": 2}) == pytest.approx(2 * e)  # divided: 2 | 2
    # host entry 1 s, device 0.25 s: 2 workers + device, batch 12 -> 8 on the device, 2 + 2
    free = {("host", 0): 0.0, ("host", 1): 0.0, ("device", 0): 0.0}
    counts = C.assign({"host": 1.0, "device": 0.25}, 12, free)
    assert counts == {("host", 0): 2, ("host", 1): 2, ("device", 0): 8}
    assert max(free.values()) == pytest.approx(2.0)
    assert C.smallest_s(2.1, 1.0) == 3 and C.smallest_s(0.2, 1.0) == 1
    assert C.smallest_workers(m, jobs, 2 * e + 1e-9, splits=True) == 2
    # whole jobs: the batch of 3 is one job on one worker, more workers never help it
    assert C.smallest_workers(m, jobs, 2 * e + 1e-9, splits=False) is None
    assert C.smallest_workers(m, jobs, 3 * e + 1e-9, splits=False) == 2


# ---- prediction against the pool --------------------------------------------------------------

# sizes large enough that a round's compute (about 0.1 and 0.3 s on one core here) is well
# above a contended machine's wake-up latency of a worker (milliseconds); the calibration is at
# other sizes, so n^3 scaling and interpolation are exercised (the same as bench_capacity.py)
CAL = [(160, 6), (576, 1)]             # calibration sizes (n, batch)
MODELS = {"small": [(320, 4), (384, 3)],
          "larger": [(448, 4), (512, 3), (320, 6)]}


def _cost_check():
    """benchmarks/cost_check.py, loaded from its file (nothing in the package calls it)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "cost_check.py")
    spec = importlib.util.spec_from_file_location("cost_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_prediction_learns_every_size_it_runs(name, workers):
    """Each round predicted before it runs, from every job the model has seen so far (a
    calibration at other sizes, then the rounds before: refined as jobs complete, as in a
    training run): a prediction before every round, a measured rate for every size that ran,
    from as many jobs as ran. How close the predictions come is a figure of the machine as much
    as of the model (a contended core stretches a round, not its prediction), so it is measured
    where figures live: benchmarks/bench_capacity.py, within 25% on an idle machine
    (docs/capacity.md), not asserted here."""
    r = _cost_check().prediction_check(workers, MODELS[name], CAL, repeats=3)
    assert len(r["predicted_s"]) == len(r["measured_s"]) == 3
    assert all(math.isfinite(p) and p > 0 for p in r["predicted_s"] + r["measured_s"]), r
    rates = {(row["n"], row["dtype"]): row for row in r["rates"]}
    sizes = {n for n, _ in CAL} | {n for n, _ in MODELS[name]}
    assert set(n for n, _ in rates) == sizes, (sorted(rates), sorted(sizes))
    # jobs (one a size a round): calibration, a warm-up round and one before each prediction;
    # the model's sizes, one a round
    runs = {n: 1 + 3 for n, _ in CAL} | {n: 3 for n, _ in MODELS[name]}
    for (n, _), row in rates.items():
        assert row["samples"] >= 1 and row["gflops"] > 0 and row["seconds_per_entry"] > 0, row
        assert row["samples"] <= runs[n], (row, runs[n])


# ---- the split, through the Engine interface ----------------------------------------------------

def _check_split_results(eng, op="soap_qr", n=24, batch=10, rounds=3):
    f, q = spd(batch, n, seed=3, dtype=torch.float64), basis(batch, n, seed=4,
                                                                dtype=torch.float64)
    ref = compute(op, f, q, 0.0, 0.0)
    tol = rounding_tol(f.dtype, n=n, cond=float(torch.linalg.cond(f).max()))  # n eps cond(F)
    for r in range(rounds):
        tk = eng.submit(op, list(f.unbind(0)), q.clone(), block=7, version=r + 1, deadline=3,
                        snapshot_step=0, opts=SubmitOptions(donate=("q",)))
        res = eng.wait(tk)
        assert res.status == 0 and res.outputs[0].shape == (batch, n, n)
        # LAPACK (pool) and torch agree to rounding; the permutation exactly
        torch.testing.assert_close(res.outputs[0], ref[0], rtol=tol, atol=tol)
        if op == "soap_qr":
            assert torch.equal(res.outputs[1], ref[1])
        assert res.started_ns and res.done_ns >= res.started_ns


def test_split_host_pool_and_inline_torch():
    from asteria.refresh.host_pool import HostPoolEngine
    from asteria.refresh.split import SplitEngine

    eng = SplitEngine(HostPoolEngine({"workers": 2}), InlineTorchEngine())
    seen = []
    eng.observer = seen.append
    try:
        assert eng.lanes() == {"host": 2, "device": 1} and eng.splits_batches
        _check_split_results(eng)
        st = eng.stats()
        # the first job put one entry on each unmeasured lane; every entry went somewhere
        assert st["split_entries_host"] >= 1 and st["split_entries_device"] >= 1
        assert st["split_entries_host"] + st["split_entries_device"] == 30
        assert {t.lane for t in seen} == {"host", "device"}
        assert all(t.ticket in (1, 2, 3) for t in seen)
        assert sum(t.last for t in seen) == 3  # one last part per job
        assert eng.model.measured("device", "soap_qr", torch.float64)
    finally:
        eng.close()


def test_split_follows_the_measured_rates():
    from asteria.refresh.host_pool import HostPoolEngine
    from asteria.refresh.split import SplitEngine

    spec = C.JobSpec("soap_qr", torch.float32, 64, 12)
    model = C.CostModel()
    model.add("host", "soap_qr", torch.float32, 64, 1.0)
    model.add("device", "soap_qr", torch.float32, 64, 0.25)
    eng = SplitEngine(HostPoolEngine({"workers": 2}), InlineTorchEngine(), model)
    try:
        assert eng.plan(spec) == [("device", 8), ("host", 2), ("host", 2)]
        # what is queued counts: the next job of the same size goes mostly elsewhere
        second = dict()
        for lane, c in eng.plan(C.JobSpec("soap_qr", torch.float32, 64, 4)):
            second[lane] = second.get(lane, 0) + c
        assert sum(second.values()) == 4
    finally:
        eng.close()
    # host only: the batch is divided among the workers
    eng = SplitEngine(HostPoolEngine({"workers": 2}), None, C.CostModel({"host": 1.0}))
    try:
        assert eng.plan(C.JobSpec("eigh", torch.float32, 32, 5)) == [("host", 3), ("host", 2)]
        _check_split_results(eng, op="kl_qr")
    finally:
        eng.close()


def test_split_failure_and_cancel():
    from asteria.refresh.host_pool import HostPoolEngine
    from asteria.refresh.split import SplitEngine

    eng = SplitEngine(HostPoolEngine({"workers": 1}), InlineTorchEngine(),
                      C.CostModel({"host": 1.0}))
    try:
        f = spd(4, 8)
        f[2, 0, 0] = float("nan")  # one bad entry: the job fails, no outputs
        res = eng.wait(eng.submit("eigh", f, block=1, version=1, deadline=1, snapshot_step=0))
        assert res.status < 0 and res.outputs is None and res.error
        tk = eng.submit("eigh", spd(2, 8), block=2, version=1, deadline=1, snapshot_step=0)
        eng.cancel(tk)
        eng.wait(tk)  # a cancelled job can be waited for
        with pytest.raises(ValueError, match="unknown or already"):
            eng.wait(tk)
    finally:
        eng.close()


def test_device_executor_thread_on_cpu():
    from asteria.refresh.device import DeviceEngine
    from asteria.refresh.host_pool import HostPoolEngine
    from asteria.refresh.split import SplitEngine

    dev = DeviceEngine("cpu")
    try:
        f = spd(3, 16, dtype=torch.float64)
        src = f.clone()
        tk = dev.submit("eigh", f, block=1, version=1, deadline=1, snapshot_step=0)
        f.zero_()  # the snapshot was taken at submit
        res = dev.wait(tk)
        ref = compute("eigh", src, None, 0.0, 0.0)
        torch.testing.assert_close(res.outputs[1], ref[1])
        assert res.timing == "wall" and dev.lanes() == {"device": 1}
        out = dev.wait(dev.submit("inv_root", src, block=2, version=1, deadline=1,
                                  snapshot_step=0, p=2.0, eps=1e-6,
                                  opts=SubmitOptions(host_outputs=True)))
        assert out.status == 0 and out.outputs[0].device.type == "cpu"
    finally:
        dev.close()
    eng = SplitEngine(HostPoolEngine({"workers": 2}), DeviceEngine("cpu"))
    try:
        _check_split_results(eng)
    finally:
        eng.close()


def test_no_cuda_no_device_executor_and_the_report_says_so():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=3,
               runtime={"mode": "async", "staleness": 2, "workers": 2})
    try:
        assert opt.asteria_plan() == list(opt.placement.plan.decisions)  # nothing measured yet
        for t in range(1, 12):
            loss_and_grad(model, "mlp", t)
            opt.step()
        plan = opt.asteria_plan()
        assert any("no device executor" in line for line in plan)
        assert any("work per round" in line and "GFLOP" in line for line in plan)
        assert any("smallest S that hides the refresh" in line for line in plan)
        st = opt.asteria_stats()
        cap = {k: v for k, v in st.items() if k.startswith("capacity_")}
        assert st["capacity_round_gflop"] > 0 and st["capacity_measured_round_s"] > 0, cap
        assert st["capacity_predicted_round_s"] > 0 and st["capacity_step_s"] > 0, cap
        assert st["staleness"] == 2 and not st["staleness_auto"]
    finally:
        opt.close()


# ---- staleness="auto" --------------------------------------------------------------------------

def auto_rt(workers=2):
    return {"mode": "async", "staleness": "auto", "workers": workers}


def test_auto_config():
    cfg = RuntimeConfig.from_user({"staleness": "auto"})
    assert cfg.staleness == "auto" and "staleness" not in cfg.c_items()
    check_frequency(1, cfg)  # auto stays within any frequency
    with pytest.raises(ValueError, match="'staleness'.*auto"):
        RuntimeConfig.from_user({"staleness": "fast"})
    with pytest.raises(ValueError, match="'staleness'"):
        RuntimeConfig.from_user({"staleness": -1})


def _train(model, opt, steps, start=1, clock=None, fb_s=0.0):
    """``steps`` steps; with ``clock`` (capacity_clock.StepClock) each step's forward and
    backward lasts ``fb_s`` on the capacity record's clock, which stands still otherwise."""
    for t in range(start, start + steps):
        loss_and_grad(model, "mlp", t)
        if clock is not None:
            clock.advance(fb_s)
        opt.step()


# The capacity record's steps, held by the test (capacity_clock.py): a forward and backward of
# FB_FITS holds 1.5x a round of this model (milliseconds: it would take a round of 40 s to
# break it); one of FB_SHORT is below 1.5x a round whose jobs sleep SLOW_JOB_MS first (the
# job delay, a lower bound on the round's measured seconds whatever the machine's load).
FB_FITS, FB_SHORT, SLOW_JOB_MS = 60.0, 0.01, 150


def test_auto_picks_s_keeps_it_through_a_checkpoint():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=4, runtime=auto_rt())
    try:
        assert opt.cadence.delay == 4  # the frequency until a round is measured
        _train(model, opt, 12)
        st = opt.asteria_stats()
        assert st["staleness_auto"] and st["staleness_auto_chosen"]
        s = st["staleness"]
        assert 0 <= s <= 4
        assert any(line.startswith("staleness 'auto'") for line in opt.asteria_plan())
        sd = opt.state_dict()
        assert {int(v["staleness.auto"]) for v in sd["state"].values()
                if "staleness.auto" in v} == {s}
        # a resumed run keeps S and the trajectory
        twin = make_model("mlp")
        twin.load_state_dict(model.state_dict())
        opt2 = SOAP(twin.parameters(), precondition_frequency=4, runtime=auto_rt())
        opt2.load_state_dict(sd)
        assert opt2.cadence.delay == s and opt2.asteria_stats()["staleness_auto_chosen"]
        _train(model, opt, 9, start=13)
        _train(twin, opt2, 9, start=13)
        for a, b in zip(params_of(model), params_of(twin)):
            assert torch.equal(a, b)
        opt2.close()
    finally:
        opt.close()


def test_auto_never_above_the_frequency(monkeypatch):
    # every job sleeps 150 ms, and a step (its forward and backward) lasts 10 ms on the capacity
    # record's clock: the round wants 12 steps or more, S is capped at f
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=3, runtime=auto_rt())
    try:
        delay_jobs(opt, SLOW_JOB_MS)
        _train(model, opt, 9, clock=clock, fb_s=FB_SHORT)
        assert opt.asteria_stats()["staleness_auto_chosen"] and opt.cadence.delay == 3
    finally:
        opt.close()


def test_auto_s0_where_the_round_fits_the_forward_and_backward(monkeypatch):
    """The S = 0 window: in mode "async" an S = 0 round runs during the next forward and
    backward. With 60 s of "forward and backward" before each step (the capacity record's
    clock, held by the test) and this model's rounds (factors of 16: milliseconds), 1.5x a
    round fits there: S = 0, each refresh installed at the next step's start; with every job
    slowed to 150 ms and 10 ms steps it does not, and S >= 1."""
    def chosen(job_ms, fb_s):
        clock = hold_capacity_clock(monkeypatch)
        model = make_model("mlp")
        opt = SOAP(model.parameters(), precondition_frequency=3, runtime=auto_rt())
        try:
            if job_ms:
                delay_jobs(opt, job_ms)
            _train(model, opt, 10, clock=clock, fb_s=fb_s)
            deferred = list(opt.schedule.deferred)  # (asteria_stats() settles them)
            st = opt.asteria_stats()
            assert st["staleness_auto_chosen"]
            return st["staleness"], deferred
        finally:
            opt.close()

    s, deferred = chosen(0, FB_FITS)
    # the last step's refresh (step 10: SOAP's count k = 9, after the first step's eigh)
    assert s == 0 and deferred, "an S = 0 refresh waits for the next use of the state"
    s, _ = chosen(SLOW_JOB_MS, FB_SHORT)
    assert 1 <= s <= 3


def test_auto_s_is_fixed_once_chosen_and_every_install_is_s_steps_late(monkeypatch):
    """S is chosen at the first REFRESH round (step 4: f = 3, after the first step's
    eigendecompositions), from the round's price against the steps (jobs slowed to 60 ms, steps
    of 10 ms on the capacity record's clock: S = f = 3), and never moves again: every later
    step runs at that S, and every refresh is installed exactly S steps after its snapshot
    (install="deterministic", at the bounded barrier when its jobs are late). Whether the
    chosen S also hides the round, so that no install waits, is a figure of the machine's load
    as much as of the rule: benchmarks/bench_capacity.py reports it
    (``install_waits_after_first_rounds``), in the users' regime."""
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=3, runtime=auto_rt())
    try:
        delay_jobs(opt, 60)
        chosen_at, seen, installs = None, [], [0]
        for t in range(1, 17):
            _train(model, opt, 1, start=t, clock=clock, fb_s=FB_SHORT)
            st = opt.asteria_stats()
            installs.append(st["installs"])
            if chosen_at is None and st["staleness_auto_chosen"]:
                chosen_at = t
            if chosen_at is not None:
                seen.append(opt.cadence.delay)
        assert chosen_at == 4, opt.asteria_plan()
        assert seen == [3] * len(seen), seen
        # the first step's eigendecompositions at step 1; the refreshes snapshotted at steps 4,
        # 7, 10, 13 installed at 7, 10, 13, 16 (the one of step 16 is still in flight)
        grew = [t for t in range(1, 17) if installs[t] > installs[t - 1]]
        assert grew == [1, 7, 10, 13, 16], installs
        assert opt.asteria_stats()["max_install_lag"] == 3
    finally:
        opt.close()


# ---- python3 -m asteria.plan -------------------------------------------------------------------

def test_plan_factors_and_table(capsys):
    from asteria import plan

    # 2048 x 8192 blocked by 2048: 4 blocks of 2048 x 2048, 8 factors; 768 x 2048: 2 factors
    assert plan.factors([(2048, 8192), (768, 2048)], 2048, 2048) == {2048: 9, 768: 1}
    # without blocking a dimension above max_precond_dim gets no factor
    assert plan.factors([(2048, 8192)], 2048, None) == {2048: 1}
    assert plan.main(["--shape", "512x512", "--shape", "512x2048", "--step-time", "0.5",
                      "--gflops-per-core", "10", "--cores", "2", "-S", "2"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/round" in out and "given: 10.0 GFLOP/s per core" in out
    r = plan.row(C.CostModel({"host": 10.0}), "x", plan.factors([(512, 512)], 2048, 2048),
                 "soap", 2, 0.5, 2, 10, 0, None)
    assert r["gflop"] == pytest.approx(2 * C.flops("soap_qr", 512) / 1e9)
    assert r["round_s"] == pytest.approx(C.flops("soap_qr", 512) / 10e9)
    assert r["smallest_s"] == 1 and r["fits"] and r["smallest_cores"] == 1
    with pytest.raises(SystemExit):
        plan.main(["--shape", "12", "--step-time", "1"])


def test_plan_olmo2_1b_preset():
    pytest.importorskip("olmo_core")
    from asteria import plan

    m = plan.preset("olmo2-1b")
    # 18 layers x (4 attention 2048x2048 + 3 MLP 2048x8192), embeddings and head on AdamW
    assert len(m["shapes"]) == 18 * 7
    assert plan.factors(m["shapes"], 2048, 2048) == {2048: 18 * 32}
