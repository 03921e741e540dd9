"""The REFRESH ops: the one table of their names, C codes, properties, inputs and outputs.

Owns: ``OPS``, one ``Op`` per op. Its C fields (the ``ast_op`` code, ``takes_basis``,
``in_place`` and the operands: which of a request's slots in0, in1, in2, out0, out1 it takes,
whether each is required, the shape each spans) are read from libasteria's op table
(``asteria._C.ops()``, src/op_table.c), so the two tables cannot disagree; this file adds what
only Python has: the torch reference and the FLOP count. The check of a job's inputs is here
too. Every executor and the cost model read an op's fields (``Op.takes_basis``,
``Op.in_place``, ``Op.rectangular``, ``Op.outputs``, ``Op.operand_elems``) and never name an
op: the torch executors run the references, the C pool takes the code and sizes its buffers
from the operands, the replicated executor sizes its transfers with ``output_spec``.
Adding an op: its ``ast_op`` value in include/asteria/runtime.h, its kernel in
src/linalg_kernels.c, its row in src/op_table.c, its direct entry points in src/linalg.c, its
reference and FLOP count here (docs/architecture.md, "A REFRESH op").
May call: torch, ``asteria._C`` (the op table, at import).

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

``soap_rotate`` and ``gram_ema`` are rectangular (``Op.rectangular``): their first input is
(batch, n, n1) and ``q``, ``b`` are optional operands of its two sides; executors report n1 and
``sides`` (how many of ``q``, ``b`` were given) for them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import torch

from asteria import _C
from asteria.refresh.basis import eigh_basis, qr_basis

#: shape of an operand (one batch entry) -> its dims for sizes (n, n1); "perm" is int64
_SHAPES = {"nn": lambda n, n1: (n, n), "n": lambda n, n1: (n,), "perm": lambda n, n1: (n,),
           "nn1": lambda n, n1: (n, n1), "n1n1": lambda n, n1: (n1, n1),
           "pair_nn": lambda n, n1: (2, n, n), "pair_n1n1": lambda n, n1: (2, n1, n1)}
#: a job's slots, in libasteria's order (ast_op_info)
SLOTS = ("in0", "in1", "in2", "out0", "out1")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    code: int  # ast_op
    #: in1 is the previous basis Q of F's shape, and the op needs it
    takes_basis: bool
    #: out0 / out1 are the caller's tensors, read and updated in place
    in_place: bool
    #: slot -> (need, shape) for each slot the op takes: need "required" or "optional", shape
    #: a key of ``_SHAPES`` (per batch entry, of the job's dtype but "perm": int64)
    operands: dict
    #: the torch reference: (f, q, p, eps, b) -> outputs, on batched inputs in their dtype
    reference: Callable
    #: (n, n1, p, sides) -> FLOPs of one batch entry (the cost model's table,
    #: asteria/refresh/cost.py); n1 and sides matter to the rectangular ops only
    flops: Callable[[float, float, float, int], float]
    #: (f, q, b) -> None, raising ValueError: the op's own input checks, in place of
    #: ``check_op``'s checks of a square op (None: those apply)
    check: Optional[Callable] = None

    @property
    def rectangular(self) -> bool:
        """in0 is (batch, n, n1), and q and b are optional operands of its two sides (executors
        report n1 and ``sides``, how many of q and b were given, for these ops)."""
        return self.operands["in0"][1] == "nn1"

    def reads(self, slot: str) -> bool:
        """Does a job read its input in ``slot`` ("in1", "in2")? The basis of a basis-taking op
        and the side operands of a rectangular one; the eigen ops accept an in1 they never read."""
        return slot in self.operands and (self.takes_basis or self.rectangular)

    def outputs(self, n: int, n1: int, dtype: torch.dtype) -> list:
        """(shape, dtype) of each output (out0, then out1 if the op has one) of one batch
        entry."""
        return [(_SHAPES[shape](n, n1), torch.int64 if shape == "perm" else dtype)
                for slot, (_, shape) in self.operands.items() if slot.startswith("out")]

    def operand_elems(self, slot: str, n: int, n1: int) -> int:
        """Elements of one batch entry of ``slot`` (0 for a slot the op does not take)."""
        if slot not in self.operands:
            return 0
        return math.prod(_SHAPES[self.operands[slot][1]](n, n1))

    def read_elems(self, n: int, n1: int, sides: int = 2) -> int:
        """Elements of one batch entry that a job takes from its caller: in0, the inputs it
        reads, and the operands an in-place op updates; of a rectangular op's second side (in2,
        out1) only with ``sides`` >= 2, and its first side priced as given whichever it is."""
        slots = ["in0"] + [s for s in ("in1", "in2") if self.reads(s)]
        if self.in_place:
            slots += ["out0", "out1"]
        return sum(self.operand_elems(s, n, n1) for s in slots
                   if sides >= 2 or s not in ("in2", "out1"))


# ---- the torch references (include/asteria/linalg.h's numerics) ----------------------------

AST_ENOCONV = -7
AST_ENONFINITE = -8

NEWTON_MAX_ITER = 100  # same limits as the C pool's coupled Newton (src/op_table.c)
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
    they give a rank-deficient factor's null space one root value (src/linalg_kernels.c)."""
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
    R in place, src/linalg_kernels.c)."""
    if l is None and r is None:
        raise ValueError("gram_ema needs L, R or both; got neither")
    gt = g.transpose(-1, -2)
    return (None if l is None else torch.baddbmm(l, g, gt, beta=beta, alpha=alpha),
            None if r is None else torch.baddbmm(r, gt, g, beta=beta, alpha=alpha))


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
    only the rectangular ops take it). Raises ValueError naming what is wrong."""
    if op not in OPS:
        raise ValueError(f"unknown REFRESH op {op!r}; allowed: {', '.join(OPS)}")
    f = inputs[0]
    q = inputs[1] if len(inputs) > 1 else None
    b = inputs[2] if len(inputs) > 2 else None
    entry = OPS[op]
    if entry.check is not None:
        entry.check(f, q, b)
        return
    if b is not None:
        raise ValueError(f"op {op!r} takes no third input (b); only "
                         f"{', '.join(o.name for o in OPS.values() if o.rectangular)} do")
    if f.dim() != 3 or f.shape[1] != f.shape[2]:
        raise ValueError(f"REFRESH input must have shape (batch, n, n), got {tuple(f.shape)}")
    if entry.takes_basis:
        q = inputs[1]
        if q is None or q.shape != f.shape:
            raise ValueError(f"op {op!r} needs a basis Q with the shape of F {tuple(f.shape)}")


#: what only Python has, per op: (torch reference, FLOPs of one batch entry, the check of its
#: inputs beyond check_op's or None)
_PYTHON = {
    "eigh": (lambda f, q, p, eps, b: _eigh(f), lambda n, n1, p, s: 9.0 * n ** 3, None),
    "inv_root": (lambda f, q, p, eps, b: _inv_root(f, p, eps), lambda n, n1, p, s: 11.0 * n ** 3,
                 None),
    "newton_root": (lambda f, q, p, eps, b: _newton_root(f, p, eps), _newton_flops, None),
    "soap_qr": (lambda f, q, p, eps, b: _soap_qr(f, q), lambda n, n1, p, s: 14.0 / 3.0 * n ** 3,
                None),
    "kl_qr": (lambda f, q, p, eps, b: _kl_qr(f, q), lambda n, n1, p, s: 14.0 / 3.0 * n ** 3,
              None),
    "soap_rotate": (lambda f, q, p, eps, b: soap_rotate(f, q, b), _rotate_flops, _check_rotate),
    "gram_ema": (lambda f, q, p, eps, b: gram_ema(f, q, b, p, eps), _gram_flops, _check_gram_ema),
}


def _table() -> dict:
    c_ops = _C.ops()
    if set(c_ops) != set(_PYTHON):
        raise ImportError(f"asteria.refresh.ops and libasteria's op table disagree: C has "
                          f"{sorted(c_ops)}, Python has references for {sorted(_PYTHON)}; an op "
                          f"needs both (docs/architecture.md, 'A REFRESH op')")
    return {name: Op(name, c["code"], c["takes_basis"], c["in_place"], dict(c["operands"]),
                     *_PYTHON[name])
            for name, c in sorted(c_ops.items(), key=lambda kv: kv[1]["code"])}


OPS: dict[str, Op] = _table()
