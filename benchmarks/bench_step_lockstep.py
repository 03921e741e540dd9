"""Step time of AdamW, Asteria SOAP async and native sync SOAP trained in lockstep.

bench_convergence.py times each optimizer in its own run, one after the other. On this VM the
forward and backward of the same model drift by several percent between runs minutes apart
(docs/step_time_tail.md), which is as large as the 2-3% the step targets are about. Here the
three train side by side in one process: each has its own copy of the users' model (same
initial weights and batches) and they take turns of 10 consecutive steps (common.run_loops:
an Asteria step's worker jobs overlap its own next forward and backward, not another run's),
so every optimizer's step i runs within seconds of the others'. Per step: forward + backward time, optimizer time, and
the step kind (Asteria: refresh / install / plain, from asteria_stats()).

Figures (the issue's step targets, measured here as well as in bench_convergence.py):
  - limit: AdamW's median step + SOAP's added FLOPs (6 m n (m + n) per m x n matrix) at the
    training core's measured single-thread GEMM rate; Asteria's median step over it.
  - the same at equal forward and backward: (Asteria's forward + backward median + AdamW's
    optimizer median + the FLOP time) against Asteria's median step. The models' weights
    differ after a few steps and a forward / backward's time depends on the values (AdamW's
    model's ran up to 1.4x slower than the SOAP-trained ones in trial runs), so the first
    figure can flatter a SOAP; this one compares optimizer work only.
  - Asteria's mean step on steps without a refresh (neither the snapshot's nor the install's
    step) over native sync SOAP's median step.

    python3 benchmarks/bench_step_lockstep.py            # ~3 minutes on 2 cores
    python3 benchmarks/bench_step_lockstep.py --quick --out-dir /tmp/x

Writes benchmarks/results/bench_step_lockstep.{json,png}.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_convergence as conv  # noqa: E402
import common  # noqa: E402

NAME = "bench_step_lockstep"
RUNS = ("adamw", "asteria-soap-async", "asteria-soap-sync")
#: tuned peak lrs of benchmarks/results/bench_convergence.json ("users"); the lr does not
#: change a step's work
LRS = {"adamw": 6e-3, "asteria-soap-async": 2e-2, "asteria-soap-sync": 1e-2}


#: the every-step refresh's step targets: Asteria f=1 S=0 against Asteria f=10 S=0 and native
#: f=1 (``--runs adamw,asteria-soap-async-f1-s0,asteria-soap-async-f10-s0,asteria-soap-sync-f1``)
EVERY_STEP = ("asteria-soap-async-f1-s0", "asteria-soap-async-f10-s0", "asteria-soap-sync-f1")
EVERY_STEP_TARGETS = {"f1_over_f10_max": 1.05, "f1_over_native_f1_max": 0.80}


def lr_of(name: str) -> float:
    """A run's peak lr: its own, else (a bench_convergence variant, "<base>-f<N>[-s<S>]") its
    base's, else SOAP's."""
    v = conv.variant(name)
    return LRS.get(name, LRS.get(v[0] if v else "", LRS["asteria-soap-async"]))


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    torch.set_num_threads(1)
    pin = conv.placement()
    problem = conv.build_problem(args.preset, args.steps, args.seed)
    runs = args.runs
    log(f"{args.steps} steps of {', '.join(runs)} in lockstep ({args.preset}, "
        f"{problem.batch * problem.cfg.block} tokens a step), load {common.loadavg()}")
    made = [conv.make_curve(name, lr_of(name), problem, args, pin, log, stop_below=None,
                            budget_s=None) for name in runs]
    results = conv.run_curves([c for c, _ in made])
    meta["cpu"] = results[0]["cpu"]
    rows = []
    for name, (c, _), r in zip(runs, made, results):
        conv.close(c.opt)
        rows.append({"name": name, "fb": [s - o for s, o in zip(r["step_ms"], r["opt_ms"])],
                     "opt_ms": r["opt_ms"], "kinds": r["step_kinds"], "losses": r["losses"],
                     "faults": r["minor_faults"]})
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    w = args.warmup
    out: dict[str, Any] = {}
    for r in rows:
        fb, op = r["fb"][w:], r["opt_ms"][w:]
        step = [a + b for a, b in zip(fb, op)]
        out[r["name"]] = {
            "lr_peak": lr_of(r["name"]),
            "step_ms": {"median": common.percentile(step, 50), "mean": sum(step) / len(step),
                        "p99": common.percentile(step, 99)},
            "fwd_bwd_ms": {"median": common.percentile(fb, 50), "mean": sum(fb) / len(fb)},
            "opt_ms": {"median": common.percentile(op, 50), "mean": sum(op) / len(op)},
            "minor_faults_median": {k: common.percentile(v[w:], 50)
                                    for k, v in r["faults"].items()},
            "per_step": {"fwd_bwd_ms": r["fb"], "opt_ms": r["opt_ms"], "kinds": r["kinds"],
                         "loss": r["losses"], "minor_faults": r["faults"]}}
    mats = conv.precond_shapes(problem)
    added = conv.added_flops(mats)
    rate = conv.gemm_rate(sorted(set(conv.rotation_shapes(mats)) | {(512, 512, 512)}),
                          args.gemm_reps)
    peak = max(s["gflops_best"] for s in rate["shapes"])
    flop_ms = conv.flop_ms(added, peak)
    figures: dict[str, Any] = {
        "added_flops_per_step": added, "gemm_gflops_peak": peak, "flop_ms": flop_ms,
        # every run's median step over every other's (a row over a column)
        "median_step_ratio": {x: {y: out[x]["step_ms"]["median"] / out[y]["step_ms"]["median"]
                                  for y in out} for x in out}}
    if all(r in out for r in RUNS):
        figures.update(limit_figures(out, rows[runs.index("asteria-soap-async")], w, flop_ms))
    if all(r in out for r in EVERY_STEP):
        f1, f10, native = (out[r]["step_ms"]["median"] for r in EVERY_STEP)
        figures["every_step"] = {"f1_over_f10": f1 / f10, "f1_over_native_f1": f1 / native}
    data = {**meta, "settings": {"preset": args.preset, "steps": args.steps,
                                 "warmup": args.warmup, "seed": args.seed,
                                 "frequency": args.frequency, "staleness": args.staleness,
                                 "tokens_per_step": problem.batch * problem.cfg.block,
                                 "pinning": pin, "lr": {r: lr_of(r) for r in runs}},
            "runs": out, "figures": figures,
            "targets": {"step_over_limit_max": conv.TARGETS["step_over_limit_max"],
                        "nonrefresh_mean_over_sync_median_max":
                            conv.TARGETS["nonrefresh_mean_over_sync_median_max"],
                        **EVERY_STEP_TARGETS}}
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def limit_figures(out: dict, ast: dict, w: int, flop_ms: float) -> dict[str, Any]:
    """Asteria SOAP's step against its limit and native SOAP's (the default three runs)."""
    a, s, n = out["adamw"], out["asteria-soap-async"], out["asteria-soap-sync"]
    limit = a["step_ms"]["median"] + flop_ms
    equal_fb = s["fwd_bwd_ms"]["median"] + a["opt_ms"]["median"] + flop_ms
    nonref = [f + o for f, o, k in zip(ast["fb"][w:], ast["opt_ms"][w:], ast["kinds"][w:])
              if k not in ("refresh", "install", "refresh+install")]
    return {
        "limit_ms": limit, "step_over_limit": s["step_ms"]["median"] / limit,
        "limit_equal_fwd_bwd_ms": equal_fb,
        "step_over_limit_equal_fwd_bwd": s["step_ms"]["median"] / equal_fb,
        "asteria_nonrefresh_steps": len(nonref),
        "asteria_nonrefresh_mean_ms": sum(nonref) / len(nonref) if nonref else None,
        "nonrefresh_mean_over_sync_median": (sum(nonref) / len(nonref) / n["step_ms"]["median"]
                                             if nonref else None),
        "asteria_mean_over_sync_mean": s["step_ms"]["mean"] / n["step_ms"]["mean"],
    }


def print_table(data: dict) -> None:
    print(f"{'optimizer':<28}{'step med':>10}{'step mean':>11}{'fwd+bwd med':>13}"
          f"{'opt med':>9}{'opt mean':>10}{'faults fwd+bwd':>16}{'faults opt':>12}")
    for name, r in data["runs"].items():
        fl = r.get("minor_faults_median", {})
        print(f"{name:<28}{r['step_ms']['median']:>10.1f}{r['step_ms']['mean']:>11.1f}"
              f"{r['fwd_bwd_ms']['median']:>13.1f}{r['opt_ms']['median']:>9.1f}"
              f"{r['opt_ms']['mean']:>10.1f}{fl.get('fwd_bwd', float('nan')):>16.0f}"
              f"{fl.get('opt', float('nan')):>12.0f}")
    f, t = data["figures"], data["targets"]
    if "every_step" in f:
        e = f["every_step"]
        print(f"every-step refresh: Asteria f=1 S=0 median step / Asteria f=10 S=0 "
              f"x{e['f1_over_f10']:.3f} (target <= {t['f1_over_f10_max']}); / native f=1 "
              f"x{e['f1_over_native_f1']:.3f} (target <= {t['f1_over_native_f1_max']})")
    if "limit_ms" not in f:
        return
    print(f"limit {f['limit_ms']:.1f} ms (AdamW median + {f['flop_ms']:.1f} ms of FLOPs at "
          f"{f['gemm_gflops_peak']:.0f} GFLOP/s): Asteria x{f['step_over_limit']:.3f}; at equal "
          f"forward and backward {f['limit_equal_fwd_bwd_ms']:.1f} ms: "
          f"x{f['step_over_limit_equal_fwd_bwd']:.3f} (target <= {t['step_over_limit_max']})")
    if f["nonrefresh_mean_over_sync_median"] is not None:
        print(f"Asteria mean step without a refresh / native median: "
              f"x{f['nonrefresh_mean_over_sync_median']:.3f} (target <= "
              f"{t['nonrefresh_mean_over_sync_median_max']}); mean / native mean: "
              f"x{f['asteria_mean_over_sync_mean']:.3f}")


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5))
    for name, r in data["runs"].items():
        ps = r["per_step"]
        step = [x + y for x, y in zip(ps["fwd_bwd_ms"], ps["opt_ms"])]
        a.plot(range(1, len(step) + 1), step, lw=0.9, color=conv.COLORS.get(name), label=name)
        b.plot(range(1, len(step) + 1), ps["opt_ms"], lw=0.9, color=conv.COLORS.get(name),
               label=name)
    a.set(xlabel="step", ylabel="step ms (forward + backward + optimizer)",
          title="step time, the runs in lockstep")
    b.set(xlabel="step", ylabel="optimizer step ms", yscale="log",
          title="optimizer step alone (native's refresh every f steps)")
    common.save_figure(fig, [a, b], path, "Step time in lockstep", data["machine"])


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps of each (160; --quick 12)")
    ap.add_argument("--warmup", type=int, default=None, help="leading steps left out (10; 2)")
    ap.add_argument("--preset", default=None, help="bench_convergence preset (users; tiny)")
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gemm-reps", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated runs in lockstep: bench_convergence's names, with "
                         "<base>-f<N>[-s<S>] for a run's own f and S (default " + ",".join(RUNS)
                         + "; the every-step targets: " + ",".join(("adamw",) + EVERY_STEP) + ")")
    ap.add_argument("--quick", action="store_true")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(
        steps=12 if q else 160, warmup=2 if q else 10, preset="tiny" if q else "users",
        gemm_reps=3 if q else 30, log_every=4 if q else 20,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    args.runs = conv.parse_runs(args.runs, ap, RUNS)
    args.heavyball_compile = False
    args.window = 20  # conv.make_curve's trailing mean (no run stops at a loss here)
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
