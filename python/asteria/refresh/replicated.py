"""The replicated executor: preconditioner blocks replicated across ranks (DDP, HSDP): one
owner computes each block's REFRESH, the other replicas receive it, and every replica installs
the same version at the same step (DESIGN.md "Distributed", docs/coherence.md for the
protocol, docs/distributed.md for this layer).

Owns: ``ReplicatedEngine``, the ``Engine`` the optimizers see in a distributed run, with its
channels (one per replica set and staleness budget) over the links of ``asteria.distributed``.
It wraps the ordinary engine (``HostPoolEngine`` or ``InlineTorchEngine``): a replicated job's
entries are split between their owners (the CoherenceRegistry's LPT rule,
``asteria._C.Coherence``), each rank submits only the entries it owns to the inner engine, and
the job completes through the coherence protocol (``asteria.refresh.coherence_protocol``: the
units, the channels and the thread that runs them).
Sharded (FSDP2) or unreplicated blocks go straight to the inner engine.
May call: torch, torch.distributed (gloo process groups only), asteria.distributed,
asteria.refresh (engine, ops, coherence_protocol), asteria._C.

Threads. The training thread calls the Engine methods and is the only caller of the inner
engine. One daemon thread per engine (``CoherenceProtocol``, "asteria-coherence") runs the
protocol of each *unit* (the replicated jobs of one replica set snapshotted at one step, with
one install step) in submission order, which is the same on every replica, so every process
group sees its collectives in the same order everywhere. They share: the unit queue
(``queue.Queue``); per unit two ``threading.Event`` (``owner_ready``: the training thread handed
over this rank's results; ``done``: the protocol finished) and the fields each Event publishes;
the registries (``_C.Coherence``, every call under the GIL; the training thread uses a second
registry of each channel, the *planner*, for owner lookups at submit time, and brackets its
barrier waits on the protocol registry). The training thread hands results over at every
``step_end``/``drain`` (never blocking) and, blocking, when it needs a unit (``wait``): that
wait is the bounded barrier. So traffic runs while the training thread computes, and a unit
whose owners finished within the S steps of its window costs the install step nothing.
"""
from __future__ import annotations

import dataclasses
import itertools
import warnings
from typing import Any, Iterable, Optional, Sequence

import torch

from asteria.distributed import Topology, _dist, _initialized, _Link, make_topology, replicas
from asteria.refresh.coherence_protocol import (Channel, CoherenceError, CoherenceProtocol,
                                                ReplicatedJob, Unit)
from asteria.refresh.engine import NO_OPTIONS, NO_TRACE, Engine, Result, SubmitOptions, Tracer
from asteria.refresh.ops import check_op, output_spec

_ID_BITS = 20           # coherence block id = (engine block key << _ID_BITS) | batch index
_LEVELS = ("intra_node", "inter_node", "flat", "flat_inter_node")


# ---- the engine -------------------------------------------------------------------------------

class ReplicatedEngine(Engine):
    """An Engine whose replicated jobs are computed once, by their owners, and reach every
    replica through the CoherenceRegistry (see the module doc). ``submit`` takes one more keyword,
    ``replicas``: the global ranks holding the job's blocks (None: rank-local)."""

    replicated = True

    def __init__(self, inner: Engine, topo: Topology, replica_sets: Iterable[Sequence[int]],
                 *, hierarchical: bool = True, tracer: Tracer = NO_TRACE) -> None:
        self._inner = inner
        self.tracer = tracer
        self._closed = False
        self._final_stats: Optional[dict] = None
        self._topo = topo
        self._hier = hierarchical
        self._all_sets = sorted({tuple(sorted(s)) for s in replica_sets if len(s) > 1})
        self._links = _Link.create_all(self._all_sets, topo, hierarchical)
        self._channels: dict[tuple, Channel] = {}
        self._jobs: dict[int, Any] = {}
        self._tickets = itertools.count(1)
        self._open: dict[tuple, Unit] = {}     # channel key -> unit still being submitted
        self._to_push: list[Unit] = []         # flushed units whose owner results are pending
        self._proto = CoherenceProtocol(topo, self)

    # ---- Engine -------------------------------------------------------------------------------
    def submit(self, op, f, q=None, *, block, version, deadline, snapshot_step, p=0.0, eps=0.0,
               b=None, opts: SubmitOptions = NO_OPTIONS) -> int:
        """``opts.replicas``: the ranks holding the blocks (None or one rank: a rank-local job,
        the inner executor's). A replicated job's channel budget is the S the schedule applies
        to it, ``deadline - snapshot_step``; it takes no ``b`` (the ops with one write state
        in the background, rank-local)."""
        self._check()
        ticket = next(self._tickets)
        ranks = opts.replicas
        if ranks is None or len(ranks) < 2:
            self._jobs[ticket] = self._inner.submit(op, f, q, block=block, version=version,
                                                    deadline=deadline,
                                                    snapshot_step=snapshot_step, p=p, eps=eps,
                                                    b=b, opts=opts)
            return ticket
        if b is not None:
            raise ValueError(f"a replicated {op} job takes no b: the ops with one are "
                             f"rank-local background writes")
        check_op(op, (f, q))
        link = self._links.get(ranks)
        if link is None:
            raise ValueError(f"replica set {ranks} was not declared when the engine was built "
                             f"(known: {sorted(self._links)}); build the optimizer after the "
                             "model is wrapped, on every rank")
        staleness = int(deadline) - int(snapshot_step)
        channel = self._channel(link, staleness)
        batch, n = int(f.shape[0]), int(f.shape[-1])
        if batch >= 1 << _ID_BITS:
            raise ValueError(f"a REFRESH batch of {batch} entries is too large to replicate")
        ids = [(int(block) << _ID_BITS) | i for i in range(batch)]
        new = [b for b in ids if b not in channel.known]
        from asteria import _C

        cost = _C.coherence_dim_cost(n)
        if new:
            channel.planner.extend(new, [cost] * len(new), replicas=list(ranks))
            channel.known.update(new)
        me = self._topo.rank
        owned = [i for i, b in enumerate(ids) if channel.planner.owner(b) == me]
        inner = None
        if owned:
            sel = owned if len(owned) < batch else None
            fo = f if sel is None else f[sel]
            qo = q if (q is None or sel is None) else q[sel]
            inner = self._inner.submit(op, fo, qo, block=block, version=version,
                                       deadline=deadline, snapshot_step=snapshot_step, p=p,
                                       eps=eps, opts=opts)
        host = opts.host_outputs
        job = ReplicatedJob(ticket=ticket, op=op, batch=batch, spec=output_spec(op, n, f.dtype),
                    device=torch.device("cpu") if host else f.device, host_outputs=host,
                    ids=ids, owned=owned, inner=inner, block=int(block), version=int(version),
                    snapshot_step=int(snapshot_step))
        key = (link.ranks, staleness)
        unit = self._open.get(key)
        if unit is not None and (unit.snapshot_step, unit.deadline) != (snapshot_step, deadline):
            self._flush()
            unit = None
        if unit is None:
            unit = self._open[key] = Unit(channel, snapshot_step, deadline)
        unit.jobs.append(job)
        unit.new_ids.extend(new)
        unit.new_costs.extend([cost] * len(new))
        job.unit = unit
        self._jobs[ticket] = job
        return ticket

    def ready(self, ticket: int) -> bool:
        job = self._job(ticket)
        if not isinstance(job, ReplicatedJob):
            return self._inner.ready(job)
        # A replicated result is installed at its install step only (install="eager" has no
        # distributed counterpart: timing would pick the version and replicas would drift).
        self._flush()
        self._push(block=False)
        return False

    def wait(self, ticket: int) -> Result:
        job = self._job(ticket)
        if not isinstance(job, ReplicatedJob):
            del self._jobs[ticket]
            return dataclasses.replace(self._inner.wait(job), ticket=ticket)
        unit = job.unit
        self._flush()
        if not unit.done.is_set():  # the bounded barrier: bracketed, so it is counted
            reg = unit.channel.reg
            reg.barrier_begin(unit.deadline)
            try:
                self._push(block=True, upto=unit)
                self._wait_done(unit)
            finally:
                reg.barrier_end(unit.deadline)
            unit.channel.late_units += 1
        if unit.error is not None:
            raise CoherenceError(str(unit.error)) from unit.error
        del self._jobs[ticket]
        return job.result

    def cancel(self, ticket: int) -> bool:
        job = self._jobs.get(ticket)
        if job is None or self._closed:
            return False
        if not isinstance(job, ReplicatedJob):
            return self._inner.cancel(job)
        if job.inner is None or job.inner_result is not None:
            return False
        # The owner announces nothing for a cancelled job: every replica sees it fail.
        return self._inner.cancel(job.inner)

    def note_install(self, snapshot_step: int, install_step: int) -> None:
        self._inner.note_install(snapshot_step, install_step)

    def note_nonfinite(self) -> None:
        self._inner.note_nonfinite()

    def step_end(self, step: int) -> None:
        """The optimizer's step ``step`` ends: hand finished owner results to the protocol
        (never blocks) and surface a failure of the protocol now, not at the install step."""
        self._proto.step = step
        self._flush()
        self._push(block=False)
        if self._proto.error is not None:
            raise CoherenceError(str(self._proto.error)) from self._proto.error

    def drain(self) -> int:
        n = self._inner.drain()
        if not self._closed:
            self._flush()
            self._push(block=False)
        return n

    def stats(self) -> dict[str, Any]:
        """The inner engine's counters, this engine's (coherence_*), and the registries' byte
        counters per level (bytes_intra_node, bytes_inter_node, bytes_flat,
        bytes_flat_inter_node) summed over channels; per staleness budget, the units, their
        bounded-barrier waits and the smallest window slack (install step minus the step at
        which their traffic was done). After close: the final values, units in flight
        included."""
        if self._final_stats is not None:
            out = dict(self._final_stats)
            out.update({k: v for k, v in self._inner.stats().items() if k not in out})
            return out
        return self._stats_open()

    def _stats_open(self) -> dict[str, Any]:
        out = dict(self._inner.stats())
        out.update(self._proto.counters)
        agg = {f"bytes_{lv}": 0 for lv in _LEVELS}
        agg.update({"coherence_blocks": 0, "coherence_owned": 0, "coherence_load": 0,
                    "coherence_published": 0, "coherence_received": 0, "coherence_installs": 0,
                    "coherence_barrier_waits": 0, "coherence_barrier_wait_ns": 0,
                    "coherence_barrier_max_wait_ns": 0, "coherence_max_lag_steps": -1,
                    "coherence_late_units": 0})
        per_s: dict = {}
        for (ranks, s), ch in self._channels.items():
            if ch.reg.closed:
                continue
            st = ch.reg.stats()
            for lv in _LEVELS:
                agg[f"bytes_{lv}"] += st[f"bytes_{lv}"]
            for k in ("blocks", "owned", "load", "published", "received", "installs",
                      "barrier_waits", "barrier_wait_ns"):
                agg[f"coherence_{k}"] += st[k]
            agg["coherence_barrier_max_wait_ns"] = max(agg["coherence_barrier_max_wait_ns"],
                                                       st["barrier_max_wait_ns"])
            agg["coherence_max_lag_steps"] = max(agg["coherence_max_lag_steps"],
                                                 st["max_lag_steps"])
            agg["coherence_late_units"] += ch.late_units
            d = per_s.setdefault(s, {"units": 0, "late_units": 0, "barrier_waits": 0,
                                     "barrier_wait_ns": 0, "min_window_slack": None})
            d["units"] += ch.units
            d["late_units"] += ch.late_units
            d["barrier_waits"] += st["barrier_waits"]
            d["barrier_wait_ns"] += st["barrier_wait_ns"]
            if ch.min_slack is not None:
                d["min_window_slack"] = (ch.min_slack if d["min_window_slack"] is None
                                         else min(d["min_window_slack"], ch.min_slack))
        out.update(agg)
        out["coherence_by_staleness"] = per_s
        out["coherence_topology"] = {"world": self._topo.world, "rank": self._topo.rank,
                                     "node": self._topo.node,
                                     "ranks_per_node": self._topo.ranks_per_node,
                                     "hierarchical": self._hier}
        return out

    def close(self) -> None:
        """Finish the units in flight (every replica closes too, so their collectives complete;
        bounded by the collective timeout), stop the thread, close the inner engine."""
        if self._closed:
            return
        self._closed = True
        self._proto.closing = True
        try:
            self._flush()
            if self._proto.error is None and self._proto.thread.is_alive():
                self._push(block=True)
        except Exception as exc:  # the inner engine failed: the peers time out, we go on
            warnings.warn(f"asteria: coherence close could not finish the units in flight: "
                          f"{exc}", RuntimeWarning, stacklevel=2)
        finally:
            for unit in self._to_push:
                unit.owner_ready.set()
            self._proto.queue.put(None)
            self._proto.thread.join(self._topo.timeout.total_seconds() + 5.0)
            self._proto.liveness.stop()
            self._final_stats = self._stats_open()
            try:
                self._inner.close()
            finally:
                if not self._proto.thread.is_alive():
                    for ch in self._channels.values():
                        ch.reg.close()
                        ch.planner.close()
                for link in self._links.values():
                    link.staging.close()

    # the cost model is the inner engine's
    @property
    def model(self) -> Any:
        return self._inner.model

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def declare(self, replica_sets: Iterable[Sequence[int]]) -> None:
        """Create the groups of replica sets not seen yet (collective: every rank, same sets)."""
        new = sorted({tuple(sorted(s)) for s in replica_sets if len(s) > 1} - set(self._all_sets))
        if new:
            base = len(self._all_sets)
            self._all_sets.extend(new)
            self._links.update(_Link.create_all(new, self._topo, self._hier, first_index=base))

    # ---- training-thread internals ------------------------------------------------------------
    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("ReplicatedEngine is closed")
        if self._proto.error is not None:
            raise CoherenceError(str(self._proto.error)) from self._proto.error

    def _channel(self, link: _Link, staleness: int) -> Channel:
        key = (link.ranks, staleness)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = Channel(link, staleness, self._topo)
        return ch

    def _flush(self) -> None:
        """Queue the units whose submission is complete, in channel creation order."""
        if not self._open:
            return
        for key in [k for k in self._channels if k in self._open]:
            unit = self._open.pop(key)
            self._to_push.append(unit)
            self._proto.queue.put(unit)

    def _push(self, block: bool, upto: Optional[Unit] = None) -> None:
        """Hand this rank's owner results to the protocol: every unit whose results are ready
        (block=False), or every unit up to ``upto`` (or all), waiting for them (block=True)."""
        remaining = []
        for i, unit in enumerate(self._to_push):
            must = block and (upto is None or upto in self._to_push[i:])
            complete = True
            for job in unit.jobs:
                if job.inner is None or job.inner_result is not None:
                    continue
                if must or self._inner.ready(job.inner):
                    job.inner_result = self._inner.wait(job.inner)
                else:
                    complete = False
            if complete:
                unit.owner_ready.set()
            else:
                remaining.append(unit)
        self._to_push = remaining

    def _wait_done(self, unit: Unit) -> None:
        while not unit.done.wait(0.05):
            if not self._proto.thread.is_alive():
                raise CoherenceError(f"rank {self._topo.rank}: the coherence thread stopped "
                                     f"({self._proto.error})")


def wrap_engine(engine: Engine, params: Iterable[torch.Tensor], *, hierarchical: bool = True,
                ranks_per_node: Optional[int] = None, timeout_s: Optional[float] = None,
                tracer: Tracer = NO_TRACE) -> Engine:
    """The engine an optimizer over ``params`` uses: ``engine`` itself unless torch.distributed
    is initialised with several ranks and some rank holds replicated parameters, else a
    ReplicatedEngine around it (an existing ReplicatedEngine learns the replica sets of
    ``params``, for add_param_group). Collective over the default group: every rank builds its
    optimizer, except one whose parameters were all declared rank-local
    (``set_replicas(params, None)``). ``hierarchical``, ``ranks_per_node``, ``timeout_s``: the
    runtime keys coherence_topology ("hier"), ranks_per_node and coherence_timeout_s, for a new
    ReplicatedEngine (``asteria.distributed.make_topology``). ``tracer``: the optimizer's
    tracer, for a new ReplicatedEngine."""
    params = list(params)
    if not _initialized() or _dist().get_world_size() == 1:
        return engine
    if params and all(getattr(p, "_asteria_replicas", ()) is None for p in params):
        return engine
    dist = _dist()
    sets = sorted({r for r in (replicas(p) for p in params) if r is not None})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sets)
    every = sorted({tuple(s) for g in gathered for s in g})
    if isinstance(engine, ReplicatedEngine):
        engine.declare(every)
        return engine
    if not every:
        return engine
    return ReplicatedEngine(engine, make_topology(ranks_per_node, timeout_s), every,
                             hierarchical=hierarchical, tracer=tracer)
