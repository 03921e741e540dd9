"""GPU benchmark: native sync SOAP vs Asteria async SOAP (S=5) vs AdamW on a ~150M-param GPT.

One run measures, per optimizer on the same model, seed and batches (Tiny Shakespeare, context
512): step-time median / p99 / max (device synchronised around each step), peak device memory
(torch.cuda.max_memory_allocated; every optimizer runs in its own fresh process, so peaks do not
carry over) and optimizer-state bytes per tier (asteria_stats() where it has them, else a scan of
optimizer.state; the JSON says which). Made to finish inside a fixed time: each optimizer gets a
time budget and stops after the step that spends it; a child that overruns its budget by more than
a grace period is killed and its streamed steps are kept; the whole run has a deadline too, and an
optimizer that no longer fits is recorded as skipped.

Defaults: GPT d=1024, 12 layers, 16 heads (~150M params), bf16 autocast, batch 16 x 512,
precondition_frequency 10, S=5, max_precond_dim 1024 for both SOAPs: the 4096- and 3072-wide
factors of the MLP and QKV weights get no factor. The C pool runs one batched job per factor size
on one worker, and the first-step eigendecomposition of 24 4096-wide factors alone would take
minutes there (--max-precond-dim 10000 measures the full thing, given the time).

    python3 benchmarks/gpu_bench.py                     # on the GPU machine (tests/gpu/run.sh)
    python3 benchmarks/gpu_bench.py --smoke             # tiny model, any device: tests the logic

Writes $OUT/gpu_bench.json when OUT is set, else benchmarks/results/gpu_bench.json (--out wins),
and a PNG next to it when matplotlib is there. Exits 77 without a GPU unless --smoke.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402
from tinygpt import CharData, GPTConfig, TinyGPT, n_params, warmup_cosine  # noqa: E402

NAME = "gpu_bench"
RUNS = ("soap-sync", "soap-async", "adamw")
SKIP = 77
SLOW_STEP = 1.25       # slow_steps threshold (x the median): the step-time target's
CHILD_START_S = 15.0   # import torch, CUDA context, corpus, model: before the budget starts
CHILD_GRACE_S = 45.0   # one step past the budget (an async barrier can be long) + teardown
MIN_RUN_S = 20.0       # budget below which an optimizer is skipped rather than started


def asteria_or_error() -> tuple[Any, Optional[str]]:
    try:
        import asteria
        import asteria._C  # noqa: F401  (the optimizers validate their config through it)
    except Exception as e:  # ImportError, or a broken build's OSError
        return None, f"{type(e).__name__}: {e}"
    return asteria, None


def lr_of(name: str, args) -> float:
    """The (peak) lr of one optimizer: --lrs NAME=LR where given, else --lr."""
    return args.lr_by_name.get(name, args.lr)


def make_optimizer(name: str, params, args):
    lr = lr_of(name, args)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    asteria, err = asteria_or_error()
    if asteria is None:
        raise RuntimeError(f"asteria is not importable: {err}")
    return asteria.SOAP(params, lr=lr, precondition_frequency=args.frequency,
                        max_precond_dim=args.max_precond_dim, block_size=args.block_size,
                        runtime=runtime_of(name, args))


def runtime_of(name: str, args) -> Optional[dict[str, Any]]:
    if name == "soap-sync":
        return {"mode": "sync"}
    if name == "soap-async":
        rt: dict[str, Any] = {"mode": "async", "staleness": args.staleness,
                              "install": "deterministic"}
        if args.workers is not None:
            rt["workers"] = args.workers
        return rt
    return None


def gpt_config(args, vocab: int) -> GPTConfig:
    return GPTConfig(vocab=vocab, block=args.seq, d=args.d, layers=args.layers, heads=args.heads)


# ---- child: one optimizer, one process -------------------------------------------------------

def child(args) -> int:
    """Train under one optimizer; stream every step to args.child_out (JSON lines), then a
    final "result" line."""
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = open(args.child_out, "a", encoding="utf-8")

    def emit(rec: dict) -> None:
        out.write(json.dumps(rec, default=str) + "\n")
        out.flush()

    log = common.Progress(args.child)
    torch.manual_seed(args.seed)
    data = CharData(block=args.seq)
    cfg = gpt_config(args, data.vocab)
    gen = torch.Generator().manual_seed(args.seed)
    batches: list = []

    def batch(i: int):
        while len(batches) <= i:  # same batches in every child: one generator, in order
            batches.append(tuple(t.to(device, non_blocking=True)
                                 for t in data.batch("train", args.batch, gen)))
        return batches[i]

    model = TinyGPT(cfg).to(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    mem_params = torch.cuda.memory_allocated(device) if cuda else None
    opt = make_optimizer(args.child, model.parameters(), args)
    attach, handle = (common.attach_if_available(model, opt) if args.child != "adamw"
                      else (None, None))
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.dtype]
    log(f"{n_params(model) / 1e6:.1f}M params on {device}; budget {args.budget_s:.0f} s, "
        f"at most {args.steps} steps")
    emit({"type": "start", "params": n_params(model), "memory_params_bytes": mem_params,
          "attach": attach})

    last = [common.threads_cpu_ns()]
    lr_at = (warmup_cosine(lr_of(args.child, args), args.steps) if args.schedule == "cosine"
             else None)
    losses: list = []

    def set_lr(i: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i)

    def on_step(i, step_s, opt_s, loss):
        emit({"type": "step", "i": i, "step_ms": 1e3 * step_s, "opt_ms": 1e3 * opt_s,
              "loss": loss, "worker_ms": common.ms_since(last),
              "t": time.perf_counter() - t_loop})
        if lr_at is not None and i + 1 < args.steps:
            set_lr(i + 1)
        losses.append(loss)
        # --stop-below (convergence mode): stop once the trailing mean reaches AdamW's final
        return (args.stop_below is not None
                and sum(losses[-args.window:]) / len(losses[-args.window:]) <= args.stop_below)

    if lr_at is not None:
        set_lr(0)
    cpu0 = common.cpu_snapshot()
    t_loop = time.perf_counter()
    res = common.train_steps(model, opt, batch, args.steps, device, autocast_dtype=dtype,
                             budget_s=args.budget_s, log=log, log_every=args.log_every,
                             label=args.child, on_step=on_step)
    cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
    stats = common.runtime_stats(opt)
    rec = {"type": "result", "stopped_early": res["stopped_early"], "wall_s": res["wall_s"],
           "stopped_at_target": res["stopped_at_target"],
           "cpu": cpu,
           "bytes_per_tier": common.tier_bytes(opt, device, stats),
           "runtime_counters": common.pick_runtime_counters(stats), "asteria_stats": stats,
           "peak_bytes_registered": res["peak_bytes_registered"],
           "gc": res["gc"]}  # train_steps' default: OLMo-core's policy (collector off)
    if cuda:
        torch.cuda.synchronize()
        rec["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
        rec["peak_device_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    common.detach(handle)
    if hasattr(opt, "close"):
        opt.close()
    emit(rec)
    out.close()
    del model, opt
    gc.collect()
    return 0


# ---- parent: the run -------------------------------------------------------------------------

def read_child(path: str) -> dict[str, Any]:
    start, steps, result = {}, [], None
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a kill
                    continue
                kind = rec.pop("type", None)
                if kind == "start":
                    start = rec
                elif kind == "step":
                    steps.append(rec)
                elif kind == "result":
                    result = rec
    except OSError:
        pass
    return {"start": start, "steps": steps, "result": result}


def run_child(name: str, args, argv: Sequence[str], budget: float, hard_limit: float,
              tmpdir: str, log: common.Progress, extra: Sequence[str] = ()) -> dict[str, Any]:
    path = os.path.join(tmpdir, f"{name}.jsonl")
    if os.path.exists(path):
        os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--device", args.device,
           "--child", name, "--child-out", path, "--budget-s", f"{budget:.1f}", *extra]
    limit = min(budget + CHILD_START_S + CHILD_GRACE_S, hard_limit)
    log(f"run {name}: budget {budget:.0f} s (killed after {limit:.0f} s)")
    t0 = time.perf_counter()
    # Same process group: a global `timeout` around this script reaches the child too.
    proc = subprocess.Popen(cmd)
    timed_out = False
    try:
        rc = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()  # the child starts no processes of its own, only threads
        rc = proc.wait()
        log(f"run {name}: killed after {limit:.0f} s; keeping the steps it streamed")
    got = read_child(path)
    steps = got["steps"]
    out: dict[str, Any] = {"optimizer": name, "runtime": runtime_of(name, args),
                           "lr": lr_of(name, args),
                           "returncode": rc, "timed_out": timed_out,
                           "process_wall_s": time.perf_counter() - t0,
                           "steps_run": len(steps), **got["start"]}
    if got["result"] is not None:
        out.update(got["result"])
    elif not timed_out:
        out["error"] = f"child exited {rc} without a result"
    if steps:
        ms = [s["step_ms"] for s in steps]
        kept = common.measured(ms, args.warmup)
        out["summary"] = common.summarize_ms([t / 1e3 for t in kept])
        out["opt_step_summary"] = common.summarize_ms(
            [t / 1e3 for t in common.measured([s["opt_ms"] for s in steps], args.warmup)])
        out["warmup_excluded"] = len(ms) - len(kept)
        out["final_loss"] = common.final_loss([s["loss"] for s in steps])
        out["step_ms"] = ms
        out["opt_step_ms"] = [s["opt_ms"] for s in steps]
        out["losses"] = [s["loss"] for s in steps]
        out["worker_ms"] = [s.get("worker_ms") for s in steps]
        out["time_s"] = [s.get("t") for s in steps]
        out["smoothed"] = common.smooth(out["losses"], args.window)
        out["slow_steps"] = common.slow_steps(ms, out["worker_ms"], len(ms) - len(kept),
                                              SLOW_STEP)
    return out


def comparisons(results: dict[str, dict]) -> dict[str, Any]:
    """Async / sync ratios of the headline numbers (None where a side is missing)."""
    a, n = results.get("soap-async"), results.get("soap-sync")

    def ratio(get):
        try:
            x, y = get(a), get(n)
        except (KeyError, TypeError):
            return None
        return x / y if x is not None and y else None

    out = {f"async_over_sync_{k}": ratio(lambda r, k=k: r["summary"][k])
           for k in ("median_ms", "p99_ms", "max_ms")}
    out["async_over_sync_peak_device_memory"] = ratio(lambda r: r["peak_device_memory_bytes"])
    out["async_over_sync_device_state_bytes"] = ratio(
        lambda r: r["bytes_per_tier"]["tiers"]["device"])
    for name, r in (("soap-async", a), ("soap-sync", n)):
        if r and "summary" in r:
            out[f"{name}_p99_over_median"] = r["summary"]["p99_over_median"]
            out[f"{name}_max_over_median"] = r["summary"]["max_over_median"]
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def convergence(results: dict[str, dict], target: dict) -> dict[str, Any]:
    """Convergence mode: each optimizer's time to AdamW's final (trailing-mean) loss, as a ratio
    to AdamW's time for all its steps."""
    out: dict[str, Any] = {"adamw_final_loss": target.get("loss"),
                           "adamw_wall_s": target.get("adamw_wall_s"),
                           "adamw_steps": target.get("adamw_steps"),
                           "adamw_complete": target.get("adamw_complete"), "runs": {}}
    for name, r in results.items():
        if name == "adamw" or not r.get("smoothed") or target.get("loss") is None:
            continue
        i = common.first_reach(r["smoothed"], target["loss"])
        t = None if i is None else r["time_s"][i]
        out["runs"][name] = {"step": None if i is None else i + 1, "time_s": t,
                             "time_ratio": None if t is None else t / target["adamw_wall_s"],
                             "steps_ratio": None if i is None
                             else (i + 1) / target["adamw_steps"]}
    return out


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    runs = [r for r in data["results"] if r.get("step_ms")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2.2, 1]})
    for r in runs:
        a.plot(range(1, len(r["step_ms"]) + 1), r["step_ms"], lw=1.1, label=r["optimizer"])
    a.set(xlabel="step", ylabel="step time (ms, log)", yscale="log", title="Step time vs step")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8)
    names = [r["optimizer"] for r in runs]
    peak = [r.get("peak_device_memory_bytes", 0) / 2**30 for r in runs]
    state = [r.get("bytes_per_tier", {}).get("tiers", {}).get("device", 0) / 2**30 for r in runs]
    xs = range(len(runs))
    b.bar([x - 0.2 for x in xs], peak, 0.4, label="peak device memory")
    b.bar([x + 0.2 for x in xs], state, 0.4, label="optimizer state on device")
    b.set_xticks(list(xs), names)
    b.set(ylabel="GiB", title="Device memory")
    b.legend(fontsize=8)
    fig.suptitle(f"{data['model']['params'] / 1e6:.0f}M-param GPT, {data['settings']['device']}",
                 fontsize=10)
    common.write_png(fig, path)


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, few steps, f=4, S=2: tests the logic on any device")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    ap.add_argument("--d", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None, help="context length")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="autocast dtype of forward/backward (default bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--steps", type=int, default=None, help="most steps per optimizer")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="seconds per optimizer")
    ap.add_argument("--total-budget-s", type=float, default=None,
                    help="deadline for the whole run (children included)")
    ap.add_argument("--frequency", type=int, default=None)
    ap.add_argument("--staleness", type=int, default=None)
    ap.add_argument("--max-precond-dim", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--workers", type=int, default=None,
                    help="Asteria workers (default: the cores training does not use)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's own; --smoke 1)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lrs", action="append", default=[], metavar="NAME=LR",
                    help="one optimizer's (peak) lr, repeatable (--convergence: adamw 1e-3, "
                         "soap-async and soap-sync 2e-3)")
    ap.add_argument("--convergence", action="store_true",
                    help="the users' regime comparison: batch 128 x 512 = 65,536 tokens a step "
                         "(16x the MLP's 4096), warm-up + cosine, AdamW first; every other "
                         "optimizer stops at AdamW's final loss; reports the time ratio")
    ap.add_argument("--schedule", choices=("constant", "cosine"), default=None,
                    help="lr schedule (constant; --convergence: warm-up + cosine over --steps)")
    ap.add_argument("--window", type=int, default=None,
                    help="trailing mean of the loss for the target (20; --smoke 4)")
    ap.add_argument("--stop-below", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_bench.json or "
                                                "benchmarks/results/gpu_bench.json)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--child", choices=RUNS, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = args.smoke
    defaults = dict(d=64 if s else 1024, layers=2 if s else 12, heads=2 if s else 16,
                    seq=64 if s else 512, batch=4 if s else 16, steps=14 if s else 400,
                    warmup=3 if s else 5, budget_s=15.0 if s else 50.0,
                    total_budget_s=150.0 if s else 210.0, frequency=4 if s else 10,
                    staleness=2 if s else 5, max_precond_dim=10000 if s else 1024,
                    log_every=4 if s else 10, threads=1 if s else None)
    if args.convergence:
        # AdamW first (its final loss is the target); 16x the widest layer in tokens a step
        defaults.update(batch=64 if s else 128, seq=64 if s else 512, steps=24 if s else 150,
                        budget_s=40.0 if s else 75.0, total_budget_s=150.0 if s else 200.0,
                        schedule="cosine")
        if args.runs == ",".join(RUNS):
            args.runs = "adamw,soap-async,soap-sync"
    defaults.setdefault("schedule", "constant")
    defaults["window"] = 4 if s else 20
    common.fill_defaults(args, defaults)
    args.lr_by_name = ({"adamw": 1e-3, "soap-async": 2e-3, "soap-sync": 2e-3}
                       if args.convergence else {})
    for spec in args.lrs:
        k, _, v = spec.partition("=")
        if k not in RUNS or not v:
            ap.error(f"--lrs {spec!r}: want NAME=LR with NAME one of {', '.join(RUNS)}")
        args.lr_by_name[k] = float(v)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype is None:
        args.dtype = "bf16" if args.device.startswith("cuda") else "fp32"
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; allowed: {', '.join(RUNS)}")
    args.runs = runs
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    return args


def default_out(smoke: bool, convergence: bool = False) -> str:
    name = "gpu_convergence" if convergence else NAME
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], f"{name}_smoke.json" if smoke else f"{name}.json")
    if smoke:
        return os.path.join(common.RESULTS_DIR, "tmp", f"{name}_smoke.json")
    return os.path.join(common.RESULTS_DIR, f"{name}.json")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    log = common.Progress(NAME)
    t_start = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"{NAME}: no GPU (torch {torch.__version__} sees no CUDA device); skip "
              f"(use --smoke to test the logic on CPU)", flush=True)
        return SKIP
    meta = common.run_metadata(NAME, __file__, argv)
    out_path = args.out or default_out(args.smoke, args.convergence)
    out_dir = os.path.dirname(os.path.abspath(out_path))
    with tempfile.TemporaryDirectory(prefix=f"{NAME}_") as tmpdir:  # the children's step streams
        return run(args, argv, meta, out_path, out_dir, tmpdir, log, t_start)


def run(args, argv: list, meta: dict, out_path: str, out_dir: str, tmpdir: str,
        log: common.Progress, t_start: float) -> int:
    _, asteria_err = asteria_or_error()
    child_argv = [a for a in argv if a not in ("--no-plot",)]
    cfg = gpt_config(args, 65)
    with torch.device("meta"):  # counts only: no memory, no init time
        nparams = n_params(TinyGPT(cfg))
    log(f"GPT d={args.d} layers={args.layers} heads={args.heads} seq={args.seq} batch="
        f"{args.batch} ({nparams / 1e6:.1f}M params), {args.dtype}, device "
        f"{args.device}; f={args.frequency} S={args.staleness} max_precond_dim="
        f"{args.max_precond_dim}; budget {args.budget_s:.0f} s per optimizer, "
        f"{args.total_budget_s:.0f} s in all")
    results = []
    target: dict[str, Any] = {}  # convergence mode: AdamW's final loss, set by its run
    for i, name in enumerate(args.runs):
        if name != "adamw" and asteria_err:
            log(f"skip {name}: asteria is not importable ({asteria_err})")
            results.append({"optimizer": name, "skipped": f"asteria not importable: {asteria_err}"})
            continue
        left = args.total_budget_s - (time.perf_counter() - t_start)
        # share what is left among the runs still to come; no child outlives the deadline
        budget = min(args.budget_s, left / (len(args.runs) - i) - CHILD_START_S)
        if budget < min(MIN_RUN_S, args.budget_s):
            log(f"skip {name}: {left:.0f} s left in the total budget")
            results.append({"optimizer": name, "skipped": f"total time budget spent "
                                                          f"({left:.0f} s left)"})
            continue
        extra = []
        if args.convergence and name != "adamw" and target.get("loss") is not None:
            extra = ["--stop-below", repr(target["loss"])]
        results.append(run_child(name, args, child_argv, budget, left, tmpdir, log, extra))
        r = results[-1]
        if args.convergence and name == "adamw" and r.get("smoothed"):
            target = {"loss": r["smoothed"][-1], "adamw_wall_s": r["time_s"][-1],
                      "adamw_steps": r["steps_run"],
                      "adamw_complete": r["steps_run"] == args.steps}
            log(f"target: AdamW's final loss {target['loss']:.4f} after {r['steps_run']} steps,"
                f" {target['adamw_wall_s']:.1f} s")
    by_name = {r["optimizer"]: r for r in results}
    meta["machine"]["loadavg1_end"] = common.loadavg()
    data = {
        **meta,
        "settings": {k: getattr(args, k) for k in (
            "smoke", "device", "dtype", "d", "layers", "heads", "seq", "batch", "steps", "warmup",
            "budget_s", "total_budget_s", "frequency", "staleness", "max_precond_dim",
            "block_size", "workers", "threads", "lr", "seed", "runs", "convergence",
            "schedule", "window")},
        "model": {"name": "TinyGPT (examples/tinygpt.py)", "params": nparams,
                  "vocab": 65, "corpus": "Tiny Shakespeare (bundled), characters"},
        "asteria_import_error": asteria_err,
        "comparisons": comparisons(by_name),
        "convergence": convergence(by_name, target) if args.convergence else None,
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }
    data["settings"]["timed_region"] = "zero_grad + forward + backward + optimizer.step, synced"
    data["settings"]["lrs"] = {n: lr_of(n, args) for n in args.runs}
    data["settings"]["tokens_per_step"] = args.batch * args.seq
    data["settings"]["widest_layer_dim"] = 4 * args.d
    data["settings"]["tokens_over_widest"] = args.batch * args.seq / (4 * args.d)
    path = common.write_json(data, os.path.basename(out_path), out_dir)
    print()
    hdr = (f"{'optimizer':<12}{'steps':>6}{'median ms':>11}{'p99 ms':>10}{'max ms':>10}"
           f"{'peak GiB':>10}{'dev state GiB':>15}{'host state GiB':>16}  note")
    common.print_header(hdr)
    for r in results:
        s = r.get("summary")
        if s is None:
            print(f"{r['optimizer']:<12}  {r.get('skipped') or r.get('error') or 'no steps'}")
            continue
        t = r.get("bytes_per_tier", {}).get("tiers", {})
        host = sum(t.get(k, 0) for k in ("host", "host_pinned", "uvm"))
        note = "killed" if r.get("timed_out") else "budget" if r.get("stopped_early") else ""
        print(f"{r['optimizer']:<12}{r['steps_run']:>6}{s['median_ms']:>11.1f}{s['p99_ms']:>10.1f}"
              f"{s['max_ms']:>10.1f}{r.get('peak_device_memory_bytes', 0) / 2**30:>10.2f}"
              f"{t.get('device', 0) / 2**30:>15.3f}{host / 2**30:>16.3f}  {note}")
    conv = data["convergence"]
    if conv:
        print(f"convergence: AdamW's final loss {_fmt(conv['adamw_final_loss'])} "
              f"({args.batch * args.seq} tokens a step = "
              f"{data['settings']['tokens_over_widest']:.0f}x the widest layer)")
        for name, t in conv["runs"].items():
            print(f"  {name:<12} " + (f"reaches it at step {t['step']}, {t['time_s']:.1f} s = "
                                      f"{t['time_ratio']:.3f}x AdamW's time"
                                      if t["step"] is not None else "does not reach it"))
    if not args.no_plot:
        common.try_plot(plot, data, os.path.splitext(path)[0] + ".png", log)
    log(f"wrote {path}")
    ok = all("summary" in r or "skipped" in r for r in results)
    ran = any("summary" in r for r in results)
    return 0 if ok and ran else 1


if __name__ == "__main__":
    sys.exit(main())
