"""Reduced-precision tier storage: Asteria SOAP with its eigenbases stored in float32 against
bfloat16 (runtime key ``tier_dtype``), in the users' regime, at equal steps, on two seeds.

Every run trains examples/train_tiny.py's problem (bench_convergence.py's "users" setting:
TinyGPT d=128, 2 layers, context 128, batch 64 = 8,192 tokens a step, 16x the widest layer),
warm-up + cosine, Asteria SOAP async S=5 with deterministic install, lr 1e-2, f=10. Its
eigenbases live on the host tier (asked for: ``placement={"eigenbases": "host"}``). For each
seed (initial weights and batches), one run per tier dtype; reported per run:
  - bytes per tier (asteria_stats(), measured after the last step) and the planner's figures
    (asteria_memory_plan(): steady state and peak per tier);
  - final train loss (trailing mean of the last --window losses), the last step's loss, and the
    validation loss (mean over --val-batches fixed validation batches);
and per seed bfloat16 minus float32 for each loss. The noise level is float32's seed-to-seed
spread (|seed 0 - seed 1| of each loss): a difference within it is within noise.

The NVMe tier holds the same blocks in the same dtype (its runs are bitwise the host runs:
tests/python/test_nvme_training.py); a short run per dtype with every eigenbasis on NVMe
(host_budget_bytes=0, --nvme-steps steps) records its bytes and I/O.

Writes benchmarks/results/bench_tier_dtype.{json,png} (the JSON after every run too).

    python3 benchmarks/bench_tier_dtype.py               # 200 steps x 4 runs; ~10-20 min
    python3 benchmarks/bench_tier_dtype.py --quick --out-dir /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from bench_convergence import (SOAP_HP, async_runtime, build_problem, make_optimizer,  # noqa: E402
                               make_with_wide_mask, placement, train_curve)
from bench_staleness import val_loss  # noqa: E402
from tinygpt import SCHEDULE, warmup_cosine  # noqa: E402

NAME = "bench_tier_dtype"
DTYPES = ("float32", "bfloat16")
LR = 1e-2  # Asteria-SOAP async's tuned peak lr in the users' setting (bench_convergence.json)


def tier_figures(opt) -> dict[str, Any]:
    stats = common.runtime_stats(opt)
    return {"bytes": {t: int(stats.get(f"bytes_{t}", 0)) for t in common.TIERS},
            "bytes_device_ring": int(stats.get("bytes_device_ring", 0)),
            "bytes_h2d": int(stats.get("bytes_h2d", 0)),
            "bytes_nvme_read": int(stats.get("bytes_nvme_read", 0)),
            "bytes_nvme_written": int(stats.get("bytes_nvme_written", 0)),
            "memory_plan": opt.asteria_memory_plan(),
            "barrier_waits": int(stats.get("barrier_waits", 0)),
            "barrier_wait_ms": int(stats.get("barrier_wait_ns", 0)) / 1e6}


def run_one(dtype: str, seed: int, problem, args, pin: dict, log) -> dict[str, Any]:
    label = f"{dtype} seed {seed}"
    model = problem.model()
    rt = dict(async_runtime(args, pin["worker_cpus"]), tier_dtype=dtype,
              placement={"eigenbases": "host"})  # "auto" keeps CPU eigenbases in place
    opt, _ = make_with_wide_mask(lambda: make_optimizer("asteria-soap-async",
                                                        model.parameters(), args.lr, args,
                                                        None, runtime=rt))
    load0 = common.loadavg()
    log(f"run {label}: {args.steps} steps, lr {args.lr:g}, load {load0}")
    r = train_curve(model, opt, problem, args.steps, window=args.window, label=label, log=log,
                    log_every=args.log_every, warmup=args.warmup,
                    lr_at=warmup_cosine(args.lr, args.steps))
    figures = tier_figures(opt)
    opt.close()
    val = val_loss(model, problem, args.val_batches)
    del opt, model
    gc.collect()
    measured = r["step_ms"][args.warmup:]
    out = {"label": label, "tier_dtype": dtype, "seed": seed, "runtime": rt, "lr": args.lr,
           "steps_run": r["steps_run"], "final_train_loss": r["smoothed"][-1],
           "last_loss": r["losses"][-1], "val_loss": val, **figures,
           "step_mean_ms": statistics.mean(measured) if measured else None,
           "loadavg1_start": load0, "loadavg1_end": r["loadavg1_end"], "cpu": r["cpu"],
           "losses": [round(x, 5) for x in r["losses"]]}
    log(f"  {label}: train {out['final_train_loss']:.4f}, last {out['last_loss']:.4f}, val "
        f"{val:.4f}; host {out['bytes']['host']} B, device {out['bytes']['device']} B; load "
        f"{out['loadavg1_end']}, other processes {r['cpu'].get('foreign_cores_avg')} cores")
    return out


def nvme_check(dtype: str, problem, args, pin: dict, log) -> dict[str, Any]:
    """A short run with every eigenbasis on the NVMe tier: its bytes and I/O."""
    model = problem.model()
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as d:
        rt = dict(async_runtime(args, pin["worker_cpus"]), tier_dtype=dtype, nvme_dir=d,
                  host_budget_bytes=0)
        opt, _ = make_with_wide_mask(lambda: make_optimizer("asteria-soap-async",
                                                            model.parameters(), args.lr, args,
                                                            None, runtime=rt))
        r = train_curve(model, opt, problem, args.nvme_steps, window=1, label=f"nvme {dtype}",
                        log=log, log_every=args.nvme_steps, lr_at=warmup_cosine(args.lr,
                                                                               args.steps))
        figures = tier_figures(opt)
        opt.close()
    out = {"tier_dtype": dtype, "steps": args.nvme_steps, "runtime": dict(rt, nvme_dir="<tmp>"),
           "losses": [round(x, 5) for x in r["losses"]], **figures}
    log(f"  nvme {dtype}: nvme {out['bytes']['nvme']} B, read {out['bytes_nvme_read']} B, "
        f"written {out['bytes_nvme_written']} B in {args.nvme_steps} steps")
    return out


def compare(results: list, seeds: list) -> dict[str, Any]:
    by = {(r["tier_dtype"], r["seed"]): r for r in results}
    out: dict[str, Any] = {"per_seed": {}, "noise": {}}
    for s in seeds:
        a, b = by.get(("float32", s)), by.get(("bfloat16", s))
        if a is None or b is None:
            continue
        out["per_seed"][s] = {
            **{f"{k}_diff": b[k] - a[k] for k in ("final_train_loss", "last_loss", "val_loss")},
            "host_bytes_float32": a["bytes"]["host"], "host_bytes_bfloat16": b["bytes"]["host"],
            "tiered_bytes_saved": sum(a["bytes"][t] - b["bytes"][t]
                                      for t in ("host", "host_pinned", "uvm", "nvme")),
            "device_ring_bytes_saved": a["bytes_device_ring"] - b["bytes_device_ring"],
            "planned_peak_total_saved": a["memory_plan"]["peak_total"]
            - b["memory_plan"]["peak_total"]}
    f32 = [by[("float32", s)] for s in seeds if ("float32", s) in by]
    if len(f32) >= 2:
        for k in ("final_train_loss", "last_loss", "val_loss"):
            vals = [r[k] for r in f32]
            out["noise"][k] = max(vals) - min(vals)
        diffs = out["per_seed"].values()
        out["within_noise"] = bool(diffs) and all(
            abs(d[f"{k}_diff"]) <= out["noise"][k] for d in diffs
            for k in ("final_train_loss", "val_loss"))
    return out


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    torch.set_num_threads(args.threads)
    pin = placement(args.train_cpu)
    cpu0 = common.cpu_snapshot()
    results: list = []
    nvme: list = []
    info = None
    for seed in args.seeds:
        problem = build_problem(args.model_size, args.steps, seed)
        if info is None:
            info = problem.describe()
            log(f"TinyGPT {info['params'] / 1e6:.2f}M params, {info['tokens_per_step']} tokens "
                f"a step = {info['tokens_over_widest']:.1f}x the widest layer; {args.steps} "
                f"steps; tier dtypes {', '.join(DTYPES)}; seeds {args.seeds}; load "
                f"{common.loadavg()}")
        for dtype in DTYPES:
            results.append(run_one(dtype, seed, problem, args, pin, log))
            common.write_json({**meta, "complete": False, "model": info, "results": results},
                              f"{NAME}.json", args.out_dir)
        if seed == args.seeds[0] and args.nvme_steps:
            nvme = [nvme_check(dtype, problem, args, pin, log) for dtype in DTYPES]
        del problem
        gc.collect()
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    meta["cpu"] = common.cpu_delta(cpu0, common.cpu_snapshot())
    data = {
        **meta,
        "complete": True,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness, "install": "deterministic", "lr": args.lr,
                     "schedule": SCHEDULE, "soap_hp": dict(SOAP_HP, lr=args.lr),
                     "workers": args.workers, "torch_threads": args.threads,
                     "window": args.window, "val_batches": args.val_batches, "seeds": args.seeds,
                     "placement": "auto (eigenbases on the host tier)",
                     "nvme_steps": args.nvme_steps, "quick": args.quick, "pinning": pin},
        "model": info,
        "results": results,
        "nvme": nvme,
        "comparison": compare(results, args.seeds),
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    rs = data["results"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {"float32": "tab:blue", "bfloat16": "tab:orange"}
    styles = {s: ls for s, ls in zip(data["settings"]["seeds"], ("-", "--", ":", "-."))}
    w = data["settings"]["window"]
    for r in rs:
        ls = r["losses"]
        sm = [sum(ls[max(0, i - w + 1):i + 1]) / len(ls[max(0, i - w + 1):i + 1])
              for i in range(len(ls))]
        a.plot(range(1, len(sm) + 1), sm, styles.get(r["seed"], "-"),
               color=colors[r["tier_dtype"]], label=r["label"])
    a.set(xlabel="step", ylabel=f"train loss (trailing mean of {w})", title="Training loss")
    a.set_ylim(top=min(4.5, a.get_ylim()[1]))
    for s in data["settings"]["seeds"]:
        f32 = next((r for r in rs if r["seed"] == s and r["tier_dtype"] == "float32"), None)
        bf = next((r for r in rs if r["seed"] == s and r["tier_dtype"] == "bfloat16"), None)
        if f32 and bf:
            d = [x - y for x, y in zip(bf["losses"], f32["losses"])]
            b.plot(range(1, len(d) + 1), d, styles.get(s, "-"), lw=0.8,
                   label=f"seed {s}: bfloat16 - float32")
    if len([r for r in rs if r["tier_dtype"] == "float32"]) >= 2:
        f = [r for r in rs if r["tier_dtype"] == "float32"]
        d = [x - y for x, y in zip(f[1]["losses"], f[0]["losses"])]
        b.plot(range(1, len(d) + 1), d, color="tab:gray", lw=0.6, alpha=0.7,
               label="float32: seed 1 - seed 0 (noise)")
    b.axhline(0, color="k", lw=0.8)
    b.set(xlabel="step", ylabel="per-step loss difference", title="bfloat16 storage vs float32")
    labels = [r["label"] for r in rs]
    tiers = ("device", "host", "nvme")
    bottom = [0.0] * len(rs)
    for t, col in zip(tiers, ("tab:green", "tab:blue", "tab:purple")):
        vals = [r["bytes"][t] / 2 ** 20 for r in rs]
        c.bar(labels, vals, bottom=bottom, color=col, label=t)
        bottom = [x + y for x, y in zip(bottom, vals)]
    c.set(ylabel="optimizer state (MiB)", title="Bytes per tier after the last step")
    c.set_ylim(0, 1.15 * max(bottom))
    c.tick_params(axis="x", labelrotation=20, labelsize=7)
    m = data["model"]
    common.save_figure(fig, (a, b, c), path,
                       f"Asteria SOAP, eigenbases on the host tier in float32 vs bfloat16: "
                       f"{m['params'] / 1e6:.2f}M-param TinyGPT, {m['tokens_per_step']} "
                       f"tokens/step, {data['settings']['steps']} steps", data["machine"])


def print_table(data: dict) -> None:
    hdr = (f"{'run':<18}{'train':>9}{'last':>9}{'val':>9}{'device B':>11}{'host B':>10}"
           f"{'ring B':>9}{'peak B':>11}{'load':>7}")
    common.print_header(hdr)
    for r in data["results"]:
        print(f"{r['label']:<18}{r['final_train_loss']:>9.4f}{r['last_loss']:>9.4f}"
              f"{r['val_loss']:>9.4f}{r['bytes']['device']:>11d}{r['bytes']['host']:>10d}"
              f"{r['bytes_device_ring']:>9d}{r['memory_plan']['peak_total']:>11d}"
              f"{r['loadavg1_end'] or 0:>7.2f}")
    for r in data["nvme"]:
        print(f"nvme {r['tier_dtype']}: nvme {r['bytes']['nvme']} B, host {r['bytes']['host']} "
              f"B, read {r['bytes_nvme_read']} B, written {r['bytes_nvme_written']} B")
    cmp_ = data["comparison"]
    for s, d in cmp_["per_seed"].items():
        print(f"seed {s}: bfloat16 - float32: train {d['final_train_loss_diff']:+.4f}, last "
              f"{d['last_loss_diff']:+.4f}, val {d['val_loss_diff']:+.4f}; tier bytes saved "
              f"{d['tiered_bytes_saved']}, ring {d['device_ring_bytes_saved']}")
    if cmp_["noise"]:
        n = cmp_["noise"]
        print(f"float32 seed spread (noise): train {n['final_train_loss']:.4f}, last "
              f"{n['last_loss']:.4f}, val {n['val_loss']:.4f}; within noise: "
              f"{cmp_['within_noise']}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (200; --quick 12)")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds (>= 2 for the noise)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time mean (10; --quick 2)")
    ap.add_argument("--model-size", default=None, help="bench_convergence preset (users; "
                                                       "--quick tiny)")
    ap.add_argument("--frequency", type=int, default=10, help="precondition_frequency f")
    ap.add_argument("--staleness", type=int, default=5, help="staleness budget S")
    ap.add_argument("--lr", type=float, default=LR, help="peak lr of every run")
    ap.add_argument("--window", type=int, default=None,
                    help="trailing mean of the final train loss (20; --quick 4)")
    ap.add_argument("--val-batches", type=int, default=None, help="validation batches (8; "
                                                                  "--quick 2)")
    ap.add_argument("--nvme-steps", type=int, default=None,
                    help="steps of the NVMe-tier check per dtype (20; --quick 4; 0: none)")
    ap.add_argument("--nvme-dir", default=None,
                    help="parent of the NVMe check's directory (default: the system's tmp)")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--train-cpu", type=int, default=None,
                    help="the training thread's core (default: the first allowed one)")
    args = common.parse_quick(ap, argv, lambda q: dict(
        steps=12 if q else 200, warmup=2 if q else 10, model_size="tiny" if q else "users",
        window=4 if q else 20, val_batches=2 if q else 8, log_every=6 if q else 50,
        nvme_steps=4 if q else 20,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.heavyball_compile = False  # bench_convergence's factory reads it
    if not 0 <= args.staleness <= args.frequency:
        ap.error(f"staleness {args.staleness}: need 0 <= S <= --frequency ({args.frequency})")
    if args.steps < 2 or args.window < 1 or not args.seeds:
        ap.error("need --steps >= 2, --window >= 1 and a seed")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
