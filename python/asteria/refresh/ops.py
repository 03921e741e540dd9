"""The REFRESH ops: the one table of their names, C codes, inputs and outputs.

Owns: ``OPS`` (each op's name, its ``ast_op`` code in include/asteria/runtime.h, the shapes
and dtypes of its outputs, its torch reference and its FLOP count) and the check of a job's inputs. Every
executor reads the op table from here: the torch executors run the references, the C pool
takes the code, the replicated executor sizes its transfers with ``output_spec``;
tests/python/test_refresh_ops.py checks the table against ``asteria._C``'s (which the extension
reads from libasteria's op table: ``ast_op_name``) and the references' shapes against
``output_spec``. Adding an op: its entry here, its ``ast_op`` value in
include/asteria/runtime.h, its kernel and op-table entry in src/linalg.c. May call: torch.

Operations (names mirror ``ast_op`` in include/asteria/runtime.h):

====================  ==========================  ===========================================
op                    inputs                      outputs (``Result.outputs``)
====================  ==========================  ===========================================
``"eigh"``            F                           (Q, w): Q columns in descending eigenvalue
                                                  order, w descending eigenvalues; the null
                                                  space's basis canonical (``basis``)
``"inv_root"``        F, p, eps                   (X,) with X = (F + eps I)^(-1/p), eigenvalues
                                                  raised to n eps_m lam_max before eps
``"newton_root"``     F, p (int), eps             (X,) coupled-Newton inverse root
``"soap_qr"``         F, Q                        (Q_new, perm): perm = argsort(diag(Q^T F Q),
                                                  descending) (int64), Q_new = qr(F Q[:, perm]).Q,
                                                  its dependent columns canonical (``basis``)
``"kl_qr"``           F, Q                        (Q_new,) = qr(F Q).Q, its dependent columns
                                                  canonical (``basis``)
``"soap_rotate"``     X, A pair (``q``), B pair   (out,) = A_new^T A_old X B_old^T B_new, shape
                      (``b``)                     (batch, n, n1); X (batch, n, n1), A pair
                                                  (batch, 2, n, n) = (A_old, A_new), B pair
                                                  (batch, 2, n1, n1); a pair None = identity
                                                  side, not both
``"gram_ema"``        G, L (``q``), R (``b``),    (L_new, R_new) = (p L + eps G G^T,
                      p = beta, eps = alpha       p R + eps G^T G): SOAP's factor EMAs; G
                                                  (batch, n, n1), L (batch, n, n), R (batch,
                                                  n1, n1); a factor None is not updated (None
                                                  in its place), not both. The C pool updates
                                                  L and R in place (exactly symmetric, ?syrk);
                                                  the reference returns new tensors
====================  ==========================  ===========================================

``soap_rotate`` and ``gram_ema`` are ``RECTANGULAR``: their first input is (batch, n, n1) and
``q``, ``b`` are optional operands of its two sides; executors report n1 and ``sides`` (how
many of ``q``, ``b`` were given) for them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from asteria.refresh.basis import eigh_basis, qr_basis

@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    code: int  # ast_op
    #: (n, n1, dtype) -> [(shape, dtype)] of each output of one batch entry
    outputs: Callable[[int, int, torch.dtype], list]
    #: the torch reference: (f, q, p, eps, b) -> outputs, on batched inputs in their dtype
    reference: Callable
    #: (n, n1, p, sides) -> FLOPs of one batch entry (the cost model's table,
    #: asteria/refresh/cost.py); n1 and sides matter to the rectangular ops only
    flops: Callable[[float, float, float, int], float]
    #: the second input is a basis Q of F's shape
    with_basis: bool = False
    #: the first input is (batch, n, n1); q and b are optional operands of its two sides
    rectangular: bool = False


# ---- the torch references (include/asteria/linalg.h's numerics) ----------------------------

AST_ENOCONV = -7
AST_ENONFINITE = -8

NEWTON_MAX_ITER = 100  # same limits as the C pool's coupled Newton (src/linalg.c)
NEWTON_TOL = 1e-6


class _Failure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _eye_like(f: torch.Tensor) -> torch.Tensor:
    return torch.eye(f.shape[-1], dtype=f.dtype, device=f.device).expand_as(f)


def _eigh(f: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w, q = torch.linalg.eigh(f)
    w = w.flip(-1)
    return eigh_basis(w, q.flip(-1)), w


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
    cols = perm.unsqueeze(1).expand_as(fq)
    return qr_basis(torch.gather(fq, 2, cols), torch.gather(q, 2, cols)), perm


def _kl_qr(f: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor]:
    return (qr_basis(f @ q, q),)


def soap_rotate(x: torch.Tensor, a: Optional[torch.Tensor],
                 b: Optional[torch.Tensor]) -> tuple[torch.Tensor]:
    """A_new^T A_old X B_old^T B_new; a None pair is the identity side. (The optimizer also
    uses it on the training thread when a worker's soap_rotate job failed.)"""
    if a is not None:
        x = a[:, 1].transpose(-1, -2) @ (a[:, 0] @ x)
    if b is not None:
        x = (x @ b[:, 0].transpose(-1, -2)) @ b[:, 1]
    return (x,)


def gram_ema(g: torch.Tensor, l: Optional[torch.Tensor], r: Optional[torch.Tensor],
             beta: float, alpha: float) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """SOAP's factor EMAs for G (batch, n, n1): (beta L + alpha G G^T, beta R + alpha G^T G)
    as new tensors, L (batch, n, n), R (batch, n1, n1). A None factor is not updated and None
    stands in its place; not both. The inputs are not modified (the C pool's op updates L and
    R in place, src/linalg.c)."""
    if l is None and r is None:
        raise ValueError("gram_ema needs L, R or both; got neither")
    gt = g.transpose(-1, -2)
    return (None if l is None else torch.baddbmm(l, g, gt, beta=beta, alpha=alpha),
            None if r is None else torch.baddbmm(r, gt, g, beta=beta, alpha=alpha))


def _mat(n, n1, dt):
    return [((n, n), dt)]


NEWTON_NOMINAL_ITERS = 20  # the cost model prices this many coupled-Newton iterations


def _newton_flops(n, n1, p, sides):
    return NEWTON_NOMINAL_ITERS * (2.0 * max(1, int(p) if p else 2) + 2.0) * n ** 3


def _rotate_flops(n, n1, p, sides):
    n1 = n1 or n
    return 4.0 * n * n * n1 + (4.0 * n * n1 * n1 if sides >= 2 else 0.0)


def _gram_flops(n, n1, p, sides):
    """One ?syrk per factor: n^2 n1 for L, n n1^2 for R. ``sides`` counts the factors given,
    not which: one factor is priced as L."""
    n1 = n1 or n
    return n * n * n1 + (n * n1 * n1 if sides >= 2 else 0.0)


OPS: dict[str, Op] = {op.name: op for op in (
    Op("eigh", 1, lambda n, n1, dt: [((n, n), dt), ((n,), dt)],
       lambda f, q, p, eps, b: _eigh(f), lambda n, n1, p, s: 9.0 * n ** 3),
    Op("inv_root", 2, _mat, lambda f, q, p, eps, b: _inv_root(f, p, eps),
       lambda n, n1, p, s: 11.0 * n ** 3),
    Op("newton_root", 3, _mat, lambda f, q, p, eps, b: _newton_root(f, p, eps), _newton_flops),
    Op("soap_qr", 4, lambda n, n1, dt: [((n, n), dt), ((n,), torch.int64)],
       lambda f, q, p, eps, b: _soap_qr(f, q), lambda n, n1, p, s: 14.0 / 3.0 * n ** 3,
       with_basis=True),
    Op("kl_qr", 5, _mat, lambda f, q, p, eps, b: _kl_qr(f, q),
       lambda n, n1, p, s: 14.0 / 3.0 * n ** 3, with_basis=True),
    Op("soap_rotate", 6, lambda n, n1, dt: [((n, n1), dt)],
       lambda f, q, p, eps, b: soap_rotate(f, q, b), _rotate_flops, rectangular=True),
    Op("gram_ema", 7, lambda n, n1, dt: [((n, n), dt), ((n1, n1), dt)],
       lambda f, q, p, eps, b: gram_ema(f, q, b, p, eps), _gram_flops, rectangular=True),
)}
#: ops whose second input is a basis Q of F's shape
WITH_BASIS = tuple(op.name for op in OPS.values() if op.with_basis)
#: ops whose first input is (batch, n, n1), with q and b optional operands of its two sides
RECTANGULAR = tuple(op.name for op in OPS.values() if op.rectangular)


def output_spec(op: str, n: int, dtype: torch.dtype, n1: int = 0) -> list:
    """(shape, dtype) of each output of one batch entry of ``op`` on factors of size n."""
    return OPS[op].outputs(n, n1, dtype)


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


def _check_gram_ema(g: torch.Tensor, l: Optional[torch.Tensor],
                    r: Optional[torch.Tensor]) -> None:
    if g.dim() != 3:
        raise ValueError(f"gram_ema input G must have shape (batch, n, n1), got "
                         f"{tuple(g.shape)}")
    batch, n, n1 = (int(s) for s in g.shape)
    if l is None and r is None:
        raise ValueError("gram_ema needs L (q), R (b) or both; got neither (a None factor is "
                         "not updated)")
    for name, t, m in (("L (q)", l, n), ("R (b)", r, n1)):
        if t is None:
            continue
        if tuple(t.shape) != (batch, m, m):
            raise ValueError(f"gram_ema {name} must have shape {(batch, m, m)} for G "
                             f"{tuple(g.shape)}, got {tuple(t.shape)}")
        if t.dtype != g.dtype:
            raise ValueError(f"gram_ema {name} must have G's dtype {g.dtype}, got {t.dtype}")


def check_op(op: str, inputs: Sequence[Optional[torch.Tensor]]) -> None:
    """Validates an op name and its inputs ``(f, q)`` or ``(f, q, b)`` (``b`` defaults to None;
    only the ``RECTANGULAR`` ops take it). Raises ValueError naming what is wrong."""
    if op not in OPS:
        raise ValueError(f"unknown REFRESH op {op!r}; allowed: {', '.join(OPS)}")
    f = inputs[0]
    q = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    if op == "soap_rotate":
        _check_rotate(f, q, b)
        return
    if op == "gram_ema":
        _check_gram_ema(f, q, b)
        return
    if b is not None:
        raise ValueError(f"op {op!r} takes no third input (b); only {', '.join(RECTANGULAR)} "
                         "do")
    if f.dim() != 3 or f.shape[1] != f.shape[2]:
        raise ValueError(f"REFRESH input must have shape (batch, n, n), got {tuple(f.shape)}")
    if op in WITH_BASIS:
        q = inputs[1]
        if q is None or q.shape != f.shape:
            raise ValueError(f"op {op!r} needs a basis Q with the shape of F {tuple(f.shape)}")
