"""Worker-pool throughput of the REFRESH kernels against torch.linalg on the same thread count.

For each op (the eigendecomposition, the inverse root, SOAP's QR refresh) and size n (float32),
K independent blocks are refreshed four ways, interleaved round by round so that the ratios
compare measurements adjacent in time (the machine is shared and noisy):
  torch1  a Python loop of torch.linalg calls with torch.set_num_threads(1),
  pool1   K jobs through asteria._C.Runtime with 1 worker (pinned to the first allowed core),
  torch2  the torch loop with torch.set_num_threads(2),
  pool2   the K jobs through a Runtime with 2 workers (the first two allowed cores).
The torch side computes what the pool's op computes:
  eigh      torch.linalg.eigh(F)
  inv_root  (F + eps I)^(-1/p) via eigh (eigenvalues clamped at 0 first), p = 4, eps = 1e-12
  soap_qr   e = diag(Q^T F Q); s = argsort(e, descending); torch.linalg.qr(F Q[:, s]).Q
Each pool job is one block (batch 1) with its own block id and its own registered output
buffers; the K inputs (SPD F = G G^T / n + 1e-3 I, orthonormal Q) are shared by both sides. The
main thread sleeps in Runtime.wait (GIL released) while the workers run. The JSON reports
blocks/s per way (median over rounds), the per-round ratios pool_w / torch_w (median), the pool's
scaling pool2 / pool1, worker utilisation, other processes' CPU use during each measurement, and
a one-off check that the pool's output matches torch's. Because torch's 2-thread run can be
slower than its 1-thread run on a loaded machine (OpenMP threads waiting for a core another
process holds), pool2 is also compared with the better of torch1 and torch2.

Writes benchmarks/results/bench_pool_vs_torch.json and bench_pool_vs_torch.png (grouped bars).

    python3 benchmarks/bench_pool_vs_torch.py               # default: about 2-3 minutes on 2 cores
    python3 benchmarks/bench_pool_vs_torch.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from asteria import _C  # noqa: E402

NAME = "bench_pool_vs_torch"
OPS = ("eigh", "inv_root", "soap_qr")
MODES = ("torch1", "pool1", "torch2", "pool2")
ROOT_P = 4.0
ROOT_EPS = 1e-12
MAX_JOB_BYTES = 256 << 20  # cap on the inputs + outputs of one (op, n) measurement
_block_ids = itertools.count(1)


# ---- the torch side --------------------------------------------------------------------------

def torch_eigh(f: torch.Tensor, q: torch.Tensor):
    return torch.linalg.eigh(f)


def torch_inv_root(f: torch.Tensor, q: torch.Tensor):
    w, v = torch.linalg.eigh(f)
    return (v * (w.clamp_min(0) + ROOT_EPS).pow(-1.0 / ROOT_P)) @ v.T


def torch_soap_qr(f: torch.Tensor, q: torch.Tensor):
    e = (q * (f @ q)).sum(0)
    s = torch.argsort(e, descending=True)
    return torch.linalg.qr(f @ q[:, s]).Q, s


TORCH_FNS: dict[str, Callable] = {"eigh": torch_eigh, "inv_root": torch_inv_root,
                                  "soap_qr": torch_soap_qr}


# ---- the pool side ---------------------------------------------------------------------------

class PoolJobs:
    """K registered jobs of one op and size on one Runtime: inputs shared with the torch side,
    one set of outputs per job."""

    def __init__(self, rt: "_C.Runtime", op: str, fs: list, qs: list):
        self.rt, self.op = rt, op
        self.n = fs[0].shape[0]
        self.fs, self.qs = fs, qs
        self.outs = [torch.empty(self.n, self.n) for _ in fs]
        self.aux = [torch.empty(self.n, dtype=torch.int64 if op == "soap_qr" else torch.float32)
                    if op in ("eigh", "soap_qr") else None for _ in fs]
        bufs = list(fs) + (list(qs) if op == "soap_qr" else []) + self.outs + \
            [a for a in self.aux if a is not None]
        self.handles = [rt.register(t.data_ptr(), t.numel() * t.element_size()) for t in bufs]

    def submit(self, k: int) -> int:
        kw: dict[str, Any] = {"block": next(_block_ids)}
        if self.op == "inv_root":
            kw.update(p=ROOT_P, eps=ROOT_EPS)
        q = self.qs[k].data_ptr() if self.op == "soap_qr" else None
        aux = self.aux[k].data_ptr() if self.aux[k] is not None else None
        return self.rt.submit(self.op, "float32", self.n, 1, self.fs[k].data_ptr(), q,
                              self.outs[k].data_ptr(), aux, **kw)

    def run(self, count: int) -> list:
        tickets = [self.submit(k) for k in range(count)]
        results = [self.rt.wait(t) for t in tickets]
        bad = [r for r in results if r.status != 0]
        if bad:
            raise RuntimeError(f"pool {self.op} n={self.n}: job failed: "
                               f"{_C.err_name(bad[0].status)} ({self.rt.last_error()})")
        return results

    def close(self) -> None:
        for h in self.handles:
            self.rt.unregister(h)
        self.handles = []


def check(op: str, jobs: PoolJobs) -> dict[str, float]:
    """The pool's first output against torch's (float64 torch for the reference)."""
    jobs.run(1)
    f, q = jobs.fs[0].double(), jobs.qs[0].double()
    if op == "eigh":
        w = torch.linalg.eigvalsh(f).flip(0)
        return {"max_abs_eigenvalue_err_rel": float((jobs.aux[0].double() - w).abs().max()
                                                    / w.abs().max())}
    if op == "inv_root":
        x = torch_inv_root(f, q)
        return {"max_rel_err": float((jobs.outs[0].double() - x).abs().max() / x.abs().max())}
    qn, s = torch_soap_qr(f, q)
    return {"perm_equal": bool(torch.equal(jobs.aux[0], s)),
            "max_abs_err_up_to_sign": float((jobs.outs[0].double().abs() - qn.abs()).abs().max())}


# ---- measurement -------------------------------------------------------------------------------

def inputs(n: int, k: int, seed: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(seed + n)
    fs, qs = [], []
    for _ in range(k):
        a = torch.randn(n, n, generator=g)
        fs.append((a @ a.T / n + 1e-3 * torch.eye(n)).contiguous())
        qs.append(torch.linalg.qr(torch.randn(n, n, generator=g)).Q.contiguous())
    return fs, qs


def timed(fn: Callable[[], Any]) -> dict[str, Any]:
    c0 = common.cpu_snapshot()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu = common.cpu_delta(c0, common.cpu_snapshot())
    return {"wall_s": wall, "foreign_cores_avg": cpu.get("foreign_cores_avg")}


def measure_op(op: str, n: int, args, runtimes: dict, log: common.Progress) -> dict[str, Any]:
    fn = TORCH_FNS[op]
    per_job = (4 if op == "soap_qr" else 3) * n * n * 4
    kmax = max(4, min(args.max_jobs, MAX_JOB_BYTES // per_job))
    fs, qs = inputs(n, 1, args.seed)
    torch.set_num_threads(1)
    fn(fs[0], qs[0])  # LAPACK workspace, lazy init
    one = float("inf")
    for _ in range(3):  # the fastest of three: one hiccup must not size the whole measurement
        t0 = time.perf_counter()
        fn(fs[0], qs[0])
        one = min(one, time.perf_counter() - t0)
    k = int(min(kmax, max(args.min_jobs, round(args.budget / max(one, 1e-6)))))
    k += k % 2  # even, so two workers get equal shares
    fs, qs = inputs(n, k, args.seed)
    jobs = {w: PoolJobs(runtimes[w], op, fs, qs) for w in (1, 2)}
    try:
        chk = check(op, jobs[1])
        for w in (1, 2):
            jobs[w].run(w)  # warm-up: every worker's first call
        torch.set_num_threads(2)
        fn(fs[0], qs[0])
        samples: dict[str, list] = {m: [] for m in MODES}
        busy: dict[int, list] = {1: [], 2: []}
        for _ in range(args.rounds):
            for mode in MODES:
                if mode.startswith("torch"):
                    torch.set_num_threads(int(mode[-1]))
                    s = timed(lambda: [fn(fs[i], qs[i]) for i in range(k)])
                else:
                    w = int(mode[-1])
                    b0 = runtimes[w].stats()["worker_busy_ns"]
                    s = timed(lambda: jobs[w].run(k))
                    busy[w].append((runtimes[w].stats()["worker_busy_ns"] - b0) * 1e-9
                                   / (w * s["wall_s"]))
                s["blocks_per_s"] = k / s["wall_s"]
                samples[mode].append(s)
    finally:
        for j in jobs.values():
            j.close()
    out: dict[str, Any] = {"op": op, "n": n, "jobs_per_round": k, "rounds": args.rounds,
                           "torch1_one_call_s": one, "check": chk}
    for mode in MODES:
        bps = [s["blocks_per_s"] for s in samples[mode]]
        out[mode] = {"blocks_per_s": statistics.median(bps), "per_round_blocks_per_s": bps,
                     "per_round_foreign_cores_avg": [s["foreign_cores_avg"]
                                                     for s in samples[mode]]}
        if mode.startswith("pool"):
            out[mode]["worker_utilisation"] = statistics.median(busy[int(mode[-1])])

    def ratio(a: str, b: str) -> float:
        return statistics.median(x["blocks_per_s"] / y["blocks_per_s"]
                                 for x, y in zip(samples[a], samples[b]))

    out["ratio_pool1_torch1"] = ratio("pool1", "torch1")
    out["ratio_pool2_torch2"] = ratio("pool2", "torch2")
    out["ratio_pool2_pool1"] = ratio("pool2", "pool1")
    out["ratio_torch2_torch1"] = ratio("torch2", "torch1")
    # torch with 2 threads can lose to 1 thread (OpenMP barriers on a core another process
    # holds): the pool's 2 workers also against the better of torch's two settings
    out["ratio_pool2_torch_best"] = statistics.median(
        p["blocks_per_s"] / max(a["blocks_per_s"], b["blocks_per_s"])
        for p, a, b in zip(samples["pool2"], samples["torch1"], samples["torch2"]))
    out["torch2_slower_than_torch1"] = out["ratio_torch2_torch1"] < 1.0
    foreign = [s["foreign_cores_avg"] for m in MODES for s in samples[m]
               if s["foreign_cores_avg"] is not None]
    out["max_foreign_cores_avg"] = max(foreign) if foreign else None
    log(f"{op:>8} n={n:<5} K={k:<3} blocks/s torch1 {out['torch1']['blocks_per_s']:8.2f} "
        f"pool1 {out['pool1']['blocks_per_s']:8.2f} torch2 {out['torch2']['blocks_per_s']:8.2f} "
        f"pool2 {out['pool2']['blocks_per_s']:8.2f}  pool1/torch1 {out['ratio_pool1_torch1']:.2f} "
        f"pool2/torch2 {out['ratio_pool2_torch2']:.2f}")
    return out


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    cpus = common.allowed_cpus()
    if len(cpus) < 2:
        log(f"only {len(cpus)} allowed CPU(s): the 2-worker / 2-thread ways share it")
    cpusets = {1: common.cpu_list(cpus[:1]), 2: common.cpu_list(cpus[:2])}
    runtimes = {w: _C.Runtime({"workers": w, "cpuset": cpusets[w], "pin": True})
                for w in (1, 2)}
    log(f"ops {', '.join(args.ops)}; sizes {args.sizes}; budget {args.budget} s per "
        f"measurement, {args.rounds} rounds; pool cpusets {cpusets}; load {common.loadavg()}")
    results = []
    try:
        for op in args.ops:
            for n in args.sizes:
                results.append(measure_op(op, n, args, runtimes, log))
    finally:
        for rt in runtimes.values():
            rt.close()
    geo = {}
    for key in ("ratio_pool1_torch1", "ratio_pool2_torch2", "ratio_pool2_torch_best"):
        vals = [r[key] for r in results]
        geo[key] = statistics.geometric_mean(vals) if vals else None
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    data = {
        **meta,
        "settings": {"dtype": "float32", "sizes": args.sizes, "ops": args.ops,
                     "budget_s": args.budget, "rounds": args.rounds,
                     "min_jobs": args.min_jobs, "max_jobs": args.max_jobs,
                     "inv_root_p": ROOT_P, "inv_root_eps": ROOT_EPS, "pool_cpusets": cpusets,
                     "pool_pin": True, "quick": args.quick,
                     "torch_linalg_backend": "MKL" if torch.backends.mkl.is_available() else
                                             "torch default LAPACK",
                     "pool_linalg_backend": "LAPACKE/OpenBLAS, 1 BLAS thread per worker",
                     "summary": "blocks_per_s: median over rounds; ratios: median over rounds "
                                "of the per-round ratio; foreign_cores_avg: other processes' "
                                "busy cores during a measurement"},
        "geomean": geo,
        "results": results,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    ops = data["settings"]["ops"]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4.8), squeeze=False)
    colors = {"torch1": "tab:gray", "pool1": "tab:cyan", "torch2": "black", "pool2": "tab:blue"}
    labels = {"torch1": "torch.linalg, 1 thread", "pool1": "Asteria pool, 1 worker",
              "torch2": "torch.linalg, 2 threads", "pool2": "Asteria pool, 2 workers"}
    width = 0.2
    for ax, op in zip(axes[0], ops):
        rs = [r for r in data["results"] if r["op"] == op]
        for j, mode in enumerate(MODES):
            xs = [i + (j - 1.5) * width for i in range(len(rs))]
            bars = ax.bar(xs, [r[mode]["blocks_per_s"] for r in rs], width, color=colors[mode],
                          label=labels[mode])
            if mode.startswith("pool"):
                key = "ratio_pool1_torch1" if mode == "pool1" else "ratio_pool2_torch2"
                ax.bar_label(bars, labels=[f"x{r[key]:.2f}" for r in rs], fontsize=7)
        ax.set_xticks(range(len(rs)), [f"n={r['n']}" for r in rs])
        ax.set(yscale="log", ylabel="blocks / s (log)", title=f"{op} (float32)")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    m = data["machine"]
    fig.suptitle(f"REFRESH throughput, Asteria pool vs torch.linalg (labels: pool / torch at "
                 f"equal threads), {m['cpu_model']} x{m['nproc']}, load {m['loadavg1']}",
                 fontsize=10)
    common.write_png(fig, path)


def print_table(data: dict) -> None:
    hdr = (f"{'op':<10}{'n':>6}{'K':>5}{'torch1/s':>10}{'pool1/s':>10}{'torch2/s':>10}"
           f"{'pool2/s':>10}{'p1/t1':>8}{'p2/t2':>8}{'p2/tb':>8}{'p2/p1':>8}{'foreign':>9}")
    common.print_header(hdr)
    for r in data["results"]:
        print(f"{r['op']:<10}{r['n']:>6}{r['jobs_per_round']:>5}"
              + "".join(f"{r[m]['blocks_per_s']:>10.2f}" for m in MODES)
              + f"{r['ratio_pool1_torch1']:>8.2f}{r['ratio_pool2_torch2']:>8.2f}"
              f"{r['ratio_pool2_torch_best']:>8.2f}"
              f"{r['ratio_pool2_pool1']:>8.2f}{r['max_foreign_cores_avg'] or 0.0:>9.2f}")
    g = data["geomean"]
    print(f"geometric mean pool1/torch1 {g['ratio_pool1_torch1']:.2f}, pool2/torch2 "
          f"{g['ratio_pool2_torch2']:.2f}, pool2/best torch {g['ratio_pool2_torch_best']:.2f}  "
          "(tb: the better of torch1 / torch2; foreign: most cores other processes kept busy "
          "during one measurement)")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=None, help="comma-separated n (default 256,512,1024; "
                                                  "--quick 64,128)")
    ap.add_argument("--ops", default=",".join(OPS), help="subset of " + ",".join(OPS))
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds one torch1 measurement aims at (default 0.6; --quick 0.05)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3; --quick 1)")
    ap.add_argument("--min-jobs", type=int, default=4)
    ap.add_argument("--max-jobs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(sizes="64,128" if q else "256,512,1024",
                                    budget=0.05 if q else 0.6,
                                    rounds=1 if q else 3,
                                    out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q
                                    else common.RESULTS_DIR))
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes: not a list of integers: {args.sizes!r}")
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in args.ops:
        if o not in OPS:
            ap.error(f"unknown op {o!r}; allowed: {', '.join(OPS)}")
    if args.rounds < 1 or args.min_jobs < 2 or args.max_jobs < args.min_jobs:
        ap.error("need --rounds >= 1 and 2 <= --min-jobs <= --max-jobs")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    try:
        return run(args, argv)
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()
