"""The torch.optim side of every Asteria optimizer, and the step loop.

Owns: the param groups and their checks, the parameter indices, the block layouts, the step
(AdamW path, stacks of same-shape blocks through the method, the refreshes due), the counters
behind ``asteria_stats()``, close and copies. The rest lives in parts it holds, each in a room
of its own (docs/architecture.md): ``method`` (``method.Method``: the math, one subclass per
method), ``schedule`` (``schedule.Schedule``: S, rounds, the bounded barrier, the jobs that
still write state), ``placement`` (``placement.Placement``: plan, residency, block accessors)
and ``codec`` (``checkpoint.Checkpoint``: state dicts). A step flows one way: the optimizer asks
the method for each stack's step (the method reads and writes state through the placement),
then hands the refreshes due to the schedule, which asks the method for their inputs and,
S steps later, installs their results through it. State key names are ``_layout``'s. May call:
those parts, ``_global``, ``_state``, the executor selection, torch.

A parameter with a non-finite gradient is skipped entirely (parameter, state, step count and
refresh schedule untouched) and counted.

Inside the frameworks that drive it: ``step`` is compile-disabled (a compiled function that
calls it runs it eagerly, a graph break); teardown (``close``, ``__del__``) acts on the object
that owns the engine only, never through a wrapper that takes on the optimizer's class and
forwards attributes to it (Lightning's ``LightningOptimizer``).

A complex parameter is optimised as its real view, as torch.optim's optimizers take it: every
read of a parameter's or gradient's shape, dtype or data goes through ``_state.real``, so its
blocks, state and checkpoint are those of the real parameter ``torch.view_as_real(p)``.
Complex DTensors are refused (``add_param_group``).

Distributed runs (``asteria.distributed``, docs/distributed.md): FSDP2 parameters are DTensors and
the optimizer works on their local shards (``local``), blocked as usual; with the runtime's
``fsdp_blocking="global"`` they are blocked whole instead, one owner rank per block
(``_global``: the hooks here gather the owned blocks before the kernels and scatter the new
rows after them, and agree across ranks on what skips or restarts a parameter). When some parameters are
replicated across ranks (DDP, HSDP), the engine is a ``ReplicatedEngine``
(``asteria.refresh.replicated``) around the usual one:
jobs are batched per replica set and carry it (``replicas=``), each block is computed by its
owner only, and ``step_end`` hands finished results to the synchronisation every step.

Single-threaded: everything runs on the caller's thread; the engine's workers never see this
module's objects.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Iterable, Optional, Sequence

import torch

from asteria import distributed as _dist
from asteria.refresh import select as _select
from asteria.refresh.capacity import report_lines
from asteria.config import RuntimeConfig
from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim._blocking import Layout, experts_of, make_layout
from asteria.optim._global import GlobalBlocking, sharded_dim0
from asteria.optim._state import _States, _count, local, real, shard_rows, shard_tag
from asteria.optim.checkpoint import Checkpoint
from asteria.optim.method import INIT, REFRESH
from asteria.optim.placement import Placement, _close_all
from asteria.optim.schedule import Schedule


#: the keys asteria_stats() reports in every mode (zero where a mode has no such thing)
STATS_KEYS = ("bytes_device", "bytes_host", "bytes_host_pinned", "bytes_uvm", "bytes_nvme",
              "jobs_queued", "jobs_running", "jobs_done", "barrier_waits", "barrier_wait_ns",
              "bytes_h2d", "bytes_d2h", "bytes_nvme_read", "bytes_nvme_written",
              "nvme_read_MBps", "nvme_write_MBps")
ADAMW = "adamw"  # a param group's "algorithm" that sends all its parameters to AdamW


class AsteriaOptimizer(torch.optim.Optimizer):
    """Base of the Asteria optimizers: a subclass names its method (``METHOD``, a
    ``method.Method``) and its keywords; the parts below do the rest."""

    METHOD: type

    def __init__(self, params: Iterable, defaults: dict, runtime: Any) -> None:
        self._closed = False
        self._engine = None
        self._finalizer = None
        # the parts; each holds this optimizer weakly (no cycle through it)
        self.method = self.METHOD(self)
        self.schedule = Schedule(self)
        self.placement = Placement(self)
        self.codec = Checkpoint(self)
        self.method.check(defaults)
        self._cfg = RuntimeConfig.from_user(runtime)
        self._async = self._cfg.mode == "async"
        self._pindex: dict[torch.Tensor, int] = {}  # stable ids for the engine's block keys
        self._gindex: dict[torch.Tensor, int] = {}  # param -> index of its group
        self._layouts: dict[torch.Tensor, Layout] = {}
        self._tags: dict = {}  # sharded DTensor param -> its shard's tag (or _global.KeyMap)
        # fsdp_blocking="global": FSDP2 parameters blocked whole, one owner per block
        self._global = GlobalBlocking() if self._cfg.fsdp_blocking == "global" else None
        super().__init__(params, defaults)
        self._t = 0
        self._counters = {"nonfinite_skipped": 0, "refreshes_submitted": 0,
                          "refresh_failures": 0, "installs": 0, "max_install_lag": 0,
                          "rotations_submitted": 0, "rotation_failures": 0,
                          "factor_emas_submitted": 0, "factor_ema_failures": 0}
        self._pnames: dict[int, str] = {}  # param index -> name (asteria.attach fills it)
        try:
            self._replan()
        except BaseException:
            if self._engine is not None:
                self._engine.close()
            raise
        self._finalizer = weakref.finalize(self, _close_all, self._engine,
                                           self.placement.tiered)

    def _replan(self) -> None:
        """Plan (or re-plan after add_param_group) the placement of every state tensor (the
        engine is made with the first plan), and move existing tensors where it wants them."""
        plan = self.placement.make_plan()
        if self._engine is None:
            self._engine = _select.make_engine(self._cfg, plan, self._all_params())
        if self.placement.apply(plan, self._engine.tracer):  # a residency was made now
            if self._finalizer is not None:  # the finalizer must close it too
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _close_all, self._engine,
                                                   self.placement.tiered)
        if self._wants_proxy() and not isinstance(self.state, _States):
            self.state = _States(self, self.state)
        self.placement.migrate()

    def _wants_proxy(self) -> bool:
        """Does ``optimizer.state`` need the proxy (``_state._States``)? With a residency
        (virtual entries), per-shard key names, or ``mode="async"``: reads that must wait for
        a job that writes the state (``schedule.writes``) or an install deferred to the next
        use."""
        return self.placement.tiered is not None or bool(self._tags) or self._async

    def _is_adamw(self, p: torch.Tensor, group: dict) -> bool:
        """Does p take the AdamW path? A group with ``"algorithm": "adamw"`` (OLMo-core's
        convention) sends every parameter of it there, 2-D ones too (embeddings, output heads);
        otherwise the method's rule decides."""
        return group.get("algorithm") == ADAMW or self.method.uses_adamw(p, group)

    def _fixed_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        """Add the keys of the fixed key set that p's state lacks (at creation, after a load):
        the method's (Shampoo's roots before their first install), then the schedule's (with
        S > 0 the placeholders of a refresh in flight)."""
        self.method.fixed_state(p, group, layout)
        self.schedule.fixed_state(p, group, layout)

    def _asteria_name_params(self, names: dict) -> None:
        """Parameter names (from the model) for messages."""
        for p, name in names.items():
            if p in self._pindex:
                self._pnames[self._pindex[p]] = name

    def _asteria_drain(self) -> int:
        """Collect finished REFRESH jobs (never blocks). Returns how many were collected."""
        if self._closed:
            return 0
        return self._engine.drain()

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, set):  # torch rejects sets itself
            params = list(params)
        self.method.normalize_group(param_group)  # in the caller's dict too, as torch keeps it
        param_group = dict(param_group, params=params)
        for i, p in enumerate(params):
            # a complex parameter is optimised as its real view (``real``); a DTensor's is not
            # taken: FSDP2 shards and blocks (fsdp_blocking="global") the complex shape, which
            # its real view's blocks, state and checkpoint keys would not follow
            if isinstance(p, torch.Tensor) and p.is_complex() and local(p) is not p:
                raise ValueError(
                    f"parameter {i} of param group {len(self.param_groups)} is a complex "
                    f"DTensor ({p.dtype}, shape {tuple(p.shape)}): Asteria optimises a complex "
                    f"parameter as its real view (torch.view_as_real), which it does not take "
                    f"of a sharded (FSDP2) parameter. Allowed: complex plain tensors and real "
                    f"DTensors; keep torch.view_as_real(p) as the parameter before sharding "
                    f"and build the complex value from it in forward with "
                    f"torch.view_as_complex")
        merged = dict(self.defaults)
        merged.update({k: v for k, v in param_group.items() if k != "params"})
        self.method.check(merged)
        self._cfg.check_frequency(merged["precondition_frequency"],
                                  f"param group {len(self.param_groups)}")
        if merged.get("num_experts") is not None:
            for i, p in enumerate(params):
                if not (p.numel() == 0 or self._is_adamw(p, merged)):
                    try:
                        experts_of(p.shape, merged["num_experts"])
                    except ValueError as exc:
                        raise ValueError(f"parameter {i} of param group "
                                         f"{len(self.param_groups)}: {exc}") from None
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._pindex.setdefault(p, len(self._pindex))
            self._gindex[p] = len(self.param_groups) - 1
            tag = shard_tag(p)
            if self._global is not None and sharded_dim0(p):
                self._tags[p] = (self._global.add_elementwise(p, self._pindex[p])
                                 if p.numel() == 0
                                 or self._is_adamw(p, merged)
                                 else self._global.add(self, p, self._pindex[p], merged))
            elif tag is not None:
                self._tags[p] = tag
        if self.placement.plan is not None:  # a group added after construction
            self.schedule.settle()  # installs deferred to the next use are state to re-plan
            self._replan()
            _select.add_params(self._engine, self.param_groups[-1]["params"])

    def _param_states(self):
        """(parameter, its state) of ``self.state``, leaving out entries that are not a
        parameter's state (torch.optim allows them; state-dict hooks store such values)."""
        return [(p, st) for p, st in self.state.items() if isinstance(p, torch.Tensor)]

    def _all_params(self) -> list:
        return [p for g in self.param_groups for p in g["params"]]

    def _replicas(self, p: torch.Tensor) -> Optional[tuple]:
        """The ranks holding a replica of p's blocks when the engine synchronises them."""
        if not self._engine.replicated:
            return None
        cache = self.__dict__.setdefault("_replica_cache", {})
        pidx = self._pindex[p]
        if pidx not in cache:
            cache[pidx] = _dist.replicas(p)
        return cache[pidx]

    def _group_of(self, p: torch.Tensor) -> dict:
        return self.param_groups[self._gindex[p]]

    def _layout(self, p: torch.Tensor, group: dict) -> Layout:
        lay = self._layouts.get(p)
        if lay is None:
            lay = self._layouts[p] = self._make_layout(p, group)
        return lay

    def _make_layout(self, p: torch.Tensor, group: dict) -> Layout:
        """p's blocks with group's hyperparameters: of its local tensor, or (globally blocked
        FSDP2 parameters) the blocks of the full parameter this rank owns."""
        args = (group["block_size"], self.method.merge_dims(group), self.method.max_dim(group),
                group.get("num_experts"))
        if self._global is not None and self._global.has(p):
            return self._global.layout(p, *args)
        experts = None
        if args[3] is not None:  # a shard's rows are cut where its experts end
            experts = experts_of(p.shape, args[3], shard_rows(p))
        return make_layout(real(p).shape, *args[:3], experts=experts)

    # torch.compile: a compiled function that calls step() runs it eagerly (a graph break).
    # Dynamo cannot trace it (the engine, the residency and the schedule are Python objects it
    # mutates; torch's functional AdamW fails under fake tensors here), and what it calls is
    # already batched: foreach AdamW, one kernel call per stack of same-shape blocks.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError("step() on a closed Asteria optimizer")
        self.schedule.settle()
        self.schedule.writes.start_due()  # what an interrupted step left to start
        if self.schedule.writes:  # done during the forward and backward: taken in one go, so the
            self.schedule.writes.settle_all()  # step's reads of the state take the direct path
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, skipped = [], 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            finite = self._finite(params)
            skipped += len(params) - sum(finite)
            work.append((group, [p for p, ok in zip(params, finite) if ok]))
        if self.placement.tiered is not None:
            self.placement.prepare(work)  # may raise: nothing has been changed yet
        try:
            self._t += 1
            for _ in range(skipped):
                self._counters["nonfinite_skipped"] += 1
                self._engine.note_nonfinite()
            due: list = []
            for group, params in work:
                adam = [p.numel() == 0 or self._is_adamw(p, group) for p in params]
                self._adamw(group, [p for p, a in zip(params, adam) if a])
                pre = [p for p, a in zip(params, adam) if not a]
                if pre:
                    due.extend(self._precond_step(group, pre))
            self.schedule.step_end(due)
        finally:
            if self.placement.tiered is not None:
                self.placement.tiered.end_step()
        return loss

    def _finite(self, params: list) -> list:
        by_device: dict = defaultdict(list)
        for i, p in enumerate(params):
            if p.grad.is_sparse:
                raise RuntimeError("Asteria optimizers do not support sparse gradients")
            by_device[local(p.grad).device].append(i)
        finite = [True] * len(params)
        for device, idx in by_device.items():
            # one reduction per gradient that is finite iff all its elements are (NaN and
            # +-inf propagate, huge finite values cannot overflow), then one isfinite and one
            # transfer per device. On the host aminmax: one pass, no temporary, ~5x cheaper
            # than isfinite().all() (eq, abs, ne, all) and than _foreach_norm(inf) there; on an
            # accelerator the max-norm, one fused kernel for the device's gradients.
            idx = [i for i in idx if local(params[i].grad).numel()]  # empty: finite, no value
            if not idx:
                continue
            grads = [real(params[i].grad) for i in idx]
            if device.type == "cpu":
                ext = torch.stack([t for g in grads for t in torch.aminmax(g)]).view(-1, 2)
                flags = torch.isfinite(ext).all(1).tolist()
            else:
                flags = torch.isfinite(torch.stack(torch._foreach_norm(grads, float("inf"))))
                flags = flags.tolist()
            for i, ok in zip(idx, flags):
                finite[i] = ok
        if self._global is not None:  # a globally blocked parameter is skipped on every rank
            finite = self._global.agree(params, finite)
        return finite

    def _adamw(self, group: dict, params: list) -> None:
        if not params:
            return
        sts = [self.state[p] for p in params]  # each looked up once: the proxy costs per read
        fake = self._agreed_zero({p: [st["exp_avg"], st["exp_avg_sq"]]
                                  for p, st in zip(params, sts)
                                  if st and _count(st["step"]) == 1})
        for p, st in zip(params, sts):
            if p in fake:  # what DCP's fake step left (step 1, zero moments): start afresh
                st["step"] = 0
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros_like(real(p), memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(real(p), memory_format=torch.preserve_format)
            st["step"] += 1
        beta1, beta2, eps = self.method.adamw_hparams(group)
        data = [real(p) for p in params]
        F.adamw_step(data, [real(p.grad).to(w.dtype) for p, w in zip(params, data)],
                     [st["exp_avg"] for st in sts], [st["exp_avg_sq"] for st in sts],
                     [st["step"] for st in sts],
                     lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=group["weight_decay"])

    def _precond_step(self, group: dict, params: list) -> list:
        """Run the kernels over stacks of same-shape blocks; return the factors now due."""
        stacks: dict = defaultdict(list)
        sts = [self.state[p] for p in params]  # each looked up once: the proxy costs per read
        fake = self._fake_states([p for p, st in zip(params, sts) if st])
        counts: dict = {}  # param -> its step count after this step
        # last parameters first: backward produced their gradients (and the backward-pre hooks
        # staged their roots) first, so the step consumes the ring in the order it was filled
        for p, st in zip(reversed(params), reversed(sts)):
            lay = self._layout(p, group)
            phase = "step"
            if not st:
                self.method.create_state(p, group, lay)
                self._fixed_state(p, group, lay)
                if self.method.init_step:
                    phase = INIT
            elif p in fake:  # what DCP's fake step left: this step is the first one again
                st["step"] = 0
                if self.method.init_step:
                    phase = INIT
            if phase == "step":
                st["step"] += 1
                counts[p] = st["step"]
            rp = real(p)
            dtype, device = rp.dtype, rp.device
            for j, bshape in enumerate(lay.block_shapes):
                key = (phase, bshape, dtype, device, self.method.batch_tag(p, j))
                stacks[key].append((p, j))
        due: list = []
        freq = group["precondition_frequency"]
        glob = [p for p in params if self._global is not None and self._global.has(p)]
        glob_set = set(glob)
        grads, weights = self._global.gather(glob) if glob else ({}, {})  # the owned blocks
        for p in params:
            if p not in grads:
                grads[p] = self._layouts[p].blocks(real(p.grad))
                weights[p] = self._layouts[p].blocks(real(p))
        work = []
        for (phase, bshape, dtype, _, _), all_members in stacks.items():
            if phase == INIT:
                members = all_members
                g = torch.stack([grads[p][j] for p, j in members]).to(dtype)
                fresh = self.method.init_blocks(group, members, g)
                due.extend((INIT, p, j, dims) for p, j, dims in fresh)
                continue
            # one chunk without a residency
            work.extend((bshape, dtype, m) for m in self.placement.chunks(all_members))
        try:
            for i, (bshape, dtype, members) in enumerate(work):
                if self.placement.tiered is not None and i + 1 < len(work):
                    # this chunk, then the next one, so its copy overlaps this one's compute (as
                    # far as the ring has room)
                    self.placement.tiered.prefetch([k for c in (members, work[i + 1][2]) for m in c
                                           for k in self.placement.member_keys(*m)], reason="step")
                g = torch.stack([grads[p][j] for p, j in members]).to(dtype)
                ws = [weights[p][j] for p, j in members]
                # whole parameters to an optimizer that updates them where they are: no stack of
                # them to make and copy back
                # (an expert's rows of a contiguous parameter are such a block too)
                in_place = self.method.weights_in_place and all(
                    p not in glob_set and (self._layouts[p].whole or (
                        self._layouts[p].row_blocks and real(p).is_contiguous()))
                    for p, _ in members)
                w = ws if in_place else torch.stack(ws)
                steps = [counts[p] for p, _ in members]
                try:
                    self.method.step_blocks(group, members, w, g, steps)
                finally:
                    self.placement.handed_back()  # its packed stacks were its own until it returned
                for (p, j), wi in zip(members, () if w is ws else w.unbind(0)):
                    if p in glob_set:
                        weights[p][j].copy_(wi)
                    else:
                        self._layouts[p].write(real(p), j, wi)
                dims = [i for i, h in enumerate(self.method.has_factor(bshape, group)) if h]
                if dims:
                    due.extend((REFRESH, p, j, dims) for (p, j), k in zip(members, steps)
                               if k % freq == 0)
        finally:  # the jobs the stacks that ran made (an interrupted step's too): started after
            self.schedule.writes.start_due()  # the last one, not competing with the step for memory
        if glob:
            self._global.scatter()  # the new rows back to the ranks holding them
        # jobs are batched in parameter order, whatever order the step ran in
        due.sort(key=lambda d: (self._pindex[d[1]], d[2]))
        # a step that leaves what DCP's fake step leaves submits nothing (Shampoo, f = 1): the
        # next step starts that parameter afresh anyway (globally blocked parameters: decided
        # on every rank together, so all of them are asked)
        refreshed = list({d[1]: None for d in due if d[0] == REFRESH})
        idle = self._fake_states(refreshed + [p for p in glob if p not in set(refreshed)])
        return [d for d in due if d[1] not in idle] if idle else due

    def _fake_states(self, params: list) -> set:
        """The parameters among params whose state is exactly what DCP's fake step leaves:
        the step count of one step (SOAP / KL-Shampoo: 0, their first step initialises the
        bases; Shampoo: 1) with the ``_fake_step_tensors`` all zero. One device sync."""
        count = 0 if self.method.init_step else 1
        cand = {}
        for p in params:
            st = self.state[p]
            if "step" in st and _count(st["step"]) == count:
                ts = self.method.fake_step_tensors(p)
                if self._global is not None and self._global.has(p):
                    cand[p] = ts or [torch.zeros(())]  # no block here: the owners decide
                elif ts:
                    cand[p] = ts
        return self._agreed_zero(cand)

    def _agreed_zero(self, cand: dict) -> set:
        """``_all_zero``, decided by all ranks together for the FSDP2 parameters of
        ``fsdp_blocking="global"`` (their state is spread over the ranks, its step count one)."""
        out = self._all_zero(cand)
        glob = sorted((p for p in cand if self._global is not None and self._global.agrees(p)),
                      key=lambda p: self._pindex[p])
        if glob:
            agreed = self._global.agree(glob, [p in out for p in glob])
            out = (out - set(glob)) | {p for p, ok in zip(glob, agreed) if ok}
        return out

    @staticmethod
    def _all_zero(cand: dict) -> set:
        """{p: [tensors]} -> the set of p whose tensors are all zero (one sync per device)."""
        by_device: dict = defaultdict(list)
        for p, ts in cand.items():
            nonzero = torch.stack([t.ne(0).any() for t in ts]).any()
            by_device[nonzero.device].append((p, nonzero))
        out = set()
        for items in by_device.values():
            flags = torch.stack([f for _, f in items]).tolist()
            out.update(p for (p, _), nz in zip(items, flags) if not nz)
        return out

    def _describe_param(self, pidx: int) -> str:
        name = self._pnames.get(pidx)
        return f"parameter {pidx}" + (f" ({name})" if name else "")

    def asteria_stats(self) -> dict:
        """engine.stats() plus this optimizer's counters, optimizer-state bytes per tier (the
        staging ring counts as device bytes), copy bytes per direction and NVMe bandwidth."""
        stats = {k: 0 for k in STATS_KEYS}
        stats["nvme_read_MBps"] = stats["nvme_write_MBps"] = 0.0
        stats["bytes_device_ring"] = 0
        stats.update(self._engine.stats())
        stats.update(self._counters)
        if self._global is not None:
            stats.update(self._global.stats())
        stats["overflow_skipped"] = 0
        stats.update({k: int(v) for k, v in self.schedule.lazy_counts.items()})
        dev = 0
        plan = self.placement.plan
        for p, st in self._param_states():
            pidx = self._pindex.get(p)
            for name, v in dict.items(st):
                if K.is_pending_output(name):  # placeholders: views of one shared zero
                    continue
                if isinstance(v, torch.Tensor) and (plan is None or
                                                    plan.tier((pidx, name)) == "device"):
                    dev += v.numel() * v.element_size()
        stats["bytes_state_device"] = dev
        stats["bytes_h2d"] = stats.get("bytes_h2d_results", 0)
        stats["bytes_d2h"] = stats.get("bytes_d2h_snapshots", 0)
        ts = None
        if self.placement.tiered is not None:
            ts = self.placement.tiered.stats()
        elif self.placement.tiered_final is not None:
            ts = dict(self.placement.tiered_final)
        if ts is not None:
            h2d, d2h = ts.pop("bytes_h2d"), ts.pop("bytes_d2h")
            stats.update(ts)
            stats["bytes_h2d"] += h2d
            stats["bytes_d2h"] += d2h
            dev += self.placement.plan.ring_bytes
        stats["bytes_device"] = dev
        stats.setdefault("install_waits", 0)
        stats.setdefault("install_wait_ns", 0)
        # S as the schedule applies it now; with staleness="auto", whether it was chosen yet
        stats["staleness"] = self.schedule.delay
        stats["staleness_auto"] = self._cfg.staleness == "auto"
        stats["staleness_auto_chosen"] = self.schedule.auto_s is not None
        cap = self.schedule.capacity.summary(self.schedule.delay)
        for key in ("round_gflop", "predicted_round_s", "measured_round_s", "step_s",
                    "window_s", "utilisation", "smallest_s", "smallest_workers"):
            stats[f"capacity_{key}"] = cap.get(key)
        return stats

    def asteria_plan(self) -> list[str]:
        """The planner's decisions, then the capacity report (asteria.refresh.capacity): work per
        round, predicted and measured round seconds, the window S x step time, the pool's
        utilisation and the smallest S (and worker count) that hides the refresh; whether a
        device executor runs part of it. The capacity lines come once a round was submitted."""
        lines = self.placement.decisions()
        # before the first round there is nothing measured to report: the planner's decisions
        # alone (as logged at construction)
        sched = self.schedule
        if self._async and sched.measured:
            s = self.schedule.delay
            auto = self._cfg.staleness == "auto"
            if auto:
                lines.append(f"staleness 'auto': S = {s} " + (
                    "(chosen from the measured round time)" if self.schedule.auto_s is not None
                    else "(the frequency, until a REFRESH round has been measured)"))
            lines.extend(report_lines(sched.capacity.summary(s)))
        return lines

    def close(self) -> None:
        """Release the engine (workers, buffers; the trace file is written now) and the
        residency. Idempotent; the optimizer cannot step after. Called on a wrapper that
        forwards attributes to the optimizer (Lightning's ``LightningOptimizer``), it closes
        the optimizer the wrapper stands for."""
        owner = self._engine_owner()
        if owner is not None:
            owner._close(detier=True)

    def _engine_owner(self) -> Optional["AsteriaOptimizer"]:
        """The optimizer whose ``__init__`` made this engine: self, or for an object that only
        takes on this class and forwards the attributes it lacks (LightningOptimizer: a
        subclass of the wrapped optimizer's class made without running its ``__init__``), the
        optimizer its finalizer is registered on. None once that one is closed or gone."""
        if "_closed" in vars(self):
            return self
        fin = getattr(self, "_finalizer", None)  # forwarded to the wrapped optimizer
        alive = fin.peek() if isinstance(fin, weakref.finalize) else None
        return alive[0] if alive is not None else None

    def _close(self, detier: bool) -> None:
        # the object's own attributes only: read through a wrapper's forwarding __getattr__,
        # the wrapped optimizer's would make the wrapper's teardown close that one
        own = vars(self)
        if own.get("_closed", True):
            return
        if detier:
            self.schedule.settle()  # a step end a signal interrupted: its installs are state
        sched = own.get("schedule")
        writes = sched.writes if sched is not None else None
        if detier and writes:
            writes.settle_all()
        self._closed = True
        if detier:
            self.placement.detier()
        fin = own.get("_finalizer")
        if fin is not None:
            fin()
            return
        engine = own.get("_engine")
        if engine is not None:
            engine.close()

    def __del__(self) -> None:
        try:
            # the dying object's own engine only (a dropped wrapper has none); a dying
            # optimizer's state need not be kept
            self._close(detier=False)
        except Exception:  # interpreter shutdown: the engine module may already be gone
            pass

    # ---- checkpoints: the codec's (asteria.optim.checkpoint) ----------------------------------
    def state_dict(self) -> dict:
        return self.codec.state_dict()

    state_dict.__doc__ = Checkpoint.state_dict.__doc__

    def load_state_dict(self, state_dict: dict) -> None:
        self.codec.load_state_dict(state_dict)
        for group in self.param_groups:  # a state dict from before a value went by name
            self.method.normalize_group(group)

    load_state_dict.__doc__ = Checkpoint.load_state_dict.__doc__

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle keep: the param groups (their parameters, which a
        deepcopy copies along with the model when both are copied together), the runtime config
        and ``state_dict()`` (refreshes in flight waited for and kept, not installed). The copy
        is a working optimizer with its own runtime: it continues bitwise like the original
        would. The workers, buffers and tiered blocks are the original's and are not copied."""
        if getattr(self, "_closed", True):
            raise RuntimeError(f"cannot copy or pickle a closed {type(self).__name__}: copy it "
                               f"before close(), or build a new one and load_state_dict() "
                               f"its state_dict()")
        return {"param_groups": self.param_groups, "defaults": self.defaults,
                "runtime": self._cfg, "state_dict": self.state_dict(),
                "names": dict(self._pnames)}

    def __setstate__(self, state: dict) -> None:
        if "runtime" not in state:  # torch.optim's load_state_dict sets state this way
            super().__setstate__(state)
            return
        groups = [dict(g) for g in state["param_groups"]]
        AsteriaOptimizer.__init__(self, groups, state["defaults"], state["runtime"])
        self._pnames.update(state.get("names", {}))
        self.load_state_dict(state["state_dict"])

    # ---- placement: the part's (asteria.optim.placement) --------------------------------------
    def asteria_memory_plan(self) -> dict:
        return self.placement.memory_plan()

    asteria_memory_plan.__doc__ = Placement.memory_plan.__doc__

    @property
    def capacity(self):
        """The capacity record of this optimizer's REFRESH work (asteria.refresh.capacity)."""
        return self.schedule.capacity

    def _asteria_prefetch(self, params: Iterable, reason: str = "") -> int:
        """Stage the roots / eigenbases of params into the ring (the hooks' call)."""
        return self.placement.prefetch(params, reason=reason)

    def _asteria_fetch_early(self, params: Iterable) -> None:
        """Read params' NVMe-resident blocks back into host memory (the hooks' call)."""
        self.placement.fetch_early(params)
