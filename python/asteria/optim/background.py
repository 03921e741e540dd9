"""A method's background jobs (``opt.background``): pieces of its step that a worker of the
engine may do while the next forward and backward run, from the decision to the applied result.

Owns, end to end: whether a declared job may run on a worker (``on_worker``, the one rule),
starting it now or once the step's stacks have all run (``offload``, ``start_due``), its engine
block keys and versions, the record of the jobs in flight by the (parameter, state key) each
writes ("job J writes state (p, K); a read of K waits for it"), the waits (``settle``,
``settle_all``), writing a job's outputs where it declares them, or for a job that failed
redoing it with the op's torch reference (``asteria.refresh.ops``: the same math, on the
training thread), and the counts of jobs submitted and failed. A method declares its job kinds
(``JobKind``: op, counter names, what it does, the runtime switch it obeys; declaring one
registers it in ``KINDS``, so its counters exist in every optimizer from the start) and its
jobs (``WorkerJob``: data, tensors and numbers; nothing in it runs or calls back). The
optimizer layer knows no job kind.

Built with the run record (``BackgroundJobs(run)``: engine, config, step counter, parameter
index, counters), then bound to the placement (``bind``, held weakly: the placement holds this
part); the method, the schedule, the state proxy and the optimizer are given this part at
construction. Every reader of state that a job may write settles it first: the state proxy
(``_state``, per key), the step (at its start, ``Schedule.step_start``; what it did not read,
before its end), SOAP's read of m, tiering (before packs move or blocks migrate), checkpoints
(``Schedule.wait_pending`` / ``reset``) and ``close``.

A job may be *due* (``offload(job, due=True)``): made, but started only once the step's stacks
have all run (``start_due``, which the step calls then, and again at the next step's start and
before any wait, for what a signal interrupted). A job found started already (its ``ticket``
set) is not started again. A wait that a signal (Ctrl-C) interrupts leaves its job registered:
the next settle waits for it again. A job that writes NVMe-homed blocks waits for the others
first: one such job in flight, memory for one job.

The engine block keys of these jobs are their own, from ``FIRST_BLOCK`` up (stable per op and
members, a version per submission); the schedule's REFRESH rounds number theirs from 1, so a
job of one never supersedes a queued job of the other in the pool.

May call: the run's engine (``submit``, ``wait``), the placement's ``is_state`` and ``on_nvme``,
``asteria.refresh.ops`` (an op's layout and torch reference). Holds the optimizer's
``Run`` record, never the optimizer (the state proxy's rule, ``_state``: no cycle through it).
Single-threaded (the training thread); the engine's workers never see these objects.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from asteria.optim._state import local
from asteria.optim.run import COUNTERS
from asteria.refresh.engine import SubmitOptions
from asteria.refresh.ops import OPS

if TYPE_CHECKING:
    from asteria.config import RuntimeConfig

#: the first engine block key of a background job (the schedule's REFRESH keys count from 1)
FIRST_BLOCK = 1 << 32

#: every declared job kind, in the order declared: their counters exist from the start
KINDS: list = []


@dataclasses.dataclass(frozen=True)
class JobKind:
    """A kind of job a method may hand to a worker, declared once at module level (declaring
    it registers it): the engine ``op``, the names of its counters in ``asteria_stats()``
    (``submitted``, ``failed``), ``what`` it does (the failure's warning) and ``switch``, the
    runtime config switch it obeys (config -> may it run on a worker; None: no switch, the
    rule of ``on_worker`` alone)."""

    op: str
    submitted: str
    failed: str
    what: str
    switch: Optional[Callable[["RuntimeConfig"], bool]] = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"JobKind op: unknown op {self.op!r}; allowed: {sorted(OPS)}")
        taken = set(COUNTERS) | {n for k in KINDS for n in (k.submitted, k.failed)}
        for name in (self.submitted, self.failed):
            if name in taken or self.submitted == self.failed:
                raise ValueError(f"JobKind counters: {name!r} is taken; allowed: a name no "
                                 f"other counter of asteria_stats() has")
        KINDS.append(self)


@dataclasses.dataclass(eq=False)  # a job is itself: no field-wise (tensor) comparison
class WorkerJob:
    """One piece of a method's step for a worker, as the method declares it: its ``kind``, the
    blocks ``members`` [(param, j)] and the state ``keys`` [(param, state key)] it writes, the
    op's operands ``inputs`` (f, q, b) and ``p`` / ``eps``, which operands are made for the job
    (``donate``) and ``into``: per output of the op, the state it is written into (a tensor:
    the whole output, unless the op wrote it there in place; a list: one tensor per batch
    entry, the entry reshaped to it; None: not written). ``ticket``: the engine's, once
    started (None while it is only due)."""

    kind: JobKind
    members: list
    keys: list
    inputs: tuple
    into: tuple
    donate: tuple = ()
    p: float = 0.0
    eps: float = 0.0
    ticket: Optional[int] = None


class BackgroundJobs:
    """The background-jobs part of an ``AsteriaOptimizer`` (``opt.background``). True while a
    started job is registered."""

    def __init__(self, run) -> None:
        self._run = run
        self._placement = lambda: None  # bound once the placement exists (``bind``)
        self._jobs: dict = {}   # (param, state key) -> the started job that writes it
        self._due: list = []    # jobs made but not started, in the order they start
        self._blocks: dict = {}    # (op, member indices) -> engine block key
        self._versions: dict = {}  # engine block key -> submissions so far
        for kind in KINDS:
            run.counters[kind.submitted] = 0
            run.counters[kind.failed] = 0

    def bind(self, placement) -> None:
        """The placement whose state the jobs write, held weakly (it holds this part)."""
        self._placement = weakref.ref(placement)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, key) -> bool:
        return key in self._jobs

    def __iter__(self) -> Iterator:
        return iter(self._jobs)

    @property
    def due(self) -> list:
        """The jobs made but not started yet (what a signal interrupted included)."""
        return list(self._due)

    # ---- a method's jobs ---------------------------------------------------------------------
    def on_worker(self, kind: JobKind, members: list, block_dims: int,
                  dtype: Optional[torch.dtype] = None, in_place: tuple = ()) -> bool:
        """May a job of ``kind`` that writes these members' [(param, j)] state run on a worker?
        The one rule: its kind's runtime switch allows it, an executor that takes inputs made
        for it (libasteria's pool, ``mode="async"``; rank-local: a replicated block's state is
        updated by every replica itself, on its own thread), host parameters (on a GPU the work
        is a few device matmuls, cheaper than the round trip), blocks the op's layout takes (a
        rectangular op: at most 2 dims), a dtype the pool computes in (``dtype``: float32 /
        float64), outputs written in place into the state itself (``in_place``: [(field, dim,
        tensor)] of the members, each the placement's own memory in the job's dtype, or the
        step's later write-back would overwrite the job's result). A deferred install's jobs
        too (``Schedule.settle_deferred``): the next step starts them, works on the state they
        do not write, and waits for one only where it reads what that one writes; where an
        install happens does not change which kernel computes what (bitwise the same
        trajectory)."""
        run = self._run
        if kind.switch is not None and not kind.switch(run.cfg):
            return False
        if OPS[kind.op].rectangular and block_dims > 2:
            return False
        if dtype is not None and dtype not in (torch.float32, torch.float64):
            return False
        placement = self._placement()
        return (run.engine.takes_parts and all(local(p).device.type == "cpu" for p, _ in members)
                and all(x.dtype == dtype and x.is_contiguous()
                        and placement.is_state(members, field, dim, x)
                        for field, dim, x in in_place))

    def offload(self, job: WorkerJob, due: bool = False) -> None:
        """Run a declared job (which ``on_worker`` allowed) on a worker: started now, or
        (``due``) once the step's stacks have all run (``start_due``). Its blocks on NVMe: the
        jobs in flight are taken first (one such job in flight: the previous one's inputs and
        result are let go before this one's are made)."""
        if due:
            self._due.append(job)
            return
        placement = self._placement()
        if placement.on_nvme(job.members):
            self.settle_all()
        self.start(job)

    def start(self, job: WorkerJob) -> None:
        """Submit a job, due by the next step (its block key is stable for its op and members,
        its version counts its submissions), and register what it writes."""
        run = self._run
        key = (job.kind.op, tuple((run.pindex[p], j) for p, j in job.members))
        block = self._blocks.setdefault(key, FIRST_BLOCK + len(self._blocks))
        version = self._versions[block] = self._versions.get(block, 0) + 1
        f, q, b = job.inputs
        job.ticket = run.engine.submit(job.kind.op, f, q, b=b, p=job.p, eps=job.eps, block=block,
                                       version=version, deadline=run.t + 1,
                                       snapshot_step=run.t,
                                       opts=SubmitOptions(host_outputs=True, donate=job.donate))
        run.counters[job.kind.submitted] += 1
        for k in job.keys:
            self._jobs[k] = job

    # ---- the readers' waits ------------------------------------------------------------------
    def start_due(self) -> None:
        """Start the due jobs, in order, each let go of only once started (or found started:
        a signal may land between its start and its removal here)."""
        while self._due:
            job = self._due[0]
            if job.ticket is None:
                self.start(job)
            self._due.pop(0)

    def settle(self, p, key) -> None:
        """Before a read or write of p's ``key``: the job that writes it is done and applied
        (the due jobs are started first)."""
        if self._due:
            self.start_due()
        job = self._jobs.get((p, key))
        if job is not None:
            self._finish(job)

    def settle_all(self) -> None:
        """Every job that writes state: started if due, waited for, applied."""
        if self._due:
            self.start_due()
        for job in list({id(j): j for j in self._jobs.values()}.values()):
            self._finish(job)

    def _finish(self, job: WorkerJob) -> None:
        """Wait for a job and write its outputs; a failed one has written nothing and is redone
        here with the op's torch reference on the same inputs (the same math: the state must
        not keep what the job was to replace)."""
        res = self._run.engine.wait(job.ticket)  # an interrupted wait leaves it registered
        for k in job.keys:
            if self._jobs.get(k) is job:
                del self._jobs[k]
        outputs = res.outputs
        if res.status:
            self._run.counters[job.kind.failed] += 1
            warnings.warn(f"Asteria: {job.kind.what} on a worker failed ({res.error}); done on "
                          f"the training thread instead", RuntimeWarning, stacklevel=3)
            f, q, b = job.inputs
            outputs = OPS[job.kind.op].reference(f, q, job.p, job.eps, b)
        for out, into in zip(outputs, job.into):
            if out is None or into is None:
                continue
            if isinstance(into, torch.Tensor):
                if out.data_ptr() != into.data_ptr():
                    into.copy_(out)
            else:
                for i, dst in enumerate(into):
                    dst.copy_(out[i].reshape(dst.shape))
