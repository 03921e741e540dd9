"""``HostPoolEngine``: the ``mode="async"`` REFRESH engine, over libasteria's C worker pool.

Owns: one ``asteria._C.Runtime`` and, per job whose result has not been handed out yet, its host
tensors (input snapshots, outputs) with their buffer registrations. Workers read and write those
buffers from their own threads, so each job's tensors stay referenced, and registered, until the
runtime has reported the job finished (``poll`` or ``wait``); only then are they unregistered.
May call: torch, ``asteria.refresh`` (engine, ops), ``asteria.config``, ``asteria._C``.
Threading: single-threaded use (the optimizer's training thread), no locks. The GIL is released
inside ``_C``'s blocking calls, so other Python threads run while this one waits at the barrier;
the barrier wakes every 100 ms to run signal handlers, so Ctrl-C interrupts it (a job whose wait
was interrupted stays in ``_jobs``, waitable later: nothing is unregistered or lost).
Fork: in a forked child the runtime's pool re-runs the jobs that were queued or running at the
fork (pool.h), so a child that waits for them gets the parent's results.

Snapshots (the shadow pipeline's D2H side): with ``shadow=True`` the inputs of a job are copied
by a ``_C.Shadow`` into its snapshot ring: on CUDA on the lowest-priority shadow stream after
an event recorded on the current stream (the factor update), on the host path by a memcpy at
issue. An input given as parts (one tensor per batch entry) is gathered straight into one
slot, so the caller never stacks it into fresh memory. The slot is registered with the runtime
for the job and released when the job's completion is collected. A full ring (or an input
larger than it) falls back to a private buffer. Each snapshot is traced as a d2h copy (issued, span, done) before the job's "job
queued" event.

Stream ordering of a snapshot on CUDA: an event is recorded on the current stream of the
sources' device after the step queued its writes to them; the shadow stream (on that device:
``device=``) waits on it, copies into the pinned slot and records the slot's done event;
``submit`` then waits for that event (a blocking one: the thread sleeps) before the runtime
gets the slot, since its workers read host memory with no CUDA of their own. The converted
sources (dtype casts, contiguous copies) stay referenced until that wait returns, so the
caching allocator cannot hand their memory out under the copy. The price: a refresh submit
waits until the device has run everything queued before it, in effect one device
synchronisation per submitted job. Taking that wait off the training thread needs a job that
the pool starts only once an event has passed, which libasteria's runtime does not offer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional

import torch

from asteria import _C
from asteria.config import RuntimeConfig
from asteria.refresh.engine import (NO_OPTIONS, Engine, JobTiming, Lane, Result, SubmitOptions,
                                    Tracer, TraceLane)
from asteria.refresh.ops import OPS, check_op, output_spec

_C_DTYPES = {torch.float32: "float32", torch.float64: "float64"}


def c_config(cfg: Any) -> Any:
    """The ``_C.Runtime`` config of ``cfg``: None (C's defaults), or the validated C part
    (``RuntimeConfig.c_config``) of a ``RuntimeConfig``, of a dict of runtime keys, or of an
    object with runtime-key attributes (the last two become a ``RuntimeConfig`` first, so they
    are validated as the optimizer's ``runtime=`` is, once)."""
    if cfg is None:
        return None
    if not isinstance(cfg, RuntimeConfig):
        if not isinstance(cfg, Mapping):
            cfg = {key: getattr(cfg, key) for key in RuntimeConfig.keys() if hasattr(cfg, key)}
        cfg = RuntimeConfig.from_user(cfg)
    return cfg.c_config


@dataclasses.dataclass
class _Job:
    op: str
    device: torch.device
    dtype: torch.dtype
    pinned: bool
    buffers: tuple[torch.Tensor, ...]   # every registered tensor, inputs first
    outputs: Optional[tuple[torch.Tensor, ...]]
    handles: tuple[int, ...]
    result: Any = None                 # the _C.Result, once the runtime reported it
    snapshots: tuple[int, ...] = ()    # shadow snapshot tickets holding the inputs
    host_outputs: bool = False         # hand the outputs back on the host, not job.device
    shape: tuple = (0, 0, 0, 0.0, 2)   # (batch, n, n1, p, sides) for the capacity model


_SLOTS = {"f": "in0", "q": "in1", "b": "in2"}  # SubmitOptions.DONATABLE -> the C job's slot


def _donated(opts: SubmitOptions) -> frozenset:
    """The input slots ``opts.donate`` gives away."""
    return frozenset(_SLOTS[k] for k in opts.donate)


def _parts(x: Any) -> tuple[Optional[list], Any]:
    """An input given as parts (a list or tuple of same-shape tensors: the stack of the job's
    batch, not made) -> (the parts, a meta tensor of the stack's shape and dtype, for the
    checks); a tensor or None -> (None, x)."""
    if not isinstance(x, (list, tuple)):
        return None, x
    if not x:
        raise ValueError("a REFRESH input given as parts needs at least one tensor")
    t0 = x[0]
    for i, t in enumerate(x):
        if (not isinstance(t, torch.Tensor) or t.shape != t0.shape or t.dtype != t0.dtype
                or t.device != t0.device):
            got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise ValueError(f"REFRESH input parts must be tensors of one shape, dtype and "
                             f"device: part 0 is {tuple(t0.shape)} {t0.dtype} on {t0.device}, "
                             f"part {i} is {got}")
    return list(x), torch.empty((len(x), *t0.shape), dtype=t0.dtype, device="meta")


def _snapshot(parts: list, shape: tuple, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A private copy of ``shape``: the one tensor of that shape, or the parts stacked."""
    out = torch.empty(shape, dtype=dtype, pin_memory=pin)
    whole = len(parts) == 1 and tuple(parts[0].shape) == tuple(shape)
    with torch.no_grad():
        # blocking copies, so the caller may mutate the sources as soon as submit returns
        for dst, src in zip((out,) if whole else out.unbind(0), parts):
            dst.copy_(src.detach())
    return out


class HostPoolEngine(Engine):
    """REFRESH jobs on libasteria's worker pool (``mode="async"``)."""

    takes_parts = True

    def __init__(self, cfg: Any = None, *, shadow: Any = False,
                 snapshot_ring_bytes: int = 64 << 20, device: int = -1) -> None:
        """``shadow``: False (private snapshot buffers), True or "cuda" (a shadow stream where
        CUDA is there, else the host path), "host" (the host path). ``device``: the CUDA
        device of the parameters whose inputs the shadow snapshots (-1: the current one);
        inputs on another device are snapshotted into private buffers."""
        self._closed = True  # until the runtime exists, so __del__ has nothing to do
        self._shadow = None
        self._rt = _C.Runtime(c_config(cfg))
        # the optimizer's one tracer: built here, where its runtime is (engine.py, "The trace")
        self.tracer = Tracer(self._rt)
        self._jobs: dict[int, _Job] = {}
        self._final_stats: Optional[dict[str, Any]] = None
        self._copies = {"bytes_d2h_snapshots": 0, "bytes_h2d_results": 0,
                        "snapshots_shadow": 0, "snapshots_fallback": 0, "inputs_donated": 0}
        if shadow:
            cuda = shadow != "host" and torch.cuda.is_available() and _C.HAVE_CUDA
            self._shadow = _C.Shadow(mode="auto" if cuda else "host",
                                     snapshot_ring_bytes=snapshot_ring_bytes,
                                     prefetch_ring_bytes=4096, slots=1024,
                                     device=device if cuda else -1)
        self._closed = False
        if self.tracer.active:
            self._rt.trace_name_lane(TraceLane.NVME, "nvme tier")

    def _snapshot_into_ring(self, parts: list, shape: tuple, cdtype: torch.dtype, block: int):
        """(host tensor of ``shape`` over a snapshot slot, ticket), or None when the ring has no
        room. The parts are copied back to back into the one slot (a stack without stacking)."""
        srcs = []
        for t in parts:
            src = t.detach()
            if src.dtype != cdtype or not src.is_contiguous():
                src = src.to(dtype=cdtype).contiguous()
            srcs.append(src)
        cuda = srcs[0].device.type == "cuda"
        st = self._shadow.stats()
        if cuda != bool(st["is_cuda"]) or (cuda and srcs[0].device.index != st["device"]):
            return None
        event = 0
        if cuda:
            # the factor update: every write to the sources was queued on the current stream
            # of their device before this point (the shadow stream waits on this event)
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(srcs[0].device))
            event = ev.cuda_event
        pieces = [(x.data_ptr(), x.numel() * x.element_size()) for x in srcs]
        nbytes = sum(n for _, n in pieces)
        t0 = time.monotonic_ns()
        try:
            ticket = self._shadow.snapshot_gather(pieces, event)
        except (_C.BusyError, ValueError):
            return None
        self._shadow.snapshot_wait(ticket)  # the host path copied at issue
        t1 = time.monotonic_ns()
        self.tracer("copy_issued", TraceLane.SHADOW, bytes=nbytes, direction="d2h", block=block,
                   ts_ns=t0)
        self.tracer("copy", TraceLane.SHADOW, bytes=nbytes, direction="d2h", block=block, ts_ns=t0,
                   dur_ns=t1 - t0)
        self.tracer("copy_done", TraceLane.SHADOW, bytes=nbytes, direction="d2h", block=block,
                   ts_ns=t1)
        return torch.from_dlpack(self._shadow.snapshot_view(ticket, cdtype, shape)), ticket

    @property
    def runtime(self) -> "_C.Runtime":
        return self._rt

    # ---- jobs ---------------------------------------------------------------------------------

    def submit(self, op, f, q=None, *, block, version, deadline, snapshot_step, p=0.0,
               eps=0.0, b=None, opts: SubmitOptions = NO_OPTIONS) -> int:
        """``b``: the B pair of ``soap_rotate`` (``f`` is its X, ``q`` its A pair; every pair
        given is snapshotted like any input). ``opts.host_outputs``: hand the outputs back as
        host tensors (the caller stores them in host memory) instead of copying them to the
        inputs' device. ``opts.donate``: the inputs the caller gives away: those already in
        host memory, contiguous and of the job's dtype are read by the worker in place, with
        no snapshot; the job keeps them alive until its result is taken. Others are
        snapshotted as usual. ``opts.replicas``: rank-local here (a ``ReplicatedEngine``
        around this one synchronises replicas).

        ``f`` and ``q`` may also be given as parts: a list of same-shape tensors, one per batch
        entry, that the job sees stacked. They are snapshotted straight into one slot of the
        shadow's ring (or, without room there, into one private buffer), so the caller need
        not stack them into fresh memory first; parts are never donated.

        An in-place op's (``Op.in_place``: gram_ema) outputs are the caller's own tensors, ``q``
        and ``b``, updated in place (``_submit_in_place``)."""
        self._check_open()
        entry = OPS.get(op)
        if entry is not None and entry.in_place:
            return self._submit_in_place(op, f, q, b, block=block, version=version,
                                         deadline=deadline, snapshot_step=snapshot_step, p=p,
                                         eps=eps, opts=opts)
        f_parts, f = _parts(f)
        q_parts, q = _parts(q)
        check_op(op, (f, q, b))
        if not f.is_floating_point():
            raise ValueError(f"REFRESH input must be a real floating tensor, got {f.dtype}")
        given = _donated(opts)
        rect = entry.rectangular
        batch, n = int(f.shape[0]), int(f.shape[1])
        n1 = int(f.shape[2]) if rect else 0
        if batch == 0 or n == 0 or (rect and n1 == 0):
            raise ValueError(f"REFRESH input must be non-empty, got shape {tuple(f.shape)}")
        self._poll()  # release the buffers of jobs that finished meanwhile
        cdtype = f.dtype if f.dtype in _C_DTYPES else torch.float32
        device = f_parts[0].device if f_parts else f.device
        pin = device.type == "cuda" and torch.cuda.is_available()

        # in0, then the inputs the op reads (a basis; a rectangular op's side operands, None
        # being an identity side)
        slots = {"in0": f, "in1": q if entry.reads("in1") else None,
                 "in2": b if entry.reads("in2") else None}
        parts_of = {"in0": f_parts, "in1": q_parts}
        inputs, tickets = [], []
        for slot, src in slots.items():
            if src is None:
                continue
            parts = parts_of.get(slot)
            if (parts is None and slot in given and src.device.type == "cpu"
                    and src.dtype == cdtype and src.is_contiguous() and not pin):
                inputs.append(src)
                self._copies["inputs_donated"] += 1
                continue
            if parts is None:
                parts = [src]
            staged = (self._snapshot_into_ring(parts, tuple(src.shape), cdtype, block)
                      if self._shadow is not None else None)
            if staged is None:
                t0 = time.monotonic_ns()
                inputs.append(_snapshot(parts, tuple(src.shape), cdtype, pin))
                nb = inputs[-1].numel() * inputs[-1].element_size()
                if self._shadow is not None:
                    self._copies["snapshots_fallback"] += 1
                    t1 = time.monotonic_ns()
                    self.tracer("copy", TraceLane.SHADOW, "snapshot (private buffer)", bytes=nb,
                               direction="d2h", block=block, ts_ns=t0, dur_ns=t1 - t0)
                    self.tracer("copy_done", TraceLane.SHADOW, bytes=nb, direction="d2h",
                               block=block, ts_ns=t1)
            else:
                inputs.append(staged[0])
                tickets.append(staged[1])
                self._copies["snapshots_shadow"] += 1
            self._copies["bytes_d2h_snapshots"] += inputs[-1].numel() * inputs[-1].element_size()
        outputs = [torch.empty((batch, *shape), dtype=dt, pin_memory=pin)
                   for shape, dt in output_spec(op, n, cdtype, n1)]
        buffers = (*inputs, *outputs)

        def addr(ts: list, i: int) -> Optional[int]:
            return ts[i].data_ptr() if i < len(ts) else None

        staged = iter(inputs)  # the snapshots, in the order of the given slots
        in_addr = {k: (next(staged).data_ptr() if t is not None else None)
                   for k, t in slots.items()}

        handles: list[int] = []
        try:
            for t in buffers:
                handles.append(self._rt.register(t.data_ptr(), t.numel() * t.element_size()))
            ticket = self._rt.submit(
                op, _C_DTYPES[cdtype], n, batch, in_addr["in0"], in_addr["in1"],
                addr(outputs, 0), addr(outputs, 1), p=float(p), eps=float(eps), block=block,
                version=version, deadline=deadline, snapshot_step=snapshot_step, n1=n1,
                in2=in_addr["in2"])
        except BaseException:
            for h in handles:
                self._rt.unregister(h)
            for tk in tickets:
                self._shadow.snapshot_release(tk)
            raise
        self._jobs[ticket] = _Job(op=op, device=device, dtype=f.dtype, pinned=pin,
                                  buffers=buffers, outputs=tuple(outputs), handles=tuple(handles),
                                  snapshots=tuple(tickets), host_outputs=opts.host_outputs,
                                  shape=(batch, n, n1, float(p),
                                         (q is not None) + (b is not None) if rect else 2))
        return ticket

    def _submit_in_place(self, op, g, l, r, *, block, version, deadline, snapshot_step, p, eps,
                         opts: SubmitOptions) -> int:
        """An in-place op (gram_ema): G (``f``) is snapshotted (or read in place if donated); L
        (``q``) and R (``b``) are the job's outputs, updated in place by the worker (out0, out1), so they
        must be contiguous host tensors of G's dtype (float32 or float64) that the caller
        neither reads nor writes until it has waited for the result, whose outputs are L and R
        themselves (None for a side not given). A failed job has written neither."""
        check_op(op, (g, l, r))
        if g.dtype not in _C_DTYPES:
            raise ValueError(f"{op} runs on float32 or float64 tensors, got G of {g.dtype}")
        for name, t in (("L (q)", l), ("R (b)", r)):
            if t is not None and (t.device.type != "cpu" or t.dtype != g.dtype
                                  or not t.is_contiguous()):
                raise ValueError(f"{op} updates {name} in place: it must be a contiguous "
                                 f"host tensor of G's dtype {g.dtype}, got {t.dtype} on "
                                 f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}")
        if g.device.type != "cpu":
            raise ValueError(f"{op} takes G in host memory, got it on {g.device}")
        batch, n, n1 = (int(s) for s in g.shape)
        self._poll()
        if "in0" in _donated(opts) and g.is_contiguous():
            x = g
            self._copies["inputs_donated"] += 1
        else:
            x = _snapshot([g], tuple(g.shape), g.dtype, False)
            self._copies["bytes_d2h_snapshots"] += x.numel() * x.element_size()
        outputs = (l, r)
        buffers = tuple(t for t in (x, l, r) if t is not None)
        handles: list[int] = []
        try:
            for t in buffers:
                handles.append(self._rt.register(t.data_ptr(), t.numel() * t.element_size()))
            ticket = self._rt.submit(
                op, _C_DTYPES[g.dtype], n, batch, x.data_ptr(), None,
                None if l is None else l.data_ptr(), None if r is None else r.data_ptr(),
                p=float(p), eps=float(eps), block=block, version=version, deadline=deadline,
                snapshot_step=snapshot_step, n1=n1, in2=None)
        except BaseException:
            for h in handles:
                self._rt.unregister(h)
            raise
        self._jobs[ticket] = _Job(op=op, device=g.device, dtype=g.dtype, pinned=False,
                                  buffers=buffers, outputs=outputs, handles=tuple(handles),
                                  host_outputs=True,
                                  shape=(batch, n, n1, float(p), (l is not None) + (r is not None)))
        return ticket

    def drain(self) -> int:
        """Collect every completion the runtime has published (never blocks)."""
        if self._closed:
            return 0
        before = sum(1 for j in self._jobs.values() if j.result is not None)
        self._poll()
        return sum(1 for j in self._jobs.values() if j.result is not None) - before

    def ready(self, ticket: int) -> bool:
        job = self._job(ticket)
        if job.result is None and not self._closed:
            self._poll()
        return job.result is not None

    def wait(self, ticket: int, timeout: Optional[float] = None) -> Result:
        """The job's result (bounded barrier, GIL released). ``timeout`` in seconds: on expiry
        TimeoutError and the ticket stays pending. The wait runs the signal handlers every
        100 ms: an exception from one (Ctrl-C's KeyboardInterrupt) propagates and the ticket
        stays pending as well, its tensors held and registered, so waiting again (or ``ready``)
        still gets the result."""
        job = self._job(ticket)
        if job.result is None:
            self._check_open()
            self._collect(self._rt.wait(ticket, timeout))
        del self._jobs[ticket]
        out = self._result(job)
        if self.observer is not None and out.started_ns:
            batch, n, n1, p, sides = job.shape
            self.observer(JobTiming(ticket, Lane.HOST, job.op, job.dtype, n, n1, batch,
                                    out.started_ns, out.done_ns, out.timing, p, sides,
                                    out.status == 0))
        return out

    def lanes(self) -> dict[str, int]:
        return {Lane.HOST: int(self.stats().get("workers", 1))}

    def cancel(self, ticket: int) -> bool:
        job = self._jobs.get(ticket)
        if job is None or job.result is not None or self._closed:
            return False
        if not self._rt.cancel(ticket):
            return False
        # A successful cancel publishes the completion at once: collect it without waiting.
        self._collect(self._rt.wait(ticket, 0.0))
        return True

    # ---- counters -------------------------------------------------------------------------------

    def note_install(self, snapshot_step: int, install_step: int) -> None:
        self._check_open()
        self._rt.note_install(snapshot_step, install_step)

    def note_nonfinite(self) -> None:
        self._check_open()
        self._rt.note_nonfinite()

    def stats(self) -> dict[str, Any]:
        if self._closed:
            out = dict(self._final_stats or {})
        else:
            out = self.stats_open()
        out.update(self._copies)
        return out

    def close(self) -> None:
        """Cancel queued jobs, wait for running ones (GIL released), free the runtime; the job
        tensors are dropped only after that. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for ticket, job in self._jobs.items():
            if job.result is None:
                self._rt.cancel(ticket)
        self._final_stats = self.stats_open()
        self.tracer.close()
        try:
            self._rt.close()  # writes the trace file when config 'trace' is set
        finally:
            for job in self._jobs.values():
                self._release_snapshots(job)
            self._jobs.clear()
            if self._shadow is not None:
                self._shadow.close()

    def stats_open(self) -> dict[str, Any]:
        out = self._rt.stats()
        if self._shadow is not None:
            sh = self._shadow.stats()
            out.update({f"snapshot_ring_{k[len('snapshot_'):]}": v for k, v in sh.items()
                        if k.startswith("snapshot_")})
        return out

    def _release_snapshots(self, job: _Job) -> None:
        for tk in job.snapshots:
            self._shadow.snapshot_release(tk)
        job.snapshots = ()

    def __del__(self) -> None:
        # Before the job tensors go away with this object, no worker may still write them.
        try:
            self.close()
        except Exception:
            pass

    # ---- internals -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("HostPoolEngine is closed")

    def _poll(self) -> None:
        for res in self._rt.poll():
            self._collect(res)

    def _collect(self, res: Any) -> None:
        """The runtime is done with a job: unregister and drop its buffers (keeping the outputs
        of a success) and remember its result."""
        job = self._jobs.get(res.ticket)
        if job is None:
            return
        for h in job.handles:
            self._rt.unregister(h)
        job.handles = ()
        job.buffers = ()
        self._release_snapshots(job)
        if res.status != 0:
            job.outputs = None
        job.result = res

    def _result(self, job: _Job) -> Result:
        res = job.result
        outputs, error = None, ""
        if res.status == 0:
            outputs = tuple(None if t is None else self._restore(t, job) for t in job.outputs)
            if not job.host_outputs:
                self._copies["bytes_h2d_results"] += sum(t.numel() * t.element_size()
                                                         for t in job.outputs)
        else:
            error = self._describe(job, res)
        started = int(res.started_ns)
        return Result(ticket=res.ticket, block=res.block, version=res.version,
                      snapshot_step=res.snapshot_step, status=res.status, outputs=outputs,
                      error=error, retried_f64=bool(res.retried_f64), started_ns=started,
                      done_ns=int(res.done_ns) if started else 0,
                      timing="worker" if started else "")

    @staticmethod
    def _restore(t: torch.Tensor, job: _Job) -> torch.Tensor:
        dtype = job.dtype if t.is_floating_point() else t.dtype
        if job.host_outputs:
            return t.to(dtype=dtype)
        return t.to(device=job.device, dtype=dtype, non_blocking=job.pinned)

    def _describe(self, job: _Job, res: Any) -> str:
        name = _C.err_name(res.status)
        msg = f"{job.op}: {name}: {_C.strerror(res.status)}"
        if res.started_ns and res.failed_index >= 0:  # only a job that ran has one
            msg += f" (block {res.failed_index} of the batch)"
        if not self._closed:
            detail = self._rt.last_error()
            if detail.startswith(name + ":"):  # the runtime's message about this failure
                msg += f"; {detail[len(name) + 1:].strip()}"
        return msg
