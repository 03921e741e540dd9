"""Coherence traffic and step time of DDP training with SOAP, flat against hierarchical, for the
staleness budgets S in {0, 1, 3, 5, 10}, in one launch.

Four ranks on gloo, arranged as 2 nodes x 2 ranks by two torchrun invocations that rendezvous
with each other (node from GROUP_RANK), train the same DDP model (an MLP of square layers,
float32, SOAP with block_size 64 and precondition_frequency 10, async, deterministic install) for
each (topology, S) in turn. Each replicated REFRESH block is computed by its owner and sent to
the other replicas: "flat" broadcasts it from the owner to every replica; "hier" writes it into
the owner node's shared host copy (/dev/shm), broadcasts it among node representatives, and
lets the others read their node's copy (docs/coherence.md).

Reports per (topology, S), summed over the 4 ranks: bytes per level (intra_node, inter_node, and
the flat-equivalent flat / flat_inter_node counters), inter_node / flat_inter_node, the version
exchange bytes; the job's step time (per step the slowest rank, as DDP synchronises them) as
median / p99 / max, and the same over the install steps alone; the bounded-barrier waits; and
the comm thread's time. The machine has 2 cores for 4 ranks, their comm threads and 4 C workers:
absolute times are dominated by that contention, the ratios between runs are the result.

Writes benchmarks/results/bench_coherence.json (machine, versions, command, date, every step
time) and bench_coherence.png.

    python3 benchmarks/bench_coherence.py            # ~3 minutes on 2 cores
    python3 benchmarks/bench_coherence.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "bench_coherence"
STALENESS = (0, 1, 3, 5, 10)
TOPOLOGIES = ("flat", "hier")
NODES, PER_NODE = 2, 2


# ---- the per-rank worker -------------------------------------------------------------------------

def worker(args) -> NoReturn:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import asteria

    rank, world = common.init_gloo(120)
    out = {"rank": rank, "env": common.launcher_env(), "runs": []}
    for topo in TOPOLOGIES:
        for s in args.staleness:
            net = DDP(common.mlp_job_net(args))
            opt = asteria.SOAP(net.parameters(), lr=1e-3, block_size=args.block_size,
                               precondition_frequency=args.frequency,
                               runtime={"mode": "async", "staleness": s, "workers": 1,
                                        "coherence_topology": topo})
            times, loss = common.mlp_job_steps(net, opt, rank, args)
            opt.close()  # finishes the refresh in flight on every rank: all of its traffic counts
            st = opt.asteria_stats()
            keep = {k: v for k, v in st.items()
                    if k.startswith(("bytes_intra", "bytes_inter", "bytes_flat", "coherence_"))
                    or k in ("jobs_submitted", "barrier_waits", "barrier_wait_ns",
                             "refreshes_submitted", "installs")}
            keep["coherence_by_staleness"] = {str(k): v for k, v in
                                              keep.get("coherence_by_staleness", {}).items()}
            out["runs"].append({"topology": topo, "staleness": s, "step_s": times,
                                "stats": keep, "final_loss": loss})
            dist.barrier()
    common.finish_rank(args.out, rank, out)


# ---- the launcher ----------------------------------------------------------------------------

def launch(args, out: str) -> None:
    wargs = common.mlp_job_worker_args(args, out) + [
        "--staleness", ",".join(str(s) for s in args.staleness)]
    common.launch_torchrun(__file__, wargs, out, NODES, PER_NODE, args.timeout, "bench_coherence")


def install_steps(steps: int, f: int, s: int) -> list[int]:
    """SOAP: step 1 computes the first basis; refreshes are snapshotted at 1 + k f and installed
    S steps later."""
    return [1 + k * f + s for k in range(1, steps) if 1 + k * f + s <= steps]


def aggregate(per_rank: list[dict], args) -> list[dict]:
    results = []
    for i, run in enumerate(per_rank[0]["runs"]):
        runs = [r["runs"][i] for r in per_rank]
        steps = len(run["step_s"])
        job = [max(r["step_s"][t] for r in runs) for t in range(steps)]  # DDP: the slowest
        measured = job[args.warmup:]
        inst = [job[t - 1] for t in install_steps(steps, args.frequency, run["staleness"])
                if t > args.warmup]
        st = [r["stats"] for r in runs]

        def total(key):
            return sum(x.get(key, 0) for x in st)

        by_s = [x["coherence_by_staleness"].get(str(run["staleness"]), {}) for x in st]
        res = {
            "topology": run["topology"], "staleness": run["staleness"],
            "step": common.summarize_ms(measured),
            "install_steps": common.summarize_ms(inst) if inst else None,
            "bytes": {lv: total(f"bytes_{lv}") for lv in
                      ("intra_node", "inter_node", "flat", "flat_inter_node")},
            "exchange_bytes": total("coherence_exchange_bytes"),
            "units": max(x.get("coherence_units", 0) for x in st),
            "entries_computed": total("coherence_entries_computed"),
            "entries_received": total("coherence_entries_received"),
            "refresh_barrier_waits": sum(b.get("barrier_waits", 0) for b in by_s),
            "refresh_barrier_wait_ms": sum(b.get("barrier_wait_ns", 0) for b in by_s) / 1e6,
            "min_window_slack": min((b["min_window_slack"] for b in by_s
                                     if b.get("min_window_slack") is not None), default=None),
            "comm_thread_ms_per_rank": [x.get("coherence_transfer_ns", 0) / 1e6 for x in st],
            "final_loss": run["final_loss"],
            "step_ms": [1e3 * t for t in job],
        }
        b = res["bytes"]
        res["inter_over_flat_inter"] = (b["inter_node"] / b["flat_inter_node"]
                                        if b["flat_inter_node"] else None)
        results.append(res)
    return results


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    res = data["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for topo, style in (("flat", "--"), ("hier", "-")):
        rs = sorted((r for r in res if r["topology"] == topo), key=lambda r: r["staleness"])
        ss = [r["staleness"] for r in rs]
        ax.plot(ss, [r["step"]["median_ms"] for r in rs], style + "o", color="tab:blue",
                label=f"{topo}: median step")
        ax.plot(ss, [r["install_steps"]["median_ms"] if r["install_steps"] else float("nan")
                     for r in rs], style + "s", color="tab:orange",
                label=f"{topo}: median install step")
        ax.plot(ss, [r["step"]["max_ms"] for r in rs], style + "^", color="tab:green",
                label=f"{topo}: max step")
    ax.set_xlabel("staleness S (steps)")
    ax.set_ylabel("step time of the job (ms, slowest rank)")
    ax.set_title("DDP SOAP, 4 ranks = 2 nodes x 2 (gloo, 2 cores)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax = axes[1]
    levels = ("intra_node", "inter_node", "flat_inter_node")
    width = 0.35
    for k, topo in enumerate(TOPOLOGIES):
        r = next(x for x in res if x["topology"] == topo and x["staleness"] == 1)
        units = max(r["units"], 1)
        vals = [r["bytes"][lv] / units / 1024 for lv in levels]
        xs = [i + (k - 0.5) * width for i in range(len(levels))]
        ax.bar(xs, vals, width, label=topo)
    ax.set_xticks(range(len(levels)))
    ax.set_xticklabels(["intra-node", "inter-node", "inter-node if flat"])
    ax.set_ylabel("KiB per sync unit, summed over ranks (S = 1)")
    ax.set_title("coherence bytes per level")
    ax.legend()
    common.write_png(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_mlp_job_args(ap, steps=42, width=128, tokens=512)
    ap.add_argument("--staleness", default=",".join(str(s) for s in STALENESS))
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.staleness = [int(s) for s in str(args.staleness).split(",")]
    if args.worker:
        worker(args)
    if args.quick:
        args.steps, args.width, args.tokens, args.block_size = 14, 32, 64, 16
    progress = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    with common.scratch_dir("bench_coherence-") as tmp:
        progress(f"launching 2 x torchrun --nproc-per-node {PER_NODE}: {len(TOPOLOGIES)} "
                 f"topologies x S in {args.staleness}, {args.steps} steps each")
        cpu0 = common.cpu_snapshot()
        launch(args, tmp)
        cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
        per_rank = common.read_ranks(tmp, NODES * PER_NODE)
    data = dict(meta)
    data["settings"] = {k: getattr(args, k) for k in ("steps", "warmup", "width", "layers",
                                                      "tokens", "block_size", "frequency",
                                                      "staleness", "quick")}
    data["settings"].update(nodes=NODES, ranks_per_node=PER_NODE, backend="gloo",
                            optimizer="SOAP", dtype="float32", workers_per_rank=1)
    data["launch"] = {"env": [r["env"] for r in per_rank], "cpu": cpu}
    data["results"] = aggregate(per_rank, args)
    hier = [r for r in data["results"] if r["topology"] == "hier"]
    flat = {r["staleness"]: r for r in data["results"] if r["topology"] == "flat"}
    data["summary"] = {
        "inter_node_hier_over_flat": {str(r["staleness"]): (
            r["bytes"]["inter_node"] / flat[r["staleness"]]["bytes"]["inter_node"]
            if flat[r["staleness"]]["bytes"]["inter_node"] else None) for r in hier},
        "median_step_ms": {f"{r['topology']} S={r['staleness']}": r["step"]["median_ms"]
                           for r in data["results"]},
        "install_step_median_ms": {f"{r['topology']} S={r['staleness']}":
                                   (r["install_steps"] or {}).get("median_ms")
                                   for r in data["results"]},
    }
    path = common.write_json(data, f"{NAME}.json", args.out_dir)
    progress(f"wrote {path}")
    if not args.no_plot:
        try:
            png = os.path.join(args.out_dir or common.RESULTS_DIR, f"{NAME}.png")
            plot(data, png)
            progress(f"wrote {png}")
        except ImportError:
            progress("matplotlib missing: no plot")
    for r in data["results"]:
        b = r["bytes"]
        progress(f"{r['topology']:4s} S={r['staleness']:2d}: step median "
                 f"{r['step']['median_ms']:7.1f} ms, install-step median "
                 f"{(r['install_steps'] or {}).get('median_ms', float('nan')):7.1f} ms, "
                 f"inter {b['inter_node']} B (flat-equivalent {b['flat_inter_node']}), "
                 f"barrier waits {r['refresh_barrier_waits']}")
    return data


if __name__ == "__main__":
    main()
