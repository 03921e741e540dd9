"""The REFRESH engine interface the optimizers program against.

An engine takes the O(n^3) REFRESH work of a block (eigendecomposition, inverse root, QR
refresh, SOAP's re-expression of m in a new basis) and hands back its result later. Two
engines implement it:

* ``TorchEngine`` (``engine_torch.py``): ``mode="sync"``. It computes inline with
  ``torch.linalg`` on the tensors' own device at ``submit`` time. This is the native reference.
* ``CEngine`` (``engine_c.py``): ``mode="async"``. Every job runs on libasteria's C worker pool
  (LAPACKE on host threads). The training thread only snapshots, submits, polls and waits.

All tensors passed to ``submit`` are *batched*: shape ``(batch, n, n)`` for same-shape blocks
(``soap_rotate``: see the table), so one job refreshes many blocks. ``submit`` copies
(snapshots) its inputs, so the caller may keep mutating its state right after the call.

Operations (names mirror ``ast_op`` in include/asteria/runtime.h):

====================  ==========================  ===========================================
op                    inputs                      outputs (``Result.outputs``)
====================  ==========================  ===========================================
``"eigh"``            F                           (Q, w): Q columns in descending eigenvalue
                                                  order, w descending eigenvalues
``"inv_root"``        F, p, eps                   (X,) with X = (F + eps I)^(-1/p), eigenvalues
                                                  clamped at 0 before eps
``"newton_root"``     F, p (int), eps             (X,) coupled-Newton inverse root
``"soap_qr"``         F, Q                        (Q_new, perm): perm = argsort(diag(Q^T F Q),
                                                  descending) (int64), Q_new = qr(F Q[:, perm]).Q
``"kl_qr"``           F, Q                        (Q_new,) = qr(F Q).Q
``"soap_rotate"``     X, A pair (``q``), B pair   (out,) = A_new^T A_old X B_old^T B_new, shape
                      (``b``)                     (batch, n, n1); X (batch, n, n1), A pair
                                                  (batch, 2, n, n) = (A_old, A_new), B pair
                                                  (batch, 2, n1, n1); a pair None = identity
                                                  side, not both
====================  ==========================  ===========================================
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

import torch

OPS = ("eigh", "inv_root", "newton_root", "soap_qr", "kl_qr", "soap_rotate")


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


class Engine(abc.ABC):
    """Abstract REFRESH engine. Tickets are positive ints, unique per engine."""

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
        ``soap_rotate`` (``q`` is its A pair, ``f`` its X); only ``soap_rotate`` uses it."""

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


def _check_rotate(f: torch.Tensor, a: Optional[torch.Tensor],
                  b: Optional[torch.Tensor]) -> None:
    if f.dim() != 3:
        raise ValueError(f"soap_rotate input X must have shape (batch, n, n1), got "
                         f"{tuple(f.shape)}")
    batch, n, n1 = (int(s) for s in f.shape)
    if a is None and b is None:
        raise ValueError("soap_rotate needs an A pair (q), a B pair (b) or both; got neither "
                         "(a None pair is the identity side)")
    for name, pair, m in (("A pair (q)", a, n), ("B pair (b)", b, n1)):
        if pair is not None and tuple(pair.shape) != (batch, 2, m, m):
            raise ValueError(f"soap_rotate {name} must have shape {(batch, 2, m, m)} "
                             f"(old, new) for X {tuple(f.shape)}, got {tuple(pair.shape)}")


def check_op(op: str, inputs: Sequence[Optional[torch.Tensor]]) -> None:
    """Validates an op name and its inputs ``(f, q)`` or ``(f, q, b)`` (``b`` defaults to None;
    only ``soap_rotate`` takes it). Raises ValueError naming what is wrong."""
    if op not in OPS:
        raise ValueError(f"unknown REFRESH op {op!r}; allowed: {', '.join(OPS)}")
    f = inputs[0]
    b = inputs[2] if len(inputs) > 2 else None
    if op == "soap_rotate":
        _check_rotate(f, inputs[1] if len(inputs) > 1 else None, b)
        return
    if b is not None:
        raise ValueError(f"op {op!r} takes no B pair (b); only soap_rotate does")
    if f.dim() != 3 or f.shape[1] != f.shape[2]:
        raise ValueError(f"REFRESH input must have shape (batch, n, n), got {tuple(f.shape)}")
    if op in ("soap_qr", "kl_qr"):
        q = inputs[1]
        if q is None or q.shape != f.shape:
            raise ValueError(f"op {op!r} needs a basis Q with the shape of F {tuple(f.shape)}")


def make_engine(cfg: Any) -> Engine:
    """The engine for a validated ``RuntimeConfig``: ``TorchEngine`` in sync mode, the C worker
    pool (``CEngine``) in async mode."""
    if cfg.mode == "sync":
        from asteria.engine_torch import TorchEngine

        return TorchEngine()
    from asteria.engine_c import CEngine

    return CEngine(cfg)
