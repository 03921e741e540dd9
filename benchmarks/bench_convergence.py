"""Loss against wall-clock time: AdamW vs Asteria SOAP (async, S=5) vs native sync SOAP.

The same TinyGPT (examples/tinygpt.py), initial weights, seed and batches of Tiny Shakespeare
train under each optimizer for N steps. For each run the JSON keeps every step's train loss,
its trailing-window mean (the smoothed curve) and the wall-clock time at the end of the step.
AdamW's final loss is its smoothed loss after N steps; for each SOAP the result records the
first step, and the wall time, at which its smoothed loss reaches that value, and

    time_ratio = time_to_adamw_final(SOAP) / wall_time(AdamW, N steps)

(the SOAP paper reports about 0.65 against AdamW on language models; recorded as a target,
never fatal). Also the steps ratio steps_to_adamw_final(SOAP) / N. A SOAP run stops at N
steps, or earlier once its wall time passes --soap-budget times AdamW's (at least 10 s); if it never reaches
the target, the ratios are null and "reached" is false.

The training thread is pinned to one core with one torch thread; Asteria's worker pool gets the
other cores (as in bench_step_time.py). So AdamW and native sync SOAP use one core, Asteria SOAP
one core for training plus its workers: that is the design, and the JSON records the pinning.

Writes benchmarks/results/bench_convergence.json (machine, versions, command, date, load, every
loss and time) and bench_convergence.png (smoothed loss vs wall time, and vs step).

    python3 benchmarks/bench_convergence.py                 # default: about 3-4 minutes on 2 cores
    python3 benchmarks/bench_convergence.py --quick --out-dir /tmp/x   # a few seconds

The helpers above main() (problem set-up, the timed curve, smoothing) are shared with
bench_third_party.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402
from tinygpt import CharData, GPTConfig, TinyGPT, n_params  # noqa: E402

import asteria  # noqa: E402

NAME = "bench_convergence"
LR = 3e-3
RUNS = ("adamw", "soap-async", "soap-sync")
# "conv": big enough a batch that forward/backward, not the optimizer, dominates a step on CPU,
# small enough that three runs of a few hundred steps fit in minutes on 2 cores.
PRESETS = {
    "tiny": dict(d=64, layers=1, heads=2, block=32, batch=4),
    "conv": dict(d=128, layers=2, heads=4, block=64, batch=16),
    "small": dict(d=256, layers=2, heads=4, block=64, batch=8),
}
TARGET_TIME_RATIO = 0.65
DISTURBED_CORES = 0.25  # same threshold as bench_step_time.py
MIN_BUDGET_S = 10.0     # a SOAP run may always take this long, however fast AdamW was


# ---- shared with bench_third_party.py -------------------------------------------------------

@dataclasses.dataclass
class Problem:
    """One model configuration, its initial weights and the batches every run sees."""

    preset: str
    cfg: GPTConfig
    init_state: dict
    batches: list
    seed: int
    batch: int

    def model(self) -> TinyGPT:
        torch.manual_seed(self.seed)
        m = TinyGPT(self.cfg)
        m.load_state_dict(self.init_state)
        return m

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        return {"name": "TinyGPT", "preset": self.preset, "params": n_params(self.model()),
                "d": c.d, "layers": c.layers, "heads": c.heads, "context": c.block,
                "vocab": c.vocab, "batch": self.batch, "data": "Tiny Shakespeare (char level)"}


def build_problem(preset: str, steps: int, seed: int, batch: Optional[int] = None) -> Problem:
    p = PRESETS[preset]
    data = CharData(block=p["block"])
    cfg = GPTConfig(vocab=data.vocab, block=p["block"], d=p["d"], layers=p["layers"],
                    heads=p["heads"])
    torch.manual_seed(seed)
    init_state = {k: v.clone() for k, v in TinyGPT(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    b = batch or p["batch"]
    batches = [data.batch("train", b, gen) for _ in range(steps)]
    return Problem(preset, cfg, init_state, batches, seed, b)


def placement() -> dict[str, Any]:
    """Pin the calling (training) thread to the first allowed core; the others are for the
    pool. Returns what was done, for the JSON."""
    train_cpu, worker_cpus = common.split_cores()
    common.pin_thread(None if train_cpu is None else [train_cpu])
    return {"training_cpu": train_cpu,
            "worker_cpus": common.cpu_list(worker_cpus) if train_cpu is not None else None}


def make_with_wide_mask(factory: Callable):
    """Build an optimizer with the thread on every core: pool threads inherit that mask."""
    with common.unpinned(common.allowed_cpus()):
        return factory()


def smooth(losses: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` losses (fewer at the start): causal, so the time at
    which it crosses a value is a time the run could have known it."""
    out, acc = [], 0.0
    for i, x in enumerate(losses):
        acc += x
        if i >= window:
            acc -= losses[i - window]
        out.append(acc / min(i + 1, window))
    return out


def first_reach(values: Sequence[float], target: float) -> Optional[int]:
    for i, v in enumerate(values):
        if v <= target:
            return i
    return None


def train_curve(model, opt, problem: Problem, steps: int, *, window: int, label: str,
                log: common.Progress, log_every: int, budget_s: Optional[float] = None,
                warmup: int = 0) -> dict[str, Any]:
    """Train ``steps`` steps (or until ``budget_s``) with common.train_steps; returns the losses,
    their trailing mean, the wall time at each step end (seconds since the first step began,
    including the loop's bookkeeping), step-time statistics after ``warmup`` and the CPU use."""
    ends: list[float] = []
    t0 = time.perf_counter()
    cpu0 = common.cpu_snapshot()
    res = common.train_steps(model, opt, lambda i: problem.batches[i], steps, "cpu",
                             budget_s=budget_s, log=log, log_every=log_every, label=label,
                             on_step=lambda *a: ends.append(time.perf_counter() - t0))
    cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
    losses = res["losses"]
    return {
        "steps_run": len(losses),
        "stopped_early": res["stopped_early"],
        "wall_s": ends[-1],
        "summary": common.summarize_ms(common.measured(res["step_s"], warmup)),
        "final_loss": common.final_loss(losses),
        "cpu": cpu,
        "disturbed": (cpu.get("foreign_cores_avg") or 0.0) > DISTURBED_CORES,
        "loadavg1_end": common.loadavg(),
        "time_s": ends,
        "losses": losses,
        "smoothed": smooth(losses, window),
        "step_ms": [1e3 * t for t in res["step_s"]],
    }


def close(opt) -> dict[str, Any]:
    """Runtime counters of an Asteria optimizer, then close it ({} for a torch optimizer)."""
    stats = common.runtime_stats(opt)
    if hasattr(opt, "close"):
        opt.close()
    return stats


# ---- this benchmark ------------------------------------------------------------------------------

def make_optimizer(name: str, params, args, worker_cpus: Optional[str]):
    f = args.frequency
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    if name == "soap-sync":
        return asteria.SOAP(params, lr=LR, precondition_frequency=f, runtime={"mode": "sync"})
    if name == "soap-async":
        return asteria.SOAP(params, lr=LR, precondition_frequency=f,
                            runtime=async_runtime(args, worker_cpus))
    raise ValueError(f"unknown run {name!r}; allowed: {', '.join(RUNS)}")


def async_runtime(args, worker_cpus: Optional[str]) -> dict[str, Any]:
    rt: dict[str, Any] = {"mode": "async", "staleness": args.staleness,
                          "install": "deterministic", "workers": args.workers}
    if worker_cpus:
        rt["cpuset"] = worker_cpus
    return rt


def time_to_target(run: dict, target: float, adamw_wall: float, n_steps: int) -> dict[str, Any]:
    i = first_reach(run["smoothed"], target)
    if i is None:
        return {"reached": False, "step": None, "time_s": None, "time_ratio": None,
                "steps_ratio": None}
    t = run["time_s"][i]
    return {"reached": True, "step": i + 1, "time_s": t, "time_ratio": t / adamw_wall,
            "steps_ratio": (i + 1) / n_steps}


def run(args, argv) -> dict[str, Any]:
    log = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    meta["machine"]["loadavg"] = list(os.getloadavg())  # 1, 5, 15 minutes
    torch.set_num_threads(args.threads)
    pin = placement()
    problem = build_problem(args.model_size, args.steps, args.seed, args.batch)
    model_info = problem.describe()
    log(f"TinyGPT {model_info['params'] / 1e6:.2f}M params (preset {args.model_size}, batch "
        f"{problem.batch}); {args.steps} steps per run; f={args.frequency}, S={args.staleness}; "
        f"window {args.window}; training on cpu {pin['training_cpu']}, pool on "
        f"{pin['worker_cpus']}; load {common.loadavg()}")

    results: dict[str, dict] = {}
    adamw_wall = None
    for name in args.runs:
        model = problem.model()
        opt = make_with_wide_mask(lambda: make_optimizer(name, model.parameters(), args,
                                                         pin["worker_cpus"]))
        budget = None
        if name != "adamw" and adamw_wall is not None:
            budget = max(args.soap_budget * adamw_wall, MIN_BUDGET_S)
        log(f"run {name}" + (f" (stops after {budget:.0f} s)" if budget else ""))
        r = train_curve(model, opt, problem, args.steps, window=args.window, label=name,
                        log=log, log_every=args.log_every, budget_s=budget, warmup=args.warmup)
        stats = close(opt)
        r["optimizer"] = name
        r["runtime"] = (async_runtime(args, pin["worker_cpus"]) if name == "soap-async"
                        else {"mode": "sync"} if name == "soap-sync" else None)
        r["runtime_counters"] = common.pick_runtime_counters(stats)
        results[name] = r
        if name == "adamw":
            adamw_wall = r["wall_s"]
        gc.collect()

    out: dict[str, Any] = {}
    if "adamw" in results:
        a = results["adamw"]
        target = a["smoothed"][-1]
        out = {"adamw_final_loss": target, "adamw_steps": a["steps_run"],
               "adamw_wall_s": a["wall_s"]}
        for name in ("soap-async", "soap-sync"):
            if name in results:
                out[name] = time_to_target(results[name], target, a["wall_s"], a["steps_run"])
    ratio = out.get("soap-async", {}).get("time_ratio")
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {
        **meta,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness, "install": "deterministic",
                     "workers": args.workers, "torch_threads": args.threads, "lr": LR,
                     "adamw_betas": [0.9, 0.95], "soap_betas": "asteria.SOAP defaults (0.95, 0.95)",
                     "weight_decay": 0.01, "seed": args.seed, "quick": args.quick,
                     "smoothing": f"trailing mean over {args.window} steps",
                     "window": args.window, "soap_budget_x_adamw": args.soap_budget,
                     "pinning": pin,
                     "time_axis": "wall-clock seconds from the start of the run's first step to "
                                  "the end of each step (batches prepared beforehand)",
                     "disturbed_if_foreign_cores_above": DISTURBED_CORES},
        "model": model_info,
        "time_to_adamw_final": out,
        "targets": {"soap_async_time_ratio": {
            "value": ratio, "threshold": TARGET_TIME_RATIO, "op": "<=",
            "met": None if ratio is None else ratio <= TARGET_TIME_RATIO,
            "note": "the SOAP paper's wall-clock target against AdamW; null when not reached"}},
        "results": [results[n] for n in args.runs],
    }
    path = common.write_json(data, f"{NAME}.json", args.out_dir)
    print()
    print_table(data)
    if not args.no_plot:
        png = os.path.join(args.out_dir, f"{NAME}.png")
        try:
            plot(data, png)
            log(f"wrote {png}")
        except ImportError as e:
            log(f"no plot: {e}")
    log(f"wrote {path}")
    return data


COLORS = {"adamw": "tab:gray", "soap-sync": "tab:red", "soap-async": "tab:blue"}


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    tt = data["time_to_adamw_final"]
    for r in data["results"]:
        name = r["optimizer"]
        extra = ""
        if name in tt and tt[name]["reached"]:
            extra = f", reaches AdamW's final at {tt[name]['time_s']:.0f} s " \
                    f"(x{tt[name]['time_ratio']:.2f})"
        a.plot(r["time_s"], r["smoothed"], color=COLORS.get(name), lw=1.3,
               label=f"{name}: {r['steps_run']} steps in {r['wall_s']:.0f} s{extra}")
        b.plot(range(1, r["steps_run"] + 1), r["smoothed"], color=COLORS.get(name), lw=1.3,
               label=name)
    if "adamw_final_loss" in tt:
        for ax in (a, b):
            ax.axhline(tt["adamw_final_loss"], color="k", ls=":", lw=1,
                       label="AdamW's final loss")
    a.set(xlabel="wall-clock time (s)", ylabel=f"train loss ({data['settings']['smoothing']})",
          title="Loss vs wall-clock time")
    b.set(xlabel="step", ylabel="train loss (smoothed)", title="Loss vs step")
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    m = data["model"]
    fig.suptitle(f"{m['params'] / 1e6:.2f}M-param TinyGPT (d={m['d']}, {m['layers']} layers, "
                 f"batch {m['batch']}), f={data['settings']['frequency']}, "
                 f"S={data['settings']['staleness']}, on {data['machine']['cpu_model']} "
                 f"x{data['machine']['nproc']} (load {data['machine']['loadavg1']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(data: dict) -> None:
    tt = data["time_to_adamw_final"]
    hdr = (f"{'optimizer':<12}{'steps':>7}{'wall s':>9}{'median ms':>11}{'p99 ms':>9}"
           f"{'final':>8}{'reach step':>12}{'reach s':>9}{'t ratio':>9}{'foreign':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in data["results"]:
        t = tt.get(r["optimizer"], {})
        def fmt(v, spec):
            return format(v, spec) if v is not None else "-"
        print(f"{r['optimizer']:<12}{r['steps_run']:>7}{r['wall_s']:>9.1f}"
              f"{r['summary']['median_ms']:>11.1f}{r['summary']['p99_ms']:>9.1f}"
              f"{r['final_loss']:>8.3f}{fmt(t.get('step'), 'd'):>12}"
              f"{fmt(t.get('time_s'), '.1f'):>9}{fmt(t.get('time_ratio'), '.2f'):>9}"
              f"{r['cpu'].get('foreign_cores_avg') or 0.0:>9.2f}")
    if "adamw_final_loss" in tt:
        print(f"AdamW's final (smoothed) loss {tt['adamw_final_loss']:.4f} after "
              f"{tt['adamw_steps']} steps, {tt['adamw_wall_s']:.1f} s")
    t = data["targets"]["soap_async_time_ratio"]
    met = {True: "met", False: "NOT met", None: "not measured / not reached"}[t["met"]]
    v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
    print(f"target soap-async time_to_adamw_final / adamw time: {v} <= {t['threshold']}: {met}")
    noisy = [r["optimizer"] for r in data["results"] if r["disturbed"]]
    if noisy:
        print(f"WARNING: other processes kept > {DISTURBED_CORES} cores busy during "
              f"{', '.join(noisy)}: wall times are the machine's as much as the optimizer's")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 300; --quick 24)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (default 10; --quick 4)")
    ap.add_argument("--model-size", choices=sorted(PRESETS), default=None,
                    help="TinyGPT preset (default conv: d=128, 2 layers, batch 16; --quick tiny)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (preset's)")
    ap.add_argument("--frequency", type=int, default=None,
                    help="precondition_frequency f of both SOAPs (default 10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=None,
                    help="Asteria's staleness budget S (default 5; --quick 2)")
    ap.add_argument("--window", type=int, default=None,
                    help="steps of the trailing mean that smooths the loss (default 20; --quick 4)")
    ap.add_argument("--soap-budget", type=float, default=2.5,
                    help="a SOAP run stops once its wall time passes this many times AdamW's")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of "
                    + ",".join(RUNS) + " (adamw first: it sets the target)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(steps=24 if q else 300, warmup=4 if q else 10,
                    model_size="tiny" if q else "conv", frequency=4 if q else 10,
                    staleness=2 if q else 5, window=4 if q else 20, log_every=8 if q else 50,
                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR)
    common.fill_defaults(args, defaults)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; allowed: {', '.join(RUNS)}")
    if "adamw" in runs:
        runs.remove("adamw")
        runs.insert(0, "adamw")
    args.runs = runs
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    if args.steps < 2 or args.window < 1:
        ap.error("need --steps >= 2 and --window >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark; returns what it wrote. Restores the caller's torch thread count and
    CPU affinity."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    cpus = common.allowed_cpus()
    try:
        return run(args, argv)
    finally:
        torch.set_num_threads(threads)
        common.pin_thread(cpus)


if __name__ == "__main__":
    main()
