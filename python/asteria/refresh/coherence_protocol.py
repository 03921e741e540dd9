"""The coherence protocol of replicated REFRESH results: one owner computes each replicated
block, its result reaches every replica, and every replica installs the same version at the
same step (docs/coherence.md for the protocol, docs/distributed.md for this layer).

Owns: the units of replicated work (``Unit``: the replicated jobs of one replica set
snapshotted at one step, with one install step; ``ReplicatedJob``: one job's entries, owned and not)
and the channels they run on (``Channel``: one per replica set and staleness budget, with its
registries), and ``CoherenceProtocol``: the daemon thread ("asteria-coherence") that runs each
unit's protocol in submission order (version exchange on ``ctrl``, the transfer of the due
blocks, hierarchical through host memory or flat; the results every replica installs), with
its counters and the error that stopped it, which names the lost peers (``_Liveness``: each
rank's heartbeat in the job's store). ``asteria.refresh.replicated.ReplicatedEngine`` makes the
units and hands them over. May call: torch, torch.distributed (gloo process groups only, and the
default group's store for the heartbeats), ``asteria.distributed``, ``asteria.refresh.engine``,
``asteria._C``.

Threads. The protocol thread runs ``CoherenceProtocol._loop`` and everything it calls; the
training thread (the engine) only puts units on ``queue``, sets each unit's ``owner_ready``
once this rank's owner results are in its jobs, waits on its ``done``, writes ``step`` (read
here for the window slack) and ``closing`` (set once, at close), and reads ``error`` and
``counters``. Per unit the two ``threading.Event`` order the fields they publish; the
registries (``_C.Coherence``) are called under the GIL. A second daemon thread per engine
("asteria-coherence-beat") only adds to this rank's heartbeat counter in the store. After a
failure the protocol thread writes this rank's failure report and reads its peers' counters and
reports through a third, short-lived one ("asteria-coherence-peers"), so that a store that does
not answer holds it for a bounded wait only.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Optional, Sequence

import torch

from asteria import _C
from asteria.distributed import _ALIGN, Topology, _dist, _Link
from asteria.refresh.engine import Result

AST_EFAILED = _C.AST_EFAILED
# Heartbeats: every rank of an engine adds 1 to its counter in the store every _BEAT_S (one
# small request a second: torchelastic's keep-alive, at its scale); after a failed collective a
# rank names as lost the peers whose counters did not move in _BEATS_MISSED periods and that
# reported no failure of their own.
_BEAT_S = 1.0
_BEATS_MISSED = 3


# ---- jobs, units, channels --------------------------------------------------------------------

def _nbytes(spec) -> int:
    return sum(int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
               for shape, dt in spec)


@dataclasses.dataclass
class ReplicatedJob:
    ticket: int
    op: str
    batch: int
    spec: list
    device: torch.device
    host_outputs: bool
    ids: list[int]
    owned: list[int]                # batch indices this rank computes
    inner: Optional[int]            # the inner engine's ticket for them
    block: int
    version: int
    snapshot_step: int
    unit: Any = None
    inner_result: Optional[Result] = None
    result: Optional[Result] = None

    def __post_init__(self) -> None:
        self.owned_pos = {i: k for k, i in enumerate(self.owned)}


class Unit:
    """The replicated jobs of one channel snapshotted at one step: one exchange, one transfer."""

    def __init__(self, channel: "Channel", snapshot_step: int, deadline: int):
        self.channel = channel
        self.snapshot_step = snapshot_step
        self.deadline = deadline
        self.jobs: list[ReplicatedJob] = []
        self.new_ids: list[int] = []
        self.new_costs: list[int] = []
        self.owner_ready = threading.Event()
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.completed_step: Optional[int] = None


class Channel:
    """One (replica set, staleness) pair: a registry for the protocol (comm thread) and a planner
    registry with the same registrations for owner lookups at submit time (training thread)."""

    def __init__(self, link: _Link, staleness: int, topo: Topology):
        from asteria import _C

        args = dict(ranks_per_node=1, node_ids=list(topo.nodes), staleness=staleness)
        self.link = link
        self.staleness = staleness
        self.reg = _C.Coherence(topo.world, topo.rank, **args)
        self.planner = _C.Coherence(topo.world, topo.rank, **args)
        self.known: set[int] = set()
        self.plans: dict[int, dict] = {}
        self.units = 0
        self.late_units = 0
        self.min_slack: Optional[int] = None

    def plan(self, block: int) -> dict:
        p = self.plans.get(block)
        if p is None:
            p = self.plans[block] = self.reg.hier_plan(block)
        return p


class CoherenceError(RuntimeError):
    """The coherence protocol failed on this rank (a peer died or timed out, a protocol check)."""


class _Liveness:
    """This rank's heartbeat and failure report, and a reading of its peers', in the job's store
    (which torchrun's agent hosts: it outlives the ranks). A failed collective does not say which
    peer is gone (gloo names an address, which a node's ranks share), and the peers cannot be
    asked: a live one may be blocked in a collective with another survivor until that survivor's
    process exits. Its heartbeat, on a thread of its own, goes on meanwhile; a survivor that
    failed and exited has reported its failure first; a dead or hung process does neither."""

    def __init__(self, topo: Topology) -> None:
        self._key = f"asteria-coherence/{topo.run_id}/"
        self._rank = topo.rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="asteria-coherence-beat",
                                        daemon=True)
        self._thread.start()

    @staticmethod
    def _store():
        return _dist().distributed_c10d._get_default_store()

    def _beat(self) -> None:
        try:
            store = self._store()
            while True:
                store.add(f"{self._key}beat/{self._rank}", 1)
                if self._stop.wait(_BEAT_S):
                    return
        except Exception:
            return  # no store, or it is gone: nobody can read the beats either

    def stop(self) -> None:
        self._stop.set()

    def failed(self, peers: Sequence[int], nodes: Sequence[int], name_lost: bool) -> str:
        """Report this rank's failure; with ``name_lost``, also say which of ``peers`` neither
        beat for _BEATS_MISSED periods nor reported a failure (words for an error message).
        Returns within about that many periods even when the store does not answer."""
        wait = _BEATS_MISSED * _BEAT_S if name_lost else 0.0
        found: dict = {}

        def ask() -> None:
            try:
                store = self._store()
                store.set(f"{self._key}failed/{self._rank}", "1")
                if not name_lost:
                    return
                beats = [f"{self._key}beat/{r}" for r in peers]
                before = [store.add(k, 0) for k in beats]
                time.sleep(wait)
                after = [store.add(k, 0) for k in beats]
                found["silent"] = [r for r, a, b in zip(peers, before, after) if a == b and
                                   not store.check([f"{self._key}failed/{r}"])]
            except Exception as exc:
                found["error"] = f"{type(exc).__name__}: {exc}"

        asker = threading.Thread(target=ask, name="asteria-coherence-peers", daemon=True)
        asker.start()
        asker.join(wait + 2.0)
        if not name_lost:
            return ""
        if "silent" not in found:
            return self._unreachable(peers, nodes, found.get("error"), wait + 2.0)
        silent = found["silent"]
        if not silent:
            return ", lost peers none (every peer beats or failed too)"
        where = sorted({nodes[r] for r in silent})
        return (f", lost peers {silent} (node{'s' if len(where) > 1 else ''} "
                f"{', '.join(map(str, where))}: no heartbeat for {wait:g} s, no failure "
                "reported)")

    def _unreachable(self, peers: Sequence[int], nodes: Sequence[int], error: Optional[str],
                     waited: float) -> str:
        """Words for a store that did not answer: where it is, and the peers on other nodes
        (with the store unreachable too, a failed collective most often means that this
        rank's node was cut off from the others, or the store's was)."""
        try:
            store = self._store()
            while hasattr(store, "underlying_store"):   # PrefixStores around the TCPStore
                store = store.underlying_store
            at = f" at {store.host}:{store.port}"
        except Exception:
            at = ""
        words = f"the store{at}: {error}" if error else \
            f"the store{at} did not answer in {waited:g} s"
        away = [r for r in peers if nodes[r] != nodes[self._rank]]
        if away:
            where = sorted({nodes[r] for r in away})
            words += (f"; this rank's node may be cut off from the others, or the store's "
                      f"host be gone: the peers on other nodes are {away} "
                      f"(node{'s' if len(where) > 1 else ''} {', '.join(map(str, where))})")
        return f", lost peers unknown ({words})"


class CoherenceProtocol:
    """The protocol thread of one ``ReplicatedEngine``: takes units from ``queue`` (None
    stops it) in submission order, waits for each one's ``owner_ready`` and runs its protocol;
    on a failure records ``error`` and fails every unit still queued."""

    def __init__(self, topo: Topology, owner: Any) -> None:
        self.topo = topo
        # the running thread keeps its engine alive: an engine ends through close(), which is
        # collective, never through the garbage collector while its units are in flight
        self._owner = owner
        self.queue: "queue.Queue[Optional[Unit]]" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.step = 0           # the training thread's last step end
        self.closing = False    # the engine is closing: a unit without its owners' results fails
        self.counters = {"coherence_units": 0, "coherence_entries_computed": 0,
                         "coherence_entries_received": 0, "coherence_transfer_ns": 0,
                         "coherence_exchange_bytes": 0}
        self.liveness = _Liveness(topo)
        self.thread = threading.Thread(target=self._loop, name="asteria-coherence", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            unit = self.queue.get()
            if unit is None:
                return
            unit.owner_ready.wait()
            if self.closing and self.error is None and not all(
                    j.inner is None or j.inner_result is not None for j in unit.jobs):
                self._fail(unit, CoherenceError("closed with the unit in flight"))
                return
            try:
                self._process(unit)
            except BaseException as exc:
                self._fail(unit, exc)
                return
            unit.completed_step = self.step
            ch = unit.channel
            ch.units += 1
            slack = unit.deadline - unit.completed_step
            ch.min_slack = slack if ch.min_slack is None else min(ch.min_slack, slack)
            unit.done.set()

    def _fail(self, unit: Unit, exc: BaseException) -> None:
        topo = self.topo
        ranks = unit.channel.link.ranks
        lost = self.liveness.failed([r for r in ranks if r != topo.rank], topo.nodes,
                                    name_lost=not isinstance(exc, (CoherenceError,
                                                                   _C.AsteriaError)))
        err = CoherenceError(
            f"asteria coherence failed on rank {topo.rank} (node {topo.node}) in the unit "
            f"snapshotted at step {unit.snapshot_step}, installed at step {unit.deadline}, "
            f"replica set {list(ranks)}{lost}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self.error = err
        pending = [unit]
        while True:
            try:
                nxt = self.queue.get_nowait()
            except queue.Empty:
                break
            if nxt is not None:
                pending.append(nxt)
        for u in pending:
            u.error = err
            u.done.set()

    def _process(self, unit: Unit) -> None:
        dist = _dist()
        ch, link = unit.channel, unit.channel.link
        reg, s, t = ch.reg, unit.deadline, unit.snapshot_step
        t0 = time.monotonic_ns()
        if unit.new_ids:
            reg.extend(unit.new_ids, unit.new_costs, replicas=list(link.ranks))
        entries = [(job, i) for job in unit.jobs for i in range(job.batch)]
        where: dict[int, tuple] = {}
        for k, (job, i) in enumerate(entries):
            where[job.ids[i]] = (job, i, k)
        status = torch.zeros(len(entries), dtype=torch.int64)
        for job in unit.jobs:
            res = job.inner_result
            for i in job.owned:
                k = where[job.ids[i]][2]
                if res is None:
                    status[k] = -AST_EFAILED
                elif res.status == 0:
                    reg.publish(job.ids[i], job.version, t)
                else:
                    status[k] = -res.status
        nb = reg.nblocks()
        vec = torch.empty(3 * nb + len(entries), dtype=torch.int64)
        reg.versions_export(s, vec[:3 * nb].numpy())
        vec[3 * nb:] = status
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=link.ctrl)
        self.counters["coherence_exchange_bytes"] += vec.numel() * 8
        reg.versions_import(s, vec[:3 * nb].numpy())
        status = vec[3 * nb:]
        due = reg.due(s)
        payload: dict[int, list] = {}
        for b in due:
            if b not in where:
                raise CoherenceError(f"block {b} is due at step {s} but is no part of this "
                                     "unit: the replicas submitted different jobs")
            job, i, _ = where[b]
            pos = job.owned_pos.get(i)
            if pos is not None:
                payload[b] = [o[pos] for o in job.inner_result.outputs]
        if due:
            received = self._transfer(ch, due, where, payload)
            for b in due:
                job, i, _ = where[b]
                if b in received:
                    payload[b] = received[b]
                    reg.received(b, job.version, s)
                    self.counters["coherence_entries_received"] += 1
                reg.mark_synced(b, job.version, s)
        for job in unit.jobs:
            ok, code = True, 0
            for i in range(job.batch):
                b = job.ids[i]
                if reg.install_version(b, s) != job.version:
                    ok = False
                    code = code or -int(status[where[b][2]]) or AST_EFAILED
            job.result = self._result(job, ok, code, payload)
        self.counters["coherence_units"] += 1
        self.counters["coherence_entries_computed"] += sum(len(j.owned) for j in unit.jobs)
        self.counters["coherence_transfer_ns"] += time.monotonic_ns() - t0

    def _result(self, job: ReplicatedJob, ok: bool, code: int, payload: dict) -> Result:
        if not ok:
            res = job.inner_result
            if res is not None and res.status:
                error = res.error
            else:
                from asteria import _C

                error = (f"{job.op}: refresh failed on its owner ({_C.err_name(code)}: "
                         f"{_C.strerror(code)}); previous preconditioner kept")
            return Result(ticket=job.ticket, block=job.block, version=job.version,
                          snapshot_step=job.snapshot_step, status=code, outputs=None,
                          error=error)
        outputs = []
        for k in range(len(job.spec)):
            parts = [payload[job.ids[i]][k].to(job.device) for i in range(job.batch)]
            outputs.append(torch.stack(parts))
        retried = bool(job.inner_result.retried_f64) if job.inner_result is not None else False
        return Result(ticket=job.ticket, block=job.block, version=job.version,
                      snapshot_step=job.snapshot_step, status=0, outputs=tuple(outputs),
                      retried_f64=retried)

    def _transfer(self, ch: Channel, due: Sequence[int], where: dict,
                  payload: dict) -> dict[int, list]:
        """Move the due blocks from their owners to every replica (hierarchically or flat) and
        count the bytes; returns the blocks this rank received, as output tensors."""
        dist = _dist()
        link, reg, me = ch.link, ch.reg, self.topo.rank
        plans = {b: ch.plan(b) for b in due}
        sizes = {b: _nbytes(where[b][0].spec) for b in due}
        if link.hierarchical:
            order = sorted(due, key=lambda b: (plans[b]["inter_root"], b))
            src_of = {b: plans[b]["inter_root"] for b in due}
        else:
            order = sorted(due, key=lambda b: (plans[b]["owner"], b))
            src_of = {b: plans[b]["owner"] for b in due}
        offsets, regions, pos = {}, {}, 0
        for b in order:
            offsets[b] = pos
            lo, _ = regions.get(src_of[b], (pos, pos))
            pos += sizes[b]
            regions[src_of[b]] = (lo, pos)
            pos = (pos + _ALIGN - 1) // _ALIGN * _ALIGN
        parity = link.units % 2
        link.units += 1
        buf = link.staging.get(max(pos, 1), parity) if link.hierarchical else \
            torch.empty(max(pos, 1), dtype=torch.uint8)
        for b in order:
            if plans[b]["owner"] == me:
                off = offsets[b]
                for tensor in payload[b]:
                    raw = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
                    buf[off:off + raw.numel()].copy_(raw)
                    off += raw.numel()
        if link.hierarchical:
            if link.node_group is not None:
                dist.barrier(group=link.node_group)
                link.staging.mapped()
            if link.reps_group is not None:
                for root in sorted(regions):
                    lo, hi = regions[root]
                    dist.broadcast(buf[lo:hi], src=root, group=link.reps_group)
            if link.node_group is not None and any(
                    plans[b]["owner_node"] != self.topo.node for b in due):
                dist.barrier(group=link.node_group)  # the representative wrote the rest
        else:
            for root in sorted(regions):
                lo, hi = regions[root]
                dist.broadcast(buf[lo:hi], src=root, group=link.ctrl)
        received = {}
        for b in due:
            plan, nbytes = plans[b], sizes[b]
            if plan["owner"] != me:
                off, outs = offsets[b], []
                for shape, dt in where[b][0].spec:
                    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
                    outs.append(buf[off:off + n].clone().view(dt).reshape(shape))
                    off += n
                received[b] = outs
            if link.hierarchical:
                if plan["recv_level"] is not None:
                    reg.count_bytes(plan["recv_level"], nbytes)
            elif plan["flat_recv"]:
                reg.count_bytes("inter_node" if plan["flat_recv_inter"] else "intra_node",
                                nbytes)
            if plan["flat_recv"]:
                reg.count_bytes("flat", nbytes)
            if plan["flat_recv_inter"]:
                reg.count_bytes("flat_inter_node", nbytes)
        return received
