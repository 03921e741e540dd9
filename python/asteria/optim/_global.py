"""Global blocking of FSDP2 parameters (runtime ``fsdp_blocking="global"``, docs/distributed.md).

Owns: for every FSDP2 parameter (a DTensor sharded along dim 0 over a 1-D mesh) the blocks of
the *full* parameter, cut exactly as a single process cuts it (``make_layout`` of the full
shape), the owner rank of each block (the coherence registry's LPT rule over the blocks'
costs, the same on every rank), the rows each rank holds of each block, and the two exchanges
of a step on the mesh's process group (FSDP2's own):

 - ``gather``: every rank sends the gradient rows and weight rows of each block to the block's
   owner (one ``all_to_all_single`` per process group and dtype), which assembles the owned
   blocks whole;
 - ``scatter``: after the method's kernel ran on the owned blocks, the owner sends the new
   weight rows back to the ranks holding them (one ``all_to_all_single``).

A rank keeps the state of the blocks it owns only: the optimizer sees an ``OwnedLayout`` (the
owned blocks, numbered 0..k-1 in global order), and ``KeyMap`` renames state keys between that
numbering (``b{k}.``) and the global one (``b{j}.``) that ``optimizer.state`` shows and
``state_dict()`` saves, so that a checkpoint names every block the same way whatever the world
size, and resumes on another one. Also: the agreements that must be global in this mode
(non-finite gradients, DCP's fake-step state, the refresh in flight saved in a state dict), one
small ``all_reduce`` each, only when they can matter.

May call: torch, torch.distributed (the parameters' mesh groups), asteria._C (the coherence
registry, for owners only), ``_blocking``. Single-threaded (the training thread).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from typing import Optional

import torch

from asteria.optim import _layout
from asteria.optim._blocking import Layout, experts_of, layout_key, make_layout
from asteria.optim._state import local


def _dtensor():
    return sys.modules.get("torch.distributed.tensor")


def sharded_dim0(p) -> bool:
    """Is p a DTensor sharded over more than one rank (FSDP2)?"""
    mod = _dtensor()
    if mod is None or not isinstance(p, mod.DTensor):
        return False
    return any(isinstance(pl, mod.Shard) for pl in p.placements) and p.device_mesh.size() > 1


@dataclasses.dataclass(frozen=True)
class OwnedLayout:
    """The blocks of a parameter's full layout that this rank owns, in global order: the
    optimizer's block k is the full layout's block ``ids[k]``."""

    full: Layout
    ids: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.full.shape

    @property
    def view_shape(self) -> tuple[int, ...]:
        return self.full.view_shape

    @property
    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        shapes = self.full.block_shapes
        return tuple(shapes[j] for j in self.ids)


class KeyMap:
    """State key names of a globally blocked parameter: ``b{k}.`` (the optimizer's, owned block
    k) <-> ``b{j}.`` (global block j, as ``optimizer.state`` and ``state_dict()`` show them)."""

    def __init__(self, ids: tuple[int, ...]):
        self.ids = ids
        self._k = {j: k for k, j in enumerate(ids)}

    def external(self, key):
        return _layout.renumber(key, self.ids.__getitem__)

    def internal(self, key):
        """The optimizer's name, or None for a block another rank owns."""
        return _layout.renumber(key, self._k.get)

    def export(self, st: dict) -> dict:
        return {self.external(k): v for k, v in st.items()}

    def internal_state(self, st: dict, who: str) -> dict:
        """A loaded state under the optimizer's names: the blocks of other owners dropped (a
        checkpoint of another world size holds them), a per-shard key (a checkpoint of
        ``fsdp_blocking="local"``) a ValueError."""
        out = {}
        for key, v in st.items():
            if _layout.split_tag(key)[1] is not None:
                raise ValueError(
                    f"optimizer state key {key!r} of {who} is a shard's (saved with "
                    f"fsdp_blocking='local'); this optimizer blocks globally "
                    f"(fsdp_blocking='global'): resume with the blocking it was saved with")
            name = self.internal(key)
            if name is not None:
                out[name] = v
        return out


class ShardedState:
    """State names of an FSDP2 parameter on the elementwise (AdamW) path in global mode: kept
    per rank as its shard's rows, shown under plain names, saved as DTensors of the
    parameter's sharding, so that DCP reshards them on load (another world size)."""

    def __init__(self, p):
        self._p = p

    @staticmethod
    def external(key):
        return key

    @staticmethod
    def internal(key):
        return key

    def export(self, st: dict) -> dict:
        mod = _dtensor()
        p = self._p
        lp = local(p)
        return {k: (mod.DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(lp.shape)
                    and v.dim() > 0 else v)
                for k, v in st.items()}

    def internal_state(self, st: dict, who: str) -> dict:
        """Loaded values as this rank's rows: a DTensor's local shard (DCP loads into the
        live sharding), or this rank's rows of a full tensor (a single process' state)."""
        mod = _dtensor()
        p = self._p
        out = {}
        for k, v in st.items():
            if isinstance(v, mod.DTensor):
                v = v.redistribute(p.device_mesh, p.placements).to_local()
            elif (isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape)
                  and tuple(p.shape) != tuple(local(p).shape)):
                m, size = p.shape[0], p.device_mesh.size()
                chunk = -(-m // size)
                me = p.device_mesh.get_local_rank()
                v = v[min(me * chunk, m):min((me + 1) * chunk, m)]
            out[k] = v
        return out


@dataclasses.dataclass
class _Plan:
    """One globally blocked parameter as this rank sees it."""

    p: torch.Tensor
    pidx: int
    group: object                 # the process group of its mesh
    size: int                     # ranks in that group
    me: int                       # this rank's index in it
    full: Layout
    owners: tuple[int, ...]       # per global block: its owner's index in the group
    rows: tuple[tuple[int, int], ...]  # per rank: its rows [lo, hi) of the full view
    mine: tuple[int, ...]         # the global blocks this rank owns, ascending
    hparams: tuple                # (block_size, merge_dims, max_dim, num_experts) of the layout

    def overlap(self, r: int, j: int) -> Optional[tuple[int, int]]:
        """Rows [r0, r1) of the full view that rank r holds of block j, or None."""
        sl = self.full.slices[j][0]
        lo, hi = self.rows[r]
        r0, r1 = max(sl.start, lo), min(sl.stop, hi)
        return (r0, r1) if r1 > r0 else None

    def rest(self, j: int) -> int:
        """Elements per row of block j."""
        n = 1
        for s in self.full.slices[j][1:]:
            n *= s.stop - s.start
        return n

    @property
    def local_shape(self) -> tuple[int, ...]:
        lo, hi = self.rows[self.me]
        return (hi - lo,) + self.full.view_shape[1:]

    def local_view(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(self.local_shape)

    def local_piece(self, view: torch.Tensor, j: int, r0: int, r1: int) -> torch.Tensor:
        lo = self.rows[self.me][0]
        return view[(slice(r0 - lo, r1 - lo),) + self.full.slices[j][1:]]


def _full_layout(shape, block_size, merge_dims: bool, max_dim: int,
                 num_experts: Optional[int]) -> Layout:
    """The layout of the full parameter, cut as one process cuts it."""
    experts = experts_of(shape, num_experts) if num_experts is not None else None
    return make_layout(shape, block_size, merge_dims, max_dim, experts=experts)


def _check_placement(p, pidx: int) -> None:
    mod = _dtensor()
    mesh = p.device_mesh
    if mesh.ndim != 1 or tuple(p.placements) != (mod.Shard(0),):
        raise ValueError(
            f"runtime fsdp_blocking='global' takes FSDP2 parameters sharded along dim 0 over a "
            f"1-D mesh; parameter {pidx} has placements {tuple(p.placements)} on a "
            f"{mesh.ndim}-D mesh (HSDP and other shardings: use fsdp_blocking='local')")


def _block_cost(shape: tuple, has_factor: list) -> int:
    from asteria import _C

    n = 1
    for s in shape:
        n *= s
    return n + sum(_C.coherence_dim_cost(d) for d, h in zip(shape, has_factor) if h)


class LocalBlocking:
    """``fsdp_blocking="local"`` (the default): every parameter is blocked as its local tensor.
    The null object of ``GlobalBlocking`` (as Distributed Shampoo's default distributor is of
    its distributed ones), so the optimizer asks one object either way: it takes no parameter,
    so nothing is agreed across ranks and nothing is exchanged."""

    def takes(self, p) -> bool:
        return False

    def has(self, p) -> bool:
        return False

    def agrees(self, p) -> bool:
        return False

    def agree(self, params: list, flags: list) -> list:
        return flags

    def sync_pending(self, state: dict, index: dict, keys: tuple) -> None:
        pass

    def stats(self) -> dict:
        return {}


class GlobalBlocking:
    """The global blocks of an optimizer's FSDP2 parameters and their exchanges."""

    def __init__(self):
        self._plans: dict = {}        # param -> _Plan
        self._elementwise: dict = {}  # param on the AdamW path -> its process group
        self._registries: dict = {}   # process group -> (coherence registry, next block id)
        self._exchange: Optional[list] = None  # the buckets of the step's gather
        self._stats = {"fsdp_global_bytes_sent": 0, "fsdp_global_exchanges": 0,
                       "fsdp_global_blocks_owned": 0, "fsdp_global_blocks": 0}

    def takes(self, p) -> bool:
        """Is p blocked globally once added (an FSDP2 parameter sharded along dim 0)?"""
        return sharded_dim0(p)

    def has(self, p) -> bool:
        """Is p blocked globally (preconditioned)?"""
        return p in self._plans

    def add_elementwise(self, p, pidx: int) -> ShardedState:
        """An FSDP2 parameter on the AdamW path: state per rank, saved reshardable."""
        _check_placement(p, pidx)
        self._elementwise[p] = p.device_mesh.get_group()
        return ShardedState(p)

    def agrees(self, p) -> bool:
        """Must decisions about p's state be taken by all its ranks together?"""
        return p in self._plans or p in self._elementwise

    def _group(self, p):
        plan = self._plans.get(p)
        return plan.group if plan is not None else self._elementwise[p]

    def add(self, method, p, pidx: int, group: dict) -> KeyMap:
        """Plan p (a DTensor parameter sharded along dim 0 over a 1-D mesh): its full layout,
        its rows per rank, its owners. Deterministic: every rank computes the same plans."""
        _check_placement(p, pidx)
        mesh = p.device_mesh
        hparams = layout_key(method, group)
        full = _full_layout(p.shape, *hparams)
        size, me = mesh.size(), mesh.get_local_rank()
        m = p.shape[0]
        chunk = -(-m // size) if m else 0  # torch.chunk's rows, as DTensor's Shard(0) cuts
        per_row = full.view_shape[0] // m if m else 1  # merge_dims folds dims 1.. into rows
        rows = tuple((min(r * chunk, m) * per_row, min((r + 1) * chunk, m) * per_row)
                     for r in range(size))
        lo, hi = rows[me]
        per_view_row = 1
        for s in full.view_shape[1:]:
            per_view_row *= s
        if local(p).numel() != (hi - lo) * per_view_row:
            raise ValueError(f"parameter {pidx}: unexpected local shard shape "
                             f"{tuple(local(p).shape)}")
        pg = mesh.get_group()
        reg = self._registries.get(pg)
        if reg is None:
            from asteria import _C

            reg = self._registries[pg] = [_C.Coherence(size, me, ranks_per_node=1,
                                                       node_ids=[0] * size, staleness=0), 1]
        ids = list(range(reg[1], reg[1] + len(full.slices)))
        reg[1] += len(ids)
        costs = [_block_cost(s, method.has_factor(s, group)) for s in full.block_shapes]
        if ids:
            reg[0].extend(ids, costs, replicas=list(range(size)))
        owners = tuple(int(reg[0].owner(b)) for b in ids)
        mine = tuple(j for j, o in enumerate(owners) if o == me)
        self._plans[p] = _Plan(p, pidx, pg, size, me, full, owners, rows, mine, hparams)
        self._stats["fsdp_global_blocks_owned"] += len(mine)
        self._stats["fsdp_global_blocks"] += len(ids)
        return KeyMap(mine)

    def layout(self, p, block_size, merge_dims: bool, max_dim: int,
               num_experts: Optional[int] = None):
        """The optimizer's layout of p: the owned blocks when cut as planned, else the full
        layout of these hyperparameters (a state saved with other ones does not fit)."""
        plan = self._plans[p]
        hparams = (block_size, merge_dims, max_dim, num_experts)
        if hparams == plan.hparams:
            return OwnedLayout(plan.full, plan.mine)
        return _full_layout(p.shape, *hparams)

    # ---- agreements --------------------------------------------------------------------------
    def _min_over_ranks(self, params: list, flags: list) -> list:
        """flags (one bool per parameter of this module) AND-ed over the ranks of each
        parameter's group: one all_reduce(MIN) per group."""
        import torch.distributed as dist

        by_group: dict = defaultdict(list)
        for i, p in enumerate(params):
            by_group[self._group(p)].append(i)
        out = list(flags)
        for pg, idx in by_group.items():
            t = torch.tensor([1 if flags[i] else 0 for i in idx], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pg)
            for i, v in zip(idx, t.tolist()):
                out[i] = bool(v)
        return out

    def agree(self, params: list, flags: list) -> list:
        """flags of params, those of global parameters AND-ed over their ranks (parameters in
        the order every rank has them)."""
        idx = [i for i, p in enumerate(params) if self.agrees(p)]
        if not idx:
            return flags
        got = self._min_over_ranks([params[i] for i in idx], [flags[i] for i in idx])
        out = list(flags)
        for i, v in zip(idx, got):
            out[i] = v
        return out

    def sync_pending(self, state: dict, index: dict, keys: tuple) -> None:
        """A state dict's refresh in flight (``keys``: install_in, age) as every owner of a
        block of the parameter has it: non-owners know nothing of the round, and DCP keeps
        one rank's copy of a value that all save under one name. all_reduce(MAX)."""
        import torch.distributed as dist

        by_group: dict = defaultdict(list)
        for p in sorted(self._plans, key=lambda q: self._plans[q].pidx):
            st = state.get(index.get(p))
            if isinstance(st, dict) and keys[0] in st:
                by_group[self._plans[p].group].append(st)
        for pg, sts in by_group.items():
            t = torch.tensor([[int(st[k]) for k in keys] for st in sts], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            for st, row in zip(sts, t.tolist()):
                for k, v in zip(keys, row):
                    st[k] = v

    # ---- the exchanges of a step -------------------------------------------------------------
    def _buckets(self, params: list) -> dict:
        out: dict = defaultdict(list)
        for p in sorted(params, key=lambda q: self._plans[q].pidx):
            plan = self._plans[p]
            out[(plan.group, p.dtype)].append(plan)
        return out

    def gather(self, params: list) -> tuple[dict, dict]:
        """The owned blocks of params' gradients and weights, whole: ({p: [gradient block k]},
        {p: [weight block k]}), fresh contiguous tensors. Collective over each group."""
        import torch.distributed as dist

        grads: dict = {}
        weights: dict = {}
        self._exchange = []
        for (pg, dtype), plans in self._buckets(params).items():
            size, me = plans[0].size, plans[0].me
            send: list = [[] for _ in range(size)]
            for plan in plans:
                gv = plan.local_view(local(plan.p.grad).to(dtype))
                wv = plan.local_view(local(plan.p).detach())
                for j, o in enumerate(plan.owners):
                    ov = plan.overlap(me, j)
                    if ov is not None:
                        send[o].append(plan.local_piece(gv, j, *ov).reshape(-1))
                        send[o].append(plan.local_piece(wv, j, *ov).reshape(-1))
            in_sizes = [sum(t.numel() for t in s) for s in send]
            out_sizes = [0] * size
            for plan in plans:
                for j in plan.mine:
                    for r in range(size):
                        ov = plan.overlap(r, j)
                        if ov is not None:
                            out_sizes[r] += 2 * (ov[1] - ov[0]) * plan.rest(j)
            flat = [t for s in send for t in s]
            buf_in = torch.cat(flat) if flat else torch.empty(0, dtype=dtype)
            buf_out = torch.empty(sum(out_sizes), dtype=dtype)
            dist.all_to_all_single(buf_out, buf_in, out_sizes, in_sizes, group=pg)
            self._count(in_sizes, me, dtype)
            shapes = {plan.p: plan.full.block_shapes for plan in plans}
            for plan in plans:
                grads[plan.p] = [torch.empty(shapes[plan.p][j], dtype=dtype) for j in plan.mine]
                weights[plan.p] = [torch.empty(shapes[plan.p][j], dtype=dtype)
                                   for j in plan.mine]
            off = 0
            for r in range(size):
                for plan in plans:
                    for k, j in enumerate(plan.mine):
                        ov = plan.overlap(r, j)
                        if ov is None:
                            continue
                        a = plan.full.slices[j][0].start
                        shape = (ov[1] - ov[0],) + shapes[plan.p][j][1:]
                        n = (ov[1] - ov[0]) * plan.rest(j)
                        grads[plan.p][k][ov[0] - a:ov[1] - a].copy_(
                            buf_out[off:off + n].view(shape))
                        weights[plan.p][k][ov[0] - a:ov[1] - a].copy_(
                            buf_out[off + n:off + 2 * n].view(shape))
                        off += 2 * n
            self._exchange.append((pg, dtype, plans, weights))
        return grads, weights

    def scatter(self) -> None:
        """Send the owned blocks' new weight rows back to the ranks holding them and write the
        rows this rank holds into its shards. Collective over each group (after ``gather``)."""
        import torch.distributed as dist

        for pg, dtype, plans, weights in self._exchange or ():
            size, me = plans[0].size, plans[0].me
            send: list = [[] for _ in range(size)]
            for r in range(size):
                for plan in plans:
                    for k, j in enumerate(plan.mine):
                        ov = plan.overlap(r, j)
                        if ov is not None:
                            a = plan.full.slices[j][0].start
                            send[r].append(weights[plan.p][k][ov[0] - a:ov[1] - a].reshape(-1))
            in_sizes = [sum(t.numel() for t in s) for s in send]
            out_sizes = [0] * size
            for plan in plans:
                for j, o in enumerate(plan.owners):
                    ov = plan.overlap(me, j)
                    if ov is not None:
                        out_sizes[o] += (ov[1] - ov[0]) * plan.rest(j)
            flat = [t for s in send for t in s]
            buf_in = torch.cat(flat) if flat else torch.empty(0, dtype=dtype)
            buf_out = torch.empty(sum(out_sizes), dtype=dtype)
            dist.all_to_all_single(buf_out, buf_in, out_sizes, in_sizes, group=pg)
            self._count(in_sizes, me, dtype)
            views = {}
            for plan in plans:
                target = local(plan.p)
                try:
                    views[plan.p] = (target, target.view(plan.local_shape), False)
                except RuntimeError:  # a shard torch cannot view: written through a copy
                    views[plan.p] = (target, target.reshape(plan.local_shape).clone(), True)
            off = 0
            for o in range(size):
                for plan in plans:
                    view = views[plan.p][1]
                    for j, owner in enumerate(plan.owners):
                        ov = plan.overlap(me, j) if owner == o else None
                        if ov is None:
                            continue
                        piece = plan.local_piece(view, j, *ov)
                        n = piece.numel()
                        piece.copy_(buf_out[off:off + n].view(piece.shape))
                        off += n
            for target, view, copied in views.values():
                if copied:
                    target.copy_(view.reshape(target.shape))
        self._exchange = None

    def _count(self, sizes: list, me: int, dtype) -> None:
        item = torch.empty((), dtype=dtype).element_size()
        self._stats["fsdp_global_bytes_sent"] += item * sum(
            n for r, n in enumerate(sizes) if r != me)
        self._stats["fsdp_global_exchanges"] += 1

    def stats(self) -> dict:
        return dict(self._stats)
