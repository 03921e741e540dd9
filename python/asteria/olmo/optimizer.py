"""``MatrixAwareAsteria``: one torch.optim.Optimizer over a whole OLMo-core model, with an Asteria
method (SOAP, Shampoo, KL-Shampoo) on the matrices and torch.optim.AdamW on the rest.

Owns: the routing of param groups by their ``"algorithm"`` key ("adamw" or the method's name);
the local-shard stand-ins of FSDP2 DTensor parameters; the per-shard state keys; forgetting the
state torch.distributed.checkpoint's fake step leaves in torch.optim.AdamW.
Calls the Asteria optimizer and torch.optim.AdamW through their public API only, and torch.

Why a composite. The Asteria optimizers take ``"algorithm": "adamw"`` groups themselves (their
2-D parameters too), but their AdamW state is the local shard's, a plain tensor, while
torch.optim.AdamW keeps DTensor state that reshards freely; and their per-shard state of an
FSDP2 parameter needs keys distinct per rank in a multi-rank checkpoint. This class gives
every parameter group to the optimizer that suits it:

* "adamw" groups go, with the real (possibly DTensor) parameters, to ``torch.optim.AdamW``,
  the optimizer OLMo-core's own AdamWConfig builds, so their state is DTensor-sharded as usual.
* Method groups go to the Asteria optimizer. A DTensor parameter (FSDP2) is represented there by
  a stand-in: a plain ``nn.Parameter`` sharing the storage of its local shard, given the local
  shard of the gradient before each step. The method so preconditions each rank's shard as an
  independent block, as DESIGN.md asks of FSDP2 ("FSDP2 shards are always blocked").

Outward it is one optimizer, as OLMo-core and torch.distributed.checkpoint expect: its own
``param_groups`` (what schedulers write and checkpoints keep; copied into the inner groups
before each step) hold the real parameters in the order OLMo-core built them; ``state`` has an
entry for every parameter with state (AdamW's own dict, or ``{key: the Asteria state}``);
``state_dict`` numbers parameters in that order. An Asteria parameter's state sits under one key
(``asteria``, or ``asteria_shard{i}of{n}`` for a shard of an FSDP2 mesh of n > 1 ranks, so that
ranks do not overwrite each other's per-shard state in the checkpoint) in its checkpoint form.
Resuming such a sharded state needs the same mesh; AdamW state reshards freely.

The fake step. Before torch.distributed.checkpoint saves or loads the state of an optimizer
that has none, it steps it once with zero gradients and lr 0 (``_init_optim_state``), e.g. at
OLMo-core's step-0 checkpoint. The Asteria optimizers start a parameter afresh after it
themselves; for torch.optim.AdamW it would shift the bias corrections by a step. So at the first
step after the state was created with lr 0, or after it was loaded, an AdamW state that is
exactly what such a step leaves is forgotten, and the run follows the trajectory of an optimizer
that never had a fake step.

Single-threaded, like the optimizers it wraps.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch

from asteria.olmo import checkpoint as ck

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch without distributed support: no DTensor parameters either
    DTensor = Shard = None

ADAMW = "adamw"
CKPT_KEY = "asteria"


def _is_dtensor(t: torch.Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _ckpt_key(p: torch.Tensor) -> str:
    """The state key of an Asteria parameter: distinct per shard where the mesh shards it."""
    if not _is_dtensor(p):
        return CKPT_KEY
    coord = p.device_mesh.get_coordinate() or []
    parts = [f"{coord[d]}of{p.device_mesh.size(d)}"
             for d, pl in enumerate(p.placements)
             if isinstance(pl, Shard) and p.device_mesh.size(d) > 1]
    return CKPT_KEY if not parts else f"{CKPT_KEY}_shard" + "_".join(parts)


def _packed_groups(groups: list[dict]) -> list[dict]:
    """torch.optim's state-dict form of param groups: parameters numbered in order."""
    out, start = [], 0
    for g in groups:
        packed = {k: v for k, v in g.items() if k != "params"}
        packed["params"] = list(range(start, start + len(g["params"])))
        start += len(g["params"])
        out.append(packed)
    return out


class MatrixAwareAsteria(torch.optim.Optimizer):
    """``method`` (asteria.SOAP, asteria.Shampoo or asteria.KLShampoo) on the param groups whose
    ``"algorithm"`` is ``method_name``, torch.optim.AdamW on those whose ``"algorithm"`` is
    ``"adamw"``. Each group carries all its hyperparameters; ``runtime`` is the Asteria runtime
    dict (``asteria.RuntimeConfig``), validated by the method's constructor."""

    def __init__(self, params: Iterable[dict], *, method: type, method_name: str,
                 runtime: Any = None) -> None:
        groups = [dict(g) for g in params]
        for i, g in enumerate(groups):
            if g.get("algorithm") not in (ADAMW, method_name):
                raise ValueError(f"param group {i}: 'algorithm' must be {ADAMW!r} or "
                                 f"{method_name!r}, got {g.get('algorithm')!r}")
            self._name_dtypes(g)
        super().__init__(groups, {})
        self.method_name = method_name
        self._stand_in: dict[torch.Tensor, torch.Tensor] = {}  # real parameter -> stand-in
        self._keys: dict[torch.Tensor, str] = {}                # real parameter -> state key
        method_groups, adamw_groups = [], []
        for g in self.param_groups:
            hparams = self._inner_hparams(g)
            if self._is_method(g):
                method_groups.append(dict(hparams, params=[self._make_stand_in(p)
                                                           for p in g["params"]]))
            else:
                adamw_groups.append(dict(hparams, params=list(g["params"])))
        self.second_order = method(method_groups, runtime=runtime) if method_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups) if adamw_groups else None
        self._check_fake_step = False

    # ---- parameters ---------------------------------------------------------------------------
    def _make_stand_in(self, p: torch.Tensor) -> torch.Tensor:
        self._keys[p] = _ckpt_key(p)
        if not _is_dtensor(p):
            self._stand_in[p] = p
            return p
        with torch.no_grad():
            x = torch.nn.Parameter(_local(p).detach(), requires_grad=False)
        self._stand_in[p] = x
        return x

    @staticmethod
    def _name_dtypes(group: dict) -> None:
        """torch.dtype values (KL-Shampoo's compute_dtype) by name: torch.distributed.checkpoint
        does not save torch.dtype objects. KL-Shampoo takes the name as it is."""
        for k, v in group.items():
            if isinstance(v, torch.dtype):
                group[k] = str(v).removeprefix("torch.")

    @staticmethod
    def _is_method(group: dict) -> bool:
        return group["algorithm"] != ADAMW

    def _pairs(self) -> list[tuple[dict, dict]]:
        """(outer group, inner group) in outer order. Inner groups are looked up each time:
        an inner load_state_dict replaces them."""
        m = iter(self.second_order.param_groups if self.second_order is not None else ())
        a = iter(self.adamw.param_groups if self.adamw is not None else ())
        return [(g, next(m) if self._is_method(g) else next(a)) for g in self.param_groups]

    def _inner_hparams(self, group: dict) -> dict:
        """An outer group's hyperparameters as the inner optimizer takes them."""
        return {k: v for k, v in group.items() if k not in ("params", "algorithm")}

    def _sync_hparams(self) -> None:
        """The outer hyperparameters (a scheduler's lr, a loaded checkpoint's values) into the
        inner groups."""
        for outer, inner in self._pairs():
            inner.update(self._inner_hparams(outer))

    def _sync_shards(self) -> None:
        """The current local shard and gradient of each DTensor parameter into its stand-in."""
        for p, x in self._stand_in.items():
            if x is p:
                continue
            local = _local(p)
            if x.data_ptr() != local.data_ptr() or x.shape != local.shape:
                x.data = local.detach()  # FSDP2 gave the shard new storage (e.g. on a reload)
            x.grad = None if p.grad is None else _local(p.grad).detach()

    def _release_grads(self) -> None:
        for p, x in self._stand_in.items():
            if x is not p:
                x.grad = None

    def _method_order(self) -> dict[torch.Tensor, int]:
        """Stand-in -> its index in the Asteria optimizer's state dict."""
        groups = self.second_order.param_groups if self.second_order is not None else ()
        return {x: i for i, x in enumerate(x for g in groups for x in g["params"])}

    def _adamw_order(self) -> dict[torch.Tensor, int]:
        groups = self.adamw.param_groups if self.adamw is not None else ()
        return {p: i for i, p in enumerate(p for g in groups for p in g["params"])}

    def _index(self) -> list[tuple[torch.Tensor, dict]]:
        """(parameter, its outer group) in state-dict order."""
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def _refresh_state(self) -> None:
        """Rebuild the outward ``state`` from the inner optimizers' (no copies)."""
        state: defaultdict = defaultdict(dict)
        for p, g in self._index():
            if self._is_method(g):
                st = self.second_order.state.get(self._stand_in[p])
                if st:
                    state[p] = {self._keys[p]: st}
            elif self.adamw.state.get(p):
                state[p] = self.adamw.state[p]
        self.state = state

    def _forget_fake_step(self) -> None:
        """Drop every AdamW state that is exactly what a fake step left (the Asteria optimizer
        starts such a parameter afresh by itself)."""
        if self.adamw is None:
            return
        sd = self.adamw.state_dict()
        keep = {i: st for i, st in sd["state"].items() if not ck.is_fake_step_adamw(st)}
        if len(keep) != len(sd["state"]):
            self.adamw.load_state_dict({"state": keep, "param_groups": sd["param_groups"]})

    # ---- torch.optim.Optimizer ----------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_hparams()
        self._sync_shards()
        if self._check_fake_step and self.state:
            self._forget_fake_step()
            self._check_fake_step = False
            self._refresh_state()
        was_empty = not self.state
        try:
            if self.adamw is not None:
                self.adamw.step()
            if self.second_order is not None:
                self.second_order.step()
        finally:
            self._release_grads()
        self._refresh_state()
        if was_empty and self.state:
            self._check_fake_step = all(float(g["lr"]) == 0.0 for g in self.param_groups)
        return loss

    def state_dict(self) -> dict:
        """torch.optim's layout over the outer param groups. An Asteria parameter's state is
        ``{key: its checkpoint form}`` (``asteria.olmo.checkpoint``); a refresh in flight is
        waited for and stored, not installed."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        method_sd = self.second_order.state_dict() if self.second_order is not None else None
        order = self._method_order()
        state: dict = {}
        for i, (p, g) in enumerate(self._index()):
            if self._is_method(g):
                st = method_sd["state"].get(order[self._stand_in[p]])
                if st:
                    state[i] = {self._keys[p]: dict(st)}
            elif self.adamw.state.get(p):
                state[i] = dict(self.adamw.state[p])
        sd = {"state": state, "param_groups": _packed_groups(self.param_groups)}
        for hook in self._optimizer_state_dict_post_hooks.values():
            out = hook(self, sd)
            if out is not None:
                sd = out
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Accepts what ``state_dict`` returns, also after torch.distributed.checkpoint's
        flattening (state keyed by parameter name, the checkpoint form nested at its dots)."""
        state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            out = hook(self, state_dict)
            if out is not None:
                state_dict = out
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict does not match this optimizer's param groups: "
                             f"{[len(s['params']) for s in saved_groups]} parameters per group, "
                             f"here {[len(g['params']) for g in self.param_groups]}")
        for s, g in zip(saved_groups, self.param_groups):
            if s.get("algorithm") != g["algorithm"]:
                raise ValueError(f"loaded param group is for {s.get('algorithm')!r}, this one "
                                 f"for {g['algorithm']!r}")
        saved_ids = [i for s in saved_groups for i in s["params"]]
        method_order, adamw_order = self._method_order(), self._adamw_order()
        method_state, adamw_state = {}, {}
        for sid, (p, g) in zip(saved_ids, self._index()):
            st = state_dict["state"].get(sid)
            if not st:
                continue
            if not self._is_method(g):
                adamw_state[adamw_order[p]] = st
                continue
            key = self._keys[p]
            if key not in st:
                raise ValueError(f"the checkpoint state of an Asteria parameter has keys "
                                 f"{sorted(st)}, expected {key!r}: it was saved with another "
                                 f"sharding of the parameter")
            method_state[method_order[self._stand_in[p]]] = ck.join_nested(st[key])
        for s, g in zip(saved_groups, self.param_groups):
            params = g["params"]
            g.clear()
            g.update({k: v for k, v in s.items() if k != "params"}, params=params)
            self._name_dtypes(g)
        self._sync_hparams()
        for inner, st in ((self.second_order, method_state), (self.adamw, adamw_state)):
            if inner is not None:
                inner.load_state_dict({"state": st,
                                       "param_groups": _packed_groups(inner.param_groups)})
        self._refresh_state()
        self._check_fake_step = True
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ---- runtime ------------------------------------------------------------------------------
    def asteria_stats(self) -> dict:
        """The Asteria optimizer's ``asteria_stats()`` (engine and scheduler counters)."""
        return self.second_order.asteria_stats() if self.second_order is not None else {}

    def close(self) -> None:
        """Release the Asteria engine (workers, buffers). Idempotent."""
        if self.second_order is not None:
            self.second_order.close()

    def params_by_algorithm(self) -> dict[str, list[torch.Tensor]]:
        """{"adamw": [...], method_name: [...]}: the real parameters each optimizer steps."""
        out: dict[str, list[torch.Tensor]] = {ADAMW: [], self.method_name: []}
        for g in self.param_groups:
            out[g["algorithm"]].extend(g["params"])
        return out
