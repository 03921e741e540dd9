"""Staleness against quality: Asteria SOAP at S in {0, 1, 2, 5, 10} x install {deterministic,
eager} against native sync SOAP, in the users' regime.

Every run trains the same TinyGPT (bench_convergence.py's "users" setting: d=128, 2 layers,
context 128, batch 64 = 8,192 tokens a step, 16x the widest layer) from the same initial weights
on the same batches for --steps steps (default 600) under the same warm-up + cosine schedule at
one lr (default: Asteria-SOAP's tuned lr from bench_convergence.json's sweep), f=10. Reports per
run:
  - final train loss (trailing mean of the last --window losses) and validation loss (the mean
    over --val-batches fixed validation batches), each minus native sync SOAP's;
  - mean and p99 step time after --warmup steps (the training thread on one core, the pool's
    worker on the other);
  - the barrier: how many install steps waited for their refresh and for how long
    (asteria_stats() barrier_waits, barrier_wait_ns), and the largest install lag.
Target (the paper's): |final loss(S=5) - final loss(sync)| <= 0.02.

Writes benchmarks/results/bench_staleness.{json,png}.

    python3 benchmarks/bench_staleness.py              # default: about 35 minutes on 2 cores
    python3 benchmarks/bench_staleness.py --staleness 0,5 --installs eager --steps 300
    python3 benchmarks/bench_staleness.py --quick --out-dir /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
from bench_convergence import (SOAP_HP, Problem, async_runtime, build_problem,  # noqa: E402
                               close, make_optimizer, make_with_wide_mask, placement,
                               train_curve)
from tinygpt import SCHEDULE, warmup_cosine  # noqa: E402

NAME = "bench_staleness"
STALENESS = (0, 1, 2, 5, 10)
INSTALLS = ("deterministic", "eager")
# Asteria-SOAP async's tuned peak lr in the users setting (bench_convergence.json, seed-0
# sweep over 6e-3 / 1e-2 / 2e-2); --lr changes it.
LR = 1e-2
TARGET_ABS_DIFF = 0.02
TARGET_S = 5


def val_loss(model, problem: Problem, batches: int, seed: int = 1234) -> float:
    """Mean loss over ``batches`` validation batches drawn with a fixed generator: the same
    batches for every run."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    with torch.no_grad():
        out = statistics.mean(float(model(*problem.data.batch("val", problem.batch, gen)))
                              for _ in range(batches))
    model.train()
    return out


def run_one(label: str, runtime: dict, problem: Problem, args, log) -> dict[str, Any]:
    name = "asteria-soap-sync" if runtime["mode"] == "sync" else "asteria-soap-async"
    model = problem.model()
    opt, kw = make_with_wide_mask(lambda: make_optimizer(name, model.parameters(), args.lr, args,
                                                         None, runtime=runtime))
    log(f"run {label}: {args.steps} steps, lr {args.lr:g}, load {common.loadavg()}")
    r = train_curve(model, opt, problem, args.steps, window=args.window, label=label, log=log,
                    log_every=args.log_every, warmup=args.warmup,
                    lr_at=warmup_cosine(args.lr, args.steps))
    stats = common.runtime_stats(opt)
    close(opt)
    val = val_loss(model, problem, args.val_batches)
    del opt, model
    gc.collect()
    w = args.warmup
    measured = r["step_ms"][w:]
    kinds = r["step_kinds"][w:]
    by_kind: dict[str, list] = {}
    for t, k in zip(measured, kinds):
        by_kind.setdefault(k, []).append(t)
    waits = int(stats.get("barrier_waits", 0))
    wait_ns = int(stats.get("barrier_wait_ns", 0))
    out = {
        "label": label, "runtime": runtime, "lr": args.lr,
        "steps_run": r["steps_run"],
        "final_train_loss": r["smoothed"][-1],
        "val_loss": val,
        "step_mean_ms": statistics.mean(measured),
        "step_p99_ms": common.percentile(measured, 99),
        "summary": r["summary"],
        "mean_ms_by_kind": {k: statistics.mean(v) for k, v in by_kind.items()},
        "steps_by_kind": {k: len(v) for k, v in by_kind.items()},
        "barrier_waits": waits,
        "barrier_wait_ms": wait_ns / 1e6,
        "barrier_wait_ms_per_wait": wait_ns / 1e6 / waits if waits else 0.0,
        "runtime_counters": common.pick_runtime_counters(stats),
        "cpu": r["cpu"], "disturbed": r["disturbed"], "loadavg1_end": r["loadavg1_end"],
        "losses": [round(x, 5) for x in r["losses"]],
        "step_ms": [round(x, 3) for x in r["step_ms"]],
        "step_kinds": r["step_kinds"],
    }
    log(f"  {label}: train {out['final_train_loss']:.4f}, val {val:.4f}, step mean "
        f"{out['step_mean_ms']:.1f} / p99 {out['step_p99_ms']:.1f} ms, barrier {waits} waits, "
        f"{out['barrier_wait_ms']:.1f} ms")
    return out


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    torch.set_num_threads(args.threads)
    pin = placement(args.train_cpu)
    problem = build_problem(args.model_size, args.steps, args.seed)
    info = problem.describe()
    log(f"TinyGPT {info['params'] / 1e6:.2f}M params, {info['tokens_per_step']} tokens a step = "
        f"{info['tokens_over_widest']:.1f}x the widest layer; {args.steps} steps; S "
        f"{args.staleness_list}, installs {args.installs}; load {common.loadavg()}")
    cpu0 = common.cpu_snapshot()
    results = [run_one("sync", {"mode": "sync"}, problem, args, log)]
    for install in args.installs:
        for s in args.staleness_list:
            rt = async_runtime(args, pin["worker_cpus"], staleness=s, install=install)
            results.append(run_one(f"{install[:3]} S={s}", rt, problem, args, log))
            # after every run, what is there so far: a run cut short still leaves its results
            common.write_json({**meta, "complete": False, "model": info, "results": results},
                              f"{NAME}.json", args.out_dir)
    sync = results[0]
    for r in results:
        r["train_minus_sync"] = r["final_train_loss"] - sync["final_train_loss"]
        r["val_minus_sync"] = r["val_loss"] - sync["val_loss"]
        r["step_mean_over_sync"] = r["step_mean_ms"] / sync["step_mean_ms"]
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    meta["cpu"] = common.cpu_delta(cpu0, common.cpu_snapshot())
    targets = {}
    for install in args.installs:
        r = next((x for x in results if x["runtime"].get("install") == install
                  and x["runtime"].get("staleness") == TARGET_S), None)
        v = None if r is None else abs(r["train_minus_sync"])
        targets[f"abs_train_diff_S{TARGET_S}_{install}"] = {
            "value": v, "threshold": TARGET_ABS_DIFF, "op": "<=",
            "met": None if v is None else v <= TARGET_ABS_DIFF,
            "note": f"|final train loss (S={TARGET_S}, {install}) - sync's| after {args.steps} "
                    f"steps"}
    data = {
        **meta,
        "complete": True,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness_list, "installs": args.installs,
                     "lr": args.lr, "schedule": SCHEDULE, "soap_hp": dict(SOAP_HP, lr=args.lr),
                     "workers": args.workers, "torch_threads": args.threads,
                     "window": args.window, "val_batches": args.val_batches, "seed": args.seed,
                     "quick": args.quick, "pinning": pin,
                     "timed_region": "zero_grad + forward + backward + optimizer.step"},
        "model": info,
        "results": results,
        "targets": targets,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    rs = data["results"]
    sync = rs[0]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8))
    colors = {"deterministic": "tab:blue", "eager": "tab:orange"}
    for inst in data["settings"]["installs"]:
        sub = [r for r in rs if r["runtime"].get("install") == inst]
        xs = [r["runtime"]["staleness"] for r in sub]
        a.plot(xs, [r["train_minus_sync"] for r in sub], "o-", color=colors[inst],
               label=f"{inst}: train")
        a.plot(xs, [r["val_minus_sync"] for r in sub], "s--", color=colors[inst],
               label=f"{inst}: validation")
        b.plot(xs, [r["step_mean_ms"] for r in sub], "o-", color=colors[inst],
               label=f"{inst}: mean")
        b.plot(xs, [r["step_p99_ms"] for r in sub], "^--", color=colors[inst],
               label=f"{inst}: p99")
        c.plot(xs, [r["barrier_wait_ms"] for r in sub], "o-", color=colors[inst],
               label=f"{inst}: total wait")
    a.axhspan(-TARGET_ABS_DIFF, TARGET_ABS_DIFF, color="tab:green", alpha=0.12,
              label=f"|diff| <= {TARGET_ABS_DIFF}")
    a.axhline(0, color="k", lw=0.8)
    a.set(xlabel="staleness budget S (steps)", ylabel="final loss minus sync SOAP's",
          title=f"Quality after {data['settings']['steps']} steps")
    b.axhline(sync["step_mean_ms"], color="tab:red", lw=1, label="sync: mean")
    b.axhline(sync["step_p99_ms"], color="tab:red", ls="--", lw=1, label="sync: p99")
    b.set(xlabel="staleness budget S (steps)", ylabel="step time (ms)", title="Step time")
    c.set(xlabel="staleness budget S (steps)", ylabel="barrier wait, whole run (ms)",
          title="Install steps waiting for their refresh")
    m = data["model"]
    common.save_figure(fig, (a, b, c), path,
                       f"Asteria SOAP vs sync: {m['params'] / 1e6:.2f}M-param TinyGPT, "
                       f"{m['tokens_per_step']} tokens/step, f={data['settings']['frequency']}, "
                       f"lr {data['settings']['lr']:g}", data["machine"])


def print_table(data: dict) -> None:
    hdr = (f"{'run':<12}{'train':>8}{'- sync':>9}{'val':>8}{'- sync':>9}{'mean ms':>9}"
           f"{'p99 ms':>9}{'waits':>7}{'wait ms':>9}{'foreign':>9}")
    common.print_header(hdr)
    for r in data["results"]:
        print(f"{r['label']:<12}{r['final_train_loss']:>8.4f}{r['train_minus_sync']:>+9.4f}"
              f"{r['val_loss']:>8.4f}{r['val_minus_sync']:>+9.4f}{r['step_mean_ms']:>9.1f}"
              f"{r['step_p99_ms']:>9.1f}{r['barrier_waits']:>7d}{r['barrier_wait_ms']:>9.1f}"
              f"{r['cpu'].get('foreign_cores_avg') or 0.0:>9.2f}")
    for key, t in data["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target {key}: {common.fmt(t['value'], '.4f')} <= {t['threshold']}: {met}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (600; --quick 24)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (10; --quick 4)")
    ap.add_argument("--model-size", default=None, help="bench_convergence preset (users; "
                                                       "--quick tiny)")
    ap.add_argument("--frequency", type=int, default=10, help="precondition_frequency f")
    ap.add_argument("--staleness", default=",".join(str(s) for s in STALENESS),
                    help="comma-separated staleness budgets S (each <= f)")
    ap.add_argument("--installs", default=",".join(INSTALLS),
                    help="comma-separated subset of " + ", ".join(INSTALLS))
    ap.add_argument("--lr", type=float, default=LR, help="peak lr of every run")
    ap.add_argument("--window", type=int, default=None,
                    help="trailing mean of the final train loss (20; --quick 4)")
    ap.add_argument("--val-batches", type=int, default=None, help="validation batches (8; "
                                                                  "--quick 2)")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--train-cpu", type=int, default=None,
                    help="the training thread's core (default: the first allowed one; the "
                         "worker pool gets the others)")
    ap.add_argument("--seed", type=int, default=0)
    args = common.parse_quick(ap, argv, lambda q: dict(
        steps=24 if q else 600, warmup=4 if q else 10, model_size="tiny" if q else "users",
        window=4 if q else 20, val_batches=2 if q else 8, log_every=12 if q else 100,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    args.staleness_list = [int(s) for s in args.staleness.split(",") if s.strip()]
    args.installs = [s.strip() for s in args.installs.split(",") if s.strip()]
    for s in args.staleness_list:
        if not 0 <= s <= args.frequency:
            ap.error(f"staleness {s}: need 0 <= S <= --frequency ({args.frequency})")
    for i in args.installs:
        if i not in INSTALLS:
            ap.error(f"unknown install {i!r}; allowed: {', '.join(INSTALLS)}")
    args.heavyball_compile = False  # bench_convergence's factory reads it
    if args.steps < 2 or args.window < 1:
        ap.error("need --steps >= 2 and --window >= 1")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
