"""The seam between the optimizers and whatever runs their REFRESH work: ``Engine``.

An engine takes the O(n^3) REFRESH work of a block (eigendecomposition, inverse root, QR
refresh, SOAP's re-expression of m in a new basis; the ops of ``asteria.refresh.ops``) and
hands back its result later. The executors (``asteria.refresh.select`` is the only place that
picks one):

* ``InlineTorchEngine`` (``inline_torch.py``): ``mode="sync"``. It computes inline with
  ``torch.linalg`` on the tensors' own device at ``submit`` time. This is the native reference.
* ``HostPoolEngine`` (``host_pool.py``): ``mode="async"``. Every job runs on libasteria's C worker
  pool (LAPACKE on host threads). The training thread only snapshots, submits, polls and
  waits.
* ``DeviceEngine`` (``device.py``): torch.linalg on a lowest-priority CUDA stream, on a
  thread of its own.
* ``SplitEngine`` (``split.py``): ``mode="async"`` with CUDA parameters; each job divided
  among the C pool's workers and a ``DeviceEngine`` by the cost model (``cost.py``).
* ``ReplicatedEngine`` (``replicated.py``): around either, for blocks replicated over
  ranks (one owner computes, the others receive).

All tensors passed to ``submit`` are *batched*: shape ``(batch, n, n)`` for same-shape blocks
(``soap_rotate``, ``gram_ema``: see the op table), so one job refreshes many blocks.
``submit`` copies (snapshots) its inputs, so the caller may keep mutating its state right after
the call.

``submit`` is declared in full here: the inputs and the job's identity, then one frozen
``SubmitOptions`` (outputs in host memory, donated inputs, replica set) that every executor
accepts, ignoring (documented per field) what it has no use for; callers need not check
capabilities for correctness. Capabilities an executor declares (class attributes) instead of
callers testing its type: ``takes_parts`` (inputs may be given as a list of per-block tensors,
see ``HostPoolEngine.submit``), ``replicated`` (blocks replicated over ranks: a job's
``replicas`` are synchronised), ``splits_batches`` (a job's batch is divided among lanes), ``lanes()`` (what
runs jobs and how many at once, keyed by ``Lane``) and ``model`` (a cost model the executor
divides jobs by, shared with the capacity record). An executor hands each finished job's
``JobTiming`` to its ``observer`` (the capacity model's feed), on the thread that waits for
the job.

Every method the optimizer layer calls on an engine is declared on ``Engine``; those an
executor may have nothing to do for (``drain``, ``step_end``) are no-ops here, so callers call
them plainly.

The trace: one ``Tracer`` per optimizer, over the trace recorder of libasteria's runtime (config
``trace``). The executor that owns that runtime (``HostPoolEngine``) builds it, once;
``asteria.refresh.select.make_engine`` hands it explicitly to the executors that wrap it
(``SplitEngine``, ``ReplicatedEngine``), and the optimizer hands ``engine.tracer`` to the
placement for its residency (``asteria.tiers.residency``). Every engine has one (``Engine.tracer``: ``NO_TRACE``,
which records nothing, where there is no runtime trace). Lane names are ``Lane`` (executor lanes: the cost
model's and the capacity report's) and ``TraceLane`` (the runtime trace's tracks); both are
``str`` enums whose values are what JSON, trace files and reports have always carried.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, Callable, Optional

import torch


class _StrEnum(str, enum.Enum):
    """A str whose str() and format() are its value (enum.StrEnum from Python 3.11 on)."""

    __str__ = str.__str__
    __format__ = str.__format__


class Lane(_StrEnum):
    """What runs REFRESH jobs: the unit of ``Engine.lanes()``, of ``JobTiming.lane`` and of
    the cost model's throughput table."""

    HOST = "host"      # libasteria's C worker pool (one slot per worker)
    DEVICE = "device"  # torch.linalg on a CUDA stream (DeviceEngine)
    INLINE = "inline"  # torch.linalg inline on the caller's thread (mode="sync")


class TraceLane(_StrEnum):
    """Named tracks of the runtime's Chrome trace that Python records on (``Tracer``;
    libasteria's workers have tracks of their own, by index)."""

    TRAIN = "train"
    SHADOW = "shadow"
    COHERENCE = "coherence"
    NVME = "nvme"


class Tracer:
    """Records caller events (copies, prefetches: ``asteria._C.Runtime.trace_event``'s
    arguments) in a runtime's trace, and writes it. A no-op without a trace: no runtime, its
    config 'trace' unset, or the runtime closed (``close``, by the runtime's owner, before it
    writes the file). Single-threaded use, like the engines."""

    def __init__(self, runtime: Any = None) -> None:
        self._rt = runtime if runtime is not None and getattr(runtime, "tracing", False) else None

    @property
    def active(self) -> bool:
        return self._rt is not None

    def __call__(self, kind: str, lane: Any, name: Optional[str] = None, **args: Any) -> None:
        if self._rt is not None:
            self._rt.trace_event(kind, lane, name, **args)

    def write(self, path: Optional[str] = None) -> None:
        """Write the trace so far (config ``trace``, or ``path``); recording goes on."""
        if self._rt is not None:
            self._rt.trace_write(path)

    def close(self) -> None:
        """The runtime is closing: record nothing more."""
        self._rt = None


#: the tracer of an engine without a runtime trace
NO_TRACE = Tracer()


@dataclasses.dataclass
class Result:
    """Outcome of one job. ``status`` is 0 on success, else a negative AST_E* code; on failure
    ``outputs`` is None and the caller keeps its previous preconditioner."""

    ticket: int
    block: int
    version: int
    snapshot_step: int
    status: int
    outputs: Optional[tuple[torch.Tensor, ...]]
    error: str = ""
    retried_f64: bool = False
    #: CLOCK_MONOTONIC ns (``time.monotonic_ns``) of the job's start and end, 0 where unknown.
    #: ``timing`` says who measured them: "worker" (libasteria's pool, around the LAPACK
    #: call on its thread), "wall" (Python, around the torch call; for the inline and device
    #: executors), "" (not measured).
    started_ns: int = 0
    done_ns: int = 0
    timing: str = ""


@dataclasses.dataclass(frozen=True)
class JobTiming:
    """One finished job (or one part of a job a split executor divided), as the capacity model
    (``asteria.refresh.cost``) learns from it. ``ticket`` is the ticket the caller holds."""

    ticket: int
    lane: Lane
    op: str
    dtype: torch.dtype
    n: int
    n1: int
    batch: int
    started_ns: int
    done_ns: int
    timing: str
    p: float = 0.0
    sides: int = 2    # soap_rotate / gram_ema: how many of the A / B pairs (L / R) were given
    ok: bool = True
    last: bool = True  # the last part of the caller's job to finish (a split job has several)


#: the inputs of a job that a caller may give away (``SubmitOptions.donate``)
DONATABLE = ("f", "q", "b")


@dataclasses.dataclass(frozen=True)
class SubmitOptions:
    """How a job is run and handed back, beyond its inputs: ``Engine.submit``'s ``opts``. Every
    engine accepts every field; one that has no use for a field ignores it, as said per field.
    The default asks for nothing (``NO_OPTIONS``)."""

    #: hand the outputs back as host tensors (the caller keeps them in host memory: a
    #: residency), not copied to the inputs' device. Honoured by the host pool and the device
    #: executor (and so by the executors that wrap them); the inline executor computes on the
    #: inputs' device and hands its outputs back there.
    host_outputs: bool = False
    #: names among ``DONATABLE`` of the inputs the caller gives away (tensors it made for this
    #: job and neither reads nor writes again): an executor that can reads them in place
    #: instead of snapshotting them (libasteria's pool: host tensors, contiguous, of the job's
    #: dtype). The others copy them as usual; a split executor gives its parts nothing.
    donate: tuple[str, ...] = ()
    #: the global ranks holding the job's blocks (DDP / HSDP replicas), or None: rank-local. A
    #: replicated executor (``Engine.replicated``) has one owner compute them and every replica
    #: install the same result, synchronised within the job's staleness budget, which is its
    #: ``deadline - snapshot_step`` (S is not passed again). Other executors run the job
    #: rank-local.
    replicas: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        names = (self.donate,) if isinstance(self.donate, str) else tuple(self.donate)
        bad = set(names) - set(DONATABLE)
        if bad:
            raise ValueError(f"donate: unknown input(s) {sorted(bad)}; allowed: names among "
                             f"{sorted(DONATABLE)}")
        object.__setattr__(self, "donate", names)
        if self.replicas is not None:
            object.__setattr__(self, "replicas", tuple(sorted(self.replicas)))


NO_OPTIONS = SubmitOptions()


class Engine(abc.ABC):
    """Abstract REFRESH engine. Tickets are positive ints, unique per engine."""

    #: inputs may be given as parts and donated (libasteria's pool)
    takes_parts = False
    #: a job's ``opts.replicas`` are synchronised across ranks (``step_end`` / ``drain``)
    replicated = False
    #: one job's batch may be divided among lanes (host workers, a device): the capacity model
    #: predicts its rounds with divisible work (``asteria.refresh.split``)
    splits_batches = False
    #: called with a ``JobTiming`` for each finished job whose result is handed out (the
    #: capacity model's feed); None: nobody listens
    observer: Optional[Callable[[JobTiming], None]] = None
    #: the cost model (``asteria.refresh.cost.CostModel``) this executor divides jobs by
    #: (``SplitEngine``); the capacity record shares it rather than keeping a second one.
    #: None: the executor has none
    model: Optional[Any] = None
    #: the optimizer's one runtime tracer (see the module docstring); NO_TRACE: none
    tracer: Tracer = NO_TRACE

    def _job(self, ticket: int) -> Any:
        """The job of a ticket not yet waited for: an engine keeps its jobs in ``self._jobs``
        (ticket -> job) and drops each once its result is handed out."""
        try:
            return self._jobs[ticket]
        except KeyError:
            raise ValueError(f"unknown or already waited-for ticket {ticket}") from None

    def lanes(self) -> dict[Lane, int]:
        """The lanes this executor runs jobs on and how many run at once:
        {Lane.HOST: workers} for the C pool, {Lane.INLINE: 1} for the torch executor, plus
        {Lane.DEVICE: 1} with a device executor."""
        return {}

    def drain(self) -> int:
        """Collect finished jobs without blocking; returns how many were collected. An
        executor that finishes its jobs at submit, or is only polled through ``ready``, has
        nothing to collect."""
        return 0

    def step_end(self, step: int) -> None:
        """The optimizer's step ``step`` ended (after its installs and submits). A replicated
        executor hands finished owner results to its protocol here; others ignore it."""

    @abc.abstractmethod
    def submit(
        self,
        op: str,
        f: torch.Tensor,
        q: Optional[torch.Tensor] = None,
        *,
        block: int,
        version: int,
        deadline: int,
        snapshot_step: int,
        p: float = 0.0,
        eps: float = 0.0,
        b: Optional[torch.Tensor] = None,
        opts: SubmitOptions = NO_OPTIONS,
    ) -> int:
        """Snapshot the inputs and start the job. Returns its ticket. ``b``: the B pair of
        ``soap_rotate`` (``q`` is its A pair, ``f`` its X) or R of ``gram_ema`` (``q`` is its
        L, ``f`` its G); only those two use it. ``deadline``: the step the result is installed
        at (a background write's: the next step). ``opts``: how it runs and is handed back
        (``SubmitOptions``; every engine takes every field)."""

    @abc.abstractmethod
    def ready(self, ticket: int) -> bool:
        """True if ``wait(ticket)`` would not block. Never blocks."""

    @abc.abstractmethod
    def wait(self, ticket: int) -> Result:
        """Block (bounded barrier, GIL released) until the job is done; return its result.
        Each ticket may be waited for once. Outputs are on the device/dtype of the inputs."""

    @abc.abstractmethod
    def cancel(self, ticket: int) -> bool:
        """Cancel a queued job; False if it already runs or finished."""

    @abc.abstractmethod
    def note_install(self, snapshot_step: int, install_step: int) -> None:
        """Tell the engine a result was installed (feeds the staleness stats)."""

    @abc.abstractmethod
    def note_nonfinite(self) -> None:
        """Count a REFRESH skipped because its inputs were not finite."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters: jobs_submitted, jobs_done, jobs_failed, nonfinite_skipped, installs,
        max_install_lag, barrier_waits, barrier_wait_ns, ..."""

    def close(self) -> None:
        """Release workers and buffers. Idempotent."""
