"""Step-time distribution of AdamW vs native sync SOAP vs Asteria async SOAP, in one run.

The same TinyGPT (examples/tinygpt.py), initial weights, seed and batches of Tiny Shakespeare
train under each optimizer in turn, all SOAPs at precondition_frequency f. Native sync SOAP runs
its REFRESH (QR power iteration of every eigenbasis) inline every f steps, so its step time
spikes; Asteria async SOAP (staleness S, deterministic install; eigenbases placed in host
memory and staged for each step, as on a GPU) hands it to one C pool worker pinned to the core
the training thread does not use. Warm-up steps are excluded from the
statistics. The model is sized so a REFRESH costs several steps (fc factors 4d wide).

Reports per optimizer: step-time median / p99 / max, p99/median, max/median, optimizer-state bytes
per tier (asteria_stats() where it has them, else a scan of optimizer.state; the JSON says which),
the final loss; the pool's CPU time during each step (schedstat) and the slow steps split by
whether a worker ran alongside them (see bench_core_contention.py for what a busy worker costs
the training core on this machine); and whether the targets held (recorded, never fatal):
  Asteria p99/median <= 1.25, native sync max/median >= 3, Asteria device bytes <= 70% of native.

Writes benchmarks/results/bench_step_time.json (machine, versions, command, date, every step time)
and bench_step_time.png (step time vs step, log y; bytes per tier).

    python3 benchmarks/bench_step_time.py                  # the default: ~4 minutes on 2 cores
    python3 benchmarks/bench_step_time.py --quick --out-dir /tmp/x    # a few seconds
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402
from tinygpt import CharData, GPTConfig, TinyGPT, n_params  # noqa: E402

import asteria  # noqa: E402

NAME = "bench_step_time"
LR = 3e-3
RUNS = ("adamw", "soap-sync", "soap-async")
# fc / out weights are (4d x d): their 4d-wide factors make the REFRESH cost several steps.
PRESETS = {
    "tiny": dict(d=64, layers=1, heads=2, block=32, batch=4),
    "small": dict(d=256, layers=2, heads=4, block=64, batch=8),
    "medium": dict(d=384, layers=2, heads=6, block=64, batch=8),
}
TARGETS = {"asteria_p99_over_median_max": 1.25, "native_max_over_median_min": 3.0,
           "asteria_device_fraction_max": 0.70}
# Other processes keeping more than this many cores busy on average make a run "disturbed":
# its tail latencies then say more about the machine than about the optimizer.
DISTURBED_CORES = 0.25


def make_optimizer(name: str, params, args, worker_cpus: Optional[str]):
    f = args.frequency
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
    if name == "soap-sync":
        return asteria.SOAP(params, lr=LR, precondition_frequency=f, runtime={"mode": "sync"})
    if name == "soap-async":
        params = list(params)
        return asteria.SOAP(params, lr=LR, precondition_frequency=f,
                            runtime=async_runtime(args, worker_cpus, params[0].device))
    raise ValueError(f"unknown run {name!r}; allowed: {', '.join(RUNS)}")


def async_runtime(args, worker_cpus: Optional[str], device: torch.device) -> dict[str, Any]:
    rt: dict[str, Any] = {"mode": "async", "staleness": args.staleness,
                          "install": "deterministic", "workers": args.workers}
    if device.type == "cpu":
        # the GPU layout (eigenbases in host memory, staged for each step), so the device-bytes
        # target means what it means on a GPU; "auto" would keep them in place on a CPU
        rt["placement"] = {"eigenbases": "host"}
    if worker_cpus:
        rt["cpuset"] = worker_cpus
    return rt


def run_one(name: str, args, cfg: GPTConfig, init_state: dict, batches: list, device,
            pinning: dict, log: common.Progress) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    model.load_state_dict(init_state)
    model.to(device)
    worker_cpus = pinning.get("worker_cpus")
    # The pool's threads start in the constructor: let them inherit every core, not the
    # training thread's, so an unpinned build cannot end up on the training core.
    with common.unpinned(common.allowed_cpus()):
        opt = make_optimizer(name, model.parameters(), args, worker_cpus)
    attach, handle = common.attach_if_available(model, opt) if name != "adamw" else (None, None)
    workers = common.thread_affinities()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log(f"run {name}: {args.steps} steps ({args.warmup} warm-up)")
    cpu0 = common.cpu_snapshot()
    worker_ms: list = []  # pool CPU time between consecutive steps' ends (None: no pool)
    last = [common.threads_cpu_ns()]

    def on_step(i, step_s, opt_s, loss):
        worker_ms.append(common.ms_since(last))

    res = common.train_steps(model, opt, lambda i: batches[i], args.steps, device,
                             log=log, log_every=args.log_every, label=name, on_step=on_step,
                             gc_policy=args.gc, gc_interval=args.gc_interval)
    cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
    stats = common.runtime_stats(opt)
    tiers = common.tier_bytes(opt, device, stats)
    common.detach(handle)
    if hasattr(opt, "close"):
        opt.close()
    w = args.warmup
    out: dict[str, Any] = {
        "optimizer": name,
        "runtime": (async_runtime(args, worker_cpus, device) if name == "soap-async"
                    else {"mode": "sync"} if name == "soap-sync" else None),
        "summary": common.summarize_ms(res["step_s"][w:]),
        "opt_step_summary": common.summarize_ms(res["opt_s"][w:]),
        "local_summary": local_ratios([1e3 * t for t in res["step_s"]], w, args.frequency),
        "phases": phase_medians([1e3 * t for t in res["step_s"]], w, args.frequency,
                                args.staleness),
        "slow_steps": common.slow_steps([1e3 * t for t in res["step_s"]], worker_ms, w,
                                        TARGETS["asteria_p99_over_median_max"]),
        "final_loss": common.final_loss(res["losses"]),
        "bytes_per_tier": tiers,
        "peak_bytes_registered": res["peak_bytes_registered"],
        "runtime_counters": common.pick_runtime_counters(stats),
        "asteria_stats": stats,
        "attach": attach,
        "gc": res["gc"],
        "worker_threads": workers,
        "wall_s": res["wall_s"],
        "cpu": cpu,
        "disturbed": (cpu.get("foreign_cores_avg") or 0.0) > DISTURBED_CORES,
        "loadavg1_end": common.loadavg(),
        "step_ms": [1e3 * t for t in res["step_s"]],
        "opt_step_ms": [1e3 * t for t in res["opt_s"]],
        "worker_ms": worker_ms,
        "losses": res["losses"],
    }
    if device.type == "cuda":
        out["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    del model, opt
    gc.collect()
    return out


def local_ratios(step_ms: Sequence[float], warmup: int, f: int) -> dict[str, Any]:
    """Each measured step over the median of the steps within f of it (2f+1 steps: every step
    class of the schedule, with the typical step in the middle): p99 and max of that ratio.
    A secondary figure, next to the target's plain p99/median: the VM this runs on has slow
    spells of many steps that hit every optimizer alike (AdamW's p99/median here has ranged
    1.22-1.93), and the ratio to the local median keeps what the optimizer's schedule adds
    (native sync's refresh spikes, Asteria's install and refresh steps) while a spell of a
    slow machine cancels out."""
    xs = list(step_ms)
    ratios = []
    for t in range(warmup, len(xs)):
        lo, hi = max(warmup, t - f), min(len(xs), t + f + 1)
        ratios.append(xs[t] / common.percentile(xs[lo:hi], 50))
    return {"window_steps": 2 * f + 1, "p99_over_local_median": common.percentile(ratios, 99),
            "max_over_local_median": max(ratios)}


def phase_medians(step_ms: Sequence[float], warmup: int, f: int, staleness: int) -> dict:
    """Median step time of the SOAP schedule's step classes, warm-up excluded. Step t counts
    step() calls from 1; the first is SOAP's initial eigenbasis, so a REFRESH is due at
    t = 1 + f*j (native: computed inline; async: snapshotted and submitted) and installed at
    t + S (async). For AdamW the same indices give a noise baseline."""
    refresh = {t for t in range(1 + f, len(step_ms) + 1, f)}
    install = {t + staleness for t in refresh} if staleness else set()
    groups: dict[str, list] = {"refresh_steps": [], "install_steps": [], "other_steps": []}
    for t, ms in enumerate(step_ms, 1):
        if t <= warmup:
            continue
        key = ("refresh_steps" if t in refresh else "install_steps" if t in install
               else "other_steps")
        groups[key].append(ms)
    out = {k: {"n": len(v), "median_ms": common.percentile(v, 50) if v else None}
           for k, v in groups.items()}
    base = out["other_steps"]["median_ms"]
    for k in ("refresh_steps", "install_steps"):
        m = out[k]["median_ms"]
        out[k]["over_other"] = m / base if m is not None and base else None
    return out


def targets(results: dict[str, dict]) -> dict[str, Any]:
    """The three targets, each with its value, threshold and whether it held (None: not run)."""
    def check(value, threshold, op):
        met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
        return {"value": value, "threshold": threshold, "op": op, "met": met}

    a, n = results.get("soap-async"), results.get("soap-sync")
    out = {
        "asteria_p99_over_median": check(
            a and a["summary"]["p99_over_median"], TARGETS["asteria_p99_over_median_max"], "<="),
        "native_sync_max_over_median": check(
            n and n["summary"]["max_over_median"], TARGETS["native_max_over_median_min"], ">="),
    }
    frac = None
    if a and n and n["bytes_per_tier"]["tiers"]["device"] > 0:
        frac = a["bytes_per_tier"]["tiers"]["device"] / n["bytes_per_tier"]["tiers"]["device"]
    dev = check(frac, TARGETS["asteria_device_fraction_max"], "<=")
    if a and n:
        dev["sources"] = {"soap-async": a["bytes_per_tier"]["source"],
                          "soap-sync": n["bytes_per_tier"]["source"]}
    out["asteria_device_bytes_fraction_of_native"] = dev
    return out


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    results = data["results"]
    warm = data["settings"]["warmup"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5), gridspec_kw={"width_ratios": [2.4, 1]})
    colors = {"adamw": "tab:gray", "soap-sync": "tab:red", "soap-async": "tab:blue"}
    for r in results:
        s = r["summary"]
        a.plot(range(1, len(r["step_ms"]) + 1), r["step_ms"], lw=1.1,
               color=colors.get(r["optimizer"]),
               label=f"{r['optimizer']}: median {s['median_ms']:.0f} ms, p99/med "
                     f"{s['p99_over_median']:.2f}, max/med {s['max_over_median']:.2f}")
    a.axvspan(0.5, warm + 0.5, color="0.9", label=f"warm-up ({warm} steps, excluded)")
    a.set(xlabel="step", ylabel="step time (ms, log)", yscale="log",
          title=f"Step time vs step (f = {data['settings']['frequency']}, "
                f"S = {data['settings']['staleness']})")
    a.grid(True, which="both", alpha=0.3)
    a.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    tiers = [t for t in common.TIERS
             if any(r["bytes_per_tier"]["tiers"][t] for r in results)] or ["device"]
    width = 0.8 / max(1, len(tiers))
    for k, t in enumerate(tiers):
        xs = [i + (k - (len(tiers) - 1) / 2) * width for i in range(len(results))]
        ys = [r["bytes_per_tier"]["tiers"][t] / 2**20 for r in results]
        bars = b.bar(xs, ys, width, label=t)
        b.bar_label(bars, fmt="%.0f", fontsize=8)
    b.set_xticks(range(len(results)),
                 [f"{r['optimizer']}\n({r['bytes_per_tier']['source']})" for r in results],
                 fontsize=8)
    b.set(ylabel="optimizer state (MiB)", title="Optimizer state bytes per tier")
    b.legend(fontsize=8)
    fig.suptitle(f"{data['model']['params'] / 1e6:.2f}M-param TinyGPT "
                 f"(d={data['model']['d']}, {data['model']['layers']} layers) on "
                 f"{data['machine']['cpu_model']} x{data['machine']['nproc']}, "
                 f"device {data['settings']['device']}", fontsize=10)
    common.write_png(fig, path)


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def print_table(data: dict) -> None:
    hdr = (f"{'optimizer':<12}{'median ms':>11}{'p99 ms':>10}{'max ms':>10}{'p99/med':>9}"
           f"{'max/med':>9}{'device MiB':>12}{'host MiB':>10}{'loss':>8}{'foreign':>9}")
    common.print_header(hdr)
    for r in data["results"]:
        s, t = r["summary"], r["bytes_per_tier"]["tiers"]
        host = t["host"] + t["host_pinned"] + t["uvm"]
        foreign = r["cpu"].get("foreign_cores_avg")
        print(f"{r['optimizer']:<12}{s['median_ms']:>11.1f}{s['p99_ms']:>10.1f}{s['max_ms']:>10.1f}"
              f"{s['p99_over_median']:>9.2f}{s['max_over_median']:>9.2f}"
              f"{t['device'] / 2**20:>12.1f}{host / 2**20:>10.1f}{r['final_loss']:>8.3f}"
              f"{float('nan') if foreign is None else foreign:>9.2f}")
    print("(foreign: average cores other processes kept busy during the run)")
    print("each step over the median of the steps within f of it (slow spells of the machine "
          "cancel out):")
    for r in data["results"]:
        loc = r["local_summary"]
        print(f"  {r['optimizer']:<12} p99 {loc['p99_over_local_median']:.2f}  "
              f"max {loc['max_over_local_median']:.2f}")
    print(f"steps over {TARGETS['asteria_p99_over_median_max']} x median, with / without a "
          f"pool worker running for >= half of the step:")
    for r in data["results"]:
        sl = r["slow_steps"]
        w, wo = sl["with_worker"], sl["without_worker"]
        print(f"  {r['optimizer']:<12} with {w['slow']:>3} of {w['steps']:<4} "
              f"without {wo['slow']:>3} of {wo['steps']:<4} slowest with "
              f"{w['slowest'][:1] or '-'} without {wo['slowest'][:1] or '-'}")
    print("median step time of the refresh-due / install steps over the other steps:")
    for r in data["results"]:
        ph = r["phases"]
        print(f"  {r['optimizer']:<12} refresh {_fmt(ph['refresh_steps']['over_other'])}  "
              f"install {_fmt(ph['install_steps']['over_other'])}")
    noisy = [r["optimizer"] for r in data["results"] if r["disturbed"]]
    if noisy:
        print(f"WARNING: other processes kept > {DISTURBED_CORES} cores busy during "
              f"{', '.join(noisy)}: tail latencies are the machine's as much as the optimizer's")
    for key, t in data["targets"].items():
        v = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target {key}: {v} {t['op']} {t['threshold']}: {met}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per optimizer, warm-up included (default 300, so that the p99 "
                         "is not just the second-slowest step; --quick 16)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the statistics (default 10; --quick 4)")
    ap.add_argument("--model-size", choices=sorted(PRESETS), default=None,
                    help="TinyGPT preset (default small: d=256, 2 layers; --quick tiny)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (preset's)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--frequency", type=int, default=None,
                    help="precondition_frequency f of both SOAPs (default 10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=None,
                    help="Asteria's staleness budget S (default 5; --quick 2)")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin the training thread to one core and the pool to the others")
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="comma-separated subset of " + ",".join(RUNS))
    ap.add_argument("--gc", choices=common.GC_POLICIES, default="olmo",
                    help="Python's cycle collector during training: olmo (the default, as "
                         "OLMo-core's trainer does: automatic collection off, gc.collect(1) "
                         "every --gc-interval steps, outside the timed region) or auto "
                         "(Python's default; its full collections stop any optimizer's step)")
    ap.add_argument("--gc-interval", type=int, default=common.OLMO_GC_INTERVAL,
                    help="steps between the olmo policy's collections (OLMo-core: 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny model, a few steps, f=4, S=2 (both paths exercised)")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(steps=16 if q else 300, warmup=4 if q else 10,
                    model_size="tiny" if q else "small", frequency=4 if q else 10,
                    staleness=2 if q else 5, log_every=4 if q else 25,
                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR)
    common.fill_defaults(args, defaults)
    if args.batch is None:
        args.batch = PRESETS[args.model_size]["batch"]
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    for r in runs:
        if r not in RUNS:
            ap.error(f"unknown run {r!r}; allowed: {', '.join(RUNS)}")
    args.runs = runs
    if args.gc_interval < 1:
        ap.error(f"--gc-interval must be >= 1, got {args.gc_interval}")
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps})")
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the benchmark; returns what it wrote. The caller's torch thread count and CPU
    affinity are restored on the way out, so it can run inside another process (the tests)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    threads = torch.get_num_threads()
    cpus = common.allowed_cpus()
    try:
        return run(args, argv, device)
    finally:
        torch.set_num_threads(threads)
        common.pin_thread(cpus)


def run(args, argv: Optional[Sequence[str]], device: torch.device) -> dict[str, Any]:
    log = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    torch.set_num_threads(args.threads)
    train_cpu, worker_cpus = (None, []) if args.no_pin else common.split_cores()
    pinning = {"training_cpu": train_cpu,
               "worker_cpus": common.cpu_list(worker_cpus) if train_cpu is not None else None}
    common.pin_thread(None if train_cpu is None else [train_cpu])

    p = PRESETS[args.model_size]
    data = CharData(block=p["block"])
    cfg = GPTConfig(vocab=data.vocab, block=p["block"], d=p["d"], layers=p["layers"],
                    heads=p["heads"])
    torch.manual_seed(args.seed)
    init_state = {k: v.clone() for k, v in TinyGPT(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(args.seed)
    batches = [tuple(t.to(device) for t in data.batch("train", args.batch, gen))
               for _ in range(args.steps)]
    nparams = sum(v.numel() for v in init_state.values())
    log(f"TinyGPT {nparams / 1e6:.2f}M params (d={cfg.d}, layers={cfg.layers}, context "
        f"{cfg.block}, batch {args.batch}); runs {', '.join(args.runs)}; f={args.frequency}, "
        f"S={args.staleness}; training thread on cpu {train_cpu}, pool on "
        f"{pinning['worker_cpus']}; "
        f"load {common.loadavg()}")

    results = [run_one(name, args, cfg, init_state, batches, device, pinning, log)
               for name in args.runs]
    by_name = {r["optimizer"]: r for r in results}
    meta["machine"]["loadavg1_end"] = common.loadavg()
    data_out = {
        **meta,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness, "install": "deterministic",
                     "workers": args.workers, "torch_threads": args.threads, "lr": LR,
                     "batch": args.batch, "seed": args.seed, "device": args.device,
                     "quick": args.quick, "pinning": pinning,
                     "gc": {"policy": args.gc,
                            "interval": args.gc_interval if args.gc == "olmo" else None,
                            "note": "olmo: as OLMo-core's GarbageCollectorCallback (automatic "
                                    "collection off, gc.collect(1) every interval steps, "
                                    "outside the timed region)"},
                     "timed_region": "zero_grad + forward + backward + optimizer.step",
                     "percentile": "linear interpolation between closest ranks",
                     "disturbed_if_foreign_cores_above": DISTURBED_CORES,
                     "tier_note": "device = memory of the training device (on a CPU run: host "
                                  "memory where the parameters live)"},
        "model": {"name": "TinyGPT", "preset": args.model_size, "params": n_params(TinyGPT(cfg)),
                  "d": cfg.d, "layers": cfg.layers, "heads": cfg.heads, "context": cfg.block,
                  "vocab": cfg.vocab, "widest_factor": 4 * cfg.d},
        "targets": targets(by_name),
        "results": results,
    }
    return common.finish(data_out, NAME, args.out_dir, args.no_plot, print_table, plot, log)


if __name__ == "__main__":
    main()
