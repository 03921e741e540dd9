"""``TorchEngine``: the ``mode="sync"`` REFRESH executor, the native reference.

Owns: nothing but a table of finished results and its counters. Every job is computed inline
with ``torch.linalg`` (``soap_rotate``: plain matmuls) at ``submit`` time, on the inputs' own
device and dtype, so ``ready`` is always true and ``wait`` never blocks. It may call only
torch. Single-threaded use (the optimizer's training thread); no locks.

Numerics follow include/asteria/linalg.h: eigenvalues descending, inverse roots with eigenvalues
raised to the floor n eps_m lam_max before eps, SOAP's stable descending sort, float32 retried
once in float64, half precision computed in float32, and a failure (non-finite input or
result, a torch error, non-convergence) reported as a negative status with no outputs, so the
caller keeps its previous preconditioner.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

from asteria.refresh.engine import Engine, JobTiming, Result
from asteria.refresh.ops import check_op

AST_ENOCONV = -7
AST_ENONFINITE = -8

NEWTON_MAX_ITER = 100  # same limits as the C pool's coupled Newton (src/runtime.c)
NEWTON_TOL = 1e-6


class _Failure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _eye_like(f: torch.Tensor) -> torch.Tensor:
    return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand_as(f)


def _eigh(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, q = torch.linalg.eigh(f)
    return q.flip(-1), w.flip(-1)


def null_floor(w: torch.Tensor) -> torch.Tensor:
    """The floor under the eigenvalues ``w`` (..., n) of an inverse root: n eps_m max(w, 0),
    (..., 1). Eigenvalues below it are rounding noise, on which LAPACKs disagree; raised to it
    they give a rank-deficient factor's null space one root value (src/linalg.c)."""
    n = w.shape[-1]
    return n * torch.finfo(w.dtype).eps * w.amax(dim=-1, keepdim=True).clamp(min=0.0)


def _inv_root(f: torch.Tensor, p: float, eps: float) -> tuple[torch.Tensor]:
    w, q = torch.linalg.eigh(f)
    w = torch.maximum(w, null_floor(w)) + eps
    if bool((w <= 0).any()):
        raise _Failure(AST_ENONFINITE, "inv_root: zero eigenvalue with eps = 0")
    x = (q * w.pow(-1.0 / p).unsqueeze(-2)) @ q.transpose(-1, -2)
    return (x,)


def _newton_root(f: torch.Tensor, p: float, eps: float) -> tuple[torch.Tensor]:
    """Coupled Newton iteration (Guo & Higham) for (F + eps I)^(-1/p), p a positive integer."""
    root = int(p)
    eye = _eye_like(f)
    a = f + eps * eye
    z = (root + 1) / (2.0 * torch.linalg.matrix_norm(a, ord="fro"))
    z = z.view(-1, 1, 1)
    x = z.pow(1.0 / root) * eye
    m = z * a
    for _ in range(NEWTON_MAX_ITER):
        err = torch.linalg.matrix_norm(m - eye, ord=float("inf")).max()
        if float(err) < NEWTON_TOL:
            return (x,)
        mp = ((root + 1) * eye - m) / root
        x = x @ mp
        m = torch.linalg.matrix_power(mp, root) @ m
    raise _Failure(AST_ENOCONV, f"newton_root: no convergence in {NEWTON_MAX_ITER} iterations")


def _soap_qr(f: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fq = f @ q
    est = (q * fq).sum(1)  # diag(Q^T F Q); torch.einsum's path search leaves cyclic garbage
    perm = torch.argsort(est, dim=-1, descending=True, stable=True)
    # F (Q with its columns sorted) = (F Q) with its columns sorted
    return torch.linalg.qr(torch.gather(fq, 2, perm.unsqueeze(1).expand_as(fq))).Q, perm


def _kl_qr(f: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor]:
    return (torch.linalg.qr(f @ q).Q,)


def soap_rotate(x: torch.Tensor, a: Optional[torch.Tensor],
                 b: Optional[torch.Tensor]) -> tuple[torch.Tensor]:
    """A_new^T A_old X B_old^T B_new; a None pair is the identity side. (The optimizer also
    uses it on the training thread when a worker's soap_rotate job failed.)"""
    if a is not None:
        x = a[:, 1].transpose(-1, -2) @ (a[:, 0] @ x)
    if b is not None:
        x = (x @ b[:, 0].transpose(-1, -2)) @ b[:, 1]
    return (x,)


#: the torch function of each op of ``asteria.refresh.ops.OPS``: (f, q, p, eps, b) -> outputs
FUNCTIONS = {
    "eigh": lambda f, q, p, eps, b: _eigh(f),
    "inv_root": lambda f, q, p, eps, b: _inv_root(f, p, eps),
    "newton_root": lambda f, q, p, eps, b: _newton_root(f, p, eps),
    "soap_qr": lambda f, q, p, eps, b: _soap_qr(f, q),
    "kl_qr": lambda f, q, p, eps, b: _kl_qr(f, q),
    "soap_rotate": lambda f, q, p, eps, b: soap_rotate(f, q, b),
}


def compute(op: str, f: torch.Tensor, q: Optional[torch.Tensor], p: float,
            eps: float, b: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
    """One REFRESH op on batched inputs, in their dtype. Raises _Failure. ``b``: the B pair
    of ``soap_rotate`` (``q`` its A pair)."""
    out = FUNCTIONS[op](f, q, p, eps, b)
    for t in out:
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
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
        return tuple(t.to(f.dtype) if t.is_floating_point() else t for t in out), retried
    with torch.no_grad():
        try:
            return compute(op, f, q, p, eps, b), False
        except (_Failure, RuntimeError):
            if f.dtype != torch.float32:
                raise
        out = compute(op, f.double(), None if q is None else q.double(), p, eps,
                      None if b is None else b.double())
    return tuple(t.to(f.dtype) if t.is_floating_point() else t for t in out), True


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


class TorchEngine(Engine):
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
               eps=0.0, b=None) -> int:
        if self._closed:
            raise RuntimeError("TorchEngine is closed")
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
            rotate = op == "soap_rotate"
            self._shapes[ticket] = (op, f.dtype, int(f.shape[0]), int(f.shape[1]),
                                    int(f.shape[2]) if rotate else 0, float(p),
                                    (q is not None) + (b is not None) if rotate else 2)
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
            self.observer(JobTiming(ticket, "inline", op, dtype, n, n1, batch, res.started_ns,
                                    res.done_ns, res.timing, p, sides, res.status == 0))
        return res

    def lanes(self) -> dict[str, int]:
        return {"inline": 1}

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
