"""Per-rank body of tests/python/test_distributed.py: one launch (gloo, 4 ranks as 2 nodes x 2,
the node from torchrun's GROUP_RANK) runs several checks in a row and writes what each rank
measured to OUT/rank<r>.json; the pytest driver asserts on the files.

    torchrun --nproc-per-node 2 --nnodes 2 --node-rank {0,1} --rdzv-backend c10d \
        --rdzv-endpoint localhost:PORT checks.py --out DIR --checks fsdp_sync,ddp,...

Checks (each a function below): fsdp_sync, fsdp_async_repro, ddp, hsdp, hier_vs_flat, window,
slow_rank. Comparisons that need the other ranks' tensors are done here, collectively; the driver
sees their outcome.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from job_delay import delay_jobs  # noqa: E402

import asteria  # noqa: E402
from asteria import distributed as AD  # noqa: E402
from asteria.refresh import replicated  # noqa: E402

OPTS = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo, "kl_shampoo": asteria.KLShampoo}
LR = {"soap": 1e-2, "shampoo": 1e-2, "kl_shampoo": 1e-3}


def rank() -> int:
    return dist.get_rank()


def world() -> int:
    return dist.get_world_size()


def fsdp_model(seed=0, mesh=None):
    from torch.distributed.fsdp import fully_shard

    model = C.make_model(seed)
    for blk in model.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(model.inp, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def make_opt(name, params, runtime, **kw):
    kw.setdefault("lr", LR[name])
    return OPTS[name](params, runtime=runtime, **kw)


# ---- FSDP2 -------------------------------------------------------------------------------------

def check_fsdp_sync():
    """FSDP2 over the 4 ranks (every weight sharded along dim 0 into 4 x 16 shards), block_size 4,
    mode sync, against one process training the unsharded model on the same global batch with
    block_size 4 (the same 4 x 4 blocks). Rank 0 runs the reference."""
    steps, out = 6, {}
    for name in OPTS:
        model = fsdp_model()
        opt = make_opt(name, model.parameters(), {"mode": "sync"}, block_size=4,
                       precondition_frequency=2)
        assert not isinstance(opt.run.engine, replicated.ReplicatedEngine)  # nothing is replicated
        losses = []
        for t in range(1, steps + 1):
            x, y = C.local_batch(t, rank(), world())
            losses.append(C.train_step(model, opt, x, y))
        full = [p.full_tensor().detach().clone() for p in model.parameters()]
        opt.close()
        loss_t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(loss_t)
        loss_t /= world()
        res = {"steps": steps}
        if rank() == 0:
            ref = C.make_model()
            AD.set_replicas(ref.parameters(), None)  # rank 0's own reference: no collectives
            start = [p.detach().clone() for p in ref.parameters()]
            ropt = make_opt(name, ref.parameters(), {"mode": "sync"}, block_size=4,
                            precondition_frequency=2)
            ref_losses = []
            for t in range(1, steps + 1):
                x, y = C.global_batch(t, world())
                ref_losses.append(C.train_step(ref, ropt, x, y))
            ropt.close()
            diffs = [float((a - b).abs().max()) for a, b in zip(full, ref.parameters())]
            moved = [float((b.detach() - s).abs().max()) for b, s in zip(ref.parameters(), start)]
            res.update(max_abs_diff=max(diffs), max_moved=max(moved),
                       loss_diff=max(abs(a - b) for a, b in zip(loss_t.tolist(), ref_losses)),
                       losses=loss_t.tolist(), ref_losses=ref_losses)
        out[name] = res
        dist.barrier()
    return out


def check_fsdp_async_repro():
    """FSDP2, SOAP and Shampoo in async deterministic mode (S = 1): two runs, the second with
    another worker count, give bit-identical shards and state."""
    out = {}
    for name in ("soap", "shampoo"):
        vecs = []
        for workers in (1, 2):
            model = fsdp_model()
            opt = make_opt(name, model.parameters(),
                           {"mode": "async", "staleness": 1, "workers": workers},
                           block_size=4, precondition_frequency=2)
            for t in range(1, 9):
                x, y = C.local_batch(t, rank(), world())
                C.train_step(model, opt, x, y)
            vecs.append(C.flat_state(model, opt))
            opt.close()
        same = len(vecs[0]) == len(vecs[1]) and torch.equal(vecs[0].view(torch.int64),
                                                            vecs[1].view(torch.int64))
        out[name] = {"reproducible": C.all_true(same), "numel": int(vecs[0].numel())}
    return out


# ---- DDP / HSDP --------------------------------------------------------------------------------

def ddp_run(name, steps, runtime, f, sleep=0.0, step_times=None, hierarchical=None,
            job_delay_ms=0):
    """DDP over the 4 ranks; returns (model, opt) after ``steps`` steps (opt not closed).
    ``job_delay_ms``: every REFRESH job of this rank sleeps that long first (job_delay.py)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = C.make_model()
    ddp = DDP(model)
    if hierarchical is not None:
        runtime = dict(runtime, coherence_topology="hier" if hierarchical else "flat")
    opt = make_opt(name, ddp.parameters(), runtime, block_size=8, precondition_frequency=f)
    if job_delay_ms:
        delay_jobs(opt, job_delay_ms)
    for t in range(1, steps + 1):
        x, y = C.local_batch(t, rank(), world())
        t0 = time.perf_counter()
        C.train_step(ddp, opt, x, y)
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
        if sleep:
            time.sleep(sleep)  # stands for the model's compute: the window the sync hides in
    return model, opt


def summary(opt) -> dict:
    st = opt.asteria_stats()
    keys = [k for k in st if k.startswith(("bytes_intra", "bytes_inter", "bytes_flat",
                                           "coherence_"))]
    keys += ["jobs_submitted", "barrier_waits", "barrier_wait_ns", "refreshes_submitted",
             "installs", "max_install_lag"]
    return C.jsonable({k: st[k] for k in keys if k in st})


def check_ddp():
    """DDP, each optimizer, async S = 2, 30 steps: replicas bitwise equal (parameters and every
    state tensor), each block computed by exactly one rank."""
    out = {}
    for name in OPTS:
        model, opt = ddp_run(name, 30, {"mode": "async", "staleness": 2, "workers": 1}, f=3)
        start = C.make_model()
        moved = max(float((a.detach() - b).abs().max())
                    for a, b in zip(model.parameters(), start.parameters()))
        vec = C.flat_state(model, opt)
        opt.close()  # finishes the units in flight on every rank
        res = summary(opt)
        res.update(replicas_equal=C.all_true(C.gather_equal(vec)), moved=moved,
                   engine="ReplicatedEngine")
        out[name] = res
        dist.barrier()
    return out


def check_hsdp():
    """HSDP: fully_shard over a (replicate 2) x (shard 2) mesh, so ranks {0, 2} and {1, 3} hold
    the same shards (one per node: no shared-memory step); async S = 2, 30 steps."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    partner = [int(r) for r in mesh.mesh[:, mesh.get_coordinate()[1]].tolist()]
    out = {}
    for name in ("soap", "shampoo"):
        model = fsdp_model(mesh=mesh)
        opt = make_opt(name, model.parameters(), {"mode": "async", "staleness": 2, "workers": 1},
                       block_size=8, precondition_frequency=3)
        reps = sorted({AD.replicas(p) for p in model.parameters()})
        for t in range(1, 31):
            x, y = C.local_batch(t, rank(), world())
            C.train_step(model, opt, x, y)
        vec = C.flat_state(model, opt)
        opt.close()  # finishes the units in flight on every rank
        res = summary(opt)
        others = [r for r in range(world()) if r not in partner]
        res.update(replicas=[list(r) for r in reps],
                   replicas_equal=C.all_true(C.gather_equal(vec, partner)),
                   shards_differ=not C.all_true(C.gather_equal(vec, others)))
        out[name] = res
        dist.barrier()
    return out


def check_hier_vs_flat():
    """The same DDP SOAP run with the hierarchy and flat: the same trajectory bit for bit, and
    the bytes each actually sent across nodes."""
    out = {}
    vecs = {}
    for hier in (True, False):
        model, opt = ddp_run("soap", 12, {"mode": "async", "staleness": 2, "workers": 1}, f=3,
                             hierarchical=hier)
        vecs[hier] = C.flat_state(model, opt)
        opt.close()
        out["hier" if hier else "flat"] = summary(opt)
    out["same_trajectory"] = C.all_true(torch.equal(vecs[True].view(torch.int64),
                                                    vecs[False].view(torch.int64)))
    return out


def check_window():
    """S = 5 and S = 0 with a step that computes for 30 ms: each one's units, late units,
    barrier waits and smallest window slack (test_distributed.py says what holds)."""
    out = {}
    for s in (5, 0):
        model, opt = ddp_run("soap", 16, {"mode": "async", "staleness": s, "workers": 1}, f=5,
                             sleep=0.03)
        opt.close()
        out[f"S{s}"] = summary(opt)
        dist.barrier()
    return out


def check_slow_rank():
    """Rank 2's workers sleep 150 ms in every job. Everyone else is held only at the bounded
    barrier of install steps, nothing hangs, and replicas stay equal."""
    delay_ms, S, f, steps = 150, 2, 2, 10
    times: list = []
    model, opt = ddp_run("soap", steps, {"mode": "async", "staleness": S, "workers": 1}, f=f,
                         step_times=times, job_delay_ms=delay_ms if rank() == 2 else 0)
    vec = C.flat_state(model, opt)
    opt.close()
    res = summary(opt)
    res.update(step_times=times, delay_ms=delay_ms, staleness=S, frequency=f,
               replicas_equal=C.all_true(C.gather_equal(vec)))
    return res


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items()
          if name.startswith("check_")}


def main() -> None:
    C.run_checks(CHECKS, timeout=60.0)


if __name__ == "__main__":
    main()
