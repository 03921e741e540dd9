"""How much does a busy Asteria worker slow the training core, and how often?

Asteria's async REFRESH runs on a worker pinned to a core the training thread does not use. On
real hardware that core is the training thread's own only when it is an SMT sibling (the pool's
default cpuset leaves out the caller's physical core). A virtual machine does not show where
its vCPUs run: the hypervisor may put both on the two hyperthreads of one physical core for a
while, and the guest cannot see it. Then every step that overlaps a worker job runs much slower
than the rest, whatever the optimizer does.

This probe measures that, with a baseline in the same run: the training core (the first allowed
CPU, one torch thread) multiplies 256 x 256 float32 matrices (compute-bound, in L2; --fg gemm)
or adds 32 MiB vectors (memory traffic; --fg stream) in slices of about --slice-ms, while the
pool worker (pinned to the other cores) alternates, in phases of --phase-s seconds, between
running SOAP's QR refresh of an n x n factor back to back (the op bench_step_time's worker
runs) and idling. Each phase's median slice time over the median
slice of all idle phases is its slowdown. Idle phases show the machine's own noise; busy phases
add what the worker costs the training core. A busy phase's paired slowdown is over the idle
phases on either side instead, so a slow spell of the whole machine cancels out and what is left
is the worker's doing. A phase is "slow" above --slow (1.25, the step-time target's threshold).

Writes benchmarks/results/bench_core_contention.json (bench_core_contention_stream.json with
--fg stream): per phase its state, start, median slice, slowdown, paired slowdown, worker
jobs done and the machine's steal time; and a PNG of the slowdown per phase over time.

    python3 benchmarks/bench_core_contention.py                 # 240 s
    python3 benchmarks/bench_core_contention.py --fg stream --seconds 120
    python3 benchmarks/bench_core_contention.py --quick --out-dir /tmp/x   # a few seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from asteria.refresh.host_pool import HostPoolEngine  # noqa: E402

NAME = "bench_core_contention"
FG_N = 256          # training-core gemm: 3 x 256 KiB operands stay in a 1-2 MiB L2
STREAM_MIB = 32     # training-core stream: c = a + b over 3 x 32 MiB (beyond the L2s, as big
                    # as this VM's L3): memory traffic, the other thing a worker can slow down
FOREGROUNDS = ("gemm", "stream")
IN_FLIGHT = 2       # worker jobs kept queued in a busy phase, so it never waits on us


def worker_inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (1, n, n) PSD factor and an orthonormal basis, as SOAP's QR refresh takes them."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g)
    f = a @ a.T / n
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    return f.unsqueeze(0).contiguous(), q.unsqueeze(0).contiguous()


class Worker:
    """One pinned pool worker kept busy with soap_qr jobs while ``busy`` is set."""

    def __init__(self, cpus: list[int], n: int):
        with common.unpinned(common.allowed_cpus()):
            self.engine = HostPoolEngine({"mode": "async", "workers": 1,
                                          "cpuset": common.cpu_list(cpus), "pin": True})
        self.f, self.q = worker_inputs(n, 0)
        self.pending: list[int] = []
        self.version = 0
        self.done = 0

    def feed(self, busy: bool) -> None:
        """Collect finished jobs; in a busy phase keep IN_FLIGHT queued."""
        still = []
        for t in self.pending:
            if self.engine.ready(t):
                res = self.engine.wait(t)
                if res.status != 0:
                    raise RuntimeError(f"worker job failed: {res.error}")
                self.done += 1
            else:
                still.append(t)
        self.pending = still
        while busy and len(self.pending) < IN_FLIGHT:
            self.version += 1
            self.pending.append(self.engine.submit(
                "soap_qr", self.f, self.q, block=1 + self.version % IN_FLIGHT,
                version=self.version, deadline=1 << 40, snapshot_step=0))

    def settle(self) -> None:
        """Wait for the queued jobs (end of a busy phase: the idle phase starts idle)."""
        for t in self.pending:
            self.engine.wait(t)
            self.done += 1
        self.pending = []

    def close(self) -> None:
        self.settle()
        self.engine.close()


def calibrate(unit, slice_ms: float) -> int:
    """Units of work per slice so that an idle slice lasts about slice_ms."""
    reps = 1
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            unit()
        dt = time.perf_counter() - t0
        reps = max(1, round(reps * slice_ms / (1e3 * dt)))
    return reps


def foreground(kind: str):
    """The training core's work: a function doing one unit of it, and its operands."""
    g = torch.Generator().manual_seed(1)
    if kind == "gemm":
        a, b = torch.randn(FG_N, FG_N, generator=g), torch.randn(FG_N, FG_N, generator=g)
        c = torch.empty(FG_N, FG_N)
        return lambda: torch.mm(a, b, out=c)
    n = STREAM_MIB * 2**20 // 4
    a, b = torch.randn(n, generator=g), torch.randn(n, generator=g)
    c = torch.empty(n)
    return lambda: torch.add(a, b, out=c)


def probe(args, worker_cpus: list[int], log) -> dict[str, Any]:
    unit = foreground(args.fg)
    worker = Worker(worker_cpus, args.n)
    phases: list[dict[str, Any]] = []
    try:
        reps = calibrate(unit, args.slice_ms)
        nphases = max(2, round(args.seconds / args.phase_s))
        t_start = time.perf_counter()
        for k in range(nphases):
            busy = k % 2 == 1
            done0 = worker.done
            cpu0 = common.cpu_snapshot()
            worker.feed(busy)
            slices = []
            p0 = time.perf_counter()
            while time.perf_counter() - p0 < args.phase_s:
                t0 = time.perf_counter()
                for _ in range(reps):
                    unit()
                slices.append(1e3 * (time.perf_counter() - t0))
                worker.feed(busy)
            if busy:
                worker.settle()
            steal = common.cpu_delta(cpu0, common.cpu_snapshot()).get("steal_s")
            phases.append({"phase": k, "state": "busy" if busy else "idle",
                           "start_s": p0 - t_start, "slices": len(slices),
                           "median_slice_ms": common.percentile(slices, 50),
                           "max_slice_ms": max(slices), "worker_jobs": worker.done - done0,
                           "steal_ms": None if steal is None else 1e3 * steal})
            if (k + 1) % max(1, nphases // 8) == 0:
                log(f"phase {k + 1}/{nphases}")
    finally:
        worker.close()
    base = common.percentile([p["median_slice_ms"] for p in phases if p["state"] == "idle"], 50)
    for k, p in enumerate(phases):
        p["slowdown"] = p["median_slice_ms"] / base
        if p["state"] == "busy":  # over the idle phases on either side: a slow spell cancels
            near = [q["median_slice_ms"] for q in phases[max(0, k - 1):k + 2]
                    if q["state"] == "idle"]
            p["paired_slowdown"] = p["median_slice_ms"] / (sum(near) / len(near))
    return {"units_per_slice": reps, "idle_median_slice_ms": base, "phases": phases}


def summarize(phases: list[dict[str, Any]], slow: float, phase_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for state in ("idle", "busy"):
        xs = [p["slowdown"] for p in phases if p["state"] == state]
        n_slow = sum(x > slow for x in xs)
        out[state] = {"phases": len(xs), "median_slowdown": common.percentile(xs, 50),
                      "max_slowdown": max(xs), "slow_phases": n_slow,
                      "slow_fraction": n_slow / len(xs)}
    busy = [p for p in phases if p["state"] == "busy"]
    jobs = sum(p["worker_jobs"] for p in busy)
    out["worker_jobs_per_s"] = jobs / (len(busy) * phase_s)
    paired = [p["paired_slowdown"] for p in busy]
    hit = [x for x in paired if x > slow]
    slow_steal = [p["steal_ms"] for p in busy
                  if p["paired_slowdown"] > slow and p["steal_ms"] is not None]
    out["steal_ms_in_slow_busy_phases"] = max(slow_steal) if slow_steal else None
    out["paired"] = {"median_slowdown": common.percentile(paired, 50), "max_slowdown": max(paired),
                     "slow_phases": len(hit), "slow_fraction": len(hit) / len(paired),
                     "median_slowdown_of_slow_phases": common.percentile(hit, 50) if hit
                     else None,
                     "slow_phase_starts_s": [round(p["start_s"], 1) for p in busy
                                             if p["paired_slowdown"] > slow]}
    return out


def print_table(data: dict) -> None:
    s = data["summary"]
    thr = data["settings"]["slow"]
    fg = data["settings"]["fg"]
    unit = f"gemms {FG_N}x{FG_N}" if fg == "gemm" else f"adds of {STREAM_MIB} MiB"
    print(f"training-core slice (idle worker): {data['idle_median_slice_ms']:.2f} ms "
          f"({data['units_per_slice']} {unit})")
    print(f"{'worker':<8}{'phases':>8}{'median':>9}{'max':>8}{'> ' + str(thr):>9}{'fraction':>10}")
    for state in ("idle", "busy"):
        x = s[state]
        print(f"{state:<8}{x['phases']:>8}{x['median_slowdown']:>9.3f}{x['max_slowdown']:>8.2f}"
              f"{x['slow_phases']:>9}{x['slow_fraction']:>10.3f}")
    print(f"worker: {s['worker_jobs_per_s']:.2f} soap_qr jobs/s (n={data['settings']['n']}) "
          f"in busy phases")
    if s["steal_ms_in_slow_busy_phases"] is not None:
        print(f"steal time (hypervisor ran something else) in the slow busy phases: at most "
              f"{s['steal_ms_in_slow_busy_phases']:.0f} ms per phase (both vCPUs together)")
    pr = s["paired"]
    print(f"busy phase over the idle phases on either side: median {pr['median_slowdown']:.3f}, "
          f"max {pr['max_slowdown']:.2f}; {pr['slow_phases']} of {s['busy']['phases']} over "
          f"{thr}" + (f" (median {pr['median_slowdown_of_slow_phases']:.2f}x, at "
                      f"{pr['slow_phase_starts_s']} s)" if pr["slow_phases"] else ""))


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(11, 4))
    for state, color in (("idle", "tab:gray"), ("busy", "tab:red")):
        ps = [p for p in data["phases"] if p["state"] == state]
        ax.scatter([p["start_s"] for p in ps], [p["slowdown"] for p in ps], s=10, color=color,
                   label=f"worker {state}")
    ax.axhline(data["settings"]["slow"], color="k", lw=0.8, ls="--",
               label=f"{data['settings']['slow']}x")
    ax.set(xlabel="time (s)", ylabel="training-core slice / idle median",
           title=f"Training core ({data['settings']['fg']}) while the pool worker idles or runs "
                 f"soap_qr (n={data['settings']['n']}), {data['settings']['phase_s']} s phases, "
                 f"{data['machine']['cpu_model']} x{data['machine']['nproc']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    common.write_png(fig, path)


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=None, help="total (default 240; --quick 4)")
    ap.add_argument("--phase-s", type=float, default=None,
                    help="length of each idle / busy phase (default 1.0; --quick 0.5)")
    ap.add_argument("--slice-ms", type=float, default=5.0, help="training-core slice length")
    ap.add_argument("--n", type=int, default=None,
                    help="worker's soap_qr size (default 1024, bench_step_time's widest "
                         "factor; --quick 256)")
    ap.add_argument("--fg", choices=FOREGROUNDS, default="gemm",
                    help="the training core's work: gemm (compute, in L2: slows down only when "
                         "the core itself is shared) or stream (memory traffic through L3)")
    ap.add_argument("--slow", type=float, default=1.25, help="a phase slower than this is slow")
    ap.add_argument("--quick", action="store_true", help="smoke run: a few seconds")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    q = args.quick
    defaults = dict(seconds=4.0 if q else 240.0, phase_s=0.5 if q else 1.0, n=256 if q else 1024,
                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR)
    common.fill_defaults(args, defaults)
    for k in ("seconds", "phase_s", "slice_ms"):
        if getattr(args, k) <= 0:
            ap.error(f"--{k.replace('_', '-')} must be > 0, got {getattr(args, k)}")
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if args.slow <= 1.0:
        ap.error(f"--slow must be > 1, got {args.slow}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Run the probe; returns what it wrote. The caller's torch thread count and CPU affinity
    are restored on the way out."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    cpus = common.allowed_cpus()
    train_cpu, worker_cpus = common.split_cores()
    if train_cpu is None:
        raise SystemExit(f"{NAME}: needs two CPUs (one to train, one for the worker); this "
                         f"process may use {common.cpu_list(cpus)}")
    log = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    try:
        torch.set_num_threads(1)
        common.pin_thread([train_cpu])
        log(f"training core {train_cpu}, worker on {common.cpu_list(worker_cpus)}; "
            f"{args.seconds:.0f} s in {args.phase_s} s phases; load {common.loadavg()}")
        cpu0 = common.cpu_snapshot()
        res = probe(args, worker_cpus, log)
        cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
    finally:
        torch.set_num_threads(threads)
        common.pin_thread(cpus)
    data = {**meta,
            "settings": {"seconds": args.seconds, "phase_s": args.phase_s,
                         "slice_ms": args.slice_ms, "n": args.n, "fg": args.fg,
                         "fg_gemm_n": FG_N, "fg_stream_mib": STREAM_MIB,
                         "slow": args.slow, "training_cpu": train_cpu,
                         "worker_cpus": common.cpu_list(worker_cpus), "quick": args.quick},
            "cpu": cpu,
            "units_per_slice": res["units_per_slice"],
            "idle_median_slice_ms": res["idle_median_slice_ms"],
            "summary": summarize(res["phases"], args.slow, args.phase_s),
            "phases": res["phases"]}
    name = NAME if args.fg == "gemm" else f"{NAME}_{args.fg}"
    return common.finish(data, name, args.out_dir, args.no_plot, print_table, plot, log)


if __name__ == "__main__":
    main()
