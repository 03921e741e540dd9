"""What the parts of one Asteria optimizer share: the ``Run`` record.

Owns: the validated runtime config (``cfg``), the engine once made (``engine``), the step
counter (``t``: the optimizer advances it here, so every part reads it live), whether the
optimizer is closed, the parameter index (``pindex``, each parameter's group), their names for
messages (``names``, ``describe``), their block layouts, the shard tags of sharded parameters,
the global blocking of FSDP2 parameters (``blocking``), the replica sets, and the counters
behind ``asteria_stats()``. The optimizer builds one and hands it to each part at construction,
with that part's exact collaborators (docs/architecture.md): no part reaches the optimizer's own
fields.

torch.optim owns ``state``, ``param_groups`` and ``defaults`` and replaces them itself (a load
assigns new ones), so the record reads them from the optimizer each time, through a weak
reference: the record must not own its optimizer (with the cycle collector off, as OLMo-core
trains, a cycle would keep the optimizer, its workers and buffers alive). ``optimizer`` is that
object for torch's own state-dict code (the checkpoint part). May call: ``_blocking``,
``_global``, ``asteria.distributed``, the method's rules for blocks (``merge_dims``,
``max_dim``, ``uses_adamw``). Single-threaded (the training thread).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch

from asteria import distributed as _dist
from asteria.config import RuntimeConfig
from asteria.optim._blocking import Layout, experts_of, layout_key, make_layout
from asteria.optim._global import GlobalBlocking, LocalBlocking
from asteria.optim._state import alive, real, shard_rows

ADAMW = "adamw"  # a param group's "algorithm" that sends all its parameters to AdamW

#: the counters behind asteria_stats() that exist from the start (and, added by the
#: background-jobs part, those its declared job kinds name: ``background.JobKind``)
COUNTERS = ("nonfinite_skipped", "refreshes_submitted", "refresh_failures", "installs",
            "max_install_lag")


class Run:
    """The record the parts of one optimizer share (module docstring)."""

    def __init__(self, optimizer, cfg: RuntimeConfig, method) -> None:
        self._owner = weakref.ref(optimizer)
        self._method = method  # its rules for blocks and the AdamW path only
        self.cfg = cfg
        self.engine = None  # made with the first placement plan
        self.t = 0
        self.closed = False
        self.pindex: dict[torch.Tensor, int] = {}  # stable ids for the engine's block keys
        self.gindex: dict[torch.Tensor, int] = {}  # param -> index of its group
        self.names: dict[int, str] = {}  # param index -> name (asteria.attach fills it)
        self.layouts: dict[torch.Tensor, Layout] = {}
        self.tags: dict = {}  # sharded DTensor param -> its shard's tag (or _global.KeyMap)
        # fsdp_blocking="global": FSDP2 parameters blocked whole, one owner per block
        self.blocking = GlobalBlocking() if cfg.fsdp_blocking == "global" else LocalBlocking()
        self.counters = {k: 0 for k in COUNTERS}
        self._replicas: dict[int, Optional[tuple]] = {}

    # ---- torch.optim's attributes, read live -------------------------------------------------
    @property
    def optimizer(self):
        return alive(self._owner, "the Asteria optimizer of this run")

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self) -> list:
        return self.optimizer.param_groups

    @property
    def is_async(self) -> bool:
        return self.cfg.mode == "async"

    def params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def by_index(self) -> dict:
        """param index -> param."""
        return {i: p for p, i in self.pindex.items()}

    def param_states(self) -> list:
        """(parameter, its state) of the optimizer's state, leaving out entries that are not a
        parameter's state (torch.optim allows them; state-dict hooks store such values)."""
        return [(p, st) for p, st in self.state.items() if isinstance(p, torch.Tensor)]

    def group_of(self, p: torch.Tensor) -> dict:
        return self.param_groups[self.gindex[p]]

    def describe(self, pidx: int) -> str:
        name = self.names.get(pidx)
        return f"parameter {pidx}" + (f" ({name})" if name else "")

    def replicas(self, p: torch.Tensor) -> Optional[tuple]:
        """The ranks holding a replica of p's blocks when the engine synchronises them."""
        if not self.engine.replicated:
            return None
        pidx = self.pindex[p]
        if pidx not in self._replicas:
            self._replicas[pidx] = _dist.replicas(p)
        return self._replicas[pidx]

    # ---- blocks ------------------------------------------------------------------------------
    def is_adamw(self, p: torch.Tensor, group: dict) -> bool:
        """Does p take the AdamW path? A group with ``"algorithm": "adamw"`` (OLMo-core's
        convention) sends every parameter of it there, 2-D ones too (embeddings, output heads);
        otherwise the method's rule decides."""
        return group.get("algorithm") == ADAMW or self._method.uses_adamw(p, group)

    def layout(self, p: torch.Tensor, group: dict) -> Layout:
        """p's layout, cut once with its group's hyperparameters."""
        lay = self.layouts.get(p)
        if lay is None:
            lay = self.layouts[p] = self.make_layout(p, group)
        return lay

    def make_layout(self, p: torch.Tensor, group: dict) -> Layout:
        """p's blocks with group's hyperparameters: of its local tensor, or (globally blocked
        FSDP2 parameters) the blocks of the full parameter this rank owns."""
        args = layout_key(self._method, group)
        if self.blocking.has(p):
            return self.blocking.layout(p, *args)
        experts = None
        if args[3] is not None:  # a shard's rows are cut where its experts end
            experts = experts_of(p.shape, args[3], shard_rows(p))
        return make_layout(real(p).shape, *args[:3], experts=experts)
