"""Optimizer-state bytes per memory tier: native sync SOAP vs Asteria SOAP (async).

Three configurations train the same TinyGPT (same weights, seed, batches) for f + S + 2 steps,
past the first refresh's install, so every piece of state exists:
  soap-sync         the native reference (everything on the training device),
  soap-async-auto   Asteria, eigenbases in host memory, asked for (placement {"eigenbases":
                    "host"}: on a CPU parameter "auto" keeps them in optimizer.state); with no
                    device budget the device staging ring is bounded: max(one block's
                    eigenbases, 1/8 of the staged bytes), at most 64 MiB,
  soap-async-devbudget  Asteria, device_budget_bytes = native's device bytes minus
                    --ring-cut of soap-async-auto's host bytes: the ring shrinks to fit and the
                    step streams the eigenbases through it in chunks,
  soap-async-nvme   Asteria, host_budget_bytes a fraction of soap-async-auto's host bytes and an
                    nvme_dir in a fresh temporary directory (on the project's filesystem by
                    default), so the eigenbases past the budget live on the NVMe tier.
Bytes per tier (device, host_pinned, host, uvm, nvme) come from optimizer.asteria_stats()'s
bytes_<tier> keys (the runtime's own accounting); the JSON also keeps a scan of
optimizer.state, the planner's decisions and the NVMe traffic counters. On a CPU-only machine
"device" is the host memory the parameters live in (DESIGN.md's tier of the training device).

Writes benchmarks/results/bench_tiers.json and bench_tiers.png (stacked bars, MiB per tier).

    python3 benchmarks/bench_tiers.py                    # default: well under a minute
    python3 benchmarks/bench_tiers.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from bench_convergence import (PRESETS, build_problem, make_with_wide_mask,  # noqa: E402
                               placement, train_curve)

import asteria  # noqa: E402

NAME = "bench_tiers"
LR = 3e-3
CONFIGS = ("soap-sync", "soap-async-auto", "soap-async-devbudget", "soap-async-nvme")
COLORS = {"device": "tab:red", "host_pinned": "tab:orange", "host": "tab:blue",
          "uvm": "tab:purple", "nvme": "tab:green"}


def runtime_for(name: str, args, worker_cpus: Optional[str], host_budget: Optional[int],
                device_budget: Optional[int], nvme_dir: Optional[str]) -> dict[str, Any]:
    if name == "soap-sync":
        return {"mode": "sync"}
    # the host tier asked for: under "auto" a CPU parameter's eigenbases stay in place
    rt: dict[str, Any] = {"mode": "async", "staleness": args.staleness, "workers": args.workers,
                          "placement": {"eigenbases": "host"}}
    if worker_cpus:
        rt["cpuset"] = worker_cpus
    if name == "soap-async-devbudget":
        rt["device_budget_bytes"] = device_budget
    if name == "soap-async-nvme":
        rt["host_budget_bytes"] = host_budget
        rt["nvme_dir"] = nvme_dir
    return rt


def host_side(tiers: dict[str, int]) -> int:
    return tiers["host"] + tiers["host_pinned"] + tiers["uvm"]


def measure(name: str, rt: dict, args, problem, steps: int, nvme_dir: str,
            log: common.Progress) -> dict[str, Any]:
    model = problem.model()
    opt = make_with_wide_mask(lambda: asteria.SOAP(
        model.parameters(), lr=LR, precondition_frequency=args.frequency, runtime=rt))
    try:
        curve = train_curve(model, opt, problem, steps, window=1, label=name, log=log,
                            log_every=steps, warmup=1)
        stats = common.runtime_stats(opt)
        tiers = common.tier_bytes(opt, "cpu", stats)
        plan = opt.asteria_plan() if hasattr(opt, "asteria_plan") else []
        records = len(os.listdir(nvme_dir)) if name == "soap-async-nvme" else 0
    finally:
        opt.close()
    return {
        "config": name, "runtime": rt, "steps": curve["steps_run"],
        "bytes_per_tier": tiers, "plan": plan, "nvme_record_files": records,
        "nvme": {k: stats.get(k) for k in ("bytes_nvme_read", "bytes_nvme_written",
                                           "nvme_read_MBps", "nvme_write_MBps")},
        "runtime_counters": common.pick_runtime_counters(stats),
        "asteria_stats": stats, "step_summary": curve["summary"],
        "final_loss": curve["final_loss"], "losses": curve["losses"],
        "loadavg1_end": common.loadavg(),
    }


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    torch.set_num_threads(args.threads)
    pin = placement()
    steps = args.frequency + args.staleness + 2
    problem = build_problem(args.model_size, steps, args.seed)
    os.makedirs(args.nvme_parent, exist_ok=True)
    nvme_dir = tempfile.mkdtemp(prefix="asteria-tiers-nvme-", dir=args.nvme_parent)
    log(f"TinyGPT preset {args.model_size}, {steps} steps per configuration (f={args.frequency}, "
        f"S={args.staleness}); nvme_dir {nvme_dir}; load {common.loadavg()}")
    results: list[dict] = []
    failures: list[dict] = []
    host_budget, device_budget = args.host_budget_bytes, None
    try:
        for name in args.configs:
            by = {r["config"]: r for r in results}
            eig = (host_side(by["soap-async-auto"]["bytes_per_tier"]["tiers"])
                   if "soap-async-auto" in by else None)
            if name == "soap-async-nvme" and args.host_budget_bytes is None:
                host_budget = None if eig is None else int(eig * args.host_budget_fraction)
            if name == "soap-async-devbudget":
                device_budget = (None if eig is None or "soap-sync" not in by else
                                 by["soap-sync"]["bytes_per_tier"]["tiers"]["device"]
                                 - int(eig * args.ring_cut))
            if ((name == "soap-async-nvme" and host_budget is None)
                    or (name == "soap-async-devbudget" and device_budget is None)):
                why = "skipped: its budget derives from the soap-sync / soap-async-auto results"
                log(f"config {name} {why}")
                failures.append({"config": name, "error": why})
                continue
            rt = runtime_for(name, args, pin["worker_cpus"], host_budget, device_budget,
                             nvme_dir)
            log(f"config {name}: runtime {rt}")
            try:
                r = measure(name, rt, args, problem, steps, nvme_dir, log)
            except Exception as e:  # one configuration failing must not hide the others
                log(f"config {name} FAILED: {type(e).__name__}: {e}")
                failures.append({"config": name, "runtime": rt,
                                 "error": f"{type(e).__name__}: {e}"})
                gc.collect()
                continue
            results.append(r)
            t = r["bytes_per_tier"]["tiers"]
            log(f"config {name}: " + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in t.items()))
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)

    by = {r["config"]: r for r in results}
    derived: dict[str, Any] = {}
    if "soap-sync" in by:
        native_dev = by["soap-sync"]["bytes_per_tier"]["tiers"]["device"]
        for name, r in by.items():
            t = r["bytes_per_tier"]["tiers"]
            derived[name] = {
                "device_fraction_of_native": t["device"] / native_dev if native_dev else None,
                "total_fraction_of_native": (r["bytes_per_tier"]["total"]
                                             / by["soap-sync"]["bytes_per_tier"]["total"]),
                "off_device_bytes": host_side(t) + t["nvme"],
            }
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {
        **meta,
        "settings": {"steps": steps, "frequency": args.frequency, "staleness": args.staleness,
                     "workers": args.workers, "torch_threads": args.threads, "lr": LR,
                     "seed": args.seed, "quick": args.quick, "pinning": pin,
                     "host_budget_bytes": host_budget, "device_budget_bytes": device_budget,
                     "ring_cut": args.ring_cut,
                     "host_budget_fraction": (None if args.host_budget_bytes is not None
                                              else args.host_budget_fraction),
                     "nvme_parent": os.path.abspath(args.nvme_parent),
                     "tier_note": "device = memory of the training device (on a CPU run: host "
                                  "memory where the parameters live); bytes from "
                                  "asteria_stats() bytes_<tier> where reported (source field)"},
        "model": problem.describe(),
        "derived": derived,
        "results": results,
        "failures": failures,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    results = data["results"]
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = range(len(results))
    bottom = [0.0] * len(results)
    for t in common.TIERS:
        ys = [r["bytes_per_tier"]["tiers"][t] / 2**20 for r in results]
        if not any(ys):
            continue
        bars = ax.bar(xs, ys, 0.6, bottom=bottom, label=t, color=COLORS[t])
        ax.bar_label(bars, labels=[f"{y:.1f}" if y else "" for y in ys], label_type="center",
                     fontsize=8, color="white")
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(list(xs), [f"{r['config']}\n({r['bytes_per_tier']['source']})"
                             for r in results], fontsize=8)
    hb = data["settings"]["host_budget_bytes"]
    ax.set(ylabel="optimizer state (MiB)",
           title="Optimizer-state bytes per tier" +
                 (f" (nvme config: host budget {hb / 2**20:.1f} MiB)" if hb else ""))
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    if data["failures"]:
        ax.text(0.02, 0.98, "\n".join(f"{f['config']} failed: {f['error'][:70]}"
                                      for f in data["failures"]),
                transform=ax.transAxes, va="top", fontsize=7, color="tab:red")
    m = data["model"]
    fig.suptitle(f"SOAP on {m['params'] / 1e6:.2f}M-param TinyGPT (d={m['d']}, "
                 f"{m['layers']} layers), device = training device memory", fontsize=9)
    common.write_png(fig, path)


def print_table(data: dict) -> None:
    for f in data["failures"]:
        print(f"config {f['config']} FAILED: {f['error']}")
    hdr = f"{'config':<18}" + "".join(f"{t + ' MiB':>16}" for t in common.TIERS) + f"{'dev/native':>12}"
    common.print_header(hdr)
    for r in data["results"]:
        t = r["bytes_per_tier"]["tiers"]
        frac = data["derived"].get(r["config"], {}).get("device_fraction_of_native")
        print(f"{r['config']:<18}" + "".join(f"{t[k] / 2**20:>16.2f}" for k in common.TIERS)
              + f"{'-' if frac is None else format(frac, '.3f'):>12}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-size", choices=sorted(PRESETS), default=None,
                    help="TinyGPT preset (default conv; --quick tiny)")
    ap.add_argument("--frequency", type=int, default=None, help="precondition_frequency (10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=None, help="staleness S (5; --quick 2)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--host-budget-bytes", type=int, default=None,
                    help="host budget of soap-async-nvme (default: --host-budget-fraction of "
                         "soap-async-auto's host bytes)")
    ap.add_argument("--host-budget-fraction", type=float, default=0.25)
    ap.add_argument("--ring-cut", type=float, default=0.5,
                    help="soap-async-devbudget: fraction of the eigenbasis bytes taken off "
                         "native's device bytes for the device budget")
    ap.add_argument("--nvme-parent", default=os.path.join(common.RESULTS_DIR, "tmp"),
                    help="where the temporary nvme_dir is made (default benchmarks/results/tmp, "
                         "on the project's filesystem)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(model_size="tiny" if q else "conv", frequency=4 if q else 10,
                                    staleness=2 if q else 5,
                                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q
                                    else common.RESULTS_DIR))
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}; allowed: {', '.join(CONFIGS)}")
    args.configs = sorted(configs, key=CONFIGS.index)
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    if not 0.0 <= args.host_budget_fraction < 1.0:
        ap.error("--host-budget-fraction must be in [0, 1)")
    if not 0.0 <= args.ring_cut < 1.0:
        ap.error("--ring-cut must be in [0, 1)")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
