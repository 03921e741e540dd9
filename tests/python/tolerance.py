"""Tolerances of the numerics tests, derived from the computation they compare.

Two computations of one result that may round differently (another reduction order, another
rank count, another BLAS / LAPACK kernel, libasteria's OpenBLAS against torch's MKL) agree to
a bound that follows from the compute dtype, not from the CPU a test was first run on. A
result claimed bitwise (same executor, same reduction order, same kernels) is compared with
rtol=0, atol=0 instead, never through this module.
"""

from __future__ import annotations

import torch


def rounding_tol(dtype, n: int = 1, steps: int = 1, cond: float = 1.0) -> float:
    """Relative bound on the difference of two roundings of one computation in ``dtype`` (a
    torch.dtype or its name): a reduction of ``n`` terms is off by at most n u (u = eps / 2,
    worst case, any order), ``steps`` such results compounding add up linearly, and a problem
    of condition number ``cond`` (e.g. ||F|| / gap for eigenvectors) multiplies the result.
    eps n steps cond: the worst-case bound with a factor 2 to spare."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.finfo(dtype).eps * n * steps * cond


def adamw_tol(dtype, steps: int) -> float:
    """Two elementwise AdamW updates of O(1) parameters written differently (another order of
    the same operations): about 10 roundings an element a step, over ``steps`` steps."""
    return rounding_tol(dtype, n=10, steps=steps)


def gram_tol(g, f, beta: float, alpha: float) -> float:
    """beta F + alpha G G^T (either side) in G's dtype: a sum of k + 1 terms (k <= the larger
    side), off by (k + 1) eps times the terms' size, |beta| max|F| + |alpha| k max|G|^2."""
    k = max(g.shape[-2:])
    mag = abs(beta) * float(f.abs().max()) + abs(alpha) * k * float(g.abs().max()) ** 2
    return rounding_tol(g.dtype, n=k + 1) * mag
