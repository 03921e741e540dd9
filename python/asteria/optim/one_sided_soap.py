"""``asteria.OneSidedSOAP``: SOAP with a Kronecker factor and eigenbasis on one side only.

Each block keeps the factor (and its eigenbasis) of its smallest dimension (the first of them
on a tie) and leaves the other dimensions' coordinates as they are: for a 2048 x 8192 block a
2048^2 factor instead of 2048^2 + 8192^2, and a REFRESH of one small factor instead of two
(the one-sided SOAP of NVIDIA's Emerging-Optimizers, MOSO). A block whose smallest dimension
exceeds ``max_precond_dim`` has no factor (Adam in its own coordinates), as SOAP treats such a
dimension. Everything else (hyperparameters, state names, the step, the refresh and its
schedule) is SOAP's: only which dimensions carry a factor differs.
"""

from __future__ import annotations

from typing import Sequence

from asteria.optim.method import register
from asteria.optim.soap import SOAP, SOAPMethod


class OneSidedSOAPMethod(SOAPMethod):
    """SOAP's math with a factor on each block's smallest dimension only."""

    NAME = "one_sided_soap"

    def has_factor(self, block_shape: Sequence[int], group: dict) -> list[bool]:
        shape = list(block_shape)
        if not shape:
            return []
        side = shape.index(min(shape))
        return [i == side and d <= self.max_dim(group) for i, d in enumerate(shape)]


@register
class OneSidedSOAP(SOAP):
    """SOAP preconditioning the smallest dimension of each block only; keywords as ``SOAP``."""

    METHOD = OneSidedSOAPMethod
