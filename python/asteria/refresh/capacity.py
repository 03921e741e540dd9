"""One optimizer's capacity record: its REFRESH rounds against its step time, and the report.

Owns: ``Capacity`` (the rounds of one optimizer as submitted and as they finish, their
predicted and measured times, step times net of barrier stalls, the forward and backward
between a step's end and the next step's start (the window of an S = 0 round in mode
"async"), busy time per lane, and the seconds an "auto" S or f is chosen from: a round's, a
step's, a forward and backward's (``times_for_s``, ``times_for_f``; the choice is the
cadence's, ``asteria.optim.cadence``, by ``asteria.refresh.cost``'s rule)) with its
``RoundRecord`` per round, and ``report_lines`` (the capacity summary in plain words, for
``asteria_plan()``). The predictions are the cost model's
(``asteria.refresh.cost``), fed by the executor's ``observer``; an executor with a model of its
own (``Engine.model``: the split executor's) shares it. May call: torch,
``asteria.refresh.cost``, ``asteria.refresh.engine``. Single-threaded (the training thread);
executors hand it finished jobs on that thread.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections import defaultdict, deque
from typing import Optional, Sequence

import torch

from asteria.refresh.cost import (CostModel, JobSpec, predict_round, smallest_s,
                                  smallest_workers, window_s)
from asteria.refresh.engine import Engine, JobTiming, Lane


#: the kind of the record of the jobs that time the REFRESH op before an "auto" f is chosen
#: (``Schedule.calibrate``): their times feed the cost model, and they are no REFRESH round
CALIBRATION = "calibration"


@dataclasses.dataclass
class RoundRecord:
    kind: str
    snapshot_step: int
    submit_ns: int
    jobs: dict                    # ticket -> JobSpec
    predicted_s: float
    done_ns: int = 0
    started_ns: int = 0
    busy_s: float = 0.0
    finished: set = dataclasses.field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.finished) >= len(self.jobs)

    @property
    def measured_s(self) -> Optional[float]:
        """Submit to the last job's end: the time the window must cover."""
        return (self.done_ns - self.submit_ns) / 1e9 if self.complete and self.done_ns else None

    @property
    def gflop(self) -> float:
        return sum(j.flops for j in self.jobs.values()) / 1e9


class Capacity:
    """What one optimizer's REFRESH work costs against its step time, measured as it runs."""

    KEEP = 16  # rounds and rotations kept

    def __init__(self, engine: Engine, model: Optional[CostModel] = None) -> None:
        # an executor that divides jobs by a model of its own shares it (and feeds it)
        shared = engine.model
        self._own_model = model is None and shared is None
        self.model = model or shared or CostModel()
        self._engine = engine
        self.rounds: deque = deque(maxlen=self.KEEP)
        self._by_ticket: dict = {}
        self._steps: deque = deque(maxlen=64)  # step seconds, barrier stalls excluded
        self._last_end_ns: Optional[int] = None
        self._start_ns: Optional[int] = None  # this step's start (``step_start``)
        # this step's waits that ``stalled`` timed, on this record's clock (``times_for_f``
        # excludes them from the step in progress; ``step_end`` is handed every stall)
        self._stalled_ns = 0
        # seconds from a step's end to the next step's start: the forward and backward
        self._fb: deque = deque(maxlen=64)
        self._busy = defaultdict(float)   # lane -> busy seconds since the first job
        self._first_ns: Optional[int] = None
        self.rotation_s: deque = deque(maxlen=self.KEEP)
        self._rot_pending: dict = {}      # ticket -> submit ns of a job outside the rounds
        self._timing = ""
        engine.observer = self.observe

    # ---- feeds --------------------------------------------------------------------------------
    def round_submitted(self, kind: str, snapshot_step: int, jobs: dict, start_ns: int,
                        submit_s: Optional[dict] = None) -> RoundRecord:
        """A round's jobs {ticket: JobSpec} were submitted from ``start_ns`` on (monotonic);
        ``submit_s``: {ticket: seconds its submit took}."""
        for t, s in (submit_s or {}).items():
            self.model.observe_submit(jobs[t].input_bytes, s)
        lanes = self.lanes()
        rec = RoundRecord(kind, snapshot_step, start_ns, dict(jobs),
                          predict_round(self.model, list(jobs.values()), lanes, self.splits))
        for t in jobs:
            self._by_ticket[t] = rec
        self.rounds.append(rec)
        if self._first_ns is None:
            self._first_ns = rec.submit_ns
        return rec

    def observe(self, t: JobTiming) -> None:
        if self._own_model:
            self.model.observe(t)
        self._timing = self._timing or t.timing
        if t.started_ns and t.done_ns > t.started_ns:
            self._busy[t.lane] += (t.done_ns - t.started_ns) / 1e9
            if self._first_ns is None or t.started_ns < self._first_ns:
                self._first_ns = t.started_ns
        rec = self._by_ticket.get(t.ticket)
        if rec is None:
            return
        if t.started_ns:
            rec.started_ns = min(rec.started_ns or t.started_ns, t.started_ns)
        rec.done_ns = max(rec.done_ns, t.done_ns)
        rec.busy_s += max(0, t.done_ns - t.started_ns) / 1e9
        if t.last:
            rec.finished.add(t.ticket)
        if rec.complete:
            for k in rec.jobs:
                self._by_ticket.pop(k, None)
            first = rec.jobs[min(rec.jobs)]
            if rec.started_ns and t.lane != Lane.INLINE:
                self.model.observe_dispatch((rec.started_ns - rec.submit_ns) / 1e9
                                            - self.model.submit_seconds(first))

    def step_start(self) -> None:
        """A step started now (``optimizer.step()``'s entry, before anything waits): the time
        since the last step's end was the forward and backward."""
        now = time.monotonic_ns()
        self._start_ns = now
        if self._last_end_ns is not None:
            self._fb.append(max(0, now - self._last_end_ns) / 1e9)

    def step_end(self, stall_ns: int = 0) -> None:
        """A step ended now; ``stall_ns`` of it went to waiting at the bounded barrier."""
        now = time.monotonic_ns()
        if self._last_end_ns is not None:
            self._steps.append(max(0, now - self._last_end_ns - stall_ns) / 1e9)
        self._last_end_ns = now
        self._stalled_ns = 0

    def stalled(self, wait) -> None:
        """``wait()``, timed as a stall of the step in progress (the calibration jobs' wait at
        an "auto" choice, ``Schedule.calibrated``): the step ``times_for_f`` gives excludes
        it, on this record's clock. The caller still hands it to ``step_end`` with the
        step's other stalls."""
        t0 = time.monotonic_ns()
        try:
            wait()
        finally:
            self._stalled_ns += max(0, time.monotonic_ns() - t0)

    # ---- views --------------------------------------------------------------------------------
    def lanes(self) -> dict:
        return self._engine.lanes() or {Lane.HOST: 1}

    @property
    def splits(self) -> bool:
        return bool(self._engine.splits_batches)

    def step_s(self) -> Optional[float]:
        return statistics.median(self._steps) if self._steps else None

    def fb_s(self) -> Optional[float]:
        """The median forward and backward: a step's end to the next step's start."""
        return statistics.median(self._fb) if self._fb else None

    def last_refresh(self) -> Optional[RoundRecord]:
        for rec in reversed(self.rounds):
            if rec.kind == "refresh":
                return rec
        return None

    def measured_refresh_s(self) -> list:
        return [r.measured_s for r in self.rounds if r.kind == "refresh"
                and r.measured_s is not None]

    def predict(self, rec: RoundRecord, lanes: Optional[dict] = None) -> float:
        return predict_round(self.model, list(rec.jobs.values()), lanes or self.lanes(),
                             self.splits)

    def utilisation(self) -> Optional[float]:
        if self._first_ns is None:
            return None
        elapsed = (time.monotonic_ns() - self._first_ns) / 1e9
        slots = sum(self.lanes().values())
        busy = sum(self._busy.values())
        return busy / (slots * elapsed) if elapsed > 0 and slots else None

    def times_for_s(self, jobs: Optional[Sequence[JobSpec]] = None) -> Optional[tuple]:
        """(round, step, forward and backward) seconds for ``staleness="auto"``, or None while
        they cannot be known. ``jobs``: the round about to be submitted, priced by the model if
        it has measured any job on these lanes (the first-step eigendecompositions); without
        ``jobs``: the last REFRESH round, once measured (the larger of its measured time and
        its prediction). The step and the forward and backward: the medians measured (the
        latter None before any)."""
        step = self.step_s()
        if not step:
            return None
        if jobs is not None:
            if not jobs or not self.model.observed:
                return None
            need = predict_round(self.model, list(jobs), self.lanes(), self.splits)
        else:
            rec = self.last_refresh()
            if rec is None or rec.measured_s is None:
                return None
            need = max(rec.measured_s, self.predict(rec))
        return need, step, self.fb_s()

    def times_for_f(self, jobs: Sequence[JobSpec], stall_ns: int = 0) -> Optional[tuple]:
        """(round, step, forward and backward) seconds for ``precondition_frequency="auto"``,
        or None while no step has been timed or ``jobs`` is empty. ``jobs``: a round of every
        factor, priced by the model (the larger of that and the last REFRESH round's measured
        time where that round had as many factors); the step: the median of the steps
        measured and of the one in progress (``stall_ns`` of it at the bounded barrier and
        the waits ``stalled`` timed, excluded); the forward and backward: the median
        measured (0 before any), at most the step."""
        steps = list(self._steps)
        since = self._last_end_ns if self._last_end_ns is not None else self._start_ns
        if since is not None:
            steps.append(max(0, time.monotonic_ns() - since - stall_ns - self._stalled_ns)
                         / 1e9)
        step = statistics.median(steps) if steps else 0.0
        if not jobs or step <= 0:
            return None
        need = predict_round(self.model, list(jobs), self.lanes(), self.splits)
        rec = self.last_refresh()
        entries = sum(j.batch for j in jobs)
        if (rec is not None and rec.measured_s is not None
                and sum(j.batch for j in rec.jobs.values()) == entries):
            need = max(need, rec.measured_s)
        return need, step, min(self.fb_s() or 0.0, step)

    def summary(self, staleness: int, defers: bool = False) -> dict:
        """The capacity report as numbers (None where not measured yet). ``defers``: an S = 0
        round runs during the next forward and backward (mode "async", ``Schedule.defers``),
        which is then its window; else S x step."""
        rec = self.last_refresh()
        step = self.step_s()
        fb = self.fb_s() if defers else 0.0
        lanes = self.lanes()
        out: dict = {"lanes": dict(lanes), "splits_batches": self.splits,
                     "step_s": step, "staleness": staleness, "fb_s": self.fb_s(),
                     "window_s": window_s(staleness, step, fb or 0.0) if step else None,
                     "utilisation": self.utilisation(), "timing": self._timing}
        if Lane.DEVICE in lanes:
            # process-wide: "high" / "medium" put the device lane's float32 matmuls in TF32
            out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        if rec is None:
            return out
        pred = self.predict(rec)
        measured = self.measured_refresh_s()
        out.update({"round_gflop": rec.gflop, "round_jobs": len(rec.jobs),
                    "round_entries": sum(j.batch for j in rec.jobs.values()),
                    "predicted_round_s": pred,
                    "measured_round_s": measured[-1] if measured else None,
                    "rate_sources": self.model.sources(next(iter(lanes)), rec.jobs.values())})
        need = max([pred] + measured[-1:])
        if step:
            out["smallest_s"] = smallest_s(need, step)
            jobs = list(rec.jobs.values())
            out["smallest_workers"] = smallest_workers(self.model, jobs, out["window_s"],
                                                       self.splits, lanes.get(Lane.DEVICE, 0))
        return out


def report_lines(s: dict) -> list[str]:
    """The capacity summary in plain words (``asteria_plan()``)."""
    lanes = ", ".join(f"{k} x{v}" for k, v in s["lanes"].items())
    lines = [f"capacity: REFRESH lanes {lanes}"
             + ("; each round divided among them" if s["splits_batches"] else
                "; one job per (op, size, dtype), each on one worker")]
    if Lane.DEVICE not in s["lanes"]:
        lines.append("capacity: no device executor (no CUDA device for these parameters)")
    elif s.get("float32_matmul_precision", "highest") != "highest":
        lines.append(f"capacity: torch's float32 matmul precision is "
                     f"{s['float32_matmul_precision']!r}: the device lane's float32 matmuls "
                     "(soap_qr, inv_root, soap_rotate) run in TF32, the host lane's in full "
                     "FP32, so a round divided among them mixes precisions")
    if "round_gflop" not in s:
        lines.append("capacity: no REFRESH round yet")
        return lines
    def sec(x):
        return "not measured yet" if x is None else f"{x:.3f} s"
    lines.append(f"capacity: work per round {s['round_gflop']:.2f} GFLOP in "
                 f"{s['round_jobs']} jobs ({s['round_entries']} factors); predicted "
                 f"{sec(s['predicted_round_s'])} (rates: {', '.join(s['rate_sources'])}), "
                 f"measured {sec(s['measured_round_s'])} (submit to last job's end, timed by "
                 f"{s['timing'] or 'nobody'})")
    if s["step_s"]:
        busy = "n/a" if s["utilisation"] is None else f"{100 * s['utilisation']:.0f}%"
        if s["staleness"] == 0 and s["window_s"]:
            lines.append(f"capacity: window at S=0 = the next forward and backward (a step's "
                         f"end to the next step's start) = {s['window_s']:.3f} s of a "
                         f"{s['step_s']:.3f} s step; pool utilisation {busy}")
        else:
            lines.append(f"capacity: window S x step = {s['staleness']} x {s['step_s']:.3f} s "
                         f"= {s['window_s']:.3f} s; pool utilisation {busy}")
        w = s.get("smallest_workers")
        lines.append(f"capacity: smallest S that hides the refresh: {s['smallest_s']}; "
                     f"smallest worker count at S={s['staleness']}: "
                     + ("more than 256" if w is None else str(w)))
    return lines
