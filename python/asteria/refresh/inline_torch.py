"""``InlineTorchEngine``: the ``mode="sync"`` REFRESH executor, the native reference.

Owns: nothing but a table of finished results and its counters. Every job is computed inline
with ``torch.linalg`` (``soap_rotate``, ``gram_ema``: plain matmuls) at ``submit`` time, on the
inputs' own device and dtype, so ``ready`` is always true and ``wait`` never blocks. It may
call only torch. Single-threaded use (the optimizer's training thread); no locks.

The math of each op is its torch reference in ``asteria.refresh.ops``. Here: float32 retried
once in float64, half precision computed in float32, and a failure (non-finite input or
result, a torch error, non-convergence) reported as a negative status with no outputs, so the
caller keeps its previous preconditioner.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from asteria.refresh.engine import NO_OPTIONS, Engine, JobTiming, Lane, Result, SubmitOptions
from asteria.refresh.ops import AST_ENOCONV, AST_ENONFINITE, OPS, _Failure, check_op

FUNCTIONS = {name: op.reference for name, op in OPS.items()}  # name -> (f, q, p, eps, b) -> outputs


def compute(op: str, f: torch.Tensor, q: Optional[torch.Tensor], p: float,
            eps: float, b: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """One REFRESH op on batched inputs, in their dtype. Raises _Failure. ``b``: the B pair
    of ``soap_rotate`` (``q`` its A pair), R of ``gram_ema`` (``q`` its L); an output of
    ``gram_ema`` whose factor was not given is None."""
    out = FUNCTIONS[op](f, q, p, eps, b)
    for t in out:
        if t is not None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _Failure(AST_ENONFINITE, f"{op}: non-finite result")
    return out


def _compute_with_retry(op, f, q, p, eps, b=None) -> tuple[tuple[torch.Tensor, ...], bool]:
    """float32 that fails numerically is retried once in float64, rounded back (linalg.h).
    Half-precision inputs are computed in float32, as the C pool does (torch.linalg has no
    bfloat16 / float16 decompositions), and rounded back."""
    if f.dtype not in (torch.float32, torch.float64):
        def up(t):
            return None if t is None or not t.is_floating_point() else t.float()
        out, retried = _compute_with_retry(op, up(f), up(q), p, eps, up(b))
        return _cast(out, f.dtype), retried
    with torch.no_grad():
        try:
            return compute(op, f, q, p, eps, b), False
        except (_Failure, RuntimeError):
            if f.dtype != torch.float32:
                raise
        out = compute(op, f.double(), None if q is None else q.double(), p, eps,
                      None if b is None else b.double())
    return _cast(out, f.dtype), True


def _cast(out, dtype) -> tuple:
    """The floating-point outputs in dtype; integer ones (perm) and absent ones (None) as
    they are."""
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in out)


def run(op: str, f: torch.Tensor, q: Optional[torch.Tensor], p: float, eps: float,
        b: Optional[torch.Tensor] = None) -> tuple[int, Any, str, bool]:
    """One job as every torch executor runs it: (status, outputs or None, error, retried in
    float64). Non-finite inputs and results, torch's own failures, non-convergence: a negative
    status and no outputs."""
    try:
        if any(t is not None and not bool(torch.isfinite(t).all()) for t in (f, q, b)):
            raise _Failure(AST_ENONFINITE, f"{op}: non-finite input")
        outputs, retried = _compute_with_retry(op, f, q, p, eps, b)
        return 0, outputs, "", retried
    except _Failure as exc:
        return exc.status, None, str(exc), False
    except RuntimeError as exc:  # torch.linalg's own failures (non-convergence)
        return AST_ENOCONV, None, str(exc), False


class InlineTorchEngine(Engine):
    """Inline torch.linalg engine for ``mode="sync"``."""

    def __init__(self) -> None:
        self._next_ticket = 1
        self._done: dict[int, Result] = {}
        self._shapes: dict[int, tuple] = {}  # ticket -> (op, dtype, batch, n, n1, p, sides)
        self._closed = False
        self._stats: dict[str, Any] = {
            "jobs_submitted": 0, "jobs_done": 0, "jobs_failed": 0, "jobs_retried_f64": 0,
            "nonfinite_skipped": 0, "installs": 0, "max_install_lag": 0,
            "barrier_waits": 0, "barrier_wait_ns": 0, "workers": 0,
        }

    def submit(self, op, f, q=None, *, block, version, deadline, snapshot_step, p=0.0,
               eps=0.0, b=None, opts: SubmitOptions = NO_OPTIONS) -> int:
        """Computes now, on the inputs' device: ``opts`` asks for nothing this executor does
        otherwise (no snapshot to spare, outputs where the inputs are, no replicas)."""
        if self._closed:
            raise RuntimeError("InlineTorchEngine is closed")
        check_op(op, (f, q, b))
        ticket = self._next_ticket
        self._next_ticket += 1
        self._stats["jobs_submitted"] += 1
        t0 = time.monotonic_ns()
        status, outputs, error, retried = run(op, f, q, p, eps, b)
        t1 = time.monotonic_ns()
        self._stats["jobs_done"] += 1
        if status:
            self._stats["jobs_failed"] += 1
        if retried:
            self._stats["jobs_retried_f64"] += 1
        self._done[ticket] = Result(ticket=ticket, block=block, version=version,
                                    snapshot_step=snapshot_step, status=status,
                                    outputs=outputs, error=error, retried_f64=retried,
                                    started_ns=t0, done_ns=t1, timing="wall")
        if self.observer is not None:
            rect = OPS[op].rectangular
            self._shapes[ticket] = (op, f.dtype, int(f.shape[0]), int(f.shape[1]),
                                    int(f.shape[2]) if rect else 0, float(p),
                                    (q is not None) + (b is not None) if rect else 2)
        return ticket

    def ready(self, ticket: int) -> bool:
        return ticket in self._done

    def wait(self, ticket: int) -> Result:
        try:
            res = self._done.pop(ticket)
        except KeyError:
            raise ValueError(f"unknown or already waited-for ticket {ticket}") from None
        shape = self._shapes.pop(ticket, None)
        if self.observer is not None and shape is not None:
            op, dtype, batch, n, n1, p, sides = shape
            self.observer(JobTiming(ticket, Lane.INLINE, op, dtype, n, n1, batch, res.started_ns,
                                    res.done_ns, res.timing, p, sides, res.status == 0))
        return res

    def lanes(self) -> dict[str, int]:
        return {Lane.INLINE: 1}

    def cancel(self, ticket: int) -> bool:
        return False  # every job finished at submit time

    def note_install(self, snapshot_step: int, install_step: int) -> None:
        self._stats["installs"] += 1
        self._stats["max_install_lag"] = max(self._stats["max_install_lag"],
                                             install_step - snapshot_step)

    def note_nonfinite(self) -> None:
        self._stats["nonfinite_skipped"] += 1

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def close(self) -> None:
        self._closed = True
        self._done.clear()
