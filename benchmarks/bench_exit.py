"""How often does a plain FSDP2 training script end with a non-zero exit code, per optimizer?

A user's script ends the way most do: train, then (optionally) ``destroy_process_group()``, then
fall off the end of the file; it never calls ``optimizer.close()`` and has no epilogue of ours.
gloo's threads can abort such a process in the interpreter's finalization ("terminate called
without an active exception", SIGABRT; pytorch/pytorch#190489, and the reason given in the
abandoned pytorch/pytorch#179291: AsyncWork objects that still hold tensors when the
interpreter is torn down). This benchmark launches the same 2-rank FSDP2 job (torchrun, gloo)
many times per optimizer and ending, with AdamW as the control, and counts the exit codes and
the abort's message per case. Run it with the machine otherwise loaded (both cores busy) to see
the race at all: it is rare on an idle machine.

Writes benchmarks/results/bench_exit.json (machine, versions, command, every launch's codes).

    python3 benchmarks/bench_exit.py --runs 40                  # ~20 minutes on 2 cores
    python3 benchmarks/bench_exit.py --runs 2 --out-dir /tmp/x  # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "bench_exit"
OPTIMIZERS = ("adamw", "soap-async")
ENDINGS = ("destroy", "none")   # destroy_process_group() at the end, or nothing at all
ABORT = "terminate called without an active exception"


def worker(opt_name: str, ending: str, steps: int) -> None:
    """The user's script: FSDP2 on 2 ranks, ``steps`` optimizer steps, then the chosen ending
    and nothing else (no close(), no os._exit)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    import asteria

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    if opt_name == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        opt = asteria.SOAP(model.parameters(), lr=1e-3, precondition_frequency=2,
                           runtime={"mode": "async", "staleness": 1})
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        loss = (model(x) - x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if ending == "destroy":
        dist.destroy_process_group()


def launch(opt_name: str, ending: str, steps: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--tee=3", os.path.abspath(__file__), "--worker", opt_name, ending, str(steps)]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        code, text = "timeout", str(exc.stdout or "") + str(exc.stderr or "")
    return {"code": code, "abort": ABORT in text, "seconds": round(time.monotonic() - t0, 2),
            "tail": text[-600:] if code != 0 else ""}


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", nargs=3, metavar=("OPT", "ENDING", "STEPS"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--runs", type=int, default=40, help="launches per case")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--endings", default=",".join(ENDINGS))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.worker[1], int(args.worker[2]))
        return {}
    cases = [(o, e) for o in args.optimizers.split(",") for e in args.endings.split(",")]
    result: dict[str, Any] = {"name": NAME, "machine": common.machine(),
                              "command": " ".join(["benchmarks/bench_exit.py",
                                                   *(sys.argv[1:] if argv is None else argv)]),
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              "load_at_start": os.getloadavg(), "runs": {}}
    # interleaved, so a slow spell of the machine falls on every case alike
    for i in range(args.runs):
        for o, e in cases:
            r = launch(o, e, args.steps, args.timeout)
            result["runs"].setdefault(f"{o}/{e}", []).append(r)
            print(f"[{NAME}] run {i + 1}/{args.runs} {o}/{e}: exit {r['code']}"
                  f"{' (gloo abort)' if r['abort'] else ''} in {r['seconds']} s", flush=True)
    result["load_at_end"] = os.getloadavg()
    result["summary"] = {k: {"runs": len(v), "nonzero": sum(r["code"] != 0 for r in v),
                             "aborts": sum(r["abort"] for r in v)}
                         for k, v in result["runs"].items()}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"{NAME}.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result["summary"], indent=1))
    return result


if __name__ == "__main__":
    main()
