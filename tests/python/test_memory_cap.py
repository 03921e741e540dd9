"""Training under a memory cap of the kernel (a memory cgroup, v1 or v2; benchmarks/memcap.py).

 - the cap itself: a child that allocates past it is killed by the kernel's OOM killer, one that
   stays below completes, and the group's peak is measured;
 - four 1024 x 1024 linear layers, SOAP with precondition_frequency 10, 12 steps, one torch
   thread, each run a fresh process (benchmarks/bench_memory_cap.py's worker): native SOAP
   (mode="sync") and Asteria (async, S=5, host_budget_bytes 1 MiB, nvme_dir) run in groups
   capped at the machine's memory; the planner's peak figures (asteria_plan()) bound the
   measured difference of their anonymous peaks;
 - the capped run: Asteria's NVMe configuration peaks at least 0.8 x the eigenbasis bytes
   below native SOAP (NVMe blocks stream through bounded buffers, installs are written through,
   one m rotation at a time, freed heap pages handed back: docs/memory.md), so a cap one
   round's results (plus 16 MiB) above Asteria's uncapped peak (the kernel's figure) and below
   native SOAP's OOM-kills native SOAP while Asteria completes, bitwise equal to its uncapped
   run.
Skipped, with the reason, where no memory cgroup can be made (no controller, no permission)."""

import importlib.util
import os
import sys

import pytest
import torch

from models import require_c_extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks")
MiB = 1 << 20


def load(name):
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


memcap = load("memcap")
bench = load("bench_memory_cap")


class Args:
    width, layers, batch, steps, freq, staleness, seed = 1024, 4, 256, 12, 10, 5, 0
    host_budget = 1 << 20


EIG = Args.layers * 2 * Args.width ** 2 * 4  # the eigenbases Asteria moves to NVMe: 32 MiB


def need_cgroup():
    kind, why = memcap.available()
    if kind is None:
        pytest.skip(f"no memory cgroup can be made here: {why}")
    return kind


def run(cfg, cap, tmp, tag):
    nvme = os.path.join(tmp, f"nvme-{cfg}-{tag}")
    os.makedirs(nvme)
    out = os.path.join(tmp, f"{cfg}-{tag}.pt")
    spec = bench.spec_for(Args, cfg, nvme, out)
    r = memcap.run_capped(bench.child_cmd(spec), cap, 900, env=bench.child_env())
    r["result"] = bench.parse_result(r["stdout"])
    r["params"] = out
    return r


@pytest.mark.timeout(120)
def test_cap_kills_past_it_and_spares_below():
    need_cgroup()
    # The hog holds its memory for 0.5 s: the anonymous peak is sampled every 20 ms.
    hog = [sys.executable, "-c", "import sys, time; b = bytearray(int(sys.argv[1])); "
           "b[::4096] = b'x' * len(b[::4096]); time.sleep(0.5); print('done')"]
    big = memcap.run_capped(hog + [str(256 * MiB)], 96 * MiB, 60)
    assert big["killed_by_oom"] and big["returncode"] != 0 and "done" not in big["stdout"]
    small = memcap.run_capped(hog + [str(32 * MiB)], 96 * MiB, 60)
    assert small["returncode"] == 0 and not small["killed_by_oom"] and "done" in small["stdout"]
    # the cap bounds what the group holds, sampled or not; the hog's 32 MiB are in the kernel's
    # own peak of the group, which is never missed (the 20 ms samples of anonymous memory can
    # miss its 0.5 s when the sampler is starved): that where the kernel keeps one
    assert small["anon_peak_bytes"] <= 96 * MiB
    peak = small["cgroup_peak_bytes"]
    assert 32 * MiB <= (small["anon_peak_bytes"] if peak is None else peak) <= 96 * MiB


@pytest.fixture(scope="module")
def uncapped(tmp_path_factory):
    require_c_extension()
    need_cgroup()
    tmp = str(tmp_path_factory.mktemp("memcap"))
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    native = run("soap-native", machine, tmp, "uncapped")
    ref = run("asteria-nvme", machine, tmp, "uncapped")
    assert native["returncode"] == 0 and ref["returncode"] == 0, (native["stderr"][-2000:],
                                                                  ref["stderr"][-2000:])
    return tmp, native, ref


@pytest.mark.timeout(1200)
def test_planner_peak_bounds_the_measured_difference(uncapped):
    # Same model, batches and process; only the optimizer's memory differs, so the difference
    # of the anonymous peaks is at most the difference of the planner's peak figures (the
    # "peak optimizer-state bytes" line of asteria_plan()), with 32 MiB for the allocator.
    _, native, ref = uncapped
    measured = ref["anon_peak_bytes"] - native["anon_peak_bytes"]
    planned = (ref["result"]["memory_plan"]["peak_total"]
               - native["result"]["memory_plan"]["peak_total"])
    assert measured <= planned + 32 * MiB, (measured / MiB, planned / MiB)
    assert ref["result"]["stats"]["bytes_nvme"] >= 0.9 * EIG


@pytest.mark.timeout(1200)
def test_native_soap_is_oom_killed_where_asteria_nvme_completes_bitwise(uncapped):
    tmp, native, ref = uncapped
    pn, pa = native["anon_peak_bytes"], ref["anon_peak_bytes"]
    assert pa <= pn - 0.8 * EIG, (pn / MiB, pa / MiB)
    # The cap sits above Asteria's need and below native SOAP's. Native's need differs from run
    # to run by up to ~120 MiB (759-879 MiB anonymous measured on this model), so it is bounded
    # below by this run's sampled anonymous peak. Asteria's is bounded above by the kernel's own
    # peak of its group (memory.max_usage_in_bytes / memory.peak: anonymous plus page cache,
    # never missed between samples, where the 20 ms samples of anonymous memory can miss a
    # short-lived buffer of the worker's round when the sampler is starved). Timing decides
    # whether one round's results (an eigenbasis per factor: EIG bytes, held from the end of its
    # jobs to its install, docs/memory.md) are alive at the step's peak, so one run's peak may
    # lack them and the next include them: the cap gives Asteria EIG above its uncapped kernel
    # peak, plus 16 MiB for the allocator (measured here: capped peaks at most 24 MiB above
    # the uncapped ones). Native must still need more than the cap.
    need_a = max(pa, ref["cgroup_peak_bytes"] or 0)
    cap = need_a + EIG + 16 * MiB
    told = dict(native_anon=pn / MiB, asteria_anon=pa / MiB, asteria_kernel_peak=need_a / MiB,
                cap=cap / MiB)
    assert cap < pn, told

    capped_native = run("soap-native", cap, tmp, "capped")
    assert capped_native["killed_by_oom"] and capped_native["result"] is None, (
        told, capped_native["returncode"], capped_native["cgroup_peak_bytes"] / MiB)

    capped = run("asteria-nvme", cap, tmp, "capped")
    assert capped["returncode"] == 0 and not capped["killed_by_oom"], (
        told, capped["returncode"], capped["killed_by_oom"], capped["cgroup_peak_bytes"] / MiB,
        capped["anon_peak_bytes"] / MiB, capped["stderr"][-2000:])
    assert capped["result"]["stats"]["bytes_nvme_read"] > 0
    a, b = torch.load(ref["params"]), torch.load(capped["params"])
    assert all(torch.equal(x, y) for x, y in zip(a, b))
