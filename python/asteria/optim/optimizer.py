"""The torch.optim side of every Asteria optimizer, and the step loop.

Owns: the param groups and their checks, the step (AdamW path, stacks of same-shape blocks
through the method, the refreshes due), ``asteria_stats()``, close and copies. What the parts
share is one record it builds and fills, ``run`` (``run.Run``: config, engine, step counter,
parameter index and names, layouts, shard tags, counters, replicas); the parts are built with
it and their exact collaborators, each in a room of its own (docs/architecture.md): ``method``
(``method.Method``: the math, one subclass per method), ``cadence`` (``cadence.Cadence``: f
and S, which factors refresh and when each is installed), ``schedule`` (``schedule.Schedule``:
rounds, the bounded barrier), ``background`` (``background.BackgroundJobs``: a method's jobs
that write state in the background), ``placement`` (``placement.Placement``: plan,
residency, block accessors) and ``checkpoint``
(``checkpoint.Checkpoint``: state dicts). A step flows one way: the optimizer asks the method
for each stack's step (the method reads and writes state through the placement), then hands
the refreshes due to the schedule, which asks the method for their inputs and, S steps later,
installs their results through it. State key names are ``_layout``'s. May call: those parts,
``_global``, ``_state``, the executor selection, torch.

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
jobs are batched per replica set and carry it (``SubmitOptions.replicas``), each block is
computed by its owner only, and ``step_end`` hands finished results to the synchronisation
every step.

Single-threaded: everything runs on the caller's thread; the engine's workers never see this
module's objects.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any, Iterable, Optional

import torch

from asteria.refresh import select as _select
from asteria.config import TIERS, RuntimeConfig
from asteria.optim import _layout as K
from asteria.optim import functional as F
from asteria.optim._blocking import experts_of
from asteria.optim._state import _count, ensure_proxy, local, real, shard_tag
from asteria.optim.background import BackgroundJobs
from asteria.optim.cadence import Cadence, check_frequency
from asteria.optim.checkpoint import Checkpoint
from asteria.optim.method import INIT, REFRESH
from asteria.optim.placement import Placement, close_all
from asteria.optim.run import Run
from asteria.optim.schedule import Schedule


#: the keys asteria_stats() reports in every mode (zero where a mode has no such thing): the
#: bytes of each tier (config.TIERS, libasteria's), then the rest
STATS_KEYS = tuple(f"bytes_{t}" for t in TIERS) + (
    "jobs_queued", "jobs_running", "jobs_done", "barrier_waits", "barrier_wait_ns", "bytes_h2d",
    "bytes_d2h", "bytes_nvme_read", "bytes_nvme_written", "nvme_read_MBps", "nvme_write_MBps")


class AsteriaOptimizer(torch.optim.Optimizer):
    """Base of the Asteria optimizers: a subclass names its method (``METHOD``, a
    ``method.Method``) and its keywords; the parts below do the rest."""

    METHOD: type

    def __init__(self, params: Iterable, defaults: dict, runtime: Any) -> None:
        self._finalizer = None
        method = self.METHOD()
        method.check(defaults)
        # the record the parts share, and the parts, each given what it uses (no cycle: the
        # record holds this optimizer weakly, the method its collaborators)
        self.run = run = Run(self, RuntimeConfig.from_user(runtime), method)
        self.background = background = BackgroundJobs(run)
        self.method = method
        self.placement = Placement(run, method, background)
        background.bind(self.placement)
        self.cadence = Cadence(run, method)
        self.schedule = Schedule(run, method, self.placement, background, self.cadence)
        method.bind(run, self.placement, self.schedule, background, self.cadence)
        self.checkpoint = Checkpoint(run, method, self.schedule, self.placement, self.cadence)
        super().__init__(params, defaults)
        try:
            self._replan()
        except BaseException:
            if run.engine is not None:
                run.engine.close()
            raise
        self._finalizer = weakref.finalize(self, close_all, run.engine, self.placement.closer())

    def _replan(self) -> None:
        """Plan (or re-plan after add_param_group) the placement of every state tensor (the
        engine is made with the first plan), and move existing tensors where it wants them."""
        run = self.run
        plan = self.placement.make_plan()
        if run.engine is None:
            run.engine = _select.make_engine(run.cfg, plan, run.params())
        self.cadence.check_engine()
        if self.placement.apply(plan, run.engine.tracer):  # a residency was made now
            if self._finalizer is not None:  # the finalizer must close it too
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, close_all, run.engine,
                                                   self.placement.closer())
        ensure_proxy(self)
        self.placement.migrate()

    def _asteria_name_params(self, names: dict) -> None:
        """Parameter names (from the model) for messages."""
        for p, name in names.items():
            if p in self.run.pindex:
                self.run.names[self.run.pindex[p]] = name

    def _asteria_drain(self) -> int:
        """Collect finished REFRESH jobs (never blocks). Returns how many were collected."""
        if self.run.closed:
            return 0
        return self.run.engine.drain()

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
        check_frequency(merged["precondition_frequency"], self.run.cfg,
                        f"param group {len(self.param_groups)}")
        if merged.get("num_experts") is not None:
            for i, p in enumerate(params):
                if not (p.numel() == 0 or self.run.is_adamw(p, merged)):
                    try:
                        experts_of(p.shape, merged["num_experts"])
                    except ValueError as exc:
                        raise ValueError(f"parameter {i} of param group "
                                         f"{len(self.param_groups)}: {exc}") from None
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self.run.pindex.setdefault(p, len(self.run.pindex))
            self.run.gindex[p] = len(self.param_groups) - 1
            tag = shard_tag(p)
            run = self.run
            if run.blocking.takes(p):
                run.tags[p] = (run.blocking.add_elementwise(p, run.pindex[p])
                               if p.numel() == 0 or run.is_adamw(p, merged)
                               else run.blocking.add(self.method, p, run.pindex[p], merged))
            elif tag is not None:
                self.run.tags[p] = tag
        if self.placement.plan is not None:  # a group added after construction
            self.schedule.settle()  # installs deferred to the next use are state to re-plan
            self._replan()
            _select.add_params(self.run.engine, self.param_groups[-1]["params"])

    # torch.compile: a compiled function that calls step() runs it eagerly (a graph break).
    # Dynamo cannot trace it (the engine, the residency and the schedule are Python objects it
    # mutates; torch's functional AdamW fails under fake tensors here), and what it calls is
    # already batched: foreach AdamW, one kernel call per stack of same-shape blocks.
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure=None):
        if self.run.closed:
            raise RuntimeError("step() on a closed Asteria optimizer")
        # the jobs of the last step, then the installs deferred to this one (whose jobs run on
        # while this step works on state they do not write: see Schedule.step_start)
        self.schedule.step_start()
        carried = list(self.background)
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
        if self.placement.off_device:  # may raise: nothing has been changed yet
            self.placement.prepare(work, self.schedule.in_flight())
        try:
            self.run.t += 1
            for _ in range(skipped):
                self.run.counters["nonfinite_skipped"] += 1
                self.run.engine.note_nonfinite()
            due: list = []
            for group, params in work:
                adam = [p.numel() == 0 or self.run.is_adamw(p, group) for p in params]
                self._adamw(group, [p for p, a in zip(params, adam) if a])
                pre = [p for p, a in zip(params, adam) if not a]
                if pre:
                    due.extend(self._precond_step(group, pre))
            for p, key in carried:  # a parameter this step did not reach, too
                self.background.settle(p, key)
            self.schedule.step_end(due)
        finally:
            self.placement.end_step()
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
        # a globally blocked parameter is skipped on every rank
        return self.run.blocking.agree(params, finite)

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
            lay = self.run.layout(p, group)
            phase = "step"
            if not st:
                self.method.create_state(p, group, lay)
                self.method.fixed_state(p, group, lay)
                self.cadence.fixed_state(p, group)
                self.schedule.fixed_state(p, group, lay)
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
        glob = [p for p in params if self.run.blocking.has(p)]
        glob_set = set(glob)
        grads, weights = self.run.blocking.gather(glob) if glob else ({}, {})  # the owned blocks
        for p in params:
            if p not in grads:
                grads[p] = self.run.layouts[p].blocks(real(p.grad))
                weights[p] = self.run.layouts[p].blocks(real(p))
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
                if self.placement.off_device and i + 1 < len(work):
                    # this chunk, then the next one, so its copy overlaps this one's compute (as
                    # far as the ring has room)
                    self.placement.stage([members, work[i + 1][2]], reason="step")
                g = torch.stack([grads[p][j] for p, j in members]).to(dtype)
                ws = [weights[p][j] for p, j in members]
                # whole parameters to an optimizer that updates them where they are: no stack of
                # them to make and copy back
                # (an expert's rows of a contiguous parameter are such a block too)
                in_place = self.method.weights_in_place and all(
                    p not in glob_set and (self.run.layouts[p].whole or (
                        self.run.layouts[p].row_blocks and real(p).is_contiguous()))
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
                        self.run.layouts[p].write(real(p), j, wi)
                dims = [i for i, h in enumerate(self.method.has_factor(bshape, group)) if h]
                if dims:
                    due.extend((REFRESH, p, j, dims) for (p, j), k in zip(members, steps)
                               if self.cadence.comes_due(group, k))
        finally:  # the jobs the stacks that ran made (an interrupted step's too): started after
            self.background.start_due()  # the last one, not competing with the step for memory
        if glob:
            self.run.blocking.scatter()  # the new rows back to the ranks holding them
        # jobs are batched in parameter order, whatever order the step ran in
        due.sort(key=lambda d: (self.run.pindex[d[1]], d[2]))
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
                if self.run.blocking.has(p):
                    cand[p] = ts or [torch.zeros(())]  # no block here: the owners decide
                elif ts:
                    cand[p] = ts
        return self._agreed_zero(cand)

    def _agreed_zero(self, cand: dict) -> set:
        """``_all_zero``, decided by all ranks together for the FSDP2 parameters of
        ``fsdp_blocking="global"`` (their state is spread over the ranks, its step count one)."""
        out = self._all_zero(cand)
        glob = sorted((p for p in cand if self.run.blocking.agrees(p)),
                      key=lambda p: self.run.pindex[p])
        if glob:
            agreed = self.run.blocking.agree(glob, [p in out for p in glob])
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

    def asteria_stats(self) -> dict:
        """engine.stats() plus this optimizer's counters, optimizer-state bytes per tier (the
        staging ring counts as device bytes), copy bytes per direction and NVMe bandwidth."""
        stats = {k: 0 for k in STATS_KEYS}
        stats["nvme_read_MBps"] = stats["nvme_write_MBps"] = 0.0
        stats["bytes_device_ring"] = 0
        stats.update(self.run.engine.stats())
        stats.update(self.run.counters)
        stats.update(self.run.blocking.stats())
        stats["overflow_skipped"] = 0
        stats.update({k: int(v) for k, v in self.schedule.lazy_counts.items()})
        dev = 0
        plan = self.placement.plan
        for p, st in self.run.param_states():
            pidx = self.run.pindex.get(p)
            for name, v in dict.items(st):
                if K.is_pending_output(name):  # placeholders: views of one shared zero
                    continue
                if isinstance(v, torch.Tensor) and (plan is None or
                                                    plan.tier((pidx, name)) == "device"):
                    dev += v.numel() * v.element_size()
        stats["bytes_state_device"] = dev
        stats["bytes_h2d"] = stats.get("bytes_h2d_results", 0)
        stats["bytes_d2h"] = stats.get("bytes_d2h_snapshots", 0)
        ts = self.placement.stats()
        if ts is not None:
            h2d, d2h = ts.pop("bytes_h2d"), ts.pop("bytes_d2h")
            stats.update(ts)
            stats["bytes_h2d"] += h2d
            stats["bytes_d2h"] += d2h
            dev += self.placement.plan.ring_bytes
        stats["bytes_device"] = dev
        stats.setdefault("install_waits", 0)
        stats.setdefault("install_wait_ns", 0)
        # S as applied now, whether an "auto" S or f was chosen yet, the capacity figures
        stats.update(self.cadence.stats(self.schedule.defers()))
        return stats

    def asteria_plan(self) -> list[str]:
        """The planner's decisions, then the capacity report (asteria.refresh.capacity): work per
        round, predicted and measured round seconds, the window S x step time, the pool's
        utilisation and the smallest S (and worker count) that hides the refresh; whether a
        device executor runs part of it. The capacity lines come once a round was submitted."""
        lines = self.placement.decisions()
        # before the first round there is nothing measured to report: the planner's decisions
        # alone (as logged at construction)
        lines.extend(self.cadence.plan_lines(self.schedule.defers()))
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
        if "run" in vars(self):
            return self
        fin = getattr(self, "_finalizer", None)  # forwarded to the wrapped optimizer
        alive = fin.peek() if isinstance(fin, weakref.finalize) else None
        return alive[0] if alive is not None else None

    def _close(self, detier: bool) -> None:
        # the object's own attributes only: read through a wrapper's forwarding __getattr__,
        # the wrapped optimizer's would make the wrapper's teardown close that one
        own = vars(self)
        run = own.get("run")
        if run is None or run.closed:
            return
        if detier:
            self.schedule.settle()  # a step end a signal interrupted: its installs are state
        background = own.get("background")
        if detier and background:
            background.settle_all()
        run.closed = True
        if detier:
            plain = self.placement.detier()
            if plain is not None:
                self.state = plain
        fin = own.get("_finalizer")
        if fin is not None:
            fin()
            return
        if run.engine is not None:
            run.engine.close()

    def __del__(self) -> None:
        try:
            # the dying object's own engine only (a dropped wrapper has none); a dying
            # optimizer's state need not be kept
            self._close(detier=False)
        except Exception:  # interpreter shutdown: the engine module may already be gone
            pass

    # ---- checkpoints: the checkpoint part's (asteria.optim.checkpoint) ------------------------
    def state_dict(self) -> dict:
        return self.checkpoint.state_dict()

    state_dict.__doc__ = Checkpoint.state_dict.__doc__

    def load_state_dict(self, state_dict: dict) -> None:
        self.checkpoint.load_state_dict(state_dict)
        for group in self.param_groups:  # a state dict from before a value went by name
            self.method.normalize_group(group)

    load_state_dict.__doc__ = Checkpoint.load_state_dict.__doc__

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy`` and pickle keep: the param groups (their parameters, which a
        deepcopy copies along with the model when both are copied together), the runtime config
        and ``state_dict()`` (refreshes in flight waited for and kept, not installed). The copy
        is a working optimizer with its own runtime: it continues bitwise like the original
        would. The workers, buffers and tiered blocks are the original's and are not copied."""
        run = getattr(self, "run", None)  # a wrapper's: the optimizer's it forwards to
        if run is None or run.closed:
            raise RuntimeError(f"cannot copy or pickle a closed {type(self).__name__}: copy it "
                               f"before close(), or build a new one and load_state_dict() "
                               f"its state_dict()")
        return {"param_groups": self.param_groups, "defaults": self.defaults,
                "runtime": self.run.cfg, "state_dict": self.state_dict(),
                "names": dict(self.run.names)}

    def __setstate__(self, state: dict) -> None:
        if "runtime" not in state:  # torch.optim's load_state_dict sets state this way
            super().__setstate__(state)
            return
        groups = [dict(g) for g in state["param_groups"]]
        AsteriaOptimizer.__init__(self, groups, state["defaults"], state["runtime"])
        self.run.names.update(state.get("names", {}))
        self.load_state_dict(state["state_dict"])

    # ---- placement: the part's (asteria.optim.placement) --------------------------------------
    def asteria_memory_plan(self) -> dict:
        return self.placement.memory_plan()

    asteria_memory_plan.__doc__ = Placement.memory_plan.__doc__

    @property
    def capacity(self):
        """The capacity record of this optimizer's REFRESH work (asteria.refresh.capacity)."""
        return self.cadence.capacity

    def _asteria_prefetch(self, params: Iterable, reason: str = "") -> int:
        """Stage the roots / eigenbases of params into the ring (the hooks' call)."""
        return self.placement.prefetch(params, reason=reason)

    def _asteria_fetch_early(self, params: Iterable) -> None:
        """Read params' NVMe-resident blocks back into host memory (the hooks' call)."""
        self.placement.fetch_early(params)
