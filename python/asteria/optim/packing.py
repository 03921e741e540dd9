"""Packed device state: the device-resident state of a stack of same-shape blocks (the moments,
factors and device roots / bases that a step reads and updates) kept in one buffer per name,
each member's entry a slice of it, so that the step's kernels work on the state in place: no
stack copied in, nothing copied back (the placement's ``stack(view=True)``, used by the
methods' ``step_blocks`` only).

Owns: the packs (``packs``) and the record of the packed stacks handed to the ``step_blocks``
running now (``handed``). Built with what it uses (``Packing(run, writes)``), by the placement
(``optim/placement.py``), which alone calls it. May call: torch, the run record's state (the
``_state`` proxy: its reads settle what still writes an entry), the ``BackgroundJobs`` (settled
before slices of packs move), ``_layout`` (key names). Single-threaded (the training thread).

When the members' tensors are not such slices (the first step, a parameter skipped or without
a gradient, a load, an added group, a tensor replaced), the stack is copied and the entries are
re-pointed at its slices (``packed``); a former pack's other members get private copies then,
so no stale buffer stays alive (torch.save writes a view's whole storage). Values are those of
the copying path, bit for bit. The steady state costs no walk over the members' layouts:
entries that are still the very slice objects a pack was made of (at the same memory) are that
pack (``_whole_pack``), and a stack handed out packed to the ``step_blocks`` running now comes
back with nothing to write (``take_back``).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from asteria.optim import _layout as K
from asteria.optim._state import _States


#: Keep the device-resident state of a stack of same-shape blocks packed in one buffer, so
#: that the step reads and updates it in place. Tests flip it off to compare against a run
#: whose every step copies.
PACK = True


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Are a and b the same memory, seen the same way?"""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def _slices_of(ts: list) -> Optional[torch.Tensor]:
    """The stack that ts are, in order, the consecutive slices x[a], x[a + 1], ... of (a
    contiguous packed buffer, or the exact part of it), else None."""
    t0 = ts[0]
    base = t0._base
    if base is None or base.dim() != t0.dim() + 1 or not base.is_contiguous():
        return None
    shape = base.shape[1:]
    step = base.stride(0)
    start = t0.storage_offset() - base.storage_offset()
    if step == 0 or start % step:
        return None
    a, n = start // step, len(ts)
    if a + n > base.shape[0]:
        return None
    strides = base.stride()[1:]
    at = t0.storage_offset()
    for t in ts:
        if (t._base is not base or t.storage_offset() != at or t.shape != shape
                or t.stride() != strides):
            return None
        at += step
    return base if a == 0 and n == base.shape[0] else base[a:a + n]


def _whole_pack(packs: dict, ts: list) -> Optional[torch.Tensor]:
    """The pack that ts are, in order, all the slices of, recognised without looking at their
    layout: the same tensor objects ``Packing._repack`` made, at the same memory (the steady
    state: nothing re-pointed or replaced them since), else None."""
    base = ts[0]._base
    got = packs.get(id(base)) if base is not None else None
    if got is None or got[0]() is not base or len(got[2]) != len(ts):
        return None
    for t, (ref, ptr) in zip(ts, got[2]):
        if ref() is not t or t.data_ptr() != ptr:
            return None
    return base


def _release(packs: dict, base, keep: set, state) -> None:
    """A pack being replaced: its members not in ``keep`` ({(id(param), name)}) that still
    hold their slice of it get a private copy, so nothing keeps the old buffer alive (memory,
    and torch.save, which writes a view's whole storage)."""
    if base is None:
        return
    got = packs.pop(id(base), None)
    if got is None or got[0]() is not base:
        return
    for p, name in got[1]:
        if (id(p), name) in keep:
            continue
        st = state.get(p)
        cur = dict.get(st, name) if isinstance(st, dict) else None
        if isinstance(cur, torch.Tensor) and cur._base is base:
            dict.__setitem__(st, name, cur.clone())


class Packing:
    """The packs of a placement's device state (``Placement.packing``)."""

    def __init__(self, run, writes) -> None:
        self.run = run
        self.writes = writes  # settled before slices of packs move
        # id(stack) -> (stack, members, field, dim) of the packed stacks handed to the
        # step_blocks running now (``packed``); emptied when it returns (``handed_back``)
        self.handed: dict = {}
        # id(pack) -> (weakref to it, [(param, name)] of its members, [(weakref, ptr)] of
        # their slices): the packs of device state (``_repack``)
        self.packs: dict = {}

    def packed(self, members: list, field: str, dim: Optional[int]) -> torch.Tensor:
        """The device-resident members' ``b{j}.{field}[{dim}]`` as one packed stack that the
        state entries are slices of: the pack they already are, or a new one they are
        re-pointed at. The stack is recorded as handed out (``handed``): ``take_back`` of it,
        with these members, says there is nothing to write."""

        def key(j):
            return K.key(j, field, dim)

        state = self.run.state
        states = [state[p] for p, _ in members]
        if isinstance(state, _States) and state.unsettled():  # its reads settle them
            ts = [st[key(j)] for st, (_, j) in zip(states, members)]
        else:  # nothing to settle, no entry in the residency: the proxy's read is the dict's
            ts = [dict.__getitem__(st, key(j)) for st, (_, j) in zip(states, members)]
        x = _whole_pack(self.packs, ts)
        if x is None:
            x = _slices_of(ts)
        if x is None:
            x = self._repack(members, key, states, ts)
        self.handed[id(x)] = (x, members, field, dim)
        return x

    def _repack(self, members: list, key, states: list, ts: list) -> torch.Tensor:
        """Stack ts into a new pack and re-point the members' entries at its slices."""
        if self.writes:  # slices of packs are about to move: no worker may still write one
            self.writes.settle_all()
        x = torch.stack(ts)
        self.handed.clear()  # entries are re-pointed below: earlier records may not hold
        packs = self.packs
        mine = {(id(p), key(j)) for p, j in members}
        for t in ts:  # a former pack's other members keep private copies (no stale buffer)
            _release(packs, t._base, mine, self.run.state)
        entries, slices = [], []
        for st, (p, j), xi in zip(states, members, x.unbind(0)):
            dict.__setitem__(st, key(j), xi)  # not through the proxy: no tier, no settle
            entries.append((p, key(j)))
            slices.append((weakref.ref(xi), xi.data_ptr()))  # weak: the entry owns its slice
        for ident in [i for i, (ref, _, _) in packs.items() if ref() is None]:
            del packs[ident]  # packs nothing holds any more (no callback: no cycle)
        packs[id(x)] = (weakref.ref(x), entries, slices)
        return x

    def take_back(self, x: torch.Tensor, members: list, field: str,
                  dim: Optional[int]) -> bool:
        """Was x handed out packed (``packed``) for these very members' ``b{j}.{field}[{dim}]``?
        Then writing it back needs nothing, not even a look at them; its record is dropped."""
        handed = self.handed.pop(id(x), None)
        return (handed is not None and handed[0] is x and handed[1] is members
                and handed[2:] == (field, dim))

    def is_state(self, members: list, field: str, dim: Optional[int], x: torch.Tensor) -> bool:
        """Is the stack x the members' ``b{j}.{field}[{dim}]`` itself (writing x writes the
        state)?"""
        handed = self.handed.get(id(x))
        if handed is not None and handed[0] is x:  # the steady state: no member looked at
            return True
        # a stack packed in this very step (the first, or the first after a load) is not on
        # record as handed out: its slices are the entries all the same
        state = self.run.state
        return all(same_memory(dict.__getitem__(state[p], K.key(j, field, dim)), xi)
                   for (p, j), xi in zip(members, x.unbind(0)))

    def handed_back(self) -> None:
        """The ``step_blocks`` that was handed packed stacks returned: they are the state's
        again, and writing one back writes as usual."""
        self.handed.clear()
