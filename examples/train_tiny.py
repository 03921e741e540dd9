"""Train a small GPT-style character LM on Tiny Shakespeare with AdamW and the Asteria optimizers.

Every run uses the same seed, model initialisation and batches; only the optimizer changes.
Prints progress, then a table (final train loss, validation loss, step-time median / p99 / max,
wall time), and writes a PNG (loss vs step, step time vs step) and a JSON of the raw numbers.

    python3 examples/train_tiny.py                 # the README's main job (a few minutes, 2 cores)
    python3 examples/train_tiny.py --steps 50 --runs adamw,soap-async

The corpus is bundled (examples/data/tinyshakespeare.txt, from char-rnn); nothing is downloaded.
Training uses one torch thread; on a 2-core machine Asteria's worker pool gets the other core
(runtime "workers" defaults to the cores the training thread does not use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tinygpt import CharData, GPTConfig, TinyGPT, n_params  # noqa: E402

import asteria  # noqa: E402

LR = 3e-3


def make_runs():
    """name -> factory(params). Same lr and weight decay for all; Asteria keyword defaults."""
    return {
        "adamw": lambda p: torch.optim.AdamW(p, lr=LR, betas=(0.9, 0.95), weight_decay=0.01),
        "soap-sync": lambda p: asteria.SOAP(p, lr=LR, runtime={"mode": "sync"}),
        "soap-async": lambda p: asteria.SOAP(p, lr=LR, runtime={"mode": "async", "staleness": 5}),
        "kl-shampoo-async": lambda p: asteria.KLShampoo(
            p, lr=LR, runtime={"mode": "async", "staleness": 5}),
        "shampoo-async": lambda p: asteria.Shampoo(
            p, lr=LR, weight_decay=0.01, runtime={"mode": "async", "staleness": 5}),
    }


def pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def train_one(name, factory, data, cfg, args):
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    opt = factory(model.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x, y = data.batch("train", args.batch, gen)
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % args.log_every == 0 or step == args.steps:
            recent = statistics.mean(losses[-args.log_every:])
            print(f"  [{name:>16}] step {step:4d}/{args.steps}  loss {recent:.4f}  "
                  f"step {1e3 * times[-1]:7.1f} ms", flush=True)
    wall = time.perf_counter() - t_start
    model.eval()
    vgen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        val = statistics.mean(model(*data.batch("val", args.batch, vgen)).item()
                              for _ in range(args.val_batches))
    stats = opt.asteria_stats() if hasattr(opt, "asteria_stats") else {}
    if hasattr(opt, "close"):
        opt.close()
    # Loss after N steps: the mean of the last 10 steps, so one noisy batch does not decide.
    return {
        "optimizer": name,
        "final_train_loss": statistics.mean(losses[-10:]),
        "val_loss": val,
        "step_ms_median": 1e3 * statistics.median(times),
        "step_ms_p99": 1e3 * pct(times, 0.99),
        "step_ms_max": 1e3 * max(times),
        "wall_s": wall,
        "losses": losses,
        "step_times_ms": [1e3 * t for t in times],
        "asteria_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
    }


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        a.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["optimizer"], lw=1)
        b.plot(range(1, len(r["step_times_ms"]) + 1), r["step_times_ms"], label=r["optimizer"], lw=1)
    a.set(xlabel="step", ylabel="train loss (nats/char)", title="Loss vs step")
    b.set(xlabel="step", ylabel="step time (ms)", title="Step time vs step", yscale="log")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(make_runs()))
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = make_runs()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    for n in names:
        if n not in runs:
            ap.error(f"unknown run {n!r}; allowed: {', '.join(runs)}")
    data = CharData()
    cfg = GPTConfig(vocab=data.vocab)
    print(f"TinyGPT: {n_params(TinyGPT(cfg)) / 1e6:.2f}M parameters, d={cfg.d}, layers={cfg.layers}, "
          f"context {cfg.block}, batch {args.batch}, {args.steps} steps, corpus "
          f"{len(data.train) + len(data.val):,} chars", flush=True)
    results = []
    for n in names:
        print(f"run {n}", flush=True)
        results.append(train_one(n, runs[n], data, cfg, args))

    hdr = (f"{'optimizer':<18}{'loss@N':>9}{'val':>8}{'median ms':>11}{'p99 ms':>9}"
           f"{'max ms':>9}{'wall s':>8}")
    print(f"\nResults after {args.steps} steps (loss@N = mean train loss of the last 10 steps)")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['optimizer']:<18}{r['final_train_loss']:>9.4f}{r['val_loss']:>8.4f}"
              f"{r['step_ms_median']:>11.1f}{r['step_ms_p99']:>9.1f}{r['step_ms_max']:>9.1f}"
              f"{r['wall_s']:>8.1f}")
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "train_tiny.png")
    plot(results, png)
    meta = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "machine": {"platform": platform.platform(), "processor": platform.processor(),
                        "cpus": os.cpu_count()},
            "versions": {"torch": torch.__version__, "asteria": asteria.__version__,
                         "python": platform.python_version()},
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(args), "results": results}
    with open(os.path.join(args.out_dir, "train_tiny.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"\nwrote {png} and train_tiny.json")


if __name__ == "__main__":
    main()
