"""Smoke tests of benchmarks/bench_step_time.py, bench_core_contention.py, bench_convergence.py,
bench_staleness.py, bench_tier_dtype.py, bench_step_lockstep.py and examples/main_job.py (the main
job, with examples/train_tiny.py as its first part): a --quick (or tiny) run into tmp_path
writes a result file with the metadata and sane statistics; bench_memory_cap.py's tier dtype
configurations by their arguments. They run in this process through
main(argv) (no second torch import), which restores the thread count and CPU affinity."""

import importlib.util
import json
import math
import os
import sys
import time

import pytest
import torch

pytest.importorskip("asteria._C")

# the benchmark scripts: checked once, in the main environment (scripts/run_tests.sh)
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: every test here runs a benchmark or the main job at its smallest: a hang guard, far above a
#: loaded run (test_main_job_tiny took more than 150 s at a 1-minute load of 14 to 20 on 2
#: cores, test_bench_convergence_quick more than 120 s beside 4 CPU hogs), not a time limit
HANG_GUARD_S = 600


def load_bench(name="bench_step_time"):
    script = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, script)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_step_time_quick(tmp_path):
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    returned = load_bench().main(["--quick", "--no-plot", "--out-dir", str(tmp_path)])
    assert torch.get_num_threads() == threads
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus

    data = json.loads((tmp_path / "bench_step_time.json").read_text())
    assert data["results"][0]["summary"] == returned["results"][0]["summary"]
    for key in ("benchmark", "date", "command", "machine", "versions", "settings", "model",
                "targets", "results"):
        assert key in data, key
    assert "--quick" in data["command"]
    assert data["machine"]["nproc"] >= 1 and data["machine"]["cpu_model"]
    assert data["versions"]["torch"] and data["versions"]["asteria"]

    results = {r["optimizer"]: r for r in data["results"]}
    assert set(results) == {"adamw", "soap-sync", "soap-async"}
    measured = data["settings"]["steps"] - data["settings"]["warmup"]
    for name, r in results.items():
        s = r["summary"]
        assert s["n"] == measured, name
        assert 0 < s["min_ms"] <= s["median_ms"] <= s["p99_ms"] <= s["max_ms"], (name, s)
        assert s["p99_over_median"] >= 1.0 and s["max_over_median"] >= s["p99_over_median"]
        assert len(r["step_ms"]) == data["settings"]["steps"]
        assert all(t > 0 for t in r["step_ms"])
        assert math.isfinite(r["final_loss"]) and 0 < r["final_loss"] < 10
        tiers = r["bytes_per_tier"]
        assert tiers["source"] in ("asteria_stats", "optimizer.state")
        assert set(tiers["tiers"]) == {"device", "host_pinned", "host", "uvm", "nvme"}
        assert tiers["total"] == sum(tiers["tiers"].values()) > 0
    # SOAP keeps factors and eigenbases next to its moments: more state than AdamW
    total = {name: r["bytes_per_tier"]["total"] for name, r in results.items()}
    assert total["soap-sync"] > total["adamw"]
    # the async run really used the pool (the quick settings let refreshes get installed)
    counters = results["soap-async"]["runtime_counters"]
    assert counters["jobs_done"] > 0 and counters["installs"] > 0
    # per-step worker CPU time: none without a pool, some over the run with one
    assert results["adamw"]["worker_ms"] == [None] * data["settings"]["steps"]
    wms = results["soap-async"]["worker_ms"]
    assert len(wms) == data["settings"]["steps"] and all(w >= 0 for w in wms) and sum(wms) > 0
    for name, r in results.items():
        sl = r["slow_steps"]
        assert sl["with_worker"]["steps"] + sl["without_worker"]["steps"] == measured, name
        assert 0 <= sl["with_worker"]["slow"] <= sl["with_worker"]["steps"]
    assert results["adamw"]["slow_steps"]["with_worker"]["steps"] == 0

    for key in ("asteria_p99_over_median", "native_sync_max_over_median",
                "asteria_device_bytes_fraction_of_native"):
        t = data["targets"][key]
        assert t["value"] is not None and t["value"] > 0
        assert t["met"] in (True, False)


@pytest.mark.timeout(HANG_GUARD_S)
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="the probe needs two CPUs")
def test_bench_core_contention_quick(tmp_path):
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0)
    load_bench("bench_core_contention").main(
        ["--quick", "--no-plot", "--seconds", "2", "--phase-s", "0.25", "--out-dir",
         str(tmp_path)])
    assert torch.get_num_threads() == threads and os.sched_getaffinity(0) == cpus

    data = json.loads((tmp_path / "bench_core_contention.json").read_text())
    assert "--quick" in data["command"] and data["machine"]["nproc"] >= 2
    assert data["settings"]["fg"] == "gemm" and data["units_per_slice"] >= 1
    phases = data["phases"]
    assert [p["state"] for p in phases] == ["idle", "busy"] * 4
    assert all(p["slices"] > 0 and p["median_slice_ms"] > 0 for p in phases)
    assert all(p["steal_ms"] is None or p["steal_ms"] >= 0 for p in phases)
    # the worker ran jobs in the busy phases only
    assert all(p["worker_jobs"] == 0 for p in phases if p["state"] == "idle")
    assert sum(p["worker_jobs"] for p in phases if p["state"] == "busy") > 0
    s = data["summary"]
    assert s["idle"]["phases"] == s["busy"]["phases"] == 4
    # slowdowns are relative to the idle phases' median: theirs is 1 by construction
    assert s["idle"]["median_slowdown"] == pytest.approx(1.0)
    assert s["busy"]["median_slowdown"] > 0 and s["worker_jobs_per_s"] > 0


def _restores(fn):
    """Run fn(); assert it left this process's torch thread count and CPU affinity as found."""
    threads = torch.get_num_threads()
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    out = fn()
    assert torch.get_num_threads() == threads
    if cpus is not None:
        assert os.sched_getaffinity(0) == cpus
    return out


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_convergence_quick(tmp_path):
    bc = load_bench("bench_convergence")
    t0 = time.perf_counter()
    _restores(lambda: bc.main(
        ["--quick", "--no-plot", "--out-dir", str(tmp_path), "--runs",
         "adamw,asteria-soap-async,asteria-soap-sync,asteria-soap-sync-f1,asteria-soap-async-s5,"
         "asteria-soap-async-f1-s0,asteria-soap-async-f2-s1",
         "--bound-runs", "adamw,asteria-soap-async",
         "--bound-seeds", "0", "--lrs", "adamw=3e-3,6e-3", "--gemm-reps", "2",
         "--profile-steps", "2"]))
    wall = time.perf_counter() - t0
    data = json.loads((tmp_path / "bench_convergence.json").read_text())
    assert "--quick" in data["command"] and data["versions"]["asteria"]
    assert set(data["setting_results"]) == {"users", "optimizer-bound"}
    users = data["setting_results"]["users"]
    assert users["seeds"] == [0, 1]
    # seed 0 sweeps every lr of each grid (the whole sweep kept), then beyond the edge of the
    # lrs tried (x2 above, /2 below) while the best sits there, at most --extend (2) times;
    # seed 1 runs the tuned one
    for name, entries in users["sweep"].items():
        lrs = [e["lr"] for e in entries if e["seed"] == 0]
        grid = users["grids"][name]
        assert lrs[:len(grid)] == grid and len(lrs) <= len(grid) + 2, (name, lrs)
        for i in range(len(grid), len(lrs)):
            assert lrs[i] in (2 * max(lrs[:i]), min(lrs[:i]) / 2), (name, lrs)
        assert users["lrs_tried"][name] == sorted(lrs)
        if len(lrs) < len(grid) + 2:  # stopped extending: the best is inside the lrs tried
            assert not users["tuned_at_edge_of_lrs_tried"][name], (name, lrs)
    assert len([e for e in users["sweep"]["asteria-soap-sync"] if e["seed"] == 0]) >= 3
    for name, lr in users["tuned_lr"].items():
        assert lr in users["lrs_tried"][name]
    # the amortisation runs: native SOAP at f=1, Asteria at f with S=min(5, f), and each
    # timed run's final loss at equal steps
    kw = {r["optimizer"]: r["kwargs"] for r in users["runs"] if r["seed"] == 0}
    f = data["settings"]["frequency"]
    assert kw["asteria-soap-sync-f1"]["precondition_frequency"] == 1
    assert kw["asteria-soap-sync-f1"]["runtime"] == {"mode": "sync"}
    assert kw["asteria-soap-async-s5"]["precondition_frequency"] == f
    assert kw["asteria-soap-async-s5"]["runtime"]["staleness"] == min(5, f)
    assert kw["asteria-soap-async"]["runtime"]["staleness"] == data["settings"]["staleness"]
    # the runs at their own f and S: "<base>-f<N>-s<S>", their base's lr grid
    assert kw["asteria-soap-async-f1-s0"]["precondition_frequency"] == 1
    assert kw["asteria-soap-async-f1-s0"]["runtime"]["staleness"] == 0
    assert kw["asteria-soap-async-f2-s1"]["precondition_frequency"] == 2
    assert kw["asteria-soap-async-f2-s1"]["runtime"]["staleness"] == 1
    assert users["grids"]["asteria-soap-async-f2-s1"] == users["grids"]["asteria-soap-async"]
    # the held-out loss: every timed run's weights at step 0, every --val-every steps and the
    # last, each evaluated on the same held-out batches (step 0: the same initial weights)
    every = data["settings"]["val_every"]
    for r in users["runs"]:
        v = r["val"]
        steps = data["settings"]["steps"]
        assert v["step"] == [0] + list(range(every, steps, every)) + [steps], v["step"]
        assert v["time_s"][0] == 0 and v["time_s"][-1] == r["time_s"][-1]
        assert all(x > 0 for x in v["loss"])
    zero = {r["val"]["loss"][0] for r in users["runs"] if r["seed"] == 0}
    assert len(zero) == 1
    for seed, t in users["time_to_adamw_final"].items():
        adamw = next(x for x in users["runs"] if x["optimizer"] == "adamw"
                     and x["seed"] == int(seed))
        # AdamW's own held-out loss at its own end is its last one
        # (times rounded to 10 us in the JSON)
        assert t["val_at_adamw_time"]["adamw"] == pytest.approx(adamw["val"]["loss"][-1],
                                                                abs=1e-4)
        assert set(t["val_at_adamw_time"]) == set(users["tuned_lr"])
    for r in users["runs"]:
        assert users["final_loss_at_equal_steps"][r["optimizer"]][str(r["seed"])] == \
            r["smoothed"][-1]
    best = min((e for e in users["sweep"]["adamw"] if e["seed"] == 0),
               key=lambda e: e["final_smoothed"])
    assert users["tuned_lr"]["adamw"] == best["lr"]
    for seed, t in users["time_to_adamw_final"].items():
        assert t["adamw_steps"] == data["settings"]["steps"] and t["adamw_wall_s"] > 0
        for name, r in t["runs"].items():
            run = next(x for x in users["runs"]
                       if x["optimizer"] == name and x["seed"] == int(seed))
            # the timed runs go on past the target (lockstep, all steps): the reach step is
            # the first whose trailing mean is at or below it
            assert run["steps_run"] == data["settings"]["steps"]
            if r["reached"]:
                k = r["step"] - 1
                assert run["smoothed"][k] <= t["target"]
                assert all(v > t["target"] for v in run["smoothed"][:k])
                assert r["time_s"] == run["time_s"][k]
                assert r["time_ratio"] == pytest.approx(r["time_s"] / t["adamw_wall_s"])
    # the lockstep runs are the sweep's runs, interleaved: same losses (deterministic)
    for name, lr in users["tuned_lr"].items():
        timed = next(x for x in users["runs"] if x["optimizer"] == name and x["seed"] == 0)
        swept = next(e for e in users["sweep"][name] if e["seed"] == 0 and e["lr"] == lr)
        if name == "adamw":
            assert timed["final_loss"] == pytest.approx(swept["final_loss"], abs=1e-9)
        elif swept.get("reached"):
            assert users["time_to_adamw_final"]["0"]["runs"][name]["step"] == swept["step"]
    # a run's clock: its own steps and their bookkeeping, disjoint spans of the one thread
    assert all(sum(r["step_ms"]) / 1e3 <= r["time_s"][-1] for r in users["runs"])
    assert sum(r["time_s"][-1] for r in users["runs"]) <= wall + 1e-5 * len(users["runs"])
    for r in users["runs"]:
        assert len(r["losses"]) == len(r["time_s"]) == len(r["step_kinds"]) == r["steps_run"]
        if r["optimizer"] == "asteria-soap-sync-f1":  # a refresh in every step
            assert set(r["step_kinds"]) == {"refresh+install"}, r["step_kinds"]
        elif r["optimizer"] == "asteria-soap-async-f1-s0":  # the install in the next step
            assert set(r["step_kinds"][2:]) == {"refresh+install"}, r["step_kinds"]
        elif r["optimizer"].startswith("asteria"):
            # f=4 in --quick: refreshes after the first step's (sync: installed at once)
            assert any(k.startswith("refresh") for k in r["step_kinds"][1:]), r["step_kinds"]
            # ... and steps without one (a SOAP step's factor EMA jobs are no refresh)
            assert "plain" in r["step_kinds"][1:], r["step_kinds"]
    assert data["setting_results"]["optimizer-bound"]["seeds"] == [0]
    lim = data["step_limit"]
    assert lim["added_flops_per_step"] > 0 and lim["gemm_gflops_peak"] > 0
    assert lim["limit_ms_at_peak_rate"] > lim["adamw_step_median_ms"] > 0
    assert lim["limit_ms_at_peak_rate"] == pytest.approx(
        lim["adamw_step_median_ms"] + lim["flop_ms_at_peak"])
    assert lim["nonrefresh_mean_over_sync_median"] > 0
    assert set(data["targets"]) >= {"soap_async_time_ratio", "step_over_limit",
                                    "nonrefresh_mean_over_sync_median"}
    assert data["why_settings_differ"]
    for r in users["runs"]:  # page faults of the training thread, per step
        mf = r["minor_faults"]
        assert len(mf["fwd_bwd"]) == len(mf["opt"]) == r["steps_run"]
        assert all(isinstance(x, int) and x >= 0 for x in mf["fwd_bwd"] + mf["opt"])
    # where the step's time goes: plain steps only, AdamW has no matrix products, SOAP's ran
    # at some rate, and the excess over the limit is split as the text says
    prof = data["profile"]
    assert prof["adamw"]["plain_steps_profiled"] == 2 == prof["asteria-soap-async"][
        "plain_steps_profiled"]
    assert prof["adamw"]["matmul_ms"] == 0 and prof["asteria-soap-async"]["matmul_ms"] > 0
    assert prof["asteria-soap-async"]["matmul_gflops_in_step"] > 0
    assert all(prof[n]["interpreter_ms"] > 0 and prof[n]["other_ops_ms"] > 0 for n in prof)
    ex = lim["excess"]
    assert ex["step_over_limit_ms"] == pytest.approx(
        lim["asteria_soap_step_median_ms"] - lim["limit_ms_at_peak_rate"])
    assert ex["fwd_bwd_over_adamw_ms"] == pytest.approx(
        lim["asteria_fwd_bwd_median_ms"] - lim["adamw_fwd_bwd_median_ms"])
    assert set(ex["profiled"]) == {"matmul_over_flop_time_ms", "other_ops_over_adamw_ms",
                                   "interpreter_over_adamw_ms", "matmul_gflops_in_step"}
    assert lim["limit_ms_at_in_step_rate"] > lim["adamw_step_median_ms"]


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_staleness_quick(tmp_path):
    bs = load_bench("bench_staleness")
    _restores(lambda: bs.main(["--quick", "--no-plot", "--out-dir", str(tmp_path),
                               "--staleness", "0,2", "--frequency", "4"]))
    data = json.loads((tmp_path / "bench_staleness.json").read_text())
    assert "--quick" in data["command"]
    labels = [r["label"] for r in data["results"]]
    assert labels == ["sync", "det S=0", "det S=2", "eag S=0", "eag S=2"]
    sync = data["results"][0]
    assert sync["train_minus_sync"] == 0 and sync["val_minus_sync"] == 0
    for r in data["results"]:
        assert r["steps_run"] == data["settings"]["steps"]
        assert math.isfinite(r["final_train_loss"]) and math.isfinite(r["val_loss"])
        assert 0 < r["step_mean_ms"] <= r["step_p99_ms"]
        assert r["barrier_waits"] >= 0 and r["barrier_wait_ms"] >= 0
        assert sum(r["steps_by_kind"].values()) == r["steps_run"] - data["settings"]["warmup"]
    # the target is about S=5, which this run left out
    assert set(data["targets"]) == {"abs_train_diff_S5_deterministic", "abs_train_diff_S5_eager"}
    assert all(t["value"] is None and t["met"] is None for t in data["targets"].values())


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_tier_dtype_quick(tmp_path):
    """Every tier dtype on the host tier beside AdamW, then on NVMe: each NVMe run's losses are
    bitwise its host run's (test_nvme_training.py), the quantized tiers hold fewer bytes and
    their rectified bases are nearer orthogonal than as stored; the targets are judged."""
    from asteria.config import TIER_DTYPES

    bt = load_bench("bench_tier_dtype")
    _restores(lambda: bt.main(["--quick", "--no-plot", "--out-dir", str(tmp_path),
                               "--nvme-dir", str(tmp_path)]))
    data = json.loads((tmp_path / "bench_tier_dtype.json").read_text())
    assert "--quick" in data["command"] and data["complete"]
    names = ["adamw", *TIER_DTYPES, *(f"{d}-nvme" for d in TIER_DTYPES)]
    assert [r["label"] for r in data["results"]] == [f"{n} seed {s}" for s in (0, 1)
                                                     for n in names]
    for r in data["results"]:
        assert r["steps_run"] == data["settings"]["steps"] and math.isfinite(r["val_final"])
        if r["optimizer"] != "adamw":
            assert r["memory_plan"]["tier_dtype"] == r["tier_dtype"]
    for seed, d in data["per_seed"].items():
        runs = d["runs"]
        assert runs["bfloat16"]["tier_bytes"] * 2 == runs["float32"]["tier_bytes"]
        assert (runs["int4"]["tier_bytes"] < runs["int8"]["tier_bytes"]
                < runs["bfloat16"]["tier_bytes"])
        for dt in TIER_DTYPES:
            nv = runs[f"{dt}-nvme"]
            assert nv["tier_bytes"] == runs[dt]["tier_bytes"] and nv["losses_bitwise_host"]
            assert nv["nvme_read_per_step"] > 0 == runs[dt]["nvme_read_per_step"]
    for r in data["results"]:
        o = r.get("orthogonality")
        if r["tier_dtype"] in ("int8", "int4"):
            assert o["bjorck_steps"] > 0 and o["rectified_max"] < o["widened_max"]
    assert set(data["targets"]) == {"int8", "int4"}
    assert all(t["met"] in (True, False) for t in data["targets"].values())


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_quant_orth_quick(tmp_path):
    """Every (qtype, block) on both kinds of basis: its bytes are the format's (a float32
    scale per block, the codes padded to 4 bytes), each Bjorck step brings it nearer
    orthogonal (e -> at most (3/4 + e/4) e^2 to float32's rounding floor), and at the tiers'
    own block and step count it is nearer orthogonal than the bfloat16 tier's basis."""
    from asteria.config import TIER_QUANT_BLOCK, TIER_RECTIFY_STEPS

    bq = load_bench("bench_quant_orth")
    _restores(lambda: bq.main(["--quick", "--no-plot", "--out-dir", str(tmp_path)]))
    data = json.loads((tmp_path / "bench_quant_orth.json").read_text())
    assert "--quick" in data["command"] and data["configured_block"] == TIER_QUANT_BLOCK
    assert {(r["n"], r["kind"]) for r in data["rows"]} == {
        (n, k) for n in data["sizes"] for k in data["kinds"]}
    for r in data["rows"]:
        n = r["n"]
        assert len(r["forms"]) == 4  # int8, int4 x blocks 64, 128
        for f in r["forms"]:
            bits, b = (8 if f["qtype"] == "int8" else 4), f["block"]
            codes = -(-n * n * bits // 8)
            assert f["bytes_ratio"] == (-(-codes // 4) * 4 + 4 * -(-n * n // b)) / (4 * n * n)
            e = f["orth_error"]
            assert len(e) == data["max_steps"] + 1
            floor = n ** 1.5 * 2.0 ** -24  # float32's rounding floor of ||V^T V - I||_F
            for a, c in zip(e, e[1:]):  # A' = -(3/4) A^2 + (1/4) A^3, to rounding
                assert c <= (0.75 + a / 4) * a * a + floor
            assert e[1] < e[0]
            if f["tiers_block"]:
                assert b == TIER_QUANT_BLOCK[f["qtype"]]
                assert e[TIER_RECTIFY_STEPS[f["qtype"]]] < r["bfloat16"]


def test_bench_exit_counts_each_launch(tmp_path):
    """bench_exit launches the user's 2-rank script (no epilogue of ours) and records each
    launch's exit code: one launch of one case, its JSON and summary."""
    be = load_bench("bench_exit")
    _restores(lambda: be.main(["--runs", "1", "--optimizers", "soap-async", "--endings", "none",
                               "--steps", "4", "--out-dir", str(tmp_path)]))
    data = json.loads((tmp_path / "bench_exit.json").read_text())
    assert "--runs 1" in data["command"] and data["machine"]
    (run,) = data["runs"]["soap-async/none"]
    assert run["code"] == 0 and run["abort"] is False, run
    assert data["summary"] == {"soap-async/none": {"runs": 1, "nonzero": 0, "aborts": 0}}


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_sigint_one_repeat(tmp_path):
    """bench_sigint measures, per repeat, a SIGINT's way to a waiting thread, a handler's and a
    timed wait's overshoot (the latencies test_sigint.py does not assert): one repeat, its JSON
    and summary (the figures themselves are the machine's)."""
    bs = load_bench("bench_sigint")
    _restores(lambda: bs.main(["--repeats", "1", "--out-dir", str(tmp_path)]))
    data = json.loads((tmp_path / "bench_sigint.json").read_text())
    assert "--repeats 1" in data["command"] and data["machine"]["loadavg_end"]
    assert set(data["summary"]) == set(data["samples_s"]) == {"interrupt", "handler",
                                                               "timed_overshoot"}
    for kind, xs in data["samples_s"].items():
        assert len(xs) == 1 and xs[0] >= 0, (kind, xs)
        assert data["summary"][kind]["n"] == 1
    with pytest.raises(SystemExit):
        bs.main(["--repeats", "0"])


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_step_lockstep_quick(tmp_path):
    bl = load_bench("bench_step_lockstep")
    bl.main(["--quick", "--no-plot", "--out-dir", str(tmp_path)])
    data = json.loads((tmp_path / "bench_step_lockstep.json").read_text())
    assert set(data["runs"]) == {"adamw", "asteria-soap-async", "asteria-soap-sync"}
    steps = data["settings"]["steps"]
    for name, r in data["runs"].items():
        ps = r["per_step"]
        assert len(ps["fwd_bwd_ms"]) == len(ps["opt_ms"]) == len(ps["loss"]) == steps, name
        assert all(t > 0 for t in ps["fwd_bwd_ms"] + ps["opt_ms"])
        assert 0 < r["opt_ms"]["median"] and 0 < r["fwd_bwd_ms"]["median"] < r["step_ms"]["p99"]
        assert len(ps["minor_faults"]["fwd_bwd"]) == steps
        assert set(r["minor_faults_median"]) == {"fwd_bwd", "opt"}
    # the three share initial weights and batches: the first step's loss is the same
    first = {r["per_step"]["loss"][0] for r in data["runs"].values()}
    assert len(first) == 1
    kinds = data["runs"]["asteria-soap-async"]["per_step"]["kinds"]
    assert "refresh" in kinds and "install" in kinds  # S = 0: the install in the next step
    f = data["figures"]
    assert f["limit_ms"] > data["runs"]["adamw"]["step_ms"]["median"]
    assert f["step_over_limit"] > 0 and f["step_over_limit_equal_fwd_bwd"] > 0


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_step_lockstep_every_step_runs(tmp_path):
    """--runs with each run's own f and S: the every-step refresh's step ratios."""
    bl = load_bench("bench_step_lockstep")
    bl.main(["--quick", "--no-plot", "--out-dir", str(tmp_path), "--runs",
             ",".join(bl.EVERY_STEP)])
    data = json.loads((tmp_path / "bench_step_lockstep.json").read_text())
    assert list(data["runs"]) == ["adamw", *bl.EVERY_STEP]  # AdamW first, always
    med = {n: r["step_ms"]["median"] for n, r in data["runs"].items()}
    e = data["figures"]["every_step"]
    f1, f10, native = (med[n] for n in bl.EVERY_STEP)
    assert e["f1_over_f10"] == pytest.approx(f1 / f10)
    assert e["f1_over_native_f1"] == pytest.approx(f1 / native)
    assert data["figures"]["median_step_ratio"]["adamw"]["adamw"] == 1.0
    assert "limit_ms" not in data["figures"]  # the default three are not all there
    # f=1: the Asteria run refreshes and installs every step (S = 0: in the next one)
    kinds = data["runs"]["asteria-soap-async-f1-s0"]["per_step"]["kinds"]
    assert kinds[2:].count("refresh+install") >= len(kinds) - 4


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_convergence_policy_runs_round_steps(tmp_path):
    """The runs named by their refresh policy ("asteria-soap-async-auto": f and S "auto";
    "asteria-soap-drift": refresh_policy "drift", its budget and d "auto") on a host stretched
    to R steps a round (--round-steps, calibrated on the f=S run), without a sweep
    (--no-sweep: each at its one lr); every run with factors records its refreshes per factor
    per 100 steps and the mean age of the basis its steps used, every run with a worker pool
    a whole round in steps."""
    bc = load_bench("bench_convergence")
    runs = ("adamw", "asteria-soap-sync", "asteria-soap-async-f4-s4", "asteria-soap-async-auto",
            "asteria-soap-drift")
    lrs = [a for n in runs for a in ("--lrs", f"{n}={6e-3 if n == 'adamw' else 2e-2}")]
    _restores(lambda: bc.main(
        ["--quick", "--no-plot", "--out-dir", str(tmp_path), "--settings", "users",
         "--seeds", "0", "--no-sweep", "--round-steps", "20", "--runs", ",".join(runs)] + lrs))
    data = json.loads((tmp_path / "bench_convergence.json").read_text())
    users = data["setting_results"]["users"]
    assert data["settings"]["sweep"] is False and users["sweep"] == {}
    assert users["tuned_lr"] == {n: 6e-3 if n == "adamw" else 2e-2 for n in runs}
    # a round of the quick model takes a few steps unstretched: R = 20 stretches it
    assert users["round_steps"]["calibrated_on"] == "asteria-soap-async-f4-s4"
    assert users["round_steps"]["job_stretch"] > 1
    assert data["settings"]["timed_runs"].startswith("every optimizer at its tuned lr, one "
                                                     "after another")
    by = {r["optimizer"]: r for r in users["runs"]}
    assert set(by) == set(runs)
    assert by["asteria-soap-async-auto"]["kwargs"]["precondition_frequency"] == "auto"
    assert by["asteria-soap-async-auto"]["kwargs"]["runtime"]["staleness"] == "auto"
    rt = by["asteria-soap-drift"]["kwargs"]["runtime"]
    assert by["asteria-soap-drift"]["kwargs"]["precondition_frequency"] == 1
    assert (rt["mode"], rt["refresh_policy"], rt["refresh_budget"], rt["install_delay"]) == \
        ("async", "drift", "auto", "auto")
    assert by["adamw"]["refresh"] is None
    # round policies: from f and S, every factor every f steps, ages S ... S + f - 1
    assert by["asteria-soap-sync"]["refresh"]["refreshes_per_factor_per_100"] == 25.0
    assert by["asteria-soap-sync"]["refresh"]["mean_age"] == 1.5
    assert by["asteria-soap-async-f4-s4"]["refresh"]["mean_age"] == 4 + 1.5
    auto = by["asteria-soap-async-auto"]["refresh"]
    assert auto["f"] >= 1 and auto["mean_age"] == auto["S"] + (auto["f"] - 1) / 2
    # drift: measured, within its budget's share and its age bound
    dr = by["asteria-soap-drift"]["refresh"]
    assert dr["policy"] == "drift" and 0 < dr["budget"] <= 1 and dr["factors"] > 0
    assert 0 < dr["refreshes_per_factor_per_100"] <= 100
    assert 0 <= dr["mean_age"] <= dr["max_age"] <= dr["max_age_bound"]
    for name in runs[2:]:
        assert by[name]["round_steps"]["job_stretch"] == users["round_steps"]["job_stretch"]
        assert by[name]["full_round"]["R"] > 0
    assert "full_round" not in by["asteria-soap-sync"]


def test_bench_convergence_run_names():
    bc = load_bench("bench_convergence")
    assert bc.variant("asteria-soap-async-f1-s0") == ("asteria-soap-async", 1, 0)
    assert bc.variant("asteria-soap-sync-f10") == ("asteria-soap-sync", 10, None)
    assert bc.variant("asteria-soap-async") is None and bc.variant("adamw") is None
    assert bc.variant("asteria-soap-async-f0") is None
    assert bc.variant("asteria-soap-drift") is None and bc.known_run("asteria-soap-drift")
    assert bc.grid_of("asteria-soap-async-auto", bc.GRIDS) == bc.GRIDS["asteria-soap-async"]
    f, keys = bc.policy_run("asteria-soap-drift-b10")
    assert f == 1 and keys["refresh_budget"] == 0.1 and keys["install_delay"] == "auto"
    assert keys["refresh_policy"] == "drift" and bc.known_run("asteria-soap-drift-b10")
    assert bc.policy_run("asteria-soap-drift-b0") is None and not bc.known_run("asteria-soap-drift-b")
    with pytest.raises(ValueError, match="staleness 3 > precondition_frequency 2"):
        bc.variant("asteria-soap-async-f2-s3")
    assert bc.at_time([0.0, 1.0, 3.0], [4.0, 2.0, 1.0], 2.0) == pytest.approx(1.5)
    assert bc.at_time([0.0, 1.0], [4.0, 2.0], 5.0) == 2.0
    assert bc.at_time([0.0, 1.0], [4.0, 2.0], -1.0) == 4.0


@pytest.mark.timeout(HANG_GUARD_S)
def test_bench_moe_quick(tmp_path):
    """bench_moe.py on its quick model (d=16, 8 experts, top-2) in OLMo-core's flat layout:
    the MoE model's loss is the cross-entropy (the balancing term adds a gradient only) and
    does not depend on the layout; soap-experts keeps per-expert factors (num_experts), soap-plain
    the whole tensors'; bench_convergence's procedure (sweep, lockstep runs, time ratios)."""
    bm = load_bench("bench_moe")
    _restores(lambda: bm.main(
        ["--quick", "--no-plot", "--out-dir", str(tmp_path), "--layout", "flat", "--extend", "1",
         "--lrs", "adamw=3e-3,6e-3", "--lrs", "soap-experts=1e-2,2e-2",
         "--lrs", "soap-plain=1e-2,2e-2"]))
    data = json.loads((tmp_path / "bench_moe.json").read_text())
    assert "--quick" in data["command"] and data["versions"]["asteria"]
    assert data["machine"]["uptime_start"] and data["machine"]["uptime_end"]
    m = data["model"]
    d, h = m["d"], 4 * m["d"]
    assert (m["experts"], m["top_k"], m["layout"]) == (8, 2, "flat")
    assert m["expert_weight_shapes"] == [[8 * d, h], [8 * h, d]]
    res = data["results"]
    assert res["seeds"] == [0, 1] and res["optimizers"] == ["adamw", "soap-experts", "soap-plain"]
    for name, lr in res["tuned_lr"].items():
        assert lr in res["lrs_tried"][name]
    kw = {r["optimizer"]: r["kwargs"] for r in res["runs"] if r["seed"] == 0}
    assert kw["soap-experts"]["expert_weights_num_experts"] == 8
    assert kw["soap-plain"]["expert_weights_num_experts"] is None
    for name in ("soap-experts", "soap-plain"):
        assert kw[name]["runtime"]["mode"] == "async" and kw[name]["runtime"]["staleness"] == 0
    steps = data["settings"]["steps"]
    for r in res["runs"]:
        assert r["steps_run"] == steps and all(math.isfinite(x) for x in r["losses"])
        assert res["final_loss_at_equal_steps"][r["optimizer"]][str(r["seed"])] == \
            r["smoothed"][-1]
    for seed, t in res["time_to_adamw_final"].items():
        adamw = next(r for r in res["runs"] if r["optimizer"] == "adamw" and
                     r["seed"] == int(seed))
        assert t["target"] == adamw["smoothed"][-1]
        for name, q in t["runs"].items():
            run = next(r for r in res["runs"] if r["optimizer"] == name and
                       r["seed"] == int(seed))
            if q["reached"]:
                assert run["smoothed"][q["step"] - 1] <= t["target"]
                assert q["time_ratio"] == pytest.approx(q["time_s"] / t["adamw_wall_s"])
            else:
                assert min(run["smoothed"]) > t["target"]
    # the expert weights' state (one layer): per-expert d^2 + h^2 factors and eigenbases
    # against the whole tensors' (8 d)^2 + h^2 and (8 h)^2 + d^2; the same Adam moments
    mem = res["memory"]
    kinds = {n: mem[n]["by_kind"] for n in ("adamw", "soap-experts", "soap-plain")}
    assert kinds["soap-experts"]["factors"] == 4 * 2 * 8 * (d * d + h * h)
    assert kinds["soap-plain"]["factors"] == 4 * ((8 * d) ** 2 + h * h + (8 * h) ** 2 + d * d)
    for n in ("soap-experts", "soap-plain"):
        assert kinds[n]["eigenbases"] == kinds[n]["factors"] and kinds[n]["expert_other"] == 0
        assert mem[n]["tiers"]["source"] == "asteria_stats"
        assert mem[n]["memory_plan"]["peak_total"] >= mem[n]["tiers"]["total"] > 0
    assert {k["moments"] for k in kinds.values()} == {4 * 2 * 2 * 8 * d * h}

    problem = bm.make_problems(bm.parse_args(["--quick", "--seeds", "0", "--layout", "flat"]))[0]
    model = problem.model()
    x, y = problem.batches[0]
    loss = model(x, y)
    assert float(loss.detach()) == float(torch.nn.functional.cross_entropy(
        model(x).view(-1, model.c.vocab), y.view(-1)).detach())
    loss.backward()
    grads = [b.moe.router.weight.grad.clone() for b in model.blocks]
    model.zero_grad()
    model.c.balance = 0.0  # without the balancing term the router's gradient changes
    model(x, y).backward()
    assert not all(torch.equal(g, b.moe.router.weight.grad) for g, b in zip(grads, model.blocks))
    three = bm.make_problems(bm.parse_args(["--quick", "--seeds", "0"]))[0]
    assert three.cfg.layout == "3d"
    assert float(three.model()(x, y).detach()) == float(loss.detach())


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples",
                                                                     f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(HANG_GUARD_S)
def test_main_job_tiny(tmp_path):
    """The main job (examples/main_job.py, `bash scripts/run_main.sh`) on its tiny settings:
    the three parts run, their tables print, main.json holds each answer under the keys the
    README names and main.png is written. No timing is asserted; what is checked is how each
    answer follows from what was measured. Part 3's cap is set above every peak here (the
    tiny model's two peaks are too close for a cap between them), so the three runs complete
    and Asteria's capped parameters (float32 and int8 tiers) equal their uncapped runs'."""
    mj = load_example("main_job")
    t0 = time.perf_counter()
    out = _restores(lambda: mj.main(["--tiny", "--out-dir", str(tmp_path), "--mem-cap-mib",
                                     "4096"]))
    elapsed = time.perf_counter() - t0
    assert (tmp_path / "main.png").exists()
    data = json.loads((tmp_path / "main.json").read_text())
    assert data["time_to_loss"] == out["time_to_loss"]
    for key in ("date", "command", "machine", "versions", "git_dirty", "load", "training_s",
                "time_to_loss", "spikes", "memory_cap", "targets", "details"):
        assert key in data, key
    assert data["versions"]["git_commit"] and data["tiny"] is True
    assert set(data["load"]) == {"start", "end", "time_to_loss", "spikes", "memory_cap"}
    assert data["training_s"]["total"] <= elapsed

    # part 1: time to loss; AdamW's final loss is the target, reached at its last step
    tl = data["time_to_loss"]
    runs = {"adamw", "asteria_soap", "native_soap", "native_soap_f1"}
    assert set(tl) == runs | {"best_native", "asteria_time_over_best_native"}
    # Asteria at the f it chose ("auto", chosen at its second step), native SOAP at 10 and 1
    assert isinstance(tl["asteria_soap"]["frequency"], int) and tl["asteria_soap"]["frequency"] >= 1
    assert tl["native_soap"]["frequency"] == 10 and tl["native_soap_f1"]["frequency"] == 1
    assert tl["adamw"]["frequency"] is None
    # the best native SOAP: the one that reaches AdamW's loss first; Asteria's time over its
    reached = {n: tl[n]["time_to_adamw_final_s"] for n in ("native_soap", "native_soap_f1")
               if tl[n]["time_to_adamw_final_s"] is not None}
    if reached:
        best = min(reached, key=reached.get)
        assert tl["best_native"] == best
        a = tl["asteria_soap"]["time_to_adamw_final_s"]
        assert tl["asteria_time_over_best_native"] == (None if a is None else
                                                        pytest.approx(a / reached[best]))
    else:
        assert tl["best_native"] is None and tl["asteria_time_over_best_native"] is None
    tl = {n: tl[n] for n in runs}
    for name, r in tl.items():
        assert {"time_ratio", "final_loss", "lr"} <= set(r), name
        assert r["lr"] > 0 and math.isfinite(r["final_loss"])
    d1 = data["details"]["time_to_loss"]
    assert tl["adamw"]["final_loss"] == d1["adamw_final_loss"]
    assert tl["adamw"]["steps_to_adamw_final"] == d1["steps"] == 12
    assert tl["adamw"]["time_ratio"] == pytest.approx(1.0, abs=1e-2)  # times kept to 0.1 ms
    for name, r in tl.items():
        cv = d1["curves"][name]
        assert len(cv["smoothed"]) == len(cv["time_s"]) == 12
        assert cv["time_s"] == sorted(cv["time_s"])  # each run's own clock (lockstep)
        if r["time_ratio"] is None:
            assert min(cv["smoothed"]) > d1["adamw_final_loss"]
        else:
            k = r["steps_to_adamw_final"] - 1
            assert cv["smoothed"][k] <= d1["adamw_final_loss"] < min(cv["smoothed"][:k] + [9])
            assert r["time_ratio"] == pytest.approx(cv["time_s"][k] / tl["adamw"]["wall_s"])

    # part 2: native SOAP refreshes inline every f steps, Asteria snapshots on the same steps
    # and installs S later; the statistics are the step times' after the warm-up
    sp, d2 = data["spikes"], data["details"]["spikes"]
    m = d2["model"]
    f, S, w = m["frequency"], m["staleness"], m["warmup"]
    # Asteria runs the rest of the same schedule stretched over more steps
    assert m["asteria_steps"] > m["steps"]
    lr_n, lr_a = d2["per_step"]["native_soap"]["lr"], d2["per_step"]["asteria_soap"]["lr"]
    assert lr_a[0] == lr_n[0] and lr_a[-1] == pytest.approx(lr_n[-1])
    assert all(a >= b for a, b in zip(lr_a, lr_a[1:]))  # past the warm-up: cosine decay only
    for name, n in (("native_soap", m["steps"]), ("asteria_soap", m["asteria_steps"])):
        r = sp[name]
        assert r["steps"] == n == len(d2["per_step"][name]["step_ms"])
        assert {"median_ms", "p99_ms", "max_ms"} <= set(r)
        assert 0 < r["median_ms"] <= r["p99_ms"] <= r["max_ms"]
        steps = d2["per_step"][name]["step_ms"][w:]
        assert r["max_ms"] == pytest.approx(max(steps), abs=1e-3)
        assert r["max_over_median"] == pytest.approx(r["max_ms"] / r["median_ms"])
        assert r["steps_over_2x_median"] == [w + 1 + i for i, t in enumerate(steps)
                                             if t > 2 * r["median_ms"]]
        assert r["refresh_steps"] == [i for i in range(w + 1, n + 1) if (i - 1) % f == 0]
    assert sp["native_soap"]["install_steps"] == sp["native_soap"]["refresh_steps"]
    assert sp["asteria_soap"]["install_steps"] == [
        i + S for i in sp["asteria_soap"]["refresh_steps"] if i + S <= m["asteria_steps"]]
    assert sp["target_loss"] == sp["native_soap"]["final_loss"]
    tn, ta = sp["native_soap"]["time_to_target_s"], sp["asteria_soap"]["time_to_target_s"]
    assert tn is not None and tn <= sp["native_soap"]["wall_s"] + 1e-9
    assert sp["asteria_time_over_native"] == (None if ta is None else pytest.approx(ta / tn))
    # the loss both reach: the higher final; each reaches it, native's final at its own end
    assert sp["common_loss"] == max(sp["native_soap"]["final_loss"],
                                    sp["asteria_soap"]["final_loss"])
    cn, ca = sp["native_soap"]["time_to_common_loss_s"], sp["asteria_soap"]["time_to_common_loss_s"]
    assert cn is not None and ca is not None
    assert sp["asteria_time_over_native_common_loss"] == pytest.approx(ca / cn)
    if ta is not None:
        assert sp["common_loss"] == sp["target_loss"] and ca == ta

    # part 3: the memory cap (or why it was skipped)
    mc = data["memory_cap"]
    assert {"cap_mib", "native", "asteria", "asteria_equal_uncapped", "peak_mib",
            "asteria_int8"} <= set(mc)
    if mc.get("skipped"):
        assert mc["cap_mib"] is None and "cgroup" in mc["skipped"]
        assert "memory_cap" not in data["targets"] and "memory_cap_int8" not in data["targets"]
    else:
        assert mc["cap_mib"] == 4096
        assert mc["native"] == mc["asteria"] == "completed"
        assert mc["asteria_equal_uncapped"] is True
        p = mc["peak_mib"]
        assert all(p[k] > 0 for k in ("native_uncapped", "asteria_uncapped", "native_capped",
                                      "asteria_capped"))
        runs = data["details"]["memory_cap"]["uncapped"]
        assert runs["asteria-nvme"]["nvme_mib"] > 0 and runs["soap-native"]["nvme_mib"] == 0
        # completing is not enough: the target asks for native SOAP to be killed
        assert data["targets"]["memory_cap"]["met"] is False
        # the int8 tier: its own row, a quarter of the bytes (and scales) on NVMe and read
        q8 = mc["asteria_int8"]
        assert q8["status"] == "completed" and q8["equal_uncapped"] is True
        assert q8["uncapped_peak_mib"] > 0 and q8["capped_peak_mib"] > 0
        assert 0 < q8["nvme_read_mib"] < q8["float32_nvme_read_mib"]
        assert math.isfinite(q8["final_loss"])
        assert 0 < runs["asteria-nvme-int8"]["nvme_mib"] < runs["asteria-nvme"]["nvme_mib"]
        assert data["targets"]["memory_cap_int8"]["met"] == (
            q8["status"] == "completed" and q8["equal_uncapped"] is True
            and q8["nvme_read_mib"] < q8["float32_nvme_read_mib"])

    # the targets follow from the figures
    t = data["targets"]
    ratio = data["time_to_loss"]["asteria_time_over_best_native"]
    assert t["asteria_time_over_best_native"]["met"] == (
        ratio is not None and ratio <= mj.TARGETS["asteria_time_over_best_native_max"])
    assert t["native_max_over_median"]["met"] == (
        sp["native_soap"]["max_over_median"] >= mj.TARGETS["native_max_over_median_min"])
    assert t["asteria_max_over_median"]["met"] == (
        sp["asteria_soap"]["max_over_median"] <= mj.TARGETS["asteria_max_over_median_max"])
    limit = mj.TARGETS["asteria_time_over_native_max"]
    assert t["asteria_time_to_native_final"]["met"] == (ta is not None and ta / tn <= limit)
    assert t["asteria_time_to_common_loss"]["met"] == (ca / cn <= limit)


@pytest.mark.timeout(HANG_GUARD_S)
def test_main_job_memory_verdict_of_killed_runs(tmp_path):
    """Part 3's verdict from real capped runs (bench_memory_cap.run_capped_configs) where the
    cap is below what importing torch takes: all three (native SOAP, Asteria at float32 and at
    int8) are OOM-killed, nothing is compared, and neither target is met."""
    mj = load_example("main_job")
    if mj.memcap.available()[0] is None:
        pytest.skip(f"no memory cgroup can be made here: {mj.memcap.available()[1]}")
    args = mj.parse_args(["--tiny", "--out-dir", str(tmp_path)])
    margs = mj.memory_args(args)
    os.makedirs(margs.dir_parent, exist_ok=True)
    cap = 64 << 20
    runs = mj.memory_bench.run_capped_configs(margs, cap, str(tmp_path), lambda msg: None,
                                              mj.MEMORY_CONFIGS)
    v = mj.memory_summary(cap, runs, {})
    assert v["cap_mib"] == 64 and v["native"] == v["asteria"] == "OOM-killed"
    assert v["asteria_equal_uncapped"] is False
    assert v["peak_mib"]["native_uncapped"] is None and v["peak_mib"]["native_capped"] <= 64
    q8 = v["asteria_int8"]
    assert q8["status"] == "OOM-killed" and q8["capped_peak_mib"] <= 64
    assert q8["nvme_read_mib"] is None and q8["final_loss"] is None
    t = mj.targets({"memory_cap": v})
    assert t["memory_cap"]["met"] is False and t["memory_cap_int8"]["met"] is False


def test_bench_memory_cap_tier_dtypes(capsys):
    """bench_memory_cap.py --tier-dtypes: the dtypes from asteria's one list, each configuration
    of --tier-dtype-configs at each dtype other than --tier-dtype, named with it and run with
    it as its runtime's tier_dtype; a dtype or configuration not allowed is refused, naming the
    option and what is allowed."""
    from asteria.config import TIER_DTYPES

    b = load_bench("bench_memory_cap")
    args = b.parse_args(["--tier-dtypes", "float32,int8,int4", "--tier-dtype-configs",
                         "asteria-nvme,asteria-host", "--out-dir", "/nonexistent"])
    cfgs = b.dtype_configs(args)
    assert cfgs == ["asteria-nvme-int8", "asteria-nvme-int4", "asteria-host-int8",
                    "asteria-host-int4"]
    assert [b.split_config(c) for c in cfgs[:2]] == [("asteria-nvme", "int8"),
                                                    ("asteria-nvme", "int4")]
    assert b.split_config("asteria-nvme") == ("asteria-nvme", None)
    assert b.spec_for(args, cfgs[1], "/d")["runtime_extra"] == {"tier_dtype": "int4"}
    assert b.spec_for(args, "asteria-nvme", "/d")["runtime_extra"] == {}
    assert b.dtype_configs(b.parse_args(["--out-dir", "/nonexistent"])) == []
    for argv, allowed in ((["--tier-dtypes", "int8,int2"], TIER_DTYPES),
                          (["--tier-dtype-configs", "adamw"], ("asteria-host", "asteria-nvme"))):
        with pytest.raises(SystemExit):
            b.parse_args(argv)
        err = capsys.readouterr().err
        assert argv[0] in err and all(a in err for a in allowed), err


def test_run_loops_takes_turns_of_consecutive_steps():
    """Lockstep turns are runs of consecutive steps (an Asteria run's worker jobs, started at a
    step's end, overlap its own next forward and backward), rotating who starts each round;
    a loop that ends mid-turn hands over at once."""
    common = load_bench("common")
    order = []

    class Loop:
        gc_policy = None

        def __init__(self, name, steps):
            self.name, self.left, self.done = name, steps, steps < 1

        def step(self):
            order.append(self.name)
            self.left -= 1
            self.done = self.left == 0
            return self.done

    common.run_loops([Loop("a", 5), Loop("b", 4), Loop("c", 0)], turn=2)
    assert "".join(order) == "aabbbbaaa"
    order.clear()
    common.run_loops([Loop("a", 3), Loop("b", 3)], turn=1)
    assert "".join(order) == "abbaab"


@pytest.mark.timeout(HANG_GUARD_S)
def test_gpu_bench_smoke_convergence(tmp_path):
    """benchmarks/gpu_bench.py (stages 5 and 6 of tests/gpu/run.sh) in its --smoke mode on the
    host: every optimizer's child process runs its steps and streams them back, AdamW first
    sets the convergence target, and the JSON holds the comparisons. The GPU machine is lent
    rarely; this is what keeps the script's logic working between its runs there."""
    import subprocess

    out = tmp_path / "gpu_convergence.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_bench.py"),
                           "--smoke", "--convergence", "--device", "cpu", "--no-plot",
                           "--out", str(out)], capture_output=True, text=True,
                           timeout=HANG_GUARD_S - 10)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["asteria_import_error"] is None
    assert data["settings"]["tokens_over_widest"] >= 16
    runs = {r["optimizer"]: r for r in data["results"]}
    assert list(runs) == ["adamw", "soap-async", "soap-sync"]
    for r in runs.values():
        assert r["returncode"] == 0 and not r["timed_out"]
        assert r["steps_run"] == data["settings"]["steps"] == len(r["losses"])
        assert all(math.isfinite(x) for x in r["losses"])
    conv = data["convergence"]
    assert conv["adamw_complete"]
    assert conv["adamw_final_loss"] == pytest.approx(runs["adamw"]["smoothed"][-1])
    assert set(conv["runs"]) == {"soap-async", "soap-sync"}
    assert data["comparisons"]["async_over_sync_median_ms"] > 0
