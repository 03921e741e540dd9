"""The REFRESH ops: the one table of their names, C codes, inputs and outputs.

Owns: ``OPS`` (each op's name, its ``ast_op`` code in include/asteria/runtime.h, and the
shapes and dtypes of its outputs) and the check of a job's inputs. Every executor reads the op
table from here: the torch executor maps names to its functions (``inline_torch.FUNCTIONS``),
the C pool takes the code, the replicated executor sizes its transfers with ``output_spec``;
tests/python/test_refresh_ops.py checks the table against ``asteria._C``'s. May call: torch.

Operations (names mirror ``ast_op`` in include/asteria/runtime.h):

====================  ==========================  ===========================================
op                    inputs                      outputs (``Result.outputs``)
====================  ==========================  ===========================================
``"eigh"``            F                           (Q, w): Q columns in descending eigenvalue
                                                  order, w descending eigenvalues
``"inv_root"``        F, p, eps                   (X,) with X = (F + eps I)^(-1/p), eigenvalues
                                                  raised to n eps_m lam_max before eps
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

import dataclasses
from typing import Callable, Optional, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    code: int  # ast_op
    #: (n, n1, dtype) -> [(shape, dtype)] of each output of one batch entry
    outputs: Callable[[int, int, torch.dtype], list]


def _mat(n, n1, dt):
    return [((n, n), dt)]


OPS: dict[str, Op] = {op.name: op for op in (
    Op("eigh", 1, lambda n, n1, dt: [((n, n), dt), ((n,), dt)]),
    Op("inv_root", 2, _mat),
    Op("newton_root", 3, _mat),
    Op("soap_qr", 4, lambda n, n1, dt: [((n, n), dt), ((n,), torch.int64)]),
    Op("kl_qr", 5, _mat),
    Op("soap_rotate", 6, lambda n, n1, dt: [((n, n1), dt)]),
)}
#: ops whose second input is a basis Q of F's shape
WITH_BASIS = ("soap_qr", "kl_qr")


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
    if op in WITH_BASIS:
        q = inputs[1]
        if q is None or q.shape != f.shape:
            raise ValueError(f"op {op!r} needs a basis Q with the shape of F {tuple(f.shape)}")
