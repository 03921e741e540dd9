"""State that an engine job still writes: "job J writes state (p, K); a read of K waits for it".

Owns: the record of the jobs that write optimizer state in the background (``Write``: the
(parameter, state key) pairs it writes, its engine ticket, how its result is applied), the jobs
due to start but not started yet, and the waits. An optimizer holds one ``PendingWrites``;
every reader of the state calls it before it reads: the state proxy (``_state``, per key), the
step (everything, at its start), tiering (before packs move or blocks migrate), checkpoints
(``state_dict`` / ``load_state_dict``) and ``close``. A method registers its own jobs with how
to apply their results (``WorkerJob``: SOAP's m re-expression at an install, the factor EMAs
of a step, declared in soap.py and started by the schedule); the optimizer layer knows no job
kind.

A job may be *due* (``defer``): made, but started only once the step's stacks have all run
(``start_due``, which the step calls then, and again at the next step's start and before any
wait, for what a signal interrupted). Starting is the job's own (``Write.start``): it submits
and registers itself (``add``); one found started already is not started again.

A wait that a signal (Ctrl-C) interrupts leaves its job registered: the next settle waits for it
again. Holds the optimizer's ``Run`` record (``run.py``), never the optimizer (the state proxy's
rule, ``_state``: no cycle through it). May call: the run's engine (``wait``), the jobs'
``start`` / ``apply``.
Single-threaded (the training thread); the engine's workers never see these objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Optional


class Write:
    """One job that writes optimizer state. ``keys``: the [(param, state key)] it writes;
    ``ticket``: the engine's, None while the job is only due. Subclasses say how it starts (a
    due job: submit, set ``ticket``, ``writes.add(self)``) and how its result is applied to the
    state (``apply``: the job's result, or its failure to redo on the training thread)."""

    keys: list
    ticket: Optional[int]

    def start(self) -> None:
        raise NotImplementedError

    def apply(self, result: Any) -> None:
        raise NotImplementedError


@dataclasses.dataclass(eq=False)  # a job is itself: no field-wise (tensor) comparison
class WorkerJob(Write):
    """A piece of a method's step that a worker may do, as the method declares it: the engine
    ``op`` and its operands ``inputs`` (f, q, b), ``p`` / ``eps``, the blocks ``members``
    [(param, j)] and the state ``keys`` [(param, state key)] it writes, which operands are
    made for the job (``donate``), ``apply`` (the op's outputs -> written into the state) and
    ``fallback`` (the same math with torch, for a job that fails: () -> the outputs).
    ``counters``: the names of its submitted and failed counts (``asteria_stats()``), ``what``
    it does (the failure's warning). The schedule decides whether it runs on a worker and
    starts it (``Schedule.offload``, which sets ``runner``: its ``start_job`` and
    ``finish_job`` start the job and apply its result)."""

    op: str
    members: list
    keys: list
    inputs: tuple
    apply_outputs: Callable[[tuple], None]
    fallback: Callable[[], tuple]
    counters: tuple
    what: str
    donate: tuple = ()
    p: float = 0.0
    eps: float = 0.0
    ticket: Optional[int] = None
    runner: Any = None

    def start(self) -> None:
        self.runner.start_job(self)

    def apply(self, result: Any) -> None:
        self.runner.finish_job(self, result)


class PendingWrites:
    """The jobs in flight that write optimizer state, by the (param, state key) they write, and
    the ones due to start. True while a started job is registered."""

    def __init__(self, run) -> None:
        self._run = run  # its engine waits for the jobs
        self._jobs: dict = {}   # (param, state key) -> the started Write that writes it
        self._due: list = []    # Writes made but not started, in the order they start

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

    def add(self, job: Write) -> None:
        """A started job writes ``job.keys``: a read of one of them waits for it."""
        for k in job.keys:
            self._jobs[k] = job

    def defer(self, job: Write) -> None:
        """A job to start at the next ``start_due`` (once the step's stacks have all run)."""
        self._due.append(job)

    def start_due(self) -> None:
        """Start the due jobs, in order, each let go of only once started (or found started:
        a signal may land between its start and its removal here)."""
        while self._due:
            job = self._due[0]
            if job.ticket is None:
                job.start()
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

    def _finish(self, job: Write) -> None:
        result = self._run.engine.wait(job.ticket)  # an interrupted wait leaves it registered
        for k in job.keys:
            if self._jobs.get(k) is job:
                del self._jobs[k]
        job.apply(result)
