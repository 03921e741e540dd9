"""The seam between the optimizers and whatever runs their REFRESH work: ``Engine``.

An engine takes the O(n^3) REFRESH work of a block (eigendecomposition, inverse root, QR
refresh, SOAP's re-expression of m in a new basis; the ops of ``asteria.refresh.ops``) and
hands back its result later. The executors (``asteria.refresh.select`` is the only place that
picks one):

* ``TorchEngine`` (``inline_torch.py``): ``mode="sync"``. It computes inline with
  ``torch.linalg`` on the tensors' own device at ``submit`` time. This is the native reference.
* ``CEngine`` (``host_pool.py``): ``mode="async"``. Every job runs on libasteria's C worker
  pool (LAPACKE on host threads). The training thread only snapshots, submits, polls and
  waits.
* ``DeviceEngine`` (``device.py``): torch.linalg on a lowest-priority CUDA stream, on a
  thread of its own.
* ``SplitEngine`` (``split.py``): ``mode="async"`` with CUDA parameters; each job divided
  among the C pool's workers and a ``DeviceEngine`` by the cost model (``cost.py``).
* ``DistributedEngine`` (``replicated.py``): around either, for blocks replicated over
  ranks (one owner computes, the others receive).

All tensors passed to ``submit`` are *batched*: shape ``(batch, n, n)`` for same-shape blocks
(``soap_rotate``, ``gram_ema``: see the op table), so one job refreshes many blocks.
``submit`` copies (snapshots) its inputs, so the caller may keep mutating its state right after
the call.

Capabilities an executor declares (class attributes) instead of callers testing its type:
``takes_parts`` (inputs may be given as a list of per-block tensors and donated, see
``CEngine.submit``), ``replicated`` (blocks replicated over ranks: jobs take ``replicas=``),
``splits_batches`` (a job's batch is divided among lanes), and ``lanes()`` (what runs jobs and
how many at once). An executor hands each finished job's ``JobTiming`` to its ``observer``
(the capacity model's feed), on the thread that waits for the job.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional

import torch


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
    lane: str         # "host" (the C pool), "device" (a CUDA stream), "inline" (torch inline)
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


class Engine(abc.ABC):
    """Abstract REFRESH engine. Tickets are positive ints, unique per engine."""

    #: inputs may be given as parts and donated (libasteria's pool)
    takes_parts = False
    #: jobs carry ``replicas=`` and ``step_end`` / ``drain`` synchronise them across ranks
    replicated = False
    #: one job's batch may be divided among lanes (host workers, a device): the capacity model
    #: predicts its rounds with divisible work (``asteria.refresh.split``)
    splits_batches = False
    #: called with a ``JobTiming`` for each finished job whose result is handed out (the
    #: capacity model's feed); None: nobody listens
    observer: Optional[Callable[[JobTiming], None]] = None

    def lanes(self) -> dict[str, int]:
        """The lanes this executor runs jobs on and how many run at once:
        {"host": workers} for the C pool, {"inline": 1} for the torch executor, plus
        {"device": 1} with a device executor."""
        return {}

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
    ) -> int:
        """Snapshot the inputs and start the job. Returns its ticket. ``b``: the B pair of
        ``soap_rotate`` (``q`` is its A pair, ``f`` its X) or R of ``gram_ema`` (``q`` is its
        L, ``f`` its G); only those two use it."""

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
