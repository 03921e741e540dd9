"""How a parameter is cut into preconditioner blocks.

Owns: the ``Layout`` of one parameter: the optional ``merge_dims`` reshape (SOAP's rule: merge
neighbouring dimensions while their product stays <= max_precond_dim) followed by the optional
``block_size`` split into independent blocks of at most ``block_size`` per dimension (the edge
blocks may be smaller), as Distributed Shampoo blocks large matrices. Calls only torch; no state.

Blocks are views into the parameter (or its gradient) wherever torch can express them, so the
optimizers write block results straight back into the parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Optional

import torch


def merge_shape(shape: Sequence[int], max_dim: int) -> tuple[int, ...]:
    """SOAP's ``merge_dims``: collapse neighbouring dims while the product is <= max_dim."""
    merged: list[int] = []
    cur = 1
    for size in shape:
        if cur * size > max_dim:
            if cur > 1:
                merged.append(cur)
                cur = size
            else:
                merged.append(size)
                cur = 1
        else:
            cur *= size
    if cur > 1 or not merged:
        merged.append(cur)
    return tuple(merged)


@dataclasses.dataclass(frozen=True)
class Layout:
    shape: tuple[int, ...]                 # the parameter's shape
    view_shape: tuple[int, ...]            # after merge_dims (== shape without it)
    slices: tuple[tuple[slice, ...], ...]  # one entry per block, indexing view_shape

    # derived once per layout: the step reads them for every block of every step
    @functools.cached_property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s.stop - s.start for s in sl) for sl in self.slices)

    @functools.cached_property
    def whole(self) -> bool:
        """One block, the parameter itself (no reshape, no cut)."""
        return len(self.slices) == 1 and self.view_shape == self.shape

    def blocks(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The blocks of ``t`` (a parameter or gradient of this layout), views where possible."""
        if self.whole:
            return [t]
        v = t.reshape(self.view_shape)
        return [v[sl] for sl in self.slices]

    def write(self, p: torch.Tensor, j: int, value: torch.Tensor) -> None:
        """Copy the new value of block ``j`` into parameter ``p``."""
        if self.whole:
            p.copy_(value)
            return
        try:
            p.view(self.view_shape)[self.slices[j]].copy_(value)
        except RuntimeError:  # a non-viewable (non-contiguous) parameter: go through a copy
            v = p.reshape(self.view_shape).clone()
            v[self.slices[j]].copy_(value)
            p.copy_(v.reshape(p.shape))


def make_layout(shape: Sequence[int], block_size: Optional[int] = None,
                merge_dims: bool = False, max_precond_dim: int = 10000) -> Layout:
    shape = tuple(int(s) for s in shape)
    view_shape = merge_shape(shape, max_precond_dim) if merge_dims and len(shape) > 1 else shape
    per_dim = []
    for size in view_shape:
        step = size if block_size is None else block_size
        per_dim.append([slice(a, min(a + step, size)) for a in range(0, size, max(step, 1))]
                       or [slice(0, 0)])
    slices = tuple(tuple(c) for c in itertools.product(*per_dim))
    return Layout(shape=shape, view_shape=view_shape, slices=slices)
