"""``SplitEngine``: each batched job divided among the host pool's workers and a device.

Owns: per job the parts it was divided into (lane, child engine, child ticket, batch range),
the predicted time each lane slot is busy until, and the split counters. The division is the
cost model's (``asteria.refresh.cost.assign``): every entry of the batch goes to the slot
(one of the W host workers, or the device) where it would finish first, given what is already
queued there, so a round ends as early as the measured throughputs allow; the model learns
from every part that finishes. A lane never measured for an op gets one entry of its first job
of that op (so it is measured). May call: the child engines (``host_pool.HostPoolEngine``, an
``Engine`` for the device lane: ``device.DeviceEngine`` on CUDA, any torch executor in tests),
``asteria.refresh.cost``, torch.

The caller sees one job: one ticket, its outputs concatenated over the parts in batch order,
one status (the first failed part's; then no outputs, as for any failed job). Parts of a job
on the host are submitted as separate pool jobs under derived block keys (block * 1024 + part
+ 1), so a part never supersedes another. Results are installed at t + S by the schedule like
every job's; which lane computed a factor is a function of the measured throughputs, so a
hybrid run's factors may round differently from a host-only run's (cuSOLVER vs LAPACK).

Single-threaded use (the training thread); the children keep their own threads.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

import torch

from asteria.refresh.cost import CostModel, JobSpec, assign
from asteria.refresh.engine import (NO_OPTIONS, NO_TRACE, Engine, JobTiming, Lane, Result,
                                    SubmitOptions, Tracer)
from asteria.refresh.ops import OPS

PART_KEYS = 1024  # derived block keys per job block


@dataclasses.dataclass
class _Part:
    lane: Lane
    engine: Engine
    ticket: int
    lo: int
    hi: int


@dataclasses.dataclass
class _Split:
    block: int
    version: int
    snapshot_step: int
    parts: list
    left: int                       # parts not observed yet (the capacity feed)


def _slice(x: Any, lo: int, hi: int) -> Any:
    if x is None:
        return None
    return list(x[lo:hi]) if isinstance(x, (list, tuple)) else x[lo:hi]


class SplitEngine(Engine):
    """Divides each job between ``host`` (the C pool) and ``device`` (optional)."""

    takes_parts = True
    splits_batches = True

    def __init__(self, host: Engine, device: Optional[Engine] = None,
                 model: Optional[CostModel] = None, *, tracer: Tracer = NO_TRACE) -> None:
        self._host = host
        self.tracer = tracer
        self._device = device
        self.model = model or CostModel()
        self._workers = max(1, int(host.lanes().get(Lane.HOST, 1)))
        self._free = {(Lane.HOST, i): 0.0 for i in range(self._workers)}
        if device is not None:
            self._free[(Lane.DEVICE, 0)] = 0.0
        self._engines = {Lane.HOST: host, Lane.DEVICE: device}
        self._jobs: dict[int, _Split] = {}
        self._child: dict = {}      # (lane, child ticket) -> outer ticket
        self._next = 1
        self._closed = False
        self._counts = {"split_entries_host": 0, "split_entries_device": 0, "split_parts": 0}
        # a child reports under the lane it plays here (a torch executor in the device lane)
        host.observer = lambda t: self._observed(Lane.HOST, t)
        if device is not None:
            device.observer = lambda t: self._observed(Lane.DEVICE, t)

    def lanes(self) -> dict[str, int]:
        return {Lane.HOST: self._workers, **({Lane.DEVICE: 1} if self._device is not None else {})}

    def drain(self) -> int:
        return sum(e.drain() for e in (self._host, self._device) if e is not None)

    # ---- the division ----------------------------------------------------------------------
    def plan(self, spec: JobSpec) -> list:
        """[(lane, entries)] in batch order for a job of ``spec``, given what is queued."""
        now = time.monotonic()
        free = {s: max(v, now) - now for s, v in self._free.items()}
        lanes = sorted({s[0] for s in free})
        secs = {lane: self.model.entry_seconds(lane, spec) for lane in lanes}
        counts: dict = {}
        batch = spec.batch
        for lane in lanes:  # explore: one entry on a lane that never ran this op
            if batch > 1 and len(lanes) > 1 and not self.model.measured(lane, spec.op,
                                                                        spec.dtype):
                slot = (lane, 0)
                free[slot] += secs[lane]
                counts[slot] = counts.get(slot, 0) + 1
                batch -= 1
        for slot, c in assign(secs, batch, free).items():
            counts[slot] = counts.get(slot, 0) + c
        for slot, t in free.items():
            self._free[slot] = now + t
        # device first, then the host workers in order: contiguous ranges of the batch
        order = sorted(counts.items(), key=lambda kv: (kv[0][0] != Lane.DEVICE, kv[0][1]))
        return [(s[0], c) for s, c in order if c]

    def submit(self, op, f, q=None, *, block, version, deadline, snapshot_step, p=0.0,
               eps=0.0, b=None, opts: SubmitOptions = NO_OPTIONS) -> int:
        """As ``Engine.submit``. ``opts`` goes to the host pool's part; the device's part
        gets none of it (its outputs come back on the device, its inputs are copied)."""
        if self._closed:
            raise RuntimeError("SplitEngine is closed")
        first = f[0] if isinstance(f, (list, tuple)) else f[0]
        batch = len(f) if isinstance(f, (list, tuple)) else int(f.shape[0])
        rect = op in OPS and OPS[op].rectangular  # an unknown op: the children say so
        spec = JobSpec(op, first.dtype, int(first.shape[0]), batch,
                       int(first.shape[1]) if rect else 0, float(p),
                       (q is not None) + (b is not None) if rect else 2)
        ticket = self._next
        self._next += 1
        parts, lo = [], 0
        for i, (lane, count) in enumerate(self.plan(spec)):
            hi = lo + count
            eng = self._engines[lane]
            fi = _slice(f, lo, hi)
            if not eng.takes_parts and isinstance(fi, list):
                fi = torch.stack(fi)
            child = eng.submit(op, fi, _slice(q, lo, hi), block=block * PART_KEYS + i + 1,
                               version=version, deadline=deadline, snapshot_step=snapshot_step,
                               p=p, eps=eps, b=_slice(b, lo, hi),
                               opts=opts if eng.takes_parts else NO_OPTIONS)
            parts.append(_Part(lane, eng, child, lo, hi))
            self._child[(lane, child)] = ticket
            self._counts[f"split_entries_{lane}"] += count
            lo = hi
        self._counts["split_parts"] += len(parts)
        self._jobs[ticket] = _Split(block, version, snapshot_step, parts, len(parts))
        return ticket

    def ready(self, ticket: int) -> bool:
        return all(pt.engine.ready(pt.ticket) for pt in self._job(ticket).parts)

    def wait(self, ticket: int) -> Result:
        job = self._job(ticket)
        results = [pt.engine.wait(pt.ticket) for pt in job.parts]
        del self._jobs[ticket]
        for pt in job.parts:
            self._child.pop((pt.lane, pt.ticket), None)
        failed = next((r for r in results if r.status), None)
        outputs = None
        if failed is None:  # an absent output (gram_ema's factor not given) stays None
            dev = next(t for t in results[0].outputs if t is not None).device
            outputs = tuple(None if results[0].outputs[i] is None else
                            torch.cat([r.outputs[i].to(dev) for r in results])
                            for i in range(len(results[0].outputs)))
        started = min((r.started_ns for r in results if r.started_ns), default=0)
        return Result(ticket, job.block, job.version, job.snapshot_step,
                      failed.status if failed else 0, outputs,
                      error=failed.error if failed else "",
                      retried_f64=any(r.retried_f64 for r in results), started_ns=started,
                      done_ns=max(r.done_ns for r in results) if started else 0,
                      timing="+".join(sorted({r.timing for r in results if r.timing})))

    def _observed(self, lane: str, t: JobTiming) -> None:
        t = dataclasses.replace(t, lane=lane)
        self.model.observe(t)
        outer = self._child.get((lane, t.ticket))
        job = self._jobs.get(outer)
        if job is None:
            return
        job.left -= 1
        if self.observer is not None:
            self.observer(dataclasses.replace(t, ticket=outer, last=job.left == 0))

    def cancel(self, ticket: int) -> bool:
        job = self._jobs.get(ticket)
        if job is None:
            return False
        return all([pt.engine.cancel(pt.ticket) for pt in job.parts])

    def note_install(self, snapshot_step: int, install_step: int) -> None:
        self._host.note_install(snapshot_step, install_step)

    def note_nonfinite(self) -> None:
        self._host.note_nonfinite()

    def stats(self) -> dict[str, Any]:
        out = self._host.stats()
        if self._device is not None:
            out.update({f"device_{k}": v for k, v in self._device.stats().items()})
        out.update(self._counts)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for eng in (self._host, self._device):
            if eng is not None:
                eng.close()

