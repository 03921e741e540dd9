"""The REFRESH round of each replica set of a distributed job (``replica_round``).

Replicas (``--nodes``, ``--gpus-per-node``, ``--parallel``). In a distributed run each
replicated factor has one owner, who computes it on its own host workers (docs/distributed.md
"DDP and HSDP: one owner per block"), so a round of a replica set is divided among its ranks.
The planner asks the coherence registry itself (``asteria._C.Coherence``) for the owners, fed
as ``ReplicatedEngine`` feeds it: per replica set one registry, one ``extend`` per batch of a
round (the factors of one size, in the optimizer's order: parameters, blocks, dimensions;
entry ids ``(batch key << 20) | index``, cost n^3 each). Each owner's jobs are priced on its
``cores``; a replica set's round is its slowest owner's. Layouts (``PARALLEL``): ``ddp``: every
weight on all nodes x GPUs ranks, one replica set; ``hsdp``: dim 0 sharded over the GPUs of a
node (FSDP2's Shard(0), torch.chunk rows: ceil(rows / G) per rank, the last ranks get fewer or
none), each rank's shard blocked alone (``fsdp_blocking="local"``), the shard replicated on the
same local rank of every node; ``fsdp``: dim 0 sharded over all ranks, no replicas. Assumed: the
steady-state REFRESH rounds in a registry of their own (a channel per replica set and S > 0),
every rank's cores its own; the transfer of the results (network, shared memory) is not
modelled.

For other code (benchmarks/bench_cluster.py)::

    replica_round(shapes, optimizer="soap", nodes=1, gpus_per_node=1, parallel="hsdp",
                  cores=14, cost_model=None, max_dim=2048, block_size=2048, *, device=0)
        -> dict

``shapes``: the 2-D (or more) weight shapes of the full model; ``cost_model``: an
``asteria.refresh.cost.CostModel`` (None: calibrated here as the CLI does); ``device``: 1 adds
each rank's device lane. Returns: ``ranks`` (nodes x gpus_per_node), ``replica_sets`` (tuples
of global ranks, rank = node x gpus_per_node + local rank), ``replica_set_size``; per rank
(lists indexed by rank): ``owner_factors`` ({factor size: entries it owns}), ``held_factors``
({factor size: entries of its shard}, owned or not: the roots / eigenbases it keeps),
``owner_seconds``
(its round on ``cores``), ``owner_gflop``, ``busy_seconds`` (its owned jobs' seconds on one
core, at the model's rate); ``round_s`` (the slowest owner's seconds), ``slowest_rank``,
``gflop`` (all ranks), ``single_rank_s`` and ``single_rank_gflop`` (the whole model on one rank,
the table's "round s"), ``speedup`` (single_rank_s / round_s). ValueError for a bad argument,
naming it and the allowed values.

Owns: the layouts, a shard's shape, the owners of a round's entries, ``replica_round``. May
call: ``asteria._C`` (the coherence registry, for owners only; ``asteria.refresh.replicated``
for its entry ids), ``asteria.refresh.cost``, ``asteria.refresh.engine`` (lane names),
``asteria.optim`` (the methods), ``asteria.plan.shapes``, ``asteria.plan.rates``
(``calibrated``), torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch

from asteria.optim import METHODS
from asteria.optim.method import method_of
from asteria.plan.rates import calibrated
from asteria.plan.shapes import factors, round_jobs
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane
from asteria.refresh.replicated import _ID_BITS

PARALLEL = ("ddp", "hsdp", "fsdp")


def shard_shape(shape: Sequence[int], parts: int, index: int) -> tuple:
    """The local shape of shard ``index`` of ``parts`` of a weight cut along dim 0 as FSDP2's
    Shard(0) cuts it (torch.chunk: ceil(rows / parts) rows each, the last shards shorter or
    empty)."""
    rows = int(shape[0])
    step = -(-rows // parts)
    return (max(0, min(rows, (index + 1) * step) - index * step),) + tuple(shape[1:])


def layout_of(nodes: int, gpus_per_node: int, parallel: str) -> tuple[list, list]:
    """(replica sets, [(shard index, shard count)] per rank) of a job whose rank is
    node x gpus_per_node + local rank."""
    world = nodes * gpus_per_node
    if parallel == "ddp":
        return [tuple(range(world))], [(0, 1)] * world
    if parallel == "hsdp":
        return ([tuple(g + k * gpus_per_node for k in range(nodes))
                 for g in range(gpus_per_node)],
                [(r % gpus_per_node, gpus_per_node) for r in range(world)])
    return [(r,) for r in range(world)], [(r, world) for r in range(world)]


def owners(batches: Sequence[tuple], ranks: Sequence[int], world: int) -> list:
    """The owner of every entry of a round's ``batches`` [(factor size, entries)] on the
    replica set ``ranks``: [[rank per entry] per batch], from the coherence registry, fed as
    ``ReplicatedEngine.submit`` feeds it (one ``extend`` per batch, in order; cost n^3)."""
    ranks = sorted(int(r) for r in ranks)
    if len(ranks) == 1:  # a rank-local job: the engine does not ask the registry
        return [[ranks[0]] * k for _, k in batches]
    from asteria import _C

    out = []
    with _C.Coherence(world, ranks[0]) as reg:
        for key, (n, k) in enumerate(batches, 1):
            if k >= 1 << _ID_BITS:
                raise ValueError(f"a batch of {k} factors of size {n} is too large to "
                                 "replicate (ReplicatedEngine refuses it too)")
            ids = [(key << _ID_BITS) | i for i in range(k)]
            reg.extend(ids, [_C.coherence_dim_cost(n)] * k, replicas=ranks)
            out.append([reg.owner(b) for b in ids])
    return out


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: allowed: an integer >= 1")
    return value


def replica_round(shapes: Sequence[tuple], optimizer: str = "soap", nodes: int = 1,
                  gpus_per_node: int = 1, parallel: str = "hsdp", cores: int = 14,
                  cost_model: Optional[C.CostModel] = None, max_dim: int = 2048,
                  block_size: Optional[int] = 2048, *, device: int = 0) -> dict:
    """The REFRESH round of the weights ``shapes`` on nodes x gpus_per_node ranks, each
    replicated factor computed by its owner only: per rank its owned factors, their seconds on
    ``cores`` and on one core, their GFLOP; the slowest owner; the whole model on one rank for
    comparison (the module doc lists the keys)."""
    _count("nodes", nodes)
    _count("gpus_per_node", gpus_per_node)
    _count("cores", cores)
    if parallel not in PARALLEL:
        raise ValueError(f"parallel={parallel!r}: allowed: {', '.join(PARALLEL)}")
    if optimizer not in METHODS:
        raise ValueError(f"optimizer={optimizer!r}: allowed: {', '.join(sorted(METHODS))}")
    model = cost_model if cost_model is not None else calibrated(optimizer)[0]
    lanes = {Lane.HOST: cores, **({Lane.DEVICE: 1} if device else {})}
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    sets, shards = layout_of(nodes, gpus_per_node, parallel)
    world = nodes * gpus_per_node
    owned: list = [Counter() for _ in range(world)]
    held: list = [Counter() for _ in range(world)]
    for ranks in sets:
        index, parts = shards[ranks[0]]
        local = [shard_shape(s, parts, index) for s in shapes]
        batches = list(factors([s for s in local if s[0] > 0], max_dim, block_size,
                               optimizer).items())
        for r in ranks:
            held[r] = Counter(dict(batches))
        for (n, _), who in zip(batches, owners(batches, ranks, world)):
            for r in who:
                owned[r][n] += 1
    # a rank's jobs in its batches' order, as its engine receives its sub-batches
    jobs = [[C.JobSpec(op, torch.float32, n, k, p=p) for n, k in o.items()] for o in owned]
    secs = [C.split_makespan(model, j, lanes) for j in jobs]
    whole = round_jobs(factors(shapes, max_dim, block_size, optimizer), optimizer)
    single = C.split_makespan(model, whole, lanes)
    slowest = max(range(world), key=secs.__getitem__)
    return {"parallel": parallel, "nodes": nodes, "gpus_per_node": gpus_per_node,
            "ranks": world, "cores": cores, "replica_sets": sets,
            "replica_set_size": len(sets[0]),
            "owner_factors": [dict(o) for o in owned],
            "held_factors": [dict(h) for h in held],
            "owner_seconds": secs,
            "owner_gflop": [sum(x.flops for x in j) / 1e9 for j in jobs],
            "busy_seconds": [sum(model.job_seconds(Lane.HOST, x) for x in j) for j in jobs],
            "round_s": secs[slowest], "slowest_rank": slowest,
            "gflop": sum(x.flops for j in jobs for x in j) / 1e9,
            "single_rank_s": single, "single_rank_gflop": sum(x.flops for x in whole) / 1e9,
            "speedup": single / secs[slowest] if secs[slowest] > 0 else 1.0}
