"""The cost model of the REFRESH work: how long a round takes on the lanes that run it.

Owns: the FLOP count of a job (``flops``, from each op's count in ``asteria.refresh.ops``), the
throughput measured per lane, op, dtype and size (``CostModel``), the prediction of a round's
time on a number of workers or lanes (``makespan``, ``assign``, ``split_makespan``,
``predict_round``), the smallest S and worker count that cover a round (``smallest_s``,
``smallest_workers``), the window a round has at a given S (``window_s``), the rule that
chooses an "auto" S and f from a round's and a step's seconds (``choose_staleness``,
``choose_frequency``: the one place it is written; ``asteria.optim.cadence`` applies it to a
run's measurements, ``asteria.plan`` to a model's), the device lane's rate before it is measured
(``DEVICE_PRIOR_GFLOPS``, a published figure) and from a GPU microbenchmark's JSON
(``read_gpu_microbench``, ``add_gpu_microbench``; the ops each of its ops prices,
``GPU_MICROBENCH_OPS``, read from the ops' fields: ``square_ops``, ``least_work``), and the
measurement of a machine's per-core rate (``calibrate``). One optimizer's record of its rounds
and the capacity report are ``asteria.refresh.capacity``'s; the check of the prediction against
the pool is benchmarks/cost_check.py's. May call: torch, ``asteria.refresh.ops``,
``asteria.refresh.engine`` (JobTiming, Lane) and, for ``calibrate`` only,
``asteria.refresh.host_pool``. Single-threaded (the training thread); executors hand it
finished jobs through their ``observer`` on that thread.

FLOPs per batch entry (n: the factor's size; real arithmetic, one multiply-add = 2 FLOPs; each
op's count is its ``flops`` entry in asteria/refresh/ops.py):

==================  ============================================  ===============================
op                  count                                         from
==================  ============================================  ===============================
``eigh``            9 n^3                                         symmetric QR with vectors
                                                                  (Golub & Van Loan, 8.3)
``inv_root``        9 n^3 + 2 n^3 = 11 n^3                        eigh, then Q diag(w) Q^T
``newton_root``     20 (2 p + 2) n^3, p the root (integer)        nominal: 20 coupled-Newton
                                                                  iterations of p + 1 matmuls
``soap_qr``         2 n^3 + 8/3 n^3 = 14/3 n^3                    F Q, then Householder QR
                                                                  (geqrf 4/3 + orgqr 4/3)
``kl_qr``           14/3 n^3                                      as soap_qr
``soap_rotate``     4 n^2 n1 (A pair) + 4 n n1^2 (B pair)         two matmuls per side
``gram_ema``        n^2 n1 (L) + n n1^2 (R); one factor given:    one ?syrk per factor (half a
                    n^2 n1 (which one is not known)               matmul), G n x n1
==================  ============================================  ===============================

Throughput: a lane's seconds per entry are measured from finished jobs (the C pool's own
start / end times on its worker thread, or Python's wall time around the torch call for the
inline and device executors; each ``JobTiming`` says which). Per (lane, op, dtype) the model
keeps the mean of the last samples at each measured size, its largest dropped (``_typical``); between two measured sizes the
rate (FLOP/s) is interpolated log-linearly in the FLOP count, outside them it is the nearest
measured size's rate, so time scales with n^3 from there. An op never measured on a lane
takes that lane's median rate over the ops it has measured, then the lane's base rate (a
calibration or a given per-core throughput), and each prediction says where its rate came from.
A round's predicted time runs from its first submit: each job is released when its submit
returns (the snapshot copy on the caller's thread, priced per byte as measured), runs on the
lanes as the executor schedules it, and the round pays once the median dispatch latency
measured (a submit's return to the first job's start: waking a worker, or waiting for a core
on a busy machine).
Half-precision jobs are computed in float32 (as the executors do) and priced as float32;
float64 without its own measurement at half the float32 rate.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import statistics
from collections import defaultdict, deque
from typing import Any, Iterable, Optional, Sequence

import torch

from asteria.refresh.engine import JobTiming, Lane
from asteria.refresh.ops import NEWTON_NOMINAL_ITERS, OPS  # noqa: F401

SAMPLES = 9                  # per measured size: the last SAMPLES (see _typical)
ASSUMED_GFLOPS = 5.0         # a lane with nothing measured and no base rate (labelled so)
#: a device lane before its first job (the split explores it from there; the planner prices
#: the device executor with it): a published figure, not measured here (docs/capacity.md, "The
#: device executor's rate"). One QR power step of SOAP (F Q, then QR) of a factor of size
#: DEVICE_PRIOR_N takes 5 to 10 ms on an H100 in float32 (NVIDIA Emerging-Optimizers); the slow
#: end, DEVICE_PRIOR_S, as a FLOP rate for every op (DEVICE_PRIOR_GFLOPS, below ``least_work``)
DEVICE_PRIOR_N = 2048
DEVICE_PRIOR_S = 0.010
DEVICE_PRIOR_SOURCE = (f"device prior: a published H100 figure, one QR power step of "
                       f"n={DEVICE_PRIOR_N} in {DEVICE_PRIOR_S * 1e3:g} ms (not measured)")


def flops(op: str, n: int, n1: int = 0, p: float = 0.0, sides: int = 2) -> float:
    """FLOPs of one batch entry of ``op`` on a factor of size n (table above). ``soap_rotate``:
    X is n x n1 and ``sides`` says which pairs were given (2: both; 1: the A pair);
    ``gram_ema``: G is n x n1 and ``sides`` says how many of L and R were given."""
    if op not in OPS:
        raise ValueError(f"unknown REFRESH op {op!r}; allowed: {', '.join(OPS)}")
    return OPS[op].flops(float(n), float(n1), p, sides)


def square_ops(takes_basis: bool) -> tuple:
    """The square ops (F n x n: not ``Op.rectangular``) that take a basis (``Op.takes_basis``),
    or those that do not, in the op table's order."""
    return tuple(name for name, op in OPS.items()
                 if not op.rectangular and op.takes_basis == takes_basis)


def least_work(ops: Sequence[str], n: int) -> str:
    """The op of ``ops`` with the fewest FLOPs on a factor of size n (the first of equals)."""
    return min(ops, key=lambda op: flops(op, n))


# a QR power step is the refresh of the square ops that take a basis: the least work of them
DEVICE_PRIOR_GFLOPS = (flops(least_work(square_ops(True), DEVICE_PRIOR_N), DEVICE_PRIOR_N)
                       / DEVICE_PRIOR_S / 1e9)  # 4.0 TFLOP/s


def _typical(samples: Iterable[float]) -> float:
    """The mean without the largest sample (one outlier of a busy machine dropped): a round's
    time is a sum of jobs, and on a loaded machine job times are skewed to the right, so the
    mean, not the median, is what sums to a round's typical time."""
    xs = sorted(samples)
    if len(xs) > 2:
        xs = xs[:-1]
    return sum(xs) / len(xs)


def _dtype_key(dtype: Any) -> str:
    if dtype in (torch.float64, "float64"):
        return "float64"
    return "float32"  # half precision runs in float32 on every executor


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One batched job of a round, as the model prices it."""

    op: str
    dtype: Any
    n: int
    batch: int
    n1: int = 0
    p: float = 0.0
    sides: int = 2

    @property
    def flops_per_entry(self) -> float:
        return flops(self.op, self.n, self.n1, self.p, self.sides)

    @property
    def flops(self) -> float:
        return self.batch * self.flops_per_entry

    @property
    def input_bytes(self) -> int:
        """Bytes the executor snapshots at submit (F, and Q or the rotation's pairs, or G and
        the factors)."""
        size = 8 if _dtype_key(self.dtype) == "float64" else 4
        n, n1 = self.n, self.n1 or self.n
        return self.batch * OPS[self.op].read_elems(n, n1, self.sides) * size


class CostModel:
    """Measured throughput per (lane, op, dtype, size); predictions in seconds per entry."""

    def __init__(self, base_gflops: Optional[dict] = None, source: str = "") -> None:
        #: (lane, op, dtype) -> {(n, n1, p, sides): deque of (flops, seconds) per entry}
        self._points: dict = defaultdict(dict)
        #: lane -> GFLOP/s used where nothing is measured (calibration, or given)
        self.base_gflops: dict = dict(base_gflops or {})
        self.base_source = source
        self.observed = 0
        self._dispatch: deque = deque(maxlen=SAMPLES)
        self._submit: deque = deque(maxlen=4 * SAMPLES)  # seconds per byte of a submit

    def observe_submit(self, nbytes: int, seconds: float) -> None:
        """One submit on the caller's thread took ``seconds`` for ``nbytes`` of inputs (the
        snapshot copy): a job cannot start before its submit returns."""
        if nbytes > 0 and seconds > 0:
            self._submit.append(seconds / nbytes)

    def submit_seconds(self, job: "JobSpec") -> float:
        return job.input_bytes * statistics.median(self._submit) if self._submit else 0.0

    def observe_dispatch(self, seconds: float) -> None:
        """A round's dispatch latency: from its first submit's return to its first job's start
        (waking a worker; on a busy machine, waiting for a core)."""
        self._dispatch.append(max(0.0, float(seconds)))

    @property
    def dispatch_s(self) -> float:
        """The median dispatch latency measured (0 before any): every round pays it once."""
        return statistics.median(self._dispatch) if self._dispatch else 0.0

    def observe(self, t: JobTiming) -> None:
        """Learn from one finished job (failed or unmeasured ones are ignored)."""
        if not t.ok or not t.started_ns or t.done_ns <= t.started_ns or t.batch <= 0:
            return
        per_entry = (t.done_ns - t.started_ns) / 1e9 / t.batch
        self.add(t.lane, t.op, t.dtype, t.n, per_entry, t.n1, t.p, t.sides)

    def add(self, lane: str, op: str, dtype: Any, n: int, seconds_per_entry: float,
            n1: int = 0, p: float = 0.0, sides: int = 2) -> None:
        key = (lane, op, _dtype_key(dtype))
        size = (int(n), int(n1), float(p), int(sides))
        q = self._points[key].setdefault(size, deque(maxlen=SAMPLES))
        q.append((flops(op, n, n1, p, sides), float(seconds_per_entry)))
        self.observed += 1

    def _curve(self, lane: str, op: str, dt: str) -> list:
        """[(flops, rate)] of the measured sizes, by flops."""
        pts = self._points.get((lane, op, dt), {})
        out = []
        for q in pts.values():
            f = q[0][0]
            s = _typical(x[1] for x in q)
            if s > 0:
                out.append((f, f / s))
        return sorted(out)

    @staticmethod
    def _interp(curve: list, f: float) -> float:
        if f <= curve[0][0]:
            return curve[0][1]
        if f >= curve[-1][0]:
            return curve[-1][1]
        for (f0, r0), (f1, r1) in zip(curve, curve[1:]):
            if f0 <= f <= f1:
                if f1 == f0:
                    return r1
                w = (math.log(f) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
        return curve[-1][1]

    def rate(self, lane: str, op: str, dtype: Any, f: float) -> tuple[float, str]:
        """(FLOP/s for an entry of f FLOPs, where that rate comes from)."""
        dt = _dtype_key(dtype)
        curve = self._curve(lane, op, dt)
        if curve:
            return self._interp(curve, f), "measured"
        if dt == "float64":
            curve = self._curve(lane, op, "float32")
            if curve:
                return self._interp(curve, f) / 2.0, "measured in float32, halved"
        rates = [self._interp(c, f) for c in (self._curve(lane, o, dt) for o in
                                                   {k[1] for k in self._points if k[0] == lane})
                 if c]
        if rates:
            return statistics.median(rates), "the lane's other ops"
        if lane in self.base_gflops:
            return self.base_gflops[lane] * 1e9, self.base_source or "base rate"
        if lane == Lane.DEVICE:
            return DEVICE_PRIOR_GFLOPS * 1e9, DEVICE_PRIOR_SOURCE
        return ASSUMED_GFLOPS * 1e9, "assumed (nothing measured)"

    def measured(self, lane: str, op: str, dtype: Any) -> bool:
        return bool(self._curve(lane, op, _dtype_key(dtype)))

    def entry_seconds(self, lane: str, job: JobSpec) -> float:
        f = job.flops_per_entry
        return f / self.rate(lane, job.op, job.dtype, f)[0]

    def job_seconds(self, lane: str, job: JobSpec) -> float:
        return job.batch * self.entry_seconds(lane, job)

    def sources(self, lane: str, jobs: Iterable[JobSpec]) -> list[str]:
        return sorted({self.rate(lane, j.op, j.dtype, j.flops_per_entry)[1] for j in jobs})

    def table(self) -> list[dict]:
        """Every measured point: lane, op, dtype, n, GFLOP/s, samples."""
        out = []
        for (lane, op, dt), pts in sorted(self._points.items()):
            for (n, n1, p, sides), q in sorted(pts.items()):
                s = _typical(x[1] for x in q)
                out.append({"lane": lane, "op": op, "dtype": dt, "n": n, "n1": n1,
                            "gflops": q[0][0] / s / 1e9 if s > 0 else None,
                            "seconds_per_entry": s, "samples": len(q)})
        return out


# ---- rounds on lanes ---------------------------------------------------------------------------

def makespan(model: CostModel, jobs: Sequence[JobSpec], workers: int, lane: Lane = Lane.HOST,
             free_at: Optional[Sequence[float]] = None) -> float:
    """Seconds from a round's first submit until the last of ``jobs`` is done when each runs
    whole on one of ``workers`` (libasteria's pool: a batched job is one unit; jobs of one
    round share a deadline and start in submission order on the first free worker, not before
    their submit, which copies their inputs on the caller's thread, has returned)."""
    free = sorted(free_at) if free_at else [0.0] * max(1, workers)
    release = 0.0
    for job in jobs:
        release += model.submit_seconds(job)
        i = min(range(len(free)), key=free.__getitem__)
        free[i] = max(free[i], release) + model.job_seconds(lane, job)
    return max(free) + model.dispatch_s if jobs else 0.0


def assign(entry_seconds: dict, batch: int, free_at: dict) -> dict:
    """Divide ``batch`` equal entries among slots to finish the last one soonest.

    ``entry_seconds``: lane -> seconds per entry; ``free_at``: slot -> when the slot is free
    (seconds), a slot being (lane, index), e.g. ("host", 0..W-1), ("device", 0). Returns
    slot -> entries (greedy: each entry to the slot where it would finish first, ties to the
    smaller slot; optimal for identical entries). ``free_at`` is advanced in place."""
    heap = [(t + entry_seconds[s[0]], s) for s, t in free_at.items()]
    heapq.heapify(heap)
    counts: dict = {}
    for _ in range(batch):
        end, slot = heapq.heappop(heap)
        free_at[slot] = end
        counts[slot] = counts.get(slot, 0) + 1
        heapq.heappush(heap, (end + entry_seconds[slot[0]], slot))
    return counts


def split_makespan(model: CostModel, jobs: Sequence[JobSpec], lanes: dict) -> float:
    """Seconds until a round is done when every job's batch may be divided among the lanes'
    slots (``asteria.refresh.split``): lanes = {"host": W, "device": 1}."""
    free = {(lane, i): 0.0 for lane, k in lanes.items() for i in range(k)}
    if not free:
        return 0.0
    release = 0.0
    for job in jobs:
        release += model.submit_seconds(job)
        for slot in free:
            free[slot] = max(free[slot], release)
        secs = {lane: model.entry_seconds(lane, job) for lane in lanes}
        assign(secs, job.batch, free)
    return max(free.values()) + model.dispatch_s if jobs else 0.0


def predict_round(model: CostModel, jobs: Sequence[JobSpec], lanes: dict,
                  splits: bool) -> float:
    """A round's seconds on an executor with these lanes: inline (serial, on the caller's
    thread), whole jobs on the host pool, or divided among host workers and a device."""
    if Lane.INLINE in lanes:  # on the caller's thread: nothing to dispatch
        return sum(model.job_seconds(Lane.INLINE, j) for j in jobs)
    if splits:
        return split_makespan(model, jobs, lanes)
    return makespan(model, jobs, lanes.get(Lane.HOST, 1))


def smallest_workers(model: CostModel, jobs: Sequence[JobSpec], window_s: float,
                     splits: bool, device: int = 0, limit: int = 256) -> Optional[int]:
    """The fewest host workers whose predicted round fits ``window_s`` (None: none up to
    ``limit``). A bisection: more workers never make the prediction longer here."""
    if not jobs:
        return 1
    if window_s <= 0:
        return None

    def fits(w: int) -> bool:
        lanes = {Lane.HOST: w, **({Lane.DEVICE: device} if device else {})}
        return predict_round(model, jobs, lanes, splits) <= window_s

    if not fits(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def smallest_s(round_s: float, step_s: float, margin: float = 1.0) -> Optional[int]:
    """The fewest steps whose time covers ``margin`` x a round (>= 1), None without a step
    time."""
    if step_s <= 0:
        return None
    return max(1, math.ceil(margin * round_s / step_s - 1e-9))

AUTO_MARGIN = 1.5  # "auto" S and f: the window must be this much above a round


def window_s(staleness: int, step_s: float, fb_s: float) -> float:
    """Seconds a REFRESH round has before its install, in mode "async": S whole steps
    (snapshot at the end of step t, install at the end of step t + S), or with S = 0 the
    forward and backward in between (``fb_s``): the install is deferred to the next step's
    start, so the round runs while the model computes its next gradients."""
    return staleness * step_s if staleness > 0 else fb_s


def choose_frequency(round_s: float, step_s: float, fb_s: float,
                     staleness: Optional[int] = None,
                     margin: float = AUTO_MARGIN) -> tuple[int, int]:
    """(f, S) for ``precondition_frequency="auto"``: the smallest f whose REFRESH round keeps
    up, S as small as hides it. ``round_s``: a round of every factor; ``step_s``: a step, end
    to end; ``fb_s``: its forward and backward (the S = 0 window, ``window_s``);
    ``staleness``: the S the run fixed (an integer), or None to choose it too.

    The round needs ``margin`` x ``round_s``. S free: if that fits the forward and backward,
    f = 1 with S = 0 (sync's trajectory, every step); else f = S = the fewest steps that cover
    it (one round in flight at a time, the pool busy at most 1 / margin of the time). S fixed:
    f = 1 where S = 0 and the round fits the forward and backward; else the fewest steps that
    cover it, and never below S (S <= f). With S = 0 fixed and a round longer than the forward
    and backward, each install waits for the rest of its round; f keeps those waits to one per
    round that the pool can keep up with."""
    if step_s <= 0:
        raise ValueError(f"choose_frequency: step_s={step_s!r}: allowed: seconds > 0")
    s = choose_staleness(round_s, step_s, fb_s, margin)
    if staleness is None:
        return (1, 0) if s == 0 else (s, s)
    if staleness == 0 and s == 0:
        return 1, 0
    return max(smallest_s(round_s, step_s, margin), staleness), staleness


def choose_staleness(round_s: float, step_s: float, fb_s: Optional[float],
                     margin: float = AUTO_MARGIN) -> int:
    """The smallest S that hides a round (``staleness="auto"``, and the S of
    ``choose_frequency``): 0 where ``margin`` x ``round_s`` fits the forward and backward
    ``fb_s`` (the S = 0 window, ``window_s``; None: no such window, an S = 0 round's install
    does not wait for the next step), else the fewest steps of ``step_s`` (> 0) that cover
    it, at least 1."""
    if fb_s is not None and margin * round_s <= fb_s:
        return 0
    return smallest_s(round_s, step_s, margin)


# ---- a GPU's measured rates (benchmarks/gpu_microbench.py) -------------------------------------

GPU_MICROBENCH_SCHEMA = "asteria.gpu_microbench/1"
#: the microbenchmark's ops (its own names) that time one QR power step (torch.linalg.qr(F @
#: Q)) and one eigendecomposition (torch.linalg.eigh(F))
GPU_MICROBENCH_QR_STEP = "qr_power_step"
GPU_MICROBENCH_EIGH = "linalg_eigh"


def _gpu_microbench_ops() -> dict:
    """The microbenchmark's ops the device lane is priced from: its op -> (the REFRESH op
    whose FLOPs it does, the REFRESH ops priced at its FLOP rate), read from the ops' fields.
    The square ops that take a basis are priced from its QR power step, which is their refresh
    (F Q, then QR); those without one from its eigendecomposition (torch.linalg.eigh), which is
    the least work of them. The others run an eigendecomposition and GEMMs (an inverse root:
    eigh, then Q diag(w) Q^T) or GEMMs alone (coupled Newton), priced at the
    eigendecomposition's FLOP rate: a GEMM runs faster than that, so the price is an upper
    bound. Each microbenchmark op does the FLOPs of the least work of the ops it prices
    (``least_work``, at DEVICE_PRIOR_N: every square op's count grows as n^3, so the least
    work is the same at every n)."""
    out = {}
    for key, takes_basis in ((GPU_MICROBENCH_QR_STEP, True), (GPU_MICROBENCH_EIGH, False)):
        ops = square_ops(takes_basis)
        out[key] = (least_work(ops, DEVICE_PRIOR_N), ops)
    return out


GPU_MICROBENCH_OPS = _gpu_microbench_ops()
GPU_MICROBENCH_PRECISIONS = ("highest", "tf32")


def read_gpu_microbench(path: str) -> dict:
    """The record benchmarks/gpu_microbench.py wrote at ``path`` (schema
    ``GPU_MICROBENCH_SCHEMA``). ValueError naming the path and what is wrong: unreadable, not
    JSON, another schema, no ``results`` list, a result without its fields."""
    import json

    try:
        with open(path, encoding="utf-8") as fh:
            rec = json.load(fh)
    except OSError as e:
        raise ValueError(f"GPU microbenchmark JSON {path!r}: cannot read it: "
                         f"{e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"GPU microbenchmark JSON {path!r}: not JSON: {e}") from None
    schema = rec.get("schema") if isinstance(rec, dict) else None
    if schema != GPU_MICROBENCH_SCHEMA:
        raise ValueError(f"GPU microbenchmark JSON {path!r}: schema {schema!r}; allowed: "
                         f"{GPU_MICROBENCH_SCHEMA!r} (benchmarks/gpu_microbench.py --out)")
    results = rec.get("results")
    if not isinstance(results, list):
        raise ValueError(f"GPU microbenchmark JSON {path!r}: 'results' is "
                         f"{type(results).__name__}; allowed: a list of {{op, n, batch, "
                         f"precision, ms}}")
    for i, r in enumerate(results):
        ok = (isinstance(r, dict) and isinstance(r.get("op"), str)
              and isinstance(r.get("precision"), str)
              and all(isinstance(r.get(k), int) and not isinstance(r.get(k), bool)
                      and r[k] >= 1 for k in ("n", "batch"))
              and isinstance(r.get("ms"), (int, float)) and not isinstance(r.get("ms"), bool)
              and math.isfinite(r["ms"]) and r["ms"] > 0)
        if not ok:
            raise ValueError(f"GPU microbenchmark JSON {path!r}: results[{i}] = {r!r}; "
                             f"allowed: {{op: str, n: int >= 1, batch: int >= 1, precision: "
                             f"str, ms: a number > 0, ...}}")
    return rec


def add_gpu_microbench(model: CostModel, rec: dict, precision: str = "highest") -> list:
    """Put a GPU microbenchmark's rates (``read_gpu_microbench``) on ``model``'s device lane:
    per op of ``GPU_MICROBENCH_OPS`` and size n measured at ``precision``, one factor's seconds
    at the largest batch measured (ms / batch: a round's batch of one size is one call on the
    device executor), scaled to each REFRESH op it prices by their FLOPs. Returns
    [(microbenchmark op, n, batch, seconds per factor)] of what it added (empty: nothing
    usable at that precision)."""
    if precision not in GPU_MICROBENCH_PRECISIONS:
        raise ValueError(f"precision={precision!r}: allowed: "
                         f"{', '.join(GPU_MICROBENCH_PRECISIONS)}")
    best: dict = {}
    for r in rec["results"]:
        if r["op"] in GPU_MICROBENCH_OPS and r["precision"] == precision:
            key = (r["op"], r["n"])
            if key not in best or r["batch"] > best[key]["batch"]:
                best[key] = r
    added = []
    for (op, n), r in sorted(best.items()):
        seconds = r["ms"] / 1e3 / r["batch"]
        src, targets = GPU_MICROBENCH_OPS[op]
        for target in targets:
            model.add(Lane.DEVICE, target, torch.float32, n,
                      seconds * flops(target, n) / flops(src, n))
        added.append((op, n, r["batch"], seconds))
    return added


# ---- calibration -------------------------------------------------------------------------------

def spd_and_basis(batch: int, n: int, dtype: torch.dtype, seed: int) -> tuple:
    """(F, Q) of a calibration job: ``batch`` well-conditioned SPD factors of size n and
    orthogonal bases, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, n, n, generator=g, dtype=dtype)
    f = a @ a.transpose(-1, -2) / n + torch.eye(n, dtype=dtype)
    return f, torch.linalg.qr(torch.randn(batch, n, n, generator=g, dtype=dtype)).Q


def calibrate(ops: Sequence[str] = ("soap_qr", "eigh"), sizes: Sequence[int] = (256, 512),
              dtype: torch.dtype = torch.float32, batch: int = 2, repeats: int = 3,
              model: Optional[CostModel] = None) -> CostModel:
    """Measure ops on libasteria's pool with one worker (its own timings, the median of
    ``repeats``) and return the model (lane "host"): the per-core throughput of this machine."""
    from asteria.refresh.host_pool import HostPoolEngine

    model = model or CostModel()
    eng = HostPoolEngine({"workers": 1})
    eng.observer = model.observe
    try:
        for n in sizes:
            f, q = spd_and_basis(batch, n, dtype, 0)
            for op in ops:
                for r in range(repeats):
                    tk = eng.submit(op, f, q if OPS[op].takes_basis else None,
                                    block=r + 1, version=1, deadline=0, snapshot_step=0,
                                    p=2.0 if "root" in op else 0.0,
                                    eps=1e-6 if "root" in op else 0.0)
                    eng.wait(tk)
    finally:
        eng.close()
    return model


# ---- refresh per factor (refresh_policy="drift") -------------------------------------------------

def choose_refresh_budget(round_s: float, step_s: float, fb_s: Optional[float],
                          largest_s: float, budget: Optional[float] = None,
                          delay: Optional[int] = None,
                          margin: float = AUTO_MARGIN) -> tuple[float, int]:
    """(budget, d) of ``refresh_policy="drift"``: the share of a full round that may start per
    step and the steps from a factor's start to its install. ``round_s``: a round of every
    factor; ``step_s``: a step, end to end (> 0); ``fb_s``: its forward and backward (the d = 0
    window, ``window_s``; None: no such window); ``largest_s``: the longest single factor's
    refresh alone; ``budget`` / ``delay``: the value the run fixed, or None to choose it.

    The budgeted work is ``budget`` x ``round_s`` per step, and a factor's job is whole on one
    worker. Both free: a whole round every step with d = 0 where ``margin`` x the round fits
    the forward and backward (sync's trajectory); else budget = 1 / R with R the fewest steps
    that cover ``margin`` x the round (the S of ``choose_staleness``: a round's worth of
    factors every R steps, the pool busy at most 1 / margin of the time) and d the fewest
    steps that cover ``margin`` x the larger of a step's work and the largest factor (1 unless
    one factor alone takes longer than a step). The budget fixed: d as above, 0 where that
    fits the forward and backward. d fixed: the budget whose work per step fits its window
    (the forward and backward for d = 0, else a step), at most 1."""
    if step_s <= 0:
        raise ValueError(f"choose_refresh_budget: step_s={step_s!r}: allowed: seconds > 0")
    if budget is None and delay is None and fb_s is not None and margin * round_s <= fb_s:
        return 1.0, 0
    if budget is None:
        window = fb_s if delay == 0 and fb_s else step_s
        budget = 1.0 / max(1, math.ceil(margin * round_s / window - 1e-9))
    if delay is None:
        work = max(budget * round_s, largest_s)
        fits = fb_s is not None and margin * work <= fb_s
        delay = 0 if fits else smallest_s(work, step_s, margin)
    return float(budget), int(delay)


def default_max_age(budget: float, delay: int) -> int:
    """``max_age="auto"``: ceil(4 / budget) + d steps: four times the steps a round's worth of
    factors takes at the budget, plus the install delay every basis carries."""
    return math.ceil(4.0 / budget - 1e-9) + delay
