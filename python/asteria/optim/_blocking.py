"""How a parameter is cut into preconditioner blocks.

Owns: the ``Layout`` of one parameter: the optional ``merge_dims`` reshape (SOAP's rule: merge
neighbouring dimensions while their product stays <= max_precond_dim) followed by the optional
``block_size`` split into independent blocks of at most ``block_size`` per dimension (the edge
blocks may be smaller), as Distributed Shampoo blocks large matrices; and the experts of a
mixture-of-experts weight (``Experts``: the param group's ``num_experts``), each its own set of
blocks; and the key a layout is cut by (``layout_key``: block size, merge_dims, max dim,
experts of a param group, through its method's rules). Calls only torch; no state.

Experts. A layer's experts are kept in one parameter, either as (E, d_in, d_out) (torchtitan) or
with the expert dimension folded into the rows, (E * d_in, d_out) (OLMo-core's MoE MLP, so that
FSDP2 can shard it over more ranks than experts). Either way the layout works on the rows
(E * d_in, d_out, ...): an expert is d_in consecutive rows, and every block lies within one
expert, so no factor couples two experts and no statistic is shared between them; blocking
(``merge_dims``, ``block_size``) applies within each expert. All experts' blocks have one shape,
so a layer's experts form one stack: one kernel call and one batched REFRESH job. A shard of
such a parameter (FSDP2 cuts its rows) is cut at the expert boundaries its rows cross
(``Experts.row_offset``): a shard that holds part of an expert preconditions that part.

Blocks are views into the parameter (or its gradient) wherever torch can express them, so the
optimizers write block results straight back into the parameter.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Optional, Sequence

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
    experts: bool = False                  # cut at expert boundaries (``Experts``)

    # derived once per layout: the step reads them for every block of every step
    @functools.cached_property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(s.stop - s.start for s in sl) for sl in self.slices)

    @functools.cached_property
    def whole(self) -> bool:
        """One block, the parameter itself (no reshape, no cut)."""
        return len(self.slices) == 1 and self.view_shape == self.shape

    @functools.cached_property
    def row_blocks(self) -> bool:
        """Every block is whole rows of the row view (experts, not cut across the other
        dimensions): of a contiguous parameter, its blocks are contiguous views of it, which a
        kernel may update where they are."""
        return self.experts and all(s.start == 0 and s.stop == n for sl in self.slices
                                    for s, n in zip(sl[1:], self.view_shape[1:]))

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


@dataclasses.dataclass(frozen=True)
class Experts:
    """The experts of a parameter's rows: every ``rows`` consecutive rows of the row view (the
    leading dimension, with an (E, d_in, ...) parameter's first two dimensions folded into
    one) are one expert; the tensor cut starts ``row_offset`` rows into the full parameter's row
    view (a shard's first row; 0 for a whole parameter). ``fold``: the tensor's first two
    dimensions are folded into the rows ((E, d_in, d_out) -> (E * d_in, d_out))."""

    rows: int
    row_offset: int = 0
    fold: bool = False


def experts_of(shape: Sequence[int], num_experts: int, local_rows: Optional[tuple] = None
               ) -> Experts:
    """The expert rows of a parameter of the full ``shape`` holding ``num_experts`` experts;
    ``local_rows``: the [lo, hi) range of its dim 0 that a shard holds (FSDP2's Shard(0)), for
    that shard's layout. ValueError when dim 0 does not hold num_experts experts."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or shape[0] % num_experts:
        raise ValueError(f"num_experts={num_experts}: a parameter of shape {shape} does not "
                         f"hold {num_experts} experts; allowed: a parameter of at least 2 "
                         f"dimensions whose first dimension is num_experts (E, d_in, ...) or a "
                         f"multiple of it (E * d_in, ...)")
    fold = shape[0] == num_experts and len(shape) >= 3
    rows = shape[1] if fold else shape[0] // num_experts
    lo = 0 if local_rows is None else int(local_rows[0])
    return Experts(rows=rows, row_offset=lo * shape[1] if fold else lo, fold=fold)


def layout_key(method, group: dict) -> tuple:
    """(block_size, merge_dims, max_dim, num_experts): what a parameter of ``group`` is cut
    with, the method's rules applied (``make_layout``'s arguments; a global plan's key)."""
    return (group["block_size"], method.merge_dims(group), method.max_dim(group),
            group.get("num_experts"))


def make_layout(shape: Sequence[int], block_size: Optional[int] = None,
                merge_dims: bool = False, max_precond_dim: int = 10000,
                experts: Optional[Experts] = None) -> Layout:
    shape = tuple(int(s) for s in shape)
    base = shape
    if experts is not None and experts.fold:
        base = (shape[0] * shape[1],) + shape[2:]
    if experts is None:
        view_shape = (merge_shape(shape, max_precond_dim) if merge_dims and len(shape) > 1
                      else shape)
    else:  # merged within an expert: its rows stay the leading factor of the first dimension
        one = (experts.rows,) + base[1:]
        merged = merge_shape(one, max_precond_dim) if merge_dims and len(one) > 1 else one
        scale = merged[0] // experts.rows
        view_shape = (base[0] * scale,) + tuple(merged[1:])
        cuts = _expert_cuts(base[0], experts.rows, experts.row_offset)
    per_dim = []
    for d, size in enumerate(view_shape):
        step = size if block_size is None else block_size
        if d == 0 and experts is not None:  # each expert's rows blocked on their own
            per_dim.append([slice(a * scale + i, a * scale + min(i + step, (b - a) * scale))
                            for a, b in cuts
                            for i in range(0, (b - a) * scale, max(step, 1))] or [slice(0, 0)])
            continue
        per_dim.append([slice(a, min(a + step, size)) for a in range(0, size, max(step, 1))]
                       or [slice(0, 0)])
    slices = tuple(tuple(c) for c in itertools.product(*per_dim))
    return Layout(shape=shape, view_shape=view_shape, slices=slices,
                  experts=experts is not None)


def _expert_cuts(n: int, rows: int, offset: int) -> list:
    """[(a, b)] row ranges of a tensor of n rows starting ``offset`` rows into the full row
    view, cut where an expert (``rows`` rows) ends."""
    out, a = [], 0
    while a < n:
        b = min(n, a + rows - (offset + a) % rows)
        out.append((a, b))
        a = b
    return out
