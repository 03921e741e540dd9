"""Per-rank body of tests/python/test_refresh_policy.py's two-rank test: refresh_policy="drift"
with replicas (DDP: every rank holds every factor, and all must start the same factors at the
same steps) and with owners (FSDP2, fsdp_blocking="global": each block's factors live on its
owner, which alone decides for them).

    torchrun --nproc-per-node 2 refresh_policy.py --out DIR [--checks ddp,fsdp_global,...]

Checks: ``ddp`` (each optimizer, a budget of a third of a round, d = 2: the replicas' state
and their decisions bitwise equal), ``ddp_auto_raises`` (an "auto" budget or d with replicated
parameters: ValueError at construction), ``hsdp`` (a replicate x shard mesh of 2 x 1: replicas
again, through FSDP2), ``fsdp_global`` (each optimizer: the ranks decide for disjoint sets of
global blocks, their own; two runs under different job delays give the same full parameters
bit for bit), ``fsdp_local`` (per-shard blocks: reproducible under other job delays). Each rank writes OUT/rank<r>.json and ends through
``asteria.rank_exit.exit_rank`` (common.run_checks).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from job_delay import delay_jobs  # noqa: E402

import asteria  # noqa: E402

OPTS = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo, "kl_shampoo": asteria.KLShampoo}
LR = {"soap": 1e-2, "shampoo": 1e-2, "kl_shampoo": 1e-3}
STEPS = 12
DRIFT = {"mode": "async", "workers": 1, "refresh_policy": "drift", "refresh_budget": 0.34,
         "install_delay": 2, "skip_threshold": 0.01}


def make_opt(name, params, runtime):
    return OPTS[name](params, lr=LR[name], precondition_frequency=1, block_size=8,
                      runtime=runtime)


def record(opt) -> list:
    """[(t, param index, global block, dim, install step)] of every factor's start, as the
    cadence answers the schedule (recorded around ``Cadence.due``); a globally blocked
    parameter's block is named by its global index."""
    log = []
    due = opt.cadence.due

    def recording(end):
        out = due(end)
        for (_, p, j, dims), at in out:
            tag = opt.run.tags.get(p)
            g = tag.ids[j] if opt.run.blocking.has(p) else j
            log.extend((end.t, opt.run.pindex[p], g, dim, at) for dim in dims)
        return out
    opt.cadence.due = recording
    return log


def moved(model, start) -> float:
    return max(float((a.detach() - b).abs().max())
               for a, b in zip(model.parameters(), start.parameters()))


def rank_batch(t):
    return C.local_batch(t, dist.get_rank(), dist.get_world_size())


def replicas_run(name, module, model) -> tuple[dict, str]:
    """``name`` with the drift policy trained through ``module`` (model itself or its wrapper)
    on every rank: (whether the ranks' state and decisions are bitwise equal, with the stats'
    refresh counts; the engine's type name)."""
    opt = make_opt(name, module.parameters(), DRIFT)
    log = record(opt)
    C.train(module, opt, rank_batch, 1, STEPS)
    vec = C.flat_state(model, opt)
    st = opt.asteria_stats()
    engine = type(opt.run.engine).__name__
    opt.close()  # finishes the units in flight on every rank
    decisions = torch.tensor(log, dtype=torch.float64).reshape(-1)
    return {"replicas_equal": C.all_true(C.gather_equal(vec)),
            "decisions_equal": C.all_true(C.gather_equal(decisions)),
            "started": st["refresh_started"], "waiting": st["refresh_waiting"]}, engine


def check_ddp() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for name in OPTS:
        model = C.make_model()
        out[name], _ = replicas_run(name, DDP(model), model)
        out[name]["moved"] = moved(model, C.make_model())
        dist.barrier()
    return out


def check_ddp_auto_raises() -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(C.make_model())
    try:
        make_opt("soap", ddp.parameters(), {"mode": "async", "workers": 1,
                                            "refresh_policy": "drift"}).close()
    except ValueError as exc:
        return {"raised": "refresh_budget" in str(exc) and "replicated" in str(exc)}
    return {"raised": False}


def fsdp_model():
    from torch.distributed.fsdp import fully_shard

    model = C.make_model()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model.inp)
    fully_shard(model.head)
    fully_shard(model)
    return model


def fsdp_run(name, runtime, delay, logs=None) -> tuple[list, dict]:
    """``name`` on fsdp_model() with ``runtime``, its jobs delayed by ``delay`` (0: not): (the
    full parameters after STEPS steps, the stats); its decisions (record) appended to ``logs``
    when given."""
    model = fsdp_model()
    opt = make_opt(name, model.parameters(), runtime)
    if delay:
        delay_jobs(opt, delay)
    if logs is not None:
        logs.append(record(opt))
    C.train(model, opt, rank_batch, 1, STEPS)
    st = opt.asteria_stats()
    opt.close()
    return C.full_params(model), st


def check_fsdp_global() -> dict:
    out = {}
    for name in OPTS:
        digests, logs = [], []
        for delay in (0, 7):
            full, st = fsdp_run(name, dict(DRIFT, fsdp_blocking="global"), delay, logs)
            digests.append(C.digest(full))
        mine = sorted({(p, g, d) for _, p, g, d, _ in logs[0]})
        theirs = [None] * dist.get_world_size()
        dist.all_gather_object(theirs, mine)
        others = {k for r, s in enumerate(theirs) if r != dist.get_rank() for k in map(tuple, s)}
        start = C.make_model()
        out[name] = {"decided_own_only": not (set(mine) & others) and logs[0] == logs[1],
                     "started": st["refresh_started"],
                     "reproducible": C.all_true(digests[0] == digests[1]),
                     "moved": max(float((a - b).abs().max())
                                  for a, b in zip(full, start.parameters()))}
        dist.barrier()
    return out


def check_fsdp_local() -> dict:
    """FSDP2 with the default per-shard blocks: each rank decides for its own shard's factors
    (nothing to agree on); two runs under different job delays give the same full parameters
    bit for bit."""
    out = {}
    for name in OPTS:
        digests = []
        for delay in (0, 7):
            full, st = fsdp_run(name, DRIFT, delay)
            digests.append(C.digest(full))
        out[name] = {"reproducible": C.all_true(digests[0] == digests[1]),
                     "started": st["refresh_started"], "waiting": st["refresh_waiting"]}
        dist.barrier()
    return out


def check_hsdp() -> dict:
    """HSDP over a (replicate 2) x (shard 1) mesh: the two ranks are replicas of every shard
    (the replicated engine): their state and decisions bitwise equal."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1),
                            mesh_dim_names=("replicate", "shard"))
    out = {}
    for name in ("soap", "shampoo"):
        model = C.make_model()
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        out[name], engine = replicas_run(name, model, model)
        out[name]["engine"] = engine
        dist.barrier()
    return out


def main() -> None:
    C.run_checks(C.checks_in(globals()), timeout=120.0)


if __name__ == "__main__":
    main()
