"""Per-rank body of tests/python/test_fsdp_global.py: FSDP2 with ``fsdp_blocking="global"``
against one process training the unsharded model with the same blocks.

    torchrun --nproc-per-node N [--nnodes 2 --node-rank i ...] fsdp_global.py --out DIR \
        --checks sync,async

The model (float64) has two square 12 x 12 weights blocked 4 x 4 (blocks straddle the shards
on 2 and 4 ranks: 6 or 3 rows per rank) and a 9 x 9 weight blocked whole (9 rows: 5 + 4 on 2
ranks, 3 + 3 + 3 + 0 on 4, an uneven and an empty shard), biases on AdamW. Every block is
square and a rank's batch has more rows than any block is wide, so every factor is full rank
with distinct eigenvalues (tests/python/dist/common.py says why that matters). Rank 0 runs the
single-process reference (declared rank-local, no collectives) on the global batch and
compares with the full parameters; every rank writes OUT/rank<r>.json.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import asteria  # noqa: E402
from asteria import distributed as AD  # noqa: E402

OPTS = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo, "kl_shampoo": asteria.KLShampoo}
LR = {"soap": 1e-2, "shampoo": 1e-2, "kl_shampoo": 1e-3}
BATCH = 32      # rows of the global batch (16 per rank on 2 ranks, 8 on 4)
STEPS = 20
FREQ = 4
DTYPE = torch.float64


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 12)
        self.b = nn.Linear(12, 12)
        self.c = nn.Linear(9, 9)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return torch.cat([self.c(h[:, :9]), h[:, 9:]], dim=1)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DTYPE)


def batch(step: int):
    gen = torch.Generator().manual_seed(500 + step)
    x = torch.randn(BATCH, 12, generator=gen, dtype=DTYPE)
    a = torch.randn(12, 12, generator=torch.Generator().manual_seed(3), dtype=DTYPE)
    return x, torch.sin(x @ a)


def local_batch(step: int):
    return C.rank_rows(*batch(step))


def groups(model: Net) -> list:
    """The 12 x 12 weights in 4 x 4 blocks, the 9 x 9 one whole, the biases (AdamW)."""
    return [{"params": [model.a.weight, model.b.weight], "block_size": 4},
            {"params": [model.c.weight], "block_size": None},
            {"params": [model.a.bias, model.b.bias, model.c.bias], "block_size": None}]


def make_opt(name: str, model: Net, runtime: dict):
    return OPTS[name](groups(model), lr=LR[name], precondition_frequency=FREQ, runtime=runtime)


def fsdp_net(seed: int = 0) -> Net:
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed)
    for m in (model.a, model.b, model.c):
        fully_shard(m)
    fully_shard(model)
    return model


def reference(name: str, runtime: dict, steps: int) -> list:
    """The unsharded run of one process on the global batch (rank-local: no collectives)."""
    return C.single_process(make_net(), lambda m: make_opt(name, m, runtime), batch, steps)


def run_global(name: str, runtime: dict) -> dict:
    model = fsdp_net()
    start = C.full_params(model)
    opt = make_opt(name, model, dict(runtime, fsdp_blocking="global"))
    t0 = time.perf_counter()
    C.train(model, opt, local_batch, 1, STEPS)
    elapsed = time.perf_counter() - t0
    stats = opt.asteria_stats()
    opt.close()
    full = C.full_params(model)
    res = {"owned": stats["fsdp_global_blocks_owned"], "blocks": stats["fsdp_global_blocks"],
           "digest": C.digest(full),
           "bytes_sent": stats["fsdp_global_bytes_sent"], "seconds": elapsed}
    if dist.get_rank() == 0:
        res.update(C.compare(full, reference(name, runtime, STEPS), start))
    return res


def check_sync() -> dict:
    out = {name: run_global(name, {"mode": "sync"}) for name in OPTS}
    if dist.get_world_size() != 2:
        return out
    # the control: per-shard blocks (the default) are another optimizer on more than one rank
    # (on 2 ranks only: on 4 the 9-row weight leaves rank 3 an empty shard, which the local
    # mode does not take today: a (0, 9) block reaches soap_init)
    model = fsdp_net()
    opt = make_opt("soap", model, {"mode": "sync"})
    C.train(model, opt, local_batch, 1, STEPS)
    opt.close()
    full = C.full_params(model)
    if dist.get_rank() == 0:
        start = [p.detach().clone() for p in make_net().parameters()]
        out["soap_local_control"] = C.compare(full, reference("soap", {"mode": "sync"}, STEPS),
                                              start)
    return out


def check_async() -> dict:
    rt = {"mode": "async", "staleness": 3, "install": "deterministic", "workers": 1}
    return {name: run_global(name, rt) for name in OPTS}


def check_tiered() -> dict:
    """Async S = 3 with the eigenbases and roots placed in host memory (a Residency)."""
    rt = {"mode": "async", "staleness": 3, "install": "deterministic", "workers": 1,
          "placement": {"eigenbases": "host", "roots": "host"}}
    return {name: run_global(name, rt) for name in OPTS}


def check_hsdp_raises() -> dict:
    """HSDP (a 2-D mesh, replicate x shard) is not taken by the global mode: ValueError at
    construction, naming the key to use."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2),
                            mesh_dim_names=("replicate", "shard"))
    model = make_net()
    fully_shard(model, mesh=mesh)
    try:
        make_opt("soap", model, {"mode": "sync", "fsdp_blocking": "global"})
    except ValueError as exc:
        return {"raised": "fsdp_blocking='local'" in str(exc)}
    return {"raised": False}


# ---- checkpoints: save on one world size, resume on another -------------------------------------
SPLIT = 10  # a refresh is in flight after step 10 (SOAP, KL: snapshot 9, install 12; Shampoo: 8, 11)
ASYNC = {"mode": "async", "staleness": 3, "install": "deterministic", "workers": 1,
         "fsdp_blocking": "global"}


def _async_net(name: str, seed: int = 0) -> tuple:
    model = fsdp_net(seed)
    return model, make_opt(name, model, ASYNC)


def check_save() -> dict:
    """Steps 1..SPLIT, then a DCP checkpoint (model and flattened optimizer state) in
    $FSDP_GLOBAL_CKPT/<name>."""
    return C.save_each(OPTS, _async_net, local_batch, SPLIT)


def check_resume() -> dict:
    """Load $FSDP_GLOBAL_CKPT/<name> (saved on any world size) into a fresh model and
    optimizer, train steps SPLIT+1..STEPS; rank 0 compares with the uninterrupted
    single-process run."""
    fulls = C.resume_each(OPTS, lambda n: _async_net(n, seed=123), local_batch, SPLIT, STEPS)
    out = {name: {"digest": C.digest(full)} for name, full in fulls.items()}
    if dist.get_rank() == 0:
        start = [p.detach().clone() for p in make_net().parameters()]
        rt = {k: v for k, v in ASYNC.items() if k != "fsdp_blocking"}
        for name, full in fulls.items():
            out[name].update(C.compare(full, reference(name, rt, STEPS), start))
    return out


def check_load_single() -> dict:
    """A single process' plain ``state_dict()`` after step SPLIT (every rank computes it, as
    rank-local runs) loaded into the FSDP2 model and optimizer: each rank keeps its rows and
    the blocks it owns; steps SPLIT+1..STEPS continue the single-process trajectory."""
    from torch.distributed.tensor import distribute_tensor

    rt = {k: v for k, v in ASYNC.items() if k != "fsdp_blocking"}
    out = {}
    for name in OPTS:
        ref = make_net()
        AD.set_replicas(ref.parameters(), None)
        ropt = make_opt(name, ref, rt)
        C.train(ref, ropt, batch, 1, SPLIT)
        sd = ropt.state_dict()
        ropt.close()
        model = fsdp_net(seed=123)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.to_local().copy_(distribute_tensor(q.detach(), p.device_mesh,
                                                     p.placements).to_local())
        opt = make_opt(name, model, ASYNC)
        opt.load_state_dict(sd)
        C.train(model, opt, local_batch, SPLIT + 1, STEPS)
        opt.close()
        full = C.full_params(model)
        res = {}
        if dist.get_rank() == 0:
            start = [p.detach().clone() for p in make_net().parameters()]
            res = C.compare(full, reference(name, rt, STEPS), start)
        out[name] = res
    return out


def main() -> None:
    C.run_checks(C.checks_in(globals()), timeout=120.0)


if __name__ == "__main__":
    main()
