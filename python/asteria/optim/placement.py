"""Where an Asteria optimizer's state lives (``opt.placement``): the placement plan, the Residency
of roots and eigenbases outside the device with its staging through the ring, and a method's
view of its blocks (``BlockAccess``), through which the kernels see exactly the tensors of the
all-device path.

Owns: the plan, the residency, the map from a parameter to its tiered keys, the staging of
stacks through the ring in chunks that fit it, and the packing of its device state
(``packing``: a ``packing.Packing``, which nothing else calls). The Residency is its own: the
others use the calls it offers. A method: ``BlockAccess`` (declared below, the only calls
soap.py, one_sided_soap.py, shampoo.py, kl_shampoo.py and method.py make on it; checked by
tests/python/test_composition.py); the schedule: ``owned``, ``on_nvme``, ``is_state``; the
state proxy: ``off_device``, ``owned``, ``held`` / ``held_names`` / ``read`` / ``write`` /
``drop``; the checkpoint part: ``export_tiered`` / ``clear_tiered`` / ``restore_tiered`` /
``end_step``; the optimizer: the plan's and the step's calls (docs/architecture.md's table of
the parts lists them all). Built with what it uses (``Placement(run, method, writes)``). May
call: torch, ``asteria.tiers.plan`` (the planner), ``asteria.tiers.residency``, ``packing``, the
run record (config, parameter index, layouts, the state), the method's ``state_spec``, the
``BackgroundJobs`` (settled before packs move or blocks migrate); ``_layout`` (key names). Single-threaded (the
training thread and the hooks it runs on that thread).

Tiers (``asteria.tiers.plan``, ``asteria.tiers.residency``): at construction the planner assigns
a tier to every piece of state. Factors and moments always live in ``self.state`` on the
parameter's device. In ``mode="async"`` roots / eigenbases normally live in a ``Residency``
(host, pinned, UVM or NVMe blocks) instead of ``self.state``; every access goes through
``BlockAccess`` (``stack`` / ``unstack`` / ``root_*``) so the kernels see exactly the tensors
they would see with everything on the device (the same values, stacked the same way: results
are bitwise those of the all-device path). A step with a residency runs in two phases:
``prepare`` (NVMe reads and writes, ring prefetches) before anything is mutated, so an I/O
failure raises with the parameters, the state and the step counter untouched; then the usual
step, streaming preconditioned stacks through the staging ring in chunks that fit it.

Reduced-precision tiers (``tier_dtype="bfloat16"``): the residency keeps the blocks narrowed;
``stack`` widens the borrowed ones as it stacks them, so the kernels see the stored value,
rounded, in the state's dtype. Quantized tiers (``"int8"``, ``"int4"``): the residency keeps
eigenbases block-quantized and ``borrow`` hands them out widened and rectified on the step's
device. A value used before it is stored (SOAP's new basis, which m is re-expressed in at
install) is made what the step will see first (``as_stored``, on the device that uses it): the
step always uses the basis the state holds. Checkpoints and the state proxy see a quantized
basis as stored (dequantized, not rectified), which a load stores again byte for byte.

Packed state (``packing``): the step's read of the device state it updates in place
(``stack(view=True)``, a method's ``step_blocks`` only) is, where every member's tensor lives
on the device, the packed buffer the members' entries are slices of: no copy in, nothing to
write back. Residency-owned blocks are always copied (borrowed from the ring) and ``unstack``
writes them back; everything else that takes a stack (installs, jobs, ``out=``) gets a copy.
Values are those of the copying path, bit for bit.
"""

from __future__ import annotations

import warnings
import weakref
from collections import defaultdict
from typing import Iterable, Optional, Protocol, Sequence

import torch

from asteria.tiers import plan as planner
from asteria.tiers.residency import Residency
from asteria.optim import _layout as K
from asteria.optim import packing
from asteria.optim._state import _ParamState, local, real


class BlockAccess(Protocol):
    """A method's view of its blocks (``Method.placement``): all a method may call on the
    placement. ``members``: [(param, j)], the blocks of a stack of same-shape blocks, in order;
    ``field`` and ``dim`` name each member's entry ``b{j}.{field}`` (``b{j}.{field}{dim}`` for a
    per-dimension field); ``name``: a full key. Wherever a block lives, what these give and
    take are the all-device path's tensors."""

    def stack(self, members: list, field: str, dim: Optional[int] = None,
              out: Optional[torch.Tensor] = None, view: bool = False) -> torch.Tensor:
        """The members' entries stacked: a copy (into ``out`` when given), which the caller may
        keep, donate to a job or write freely. ``view=True`` (``step_blocks``' reads of the
        state it updates in place): the stack may be the state itself (the packed buffer of
        the device-resident entries): it is handed back with ``unstack``."""

    def stack_dims(self, members: list, field: str, has: Sequence[bool],
                   view: bool = False) -> list:
        """``stack`` of a per-dimension field for each dimension i where ``has[i]`` (else None)."""

    def unstack(self, members: list, field: str, x: torch.Tensor,
                dim: Optional[int] = None) -> None:
        """Write a stack back into the members' entries (nothing to write for the state
        itself, a packed stack from ``stack(view=True)``)."""

    def unstack_dims(self, members: list, field: str, stacks: Sequence) -> None:
        """``unstack`` of each per-dimension stack ``stack_dims`` gave (None: no factor there)."""

    def root_has(self, p: torch.Tensor, name: str) -> bool:
        """Does p hold the root / eigenbasis ``name`` (set once, by ``root_set``)?"""

    def root_set(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Set a root / eigenbasis (creating it on first set)."""

    def root_for_job(self, p: torch.Tensor, name: str):
        """A root / eigenbasis as a REFRESH job input (the engine copies it at submit): a
        tensor, or a ``residency.OnNvme`` read when the job's stack is made."""

    def as_stored(self, p: torch.Tensor, name: str, value: torch.Tensor,
                  device: Optional[torch.device] = None) -> torch.Tensor:
        """``value`` on ``device`` (default: value's) as the block ``name`` of p will hold it
        once written and a step on that device will use it: rounded through the tier dtype
        when the block lives outside the device narrowed, quantized, widened and rectified
        when it lives there quantized (else value itself). Write ``value``, not this, to the
        block: a quantized tier quantizes what it is given."""

    def chunks(self, members: list) -> list:
        """Split a stack's members so that each chunk's staged blocks fit the ring."""


def close_all(engine, close_residency) -> None:
    """Finalizer of an optimizer (also at interpreter exit): the engine first (it writes the
    trace file and stops the workers), then the residency (``Placement.closer``)."""
    try:
        if engine is not None:
            engine.close()
    finally:
        if close_residency is not None:
            close_residency()


class Placement:
    """The placement part of an ``AsteriaOptimizer`` (``opt.placement``), a method's
    ``BlockAccess``."""

    def __init__(self, run, method, writes) -> None:
        self.run = run
        self.method = method
        self.writes = writes  # settled before blocks migrate
        self.plan = None     # the placement plan (asteria.tiers.plan)
        self._residency = None   # the Residency of the blocks outside the device, if any
        self._final_stats: Optional[dict] = None  # its last stats, once closed
        self.tkeys: dict = {}  # param index -> its tiered state keys
        self.kinds: dict = {}  # (param index, name) -> the kind of state it is
        self.packing = packing.Packing(run, writes)  # the packs of the device state

    # ---- a method's view of its blocks (BlockAccess) ----------------------------------------
    def stack(self, members: list, field: str, dim: Optional[int] = None,
              out: Optional[torch.Tensor] = None, view: bool = False) -> torch.Tensor:
        """``BlockAccess.stack``. ``view=True`` where no member is owned by the residency: the
        packed buffer (``packing``). Residency-owned blocks are borrowed from the ring and
        copied, widened as they are stacked when they are stored narrowed."""
        if out is None and view and packing.PACK and not self._any_owned(members, field, dim):
            return self.packing.packed(members, field, dim)
        if self._residency is not None:
            keys = [(self.run.pindex[p], K.key(j, field, dim)) for p, j in members]
            owned = [self._residency.owns(k) for k in keys]
            if any(owned):
                mine = [k for k, o in zip(keys, owned) if o]
                staged = iter(self._residency.borrow(mine))
                try:
                    parts = [next(staged) if o else self.run.state[p][K.key(j, field, dim)]
                             for (p, j), o in zip(members, owned)]
                    wide = self._residency.dtype_of(mine[0])
                    if out is None and any(x.dtype != wide for x in parts):
                        # narrowed blocks: widened as they are stacked (one pass)
                        out = torch.empty((len(parts),) + tuple(parts[0].shape), dtype=wide,
                                          device=parts[0].device)
                    return torch.stack(parts, out=out)
                finally:
                    self._residency.give_back(mine)
        return torch.stack([self.run.state[p][K.key(j, field, dim)] for p, j in members], out=out)

    def stack_dims(self, members: list, field: str, has: Sequence[bool],
                   view: bool = False) -> list:
        return [self.stack(members, field, i, view=view) if h else None
                for i, h in enumerate(has)]

    def unstack(self, members: list, field: str, x: torch.Tensor,
                dim: Optional[int] = None) -> None:
        """``BlockAccess.unstack``: a stack handed out packed for these very members needs no
        look at them at all, and a member whose tensor is already its slice of x no copy."""
        if self.packing.take_back(x, members, field, dim):
            return
        for (p, j), xi in zip(members, x.unbind(0)):
            name = K.key(j, field, dim)
            if self.owned(p, name):
                self._residency.write(self._key(p, name), xi)
            else:
                t = self.run.state[p][name]
                if not packing.same_memory(t, xi):
                    t.copy_(xi)

    def unstack_dims(self, members: list, field: str, stacks: Sequence) -> None:
        for i, x in enumerate(stacks):
            if x is not None:
                self.unstack(members, field, x, dim=i)

    def root_has(self, p: torch.Tensor, name: str) -> bool:
        if self.owned(p, name):
            return self._residency.has(self._key(p, name))
        return name in self.run.state[p]

    def root_set(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        if self.owned(p, name):
            self._residency.write(self._key(p, name), value)
            return
        st = self.run.state[p]
        if name in st:
            st[name].copy_(value)
        else:
            st[name] = value.to(device=local(p).device, copy=True)

    def root_for_job(self, p: torch.Tensor, name: str):
        if self.owned(p, name):
            return self._residency.job_input(self._key(p, name))
        return self.run.state[p][name]

    def as_stored(self, p: torch.Tensor, name: str, value: torch.Tensor,
                  device: Optional[torch.device] = None) -> torch.Tensor:
        device = value.device if device is None else device
        if not self.owned(p, name):
            return value.to(device)
        return self._residency.as_stored(self._key(p, name), value, device)

    def chunks(self, members: list) -> list:
        """``BlockAccess.chunks`` (the optimizer's step too): one chunk without a residency."""
        if self._residency is None or not members:
            return [members]
        cap = self.plan.ring_bytes
        if cap >= 2 * self.plan.ring_min:
            cap //= 2  # two chunks fit: the next one is copied in while this one is used
        chunks, cur, used = [], [], 0
        for m in members:
            cost = self._residency.chunk_cost(self._member_keys(*m))
            if cur and used + cost > cap:
                chunks.append(cur)
                cur, used = [], 0
            cur.append(m)
            used += cost
        chunks.append(cur)
        return chunks

    # ---- the schedule -----------------------------------------------------------------------
    def owned(self, p: torch.Tensor, name: str) -> bool:
        """Does the residency own p's block ``name`` (the plan puts it outside the device)?"""
        return self._residency is not None and self._residency.owns((self.run.pindex[p], name))

    def on_nvme(self, members: list) -> bool:
        """Are some of these members' [(param, j)] blocks NVMe-homed?"""
        return self._residency is not None and any(
            self._residency.plan.tier(k) == "nvme" for p, j in members
            for k in self._member_keys(p, j))

    def is_state(self, members: list, field: str, dim: Optional[int], x: torch.Tensor) -> bool:
        """Is the stack x the members' ``b{j}.{field}[{dim}]`` itself (a packed stack from
        ``stack(view=True)``: writing x writes the state)?"""
        return self.packing.is_state(members, field, dim, x)

    # ---- the tiered state as the state proxy and the checkpoint use it ----------------------
    @property
    def off_device(self) -> bool:
        """Does some state live outside the device (a residency holds it)?"""
        return self._residency is not None

    def held(self, p: torch.Tensor, name: str) -> bool:
        """Does the residency hold p's block ``name`` (a virtual entry of ``optimizer.state``)?"""
        return self._residency is not None and self._residency.has((self.run.pindex[p], name))

    def held_names(self, p: torch.Tensor) -> list:
        """The names of p's blocks the residency holds."""
        if self._residency is None:
            return []
        return [k[1] for k in self.tkeys.get(self.run.pindex[p], ()) if self._residency.has(k)]

    def read(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """A held block as a fresh tensor on p's device (never a live view)."""
        key = self._key(p, name)
        return self._residency.materialize([key])[key]

    def write(self, p: torch.Tensor, name: str, value: torch.Tensor) -> None:
        """Write an owned block (``owned``) into the residency."""
        self._residency.write(self._key(p, name), value)

    def drop(self, p: torch.Tensor, name: str) -> None:
        """Free a held block."""
        self._residency.drop(self._key(p, name))

    def export_tiered(self) -> dict:
        """{param: {name: tensor}} of every held block, as the all-device path has them (the
        checkpoint's form)."""
        params = self.run.by_index()
        out: dict = defaultdict(dict)
        if self._residency is not None:
            for (pidx, name), v in self._residency.materialize(self._residency.keys()).items():
                out[params[pidx]][name] = v
        return out

    def clear_tiered(self) -> None:
        """Drop every held block (a load replaces them)."""
        if self._residency is not None:
            self._residency.clear()

    def restore_tiered(self, p: torch.Tensor, st: dict) -> None:
        """Move the blocks of a loaded state ``st`` (a plain dict of p's state, changed in
        place) that the residency owns into it."""
        if self._residency is not None:
            for name in [n for n in dict.keys(st) if self.owned(p, n)]:
                self.write(p, name, dict.pop(st, name))

    def end_step(self) -> None:
        """After a step (or a load): NVMe-homed blocks go back to NVMe (best effort)."""
        if self._residency is not None:
            self._residency.end_step()

    # ---- the optimizer: the plan, the step, close, stats ------------------------------------
    def make_plan(self):
        """Plan the placement of every state tensor (construction, ``add_param_group``)."""
        planner.check_tier_dtype(self.run.cfg.tier_dtype,
                                 [f.name for f in self.method.STATE if f.kind == "roots"])
        entries = self._entries()
        self.kinds = {e.key: e.kind for e in entries}
        plan = planner.make_plan(self.run.cfg, entries)
        plan.log()
        return plan

    def apply(self, plan, tracer) -> bool:
        """Take a plan: the tiered keys per parameter, and a residency when the plan first
        puts blocks outside the device (True then: the optimizer's finalizer must close it).
        ``migrate`` moves existing tensors where the plan wants them."""
        self.plan = plan
        self.tkeys = defaultdict(list)
        for key, tier in plan.block_tier.items():
            if tier != "device":
                self.tkeys[key[0]].append(key)
        if plan.tiered and self._residency is None:
            # no strong reference back: the optimizer's finalizer holds the residency
            me = weakref.ref(self)

            def describe(key, _me=me):
                place = _me()
                return place.describe_key(key) if place is not None else f"block {key!r}"

            self._residency = Residency(plan, self.run.cfg, tracer=tracer, describe=describe)
            return True
        if self._residency is not None:
            self._residency.plan = plan
        return False

    def migrate(self) -> None:
        """Put every existing root / eigenbasis where the plan says: self.run.state or residency."""
        self.writes.settle_all()
        if self._residency is None:
            return
        params = {i: p for p, i in self.run.pindex.items()}
        for p, st in list(self.run.param_states()):
            pidx = self.run.pindex.get(p)
            for name in [n for n in dict.keys(st) if isinstance(dict.__getitem__(st, n),
                                                                 torch.Tensor)]:
                if self._residency.owns((pidx, name)):
                    self._residency.write((pidx, name), dict.pop(st, name))
        for key in self._residency.keys():
            if not self._residency.owns(key):
                p = params[key[0]]
                # as the step used it (a quantized basis rectified): it is used as it is now
                value = self._residency.materialize([key], rectified=True)[key]
                self._residency.drop(key)
                dict.__setitem__(self.run.state[p], key[1], value)
        self._residency.end_step()

    def closer(self):
        """What the optimizer's finalizer calls to close the residency (``close_all``); None
        while there is none. It holds the residency, not this placement."""
        return None if self._residency is None else self._residency.close

    def prepare(self, work: list, in_flight: list) -> None:
        """Phase A of a step with a residency: NVMe blocks read back (verified) and written out
        again, host blocks prefetched into the ring in the order the step uses them; then the
        blocks of ``in_flight`` (the parameters of the refreshes in flight, which an install
        at this step's end writes)."""
        order: list = []
        seen: set = set()
        state = self.run.state
        for group, params in work:
            for p in params:
                if state[p]:
                    pidx = self.run.pindex[p]
                    if pidx not in seen:
                        seen.add(pidx)
                        order.append(pidx)
        nstep = len(order)
        for p in in_flight:
            pidx = self.run.pindex[p]
            if pidx not in seen:
                seen.add(pidx)
                order.append(pidx)
        keys = [k for pidx in order for k in self.tkeys.get(pidx, ())]
        self._residency.prepare(keys)
        # the step consumes the last parameters first (see _precond_step)
        self._residency.prefetch([k for pidx in reversed(order[:nstep])
                                  for k in self.tkeys.get(pidx, ())], reason="step")

    def stage(self, member_lists: list, reason: str) -> None:
        """Stage the blocks of these lists of members [(param, j)] into the ring, in order
        (as far as it has room)."""
        self._residency.prefetch([k for c in member_lists for m in c
                                  for k in self._member_keys(*m)], reason=reason)

    def handed_back(self) -> None:
        """The ``step_blocks`` that was handed packed stacks returned: they are the state's
        again, and an ``unstack`` of them writes as usual."""
        self.packing.handed_back()

    def prefetch(self, params: Iterable, reason: str = "") -> int:
        """Stage the roots / eigenbases of params into the ring (as far as it has room)."""
        if self.run.closed or self._residency is None:
            return 0
        return self._residency.prefetch(self._keys_of(params), reason=reason)

    def fetch_early(self, params: Iterable) -> None:
        """Read params' NVMe-resident blocks back into host memory (never raises)."""
        if not self.run.closed and self._residency is not None:
            self._residency.fetch_early(self._keys_of(params))

    def detier(self) -> Optional[dict]:
        """At close: the optimizer's state with the tiered roots / eigenbases as plain tensors
        on their parameters' devices, so the state stays inspectable (and checkpointable) after
        the residency is gone (None: nothing was tiered). A block that cannot be read back is
        left out, with a warning."""
        tiered = self._residency
        if tiered is None:
            return None
        params = {i: p for p, i in self.run.pindex.items()}
        values: dict = {}
        try:
            values = tiered.materialize(tiered.keys())
        except Exception as exc:
            warnings.warn(f"Asteria: close() could not read every tiered block back ({exc}); "
                          "they are left out of optimizer.state", RuntimeWarning, stacklevel=3)
            for key in tiered.keys():
                try:
                    values.update(tiered.materialize([key]))
                except Exception:
                    pass
        self._final_stats = tiered.stats_final()
        self._residency = None
        plain: defaultdict = defaultdict(dict)
        for p, st in self.run.state.items():
            plain[p] = st.raw() if isinstance(st, _ParamState) else st
        for (pidx, name), v in values.items():
            plain[params[pidx]][name] = v
        return plain

    def stats(self) -> Optional[dict]:
        """The residency's counters (bytes per tier, copies, NVMe traffic; its last ones once
        closed), or None: nothing was ever tiered."""
        if self._residency is not None:
            return self._residency.stats()
        return None if self._final_stats is None else dict(self._final_stats)

    def decisions(self) -> list[str]:
        """The planner's decisions, in plain words."""
        return list(self.plan.decisions) if self.plan is not None else []

    def memory_plan(self) -> dict:
        """The planner's memory figures, from construction on (nothing measured): bytes of
        optimizer state per tier in the steady state (``planned_bytes``) and at the planned
        peak (``peak_bytes``, ``peak_total``), the peak's parts by owner (``peak_parts``: the
        state, the snapshot ring, refresh results, rotated moments, the NVMe step cache, ...),
        the device staging ring (``ring_bytes``, included in device bytes) and the snapshot
        ring (``snapshot_ring_bytes``), ``tier_dtype``, and the bytes over PCIe
        (``transfer_bytes``: ``per_step`` staged into the ring, ``per_install`` one install of
        every block outside the device; CUDA parameters only). Blocks outside the device count
        in their stored form (narrowed, or quantized with its scales)."""
        plan = self.plan
        return {"mode": plan.mode, "tier_dtype": self.run.cfg.tier_dtype,
                "transfer_bytes": dict(plan.transfer_bytes),
                "planned_bytes": dict(plan.planned_bytes), "peak_bytes": dict(plan.peak_bytes),
                "peak_total": sum(plan.peak_bytes.values()), "peak_parts": dict(plan.peak_parts),
                "ring_bytes": plan.ring_bytes, "snapshot_ring_bytes": plan.snapshot_ring_bytes}

    # ---- its own ----------------------------------------------------------------------------
    def describe_key(self, key) -> str:
        """A block's key in words, for the residency's messages."""
        pidx, name = key
        kind = {"roots": "root", "eigenbases": "eigenbasis"}.get(self.kinds.get(key), "state")
        return f"{kind} block {name!r} of {self.run.describe(pidx)}"

    def _entries(self) -> list:
        """The planner's entry for every piece of state of every parameter."""
        out = []
        for group in self.run.param_groups:
            for p in group["params"]:
                lp = real(p)
                pidx = self.run.pindex[p]
                if lp.numel() == 0 or self.run.is_adamw(p, group):
                    spec = [(n, "moments", tuple(lp.shape), lp.dtype) for n in K.ADAMW_MOMENTS]
                else:
                    spec = self.method.state_spec(p, group, self.run.layout(p, group))
                for name, kind, shape, dtype in spec:
                    itemsize = torch.empty((), dtype=dtype).element_size()
                    out.append(planner.StateEntry(pidx, name, kind,
                                                  int(torch.Size(shape).numel()) * itemsize,
                                                  lp.device, dtype, shape=tuple(shape)))
        return out

    def _key(self, p: torch.Tensor, name: str) -> tuple:
        return (self.run.pindex[p], name)

    def _member_keys(self, p: torch.Tensor, j: int) -> list:
        return [k for k in self.tkeys.get(self.run.pindex[p], ()) if K.block_of(k[1]) == j]

    def _any_owned(self, members: list, field: str, dim: Optional[int]) -> bool:
        if self._residency is None:
            return False
        return any(self._residency.owns((self.run.pindex[p], K.key(j, field, dim)))
                   for p, j in members)

    def _keys_of(self, params: Iterable) -> list:
        if self._residency is None:
            return []
        return [k for p in params if p in self.run.pindex
                for k in self.tkeys.get(self.run.pindex[p], ()) if self._residency.has(k)]
