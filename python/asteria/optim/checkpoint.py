"""Checkpoints of an Asteria optimizer (``opt.checkpoint``): ``state_dict`` / ``load_state_dict``
in torch.optim's form and checked loads.

Owns: the checkpoint form of the state (the optimizer's own key names; a refresh in flight
stored as its results, not installed), the check of a loaded state dict against this
optimizer, and the dtype each loaded tensor is kept in. Built with what it uses
(``Checkpoint(run, method, schedule, placement, cadence)``); each part owns its own wire form
and the checkpoint calls it: the schedule's refreshes in flight (``wait_pending``,
``export_pending``, ``reset``, ``restore_pending``), the placement's tiered state
(``export_tiered``, ``clear_tiered``, ``restore_tiered``), the cadence's chosen values and
per-factor ages and sketches (``STATE_KEYS``, ``fixed_state``, ``reset``, ``restore``,
``export_state``, ``factor_keys``; ``delay``, ``per_factor``). May call: torch.optim's
own state-dict code on the run's ``optimizer``, those calls, the method (``check``,
``state_spec``, ``output_specs``, ``flag_keys``, ``has_factor``, ``fixed_state``),
``cadence.check_frequency`` (a loaded group's f), ``_layout`` (key names). Single-threaded (the
training thread).

Checkpoints through torch.distributed.checkpoint (DCP).
 - Fixed key set. A flattened load (``StateDictOptions(flatten_optimizer_state_dict=True)``)
   keeps only the keys the live ``optimizer.state`` of the loading optimizer has, and that one
   is fresh: DCP's fake step made its state. So a preconditioned parameter's state has one key
   set from its creation on, the same live and in ``state_dict()``: with S > 0 the keys of a
   refresh in flight always exist (``pending.install_in`` = -1 (``NO_ROUND``) and
   ``pending.age`` = 0 without one; ``b{j}.pending{dim}.{i}`` zero placeholders of the outputs'
   shapes and dtypes, with ``b{j}.pending{dim}_ok`` = 0), and so do Shampoo's roots (zeros with
   ``b{j}.Linv{i}_set`` = 0 before the first install). Live, a placeholder is a stride-0 view of
   one shared zero (no memory); ``state_dict()`` hands out real zeros or the results. With
   S = 0 (and ``mode="sync"``) the pending keys do not exist: ``state_dict()`` first carries
   out an install deferred to the next use (``schedule``), so nothing is in flight there.
 - The fake step. DCP materialises the state of an optimizer without one by ``step()`` with
   zero gradients and lr 0. It launches no engine job (zero factors get the identity basis;
   a refresh due then is not submitted), and the next real step of a parameter whose state is
   exactly what it leaves (SOAP / KL-Shampoo: step 0 with zero factors, hence identity bases;
   Shampoo: step 1 with zero factors, momentum and grafting state; AdamW path: step 1 with
   zero moments) starts that parameter afresh, so the trajectory is that of a run without the
   fake step. (An all-zero first gradient leaves the same state and is treated the same way.)
 - FSDP2 across several ranks: the state of a sharded DTensor parameter is its local shard's,
   a plain tensor per rank; DCP keeps one copy of a plain value that several ranks save under
   one name. So its keys carry the shard's tag (``b0.exp_avg@shard1of2``, ``step@shard1of2``;
   ``shard_tag``), live and in ``state_dict()``, and every rank's copy is kept (uneven shards,
   a different key set per rank included). Resuming needs the same mesh and sharding: the
   state of another layout is refused (by DCP's planner on the keys, or by ``load_state_dict``
   naming the cause and the remedy, ``fsdp_blocking="global"``).
   The marker. DCP's planner refuses with torch's words, ``Missing key in checkpoint
   state_dict: <key>.``, naming the first key of the loading state that the checkpoint lacks.
   So every such state (live and in ``state_dict()``) begins with a marker whose name is the
   cause and the remedy, ``K.LOCAL_ONLY`` tagged like every key, one name:
   ``fsdp_blocking=local(resumes_only_at_the_saved_world_size;``
   ``use_fsdp_blocking=global_to_resume_at_another)@shard0of2``; its value is the shard count
   (a 0-d int64 tensor). At another world size every key of a sharded parameter changes its
   tag, so the key DCP names is a marker, on 2 ranks or more (one rank has no shards, so no
   marker: there DCP names a key of the plain state, torch's words only). The marker follows
   from the tag and is never stored (``_state.shown_state``): nothing that iterates the
   state's entries for the math, the bytes or the tiers sees it; ``load_state_dict`` checks
   its value and drops it. Compatibility: a DCP checkpoint of ``fsdp_blocking="local"`` on
   several ranks written before the marker lacks it and does not load, even on its own world
   size (DCP names the marker as missing); a rank's ``state_dict()`` without it (saved with
   ``torch.save``) still loads.
   With ``fsdp_blocking="global"`` (``_global``) the keys name the global blocks instead, each
   on its owner, and the AdamW state is saved as DTensors: a checkpoint resumes on another
   world size.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Mapping

import torch

from asteria.optim import _layout as K
from asteria.optim._state import _count, _ParamState, ensure_proxy, real, shown_state
from asteria.optim.cadence import check_frequency


#: group keys torch.optim itself puts into an optimizer's defaults or groups, none of them a
#: hyperparameter of these optimizers: torch's __setstate__ (the end of every load_state_dict,
#: of a copy and of an unpickling) adds "differentiable" to the defaults, so an optimizer that
#: was loaded once (accelerate's prepare() loads its own state dict) would otherwise demand it
#: of every later state dict; torch's own optimizers store all five in their groups. A loaded
#: state dict may have them or not.
TORCH_GROUP_KEYS = frozenset({"differentiable", "foreach", "maximize", "capturable", "fused"})


def _layout_mismatch(key: str, who: str, saved: str, here: str) -> str:
    """The refusal of a checkpoint of another shard layout: what, why, and the remedy."""
    return (f"load_state_dict: optimizer state key {key!r} of {who} was saved for {saved}, this "
            f"rank has {here}. With fsdp_blocking='local' each rank's state is that of the "
            f"blocks cut from its own shard, so a checkpoint is tied to the shard layout it "
            f"was saved with: it resumes on the same mesh and sharding only (the same world "
            f"size). To resume on another world size, train with "
            f"runtime={{'fsdp_blocking': 'global'}}: its blocks are those of the whole "
            f"parameter and torch.distributed.checkpoint reshards its checkpoints")


@contextlib.contextmanager
def _hooks_off(opt, attr: str):
    """torch.optim runs the hooks in ``opt.<attr>`` itself; with them set aside the caller
    runs them where they belong (on the state dict it returns, on the state it loaded)."""
    hooks = getattr(opt, attr)
    setattr(opt, attr, type(hooks)())
    try:
        yield hooks
    finally:
        setattr(opt, attr, hooks)


class Checkpoint:
    """The checkpoint part of an ``AsteriaOptimizer`` (``opt.checkpoint``): the optimizer's
    ``state_dict`` / ``load_state_dict`` are its."""

    def __init__(self, run, method, schedule, placement, cadence) -> None:
        self.run = run
        self.method = method
        self.schedule = schedule
        self.placement = placement
        self.cadence = cadence

    def state_dict(self) -> dict:
        """torch.optim's state dict, with the same keys as the live state (the fixed key set):
        a refresh in flight is waited for and stored, not installed, in its
        ``b{j}.pending{dim}.{i}`` tensors (flag ``b{j}.pending{dim}_ok`` = 1) with
        ``pending.install_in`` / ``pending.age``; without one they are zeros, flags 0 and
        ``pending.install_in`` = -1. After ``close()`` the state is still there, but a refresh
        that was in flight at the close is gone with the engine: then it raises RuntimeError
        saying so (call it before ``close()``).

        The state of a DTensor parameter sharded over several ranks (FSDP2) is its local
        shard's, under keys tagged with the shard (``b0.exp_avg@shard1of2``, ``step@...``, as
        the live state shows them): torch.distributed.checkpoint keeps one copy of a plain
        value saved under one name by several ranks, so untagged keys would lose all ranks'
        state but one. Such a state begins with the marker ``K.LOCAL_ONLY`` (module docstring).
        Resuming needs the same mesh and sharding (``load_state_dict`` raises ValueError on
        another shard's keys)."""
        opt = self.run.optimizer
        self.schedule.wait_pending()
        # torch's post hooks must see the state dict as returned: they run after ours is built
        with _hooks_off(opt, "_optimizer_state_dict_post_hooks") as post_hooks:
            sd = torch.optim.Optimizer.state_dict(opt)
        index = {}
        for p in itertools.chain.from_iterable(g["params"] for g in opt.param_groups):
            index.setdefault(p, len(index))
        ids = set(index.values())
        # the optimizer's names, copies; entries that are not a parameter's state stay as torch
        # stores them
        sd["state"] = {i: ((st.raw() if isinstance(st, _ParamState) else dict(st))
                           if i in ids and isinstance(st, dict) else st)
                       for i, st in sd["state"].items()}
        # roots / eigenbases as the all-device path has them
        for p, tiered in self.placement.export_tiered().items():
            sd["state"][index[p]].update(tiered)
        self.schedule.export_pending(sd["state"], index)
        self.cadence.export_state(sd["state"], index)
        if self.cadence.delay > 0 and not self.cadence.per_factor:
            # fsdp_blocking="global": as every owner has it (per factor: the block's owner's)
            self.run.blocking.sync_pending(sd["state"], index, (K.PENDING_IN, K.PENDING_AGE))
        for p, tag in self.run.tags.items():  # per-shard state: the shard's own key names
            st = sd["state"].get(index.get(p))
            if st is not None:
                sd["state"][index[p]] = (shown_state(tag, st) if isinstance(tag, str)
                                         else tag.export(st))
        for hook in post_hooks.values():
            out = hook(opt, sd)
            if out is not None:
                sd = out
        return sd

    def untag(self, state_dict: dict) -> dict:
        """A loaded state dict under the optimizer's key names: a sharded parameter's own tag
        stripped; another shard's tag (another mesh, rank or world size), or an untagged key
        of a parameter sharded here, is a ValueError naming the cause and the remedy."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.run.param_groups for p in g["params"]]
        state = dict(state_dict["state"])
        for i, p in zip(saved_ids, params):
            st = state.get(i)
            if not st:
                continue
            tag = self.run.tags.get(p)
            if tag is not None and not isinstance(tag, str):  # fsdp_blocking="global"
                state[i] = tag.internal_state(st, self.run.describe(self.run.pindex[p]))
                continue
            out = {}
            who = self.run.describe(self.run.pindex[p])
            for k, v in st.items():
                name, saved = K.split_tag(k)
                if saved is not None:
                    if saved != str(tag):
                        raise ValueError(_layout_mismatch(k, who, K.shard_words(saved),
                                                          K.shard_words(tag)))
                    if name == K.LOCAL_ONLY:  # the marker: checked, not state
                        if _count(v) != K.shard_count(tag):
                            raise ValueError(_layout_mismatch(
                                k, who, f"a layout of {_count(v)} shards", K.shard_words(tag)))
                        continue
                    k = name
                elif tag is not None and isinstance(k, str):
                    raise ValueError(_layout_mismatch(k, who, K.shard_words(None),
                                                      K.shard_words(tag)))
                out[k] = v
            state[i] = out
        return dict(state_dict, state=state)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim's load, checked first: a state dict that does not fit this optimizer
        (another optimizer's, or saved for parameters of other shapes) raises ValueError naming
        the parameter, the key and what was expected, and the optimizer is left unchanged.
        Every state tensor is stored in the dtype this optimizer keeps it in (KL-Shampoo's
        compute dtype, the int64 permutations; torch would cast it to the parameter's dtype),
        as a copy. Entries of ``state`` that are not a parameter's state are kept as torch
        keeps them. The load hooks run as torch runs them: pre hooks first, post hooks on the
        loaded optimizer."""
        opt = self.run.optimizer
        for hook in list(opt._optimizer_load_state_dict_pre_hooks.values()):
            out = hook(opt, state_dict)
            if out is not None:
                state_dict = out
        state_dict = self.untag(state_dict)
        loaded, others = self.loaded_states(state_dict)
        # checked: from here on the optimizer changes
        self.schedule.reset()
        self.cadence.reset()
        with _hooks_off(opt, "_optimizer_load_state_dict_pre_hooks"), \
                _hooks_off(opt, "_optimizer_load_state_dict_post_hooks") as post_hooks:
            torch.optim.Optimizer.load_state_dict(
                opt, {"state": {}, "param_groups": state_dict["param_groups"]})
        for p, st in loaded.items():
            opt.state[p] = st
        for k, v in others.items():
            opt.state[k] = v
        self.placement.clear_tiered()
        ensure_proxy(opt)
        for p in loaded:
            st = opt.state[p]
            self.placement.restore_tiered(p, st)
            group = self.run.group_of(p)
            if p.numel() == 0 or self.run.is_adamw(p, group):
                continue
            self.schedule.restore_pending(p, st)
            layout = self.run.layout(p, group)
            self.method.fixed_state(p, group, layout)
            self.cadence.fixed_state(p, group)
            self.schedule.fixed_state(p, group, layout)
        self.cadence.restore()  # an "auto" S and f the saved run chose stay
        self.placement.end_step()  # NVMe-homed blocks go back to NVMe (best effort)
        for hook in post_hooks.values():
            hook(opt)

    def loaded_states(self, state_dict: dict) -> tuple[dict, dict]:
        """Check a state dict against this optimizer without changing anything. Returns
        ({param: its state as it will be stored}, {key: value} of the entries that are not a
        parameter's state)."""
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, (list, tuple)) or not isinstance(state, Mapping):
            raise ValueError("load_state_dict: a state dict has 'state' (a dict) and "
                             "'param_groups' (a list), as optimizer.state_dict() returns")
        name = type(self.run.optimizer).__name__
        if len(groups) != len(self.run.param_groups):
            raise ValueError(f"load_state_dict: the state dict has {len(groups)} param groups, "
                             f"this {name} has {len(self.run.param_groups)}")
        loaded: dict = {}
        seen: set = set()
        for gi, (saved, live) in enumerate(zip(groups, self.run.param_groups)):
            ids = list(saved.get("params", ()))
            if len(ids) != len(live["params"]):
                raise ValueError(f"load_state_dict: param group {gi} of the state dict has "
                                 f"{len(ids)} parameters, this {name}'s has "
                                 f"{len(live['params'])}")
            missing = [k for k in self.run.optimizer.defaults
                       if k not in saved and k not in TORCH_GROUP_KEYS]
            if missing:
                raise ValueError(f"load_state_dict: param group {gi} of the state dict lacks "
                                 f"{name}'s hyperparameter(s) {missing}: it was saved by another "
                                 f"optimizer (its keys: {sorted(k for k in saved if k != 'params')})")
            group = {k: v for k, v in saved.items() if k != "params"}
            self.method.check(group)
            check_frequency(group["precondition_frequency"], self.run.cfg,
                            f"param group {gi} of the state dict")
            for i, p in zip(ids, live["params"]):
                seen.add(i)
                st = state.get(i)
                if st:
                    loaded[p] = self.loaded_state(p, group, live, st)
        others = {k: v for k, v in state.items() if k not in seen}
        return loaded, others

    def loaded_state(self, p: torch.Tensor, group: dict, live: dict, st: Any) -> dict:
        """One parameter's saved state, checked against what this optimizer keeps for it
        (keys, shapes, kinds) and converted: tensors copied to the parameter's device in the
        dtype this optimizer keeps them in."""
        who = self.run.describe(self.run.pindex[p])
        lp = real(p)

        def bad(msg):
            return ValueError(f"load_state_dict: the state of {who} {tuple(lp.shape)} does not "
                              f"fit this {type(self.run.optimizer).__name__}: {msg}")

        if not isinstance(st, Mapping):
            raise bad(f"expected a dict of state, found {type(st).__name__}")
        tensors: dict = {}   # key -> (shape, dtype) it must have
        flags: set = {K.STEP}
        # the path step() takes: p's own size, so an empty FSDP2 shard of a matrix (a rank past
        # its rows) keeps the preconditioned keys it was given
        if p.numel() == 0 or self.run.is_adamw(p, group):
            tensors = {n: (tuple(lp.shape), lp.dtype) for n in K.ADAMW_MOMENTS}
            required = set(tensors) | {K.STEP}
        else:
            layout = self.run.make_layout(p, group)
            here = self.run.layout(p, live)
            if layout.block_shapes != here.block_shapes:
                raise bad(f"it was saved with blocks {layout.block_shapes}, this optimizer "
                          f"cuts {here.block_shapes}")
            spec = self.method.state_spec(p, group, layout)
            tensors = {n: (tuple(shape), dt) for n, _, shape, dt in spec}
            # Shampoo's roots may be absent (a state dict from before the fixed key set)
            required = {n for n, kind, _, _ in spec if kind != "roots"} | {K.STEP}
            # the cadence's: the S / f an "auto" run chose (kept by a resumed auto run)
            flags |= {K.PENDING_IN, K.PENDING_AGE, *self.cadence.STATE_KEYS}
            flags |= set(self.method.flag_keys(p, group, layout))
            for j, bshape in enumerate(layout.block_shapes):
                for dim, has in enumerate(self.method.has_factor(bshape, group)):
                    if has:
                        flags |= {K.pending_ok(j, dim), K.pending_in(j, dim),
                                  K.pending_age(j, dim)}
                        mine, kept = self.cadence.factor_keys(int(bshape[dim]), j, dim)
                        flags |= mine
                        tensors.update(kept)
                        for i, (oshape, dt) in enumerate(
                                self.method.output_specs(p, group, bshape[dim])):
                            tensors[K.pending_output(j, dim, i)] = (tuple(oshape), dt)
        missing = sorted(required - set(st))
        if missing:
            raise bad(f"key {missing[0]!r} is missing (keys found: {sorted(st)}); was it "
                      f"saved by another optimizer?")
        out = {}
        for k, v in st.items():
            if k in tensors:
                shape, dt = tensors[k]
                if not isinstance(v, torch.Tensor):
                    raise bad(f"key {k!r}: expected a tensor of shape {shape}, found "
                              f"{type(v).__name__}")
                if tuple(v.shape) != shape:
                    raise bad(f"key {k!r}: expected shape {shape}, found {tuple(v.shape)}")
                if v.is_floating_point() != dt.is_floating_point or v.is_complex():
                    raise bad(f"key {k!r}: expected {dt} values, found {v.dtype}")
                out[k] = v.detach().to(device=lp.device, dtype=dt, copy=True)
            elif k in flags:
                if isinstance(v, torch.Tensor):
                    if v.numel() != 1:
                        raise bad(f"key {k!r}: expected a number, found a tensor of shape "
                                  f"{tuple(v.shape)}")
                    v = v.detach().clone()
                elif not isinstance(v, (int, float)):
                    raise bad(f"key {k!r}: expected a number, found {type(v).__name__}")
                out[k] = v
            else:
                raise bad(f"unexpected key {k!r}; it keeps {sorted(required)} and the flags "
                          f"and results of a refresh in flight")
        return out
