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
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "bench_fsdp_global"
MODES = ("local", "global")
NODES, PER_NODE = 2, 2


def worker(args) -> NoReturn:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import asteria
    from asteria.rank_exit import exit_rank

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    d = args.width
    target = torch.randn(d, d, generator=torch.Generator().manual_seed(7)) / d ** 0.5
    out = {"rank": rank, "env": {k: os.environ.get(k) for k in ("GROUP_RANK", "LOCAL_RANK",
                                                                   "LOCAL_WORLD_SIZE")},
           "runs": []}
    for mode in MODES:
        torch.manual_seed(0)
        net = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(d, d),
                                                                      nn.Tanh())])
        for m in net:
            if isinstance(m, nn.Linear):
                fully_shard(m)
        fully_shard(net)
        grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
        opt = asteria.SOAP(net.parameters(), lr=1e-3, block_size=args.block_size,
                           precondition_frequency=args.frequency,
                           runtime={"mode": "async", "staleness": 3, "workers": 1,
                                    "fsdp_blocking": mode})
        times = []
        for t in range(1, args.steps + 1):
            gen = torch.Generator().manual_seed(1000 * t + rank)
            x = torch.randn(args.tokens, d, generator=gen)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = ((net(x) - torch.sin(x @ target)) ** 2).mean()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        st = opt.asteria_stats()
        opt.close()
        out["runs"].append({"mode": mode, "step_s": times, "final_loss": float(loss.detach()),
                            "grad_bytes_full": grad_bytes,
                            "reduce_scatter_bytes_per_step": grad_bytes * (world - 1) / world,
                            "global_bytes_sent": st.get("fsdp_global_bytes_sent", 0),
                            "global_exchanges": st.get("fsdp_global_exchanges", 0),
                            "blocks_owned": st.get("fsdp_global_blocks_owned", 0),
                            "refreshes_submitted": st.get("refreshes_submitted", 0)})
        dist.barrier()
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(out, fh)
    exit_rank(0)


def launch(args, out: str) -> None:
    wargs = ["--worker", "--out", out, "--steps", str(args.steps), "--width", str(args.width),
             "--layers", str(args.layers), "--tokens", str(args.tokens),
             "--block-size", str(args.block_size), "--frequency", str(args.frequency)]
    common.launch_torchrun(__file__, wargs, out, NODES, PER_NODE, args.timeout, NAME)


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
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="few steps, a narrow model")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256, help="rows of the batch per rank")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--frequency", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    if args.quick:
        args.steps, args.width, args.tokens, args.block_size = 12, 64, 64, 16
    progress = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    tmp = tempfile.mkdtemp(prefix=f"{NAME}-")
    try:
        progress(f"launching 2 x torchrun --nproc-per-node {PER_NODE}: modes {MODES}, "
                 f"{args.steps} steps each")
        launch(args, tmp)
        per_rank = []
        for r in range(NODES * PER_NODE):
            with open(os.path.join(tmp, f"rank{r}.json")) as fh:
                per_rank.append(json.load(fh))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
