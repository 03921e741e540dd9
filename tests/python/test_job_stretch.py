"""The test-only job stretch (``ast__runtime_set_job_stretch``, src/testing.h, through
job_delay.py): a job holds its worker factor x its compute, so a pool of W workers computes as
W cores 1/factor as fast would (benchmarks/bench_convergence.py's ``--round-steps``).

Only what the code guarantees is asserted, never a duration a loaded machine could change: a
sleep to an absolute deadline lasts at least until it, so a stretched job's span in the runtime's
own stamps (started_ns .. done_ns) holds at least its compute plus its sleep, the sleep at least
(factor - 1) x the compute, both from the runtime's totals, and the wait returns no sooner.
Factor 1 takes the job's old path (nothing timed, nothing slept); the outputs and an async
optimizer's trajectory with deterministic installs are bitwise those of an unstretched run.
"""

import importlib.util
import json
import os
import sys
import time

import pytest
import torch

from asteria import SOAP, _C
from asteria.refresh.host_pool import HostPoolEngine
from asteria.refresh.ops import OPS
from job_delay import job_stretch_totals, runtimes_of, set_job_stretch, stretch_jobs
from models import deterministic_runtime, make_model, require_c_extension, train_mlp


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def spd(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    return (a @ a.T / n + torch.eye(n, dtype=torch.float64))[None]


def eigh(eng, f):
    """(the result of one eigh job of ``f`` on ``eng``, the ns from before its submit to the
    wait's return)."""
    t0 = time.monotonic_ns()  # CLOCK_MONOTONIC, the runtime's clock
    res = eng.wait(eng.submit("eigh", f, block=1, version=1, deadline=1, snapshot_step=0))
    return res, time.monotonic_ns() - t0


def test_bad_arguments_name_what_is_allowed():
    eng = HostPoolEngine({"workers": 1})
    try:
        for bad in (0.5, 0.0, -2.0, float("nan"), float("inf"), 1001.0):
            with pytest.raises(ValueError, match=r"set_job_stretch: factor .*allowed: a finite "
                                                 r"number in 1\.\.1000") as ei:
                set_job_stretch(eng.runtime, bad)
            assert ei.value.code == _C.AST_EINVAL
        with pytest.raises(ValueError, match=r"ops\[1\] is 'qr'; allowed: op names \(eigh, "):
            set_job_stretch(eng.runtime, 2.0, ["eigh", "qr"])
        with pytest.raises(TypeError, match="ops must be None or a sequence of op names"):
            set_job_stretch(eng.runtime, 2.0, "eigh")
        with pytest.raises(TypeError, match="asteria._C.Runtime"):
            set_job_stretch(object(), 2.0)
    finally:
        eng.close()
    with pytest.raises(_C.AsteriaError) as ei:
        set_job_stretch(eng.runtime, 2.0)
    assert ei.value.code == _C.AST_ESHUTDOWN


def test_factor_one_is_the_old_path_and_bitwise():
    f = spd(96, seed=1)
    plain = HostPoolEngine({"workers": 1})
    one = HostPoolEngine({"workers": 1})
    try:
        set_job_stretch(one.runtime, 1.0)
        want, _ = eigh(plain, f)
        got, _ = eigh(one, f)
        assert got.status == want.status == 0
        assert all(torch.equal(a, b) for a, b in zip(got.outputs, want.outputs))
        assert job_stretch_totals(one.runtime) == (0, 0)
        assert job_stretch_totals(plain.runtime) == (0, 0)
    finally:
        plain.close()
        one.close()


@pytest.mark.parametrize("factor", [3.0, 1.5])
def test_a_stretched_job_holds_its_worker(factor):
    f = spd(160, seed=2)
    plain = HostPoolEngine({"workers": 1})
    slow = HostPoolEngine({"workers": 1})
    try:
        want, _ = eigh(plain, f)
        set_job_stretch(slow.runtime, factor, ["eigh"])
        got, waited = eigh(slow, f)
        compute, slept = job_stretch_totals(slow.runtime)
        assert compute > 0
        assert slept >= (factor - 1) * compute  # (factor - 1) is exact in binary here
        assert got.done_ns - got.started_ns >= compute + slept
        assert waited >= compute + slept  # the result came no sooner
        assert got.status == 0
        assert all(torch.equal(a, b) for a, b in zip(got.outputs, want.outputs))
        # an op outside the mask is not stretched
        set_job_stretch(slow.runtime, factor, ["inv_root"])
        eigh(slow, f)
        assert job_stretch_totals(slow.runtime) == (compute, slept)
    finally:
        plain.close()
        slow.close()


def test_training_is_bitwise_with_the_refresh_stretched():
    """SOAP in mode "async" with deterministic installs: the refresh jobs (the ops that are not
    rectangular: what a REFRESH round runs, as the benchmark stretches them) held 4x their
    compute give the unstretched run's parameters, bitwise."""
    refresh_ops = [o.name for o in OPS.values() if not o.rectangular]

    def run(factor):
        model = make_model("mlp")
        opt = SOAP(model.parameters(), precondition_frequency=3,
                   runtime=deterministic_runtime(staleness=1))
        try:
            if factor > 1:
                assert stretch_jobs(opt, factor, refresh_ops) >= 1
            out = train_mlp(model, opt, range(1, 11))
            totals = [job_stretch_totals(rt) for rt in runtimes_of(opt)]
        finally:
            opt.close()
        return out, totals

    want, none = run(1.0)
    got, totals = run(4.0)
    assert all(t == (0, 0) for t in none)
    assert sum(c for c, _ in totals) > 0
    for a, b in zip(want, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_sync_optimizer_has_nothing_to_stretch():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=3, runtime={"mode": "sync"})
    try:
        assert stretch_jobs(opt, 2.0) == 0
    finally:
        opt.close()


def _load_bench(name):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "benchmarks",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.main_env_only
@pytest.mark.timeout(120)
def test_bench_convergence_round_steps(tmp_path):
    """bench_convergence.py --round-steps: the calibration's two passes (unstretched, then at
    R over the first's R), the stretch every Asteria run with a worker pool got, and each such
    run's measured R; the sync run refreshes inline, unstretched. Structure only: the Rs are
    this machine's."""
    bc = _load_bench("bench_convergence")
    for bad in (["--round-steps", "0"], ["--round-steps", "5", "--settings", "optimizer-bound"]):
        with pytest.raises(SystemExit):
            bc.parse_args(["--quick"] + bad)
    bc.main(["--quick", "--no-plot", "--out-dir", str(tmp_path), "--settings", "users",
             "--seeds", "0", "--runs", "adamw,asteria-soap-async,asteria-soap-sync",
             "--lrs", "adamw=3e-3", "--lrs", "asteria-soap-async=1e-2",
             "--lrs", "asteria-soap-sync=1e-2", "--extend", "0", "--profile-steps", "0",
             "--gemm-reps", "1", "--round-steps", "3"])
    data = json.loads((tmp_path / "bench_convergence.json").read_text())
    assert data["settings"]["round_steps"] == 3
    cal = data["setting_results"]["users"]["round_steps"]
    assert cal["asked"] == 3 and cal["calibrated_on"] == "asteria-soap-async"
    assert cal["stretched_ops"] == [o.name for o in OPS.values() if not o.rectangular]
    first = cal["passes"][0]
    assert first["job_stretch"] == 1 and first["R"] == first["round_s"] / first["step_s"]
    if first["R"] < 3:
        assert cal["passes"][1]["job_stretch"] == pytest.approx(3 / first["R"])
    k = cal["job_stretch"]
    assert k >= 1
    for r in data["setting_results"]["users"]["runs"]:
        if r["optimizer"] == "asteria-soap-async" and k > 1:
            rs = r["round_steps"]
            assert rs["job_stretch"] == k and rs["R"] > 0
            assert min(rs["R_per_round"]) <= rs["R"] <= max(rs["R_per_round"])
        else:  # AdamW, native SOAP in mode "sync": nothing stretched
            assert "round_steps" not in r
