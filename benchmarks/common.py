"""Helpers shared by the Python benchmarks (bench_step_time.py, gpu_bench.py).

Owns: the run metadata every result file carries (machine, versions, the exact command, date;
with the load, ``start_run``), the step-time statistics (percentile, summary), writing JSON (by
default to benchmarks/results/), the printed tables' cells and header (``fmt``,
``print_header``), PNG plotting through matplotlib's Agg backend (``write_png``, ``try_plot``),
progress lines, CPU pinning of the training thread, the optimizer-state bytes per memory tier, a
slower host for the REFRESH jobs (``stretch_refresh_jobs``, ``round_steps``), a benchmark's
command line end and ``main`` (``parse_quick``, ``make_main``), and the
multi-process benchmarks: the torchrun launcher, its scratch directory and the per-rank results
(``launch_torchrun``, ``scratch_dir``, ``read_ranks``), the options, model and timed steps of
a job that trains an MLP (``add_mlp_job_args``, ``mlp_job_net``, ``mlp_job_steps``), and a
rank's start and end (``init_gloo``, ``launcher_env``, ``finish_rank``).
May call: the standard library, torch, (lazily, where present) asteria and matplotlib, and
tests/python/job_delay.py (lazily, for the job stretch). Nothing
here needs numpy or matplotlib at import time: the GPU machine may lack them.

Tiers are those of DESIGN.md ("store"): device, host_pinned, host, uvm, nvme. "device" is the
memory of the device that trains (on a CPU-only run: host memory, where the parameters live).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, NoReturn, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")

TIERS = ("device", "host_pinned", "host", "uvm", "nvme")
TIER_KEYS = tuple(f"bytes_{t}" for t in TIERS)
# Runtime counters worth keeping next to the timings when asteria_stats() reports them.
RUNTIME_COUNTERS = ("workers", "jobs_submitted", "jobs_queued", "jobs_running", "jobs_done",
                    "jobs_failed", "jobs_superseded", "installs", "max_install_lag",
                    "barrier_waits", "barrier_wait_ns", "worker_busy_ns", "bytes_registered",
                    "bytes_h2d", "bytes_d2h", "bytes_nvme_read", "bytes_nvme_written")


# ---- metadata ------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def loadavg() -> Optional[float]:
    """The 1-minute load average: says whether other processes shared the machine."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def allowed_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def cpu_snapshot() -> dict[str, float]:
    """Wall clock, this process's CPU time and the whole machine's busy CPU time (from
    /proc/stat), to tell foreign load from our own over an interval (see cpu_delta)."""
    snap = {"wall": time.perf_counter(), "self": time.process_time(), "machine": float("nan"),
            "steal": float("nan")}
    try:
        with open("/proc/stat", encoding="utf-8") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        snap["machine"] = (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
        # time the hypervisor ran something else while a vCPU wanted to run
        snap["steal"] = fields[7] / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return snap


def cpu_delta(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
    """CPU use between two snapshots: ours, the machine's, and the rest (other processes), the
    last also as average busy cores. None where /proc/stat could not be read."""
    wall = b["wall"] - a["wall"]
    own = b["self"] - a["self"]
    busy = b["machine"] - a["machine"]
    out: dict[str, Any] = {"wall_s": round(wall, 3), "self_cpu_s": round(own, 3)}
    steal = b["steal"] - a["steal"]
    if math.isfinite(steal):
        out["steal_s"] = round(steal, 3)
    if math.isfinite(busy):
        foreign = max(0.0, busy - own)
        out.update({"machine_busy_s": round(busy, 3), "foreign_cpu_s": round(foreign, 3),
                    "foreign_cores_avg": round(foreign / wall, 3) if wall > 0 else None})
    return out


def machine() -> dict[str, Any]:
    u = platform.uname()
    out: dict[str, Any] = {
        "sysname": u.system, "nodename": u.node, "release": u.release, "version": u.version,
        "machine": u.machine, "cpu_model": cpu_model(), "nproc": os.cpu_count(),
        "allowed_cpus": cpu_list(allowed_cpus()), "loadavg1": loadavg(),
    }
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            kb = int(f.readline().split()[1])
        out["mem_total_bytes"] = kb * 1024
    except (OSError, ValueError, IndexError):
        pass
    gpu = gpu_info()
    if gpu:
        out["gpu"] = gpu
    return out


def gpu_info() -> Optional[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    i = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(i)
    return {"name": p.name, "count": torch.cuda.device_count(),
            "capability": f"{p.major}.{p.minor}", "total_memory_bytes": p.total_memory,
            "multiprocessors": p.multi_processor_count}


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> Optional[str]:
    """HEAD of the checkout (read-only query); None outside a git checkout."""
    try:
        r = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(),
                           "python_implementation": platform.python_implementation()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except ImportError:
        out["torch"] = None
    try:
        import asteria

        out["asteria"] = asteria.__version__
        out["asteria_path"] = os.path.dirname(os.path.abspath(asteria.__file__))
    except ImportError as e:
        out["asteria"] = None
        out["asteria_import_error"] = str(e)
    for name in ("numpy", "matplotlib"):
        out[name] = _dist_version(name)
    out["git_commit"] = git_commit()
    return out


def command_line(script: str, argv: Optional[Sequence[str]]) -> str:
    """The command that reproduces this run: the interpreter, the script, its arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join([os.path.basename(sys.executable) or "python3",
                       os.path.relpath(os.path.abspath(script), os.getcwd())] + args)


def start_run(benchmark: str, script: str, argv: Optional[Sequence[str]]):
    """A suite part's start: (its Progress, its run_metadata with the 1, 5 and 15 minute load
    averages of now in machine["loadavg"])."""
    log = Progress(benchmark)
    meta = run_metadata(benchmark, script, argv)
    meta["machine"]["loadavg"] = list(os.getloadavg())
    return log, meta


def run_metadata(benchmark: str, script: str, argv: Optional[Sequence[str]]) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command_line(script, argv),
        "cwd": os.getcwd(),
        "machine": machine(),
        "versions": versions(),
    }


# ---- statistics ----------------------------------------------------------------------------

def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100), linear interpolation between closest ranks (numpy's
    default), so p99 of a short run lies between its two largest samples."""
    if not xs:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize_ms(times_s: Sequence[float]) -> dict[str, Any]:
    """median / p99 / max (and friends) of step times given in seconds, reported in ms."""
    ms = [1e3 * t for t in times_s]
    med = percentile(ms, 50)
    p99 = percentile(ms, 99)
    mx = max(ms)
    return {"n": len(ms), "median_ms": med, "p99_ms": p99, "max_ms": mx, "min_ms": min(ms),
            "mean_ms": sum(ms) / len(ms), "p90_ms": percentile(ms, 90),
            "p99_over_median": p99 / med if med > 0 else None,
            "max_over_median": mx / med if med > 0 else None}


def slow_steps(step_ms: Sequence[float], worker_ms: Sequence[Optional[float]], warmup: int,
               slow: float) -> dict[str, Any]:
    """The measured steps slower than ``slow`` x the median, split by whether a pool worker ran
    alongside them for at least half of the step (its CPU time over the step, from schedstat).
    bench_core_contention.py measures what a busy worker does to the training core on this
    machine; this says which of the run's slow steps it can explain. Also the median step of
    each kind over the overall median."""
    med = percentile(list(step_ms[warmup:]), 50)
    kinds: dict[str, list] = {"with_worker": [], "without_worker": []}
    for t in range(warmup, len(step_ms)):
        w = worker_ms[t] if t < len(worker_ms) else None
        kinds["with_worker" if w is not None and w >= 0.5 * step_ms[t] else
              "without_worker"].append(step_ms[t] / med)
    out: dict[str, Any] = {"threshold": slow}
    for k, rs in kinds.items():
        s = sorted(rs)
        out[k] = {"steps": len(rs), "slow": sum(r > slow for r in rs),
                  "median_over_median": percentile(s, 50) if s else None,
                  "slowest": [round(r, 3) for r in s[-3:][::-1]]}
    return out


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
    """Index of the first value <= target; None if none is."""
    for i, v in enumerate(values):
        if v <= target:
            return i
    return None


# ---- output --------------------------------------------------------------------------------

def add_output_args(ap) -> None:
    """--out-dir and --no-plot, as every suite part has them (argparse parser ``ap``)."""
    ap.add_argument("--out-dir", default=None,
                    help="where the JSON and PNG go (default benchmarks/results; --quick: "
                         "benchmarks/results/tmp)")
    ap.add_argument("--no-plot", action="store_true")


def fill_defaults(args, defaults: dict) -> None:
    """Set each of ``defaults`` the command line left at None (defaults that depend on
    --quick)."""
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def fmt(v: Any, spec: str = ".3f") -> str:
    """A table cell: ``v`` in ``format`` spec ``spec``, "-" where it is None (not measured,
    not reached)."""
    return "-" if v is None else format(v, spec)


def print_header(hdr: str) -> None:
    """A table's header line and a rule of its width under it."""
    print(hdr)
    print("-" * len(hdr))


def parse_quick(ap, argv: Optional[Sequence[str]], defaults: Callable[[bool], dict]):
    """--log-every, --quick and the output arguments added last to ``ap``; ``argv`` parsed,
    then ``defaults(quick)`` filled in where the command line left None (fill_defaults)."""
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, a few steps")
    add_output_args(ap)
    args = ap.parse_args(argv)
    fill_defaults(args, defaults(args.quick))
    return args


def write_json(data: dict, name: str, out_dir: Optional[str] = None) -> str:
    """Write ``data`` as ``out_dir/name`` (default benchmarks/results/), atomically."""
    out_dir = out_dir or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(_finite(data), f, indent=1, allow_nan=False, default=_json_default)
        f.write("\n")
    os.replace(tmp, path)
    return path


def _finite(x: Any) -> Any:
    """NaN / inf (a diverged loss, say) become null: strict JSON, and the rest still lands."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _json_default(x: Any) -> Any:
    if hasattr(x, "item"):  # torch / numpy scalars
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display). Raises ImportError if absent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, axes, path: str, title: str, machine: dict, legend: bool = True) -> None:
    """Finish a benchmark figure: a grid (and a legend) on each of ``axes``, ``title`` followed
    by the machine and its load at the start and end of the run as the figure's title, saved as
    a PNG at ``path`` and closed."""
    for ax in axes:
        ax.grid(True, alpha=0.3)
        if legend:
            ax.legend(fontsize=7)
    fig.suptitle(f"{title}, on {machine['cpu_model']} x{machine['nproc']} (load "
                 f"{machine['loadavg1']} -> {machine.get('loadavg1_end')})", fontsize=10)
    write_png(fig, path)


def write_png(fig, path: str) -> None:
    """Lay ``fig`` out, save it as a PNG at ``path`` (110 dpi) and close it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


class Progress:
    """Progress lines on stdout, flushed, prefixed with the seconds since the start."""

    def __init__(self, name: str):
        self.name = name
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.name} {self.elapsed():6.1f}s] {msg}", flush=True)


# ---- CPU placement -------------------------------------------------------------------------



def split_cores() -> tuple[Optional[int], list[int]]:
    """(core for the training thread, cores for the worker pool): the first allowed CPU trains,
    the rest compute. (None, all) when there is a single CPU."""
    cpus = allowed_cpus()
    if len(cpus) < 2:
        return None, cpus
    return cpus[0], cpus[1:]


def pin_thread(cpus: Optional[Iterable[int]]) -> None:
    """Bind the calling thread (only it: Linux applies pid 0 to the caller) to ``cpus``."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cpus))


@contextlib.contextmanager
def unpinned(all_cpus: Sequence[int]):
    """Run the body with the calling thread on every allowed CPU, then restore its mask. Threads
    started in the body (the worker pool) inherit the wide mask, not the training core."""
    if not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(all_cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _threads(prefix: str) -> Iterable[tuple[str, str]]:
    """(tid, name) of this process's threads whose name starts with ``prefix``."""
    base = "/proc/self/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return
    for tid in sorted(tids, key=int):
        try:
            with open(f"{base}/{tid}/comm", encoding="utf-8") as f:
                name = f.read().strip()
        except OSError:
            continue
        if name.startswith(prefix):
            yield tid, name


def thread_affinities(prefix: str = "ast-pool") -> list[dict[str, str]]:
    """Name and allowed CPUs of this process's threads whose name starts with ``prefix`` (the C
    pool names its workers ast-pool-<i>): shows where the workers really ran."""
    out = []
    for tid, name in _threads(prefix):
        try:
            allowed = ""
            with open(f"/proc/self/task/{tid}/status", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        allowed = line.split(":", 1)[1].strip()
            out.append({"name": name, "cpus_allowed": allowed})
        except OSError:
            continue
    return out


def threads_cpu_ns(prefix: str = "ast-pool") -> Optional[int]:
    """CPU time (ns, from /proc schedstat) the threads named ``prefix``* have run so far; None
    where the kernel does not expose it. Differences over a step say how long the workers ran
    alongside it. Threads that exit between two readings drop out of the later one."""
    total, seen = 0, False
    for tid, _ in _threads(prefix):
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="utf-8") as f:
                total += int(f.read().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue
    return total if seen else None


def ms_since(last: list) -> Optional[float]:
    """Pool CPU time (ms) since ``last[0]`` (a threads_cpu_ns() reading), which it updates;
    None without a pool or schedstat."""
    now = threads_cpu_ns()
    out = None if now is None or last[0] is None else (now - last[0]) / 1e6
    last[0] = now
    return out


# ---- optimizer state per tier ----------------------------------------------------------------

def _state_tensors(optimizer) -> Iterable:
    import torch

    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                yield v


def state_scan_bytes(optimizer, train_device) -> dict[str, int]:
    """Bytes per tier of the tensors in ``optimizer.state``, each storage counted once, by where
    each lives: on the training device -> device; pinned host memory -> host_pinned; other host
    memory -> host. (A fallback: it cannot see UVM, NVMe or the runtime's own buffers.)"""
    import torch

    train_type = torch.device(train_device).type
    seen: set = set()
    out = {t: 0 for t in TIERS}
    for t in _state_tensors(optimizer):
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if storage.data_ptr() and key in seen:
            continue
        seen.add(key)
        nbytes = storage.nbytes()
        if t.device.type == train_type:
            out["device"] += nbytes
        elif t.device.type == "cpu":
            pinned = False
            try:
                pinned = t.is_pinned()
            except RuntimeError:  # no accelerator runtime to ask
                pass
            out["host_pinned" if pinned else "host"] += nbytes
        else:
            out["device"] += nbytes
    return out


def runtime_stats(optimizer) -> dict[str, Any]:
    """``optimizer.asteria_stats()`` (scalars only), or {} for a plain torch optimizer."""
    fn = getattr(optimizer, "asteria_stats", None)
    if fn is None:
        return {}
    return {k: v for k, v in fn().items() if isinstance(v, (int, float, str, bool)) or v is None}


def tier_bytes(optimizer, train_device, stats: Optional[dict] = None) -> dict[str, Any]:
    """Optimizer-state bytes per tier. Prefers asteria_stats()'s bytes_<tier> keys (the
    runtime's own accounting, which sees its staging rings and NVMe files) when it reports all
    of them; else the scan of optimizer.state. Both are returned, with the source used."""
    stats = runtime_stats(optimizer) if stats is None else stats
    scan = state_scan_bytes(optimizer, train_device)
    if all(k in stats for k in TIER_KEYS):
        tiers = {t: int(stats[f"bytes_{t}"]) for t in TIERS}
        source = "asteria_stats"
    else:
        tiers = dict(scan)
        source = "optimizer.state"
    return {"tiers": tiers, "source": source, "total": sum(tiers.values()), "state_scan": scan}


def pick_runtime_counters(stats: dict) -> dict[str, Any]:
    return {k: stats[k] for k in RUNTIME_COUNTERS if k in stats}



# ---- a slower host: the test-only job stretch -----------------------------------------------------

def _job_hooks():
    """tests/python/job_delay.py: the one loader of asteria._C_testing (libasteria's test hooks,
    never imported by the package), whose job stretch the ``round_steps`` settings use."""
    here = os.path.join(ROOT, "tests", "python")
    if here not in sys.path:
        sys.path.insert(0, here)
    import job_delay

    return job_delay


def refresh_ops() -> list[str]:
    """The ops a REFRESH round runs on the host workers (eigendecompositions, roots, QR power
    steps): every op but the rectangular ones (``soap_rotate``, ``gram_ema``), which are
    per-step work that a GPU run does on the GPU."""
    from asteria.refresh.ops import OPS

    return [o.name for o in OPS.values() if not o.rectangular]


def stretch_refresh_jobs(optimizer, factor: float) -> int:
    """Every REFRESH job (``refresh_ops``) that ``optimizer``'s runtimes run from now on holds
    its worker ``factor`` times as long as it computed (``set_job_stretch``,
    tests/python/job_delay.py): the worker pool computes as cores 1/``factor`` as fast would,
    burning no more CPU. Returns the runtimes stretched: 0 for a torch optimizer or an Asteria
    one in mode "sync" (its refresh runs inline, at the core's full speed)."""
    if factor == 1.0 or not hasattr(optimizer, "asteria_stats"):
        return 0
    return _job_hooks().stretch_jobs(optimizer, factor, refresh_ops())


def round_steps(stats: dict, rounds_s: Sequence[float] = ()) -> Optional[dict[str, Any]]:
    """R, a REFRESH round's time (its submit to its last job's end) over the median step
    (barrier stalls excluded), from ``asteria_stats()``' capacity record: {"R", "round_s",
    "step_s"}, the round being the last one measured, or with ``rounds_s`` (the measured time
    of each round of a run) their median, and then also "R_per_round". None before a round
    was measured (or for a torch optimizer)."""
    step = stats.get("capacity_step_s")
    rnd = percentile(rounds_s, 50) if rounds_s else stats.get("capacity_measured_round_s")
    if not rnd or not step:
        return None
    out = {"R": rnd / step, "round_s": rnd, "step_s": step}
    if rounds_s:
        out["R_per_round"] = [x / step for x in rounds_s]
    return out

# ---- the timed training loop -------------------------------------------------------------------

def device_sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def attach_if_available(model, optimizer) -> tuple[dict[str, Any], Any]:
    """``asteria.attach(model, optimizer)`` where this asteria has it (the staging hooks).
    Returns (what happened, for the result file; the handle or None). A failing attach is
    recorded, not fatal."""
    try:
        import asteria
    except ImportError:
        return {"available": False}, None
    if not hasattr(asteria, "attach"):
        return {"available": False}, None
    try:
        handle = asteria.attach(model, optimizer)
    except Exception as e:  # an API still in flux must not sink the whole measurement
        return {"available": True, "attached": False, "error": f"{type(e).__name__}: {e}"}, None
    return {"available": True, "attached": True}, handle


def detach(handle) -> None:
    """Undo attach_if_available (the hooks hold the optimizer)."""
    if handle is None:
        return
    import asteria

    if hasattr(asteria, "detach"):
        asteria.detach(handle)
    elif hasattr(handle, "remove"):
        handle.remove()


# OLMo-core's trainer (GarbageCollectorCallback, added by default to distributed runs) turns
# Python's automatic cycle collector off for training and runs gc.collect(1) every
# gc_interval steps (default 1000). The step-time benchmarks train under the same policy by
# default (--gc olmo); --gc auto leaves the collector on, whose full collections of a torch
# process stop the training thread for 100+ ms whatever the optimizer.
GC_POLICIES = ("olmo", "auto")
OLMO_GC_INTERVAL = 1000


class GcWatch:
    """Collections of Python's cycle collector, counted by generation with their time, while
    ``active`` (the timed region of the steps)."""

    def __init__(self) -> None:
        self.active = False
        self.count = [0, 0, 0]
        self.ms = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += 1e3 * (time.perf_counter() - self._t0)

    def summary(self) -> dict[str, Any]:
        return {"collections_by_generation": list(self.count), "ms": round(self.ms, 3)}


class StepLoop:
    """Training steps one at a time, ``batch(i)`` giving step i's (x, y) on ``device``, so
    several models can take turns (``run_loops``). Times every step (zero_grad + forward +
    backward + optimizer.step, device synchronised around it), the optimizer step alone, and
    the training thread's CPU time over the step (what other processes' load does not stretch,
    as long as the thread keeps its core's cache). ``clock()`` is the loop's own time: its
    steps and their bookkeeping, not other loops' turns. Stops early, after a whole step, once
    that clock passes ``budget_s``. Between steps (outside the timed region) it samples the
    runtime's registered host buffers, whose peak the end-of-run stats would miss.
    ``on_step(i, step_s, opt_s, loss)`` is called after each step (outside the timed region);
    a true return value stops the loop there (a loss target reached: "stopped_at_target").
    ``gc_policy``: "olmo" (``gc.collect(1)`` after every ``gc_interval`` steps, outside the
    timed region; run_loops turns automatic collection off) or "auto" (Python's default).
    The result's "gc" says which collections ran in the timed region."""

    def __init__(self, model, optimizer, batch, steps: int, device, *, autocast_dtype=None,
                 budget_s: Optional[float] = None, log=None, log_every: int = 25,
                 label: str = "", on_step=None, gc_policy: str = "olmo",
                 gc_interval: int = OLMO_GC_INTERVAL) -> None:
        if gc_policy not in GC_POLICIES:
            raise ValueError(f"gc_policy {gc_policy!r}: allowed {', '.join(GC_POLICIES)}")
        if gc_interval < 1:
            raise ValueError(f"gc_interval must be >= 1, got {gc_interval}")
        self.model, self.optimizer, self.batch, self.steps = model, optimizer, batch, steps
        self.device, self.autocast_dtype, self.budget_s = device, autocast_dtype, budget_s
        self.log, self.log_every, self.label, self.on_step = log, log_every, label, on_step
        self.gc_policy, self.gc_interval = gc_policy, gc_interval
        self.step_s: list[float] = []
        self.opt_s: list[float] = []
        self.cpu_s: list[float] = []  # the training thread's CPU time in each step
        # the training thread's minor page faults in forward + backward and in the optimizer
        # step: fresh pages the allocator maps (and the kernel zeroes) cost time in both
        self.faults_fb: list[int] = []
        self.faults_opt: list[int] = []
        self.losses: list[float] = []
        self.peak_registered = 0
        self.stats_fn = getattr(optimizer, "asteria_stats", None)
        self.watch = GcWatch()
        self.own_s = 0.0              # finished steps, bookkeeping included
        self._t0: Optional[float] = None
        self.done = steps < 1
        self.stopped_early = self.stopped_at_target = False

    def clock(self) -> float:
        """Seconds of this loop's own: its finished steps, and the current one so far."""
        return self.own_s + (0.0 if self._t0 is None else time.perf_counter() - self._t0)

    def step(self) -> bool:
        """Run the next step and its bookkeeping; True once the loop is over."""
        import gc

        import torch

        if self.done:
            return True
        i = len(self.losses)
        x, y = self.batch(i)
        gc.callbacks.append(self.watch)
        try:
            device_sync(self.device)
            self.watch.active = True
            c0 = time.thread_time()
            f0 = thread_faults()
            t0 = self._t0 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            if self.autocast_dtype is not None:
                with torch.autocast(device_type=torch.device(self.device).type,
                                    dtype=self.autocast_dtype):
                    loss = self.model(x, y)
            else:
                loss = self.model(x, y)
            loss.backward()
            device_sync(self.device)
            t1 = time.perf_counter()
            f1 = thread_faults()
            self.optimizer.step()
            device_sync(self.device)
            t2 = time.perf_counter()
            f2 = thread_faults()
            c2 = time.thread_time()
            self.watch.active = False
            if self.gc_policy == "olmo" and (i + 1) % self.gc_interval == 0:
                gc.collect(1)
        finally:
            self.watch.active = False
            gc.callbacks.remove(self.watch)
        self.step_s.append(t2 - t0)
        self.opt_s.append(t2 - t1)
        self.cpu_s.append(c2 - c0)
        self.faults_fb.append(f1 - f0)
        self.faults_opt.append(f2 - f1)
        self.losses.append(float(loss.detach()))
        if self.on_step is not None and self.on_step(i, self.step_s[-1], self.opt_s[-1],
                                                     self.losses[-1]):
            self.stopped_at_target = True
        if self.stats_fn is not None:
            self.peak_registered = max(self.peak_registered,
                                       int(self.stats_fn().get("bytes_registered", 0)))
        log, every = self.log, self.log_every
        if log is not None and ((i + 1) % every == 0 or i + 1 == self.steps):
            recent = self.losses[-every:]
            log(f"{self.label:>10} step {i + 1:4d}/{self.steps}  loss "
                f"{sum(recent) / len(recent):.4f}  step {1e3 * self.step_s[-1]:8.1f} ms  "
                f"(opt {1e3 * self.opt_s[-1]:8.1f} ms)")
        self.own_s += time.perf_counter() - t0
        self._t0 = None
        if self.stopped_at_target:
            if log is not None:
                log(f"{self.label:>10} target reached after {i + 1} steps: stop")
            self.done = True
        elif i + 1 >= self.steps:
            self.done = True
        elif self.budget_s is not None and self.own_s > self.budget_s:
            self.stopped_early = self.done = True
            if log is not None:
                log(f"{self.label:>10} time budget {self.budget_s:.0f} s spent after {i + 1} "
                    f"steps: stop")
        return self.done

    def result(self) -> dict[str, Any]:
        return {"step_s": self.step_s, "opt_s": self.opt_s, "cpu_s": self.cpu_s,
                "minor_faults": {"fwd_bwd": self.faults_fb, "opt": self.faults_opt},
                "losses": self.losses, "wall_s": self.own_s,
                "stopped_early": self.stopped_early,
                "stopped_at_target": self.stopped_at_target,
                "peak_bytes_registered": self.peak_registered,
                "gc": {"policy": self.gc_policy,
                       "interval": self.gc_interval if self.gc_policy == "olmo" else None,
                       "in_timed_region": self.watch.summary()}}


def thread_faults() -> int:
    """The calling thread's minor page faults so far (Linux; the process's elsewhere)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who).ru_minflt


#: consecutive steps a loop takes per turn in run_loops
TURN_STEPS = 10


def run_loops(loops: Sequence[StepLoop], turn: int = TURN_STEPS) -> None:
    """Run the loops to their ends, taking turns of ``turn`` consecutive steps (one loop: one
    after another); each round starts one loop further on, so no loop always follows the same
    other one. Consecutive steps, not one step a turn: an Asteria step starts worker jobs at
    its end that run during the next forward and backward; in turns of one step they ran
    during another loop's turn, which hid what they cost the run that started them (and
    charged it to the other). With turns of ``turn`` steps only a turn's first step sees the
    previous loop's jobs. Automatic collection is off throughout if any loop's policy is
    "olmo", and restored."""
    import gc

    was_enabled = gc.isenabled()
    if any(lp.gc_policy == "olmo" for lp in loops):
        gc.disable()
    try:
        active = [lp for lp in loops if not lp.done]
        k = 0
        while active:
            j = k % len(active)
            for lp in active[j:] + active[:j]:
                for _ in range(turn):
                    if lp.step():
                        break
            active = [lp for lp in active if not lp.done]
            k += 1
    finally:
        if was_enabled:
            gc.enable()


def train_steps(model, optimizer, batch, steps: int, device, **kwargs) -> dict[str, Any]:
    """Run up to ``steps`` training steps of one model (StepLoop's arguments and result)."""
    loop = StepLoop(model, optimizer, batch, steps, device, **kwargs)
    run_loops([loop])
    return loop.result()


def measured(xs: Sequence[float], warmup: int) -> list[float]:
    """The samples after the warm-up; if a run stopped inside its warm-up, all but the first
    step (which holds one-off set-up), so a cut-short run still reports something."""
    xs = list(xs)
    if len(xs) > warmup:
        return xs[warmup:]
    return xs[1:] or xs


def final_loss(losses: Sequence[float], last: int = 10) -> float:
    """Mean of the last ``last`` training losses, so one noisy batch does not decide."""
    tail = list(losses[-last:])
    return sum(tail) / len(tail)


def finish(data: dict, name: str, out_dir: str, no_plot: bool, print_table, plot, log) -> dict:
    """The common end of a suite part: write <name>.json, print the table, plot <name>.png
    (unless no_plot; a missing matplotlib is reported, not fatal)."""
    path = write_json(data, f"{name}.json", out_dir)
    print()
    print_table(data)
    if not no_plot:
        try_plot(plot, data, os.path.join(out_dir, f"{name}.png"), log)
    log(f"wrote {path}")
    return data


def try_plot(plot, data: dict, png: str, log) -> None:
    """``plot(data, png)``, said through ``log``; a missing matplotlib is reported, not
    fatal."""
    try:
        plot(data, png)
        log(f"wrote {png}")
    except ImportError as e:
        log(f"no plot: {e}")


def run_restoring(run: Callable[..., Any], args: Any, argv: Any) -> Any:
    """``run(args, argv)``, then the caller's torch thread count and CPU affinity back (a
    benchmark pins its training thread and sets torch's threads for itself)."""
    import torch

    threads = torch.get_num_threads()
    cpus = allowed_cpus()
    try:
        return run(args, argv)
    finally:
        torch.set_num_threads(threads)
        pin_thread(cpus)


def make_main(run: Callable[..., Any],
              parse_args: Callable[[Optional[Sequence[str]]], Any]) -> Callable[..., Any]:
    """A benchmark's ``main(argv=None)``: ``run(parse_args(argv), argv)`` through
    run_restoring."""
    def main(argv: Optional[Sequence[str]] = None) -> Any:
        """Run the benchmark; returns what it wrote. Restores the caller's torch thread count
        and CPU affinity."""
        return run_restoring(run, parse_args(argv), argv)

    return main

# ---- multi-process benchmarks ----------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks_env() -> dict[str, str]:
    """The ranks' environment: this one, one OpenMP thread, and asteria importable from where
    this process imports it."""
    import asteria

    env = dict(os.environ, OMP_NUM_THREADS="1")
    pkg_root = os.path.dirname(os.path.dirname(asteria.__file__))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root] + [p for p in env.get("PYTHONPATH", "")
                                                      .split(os.pathsep) if p])
    return env


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A fresh temporary directory (``prefix``), removed with what is in it on the way out."""
    path = tempfile.mkdtemp(prefix=prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def launch_torchrun(script: str, worker_args: Sequence[str], out: str, nodes: int,
                    per_node: int, timeout: float, name: str) -> None:
    """Run ``script worker_args`` as ``nodes`` x ``per_node`` ranks on this machine: one
    torch.distributed.run launcher per simulated node, c10d rendezvous on a free local port,
    the environment of ``ranks_env``. Each node's output goes to ``out/node{i}.log``; if any
    launcher fails, the tails of those logs go to stderr and SystemExit names ``name``."""
    port = free_port()
    env = ranks_env()
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(per_node),
               "--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
               os.path.abspath(script)] + list(worker_args)
        log = open(os.path.join(out, f"node{node}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT),
                      log))
    failed = False
    for p, log in procs:
        failed |= p.wait(timeout=timeout) != 0
        log.close()
    if failed:
        for node in range(nodes):
            with open(os.path.join(out, f"node{node}.log")) as fh:
                sys.stderr.write(fh.read()[-4000:])
        raise SystemExit(f"{name}: a worker failed")


# The shape of a torchrun job that trains an MLP of square layers (bench_coherence,
# bench_fsdp_global): what its ranks are told.
MLP_JOB = ("steps", "width", "layers", "tokens", "block_size", "frequency")


def add_mlp_job_args(ap, steps: int, width: int, tokens: int) -> None:
    """An MLP job's options (argparse parser ``ap``): the ranks' own --worker and --out,
    --quick, --steps, --warmup, --width, --layers, --tokens, --block-size, --frequency."""
    import argparse

    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="few steps, a narrow model")
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=tokens, help="rows of the batch per rank")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--frequency", type=int, default=10)


def mlp_job_worker_args(args, out: str) -> list[str]:
    """The command line of an MLP job's ranks (``add_mlp_job_args``), writing into ``out``."""
    wargs = ["--worker", "--out", out]
    for k in MLP_JOB:
        wargs += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    return wargs


def mlp_job_net(args):
    """An MLP job's model, the same on every rank and in every run: ``args.layers`` x
    (Linear(args.width, args.width), tanh), from torch seed 0."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    d = args.width
    return nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(d, d), nn.Tanh())])


def mlp_job_steps(net, opt, rank: int, args, barrier: bool = False) -> tuple[list[float], float]:
    """``args.steps`` timed steps (zero_grad, forward, backward, step) of an MLP job on rank
    ``rank``'s own batches (args.tokens x args.width, fitting sin(x @ W) for a fixed W); with
    ``barrier`` the ranks start each step's clock together. Returns (seconds per step, the last
    step's loss)."""
    import torch
    import torch.distributed as dist

    d = args.width
    target = torch.randn(d, d, generator=torch.Generator().manual_seed(7)) / d ** 0.5
    times = []
    for t in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(1000 * t + rank)
        x = torch.randn(args.tokens, d, generator=gen)
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = ((net(x) - torch.sin(x @ target)) ** 2).mean()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return times, float(loss.detach())


def read_ranks(out: str, world: int) -> list[dict]:
    """The ranks' results (``finish_rank``), in rank order."""
    per_rank = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as fh:
            per_rank.append(json.load(fh))
    return per_rank


# ---- in a rank -------------------------------------------------------------------------------

def init_gloo(timeout_s: float) -> tuple[int, int]:
    """A rank's start: one torch thread, the gloo process group (collective timeout
    ``timeout_s``); (rank, world size)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def launcher_env() -> dict[str, Optional[str]]:
    """Where torchrun put this rank: GROUP_RANK (the node), LOCAL_RANK, LOCAL_WORLD_SIZE."""
    return {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def finish_rank(out: str, rank: int, result: dict) -> NoReturn:
    """A rank's end: ``result`` to out/rank{rank}.json (read_ranks), then its exit
    (asteria.rank_exit)."""
    from asteria.rank_exit import exit_rank

    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    exit_rank(0)
