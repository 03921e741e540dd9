"""Smoke tests of benchmarks/bench_step_time.py and benchmarks/bench_core_contention.py: a --quick
run into tmp_path writes a result file with the metadata and sane statistics. They run in this
process through main(argv) (no second torch import), which restores the thread count and CPU
affinity."""

import importlib.util
import json
import math
import os

import pytest
import torch

pytest.importorskip("asteria._C")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench(name="bench_step_time"):
    script = os.path.join(ROOT, "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(60)
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
