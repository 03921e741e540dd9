"""The job's store, hosted outside the ranks as torchrun's agent hosts it, so that it outlives
any rank. The rank-death tests (test_distributed.py, test_cluster.py) start the ranks without
torchrun (die.py says why) and this next to them, with TORCHELASTIC_USE_AGENT_STORE=True in the
ranks' environment (every rank a client of this store, as under torchrun).

    python store.py HOST PORT     # prints "STORE READY" once listening, serves until killed
"""

from __future__ import annotations

import datetime
import sys
import time

import torch.distributed as dist


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,  # noqa: F841
                          timeout=datetime.timedelta(seconds=300))
    print("STORE READY", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
