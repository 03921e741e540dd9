"""FSDP2 with SOAP: per-shard blocks (``fsdp_blocking="local"``) against global blocks
(``"global"``, one owner rank per block of the full parameter), on 4 ranks.

Four ranks on gloo (2 nodes x 2 ranks: two torchrun invocations that rendezvous, as
bench_coherence.py launches them) train the same FSDP2 model (an MLP of square layers, float32,
SOAP with block_size 64, precondition_frequency 10, async, S = 3, deterministic installs) once
per blocking mode. Reports:

 - bytes sent per step per rank by the global mode's two exchanges (gradient and weight rows
   to the owners, new weight rows back; ``fsdp_global_bytes_sent``), against FSDP2's own
   reduce-scatter of the gradients for the same model, counted as what a reduce-scatter must
   send at the least per rank and step: (R - 1) / R of the full gradient's bytes (a ring sends
   exactly that);
 - the job's step time (per step the slowest rank) per mode, median and p90 after warm-up, and
   the ratio global / local.

The machine has 2 cores for 4 ranks and their workers: absolute times are dominated by that
contention; the ratios are the result. Writes benchmarks/results/bench_fsdp_global.json
(machine, versions, command, every step time).

    python3 benchmarks/bench_fsdp_global.py              # ~2 minutes on 2 cores
    python3 benchmarks/bench_fsdp_global.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "bench_fsdp_global"
MODES = ("local", "global")
NODES, PER_NODE = 2, 2


def worker(args) -> NoReturn:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import asteria

    rank, world = common.init_gloo(300)
    out = {"rank": rank, "env": common.launcher_env(), "runs": []}
    for mode in MODES:
        net = common.mlp_job_net(args)
        for m in net:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(net)
        grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        opt = asteria.SOAP(net.parameters(), lr=1e-3, block_size=args.block_size,
                           precondition_frequency=args.frequency,
                           runtime={"mode": "async", "staleness": 3, "workers": 1,
                                    "fsdp_blocking": mode})
        times, loss = common.mlp_job_steps(net, opt, rank, args, barrier=True)
        st = opt.asteria_stats()
        opt.close()
        out["runs"].append({"mode": mode, "step_s": times, "final_loss": loss,
                            "grad_bytes_full": grad_bytes,
                            "reduce_scatter_bytes_per_step": grad_bytes * (world - 1) / world,
                            "global_bytes_sent": st.get("fsdp_global_bytes_sent", 0),
                            "global_exchanges": st.get("fsdp_global_exchanges", 0),
                            "blocks_owned": st.get("fsdp_global_blocks_owned", 0),
                            "refreshes_submitted": st.get("refreshes_submitted", 0)})
        dist.barrier()
    common.finish_rank(args.out, rank, out)


def launch(args, out: str) -> None:
    common.launch_torchrun(__file__, common.mlp_job_worker_args(args, out), out, NODES, PER_NODE,
                           args.timeout, NAME)


def aggregate(per_rank: list[dict], args) -> dict:
    res = {}
    for i, run in enumerate(per_rank[0]["runs"]):
        runs = [r["runs"][i] for r in per_rank]
        steps = len(run["step_s"])
        job = [max(r["step_s"][t] for r in runs) for t in range(steps)]
        sent = [r["global_bytes_sent"] / steps for r in runs]
        rs = run["reduce_scatter_bytes_per_step"]
        res[run["mode"]] = {
            "step": common.summarize_ms(job[args.warmup:]),
            "step_ms": [1e3 * t for t in job],
            "bytes_sent_per_step_per_rank": sent,
            "reduce_scatter_bytes_per_step_per_rank": rs,
            "bytes_over_reduce_scatter": [s / rs for s in sent],
            "blocks_owned": [r["blocks_owned"] for r in runs],
            "refreshes_submitted": [r["refreshes_submitted"] for r in runs],
            "final_loss": run["final_loss"],
        }
    return res


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_mlp_job_args(ap, steps=30, width=256, tokens=256)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    if args.quick:
        args.steps, args.width, args.tokens, args.block_size = 12, 64, 64, 16
    progress = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    with common.scratch_dir(f"{NAME}-") as tmp:
        progress(f"launching 2 x torchrun --nproc-per-node {PER_NODE}: modes {MODES}, "
                 f"{args.steps} steps each")
        launch(args, tmp)
        per_rank = common.read_ranks(tmp, NODES * PER_NODE)
    data = dict(meta)
    data["settings"] = {k: getattr(args, k) for k in ("steps", "warmup", "width", "layers",
                                                      "tokens", "block_size", "frequency",
                                                      "quick")}
    data["settings"].update(nodes=NODES, ranks_per_node=PER_NODE, backend="gloo",
                            optimizer="SOAP", dtype="float32", staleness=3,
                            workers_per_rank=1)
    data["launch"] = {"env": [r["env"] for r in per_rank]}
    data["results"] = aggregate(per_rank, args)
    g, lo = data["results"]["global"], data["results"]["local"]
    data["summary"] = {
        "global_bytes_over_reduce_scatter_max_rank": max(g["bytes_over_reduce_scatter"]),
        "global_bytes_over_reduce_scatter_mean": (sum(g["bytes_over_reduce_scatter"]) /
                                                  len(g["bytes_over_reduce_scatter"])),
        "median_step_ms": {"local": lo["step"]["median_ms"], "global": g["step"]["median_ms"]},
        "step_time_global_over_local": g["step"]["median_ms"] / lo["step"]["median_ms"],
    }
    path = common.write_json(data, f"{NAME}.json", args.out_dir)
    progress(f"wrote {path}")
    print(json.dumps(data["summary"], indent=1))
    return data


if __name__ == "__main__":
    main()
