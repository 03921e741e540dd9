"""Smoke test of benchmarks/run_suite.py: the cheap parts (tiers, pool vs torch, NVMe) with
--quick into tmp_path, as a child process like a person would run it; then the JSON each part
and the suite wrote: metadata (machine, load, versions, command), the fields the summary reads,
and numbers that make sense. Plus the pure helpers of bench_convergence (smoothing, the time to
AdamW's final loss) and the suite's part selection. Under a minute on 2 idle cores."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

import asteria

pytest.importorskip("asteria._C")

# the benchmark scripts: checked once, in the main environment (scripts/run_tests.sh)
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
TIERS = {"device", "host_pinned", "host", "uvm", "nvme"}


def load(name):
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def check_meta(data, benchmark):
    assert data["benchmark"] == benchmark
    for key in ("date", "command", "cwd", "machine", "versions"):
        assert key in data, key
    assert "--quick" in data["command"] and benchmark in data["command"]
    m = data["machine"]
    assert m["nproc"] >= 1 and m["cpu_model"]
    assert "loadavg1" in m and "loadavg1_end" in m
    assert len(m["loadavg"]) == len(m["loadavg_end"]) == 3  # os.getloadavg() at start and end
    assert data["versions"]["torch"] and data["versions"]["asteria"]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite")
    env = dict(os.environ)
    # the package under test (the installed one in the project's test command)
    pkg_root = os.path.dirname(os.path.dirname(asteria.__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, os.path.join(BENCH, "run_suite.py"), "--quick",
                        "--only", "tiers,pool,nvme", "--out-dir", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=170)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    return out, r.stdout


@pytest.mark.timeout(180)
def test_summary(suite):
    out, stdout = suite
    s = json.loads((out / "summary.json").read_text())
    assert s["benchmark"] == "run_suite" and s["quick"] is True
    assert "--only" in s["command"] and len(s["machine"]["loadavg"]) == 3
    assert set(s["parts"]) == {"c", "d", "e"}
    for key, p in s["parts"].items():
        assert p["ok"], (key, p.get("error"), p.get("output_tail"))
        assert p["rc"] == 0 and not p["timed_out"] and p["wall_s"] > 0
        assert "--quick" in p["command"] and os.path.exists(p["json"])
        assert p["png"] and os.path.exists(p["png"])
        assert p["metrics"] and all({"metric", "value", "note"} <= set(m) for m in p["metrics"])
    h = s["headline"]
    assert h["pool_over_torch_linalg_geomean_1_thread"] > 0
    assert h["convergence_soap_async_time_ratio"] is None  # (b) not run
    assert "benchmark suite summary" in stdout and "headline:" in stdout


@pytest.mark.timeout(180)
def test_tiers_json(suite):
    out, _ = suite
    d = json.loads((out / "bench_tiers.json").read_text())
    check_meta(d, "bench_tiers")
    by = {r["config"]: r for r in d["results"]}
    assert {"soap-sync", "soap-async-auto", "soap-async-nvme"} <= set(by)
    for name, r in by.items():
        b = r["bytes_per_tier"]
        assert set(b["tiers"]) == TIERS and b["source"] in ("asteria_stats", "optimizer.state")
        assert b["total"] == sum(b["tiers"].values()) > 0
        assert r["steps"] == d["settings"]["steps"]
        assert all(math.isfinite(x) for x in r["losses"])
    sync, auto, nv = by["soap-sync"], by["soap-async-auto"], by["soap-async-nvme"]
    assert sync["bytes_per_tier"]["tiers"]["host"] == sync["bytes_per_tier"]["tiers"]["nvme"] == 0
    assert auto["bytes_per_tier"]["tiers"]["host"] > 0 and auto["bytes_per_tier"]["tiers"]["nvme"] == 0
    t = nv["bytes_per_tier"]["tiers"]
    assert t["nvme"] > 0 and t["host"] <= d["settings"]["host_budget_bytes"]
    assert nv["nvme"]["bytes_nvme_written"] > 0 and nv["nvme_record_files"] > 0
    # the eigenbases are the same bytes wherever they live
    assert t["host"] + t["nvme"] == auto["bytes_per_tier"]["tiers"]["host"]
    assert not os.path.exists(nv["runtime"]["nvme_dir"])  # the temporary nvme_dir is gone


@pytest.mark.timeout(180)
def test_pool_json(suite):
    out, _ = suite
    d = json.loads((out / "bench_pool_vs_torch.json").read_text())
    check_meta(d, "bench_pool_vs_torch")
    s = d["settings"]
    assert {(r["op"], r["n"]) for r in d["results"]} == {(o, n) for o in s["ops"] for n in s["sizes"]}
    for r in d["results"]:
        assert r["jobs_per_round"] >= 4 and r["jobs_per_round"] % 2 == 0
        for mode in ("torch1", "pool1", "torch2", "pool2"):
            assert r[mode]["blocks_per_s"] > 0 and len(r[mode]["per_round_blocks_per_s"]) == s["rounds"]
        for key in ("ratio_pool1_torch1", "ratio_pool2_torch2", "ratio_pool2_pool1",
                    "ratio_pool2_torch_best"):
            assert 0 < r[key] < 1e4, (key, r[key])
        assert 0 < r["pool1"]["worker_utilisation"] <= 1.05
        c = r["check"]
        if r["op"] == "eigh":
            assert c["max_abs_eigenvalue_err_rel"] < 1e-4
        elif r["op"] == "inv_root":
            assert c["max_rel_err"] < 1e-3
        else:
            assert c["perm_equal"] and c["max_abs_err_up_to_sign"] < 1e-3
    assert d["geomean"]["ratio_pool1_torch1"] > 0


@pytest.mark.timeout(180)
def test_nvme_json(suite):
    out, _ = suite
    d = json.loads((out / "bench_nvme.json").read_text())
    check_meta(d, "bench_nvme")
    assert d["store_nvme_direct"] in (True, False) and d["page_cache"]
    assert d["filesystem"]["path"]
    assert [r["block_bytes"] for r in d["results"]] == d["settings"]["block_sizes"]
    for r in d["results"]:
        assert r["payload_bytes"] == r["blocks"] * r["block_bytes"] > 0
        for key in ("store_write_MBps", "store_read_MBps", "direct_write_MBps", "direct_read_MBps"):
            assert 0 < r[key] < 1e6, (key, r[key])
        assert r["ratio_write_store_direct"] > 0 and r["ratio_read_store_direct"] > 0
        rd = r["rounds"][0]
        assert rd["store_device_bytes_written"] >= r["payload_bytes"]
        assert rd["store_device_bytes_read"] >= r["payload_bytes"]
    assert not os.path.exists(d["filesystem"]["path"])  # the temporary nvme_dir is gone


def test_convergence_helpers():
    bc = load("bench_convergence")
    assert bc.smooth([4.0, 2.0, 3.0, 1.0], 2) == [4.0, 3.0, 2.5, 2.0]
    assert bc.first_reach([3.0, 2.5, 2.0, 2.2], 2.1) == 2
    assert bc.first_reach([3.0, 2.5], 1.0) is None
    run = {"smoothed": [3.0, 2.5, 2.0], "time_s": [1.0, 2.0, 3.0]}
    t = bc.time_to_target(run, 2.4, adamw_wall=6.0, n_steps=4)
    assert t == {"reached": True, "step": 3, "time_s": 3.0, "time_ratio": 0.5, "steps_ratio": 0.75}
    assert bc.time_to_target(run, 1.0, 6.0, 4)["reached"] is False


def test_suite_part_selection():
    rs = load("run_suite")
    assert [p.key for p in rs.select("e,a,tiers")] == ["a", "c", "e"]
    assert [p.key for p in rs.select(None)] == list("abcdef")
    with pytest.raises(SystemExit, match="unknown part 'zz'"):
        rs.select("a,zz")
