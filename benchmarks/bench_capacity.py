"""staleness="auto" in the users' regime: barrier waits after the first rounds, loss vs sync.

TinyGPT (d=128, 2 layers, context 128, batch 64: 8,192 tokens a step, 16x the widest layer,
the MLP's 512) on Tiny Shakespeare, warmup then cosine decay, the same initial weights and
batches for every run:

* ``sync``: native SOAP (``mode="sync"``), the reference;
* ``auto``: Asteria SOAP, ``mode="async"``, ``install="deterministic"``, ``staleness="auto"``;
* optionally ``s5`` (deterministic S=5) and ``eager5`` (eager S=5) for reference (--runs).

First (``--prediction``, on by default) the cost model's prediction error on the C pool: the
rounds of two model sizes at 1 and 2 workers, each predicted before it runs from the jobs seen
so far (``cost_check.prediction_check``, what tests/python/test_capacity.py checks
within 25%), written to bench_capacity_prediction.json (``--runs ""``: that alone).

Per step the JSON keeps the train loss, the step's wall time, the S in force and the running
counts of installs that waited at the bounded barrier (the schedule's ``install_waits``: a
round not done at its install step) and of the C runtime's barrier waits (any blocking wait,
SOAP's re-expressions of m included). Reported: waits after the first rounds (from the step at
which auto chose S), the S chosen, the capacity report (``asteria_plan()``), and the final loss
(mean of the last 50 steps' train loss, and the last step's) minus sync's.

The training thread is pinned to one core with one torch thread, the pool gets the others
(as in bench_convergence.py).

    python3 benchmarks/bench_capacity.py                   # 600 steps, sync and auto
    python3 benchmarks/bench_capacity.py --steps 40 --out-dir /tmp/x   # a smoke run

Writes benchmarks/results/bench_capacity.json and bench_capacity.png.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402
from bench_convergence import make_with_wide_mask, placement  # noqa: E402
from tinygpt import CharData, GPTConfig, TinyGPT, n_params  # noqa: E402

import asteria  # noqa: E402

NAME = "bench_capacity"
RUNS = ("sync", "auto", "s5", "eager5")
FINAL_WINDOW = 50


def runtime_for(name: str, workers: Optional[int], cpus: Optional[str]) -> dict[str, Any]:
    if name == "sync":
        return {"mode": "sync"}
    rt: dict[str, Any] = {"mode": "async", "workers": workers,
                          "staleness": {"auto": "auto", "s5": 5, "eager5": 5}[name],
                          "install": "eager" if name == "eager5" else "deterministic"}
    if cpus:
        rt["cpuset"] = cpus
    return rt


def lr_lambda(steps: int, warmup: int):
    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        x = (i - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x))
    return f


def train(name: str, args, cfg, init, batches, cpus, log) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    model.load_state_dict(init)
    opt = make_with_wide_mask(lambda: asteria.SOAP(
        model.parameters(), lr=args.lr, precondition_frequency=args.frequency,
        runtime=runtime_for(name, args.workers, cpus)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.steps, args.warmup))
    losses, step_s, s_now, waits, bwaits = [], [], [], [], []
    chosen_at = None
    for i in range(args.steps):
        t0 = time.perf_counter()
        x, y = batches[i]
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        step_s.append(time.perf_counter() - t0)
        losses.append(loss.item())
        st = opt.asteria_stats()
        s_now.append(st["staleness"])
        waits.append(st["install_waits"])
        bwaits.append(st["barrier_waits"])
        if chosen_at is None and st.get("staleness_auto_chosen"):
            chosen_at = i + 1
        if (i + 1) % args.log_every == 0:
            log(f"{name}: step {i + 1}/{args.steps} loss {losses[-1]:.4f} S {s_now[-1]} "
                f"install waits {waits[-1]} barrier waits {bwaits[-1]}")
    plan = opt.asteria_plan()
    final = opt.asteria_stats()
    opt.close()
    # "after the first rounds": from the step auto chose S on (sync, fixed S: after 3 rounds)
    start = chosen_at if chosen_at is not None else min(args.steps, 3 * args.frequency + 2)
    return {
        "runtime": runtime_for(name, args.workers, cpus),
        "losses": losses, "step_s": step_s, "staleness": s_now,
        "install_waits": waits, "barrier_waits": bwaits,
        "auto_chosen_at_step": chosen_at,
        "waits_counted_from_step": start,
        "install_waits_after_first_rounds": waits[-1] - (waits[start - 1] if start else 0),
        "barrier_waits_after_first_rounds": bwaits[-1] - (bwaits[start - 1] if start else 0),
        "final_loss_mean_last": sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:]),
        "final_loss_last": losses[-1],
        "step_ms": common.summarize_ms(step_s[start:] or step_s),
        "capacity_plan": plan,
        "stats": {k: v for k, v in final.items() if isinstance(v, (int, float, type(None)))},
    }


PRED_CAL = [(160, 6), (576, 1)]
PRED_MODELS = {"small": [(320, 4), (384, 3)], "larger": [(448, 4), (512, 3), (320, 6)]}


def prediction(log) -> list:
    from cost_check import prediction_check

    rows = []
    with common.unpinned(common.allowed_cpus()):
        for name, sizes in PRED_MODELS.items():
            for workers in (1, 2):
                r = prediction_check(workers, sizes, PRED_CAL)
                r["model"] = name
                rows.append(r)
                log(f"prediction {name}, {workers} workers: predicted "
                    f"{r['median_predicted_s']:.4f} s, measured {r['median_measured_s']:.4f} s, "
                    f"error {100 * r['relative_error']:+.1f}%")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--runs", default="sync,auto")
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--no-prediction", dest="prediction", action="store_false")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    bad = [r for r in runs if r not in RUNS]
    if bad:
        ap.error(f"unknown run(s) {bad}; allowed: {', '.join(RUNS)}")
    log = common.Progress(NAME)
    torch.set_num_threads(1)
    where = placement()
    cpus = where.get("worker_cpus")
    data = CharData(block=128)
    cfg = GPTConfig(vocab=data.vocab, block=128, d=128, layers=2, heads=4)
    torch.manual_seed(args.seed)
    init = {k: v.clone() for k, v in TinyGPT(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(args.seed)
    batches = [data.batch("train", args.batch, gen) for _ in range(args.steps)]
    out: dict[str, Any] = common.run_metadata(NAME, __file__, argv)
    tokens = args.batch * cfg.block
    out.update({"model": {"name": "TinyGPT", "d": cfg.d, "layers": cfg.layers, "heads": cfg.heads,
                          "context": cfg.block, "params": n_params(TinyGPT(cfg)),
                          "widest_layer": 4 * cfg.d},
                "tokens_per_step": tokens, "tokens_over_widest": tokens / (4 * cfg.d),
                "steps": args.steps, "lr": args.lr, "warmup": args.warmup,
                "precondition_frequency": args.frequency, "placement": where,
                "loadavg1_start": common.loadavg(), "runs": {}})
    if args.prediction:
        pred = common.run_metadata(NAME + "_prediction", __file__, argv)
        pred.update({"loadavg1_start": common.loadavg(), "rows": prediction(log),
                     "loadavg1_end": common.loadavg()})
        log(f"wrote {common.write_json(pred, NAME + '_prediction.json', args.out_dir)}")
        if not runs:
            return 0
    for name in runs:
        out["runs"][name] = train(name, args, cfg, init, batches, cpus, log)
        common.write_json(out, f"{NAME}.json", args.out_dir)  # partial results survive an interruption
    out["loadavg1_end"] = common.loadavg()
    if "sync" in out["runs"]:
        ref = out["runs"]["sync"]
        out["vs_sync"] = {n: {"final_loss_mean_last_minus_sync":
                              r["final_loss_mean_last"] - ref["final_loss_mean_last"],
                              "final_loss_last_minus_sync":
                              r["final_loss_last"] - ref["final_loss_last"]}
                          for n, r in out["runs"].items() if n != "sync"}
    path = common.write_json(out, f"{NAME}.json", args.out_dir)
    log(f"wrote {path}")
    for n, r in out["runs"].items():
        log(f"{n}: final loss (mean of last {FINAL_WINDOW}) {r['final_loss_mean_last']:.4f}, "
            f"S chosen at step {r['auto_chosen_at_step']}: {r['staleness'][-1]}, install waits "
            f"after the first rounds {r['install_waits_after_first_rounds']}, barrier waits "
            f"{r['barrier_waits_after_first_rounds']}; vs sync {out.get('vs_sync', {}).get(n)}")
    plot(out, args.out_dir)
    return 0


def plot(out: dict, out_dir: Optional[str]) -> None:
    plt = common.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in out["runs"].items():
        steps = range(1, len(r["losses"]) + 1)
        k = 20
        sm = [sum(r["losses"][max(0, i - k + 1):i + 1]) / len(r["losses"][max(0, i - k + 1):i + 1])
              for i in range(len(r["losses"]))]
        ax[0].plot(steps, sm, label=name)
        ax[1].plot(steps, r["install_waits"], label=f"{name} install waits")
        ax[1].plot(steps, r["barrier_waits"], "--", label=f"{name} C barrier waits")
        ax[2].plot(steps, r["staleness"], label=name)
    ax[0].set(xlabel="step", ylabel="train loss (trailing mean of 20)", title="loss")
    ax[1].set(xlabel="step", ylabel="cumulative count", title="waits at the barrier")
    ax[2].set(xlabel="step", ylabel="S in force", title="staleness")
    for a in ax:
        a.legend(fontsize=7)
    fig.suptitle(f"{NAME}: TinyGPT, {out['tokens_per_step']} tokens/step, "
                 f"load {out.get('loadavg1_start')}")
    fig.tight_layout()
    d = out_dir or os.path.join(HERE, "results")
    fig.savefig(os.path.join(d, f"{NAME}.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
