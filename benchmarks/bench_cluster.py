"""Staleness and hierarchy against a slow inter-node link: Asteria SOAP on an emulated cluster.

The cluster: tests/python/cluster/netns.py (docs/distributed.md "An emulated cluster"): N nodes,
each a network namespace holding its 2 ranks, joined through a switch namespace by veth links
shaped with a token bucket (tc tbf) to a rate; torchrun per node, gloo over the links. Latency
is not emulated (the kernel has no netem): a slow link here is a narrow one.

The job: an MLP of square layers (tanh), float32, each rank its own batch of ``--tokens`` rows
(a regression onto a fixed random function), trained by Asteria SOAP (async, one worker per rank,
deterministic installs, block 64, precondition_frequency f) with linear warm-up over the first
10% of the steps and cosine decay to 10% of the peak lr, in two layouts:
  hsdp  FSDP2 on a (replicate = nodes) x (shard = ranks per node) mesh: each weight sharded
        inside a node, the shards replicated across nodes (one replica per node, so the
        hierarchy has nothing to do: hier and flat run the same protocol);
  ddp   every weight on every rank (replica sets of all ranks: 2 per node, where the
        hierarchy sends each block across the nodes once instead of once per replica).
For every (layout, coherence topology hier / flat, S in {1, 2, 5}) at two link rates and for 2
and 4 nodes: the job's step time (per step the slowest rank) median and p99, the bytes each link
carried (eth0: inter-node; lo: intra-node, summed over nodes, from the kernel's counters over the
training steps), the time the training thread waited on the optimizer's communication (the
bounded barrier of the coherence units, ``coherence_barrier_wait_ns``) as a share of the step
time, the owners' refresh work (``worker_busy_ns`` per round) beside the capacity planner's
prediction (``asteria.plan.replica_round``), and the final loss (mean of the last 10 steps over
the ranks). The slow rate is chosen so that flat synchronisation at S = 1 waits for the link;
the fast one so that it does not.

Needs root and the veth / bridge / tbf kernel modules (netns.unavailable() says what is missing).
All ranks share this machine's 2 cores: absolute times are the contention's; what the link adds,
and what S hides of it, is the result.

Writes benchmarks/results/cluster/bench_cluster.{json,png}.

    python3 benchmarks/bench_cluster.py                 # about 11 minutes on 2 cores
    python3 benchmarks/bench_cluster.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from typing import Any, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "python", "cluster"))
import common  # noqa: E402
from bench_coherence import install_steps  # noqa: E402

NAME = "bench_cluster"
LAYOUTS = ("hsdp", "ddp")
TOPOLOGIES = ("hier", "flat")
STALENESS = (1, 2, 5)
PER_NODE = 2
FINAL_WINDOW = 10
PROGRESS = "[bench_cluster rank 0]"  # a worker's progress line, echoed by the driver


# ---- the per-rank worker -------------------------------------------------------------------------

def _schedule(steps: int):
    warm = max(1, steps // 10)

    def factor(i: int) -> float:  # i: 0-based step index
        if i < warm:
            return (i + 1) / warm
        x = (i - warm) / max(1, steps - warm)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x))
    return factor


def worker(args) -> NoReturn:
    import torch
    import torch.distributed as dist
    from torch import nn

    import asteria
    from netns import read_counters

    rank, world = common.init_gloo(args.timeout)
    nodes = world // PER_NODE
    d = args.width
    target = torch.randn(d, d, generator=torch.Generator().manual_seed(7)) / d ** 0.5
    mesh = None
    if "hsdp" in args.layouts:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (nodes, PER_NODE), mesh_dim_names=("replicate", "shard"))

    def build(layout: str):
        torch.manual_seed(0)
        layers = []
        for _ in range(args.layers):
            layers += [nn.Linear(d, d), nn.Tanh()]
        net = nn.Sequential(*layers)
        if layout == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            return DDP(net)
        from torch.distributed.fsdp import fully_shard
        for m in net:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    out = {"rank": rank, "node": int(os.environ.get("GROUP_RANK", rank // PER_NODE)), "runs": []}
    for layout in args.layouts:
        for topo in args.topologies:
            for s in args.staleness:
                net = build(layout)
                opt = asteria.SOAP(net.parameters(), lr=args.lr, block_size=args.block_size,
                                   precondition_frequency=args.frequency,
                                   runtime={"mode": "async", "staleness": s, "workers": 1,
                                            "install": "deterministic",
                                            "coherence_topology": topo})
                sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(args.steps))
                dist.barrier()
                before = read_counters()
                times, losses = [], []
                for t in range(1, args.steps + 1):
                    gen = torch.Generator().manual_seed(1000 * t + rank)
                    x = torch.randn(args.tokens, d, generator=gen)
                    t0 = time.perf_counter()
                    opt.zero_grad(set_to_none=True)
                    loss = ((net(x) - torch.sin(x @ target)) ** 2).mean()
                    loss.backward()
                    opt.step()
                    sched.step()
                    times.append(time.perf_counter() - t0)
                    losses.append(float(loss.detach()))
                    if t == args.warmup:  # the waits of the measured steps only
                        waited0 = opt.asteria_stats().get("coherence_barrier_wait_ns", 0)
                # the pool's CPU time so far (its threads go with close), and the rounds
                # installed by then: the owners' work per round on a core, not stretched by
                # the other ranks sharing the cores as worker_busy_ns is
                pool_cpu_ns = common.threads_cpu_ns()
                installed = opt.asteria_stats().get("coherence_units", 0)
                opt.close()  # the round in flight finishes: all of its traffic counts
                dist.barrier()
                after = read_counters()
                st = opt.asteria_stats()
                keep = {k: v for k, v in st.items()
                        if k.startswith(("bytes_intra", "bytes_inter", "bytes_flat",
                                         "coherence_"))
                        or k in ("refreshes_submitted", "installs", "worker_busy_ns",
                                 "jobs_submitted", "jobs_done")}
                keep["pool_cpu_ns"], keep["units_before_close"] = pool_cpu_ns, installed
                keep["measured_wait_ns"] = keep.get("coherence_barrier_wait_ns", 0) - waited0
                keep["coherence_by_staleness"] = {
                    str(k): v for k, v in keep.get("coherence_by_staleness", {}).items()}
                if rank == 0:
                    print(f"{PROGRESS} {layout} {topo} S={s}: median step "
                          f"{1e3 * sorted(times)[len(times) // 2]:.0f} ms (rank 0), loss "
                          f"{sum(losses[-FINAL_WINDOW:]) / len(losses[-FINAL_WINDOW:]):.5f}",
                          flush=True)
                out["runs"].append({"layout": layout, "topology": topo, "staleness": s,
                                    "step_s": times, "loss": losses, "stats": keep,
                                    "link": {k: after[k] - before[k] for k in after}})
                del opt, net
                dist.barrier()
    common.finish_rank(args.out, rank, out)


# ---- one launch: a cluster at one rate ----------------------------------------------------------

def _echo(path: str, seen: int, progress) -> int:
    """Pass on the progress lines of ``path`` after its first ``seen`` lines; lines read."""
    try:
        with open(path, errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return seen
    for line in lines[seen:]:
        if line.startswith(PROGRESS):
            progress("    " + line[len(PROGRESS):].strip())
    return len(lines)


def launch(cluster, args, out: str, progress) -> list[dict]:
    """torchrun on every node of ``cluster`` running this file's worker, its progress passed
    on; the per-rank results."""
    wargs = ["--worker", "--out", out, "--steps", str(args.steps), "--width", str(args.width),
             "--layers", str(args.layers), "--tokens", str(args.tokens), "--lr", str(args.lr),
             "--block-size", str(args.block_size), "--frequency", str(args.frequency),
             "--staleness", ",".join(map(str, args.staleness)),
             "--layouts", ",".join(args.layouts), "--topologies", ",".join(args.topologies),
             "--timeout", str(args.timeout)]
    env = common.ranks_env()
    procs, logs = [], []
    for node in range(cluster.nodes):
        log = open(os.path.join(out, f"node{node}.log"), "w")
        logs.append(log)
        procs.append(cluster.torchrun(node, [os.path.abspath(__file__), *wargs], PER_NODE, env,
                                      stdout=log, stderr=subprocess.STDOUT))
    t0, limit, seen = time.monotonic(), args.timeout * len(args.staleness) * 4, 0
    while any(p.poll() is None for p in procs) and time.monotonic() - t0 < limit:
        time.sleep(1.0)
        seen = _echo(os.path.join(out, "node0.log"), seen, progress)
    _echo(os.path.join(out, "node0.log"), seen, progress)
    failed = any(p.poll() != 0 for p in procs)  # None: still running past the limit
    for log in logs:
        log.close()
    if failed:
        for node in range(cluster.nodes):
            with open(os.path.join(out, f"node{node}.log"), errors="replace") as fh:
                sys.stderr.write(fh.read()[-4000:])
        raise SystemExit(f"{NAME}: a rank failed ({cluster.nodes} nodes at {cluster.rate})")
    return common.read_ranks(out, cluster.nodes * PER_NODE)


# ---- aggregation --------------------------------------------------------------------------------

def aggregate(per_rank: list[dict], args, nodes: int, rate: str) -> list[dict]:
    results = []
    for i, run in enumerate(per_rank[0]["runs"]):
        runs = [r["runs"][i] for r in per_rank]
        steps = len(run["step_s"])
        job = [max(r["step_s"][t] for r in runs) for t in range(steps)]
        measured = job[args.warmup:]
        inst = [job[t - 1] for t in install_steps(steps, args.frequency, run["staleness"])
                if t > args.warmup]
        st = [r["stats"] for r in runs]
        # a node's counters are read by each of its ranks: take its first rank's
        first = {}
        for r in per_rank:
            first.setdefault(r["node"], r["runs"][i]["link"])
        wait_s = [x["measured_wait_ns"] / 1e9 for x in st]
        step_total = [sum(r["step_s"][args.warmup:]) for r in runs]
        rounds = max(1, max(x.get("coherence_units", 0) for x in st))
        losses = [sum(r["loss"][-FINAL_WINDOW:]) / len(r["loss"][-FINAL_WINDOW:]) for r in runs]
        res = {
            "nodes": nodes, "rate": rate, "layout": run["layout"], "topology": run["topology"],
            "staleness": run["staleness"],
            "step": common.summarize_ms(measured),
            "install_steps": common.summarize_ms(inst) if inst else None,
            "link_bytes": {"inter_node": sum(v["tx_bytes"] for v in first.values()),
                           "intra_node": sum(v["lo_bytes"] for v in first.values())},
            "coherence_bytes": {lv: sum(x.get(f"bytes_{lv}", 0) for x in st) for lv in
                                ("intra_node", "inter_node", "flat", "flat_inter_node")},
            "comm_wait_s_per_rank": wait_s,
            "comm_wait_share": max(w / t for w, t in zip(wait_s, step_total) if t > 0),
            # what one round's synchronisation adds to its install step, in median steps
            "wait_per_round_over_step": (max(wait_s) / max(1, len(inst))
                                         / common.percentile(measured, 50)),
            "barrier_waits": max(x.get("coherence_barrier_waits", 0) for x in st),
            "units": rounds,
            "owner_busy_ms_per_round": [x.get("worker_busy_ns", 0) / 1e6 / rounds for x in st],
            "owner_cpu_ms_per_round": [(x.get("pool_cpu_ns") or 0) / 1e6
                                       / max(1, x.get("units_before_close", 0)) for x in st],
            "comm_thread_ms_per_round": [x.get("coherence_transfer_ns", 0) / 1e6 / rounds
                                         for x in st],
            "final_loss": sum(losses) / len(losses),
            "step_ms": [round(1e3 * t, 3) for t in job],
        }
        results.append(res)
    return results


def key(r: dict) -> str:
    return f"{r['nodes']}n {r['rate']} {r['layout']} {r['topology']} S={r['staleness']}"


def summarize(results: list[dict], slow: str) -> dict:
    """The issue's targets, read off the results."""
    out: dict[str, Any] = {"checks": []}
    by = {key(r): r for r in results}
    for r in results:
        if r["topology"] != "hier" or r["staleness"] != 5:
            continue
        base = by.get(key(dict(r, staleness=1)))
        flat = by.get(key(dict(r, topology="flat")))
        flat1 = by.get(key(dict(r, topology="flat", staleness=1)))
        c = {"run": key(r), "comm_wait_share": r["comm_wait_share"],
             "flat_S1_comm_wait_share": flat1["comm_wait_share"] if flat1 else None,
             "flat_S1_wait_per_round_over_step": (flat1["wait_per_round_over_step"]
                                                  if flat1 else None),
             "loss_minus_S1": r["final_loss"] - base["final_loss"] if base else None,
             # mean, not median: the steps that wait are what S and the hierarchy remove
             "mean_step_ms": r["step"]["mean_ms"],
             "S1_mean_step_ms": base["step"]["mean_ms"] if base else None,
             "flat_mean_step_ms": flat["step"]["mean_ms"] if flat else None,
             "flat_S1_mean_step_ms": flat1["step"]["mean_ms"] if flat1 else None,
             "inter_bytes_hier_over_flat": (r["link_bytes"]["inter_node"]
                                            / flat["link_bytes"]["inter_node"]
                                            if flat and flat["link_bytes"]["inter_node"] else None),
             "coherence_inter_hier_over_flat": (
                 r["coherence_bytes"]["inter_node"] / flat["coherence_bytes"]["inter_node"]
                 if flat and flat["coherence_bytes"]["inter_node"] else None)}
        if r["rate"] == slow:
            c["target_wait_under_5pct"] = r["comm_wait_share"] < 0.05
            c["target_loss_within_0.01"] = (c["loss_minus_S1"] is not None
                                            and abs(c["loss_minus_S1"]) <= 0.01)
            c["target_flat_S1_waits_30pct_of_a_step"] = (
                (c["flat_S1_wait_per_round_over_step"] or 0) >= 0.30)
        if c["coherence_inter_hier_over_flat"] is not None:
            c["target_inter_at_most_1_over_ranks_per_node"] = (
                c["coherence_inter_hier_over_flat"] <= 1 / PER_NODE + 1e-9)
        out["checks"].append(c)
    return out


# ---- the planner's prediction -------------------------------------------------------------

def predict(args, nodes: int, layout: str) -> dict:
    """asteria.plan's round for this job (each rank's owned factors on its one worker), priced
    at the per-core rate of SOAP's refresh op measured here, beside nothing else: the caller
    puts the measured rounds next to it."""
    from asteria import plan
    from asteria.refresh import cost as C

    if getattr(predict, "model", None) is None:
        predict.model = C.calibrate(ops=("soap_qr",), sizes=(32, 64, 128))
    shapes = [(args.width, args.width)] * args.layers + [(args.width,)] * args.layers
    r = plan.replica_round(shapes, "soap", nodes, PER_NODE, layout, 1, predict.model,
                           max_dim=10000, block_size=args.block_size)
    return {"round_ms": 1e3 * r["round_s"], "single_rank_ms": 1e3 * r["single_rank_s"],
            "speedup": r["speedup"], "owner_factors": r["owner_factors"],
            "busy_ms_per_rank": [1e3 * x for x in r["busy_seconds"]]}


# ---- plot and table ----------------------------------------------------------------------------

def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    res = data["results"]
    rates = data["settings"]["rates"]
    combos = [(n, lay) for n in data["settings"]["nodes"] for lay in data["settings"]["layouts"]]
    fig, axes = plt.subplots(2, len(combos), figsize=(4.2 * len(combos), 8), squeeze=False)
    for j, (n, lay) in enumerate(combos):
        a, b = axes[0][j], axes[1][j]
        for rate, color in zip(rates, ("tab:red", "tab:blue")):
            for topo, style in (("hier", "-o"), ("flat", "--s")):
                rs = sorted((r for r in res if (r["nodes"], r["layout"], r["rate"],
                                                r["topology"]) == (n, lay, rate, topo)),
                            key=lambda r: r["staleness"])
                if not rs:
                    continue
                ss = [r["staleness"] for r in rs]
                a.plot(ss, [r["step"]["mean_ms"] for r in rs], style, color=color,
                       label=f"{rate} {topo} mean")
                a.plot(ss, [r["step"]["p99_ms"] for r in rs], style, color=color, alpha=0.35,
                       label=f"{rate} {topo} p99")
                b.plot(ss, [100 * r["comm_wait_share"] for r in rs], style, color=color,
                       label=f"{rate} {topo}")
        a.set(title=f"{lay}, {n} nodes x {PER_NODE}", xlabel="S",
              ylabel="job step (ms): mean, and p99 (light)")
        b.axhline(5, color="k", lw=0.8, ls=":")
        b.set(xlabel="S", ylabel="comm wait (% of step time)",
              title="training thread waiting on the coherence units")
    common.save_figure(fig, [x for row in axes for x in row], path,
                       f"Asteria SOAP on an emulated cluster ({data['settings']['layers']} x "
                       f"{data['settings']['width']}^2 MLP, {data['settings']['tokens']} "
                       f"rows/rank/step, f={data['settings']['frequency']})", data["machine"])


def print_table(data: dict) -> None:
    hdr = (f"{'nodes':>5} {'rate':>8} {'layout':>6} {'topo':>5} {'S':>2} {'median ms':>10} "
           f"{'p99 ms':>8} {'wait %':>7} {'wait/round':>11} {'inter MB':>9} {'intra MB':>9} "
           f"{'coh inter MB':>13} {'owner ms/round':>15} {'final loss':>11}")
    common.print_header(hdr)
    for r in data["results"]:
        own = max(r["owner_busy_ms_per_round"])
        print(f"{r['nodes']:>5} {r['rate']:>8} {r['layout']:>6} {r['topology']:>5} "
              f"{r['staleness']:>2} {r['step']['median_ms']:>10.1f} {r['step']['p99_ms']:>8.1f} "
              f"{100 * r['comm_wait_share']:>7.1f} {r['wait_per_round_over_step']:>11.2f} "
              f"{r['link_bytes']['inter_node'] / 1e6:>9.2f} "
              f"{r['link_bytes']['intra_node'] / 1e6:>9.2f} "
              f"{r['coherence_bytes']['inter_node'] / 1e6:>13.2f} {own:>15.1f} "
              f"{r['final_loss']:>11.5f}")
    for c in data["summary"]["checks"]:
        print("  " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in c.items()))
    for k, p in data.get("prediction", {}).items():
        print(f"  planner, {k}: predicted round {p['round_ms']:.2f} ms (one rank alone "
              f"{p['single_rank_ms']:.2f} ms, x{p['speedup']:.2f}); measured slowest owner "
              f"{p['measured_round_ms_median']:.2f} ms wall (x{p['measured_over_predicted']:.2f}), "
              f"{p['measured_round_cpu_ms_median']:.2f} ms CPU "
              f"(x{p['measured_cpu_over_predicted']:.2f})")


# ---- main -------------------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 nodes, few steps")
    ap.add_argument("--nodes", default=None, help="node counts, 2 ranks each (2,4; --quick 2)")
    ap.add_argument("--rates", default="16mbit,1gbit",
                    help="inter-node link rates (tc syntax), slow first")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--topologies", default=",".join(TOPOLOGIES))
    ap.add_argument("--staleness", default=None, help="S values (1,2,5; --quick 1,5)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (60; --quick 12)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (5; --quick 2)")
    ap.add_argument("--width", type=int, default=None, help="layer width (128; --quick 32)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=None,
                    help="batch rows per rank per step (2048 = 16x the width; --quick 64)")
    ap.add_argument("--block-size", type=int, default=None, help="SOAP block (64; --quick 16)")
    ap.add_argument("--frequency", type=int, default=5, help="precondition_frequency f")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak lr")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="the collective timeout (s); a launch may take 4 x this per S")
    common.add_output_args(ap)
    args = ap.parse_args(argv)
    q = args.quick
    common.fill_defaults(args, dict(
        steps=12 if q else 60, warmup=2 if q else 5, width=32 if q else 128,
        tokens=64 if q else 2048, block_size=16 if q else 64, nodes="2" if q else "2,4",
        staleness="1,5" if q else ",".join(map(str, STALENESS)),
        out_dir=os.path.join(common.RESULTS_DIR, "tmp" if q else "cluster")))
    args.nodes = [int(x) for x in str(args.nodes).split(",") if x.strip()]
    args.rates = [x.strip() for x in args.rates.split(",") if x.strip()]
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    args.topologies = [x.strip() for x in args.topologies.split(",") if x.strip()]
    args.staleness = [int(x) for x in str(args.staleness).split(",") if x.strip()]
    for lay in args.layouts:
        if lay not in LAYOUTS:
            ap.error(f"--layouts: unknown {lay!r}; allowed: {', '.join(LAYOUTS)}")
    for t in args.topologies:
        if t not in TOPOLOGIES:
            ap.error(f"--topologies: unknown {t!r}; allowed: {', '.join(TOPOLOGIES)}")
    for s in args.staleness:
        if not 0 <= s <= args.frequency:
            ap.error(f"--staleness {s}: need 0 <= S <= --frequency ({args.frequency})")
    if any(n < 1 for n in args.nodes) or not args.rates:
        ap.error("need --nodes >= 1 and at least one --rates")
    if args.steps <= args.warmup + 1:
        ap.error("need --steps > --warmup + 1")
    return args


def run(args, argv) -> dict[str, Any]:
    import netns

    progress = common.Progress(NAME)
    why = netns.unavailable()
    if why:
        raise SystemExit(f"{NAME}: cannot make an emulated cluster here: {why}")
    meta = common.run_metadata(NAME, __file__, argv)
    progress(f"start: load {common.loadavg()}; nodes {args.nodes} x {PER_NODE} ranks, rates "
             f"{args.rates}, layouts {args.layouts}, topologies {args.topologies}, S "
             f"{args.staleness}, {args.steps} steps each")
    results, cpu = [], {}
    for nodes in args.nodes:
        with netns.Cluster(nodes, args.rates[0]) as cluster:
            for rate in args.rates:
                for i in range(nodes):
                    cluster.set_rate(i, rate)
                cluster.rate = rate
                with common.scratch_dir(f"{NAME}-") as tmp:
                    progress(f"{nodes} nodes at {rate}: launching")
                    cpu0 = common.cpu_snapshot()
                    per_rank = launch(cluster, args, tmp, progress)
                    cpu[f"{nodes}n {rate}"] = common.cpu_delta(cpu0, common.cpu_snapshot())
                got = aggregate(per_rank, args, nodes, rate)
                for r in got:
                    progress(f"  {key(r)}: median {r['step']['median_ms']:.0f} ms, p99 "
                             f"{r['step']['p99_ms']:.0f} ms, wait "
                             f"{100 * r['comm_wait_share']:.1f}%, inter "
                             f"{r['link_bytes']['inter_node'] / 1e6:.2f} MB, loss "
                             f"{r['final_loss']:.5f}")
                results += got
    data = dict(meta)
    data["machine"]["loadavg1_end"] = common.loadavg()
    data["settings"] = {k: getattr(args, k) for k in (
        "nodes", "rates", "layouts", "topologies", "staleness", "steps", "warmup", "width",
        "layers", "tokens", "block_size", "frequency", "lr", "quick")}
    data["settings"].update(ranks_per_node=PER_NODE, backend="gloo", optimizer="SOAP",
                            dtype="float32", workers_per_rank=1, install="deterministic",
                            schedule="linear warm-up 10%, cosine to 10% of the peak")
    data["cpu"] = cpu
    data["results"] = results
    data["summary"] = summarize(results, args.rates[0])
    pred = {}
    for nodes in args.nodes:  # the planner against the slowest owner's measured round
        for lay in args.layouts:
            p = predict(args, nodes, lay)
            rs = [r for r in results if (r["nodes"], r["layout"]) == (nodes, lay)]
            p["measured_round_ms_median"] = common.percentile(
                [max(r["owner_busy_ms_per_round"]) for r in rs], 50)
            p["measured_round_cpu_ms_median"] = common.percentile(
                [max(r["owner_cpu_ms_per_round"]) for r in rs], 50)
            p["measured_over_predicted"] = p["measured_round_ms_median"] / p["round_ms"]
            p["measured_cpu_over_predicted"] = p["measured_round_cpu_ms_median"] / p["round_ms"]
            pred[f"{nodes}n {lay}"] = p
    data["prediction"] = pred
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, progress)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.worker:
        worker(args)
    return run(args, argv)


if __name__ == "__main__":
    main()
