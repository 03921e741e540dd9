"""The state proxy of an Asteria optimizer: ``optimizer.state`` as torch.optim shows it.

Owns: how a parameter's state looks from outside (``_ParamState``: plain device tensors plus
"virtual" entries for roots / eigenbases that live in a Residency; keys tagged per shard for a
DTensor sharded over several ranks, headed by the marker ``_layout.LOCAL_ONLY``), which shard
a parameter's tag names (the spelling of keys and tags is ``_layout``'s), and the tensor the
optimizer works on for a parameter or gradient (``local``: a DTensor's shard; ``real``: a
complex tensor's real view, the one home of that mapping). Holds its optimizer weakly: the
state must never own the optimizer (with the cycle collector off, as OLMo-core trains, a cycle
would keep the optimizer, its workers and buffers alive). Every read or write of an entry
first settles what still changes it: an install deferred to the next use (``schedule``) and the
job that writes that key (``opt.background``, ``background.BackgroundJobs``); ``ensure_proxy``
says when ``optimizer.state`` needs the proxy. May call: torch, ``_layout``, the public parts of
the optimizer it belongs to (through a weak reference): ``run`` (shard tags), ``schedule``
(``deferred``, ``settle_deferred``), ``background`` (``settle``) and the placement's calls for
tiered state (``off_device``, ``owned``, ``held``, ``held_names``, ``read``, ``write``,
``drop``).
Single-threaded (the training thread).
"""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from typing import Any, Optional

import torch

from asteria.optim import _layout


def alive(ref, what: str):
    """The object behind the weak reference ``ref`` (the parts hold their optimizer weakly, so
    no cycle keeps it alive); RuntimeError naming ``what`` once it is gone."""
    obj = ref()
    if obj is None:
        raise RuntimeError(f"{what} is gone")
    return obj


def local(t):
    """The local shard of a DTensor (FSDP2's parameters and gradients: a view sharing its
    storage), else t itself. No DTensor exists unless torch.distributed.tensor was imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is not None and isinstance(t, mod.DTensor):
        return t.to_local()
    return t


def real(t):
    """A parameter's (or its gradient's) local tensor as the optimizer works on it: a complex
    one is its real view (``torch.view_as_real``: a trailing dimension of 2 holding the real
    and imaginary parts, sharing the storage), as torch.optim's optimizers take complex
    parameters; anything else is ``local(t)``. So a complex parameter's shape, dtype, blocks,
    state and checkpoint are those of a real parameter of shape ``p.shape + (2,)``. The one
    place that maps complex to real: every read of a parameter's or gradient's shape, dtype or
    data goes through it (complex DTensors are refused in ``add_param_group``)."""
    t = local(t)
    return torch.view_as_real(t) if t.is_complex() else t


def shard_rows(p) -> Optional[tuple[int, int]]:
    """The [lo, hi) range of dim 0 of the full parameter that a DTensor's local shard holds
    (FSDP2 shards dim 0), else None (a plain tensor, or a DTensor whole on this rank)."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or not isinstance(p, mod.DTensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if not shape:
        return None
    return int(offset[0]), int(offset[0]) + int(shape[0])


def shard_tag(p) -> Optional[str]:
    """The tag of a DTensor parameter sharded over more than one rank: ``shard{i}of{n}`` per
    mesh dimension that shards it (``shard0of2``, ``shard1of2_0of4``), else None. Replicas of
    one shard (HSDP) share it."""
    mod = sys.modules.get("torch.distributed.tensor")
    if mod is None or not isinstance(p, mod.DTensor):
        return None
    mesh = p.device_mesh
    coord = mesh.get_coordinate() or []
    return _layout.shard_tag([(coord[d], mesh.size(d)) for d, pl in enumerate(p.placements)
                              if isinstance(pl, mod.Shard) and mesh.size(d) > 1
                              and d < len(coord)])


def marker(tag: str) -> torch.Tensor:
    """The value of the marker that heads a per-shard state (``_layout.LOCAL_ONLY``): the
    shard count of the tag's layout, a 0-d int64 tensor."""
    return torch.tensor(_layout.shard_count(tag), dtype=torch.int64)


def shown_state(tag: str, st: dict) -> dict:
    """A per-shard state (st under the optimizer's names) as ``optimizer.state`` and
    ``state_dict()`` show it: the marker first, then every key, all tagged with the shard.
    First, because at another world size torch.distributed.checkpoint names the first key the
    checkpoint lacks, and the marker's name says why and what resumes there."""
    if not st:
        return {}
    out = {_layout.tagged(_layout.LOCAL_ONLY, tag): marker(tag)}
    out.update((_layout.tagged(k, tag), v) for k, v in st.items())
    return out


def external_key(tag, k):
    """The name of the optimizer's state key k as ``optimizer.state`` and ``state_dict()``
    show it: tagged with the shard (``shard_tag``), or renamed by a key map (the global block
    numbers of ``fsdp_blocking="global"``, ``_global.KeyMap``)."""
    if tag is None:
        return k
    return _layout.tagged(k, tag) if isinstance(tag, str) else tag.external(k)


def internal_key(tag, k):
    """The optimizer's name of a key looked up: a shard's tag stripped. A key map's shown
    names are not taken (``b3.`` could be either numbering): lookups use the optimizer's."""
    if not isinstance(tag, str) or not isinstance(k, str):
        return k
    return _layout.untagged(k, tag)


class _ParamState(dict):
    """One parameter's state when some of it lives in a Residency, or when the parameter is a
    DTensor sharded over several ranks: a plain dict for the device tensors plus "virtual"
    entries for the tiered roots / eigenbases. Reading a virtual entry returns a fresh copy on
    the parameter's device (never a live view), assigning one writes the block, popping one
    frees it. The optimizer itself never goes through the virtual entries (it stages blocks
    through the ring); they exist so state inspection and torch.optim's plumbing see the same
    keys as with everything on the device.

    A sharded parameter's state is per shard: its keys, as iteration (and so DCP) sees them,
    carry the shard's tag (``b0.exp_avg@shard1of2``), so that a checkpoint keeps every rank's
    copy instead of one for all; lookups take either name, the optimizer uses the plain one.
    Such a state, once it has entries, is headed by the marker ``_layout.LOCAL_ONLY``
    (``shown_state``): shown, read and checkpointed like an entry, never stored (the optimizer's
    own iterations, ``dict.keys(st)``, do not see it) and never set.
    A globally blocked FSDP2 parameter (``fsdp_blocking="global"``) shows its blocks under their
    global numbers (``_global.KeyMap``); lookups take the optimizer's own (owned block k)."""

    __slots__ = ("_owner", "_p", "_tag")

    def __init__(self, opt, p, items=()):
        super().__init__(items)
        # the state must not own its optimizer: with a strong reference the pair is a cycle,
        # and with the cycle collector off (OLMo-core's training policy) ``del opt`` would free
        # neither the optimizer nor its workers and buffers
        self._owner = weakref.ref(opt)
        self._p = p
        self._tag = opt.run.tags.get(p)

    @property
    def _opt(self):
        return alive(self._owner, "the Asteria optimizer this state belonged to")

    # The accessors below are on the step's path (every read of a moment or a step count goes
    # through one), so each resolves its optimizer once and strips a tag only where one exists.

    def _marked(self) -> bool:
        """Is the marker shown (a per-shard state with entries)?"""
        return isinstance(self._tag, str) and dict.__len__(self) > 0

    def _int(self, k):
        """The optimizer's name of a key (the tag stripped)."""
        return internal_key(self._tag, k)

    def _ext(self, k):
        return external_key(self._tag, k)

    def _held(self, k, opt=None) -> bool:
        """Is k a virtual entry (a block the placement's residency holds)?"""
        if opt is None:
            opt = self._opt
        if not opt.placement.off_device or not isinstance(k, str) or dict.__contains__(self, k):
            return False
        return opt.placement.held(self._p, k)

    def _virtual(self, opt=None) -> list:
        if opt is None:
            opt = self._opt
        return opt.placement.held_names(self._p)

    def _settle(self, opt, k) -> None:
        """Before a read or write of k: the work that still changes it is done (an install
        deferred to the next use; a job that writes k, ``opt.background``)."""
        if opt.schedule.deferred:
            opt.schedule.settle_deferred()
        if opt.background:
            opt.background.settle(self._p, k)

    def __getitem__(self, k):
        if self._tag is not None:
            k = internal_key(self._tag, k)
            if k == _layout.LOCAL_ONLY and self._marked():
                return marker(self._tag)
        opt = self._opt
        if opt.background or opt.schedule.deferred:
            self._settle(opt, k)
        if not self._held(k, opt):
            return dict.__getitem__(self, k)
        return opt.placement.read(self._p, k)

    def get(self, k, default=None):
        return self[k] if k in self else default

    def __contains__(self, k):
        if self._tag is not None:
            k = internal_key(self._tag, k)
            if k == _layout.LOCAL_ONLY:
                return self._marked()
        return dict.__contains__(self, k) or self._held(k)

    def _names(self) -> list:
        """The optimizer's names of every entry, device and virtual, after the marker."""
        head = [_layout.LOCAL_ONLY] if self._marked() else []
        return head + list(dict.__iter__(self)) + self._virtual()

    def __iter__(self):
        for k in self._names():
            yield self._ext(k)

    def __len__(self):
        opt = self._opt
        return dict.__len__(self) + self._marked() + len(self._virtual(opt))

    def keys(self):
        return list(iter(self))

    def items(self):
        return [(self._ext(k), self[k]) for k in self._names()]

    def values(self):
        return [self[k] for k in self._names()]

    def __setitem__(self, k, v):
        opt = self._opt
        if self._tag is not None:
            k = internal_key(self._tag, k)
            if k == _layout.LOCAL_ONLY:
                raise KeyError(f"{self._ext(k)!r} is not set: it marks the state of a shard and "
                               f"follows from the shard layout")
        if opt.background or opt.schedule.deferred:
            self._settle(opt, k)
        place = opt.placement
        if place.off_device and isinstance(v, torch.Tensor) and place.owned(self._p, k):
            place.write(self._p, k, v)
        else:
            dict.__setitem__(self, k, v)

    def pop(self, k, *default):
        k = self._int(k)
        opt = self._opt
        if opt.background or opt.schedule.deferred:
            self._settle(opt, k)
        if not self._held(k, opt):
            return dict.pop(self, k, *default)
        v = self[k]
        opt.placement.drop(self._p, k)
        return v

    def __delitem__(self, k):
        k = self._int(k)
        opt = self._opt
        if opt.background or opt.schedule.deferred:
            self._settle(opt, k)
        if not self._held(k, opt):
            dict.__delitem__(self, k)
        else:
            opt.placement.drop(self._p, k)

    def raw(self) -> dict:
        """The device entries only, under the optimizer's names."""
        return dict(dict.items(self))

    def __reduce__(self):
        return (dict, (dict(self.items()),))

    def __repr__(self):
        return repr(dict(self.items()))


class _States(defaultdict):
    """``optimizer.state`` with a Residency: creates _ParamState entries for parameters. Other
    keys (torch.optim allows entries that are not a parameter's state, which state-dict hooks
    use) are kept as they are. Holds its optimizer weakly (see _ParamState)."""

    def __init__(self, opt, items=()):
        super().__init__(dict)
        self._owner = weakref.ref(opt)
        for p, st in dict(items).items():
            if isinstance(p, torch.Tensor) and not isinstance(st, _ParamState):
                st = _ParamState(opt, p, st)
            self[p] = st

    def __missing__(self, p):
        if not isinstance(p, torch.Tensor):  # torch.optim's defaultdict(dict) does the same
            st = self[p] = {}
            return st
        opt = self._owner()
        if opt is None:
            raise RuntimeError("the Asteria optimizer this state belonged to is gone")
        st = self[p] = _ParamState(opt, p)
        return st

    def unsettled(self) -> bool:
        """Is there work that a read of some entry must settle first (a job that writes state,
        an install deferred to the next use)?"""
        opt = self._owner()
        return opt is not None and bool(opt.background or opt.schedule.deferred)

    def __reduce__(self):
        return (dict, (dict(self.items()),))


def ensure_proxy(opt) -> None:
    """Give ``opt.state`` the proxy where it needs one: with a residency (virtual entries),
    per-shard key names, or ``mode="async"`` (reads that must wait for a job that writes the
    state, ``background``, or an install deferred to the next use)."""
    run = opt.run
    if ((opt.placement.off_device or run.tags or run.is_async)
            and not isinstance(opt.state, _States)):
        opt.state = _States(opt, opt.state)


def _count(v: Any) -> int:
    """A step count stored as an int (or a loaded 0-d tensor)."""
    return int(v.item()) if isinstance(v, torch.Tensor) else int(v)
