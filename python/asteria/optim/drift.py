"""The drift score of a Kronecker factor: how far it has moved since its last refresh started
(``refresh_policy="drift"``: the cadence, ``asteria.optim.cadence``, orders the factors that
may start a refresh by it).

Owns: the probes (``PROBES`` Gaussian columns per factor size, drawn from a fixed seed on the
host: the same on every machine, rank and run), a factor's sketch (``F @ Omega``, n x
``PROBES``, float32: what the cadence keeps of a factor at its refresh start) and the score
of a factor against its sketch at its last start,

    score = ||F_t Omega - F_s Omega||_F / ||F_t Omega||_F   (0 for a zero factor).

Why this score. It estimates ||F_t - F_s||_F / ||F_t||_F (for Gaussian Omega,
E ||A Omega||_F^2 = PROBES ||A||_F^2; with 8 probes a ratio of two such norms is within about
25% of the exact one), which bounds how far the basis Q installed from F_s is from
diagonalising F_t, the quantity Distributed Shampoo's skip test measures exactly
(r = ||B - diag(B)||_F / ||B||_F with B = Q^T F_t Q, "Purifying Shampoo", arXiv 2506.03595):
when Q diagonalises F_s, ||offdiag(Q^T F_t Q)||_F <= ||Q^T (F_t - F_s) Q||_F =
||F_t - F_s||_F. The exact r costs two n^3 products per factor and step; the probes cost
2 * PROBES * n^2 and keep n x PROBES numbers per factor instead of a second copy of every
factor (docs/capacity.md, "Refresh per factor", has the measurements).
May call: torch. State: the probes, cached per (size, dtype, device). The training thread.
"""

from __future__ import annotations

from collections import defaultdict

import torch

PROBES = 8      # columns of Omega
SEED = 20506    # the probes' seed: one Omega per factor size, everywhere


class Probes:
    """The probes of every factor size, and the sketches and scores made with them."""

    def __init__(self) -> None:
        self._omega: dict = {}

    def omega(self, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Omega (n x PROBES) in the factor's dtype and device: drawn once per size on the host
        in float32 from ``SEED`` + n, so every machine and rank has the same."""
        key = (n, dtype, torch.device(device))
        om = self._omega.get(key)
        if om is None:
            gen = torch.Generator().manual_seed(SEED + n)
            om = torch.randn(n, PROBES, generator=gen, dtype=torch.float32)
            om = self._omega[key] = om.to(device=device, dtype=dtype)
        return om

    def sketch(self, factor: torch.Tensor) -> torch.Tensor:
        """F @ Omega as float32 (n x PROBES), on the factor's device."""
        return (factor @ self.omega(factor.shape[-1], factor.dtype, factor.device)).float()

    def scores(self, factors: list, refs: list) -> tuple[list, list]:
        """(scores, sketches): each factor's score against its ``refs`` sketch (the sketch at
        its last refresh start; zeros: none yet, a score of 1), and its sketch now. One
        transfer to the host per device."""
        sketches = [self.sketch(f) for f in factors]
        by_device: dict = defaultdict(list)
        for i, y in enumerate(sketches):
            by_device[y.device].append(i)
        out = [0.0] * len(factors)
        for device, idx in by_device.items():
            num = torch.stack([torch.linalg.vector_norm(sketches[i] - refs[i].to(device))
                               for i in idx])
            den = torch.stack([torch.linalg.vector_norm(sketches[i]) for i in idx])
            ratio = torch.where(den > 0, num / torch.where(den > 0, den, 1.0),
                                torch.zeros_like(num))
            for i, v in zip(idx, ratio.tolist()):
                out[i] = v
        return out, sketches
