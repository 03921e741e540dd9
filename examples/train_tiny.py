"""AdamW vs Asteria SOAP vs native SOAP where users train: the main job's time-to-loss part.

The main job (examples/main_job.py, `bash scripts/run_main.sh`) runs this as its "time to loss"
part; run alone it writes examples/out/train_tiny.{json,png}.

A small GPT-style character LM (examples/tinygpt.py: d=128, 2 layers, context 128) on Tiny
Shakespeare, batch 64: 8,192 tokens a step, 16x the widest layer (the MLP's 4d = 512), so the
model's forward and backward, not the optimizer, set the step time, as in LLM training. Every run
uses the same seed, initial weights and batches, linear warm-up then cosine decay, each
optimizer at its tuned peak lr (benchmarks/bench_convergence.py's sweep in this setting); only
the optimizer changes. The training thread runs on one core with one torch thread, Asteria's
worker pool on the other. The runs train in lockstep, taking turns of 10 consecutive steps
(benchmarks/common.py run_loops), so a slow spell of the machine falls on all of them alike;
each run's time axis is its own clock (its steps and their bookkeeping, not the others' turns).

Prints progress, then a table: final train loss, validation loss, the wall time at which the run
first reaches AdamW's final loss (and its ratio to AdamW's time), step time median / p99, wall
time and optimizer-state MiB per memory tier (asteria_stats(); for AdamW its state tensors).
Writes examples/out/train_tiny.png (loss vs wall-clock time, step time vs step, bytes per tier)
and train_tiny.json (every loss and step time, the machine, its load, the versions, the command).

    python3 examples/train_tiny.py                   # ~3 min on 2 cores
    python3 examples/train_tiny.py --steps 50 --runs adamw,soap-async

The corpus is bundled (examples/data/tinyshakespeare.txt, from char-rnn); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks"))
import common  # noqa: E402
from bench_convergence import Curve, make_problem, run_curves, time_to_target  # noqa: E402
from tinygpt import SCHEDULE, CharData, GPTConfig, n_params, warmup_cosine  # noqa: E402

import asteria  # noqa: E402

# Tuned peak lrs in this setting: the seed-0 sweeps of benchmarks/bench_convergence.py
# ("users"): AdamW and the two SOAPs in benchmarks/results/amortisation/ (2026-12-05: AdamW
# 3e-3 / 6e-3 / 1e-2; each SOAP 6e-3 / 1e-2 / 2e-2 / 4e-2, best 2e-2 by 3-5 steps over 1e-2),
# KL-Shampoo (1e-2 / 3e-2 / 1e-1) and Shampoo (6e-3 / 1e-2 / 2e-2) in benchmarks/results/.
LR = {"adamw": 6e-3, "soap-auto": 2e-2, "soap-async": 2e-2, "soap-sync": 2e-2,
      "soap-sync-f1": 2e-2, "kl-shampoo-async": 3e-2, "shampoo-async": 1e-2}
#: the main job's part 1: AdamW, Asteria SOAP at the precondition_frequency it chooses
#: ("auto"), native SOAP at f=10 (SOAP's default) and at f=1 (a refresh every step)
DEFAULT_RUNS = ("adamw", "soap-auto", "soap-sync", "soap-sync-f1")
STALENESS = 0
WINDOW = 20  # trailing mean of the train loss: the final loss and the time-to-target curve


def make_runs(worker_cpus, staleness=STALENESS, install="deterministic"):
    """name -> factory(params, lr). AdamW betas (0.9, 0.95); SOAP betas (0.95, 0.95); weight
    decay 0.01; f = 10 ("soap-auto": precondition_frequency "auto", chosen by the run from its
    measured times; "soap-sync-f1": 1); async: staleness S and install as given, one worker
    on ``worker_cpus``."""
    rt = {"mode": "async", "staleness": staleness, "install": install, "workers": 1}
    if worker_cpus:
        rt["cpuset"] = worker_cpus
    return {
        "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr, betas=(0.9, 0.95),
                                                 weight_decay=0.01),
        "soap-sync": lambda p, lr: asteria.SOAP(p, lr=lr, runtime={"mode": "sync"}),
        "soap-sync-f1": lambda p, lr: asteria.SOAP(p, lr=lr, precondition_frequency=1,
                                                   runtime={"mode": "sync"}),
        "soap-async": lambda p, lr: asteria.SOAP(p, lr=lr, runtime=rt),
        "soap-auto": lambda p, lr: asteria.SOAP(p, lr=lr, precondition_frequency="auto",
                                                runtime=rt),
        "kl-shampoo-async": lambda p, lr: asteria.KLShampoo(p, lr=lr, runtime=rt),
        "shampoo-async": lambda p, lr: asteria.Shampoo(p, lr=lr, weight_decay=0.01, runtime=rt),
    }


def make_curve(name, factory, lr, problem, args, log):
    """A fresh model of ``problem`` and optimizer ``name`` at peak lr ``lr`` under the warm-up +
    cosine schedule, as a bench_convergence.Curve (its steps taken by run_curves)."""
    model = problem.model()
    with common.unpinned(common.allowed_cpus()):  # the pool's threads get every core's mask
        opt = factory(model.parameters(), lr)
    return Curve(model, opt, problem, args.steps, window=WINDOW, label=name, log=log,
                 log_every=args.log_every, warmup=min(10, args.steps - 1),
                 lr_at=warmup_cosine(lr, args.steps))


def finish_one(name, lr, curve, res, data, args):
    """One trained curve's row: its losses and times (the loop's own clock), validation loss,
    step-time statistics, optimizer bytes per tier; the optimizer is closed."""
    model, opt = curve.loop.model, curve.opt
    model.eval()
    vgen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        val = statistics.mean(model(*data.batch("val", args.batch, vgen)).item()
                              for _ in range(args.val_batches))
    stats = common.runtime_stats(opt)
    tiers = common.tier_bytes(opt, "cpu", stats)
    if hasattr(opt, "close"):
        opt.close()
    summary = res["summary"]  # the steps after the warm-up
    return {
        "optimizer": name, "lr": lr,
        # the precondition_frequency the run used: "auto"'s choice, else the group's
        "frequency": (stats.get("frequency_auto_f") if stats.get("frequency_auto")
                      else opt.param_groups[0].get("precondition_frequency")),
        "final_train_loss": round(res["smoothed"][-1], 5),
        "val_loss": val,
        "step_ms_median": summary["median_ms"],
        "step_ms_p99": summary["p99_ms"],
        "step_ms_max": summary["max_ms"],
        "wall_s": res["wall_s"],
        "losses": [round(x, 5) for x in res["losses"]],
        "smoothed": [round(x, 5) for x in res["smoothed"]],
        "time_s": [round(t, 4) for t in res["time_s"]],
        "step_times_ms": [round(t, 3) for t in res["step_ms"]],
        "opt_times_ms": [round(t, 3) for t in res["opt_ms"]],
        "step_kinds": res["step_kinds"],
        "bytes_per_tier": tiers,
        "cpu": res["cpu"],
        "asteria_stats": stats,
    }


COLORS = {"adamw": "tab:gray", "soap-auto": "tab:blue", "soap-async": "tab:cyan",
          "soap-sync": "tab:red", "soap-sync-f1": "tab:pink", "kl-shampoo-async": "tab:purple",
          "shampoo-async": "tab:olive"}
TIER_COLORS = {"device": "tab:blue", "host_pinned": "tab:cyan", "host": "tab:orange",
               "uvm": "tab:pink", "nvme": "tab:brown"}


LABELS = {"adamw": "AdamW", "soap-auto": "Asteria SOAP (f auto)", "soap-async": "Asteria SOAP",
          "soap-sync": "native SOAP", "soap-sync-f1": "native SOAP f=1"}


def plot_loss_vs_time(a, out, labels=None):
    """Loss (trailing mean) against each run's own time on axis ``a``, with AdamW's final loss
    and each run's time to it."""
    for r in out["results"]:
        t = r.get("time_to_adamw_final", {})
        extra = (f", AdamW's final at {t['time_s']:.0f} s (x{t['time_ratio']:.2f})"
                 if t.get("time_s") is not None and r["optimizer"] != "adamw" else "")
        name = (labels or {}).get(r["optimizer"], r["optimizer"])
        a.plot(r["time_s"], r["smoothed"], color=COLORS.get(r["optimizer"]), lw=1.3,
               label=f"{name} (lr {r['lr']:g}){extra}")
    if "adamw_final_loss" in out:
        a.axhline(out["adamw_final_loss"], color="k", ls=":", lw=1, label="AdamW's final loss")
    a.set(xlabel="wall-clock time (s)", ylabel=f"train loss (trailing mean of {WINDOW})",
          title="Loss vs wall-clock time")
    a.set_ylim(top=min(3.5, a.get_ylim()[1]))


def plot(out, path):
    plt = common.pyplot()
    results = out["results"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.8),
                                  gridspec_kw={"width_ratios": [1.3, 1.3, 0.8]})
    plot_loss_vs_time(a, out)
    for r in results:
        b.plot(range(1, len(r["step_times_ms"]) + 1), r["step_times_ms"],
               color=COLORS.get(r["optimizer"]), lw=0.8, label=r["optimizer"])
    b.set(xlabel="step", ylabel="step time (ms)", title="Step time vs step", yscale="log")
    xs = range(len(results))
    bottom = [0.0] * len(results)
    for tier in common.TIERS:
        vals = [r["bytes_per_tier"]["tiers"][tier] / 2**20 for r in results]
        if any(vals):
            c.bar(xs, vals, bottom=bottom, color=TIER_COLORS[tier], label=tier)
            bottom = [x + v for x, v in zip(bottom, vals)]
    c.set_xticks(list(xs), [r["optimizer"] for r in results], rotation=15, fontsize=8)
    c.set(ylabel="optimizer state (MiB)", title="Optimizer bytes per tier")
    m = out["model"]
    common.save_figure(fig, (a, b, c), path,
                       f"TinyGPT {m['params'] / 1e6:.2f}M params, {m['tokens_per_step']} "
                       f"tokens/step ({m['tokens_per_step'] // m['widest_layer_dim']}x the widest "
                       f"layer), {out['args']['steps']} steps", out["machine"])


def print_table(out):
    print(f"\nResults after {out['args']['steps']} steps (loss@N: trailing mean of the last "
          f"{WINDOW} train losses; reach: first step whose trailing mean <= AdamW's loss@N)")
    hdr = (f"{'optimizer':<18}{'f':>5}{'lr':>7}{'loss@N':>8}{'val':>8}{'reach s':>9}{'x AdamW':>9}"
           f"{'median ms':>11}{'p99 ms':>9}{'wall s':>8}  {'MiB device/host/nvme':<22}")
    print(hdr)
    print("-" * len(hdr))
    for r in out["results"]:
        t = r["time_to_adamw_final"]
        tiers = r["bytes_per_tier"]["tiers"]
        host = tiers["host"] + tiers["host_pinned"] + tiers["uvm"]
        mib = f"{tiers['device'] / 2**20:.2f}/{host / 2**20:.2f}/{tiers['nvme'] / 2**20:.2f}"
        print(f"{r['optimizer']:<18}{common.fmt(r['frequency'], 'd'):>5}{r['lr']:>7g}"
              f"{r['final_train_loss']:>8.4f}"
              f"{r['val_loss']:>8.4f}"
              f"{'-' if t['time_s'] is None else format(t['time_s'], '.1f'):>9}"
              f"{'-' if t['time_ratio'] is None else format(t['time_ratio'], '.2f'):>9}"
              f"{r['step_ms_median']:>11.1f}{r['step_ms_p99']:>9.1f}{r['wall_s']:>8.1f}  {mib}")
    cpu = out["results"][0]["cpu"] if out["results"] else {}
    print(f"(machine load: 1-min average {out['machine']['loadavg1']} at the start, "
          f"{out['machine']['loadavg1_end']} at the end; other processes' CPU during the "
          f"lockstep run: {cpu.get('foreign_cores_avg', 0):.2f} cores)")


def parse_args(argv=None):
    """The command line; ``args.lrs`` (name -> peak lr), ``args.staleness`` (an int or "auto")
    and ``args.names`` (AdamW first) resolved."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                    help="comma-separated subset of " + ", ".join(LR))
    ap.add_argument("--lr", action="append", default=[], metavar="NAME=LR",
                    help="peak lr of one run (repeatable); defaults " + ", ".join(
                        f"{k} {v:g}" for k, v in LR.items()))
    ap.add_argument("--staleness", default=str(STALENESS),
                    help=f"the async runs' staleness budget S: an int, or auto (default {STALENESS})")
    ap.add_argument("--install", default="deterministic", choices=("deterministic", "eager"),
                    help="the async runs' install rule")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--out-dir", default=os.path.join(HERE, "out"))
    args = ap.parse_args(argv)
    lrs = dict(LR)
    for spec in args.lr:
        k, _, v = spec.partition("=")
        if k not in LR or not v:
            ap.error(f"--lr {spec!r}: want NAME=LR with NAME one of {', '.join(LR)}")
        lrs[k] = float(v)
    args.lrs = lrs
    if args.staleness != "auto":
        try:
            args.staleness = int(args.staleness)
        except ValueError:
            ap.error(f"--staleness {args.staleness!r}: want an int >= 0 or auto")
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    for n in names:
        if n not in LR:
            ap.error(f"unknown run {n!r}; allowed: {', '.join(LR)}")
    if "adamw" in names:  # AdamW first: its final loss is the others' target
        names = ["adamw"] + [n for n in names if n != "adamw"]
    args.names = names
    return args


def run(args, argv=None, show=True):
    """Train the runs of ``args`` (parse_args) in lockstep and print the table (``show``);
    returns the result (what main writes as train_tiny.json). Restores the caller's torch
    thread count and CPU affinity."""
    names, lrs = args.names, args.lrs
    meta = common.run_metadata("train_tiny", __file__, argv)
    threads, cpus = torch.get_num_threads(), common.allowed_cpus()
    torch.set_num_threads(args.threads)
    train_cpu, worker_cpus = common.split_cores()
    common.pin_thread(None if train_cpu is None else [train_cpu])
    try:
        runs = make_runs(common.cpu_list(worker_cpus) if train_cpu is not None else None,
                         args.staleness, args.install)
        data = CharData(block=args.context)
        cfg = GPTConfig(vocab=data.vocab, block=args.context, d=args.d, layers=args.layers,
                        heads=4)
        problem = make_problem("main", cfg, data, args.steps, args.seed, args.batch)
        tokens, widest = args.batch * args.context, 4 * args.d
        model_info = {"params": n_params(problem.model()), "d": args.d, "layers": args.layers,
                      "context": args.context, "batch": args.batch, "tokens_per_step": tokens,
                      "widest_layer_dim": widest}
        print(f"TinyGPT: {model_info['params'] / 1e6:.2f}M parameters, d={args.d}, "
              f"{args.layers} layers, context {args.context}, batch {args.batch} = {tokens} "
              f"tokens a step ({tokens / widest:.0f}x the widest layer, {widest}); {args.steps} "
              f"steps, {SCHEDULE}; training on cpu {train_cpu}, pool on {worker_cpus}; load "
              f"{common.loadavg()}", flush=True)
        log = common.Progress("train_tiny")
        curves = [make_curve(n, runs[n], lrs[n], problem, args, log) for n in names]
        log(f"{', '.join(f'{n} (lr {lrs[n]:g})' for n in names)} in lockstep: turns of "
            f"{common.TURN_STEPS} consecutive steps each")
        trained = run_curves(curves)
        results = [finish_one(n, lrs[n], c, r, data, args)
                   for n, c, r in zip(names, curves, trained)]
    finally:
        torch.set_num_threads(threads)
        common.pin_thread(cpus)
    argd = {k: v for k, v in vars(args).items() if k not in ("lrs", "names")}
    out = {**meta, "args": argd, "lrs": {n: lrs[n] for n in names}, "schedule": SCHEDULE,
           "model": model_info, "pinning": {"training_cpu": train_cpu,
                                            "worker_cpus": common.cpu_list(worker_cpus)}}
    out["machine"]["loadavg1_end"] = common.loadavg()
    adamw = next((r for r in results if r["optimizer"] == "adamw"), None)
    if adamw is not None:
        out["adamw_final_loss"] = adamw["final_train_loss"]
    for r in results:
        r["time_to_adamw_final"] = (
            time_to_target(r, adamw["final_train_loss"], adamw["wall_s"], args.steps) if adamw
            else {"reached": False, "step": None, "time_s": None, "time_ratio": None})
    out["results"] = results
    if show:
        print_table(out)
    return out


def main(argv=None):
    args = parse_args(argv)
    out = run(args, argv)
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "train_tiny.png")
    try:
        plot(out, png)
        print(f"\nwrote {png}")
    except ImportError as e:
        print(f"\nno plot: {e}")
    common.write_json(out, "train_tiny.json", args.out_dir)
    print(f"wrote {os.path.join(args.out_dir, 'train_tiny.json')}")
    return out


if __name__ == "__main__":
    main()
