"""Per-rank body of tests/python/test_cluster.py: 2 emulated nodes x 2 ranks (netns.py), gloo
over the shaped links, launched by torchrun per node. Writes what each rank measured to
OUT/rank<r>.json (dist/common.py's run_checks); the pytest driver asserts on the files.

Checks: hsdp (SOAP async over a (replicate 2) x (shard 2) mesh: the shard dimension inside a
node, replicas {0, 2} and {1, 3} across nodes, the usual HSDP layout), ddp_hier_flat (the same
DDP SOAP run with coherence_topology "hier" then "flat"). Each reports the coherence counters,
whether the replicas are bitwise equal, and its node's link counters (eth0: inter-node, lo:
intra-node) over its training steps only: read from /sys/class/net after a barrier that follows
the optimizer's construction (collective: process groups) and after close() (which finishes the
units in flight), so what differs between two runs is their traffic alone.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "dist"))
import checks  # noqa: E402
import common as C  # noqa: E402
from netns import read_counters  # noqa: E402

STEPS = 8
RUNTIME = {"mode": "async", "staleness": 1, "workers": 1}
FREQ = 1    # a refresh every step: the coherence traffic dominates the gradients'


def _train(model, opt, steps: int) -> dict:
    """Train ``steps`` steps, close the optimizer; the node's link counters over that span."""
    dist.barrier()
    before = read_counters()
    for t in range(1, steps + 1):
        x, y = C.local_batch(t, dist.get_rank(), dist.get_world_size())
        C.train_step(model, opt, x, y)
    opt.close()
    dist.barrier()
    after = read_counters()
    return {k: after[k] - before[k] for k in after}


def check_hsdp():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    partner = [int(r) for r in mesh.mesh[:, mesh.get_coordinate()[1]].tolist()]
    model = checks.fsdp_model(mesh=mesh)
    opt = checks.make_opt("soap", model.parameters(), RUNTIME, block_size=8,
                          precondition_frequency=FREQ)
    link = _train(model, opt, STEPS)
    vec = C.flat_state(model, opt)
    res = checks.summary(opt)
    res.update(link=link, partner=partner,
               replicas_equal=C.all_true(C.gather_equal(vec, partner)))
    return res


def check_ddp_hier_flat():
    from torch.nn.parallel import DistributedDataParallel as DDP

    out, vecs = {}, {}
    for topology in ("hier", "flat"):
        model = C.make_model()
        ddp = DDP(model)
        opt = checks.make_opt("soap", ddp.parameters(), dict(RUNTIME, coherence_topology=topology),
                              block_size=8, precondition_frequency=FREQ)
        link = _train(ddp, opt, STEPS)
        vecs[topology] = C.flat_state(model, opt)
        res = checks.summary(opt)
        res.update(link=link, replicas_equal=C.all_true(C.gather_equal(vecs[topology])))
        out[topology] = res
    out["same_trajectory"] = C.all_true(torch.equal(vecs["hier"].view(torch.int64),
                                                    vecs["flat"].view(torch.int64)))
    return out


CHECKS = {"hsdp": check_hsdp, "ddp_hier_flat": check_ddp_hier_flat}


if __name__ == "__main__":
    C.run_checks(CHECKS, timeout=60.0)
