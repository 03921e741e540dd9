"""``DeviceEngine``: REFRESH jobs with torch.linalg (cuSOLVER / cuBLAS) on a device stream.

Owns: one lowest-priority CUDA stream, one Python thread that runs the jobs on it in submission
order, and per job its input snapshot, its events and its result. The math is the torch
executor's (``inline_torch.run``: the same functions, float64 retry, failures as statuses), so
a job here gives what ``mode="sync"`` gives on that device. May call: torch,
``asteria.refresh.inline_torch``, ``asteria.refresh.ops``.

Ordering on CUDA. ``submit`` (training thread) records an event on the current stream (the
factor update), makes the device stream wait for it, copies the inputs there (the snapshot)
and makes the current stream wait for that copy, so the caller may overwrite its factors at
once and nothing on the training stream waits for the computation itself. The thread then
runs the job on the device stream and records its end; ``wait`` makes the caller's stream wait
for that event (the results are installed at t + S by the schedule, like every executor's), and
hands the outputs to the caller's stream (``record_stream``).

Without CUDA (``device="cpu"``) the same thread runs the jobs with torch on the host: that is
how the tests exercise this executor and the split (``asteria.refresh.split``) on a machine
without a GPU; ``asteria.refresh.select`` only builds one for a CUDA device.

The device stream has CUDA's lowest priority, which is also the priority of torch's default
streams: refreshes compete with training on equal terms unless the training runs on a stream
of higher priority (``torch.cuda.Stream(priority=-1)``). The runner waits for a job's end with
a blocking event (its thread sleeps, it does not spin on a core the C workers want).

Precision: torch's float32 matmul precision is process-wide; under "high" or "medium" the
device lane's matmuls (soap_qr, inv_root, soap_rotate) run in TF32 while the host lane stays
in full FP32. It is not changed here (changing it from the runner thread would change the
training thread's matmuls too); the capacity report names it (``capacity.report_lines``).

Failures: numerical ones (non-finite, non-convergence, torch.linalg's errors) are statuses of
the job's Result, as with every executor. Anything else the job raises in the runner thread (a
bug, an assertion) is kept with the job, which is then done: ``ready`` turns true, ``wait``
raises it (a RuntimeError naming the job, the exception as its cause), and the thread goes on
with the next job.

Threading: ``submit``, ``ready``, ``wait``, ``cancel`` on the owner's (training) thread; the
runner thread touches only its queue and each job's fields before setting the job's ``done``
(a threading.Event: its set / wait order the writes), which it sets whatever the job did.
torch releases the GIL inside its ops.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Optional

import torch

from asteria.refresh.engine import NO_OPTIONS, Engine, JobTiming, Lane, Result, SubmitOptions
from asteria.refresh.inline_torch import run
from asteria.refresh.ops import OPS, check_op

AST_ECANCELED = -5  # include/asteria/errors.h
#: CUDA's least stream priority is 0 (cudaDeviceGetStreamPriorityRange: least 0, greatest
#: negative); torch.cuda.Stream's priority 0 takes a stream of that, the lowest, priority
LOWEST_PRIORITY = 0


@dataclasses.dataclass
class _DJob:
    ticket: int
    op: str
    inputs: tuple
    p: float
    eps: float
    block: int
    version: int
    snapshot_step: int
    host_outputs: bool
    shape: tuple                      # (batch, n, n1, sides)
    dtype: torch.dtype
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    cancelled: bool = False
    result: Optional[Result] = None
    end_event: Any = None             # torch.cuda.Event of the job's end on the device stream
    raised: Optional[BaseException] = None  # what the job raised in the runner thread


def _stacked(x: Any) -> Any:
    if isinstance(x, (list, tuple)):
        return torch.stack([t.detach() for t in x])
    return x


class DeviceEngine(Engine):
    """REFRESH jobs on one device with torch.linalg, off the training thread."""

    takes_parts = True

    def __init__(self, device: Any = "cuda") -> None:
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        if self._cuda and not torch.cuda.is_available():
            raise RuntimeError("DeviceEngine: CUDA is not available on this machine")
        self._stream = (torch.cuda.Stream(device=self._device, priority=LOWEST_PRIORITY)
                        if self._cuda else None)
        self._queue: "queue.Queue[Optional[_DJob]]" = queue.Queue()
        self._jobs: dict[int, _DJob] = {}
        self._next = 1
        self._closed = False
        self._stats = {"jobs_submitted": 0, "jobs_done": 0, "jobs_failed": 0,
                       "jobs_cancelled": 0, "jobs_retried_f64": 0, "busy_ns": 0}
        self._thread = threading.Thread(target=self._run, name="ast-device", daemon=True)
        self._thread.start()

    @property
    def device(self) -> torch.device:
        return self._device

    def lanes(self) -> dict[str, int]:
        return {Lane.DEVICE: 1}

    # ---- the owner's side ------------------------------------------------------------------
    def submit(self, op, f, q=None, *, block, version, deadline, snapshot_step, p=0.0,
               eps=0.0, b=None, opts: SubmitOptions = NO_OPTIONS) -> int:
        """As ``Engine.submit``; ``f`` and ``q`` may be parts (stacked here). Of ``opts`` it
        honours ``host_outputs``; ``donate`` is ignored (the snapshot is a device copy either
        way) and ``replicas`` too (rank-local)."""
        if self._closed:
            raise RuntimeError("DeviceEngine is closed")
        f, q = _stacked(f), _stacked(q)
        check_op(op, (f, q, b))
        rect = OPS[op].rectangular
        batch, n = int(f.shape[0]), int(f.shape[1])
        n1 = int(f.shape[2]) if rect else 0
        sides = (q is not None) + (b is not None) if rect else 2
        with torch.no_grad():
            if self._cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self._device))  # the factor update
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    snap = tuple(None if t is None else
                                 t.to(self._device, non_blocking=True).clone() for t in (f, q, b))
                    copied = self._stream.record_event()
                torch.cuda.current_stream(self._device).wait_event(copied)
            else:
                snap = tuple(None if t is None else t.detach().to(self._device, copy=True)
                             for t in (f, q, b))
        ticket = self._next
        self._next += 1
        job = _DJob(ticket, op, snap, float(p), float(eps), block, version, snapshot_step,
                    opts.host_outputs, (batch, n, n1, sides), f.dtype)
        self._jobs[ticket] = job
        self._stats["jobs_submitted"] += 1
        self._queue.put(job)
        return ticket

    def ready(self, ticket: int) -> bool:
        return self._job(ticket).done.is_set()

    def wait(self, ticket: int) -> Result:
        job = self._job(ticket)
        job.done.wait()
        del self._jobs[ticket]
        if job.raised is not None:
            exc = job.raised
            raise RuntimeError(f"DeviceEngine: job {ticket} ({job.op}, block {job.block}) "
                               f"raised in the device thread: {type(exc).__name__}: {exc}") \
                from exc
        res = job.result
        if res.outputs is not None:
            if self._cuda:
                cur = torch.cuda.current_stream(self._device)
                cur.wait_event(job.end_event)
                for t in res.outputs:
                    if t is not None:  # gram_ema: a factor not given
                        t.record_stream(cur)
            if job.host_outputs:
                res.outputs = tuple(None if t is None else t.cpu() for t in res.outputs)
        if self.observer is not None and res.started_ns:
            batch, n, n1, sides = job.shape
            self.observer(JobTiming(ticket, Lane.DEVICE, job.op, job.dtype, n, n1, batch,
                                    res.started_ns, res.done_ns, res.timing, job.p, sides,
                                    res.status == 0))
        return res

    def cancel(self, ticket: int) -> bool:
        job = self._jobs.get(ticket)
        if job is None or job.done.is_set():
            return False
        # the runner skips it if it has not taken it yet; either way the job's result says so
        job.cancelled = True
        return True

    def note_install(self, snapshot_step: int, install_step: int) -> None:
        pass  # the host pool's counters hold the installs (asteria.refresh.split)

    def note_nonfinite(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return dict(self._stats, jobs_queued=self._queue.qsize())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in self._jobs.values():
            job.cancelled = True
        self._queue.put(None)
        self._thread.join()
        self._jobs.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---- the runner thread ------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run_job(job)
            except BaseException as exc:  # noqa: BLE001 - handed to wait(), which raises it
                job.raised = exc
                job.inputs = ()
                self._stats["jobs_failed"] += 1
            finally:
                job.done.set()

    def _run_job(self, job: _DJob) -> None:
        if job.cancelled:
            job.result = Result(job.ticket, job.block, job.version, job.snapshot_step,
                                AST_ECANCELED, None, error=f"{job.op}: cancelled")
            self._stats["jobs_cancelled"] += 1
            return
        t0 = time.monotonic_ns()
        f, q, b = job.inputs
        if self._cuda:
            with torch.cuda.stream(self._stream), torch.no_grad():
                status, outputs, error, retried = run(job.op, f, q, job.p, job.eps, b)
                job.end_event = self._stream.record_event(torch.cuda.Event(blocking=True))
            job.end_event.synchronize()  # so the time below is the device's (sleeps)
        else:
            with torch.no_grad():
                status, outputs, error, retried = run(job.op, f, q, job.p, job.eps, b)
        t1 = time.monotonic_ns()
        job.inputs = ()
        self._stats["jobs_done"] += 1
        self._stats["busy_ns"] += t1 - t0
        self._stats["jobs_failed"] += bool(status)
        self._stats["jobs_retried_f64"] += bool(retried)
        job.result = Result(job.ticket, job.block, job.version, job.snapshot_step, status,
                            outputs, error=error, retried_f64=retried, started_ns=t0,
                            done_ns=t1, timing="wall")
