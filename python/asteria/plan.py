"""``python3 -m asteria.plan``: will the REFRESH work keep up, for a model this machine need not hold?

The offline form of the capacity report of ``optimizer.asteria_plan()``: the same cost model
(``asteria.refresh.cost``) priced on parameter shapes alone. For each model and step time it
prints the work per round (GFLOP), the predicted round time on the given host cores (divided
among them, as the split executor does on a CUDA machine), the window S x step time, the pool's
utilisation (its busy share of the f steps between rounds), the smallest S that hides a round
and the fewest cores that hide it at the given S.

The window of a round (``asteria.refresh.cost.window_s``): S x step for S >= 1; at S = 0 in
mode "async" the round runs during the next forward and backward (its install waits for the
next step's start), so its window is the forward and backward's share of the step,
``--fb-share`` x step. With ``--tokens`` the step time is the forward and backward's FLOPs at
the given MFU (the optimizer's own step is not in it), so the share defaults to 1; with
``--step-time`` a measured step also holds the optimizer's step and the data loading, and the
share defaults to 0.9 (an assumption, printed with the table: give the share measured, e.g.
``asteria_stats()``'s ``capacity_fb_s`` / ``capacity_step_s``).

PCIe (``--pcie-gbps``, per direction; 0 leaves transfers out). A REFRESH on the host workers
copies each factor it decomposes from the device (the snapshot, n x n float32) and each result
back (the install: the n x n basis or root, and SOAP's sort order, n int64); the bases and
roots themselves live in host memory (placement "auto"), so the snapshot does not copy them.
Those bytes per round (``transfer_bytes``), at the given rate one direction after the other,
are added to the host round. The default, 50 GB/s, is a planning figure for PCIe 5.0 x16: 32
GT/s x 16 lanes with 128b/130b encoding is 63 GB/s per direction (the PCI-SIG PCIe 5.0 base
specification), and packet headers and flow control leave about 80% of that to large copies;
it is not measured here. The device executor (``refresh_device``) computes on the device, with
no transfer, at the device lane's rate (``device_rate``): given (``--device-gflops``), else
measured by benchmarks/gpu_microbench.py (``--gpu-json``, by default ``GPU_JSON`` where it is
present: tests/gpu/run.sh's place for it), else a published figure
(``asteria.refresh.cost.DEVICE_PRIOR_GFLOPS``, labelled so); a line says which. The table says
where the round must run: "host" where the host workers' round with its transfers fits the
window, "device" where only the device's fits (``refresh_device=True`` must take it), "host +
device" where only the round divided among both fits, "neither" where none does. The choices
(``-f auto``, the policy) take the device lane only where its rate is given or measured.

``-f auto`` (``precondition_frequency="auto"``): the f the runtime would choose
(``asteria.refresh.cost.choose_frequency``: 1.5x the round within the S = 0 window gives f = 1
and S = 0; else the fewest steps that cover it, S as given or, with ``-S auto``, as small as
hides it), from the round that runs (one rank's, with several) on the lanes (the host
workers, with their transfers; with a device rate given or measured, the round divided with
the device or the device's alone, whichever gives the smaller f); the table's f, S and window
columns are then the chosen ones. Without ``-S`` it chooses S too. It never chooses a setting
it reports as not hidden: with an S given that no f hides, it says so ("none"), with the
smallest S that hides the round and the policy below; with replicated parameters (DDP, HSDP
over nodes), where the runtime refuses "auto", it says that.

Refresh per factor (``refresh_policy="drift"``, ``drift_plan``): the budget and d that its
"auto" values take by the runtime's rule (``cost.choose_refresh_budget``), and the policy's steady state
(``drift_steady_state``: the factors round-robin, the room and the in-flight rule of the
runtime, the pool's slots): refreshes per factor per 100 steps, the mean and the largest age
of the bases at step ends, and whether each step's work is done within d steps (else d is
raised until it is); ``expected_ages`` is the closed form for equal factors. A table, a line
per row.

Tier dtypes (``tier_bytes``): per GPU and per ``tier_dtype`` (float32, bfloat16, int8, int4:
eigenbases block-quantized in libasteria's layout, ``asteria.tiers.quant.layout``), the bytes
of the roots / eigenbases in host memory (or on NVMe), of a round's installs over PCIe and the
staging ring's time per step; ``--tier-dtype`` prices the round's installs in that form.

Replicas (``--nodes``, ``--gpus-per-node``, ``--parallel``). In a distributed run each
replicated factor has one owner, who computes it on its own host workers (docs/distributed.md
"DDP and HSDP: one owner per block"), so a round of a replica set is divided among its ranks.
The planner asks the coherence registry itself (``asteria._C.Coherence``) for the owners, fed
as ``ReplicatedEngine`` feeds it: per replica set one registry, one ``extend`` per batch of a
round (the factors of one size, in the optimizer's order: parameters, blocks, dimensions;
entry ids ``(batch key << 20) | index``, cost n^3 each). Each owner's jobs are priced on its
``--cores`` as above; a replica set's round is its slowest owner's. Layouts: ``ddp``: every
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

Owns: the presets (OLMo-2 1B and 7B, read from OLMo-core's model configs: built on the meta
device, no memory allocated, and their 2-D weights listed; embeddings and the output head take
AdamW, as asteria.olmo routes them), the factor list of a set of shapes (the optimizers' own
blocking, ``asteria.optim._blocking.make_layout``), the step time from tokens per step, the
table, the round of each replica set (``replica_round``), the -f auto verdict, the policy's
steady state and the tiers' bytes. May call: ``asteria.refresh.cost``,
``asteria.refresh.engine`` (lane names), ``asteria.optim._blocking``, ``asteria._C`` (the
coherence registry, for owners only; ``asteria.refresh.replicated`` for its entry ids),
``asteria.tiers.quant`` (the quantized layout), olmo_core (presets only), torch.

Examples:
    python3 -m asteria.plan --preset olmo2-1b                        # calibrates here first
    python3 -m asteria.plan --preset olmo2-1b --preset olmo2-7b --cores 14 \\
        --tokens 65536 --tokens 524288 --gflops-per-core 20 --markdown
    python3 -m asteria.plan --shape 4096x4096 --shape 11008x4096 --step-time 1.5
    python3 -m asteria.plan --preset olmo2-7b --nodes 4 --gpus-per-node 8 --parallel hsdp
    python3 -m asteria.plan --preset olmo2-1b --tokens 65536 --gpus-per-node 8 \
        --parallel fsdp -f auto --gpu-json $OUT/gpu_microbench.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter, deque
from typing import Optional, Sequence

import torch

from asteria.optim import METHODS
from asteria.optim._blocking import make_layout
from asteria.optim.method import method_of
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane
from asteria.refresh.replicated import _ID_BITS
from asteria.config import TIER_DTYPES, TIER_QUANT_BLOCK
from asteria.tiers.plan import QUANTIZED, check_tier_dtype, stored_format

PRESETS = {"olmo2-1b": "olmo2_1B", "olmo2-7b": "olmo2_7B"}
H200_BF16_TFLOPS = 989.0  # dense bf16 peak
VOCAB = 100352            # OLMo-2's padded dolma2 vocabulary


def preset(name: str, seq_len: int = 4096) -> dict:
    """{"shapes": [2-D weight shapes given to the method], "flops_per_token": training FLOPs
    per token, "params": all parameters} of an OLMo-2 preset, from OLMo-core's config."""
    import logging
    import warnings

    logging.getLogger("olmo_core").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from olmo_core.nn.transformer import TransformerConfig

        cfg = getattr(TransformerConfig, PRESETS[name])(vocab_size=VOCAB)
        model = cfg.build(init_device="meta")
    shapes = [tuple(p.shape) for n, p in model.named_parameters()
              if p.dim() == 2 and "embeddings" not in n and "lm_head" not in n]
    # 6 FLOPs per parameter of the matmuls (forward + backward), plus attention's scores
    # and values: 12 n_layers d_model seq_len
    fpt = 6.0 * cfg.num_non_embedding_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
    return {"shapes": shapes, "flops_per_token": fpt, "params": cfg.num_params}


def factors(shapes: Sequence[tuple], max_dim: int, block_size: Optional[int],
            optimizer: str = "soap") -> Counter:
    """{factor size: count} of these weights under the optimizer's blocking and its rule of
    which dimensions of a block get a factor (``Method.has_factor``)."""
    method = method_of(optimizer).METHOD()
    group = {"block_size": block_size, "max_precond_dim": max_dim,
             "max_preconditioner_dim": max_dim, "merge_dims": False}
    out: Counter = Counter()
    for shape in shapes:
        for block in make_layout(torch.Size(shape), block_size, False, max_dim).block_shapes:
            for d, has in zip(block, method.has_factor(block, group)):
                if has:
                    out[d] += 1
    return out


def round_jobs(sizes: Counter, optimizer: str) -> list:
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    return [C.JobSpec(op, torch.float32, n, k, p=p) for n, k in sorted(sizes.items())]


def transfer_bytes(sizes: Counter, optimizer: str,
                   tier_dtype: str = "float32") -> tuple[int, int]:
    """(device-to-host, host-to-device) bytes of a REFRESH round on the host workers of
    float32 factors {size n: count}: each snapshot copies its factor (n x n), each install its
    outputs (the n x n basis or root as the tier stores it, ``stored_bytes``, and the method's
    extra outputs: SOAP's sort order, n int64)."""
    extra = sum(torch.empty((), dtype=d).element_size()
                for d in method_of(optimizer).METHOD.EXTRA_OUTPUTS)
    kind = output_kind(optimizer)
    d2h = sum(k * n * n * 4 for n, k in sizes.items())
    h2d = sum(k * (stored_bytes(n, tier_dtype, kind) + n * extra) for n, k in sizes.items())
    return d2h, h2d


# ---- the tiers' bytes ----------------------------------------------------------------------------

def output_kind(optimizer: str) -> str:
    """"eigenbases" or "roots": the kind of the method's REFRESH output."""
    return next(f.kind for f in method_of(optimizer).METHOD.STATE
                if f.kind in ("roots", "eigenbases"))


def stored_bytes(n: int, tier_dtype: str, kind: str = "eigenbases") -> int:
    """Bytes of one n x n float32 root or eigenbasis (``kind``) outside the device under
    ``tier_dtype``, in the form the runtime keeps it (``tiers.plan.stored_format``: 4 or 2 a
    value, or block-quantized as libasteria lays it out). ValueError for a tier_dtype the
    runtime does not know, and for a quantized one with roots (``check_tier_dtype``: an
    inverse root is not orthogonal)."""
    if tier_dtype not in TIER_DTYPES:
        raise ValueError(f"tier_dtype={tier_dtype!r}: allowed: {', '.join(TIER_DTYPES)}")
    check_tier_dtype(tier_dtype, [kind] if kind == "roots" else [])
    return stored_format(tier_dtype, kind, torch.float32, (n, n)).nbytes(n * n)


def tier_bytes(held: Counter, optimizer: str, tier_dtype: str) -> Optional[dict]:
    """One GPU's bytes under ``tier_dtype`` for the factors it holds {size n: count} (its
    shard's, replicated or not), placement "auto" in mode "async": ``host`` (the roots /
    eigenbases in host memory; the same payload on NVMe when spilled), ``install_h2d`` (a
    round's installs: the new bases as stored, plus the extra outputs), ``step_h2d`` (what the
    staging ring copies to the device every step: every basis as stored). None where the
    runtime refuses the dtype for the method (roots quantized)."""
    kind = output_kind(optimizer)
    try:
        host = sum(k * stored_bytes(n, tier_dtype, kind) for n, k in held.items())
    except ValueError:
        return None
    return {"host": host, "install_h2d": transfer_bytes(held, optimizer, tier_dtype)[1],
            "step_h2d": host, "bases": sum(held.values())}


# ---- replicas --------------------------------------------------------------------------------

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


def calibrated(optimizer: str) -> tuple[C.CostModel, str]:
    """(this machine's per-core model for the optimizer's REFRESH op, where it comes from)."""
    op = method_of(optimizer).METHOD.REFRESH_OP[0]
    model = C.calibrate(ops=(op,), sizes=(256, 512, 1024))
    rates = ", ".join(f"{r['gflops']:.1f} at n={r['n']}" for r in model.table())
    return model, f"measured here for {op} (libasteria pool, 1 worker): {rates} GFLOP/s"


# ---- refresh per factor (refresh_policy "drift") -------------------------------------------------

def expected_ages(count: int, budget: float, delay: int) -> dict:
    """The round-robin steady state of ``count`` equal-cost factors at ``budget`` and d =
    ``delay`` (f = 1, no skips), exactly: m = max(1, floor(budget x count)) factors start per
    step, so each starts every p = count / m steps, in intervals of q = floor(p) and q + 1
    steps, a share r = p - q of them the longer. A basis installed d steps after its start is
    d, d + 1, ... steps old at the step ends of its interval, so over time its age averages
    d + (E[p^2] / E[p] - 1) / 2 with E[p^2] = q^2 + r (2 q + 1), E[p] = p; at most
    d + ceil(p) - 1. With 1 / budget an integer that divides count, p = 1 / budget: refreshes
    100 x budget, age d + (1 / budget - 1) / 2 on average, d + 1 / budget - 1 at most.
    (Exact for d <= 1; with d >= 2 the room of d steps lets a step take a factor that the
    step before left, m is then budget x count on average.) Returns refreshes_per_100 (per
    factor per 100 steps), mean_age and max_age."""
    m = max(1, math.floor(budget * count + 1e-9))
    period = count / m
    q = math.floor(period + 1e-12)
    r = period - q
    mean = delay + ((q * q + r * (2 * q + 1)) / period - 1) / 2
    return {"refreshes_per_100": 100.0 * m / count, "mean_age": mean,
            "max_age": delay + math.ceil(period - 1e-12) - 1}


def spread_order(sizes: Counter) -> list:
    """The factors {size n: count} as one list, each size's factors spread evenly over it (as a
    model's edge blocks are spread over its layers): the order round-robin walks them in."""
    return [n for _, n in sorted(((i + 0.5) / k, n) for n, k in sizes.items() for i in range(k))]


def drift_steady_state(sizes: Counter, budget: float, delay: int, step_s: float, fb_s: float,
                       model: C.CostModel, optimizer: str, lanes: dict,
                       pcie_gbps: float = 0.0, tier_dtype: str = "float32") -> dict:
    """refresh_policy "drift" in its steady state, simulated step by step. The factors of
    ``sizes`` (``spread_order``) are the candidates of every step (f = 1, no skips) in
    round-robin order, the stalest basis first (what equal drift scores give); those with a
    refresh in flight wait; they start while their FLOPs fit the room, ``budget`` x a round's
    FLOPs x max(d, 1) less the FLOPs in flight (the first of a step beyond it when the room is
    positive and none started; after the first that does not fit none does), as the
    runtime's cadence starts them, and install d steps later. It starts uniform: for the
    first cycle and d steps the room is one step's budget, nothing carried, so the rule's
    room of d steps does not start as one burst of d steps' work (all bases at step 0, none
    in flight). Each step's starts run on the ``lanes``' slots (entries to the slot where
    they finish first, carried over from step to step, as the split executor does) after
    their snapshots' copies, and their installs' copies after them (``pcie_gbps``; 0: none).

    Returns refreshes_per_100 (per factor per 100 steps, the mean), mean_age and max_age
    (steps: at each step end, the step minus its installed basis's snapshot step),
    started_per_step, latency_s (the longest a step's work took, copies included), window_s
    (d steps, or the forward and backward for d = 0) and wait_s (the longest any install
    waited past it: 0 is hidden)."""
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    order = spread_order(sizes)
    count = len(order)
    if count == 0:
        return {"refreshes_per_100": 0.0, "mean_age": 0.0, "max_age": 0,
                "started_per_step": 0.0, "latency_s": 0.0, "window_s": 0.0, "wait_s": 0.0}
    cost = {n: C.flops(op, n, p=p) for n in sizes}
    secs = {n: {lane: model.entry_seconds(lane, C.JobSpec(op, torch.float32, n, 1, p=p))
                for lane in lanes} for n in sizes}
    copy = {n: (transfer_bytes(Counter({n: 1}), optimizer, tier_dtype) if pcie_gbps
                else (0, 0)) for n in sizes}
    rate = pcie_gbps * 1e9 if pcie_gbps else 1.0
    total = sum(cost[n] for n in order)
    tol = 1e-9 * total
    per_step = max(1, math.floor(budget * count + 1e-9))
    cycle = max(math.ceil(1.0 / budget - 1e-9), math.ceil(count / per_step))
    warm, meas = 2 * cycle + 2 * delay + 2, min(4000, max(16, 8 * cycle))
    window = delay * step_s if delay >= 1 else fb_s
    queue = deque(range(count))       # the stalest first; ties by index
    basis = [0] * count               # the snapshot step of each installed basis
    basis_sum = 0
    flight: dict = {}                 # factor -> its refresh's start step
    installs: dict = {}               # install step -> [factors]
    free = {(lane, i): 0.0 for lane, k in lanes.items() for i in range(k)}
    starts = age_sum = 0
    max_age, latency, wait = 0, 0.0, 0.0
    for t in range(1, warm + meas + 1):
        for k in installs.pop(t, ()):
            basis_sum += flight[k] - basis[k]
            basis[k] = flight.pop(k)
        if t <= cycle + delay:  # a uniform start: a step's budget, nothing carried
            left = budget * total
        else:
            left = budget * total * max(delay, 1) - sum(cost[order[k]] for k in flight)
        started: list = []
        while queue and queue[0] not in flight:
            c = cost[order[queue[0]]]
            if not (c <= left + tol or (not started and left > 0)):
                break
            started.append(queue.popleft())
            left -= c
        queue.extend(started)
        for k in started:
            if delay == 0:
                basis_sum += t - basis[k]
                basis[k] = t
            else:
                flight[k] = t
                installs.setdefault(t + delay, []).append(k)
        if started:
            t0 = t * step_s
            by_size = Counter(order[k] for k in started)
            down = sum(copy[n][0] * c for n, c in by_size.items()) / rate
            up = sum(copy[n][1] * c for n, c in by_size.items()) / rate
            end = t0
            for n, c in by_size.items():
                for slot in free:
                    free[slot] = max(free[slot], t0 + down)
                used = C.assign(secs[n], c, free)
                end = max(end, max(free[slot] for slot in used))
            took = end + up - t0
        else:
            took = 0.0
        if t > warm:
            starts += len(started)
            age_sum += count * t - basis_sum
            max_age = max(max_age, t - min(basis))
            latency = max(latency, took)
            wait = max(wait, took - window)
    return {"refreshes_per_100": 100.0 * starts / (count * meas),
            "mean_age": age_sum / (count * meas), "max_age": max_age,
            "started_per_step": starts / meas, "latency_s": latency, "window_s": window,
            "wait_s": max(0.0, wait)}


def drift_plan(sizes: Counter, round_s: float, step_s: float, fb_s: float,
               model: C.CostModel, optimizer: str, lanes: dict, pcie_gbps: float = 0.0,
               tier_dtype: str = "float32") -> dict:
    """The planner's answer for refresh_policy "drift" on one rank's factors ``sizes`` whose
    round takes ``round_s`` on ``lanes``: the budget and d of ``cost.choose_refresh_budget`` (the runtime's
    "auto"), then the steady state (``drift_steady_state``); where a step's work on whole
    factors still runs past d (more factors a step than slots), d is raised until it does
    not, and the rule's d is kept as ``rule_delay``. ``hidden`` False: no d up to the cycle's
    length hides it."""
    op, p = method_of(optimizer).METHOD.REFRESH_OP

    def one(n: int) -> float:
        t = C.split_makespan(model, [C.JobSpec(op, torch.float32, n, 1, p=p)], lanes)
        return t + (sum(transfer_bytes(Counter({n: 1}), optimizer, tier_dtype)) /
                    (pcie_gbps * 1e9) if pcie_gbps else 0.0)

    largest = max((one(n) for n in sizes), default=0.0)
    budget, rule = C.choose_refresh_budget(round_s, step_s, fb_s, largest)
    delay = rule
    limit = rule + math.ceil(1.0 / budget - 1e-9) + 1
    while True:
        sim = drift_steady_state(sizes, budget, delay, step_s, fb_s, model, optimizer, lanes,
                                 pcie_gbps, tier_dtype)
        if sim["wait_s"] <= 1e-9 or delay >= limit:
            break
        delay += 1
    return {"budget": budget, "delay": delay, "rule_delay": rule, "round_s": round_s,
            "R": round_s / step_s, "factors": sum(sizes.values()), "largest_s": largest,
            "hidden": sim["wait_s"] <= 1e-9, **sim}


def row(model: C.CostModel, name: str, sizes: Counter, optimizer: str, cores: int,
        step_s: float, staleness, frequency, device: int, tokens: Optional[int],
        fb_share: float = 0.0, pcie_gbps: float = 0.0, *, owned: Optional[list] = None,
        replicated: bool = False, tier_dtype: str = "float32"):
    """One line of the table. ``frequency``: f or "auto" (chosen here); ``staleness``: S, or
    "auto" with f "auto"; ``device``: 1 adds the device lane to the round (divided with the
    host workers) and lets the choice take the device executor's; ``fb_share``: the forward
    and backward's share of ``step_s`` (the S = 0 window); ``pcie_gbps``: per direction (0:
    transfers left out); ``owned``: with several ranks, the factors {size: count} each rank
    computes (``replica_round``'s ``owner_factors``): the round that runs is then the slowest
    rank's, its own factors' copies included, and "hidden", ``-f auto`` and the policy are
    judged on it; ``replicated``: the ranks share replicated factors (DDP, HSDP over nodes),
    where the runtime refuses an "auto" f and budget; ``tier_dtype``: the form of the bases
    the installs copy back.

    ``-f auto`` chooses as the runtime would (``cost.choose_frequency``); with S given and a
    round that S cannot hide it chooses nothing (``auto_hidden`` False; ``frequency`` is then
    the f the runtime's rule would take, and each install waits), so the table never reports a
    chosen setting as not hidden."""
    jobs = round_jobs(sizes, optimizer)
    lanes = {Lane.HOST: cores, **({Lane.DEVICE: 1} if device else {})}
    d2h, h2d = transfer_bytes(sizes, optimizer, tier_dtype)
    xfer_s = (d2h + h2d) / (pcie_gbps * 1e9) if pcie_gbps else 0.0
    round_s = C.split_makespan(model, jobs, lanes) + xfer_s
    host_s = C.split_makespan(model, jobs, {Lane.HOST: cores}) + xfer_s
    device_s = C.makespan(model, jobs, 1, Lane.DEVICE)  # the device executor: no transfer
    whole_s = C.makespan(model, jobs, cores)
    gflop = sum(j.flops for j in jobs) / 1e9
    fb_s = fb_share * step_s
    # the round that runs: the whole model on this rank, or each rank's own factors
    run_sizes, run_s, run_dev, run_host, run_x, rank = (sizes, round_s, device_s, host_s,
                                                        xfer_s, None)
    if owned is not None:
        per = []
        for r, o in enumerate(owned):
            c = Counter(o)
            j_r = round_jobs(c, optimizer)
            x = sum(transfer_bytes(c, optimizer, tier_dtype)) / (pcie_gbps * 1e9) \
                if pcie_gbps else 0.0
            per.append((C.split_makespan(model, j_r, lanes) + x if j_r else 0.0, -r, x))
        run_s, rank, run_x = max(per)
        rank = -rank
        run_sizes = Counter(owned[rank])
        run_jobs = round_jobs(run_sizes, optimizer)
        run_dev = C.makespan(model, run_jobs, 1, Lane.DEVICE)
        run_host = C.split_makespan(model, run_jobs, {Lane.HOST: cores}) + run_x
    else:
        run_jobs = jobs
    choice_s = min(run_s, run_dev) if device else run_s
    auto = frequency == "auto"
    auto_hidden, runtime_f = True, None
    if auto:
        fixed = None if staleness == "auto" else staleness
        frequency, staleness = C.choose_frequency(choice_s, step_s, fb_s, fixed)
        auto_hidden = choice_s <= C.window_s(staleness, step_s, fb_s) + 1e-12
        runtime_f = frequency
    window = C.window_s(staleness, step_s, fb_s)
    s_min = 0 if round_s <= fb_s else C.smallest_s(round_s, step_s)
    run_min = 0 if choice_s <= fb_s else C.smallest_s(choice_s, step_s)
    # judged on the round that runs (one rank's, with several)
    w_min = C.smallest_workers(model, run_jobs, window - run_x, True, device)
    busy = sum(model.job_seconds(Lane.HOST, j) for j in run_jobs)
    where = ("host" if run_host <= window else "device" if run_dev <= window
             else "host + device" if run_s <= window else "neither")
    policy = drift_plan(run_sizes, run_s, step_s, fb_s, model, optimizer, lanes, pcie_gbps,
                        tier_dtype)
    return {"model": name, "tokens": tokens, "step_s": step_s,
            "factors": sum(sizes.values()), "sizes": dict(sorted(sizes.items())),
            "gflop": gflop, "round_s": round_s, "round_whole_jobs_s": whole_s,
            "window_s": window, "utilisation": min(1.0, busy / (cores * frequency * step_s)),
            "smallest_s": s_min, "fits": choice_s <= window + 1e-12,
            "smallest_cores": w_min, "fb_s": fb_s, "bytes_d2h": d2h, "bytes_h2d": h2d,
            "transfer_s": xfer_s, "host_round_s": host_s, "device_round_s": device_s,
            "device_rate": model.sources(Lane.DEVICE, jobs), "refresh_on": where,
            "frequency": frequency, "staleness": staleness, "frequency_auto": auto,
            "auto_hidden": auto_hidden, "auto_refused": auto and replicated,
            "runtime_f": runtime_f, "run_round_s": run_s, "run_device_s": run_dev,
            "run_host_s": run_host,
            "choice_round_s": choice_s, "run_smallest_s": run_min, "run_rank": rank,
            "run_factors": sum(run_sizes.values()), "policy": policy,
            "tier_dtype": tier_dtype}


def render(head: list, lines: list, markdown: bool) -> str:
    """A table: markdown, or columns padded to their widest cell."""
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head] + lines]
    return "\n".join(out)


def fmt_table(rows: list, cores: int, staleness, frequency, markdown: bool) -> str:
    auto = frequency == "auto"
    s_name = "S" if auto else f"S={staleness}"
    head = ["model", "tokens/GPU/step", "step s", "factors", "GFLOP/round",
            f"round s ({cores} cores)", f"window {s_name} (s)",
            "pool busy (f)" if auto else f"pool busy (f={frequency})", "smallest S",
            f"cores for {s_name}", f"hidden at {s_name}", "PCIe s", "REFRESH on"]
    if auto:
        head += ["f auto", "S"]
    reps = "replicas" in rows[0]
    if reps:
        head += ["ranks", "replica set", "round s/set", "speed-up", "smallest S/set"]
    lines = []
    for r in rows:
        s_min = r["run_smallest_s"]
        lines.append([r["model"], "-" if r["tokens"] is None else f"{r['tokens'] // 1024}k",
                      f"{r['step_s']:.2f}", str(r["factors"]), f"{r['gflop']:.0f}",
                      f"{r['round_s']:.1f}", f"{r['window_s']:.1f}",
                      f"{100 * r['utilisation']:.0f}%",
                      str(s_min) + ("" if s_min <= r["frequency"]
                                    else f" (> f={r['frequency']})"),
                      "> 256" if r["smallest_cores"] is None else str(r["smallest_cores"]),
                      "yes" if r["fits"] else "no", f"{r['transfer_s']:.2f}",
                      r["refresh_on"]])
        if auto:
            lines[-1] += (["refused", "-"] if r["auto_refused"] else
                          [str(r["frequency"]), str(r["staleness"])] if r["auto_hidden"] else
                          ["none", str(r["staleness"])])
        if reps:
            rep = r["replicas"]
            lines[-1] += [str(rep["ranks"]), str(rep["replica_set_size"]),
                          f"{r['run_round_s']:.2f}",
                          f"{r['round_s'] / r['run_round_s']:.2f}x" if r["run_round_s"] > 0
                          else "-", str(r["run_smallest_s"])]
    return render(head, lines, markdown)


def fmt_policy(rows: list, markdown: bool) -> str:
    """The table of refresh_policy "drift" (``drift_plan``), a line per row."""
    head = ["model", "tokens/GPU/step", "ranks", "step s", "factors/rank", "round s/rank",
            "R", "budget", "d", "refreshes/factor/100 steps", "mean age", "max age",
            "hidden"]
    lines = []
    for r in rows:
        p = r["policy"]
        k = round(1 / p["budget"])
        lines.append([r["model"], "-" if r["tokens"] is None else f"{r['tokens'] // 1024}k",
                      str(r.get("replicas", {}).get("ranks", 1)), f"{r['step_s']:.2f}",
                      str(p["factors"]), f"{p['round_s']:.1f}", f"{p['R']:.1f}",
                      "1" if k == 1 else f"1/{k}", str(p["delay"]) +
                      ("" if p["delay"] == p["rule_delay"] else f" (rule {p['rule_delay']})"),
                      f"{p['refreshes_per_100']:.1f}", f"{p['mean_age']:.1f}",
                      str(p["max_age"]),
                      "yes" if p["hidden"] else f"no ({p['wait_s']:.1f} s)"])
    return render(head, lines, markdown)


def fmt_tiers(tiers: list, pcie_gbps: float, markdown: bool) -> str:
    """The table of one GPU's bytes per tier dtype: [(model, ranks, tier_dtype, tier_bytes)];
    the staging ring's copies each step priced at ``pcie_gbps`` (0: left out)."""
    head = ["model", "ranks", "bases/GPU", "tier_dtype", "host (or NVMe) GB/GPU",
            "PCIe GB/round of installs", f"ring s/step at {pcie_gbps:g} GB/s"]
    lines = []
    for name, ranks, dt, b in tiers:
        if b is None:
            lines.append([name, str(ranks), "-", dt, "refused (roots)", "-", "-"])
            continue
        lines.append([name, str(ranks), str(b["bases"]), dt, f"{b['host'] / 1e9:.2f}",
                      f"{b['install_h2d'] / 1e9:.2f}",
                      f"{b['step_h2d'] / (pcie_gbps * 1e9):.3f}" if pcie_gbps else "-"])
    return render(head, lines, markdown)


def replicas_note(args, rows: list) -> str:
    r0 = rows[0]["replicas"]
    lines = [f"{args.parallel} on {args.nodes} node(s) x {args.gpus_per_node} GPU(s): "
             f"{len(r0['replica_sets'])} replica set(s) of {r0['replica_set_size']} rank(s); "
             "each replicated factor computed by one owner (the coherence registry's LPT, n^3 "
             f"per factor) on its {args.cores} cores; round s/set = the slowest owner's; the "
             "transfer of the results is not modelled"]
    for name, rep in {r["model"]: r["replicas"] for r in rows}.items():
        g = rep["owner_gflop"]
        lines.append(f"{name}: GFLOP per rank {min(g):.0f} to {max(g):.0f} (all ranks "
                     f"{rep['gflop']:.0f}, one rank alone {rep['single_rank_gflop']:.0f}); "
                     f"slowest rank {rep['slowest_rank']}")
    return "\n".join(lines)


def frequency_arg(s: str):
    if s == "auto":
        return s
    try:
        return positive(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 1, or auto") from None


def staleness_arg(s: str):
    if s == "auto":
        return s
    try:
        v = int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 0, or auto")
    return v


def bounded_float(low: float, high: float, allowed: str):
    """An argparse type: a float in [low, high]; the error says what is ``allowed``."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = float("nan")
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{s!r}: allowed: {allowed}")
        return v
    return parse


share_arg = bounded_float(0.0, 1.0, "a fraction in [0, 1]")
rate_arg = bounded_float(0.0, float("inf"), "GB/s >= 0 (0: transfers left out)")


PCIE_GBPS = 50.0  # PCIe 5.0 x16 per direction, a planning figure (module doc)


def positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 1")
    return v


def parse_shape(s: str) -> tuple:
    try:
        dims = tuple(int(x) for x in s.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) < 2 or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape {s!r}: expected sizes joined by x, e.g. "
                                         f"2048x8192")
    return dims


def device_rate(model: C.CostModel, device_gflops: Optional[float],
                gpu_json: Optional[str], optimizer: str) -> tuple[bool, str]:
    """Price ``model``'s device lane: ``device_gflops`` given, else the GPU microbenchmark's
    JSON at ``gpu_json`` (``cost.add_gpu_microbench``: its "highest" precision, float32 as the
    device executor computes unless a run sets TF32), else the published prior
    (``cost.DEVICE_PRIOR_GFLOPS``). Returns (whether the rate was given or measured: then the
    choices may take the device lane, where a run on a CUDA machine does by default), the
    sentence that says where it came from). ValueError from the JSON's reader, naming it."""
    if device_gflops:
        model.base_gflops[Lane.DEVICE] = device_gflops
        return True, f"given: {device_gflops:g} GFLOP/s (--device-gflops)"
    if gpu_json:
        rec = C.read_gpu_microbench(gpu_json)
        added = C.add_gpu_microbench(model, rec, "highest")
        if not added:
            raise ValueError(f"GPU microbenchmark JSON {gpu_json!r}: no result of "
                             f"{', '.join(C.GPU_MICROBENCH_OPS)} at precision 'highest'")
        op = method_of(optimizer).METHOD.REFRESH_OP[0]
        pts = ", ".join(f"{o} n={n} {s * 1e3:.1f} ms (batch {b})" for o, n, b, s in added)
        state = rec.get("state")
        return True, (f"measured on {rec.get('device_name', '?')} ({gpu_json}, "
                      f"{'state ' + repr(state) + ', ' if state != 'passed' else ''}float32 "
                      f"at precision 'highest', one factor's time at the largest batch): {pts}; "
                      f"{op} priced from "
                      + next((k for k, (_, ops) in C.GPU_MICROBENCH_OPS.items() if op in ops),
                             "the lane's other ops"))
    return False, (f"{C.DEVICE_PRIOR_SOURCE}: {C.DEVICE_PRIOR_GFLOPS:.0f} GFLOP/s for every "
                   f"op (docs/capacity.md; give --gpu-json or --device-gflops)")


#: where tests/gpu/run.sh leaves the GPU microbenchmark when $OUT is not set, from the
#: repository's root: the planner reads it from there when present
GPU_JSON = os.path.join("benchmarks", "results", "gpu_microbench.json")


def gpu_json_arg(s: str) -> str:
    if s != "none" and not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"{s!r}: no such file; allowed: the JSON of "
                                         f"benchmarks/gpu_microbench.py, or none")
    return s


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m asteria.plan", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[])
    ap.add_argument("--shape", action="append", type=parse_shape, default=[],
                    help="a weight shape (e.g. 2048x8192); repeat for each weight")
    ap.add_argument("--optimizer", choices=sorted(METHODS), default="soap")
    ap.add_argument("--cores", type=positive, default=14, help="host cores (workers) per GPU")
    ap.add_argument("--nodes", type=positive, default=1, help="nodes of the job (default 1)")
    ap.add_argument("--gpus-per-node", type=positive, default=1,
                    help="ranks (GPUs) per node (default 1)")
    ap.add_argument("--parallel", choices=PARALLEL, default="hsdp",
                    help="how the weights are laid out over the ranks: ddp (replicated on "
                         "every rank), hsdp (dim 0 sharded over a node's GPUs, replicated "
                         "across nodes), fsdp (sharded over all ranks); default hsdp")
    ap.add_argument("--gflops-per-core", type=float, default=None,
                    help="per-core REFRESH throughput; default: measured here (libasteria's "
                         "pool, one worker, the optimizer's op at 256, 512, 1024)")
    dev = ap.add_mutually_exclusive_group()
    dev.add_argument("--device-gflops", type=float, default=None,
                     help="the device lane's throughput, given (hybrid rounds)")
    dev.add_argument("--gpu-json", type=gpu_json_arg, default=None,
                     help="the device lane's rates from benchmarks/gpu_microbench.py's JSON "
                          f"(default: {GPU_JSON} where present; none: the published prior)")
    step = ap.add_mutually_exclusive_group()
    step.add_argument("--step-time", type=float, default=None, help="seconds per step")
    step.add_argument("--tokens", type=int, action="append", default=None,
                      help="tokens per GPU per step (presets: step time from the model's "
                           "FLOPs, --mfu and --peak-tflops); repeatable")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("-f", "--frequency", type=frequency_arg, default=10,
                    help="precondition_frequency: an integer >= 1, or auto (chosen here as "
                         "the runtime would)")
    ap.add_argument("-S", "--staleness", type=staleness_arg, default=None,
                    help="an integer >= 0, or auto (with -f auto: chosen with f); default 5, "
                         "with -f auto: auto")
    ap.add_argument("--fb-share", type=share_arg, default=None,
                    help="the forward and backward's share of the step time, the S=0 window "
                         "(default: 1 with --tokens, whose step is the forward and backward's "
                         "FLOPs; 0.9 with --step-time)")
    ap.add_argument("--pcie-gbps", type=rate_arg, default=PCIE_GBPS,
                    help=f"host<->device copy rate per direction, GB/s (default {PCIE_GBPS:g}: "
                         "PCIe 5.0 x16's 63 GB/s less packet overhead; 0: transfers left out)")
    ap.add_argument("--tier-dtype", choices=TIER_DTYPES, default="float32",
                    help="the runtime's tier_dtype: the form of the bases the installs copy "
                         "back (the bytes table lists every one)")
    ap.add_argument("--max-precond-dim", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if not args.preset and not args.shape:
        ap.error("give --preset and/or --shape")
    if args.shape and args.tokens:
        ap.error("--tokens needs a preset (its FLOPs per token); give --step-time for --shape")
    if args.staleness is None:
        args.staleness = "auto" if args.frequency == "auto" else 5
    if args.staleness == "auto" and args.frequency != "auto":
        ap.error("-S auto needs -f auto here (staleness 'auto' with an integer f is chosen "
                 "from a run's measurements: optimizer.asteria_plan())")
    if args.fb_share is None:
        args.fb_share = 0.9 if args.step_time is not None else 1.0
    kind = output_kind(args.optimizer)
    if args.tier_dtype in QUANTIZED and kind != "eigenbases":
        ap.error(f"argument --tier-dtype: {args.tier_dtype!r} with --optimizer "
                 f"{args.optimizer} ({kind}): only eigenbases are quantized; allowed: "
                 f"float32, bfloat16")
    if args.gpu_json is None and args.device_gflops is None and os.path.isfile(GPU_JSON):
        args.gpu_json = GPU_JSON
    op = method_of(args.optimizer).METHOD.REFRESH_OP[0]
    if args.gflops_per_core is None:
        model, source = calibrated(args.optimizer)
    else:
        model = C.CostModel({Lane.HOST: args.gflops_per_core}, "given")
        source = f"given: {args.gflops_per_core} GFLOP/s per core"
    try:
        device, device_source = device_rate(model, args.device_gflops,
                                            None if args.gpu_json == "none" else args.gpu_json,
                                            args.optimizer)
    except ValueError as e:
        ap.error(f"argument --gpu-json: {e}")
    models = [(p, preset(p, args.seq_len)) for p in args.preset]
    if args.shape:
        models.append(("shapes", {"shapes": args.shape, "flops_per_token": None}))
    rows, tiers = [], []
    world = args.nodes * args.gpus_per_node
    for name, m in models:
        sizes = factors(m["shapes"], args.max_precond_dim, args.block_size, args.optimizer)
        rep = None if world == 1 else replica_round(
            m["shapes"], args.optimizer, args.nodes, args.gpus_per_node, args.parallel,
            args.cores, model, args.max_precond_dim, args.block_size, device=int(device))
        held = [sizes] if rep is None else [Counter(h) for h in rep["held_factors"]]
        for dt in TIER_DTYPES:
            b = [tier_bytes(h, args.optimizer, dt) for h in held]
            tiers.append((name, world, dt, None if None in b else
                          max(b, key=lambda x: x["host"])))
        if args.step_time is not None:
            steps = [(None, args.step_time)]
        else:
            toks = args.tokens or [65536, 524288]
            steps = [(t, m["flops_per_token"] * t / (args.mfu * args.peak_tflops * 1e12))
                     for t in toks]
        for tokens, step_s in steps:
            rows.append(row(model, name, sizes, args.optimizer, args.cores, step_s,
                            args.staleness, args.frequency, int(device), tokens,
                            fb_share=args.fb_share, pcie_gbps=args.pcie_gbps,
                            owned=None if rep is None else rep["owner_factors"],
                            replicated=rep is not None and rep["replica_set_size"] > 1,
                            tier_dtype=args.tier_dtype))
            if rep is not None:
                rows[-1]["replicas"] = rep
    print(fmt_table(rows, args.cores, args.staleness, args.frequency, args.markdown))
    print()
    print(f"per-core throughput: {source}; beyond the largest measured size the rate is held "
          f"(time grows as n^3).")
    print(f"device executor's rate: {device_source}" + (
        "; the choices below may take the device lane (a run on a CUDA machine does by "
        "default, refresh_device=True)" if device else
        "; the choices below are the host workers' (give the device's rate to add it)"))
    print(f"{args.optimizer} ({op}), max_precond_dim {args.max_precond_dim}, block_size "
          f"{args.block_size}, f={args.frequency}, S={args.staleness}, tier_dtype "
          f"{args.tier_dtype}" + ("" if args.step_time is not None else
             f"; step time = FLOPs/token x tokens / ({args.mfu:.0%} MFU x "
             f"{args.peak_tflops:.0f} TFLOP/s)"))
    print(f"window at S=0: the next forward and backward, {args.fb_share:g} x the step "
          f"time; at S >= 1: S x the step time")
    for r in {r["model"]: r for r in rows}.values():
        sizes = ", ".join(f"{k} x{n}" for n, k in r["sizes"].items())
        print(f"{r['model']}: factors {sizes}; a round as one job per size on one worker each "
              f"(the CPU-only executor) would take {r['round_whole_jobs_s']:.1f} s")
        print(f"{r['model']}: PCIe per round on the host workers: {r['bytes_d2h'] / 1e9:.2f} GB "
              f"device-to-host (the factors) + {r['bytes_h2d'] / 1e9:.2f} GB host-to-device "
              f"(the new bases / roots) at {args.pcie_gbps:g} GB/s per direction = "
              f"{r['transfer_s']:.2f} s, in the round; on the device executor the round "
              f"takes {r['device_round_s']:.1f} s")
    for r in rows:
        print(auto_line(r, args) if r["frequency_auto"] else "", end="")
        tok = "" if r["tokens"] is None else f" at {r['tokens'] // 1024}k tokens"
        whose = "" if r["run_rank"] is None else " (the slowest rank's)"
        if r["refresh_on"] == "device":
            print(f"{r['model']}{tok}: the host workers' round{whose} with its transfers "
                  f"({r['run_host_s']:.1f} s) does not fit the window ({r['window_s']:.1f} s) "
                  f"but the device executor's ({r['run_device_s']:.1f} s) does: it must "
                  f"take the round (runtime refresh_device=True)")
        elif r["refresh_on"] == "neither":
            print(f"{r['model']}{tok}: neither the host workers' round{whose} with its "
                  f"transfers ({r['run_host_s']:.1f} s) nor the device executor's "
                  f"({r['run_device_s']:.1f} s) fits the window ({r['window_s']:.1f} s)")
    if world > 1:
        print(replicas_note(args, rows))
    print()
    print(fmt_policy(rows, args.markdown))
    print()
    print(policy_note(rows, device))
    print()
    print(fmt_tiers(tiers, args.pcie_gbps, args.markdown))
    print()
    print(f"bytes per GPU (the rank holding the most; placement \"auto\", mode \"async\"): "
          f"every root / eigenbasis of its factors in host memory (on NVMe when spilled: the "
          f"same payload, each record adding a header, a CRC and zeros to 4 KiB); each "
          f"install copies the new basis to the device as stored (SOAP: with its sort order, "
          f"n int64); with no coherent host access (an H100 on x86) the staging ring copies "
          f"every basis to the device each step. int8 / int4: blocks of "
          f"{TIER_QUANT_BLOCK} values with one float32 scale each (libasteria's "
          f"quant_layout), eigenbases only (Shampoo's roots are refused)")
    return 0


def auto_line(r: dict, args) -> str:
    """What ``-f auto`` answers for one row: the f and S it chooses (hidden), or that the
    runtime refuses it, or that no f hides a round at the S given."""
    tok = "" if r["tokens"] is None else f" at {r['tokens'] // 1024}k tokens"
    who = (f"a round of the slowest rank's {r['run_factors']} factors"
           if r["run_rank"] is not None else f"a round of the {r['factors']} factors")
    rnd = f"{who} takes {r['choice_round_s']:.1f} s"
    s_auto = C.choose_staleness(r["choice_round_s"], r["step_s"], r["fb_s"])
    p = r["policy"]
    drift = (f"refresh_policy 'drift' (budget 1/{round(1 / p['budget'])}, d={p['delay']}, "
             f"the table below)")
    if r["auto_refused"]:
        rep = r["replicas"]
        return (f"{r['model']}{tok}: -f auto: the runtime refuses precondition_frequency "
                f"'auto' with replicated parameters ({args.parallel}: replica sets of "
                f"{rep['replica_set_size']} ranks; each rank would choose its own f); {rnd}, "
                f"the smallest S that hides it is {r['run_smallest_s']}: give integers, e.g. "
                f"-f {max(1, s_auto)} -S {s_auto} (the 1.5x margin of -S auto), or "
                f"refresh_policy 'drift' with refresh_budget {p['budget']:.4g} and "
                f"install_delay {p['delay']} (numbers: 'auto' is refused there too)\n")
    if r["auto_hidden"]:
        return (f"{r['model']}{tok}: -f auto chooses f={r['frequency']}, S={r['staleness']}: "
                f"hidden ({rnd}, the window {r['window_s']:.1f} s)\n")
    return (f"{r['model']}{tok}: -f auto: no f hides a round at S={r['staleness']} ({rnd}, "
            f"the window {r['window_s']:.1f} s); the smallest S that hides it is "
            f"{r['run_smallest_s']} (-S auto: f = S = {max(1, s_auto)}), or {drift}. "
            f"(Given S={r['staleness']}, the runtime's rule would take f={r['runtime_f']}, "
            f"and each install would wait about "
            f"{max(0.0, r['choice_round_s'] - r['window_s']):.1f} s once every "
            f"{r['runtime_f']} steps)\n")


def policy_note(rows: list, device: bool) -> str:
    """The legend of the policy table."""
    lanes = "the host workers and the device" if device else "the host workers"
    return ("refresh_policy 'drift' with refresh_budget and install_delay 'auto', f=1: R = a "
            "round of the rank's factors (round s/rank, on " + lanes + ", its PCIe copies "
            "included) over the step; budget = 1/ceil(1.5 R) of a round's FLOPs started a "
            "step (1, d=0 where 1.5x the round fits the forward and backward), d = the steps "
            "that cover 1.5x the larger of a step's work and the longest factor (the runtime's "
            "rule; \"rule\" where whole factors on the slots needed more); refreshes, mean and "
            "max age (steps, at step ends) from the steady state of the factors in "
            "round-robin order (equal drift scores, no skips), simulated step by step; hidden: "
            "every step's work done within its d steps")
if __name__ == "__main__":
    sys.exit(main())
