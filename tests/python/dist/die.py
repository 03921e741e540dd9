"""Per-rank body of the rank-death test of tests/python/test_distributed.py.

Every rank trains the same replicated model on the same data with no DDP wrapper, so the
coherence protocol's collectives are the only ones linking the ranks. Rank DIE_RANK exits
abruptly after step DIE_STEP (os._exit, or SIGKILL with DIE_SIGKILL set). Each survivor must
fail on its own, with a CoherenceError naming the unit, within the collective timeout
(DIE_TIMEOUT_S: the default group's and the runtime key coherence_timeout_s): it prints one line
"SURVIVOR <rank> FAILED <seconds> <message>" and exits 1. A survivor that finishes its steps
prints "SURVIVOR <rank> FINISHED".

Launched without torchrun (the driver sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
GROUP_RANK, MASTER_ADDR and MASTER_PORT itself): torchrun's agent would kill the survivors as
soon as one worker exits, and hide whether they would have failed by themselves.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import asteria  # noqa: E402
from asteria.rank_exit import exit_rank  # noqa: E402


def main() -> int:
    die_rank, die_step = int(os.environ["DIE_RANK"]), int(os.environ["DIE_STEP"])
    timeout = float(os.environ.get("DIE_TIMEOUT_S", "20"))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    model = C.make_model(layers=1)
    opt = asteria.SOAP(model.parameters(), lr=1e-2, block_size=8, precondition_frequency=1,
                       runtime={"mode": "async", "staleness": 1, "workers": 1,
                                "coherence_timeout_s": timeout})
    died_at = None
    try:
        for t in range(1, 200):
            x, y = C.global_batch(t, 1)
            C.train_step(model, opt, x, y)
            if t == die_step:
                if rank == die_rank:
                    print(f"RANK {rank} DIES after step {t}", flush=True)
                    if os.environ.get("DIE_SIGKILL"):
                        os.kill(os.getpid(), signal.SIGKILL)
                    os._exit(17)
                died_at = time.monotonic()
            time.sleep(0.01)
    except Exception as exc:  # the failure under test
        waited = time.monotonic() - (died_at or time.monotonic())
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"SURVIVOR {rank} FAILED {waited:.2f} {msg}", flush=True)
        exit_rank(1, teardown=False)  # the group has a dead peer: no collective teardown
    print(f"SURVIVOR {rank} FINISHED", flush=True)
    exit_rank(0)


if __name__ == "__main__":
    sys.exit(main())
