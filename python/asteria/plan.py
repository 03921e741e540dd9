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
no transfer, at the device lane's rate of the cost model (``--device-gflops``, else the model's
prior for an unmeasured device lane, labelled so); the table says where the round must run:
"host" where the host workers' round with its transfers fits the window, "device" where only
the device's fits (``refresh_device=True`` must take it), "host + device" where only the round
divided among both (``--device-gflops``) fits, "neither" where none does.

``-f auto`` (``precondition_frequency="auto"``): the f the runtime would choose
(``asteria.refresh.cost.choose_frequency``: 1.5x the round within the S = 0 window gives f = 1
and S = 0; else the fewest steps that cover it, S as given or, with ``-S auto``, as small as
hides it), from the round on the lanes given (the host workers, with their transfers, and
with ``--device-gflops`` the round divided with the device or the device's alone, whichever
gives the smaller f); the table's f, S and window columns are then the chosen ones.

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
(lists indexed by rank): ``owner_factors`` ({factor size: entries it owns}), ``owner_seconds``
(its round on ``cores``), ``owner_gflop``, ``busy_seconds`` (its owned jobs' seconds on one
core, at the model's rate); ``round_s`` (the slowest owner's seconds), ``slowest_rank``,
``gflop`` (all ranks), ``single_rank_s`` and ``single_rank_gflop`` (the whole model on one rank,
the table's "round s"), ``speedup`` (single_rank_s / round_s). ValueError for a bad argument,
naming it and the allowed values.

Owns: the presets (OLMo-2 1B and 7B, read from OLMo-core's model configs: built on the meta
device, no memory allocated, and their 2-D weights listed; embeddings and the output head take
AdamW, as asteria.olmo routes them), the factor list of a set of shapes (the optimizers' own
blocking, ``asteria.optim._blocking.make_layout``), the step time from tokens per step, the
table, and the round of each replica set (``replica_round``). May call:
``asteria.refresh.cost``, ``asteria.refresh.engine`` (lane names), ``asteria.optim._blocking``,
``asteria._C`` (the coherence registry, for owners only; ``asteria.refresh.replicated`` for its
entry ids), olmo_core (presets only), torch.

Examples:
    python3 -m asteria.plan --preset olmo2-1b                        # calibrates here first
    python3 -m asteria.plan --preset olmo2-1b --preset olmo2-7b --cores 14 \\
        --tokens 65536 --tokens 524288 --gflops-per-core 20 --markdown
    python3 -m asteria.plan --shape 4096x4096 --shape 11008x4096 --step-time 1.5
    python3 -m asteria.plan --preset olmo2-7b --nodes 4 --gpus-per-node 8 --parallel hsdp
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Optional, Sequence

import torch

from asteria.optim import METHODS
from asteria.optim._blocking import make_layout
from asteria.optim.method import method_of
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane
from asteria.refresh.replicated import _ID_BITS

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


def transfer_bytes(sizes: Counter, optimizer: str) -> tuple[int, int]:
    """(device-to-host, host-to-device) bytes of a REFRESH round on the host workers of
    float32 factors {size n: count}: each snapshot copies its factor (n x n), each install its
    outputs (the n x n basis or root, and the method's extra outputs: SOAP's sort order, n
    int64)."""
    extra = sum(torch.empty((), dtype=d).element_size()
                for d in method_of(optimizer).METHOD.EXTRA_OUTPUTS)
    d2h = sum(k * n * n * 4 for n, k in sizes.items())
    h2d = sum(k * (n * n * 4 + n * extra) for n, k in sizes.items())
    return d2h, h2d


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
    for ranks in sets:
        index, parts = shards[ranks[0]]
        local = [shard_shape(s, parts, index) for s in shapes]
        batches = list(factors([s for s in local if s[0] > 0], max_dim, block_size,
                               optimizer).items())
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


def row(model: C.CostModel, name: str, sizes: Counter, optimizer: str, cores: int,
        step_s: float, staleness, frequency, device: int, tokens: Optional[int],
        fb_share: float = 0.0, pcie_gbps: float = 0.0):
    """One line of the table. ``frequency``: f or "auto" (chosen here); ``staleness``: S, or
    "auto" with f "auto"; ``fb_share``: the forward and backward's share of ``step_s`` (the
    S = 0 window); ``pcie_gbps``: per direction (0: transfers left out)."""
    jobs = round_jobs(sizes, optimizer)
    lanes = {Lane.HOST: cores, **({Lane.DEVICE: 1} if device else {})}
    d2h, h2d = transfer_bytes(sizes, optimizer)
    xfer_s = (d2h + h2d) / (pcie_gbps * 1e9) if pcie_gbps else 0.0
    round_s = C.split_makespan(model, jobs, lanes) + xfer_s
    host_s = C.split_makespan(model, jobs, {Lane.HOST: cores}) + xfer_s
    device_s = C.makespan(model, jobs, 1, Lane.DEVICE)  # the device executor: no transfer
    whole_s = C.makespan(model, jobs, cores)
    gflop = sum(j.flops for j in jobs) / 1e9
    fb_s = fb_share * step_s
    auto = frequency == "auto"
    if auto:
        fixed = None if staleness == "auto" else staleness
        frequency, staleness = min(C.choose_frequency(x, step_s, fb_s, fixed)
                                   for x in ((round_s, device_s) if device else (round_s,)))
    window = C.window_s(staleness, step_s, fb_s)
    s_min = 0 if round_s <= fb_s else C.smallest_s(round_s, step_s)
    w_min = C.smallest_workers(model, jobs, window - xfer_s, True, device)
    busy = sum(model.job_seconds(Lane.HOST, j) for j in jobs)
    where = ("host" if host_s <= window else "device" if device_s <= window
             else "host + device" if round_s <= window else "neither")
    return {"model": name, "tokens": tokens, "step_s": step_s,
            "factors": sum(sizes.values()), "sizes": dict(sorted(sizes.items())),
            "gflop": gflop, "round_s": round_s, "round_whole_jobs_s": whole_s,
            "window_s": window, "utilisation": min(1.0, busy / (cores * frequency * step_s)),
            "smallest_s": s_min, "fits": s_min is not None and s_min <= staleness,
            "smallest_cores": w_min, "fb_s": fb_s, "bytes_d2h": d2h, "bytes_h2d": h2d,
            "transfer_s": xfer_s, "host_round_s": host_s, "device_round_s": device_s,
            "device_rate": model.sources(Lane.DEVICE, jobs), "refresh_on": where,
            "frequency": frequency, "staleness": staleness, "frequency_auto": auto}


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
        s_min = r["smallest_s"]
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
            lines[-1] += [str(r["frequency"]), str(r["staleness"])]
        if reps:
            rep = r["replicas"]
            lines[-1] += [str(rep["ranks"]), str(rep["replica_set_size"]),
                          f"{rep['round_s']:.2f}", f"{rep['speedup']:.2f}x",
                          str(r["smallest_s_set"])]
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in lines]
    return "\n".join(out)


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
    ap.add_argument("--device-gflops", type=float, default=None,
                    help="add a device lane of this throughput (hybrid rounds)")
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
    ap.add_argument("-S", "--staleness", type=staleness_arg, default=5,
                    help="an integer >= 0, or auto (with -f auto: chosen with f)")
    ap.add_argument("--fb-share", type=share_arg, default=None,
                    help="the forward and backward's share of the step time, the S=0 window "
                         "(default: 1 with --tokens, whose step is the forward and backward's "
                         "FLOPs; 0.9 with --step-time)")
    ap.add_argument("--pcie-gbps", type=rate_arg, default=PCIE_GBPS,
                    help=f"host<->device copy rate per direction, GB/s (default {PCIE_GBPS:g}: "
                         "PCIe 5.0 x16's 63 GB/s less packet overhead; 0: transfers left out)")
    ap.add_argument("--max-precond-dim", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if not args.preset and not args.shape:
        ap.error("give --preset and/or --shape")
    if args.shape and args.tokens:
        ap.error("--tokens needs a preset (its FLOPs per token); give --step-time for --shape")
    if args.staleness == "auto" and args.frequency != "auto":
        ap.error("-S auto needs -f auto here (staleness 'auto' with an integer f is chosen "
                 "from a run's measurements: optimizer.asteria_plan())")
    if args.fb_share is None:
        args.fb_share = 0.9 if args.step_time is not None else 1.0
    op = method_of(args.optimizer).METHOD.REFRESH_OP[0]
    if args.gflops_per_core is None:
        model, source = calibrated(args.optimizer)
    else:
        model = C.CostModel({Lane.HOST: args.gflops_per_core}, "given")
        source = f"given: {args.gflops_per_core} GFLOP/s per core"
    if args.device_gflops:
        model.base_gflops[Lane.DEVICE] = args.device_gflops
    models = [(p, preset(p, args.seq_len)) for p in args.preset]
    if args.shape:
        models.append(("shapes", {"shapes": args.shape, "flops_per_token": None}))
    rows = []
    world = args.nodes * args.gpus_per_node
    for name, m in models:
        sizes = factors(m["shapes"], args.max_precond_dim, args.block_size, args.optimizer)
        rep = None if world == 1 else replica_round(
            m["shapes"], args.optimizer, args.nodes, args.gpus_per_node, args.parallel,
            args.cores, model, args.max_precond_dim, args.block_size,
            device=1 if args.device_gflops else 0)
        if args.step_time is not None:
            steps = [(None, args.step_time)]
        else:
            toks = args.tokens or [65536, 524288]
            steps = [(t, m["flops_per_token"] * t / (args.mfu * args.peak_tflops * 1e12))
                     for t in toks]
        for tokens, step_s in steps:
            rows.append(row(model, name, sizes, args.optimizer, args.cores, step_s,
                            args.staleness, args.frequency,
                            1 if args.device_gflops else 0, tokens,
                            fb_share=args.fb_share, pcie_gbps=args.pcie_gbps))
            if rep is not None:
                rows[-1]["replicas"] = rep
                rows[-1]["smallest_s_set"] = C.smallest_s(rep["round_s"], step_s)
    print(fmt_table(rows, args.cores, args.staleness, args.frequency, args.markdown))
    print()
    print(f"per-core throughput: {source}; beyond the largest measured size the rate is held "
          f"(time grows as n^3).")
    print(f"{args.optimizer} ({op}), max_precond_dim {args.max_precond_dim}, block_size "
          f"{args.block_size}, f={args.frequency}, S={args.staleness}"
          + ("" if args.step_time is not None else
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
              f"takes {r['device_round_s']:.1f} s (device rate: {', '.join(r['device_rate'])})")
    for r in rows:
        tok = "" if r["tokens"] is None else f" at {r['tokens'] // 1024}k tokens"
        if r["frequency_auto"]:
            print(f"{r['model']}{tok}: -f auto chooses f={r['frequency']}, "
                  f"S={r['staleness']}" + ("" if r["fits"] else
                  f"; not hidden at S={r['staleness']}: each install waits about "
                  f"{max(0.0, r['round_s'] - r['window_s']):.1f} s for the rest of its round, "
                  f"once every {r['frequency']} steps"))
        if r["refresh_on"] == "device":
            print(f"{r['model']}{tok}: the host workers' round with its transfers "
                  f"({r['host_round_s']:.1f} s) does not fit the window ({r['window_s']:.1f} s) "
                  f"but the device executor's ({r['device_round_s']:.1f} s) does: it must "
                  f"take the round (runtime refresh_device=True)")
        elif r["refresh_on"] == "neither":
            print(f"{r['model']}{tok}: neither the host workers' round with its transfers "
                  f"({r['host_round_s']:.1f} s) nor the device executor's "
                  f"({r['device_round_s']:.1f} s) fits the window ({r['window_s']:.1f} s)")
    if args.device_gflops:
        print(f"with a device lane of {args.device_gflops} GFLOP/s (hybrid rounds)")
    if world > 1:
        print(replicas_note(args, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
