"""Asteria SOAP against third-party SOAP implementations from the package registry.

Same TinyGPT, initial weights, seed and batches (bench_convergence.py's set-up), same
hyper-parameters for every SOAP: lr 3e-3, betas (0.95, 0.95), shampoo_beta 0.95, eps 1e-8,
weight_decay 0.01, precondition_frequency f, no dimension merging, no 1-D preconditioning,
max preconditioner dimension 10000. Runs:
  asteria-soap-sync     asteria.SOAP, runtime {"mode": "sync"} (the native reference),
  asteria-soap-async    asteria.SOAP, runtime {"mode": "async", "staleness": S} (C worker pool),
  pytorch-optimizer     pytorch_optimizer.SOAP (pip: pytorch-optimizer),
  heavyball             heavyball.SOAP (pip: heavyball), with use_precond_schedule=False so its
                        refresh happens every f steps like the others. heavyball is compile-
                        first: by default its kernels go through torch.compile with
                        mode "max-autotune-no-cudagraphs", whose inductor autotuning takes
                        minutes on a CPU, so this benchmark runs it eagerly
                        (heavyball.utils.compile_mode = None) unless --heavyball-compile.
Reports per run: the loss at equal steps (each step's train loss, the final loss as the mean of
the last 10, and the difference to asteria-soap-sync's), and the step time (median / p99 /
max after the warm-up). A library that is missing or fails records the reason instead of
results; the versions of the libraries land in the JSON.

Writes benchmarks/results/bench_third_party.json and bench_third_party.png.

    python3 benchmarks/bench_third_party.py             # default: about 2-3 minutes on 2 cores
    python3 benchmarks/bench_third_party.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from bench_convergence import (PIP, PRESETS, SOAP_HP, build_problem, close,  # noqa: E402
                               dist_version, make_with_wide_mask, placement, train_curve)
from bench_convergence import make_optimizer as bc_make_optimizer  # noqa: E402


NAME = "bench_third_party"
RUNS = ("asteria-soap-sync", "asteria-soap-async", "pytorch-optimizer", "heavyball")
REFERENCE = "asteria-soap-sync"
HP = SOAP_HP


def make_optimizer(name: str, params, args, worker_cpus: Optional[str]):
    """(optimizer, the exact keyword arguments it got): bench_convergence's factory at HP's lr.
    Third-party imports happen there, so a missing library fails only its own run."""
    return bc_make_optimizer(name, params, HP["lr"], args, worker_cpus)


def run_one(name: str, args, problem, pin: dict, log: common.Progress) -> dict[str, Any]:
    out: dict[str, Any] = {"optimizer": name}
    if name in PIP:
        out["pip_package"] = PIP[name]
        out["version"] = dist_version(PIP[name])
    if name == "heavyball":
        out["compile_mode"] = ("heavyball default (torch.compile)" if args.heavyball_compile
                               else "eager (heavyball.utils.compile_mode = None)")
    model = problem.model()
    try:
        opt, kw = make_with_wide_mask(lambda: make_optimizer(name, model.parameters(), args,
                                                             pin["worker_cpus"]))
    except Exception as e:  # ImportError, or a constructor that rejects an argument
        out.update(ok=False, stage="construct", error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=4))
        log(f"run {name}: FAILED to construct: {out['error']}")
        return out
    out["kwargs"] = {k: v for k, v in kw.items()}
    log(f"run {name}" + (f" ({out['version']})" if out.get("version") else ""))
    try:
        r = train_curve(model, opt, problem, args.steps, window=1, label=name, log=log,
                        log_every=args.log_every, warmup=args.warmup)
    except Exception as e:  # a failing step: record why, keep the other runs
        out.update(ok=False, stage="step", error=f"{type(e).__name__}: {e}",
                   traceback=traceback.format_exc(limit=6))
        log(f"run {name}: FAILED in a step: {out['error']}")
        close(opt)
        return out
    stats = close(opt)
    out.update(ok=True, steps_run=r["steps_run"], summary=r["summary"],
               final_loss=r["final_loss"], wall_s=r["wall_s"], cpu=r["cpu"],
               disturbed=r["disturbed"], loadavg1_end=r["loadavg1_end"], losses=r["losses"],
               step_ms=r["step_ms"], runtime_counters=common.pick_runtime_counters(stats))
    gc.collect()
    return out


def compare(results: list[dict], checkpoints: Sequence[int]) -> dict[str, Any]:
    """Loss of every run at equal steps, and its difference to the native reference."""
    ref = next((r for r in results if r["optimizer"] == REFERENCE and r.get("ok")), None)
    out: dict[str, Any] = {"reference": REFERENCE, "checkpoints": list(checkpoints), "runs": {}}
    for r in results:
        if not r.get("ok"):
            continue
        row: dict[str, Any] = {
            "loss_at": {str(s): r["losses"][s - 1] for s in checkpoints if s <= len(r["losses"])},
            "final_loss": r["final_loss"],
            "median_ms": r["summary"]["median_ms"], "p99_ms": r["summary"]["p99_ms"]}
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            diffs = [abs(a - b) for a, b in zip(ref["losses"][:n], r["losses"][:n])]
            row["max_abs_loss_diff_vs_reference"] = max(diffs) if diffs else None
            row["final_loss_diff_vs_reference"] = r["final_loss"] - ref["final_loss"]
            row["median_ms_over_reference"] = r["summary"]["median_ms"] / ref["summary"]["median_ms"]
            row["p99_ms_over_reference"] = r["summary"]["p99_ms"] / ref["summary"]["p99_ms"]
        out["runs"][r["optimizer"]] = row
    return out


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    for pkg in ("pytorch-optimizer", "heavyball", "opt-einsum"):
        meta["versions"][pkg] = dist_version(pkg)
    torch.set_num_threads(args.threads)
    pin = placement()
    problem = build_problem(args.model_size, args.steps, args.seed)
    info = problem.describe()
    log(f"TinyGPT {info['params'] / 1e6:.2f}M params (preset {args.model_size}); {args.steps} "
        f"steps per run; f={args.frequency}; runs {', '.join(args.runs)}; load {common.loadavg()}")
    results = [run_one(name, args, problem, pin, log) for name in args.runs]
    step = max(1, args.steps // 5)
    checkpoints = sorted(set(list(range(step, args.steps + 1, step)) + [1, args.steps]))
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {
        **meta,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness, "workers": args.workers,
                     "torch_threads": args.threads, "hyperparameters": HP, "seed": args.seed,
                     "quick": args.quick, "pinning": pin,
                     "heavyball_compile": args.heavyball_compile,
                     "timed_region": "zero_grad + forward + backward + optimizer.step"},
        "model": info,
        "comparison": compare(results, checkpoints),
        "results": results,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    ok = [r for r in data["results"] if r.get("ok")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    for r in ok:
        a.plot(range(1, len(r["losses"]) + 1), r["losses"], lw=1, label=r["optimizer"])
    a.set(xlabel="step", ylabel="train loss", title="Loss at equal steps (same batches)")
    a.grid(True, alpha=0.3)
    a.legend(fontsize=8)
    xs = range(len(ok))
    med = [r["summary"]["median_ms"] for r in ok]
    p99 = [r["summary"]["p99_ms"] for r in ok]
    b.bar([x - 0.2 for x in xs], med, 0.4, label="median")
    b.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    b.set_xticks(list(xs), [r["optimizer"] for r in ok], rotation=20, fontsize=8)
    b.set(ylabel="step time (ms)", title="Step time")
    b.legend(fontsize=8)
    failed = [r for r in data["results"] if not r.get("ok")]
    if failed:
        b.text(0.02, 0.98, "\n".join(f"{r['optimizer']}: {r['error'][:60]}" for r in failed),
               transform=b.transAxes, va="top", fontsize=7, color="tab:red")
    m = data["model"]
    fig.suptitle(f"SOAP implementations on {m['params'] / 1e6:.2f}M-param TinyGPT, "
                 f"f={data['settings']['frequency']}, {data['machine']['cpu_model']} "
                 f"x{data['machine']['nproc']} (load {data['machine']['loadavg1']})", fontsize=10)
    common.write_png(fig, path)


def print_table(data: dict) -> None:
    cmp = data["comparison"]["runs"]
    hdr = (f"{'optimizer':<20}{'version':>10}{'median ms':>11}{'p99 ms':>9}{'final':>8}"
           f"{'d final':>9}{'max |d|':>9}")
    common.print_header(hdr)
    for r in data["results"]:
        v = r.get("version") or str(data["versions"].get("asteria"))
        if not r.get("ok"):
            print(f"{r['optimizer']:<20}{v:>10}  FAILED ({r['stage']}): {r['error'][:80]}")
            continue
        c = cmp[r["optimizer"]]
        df, md = c.get("final_loss_diff_vs_reference"), c.get("max_abs_loss_diff_vs_reference")
        print(f"{r['optimizer']:<20}{v:>10}{r['summary']['median_ms']:>11.1f}"
              f"{r['summary']['p99_ms']:>9.1f}{r['final_loss']:>8.3f}"
              f"{'-' if df is None else format(df, '+.3f'):>9}"
              f"{'-' if md is None else format(md, '.3f'):>9}")
    print(f"(d final, max |d|: against {REFERENCE}, per-step train loss on the same batches)")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 100; --quick 12)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the step-time "
                                                             "statistics (default 10; --quick 3)")
    ap.add_argument("--model-size", choices=sorted(PRESETS), default=None,
                    help="TinyGPT preset (default conv; --quick tiny)")
    ap.add_argument("--frequency", type=int, default=None, help="precondition_frequency (10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=None, help="Asteria async S (5; --quick 2)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--heavyball-compile", action="store_true",
                    help="keep heavyball's torch.compile (minutes of CPU autotuning)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(steps=12 if q else 100, warmup=3 if q else 10,
                                    model_size="tiny" if q else "conv", frequency=4 if q else 10,
                                    staleness=2 if q else 5, log_every=6 if q else 25,
                                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q
                                    else common.RESULTS_DIR))
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; allowed: {', '.join(RUNS)}")
    args.runs = sorted(runs, key=RUNS.index)  # heavyball last: its import touches torch config
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    if args.steps < 2:
        ap.error("need --steps >= 2")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
