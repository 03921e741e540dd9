"""Per-rank body of tests/python/test_experts_fsdp.py: a param group's ``num_experts`` under
FSDP2, against one process training the unsharded model with the same groups.

    torchrun --nproc-per-node N [--nnodes 2 --node-rank i ...] experts.py --out DIR \
        --checks sync,async,local

The model (float64, D = 8, E = 2 experts) has an ordinary D x D weight blocked 4 x 4 and two
expert weights in the group with ``num_experts=2``, each expert blocked whole (D x D): ``w1`` in
OLMo-core's layout (E * D, D) and ``w2`` in torchtitan's (E, D, D). FSDP2 shards dim 0: on 2
ranks each rank holds one expert of each; on 4 ranks each holds half an expert of ``w1`` (4 of
its 8 rows), and one expert of ``w2`` (ranks 0, 1) or an empty shard (ranks 2, 3). Every token
reaches both experts (a dense softmax gate read off the ordinary layer's output), so every
expert's factors are full rank with distinct eigenvalues (common.py says why that matters) and
no routing decision can flip between two runs. Rank 0 runs the single-process reference
(declared rank-local, no collectives) on the global batch and compares with the full
parameters; every rank writes OUT/rank<r>.json.
"""

from __future__ import annotations

import functools
import math
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402

import asteria  # noqa: E402

OPTS = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo}
LR = {"soap": 1e-2, "shampoo": 1e-2}
FACTOR = {"soap": "GG", "shampoo": "L"}  # the state key of a block's factor of dim k: GG0, L1
D = 8
E = 2
BATCH = 32      # rows of the global batch (16 per rank on 2 ranks, 8 on 4): > any block's width
STEPS = 12
FREQ = 4
DTYPE = torch.float64
SYNC = {"mode": "sync"}
ASYNC = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1}


class Experts(nn.Module):
    """E experts: x -> tanh(x W1_e) W2_e, W1 stored as (E * D, D), W2 as (E, D, D)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E * D, D) / math.sqrt(D))
        self.w2 = nn.Parameter(torch.randn(E, D, D) / math.sqrt(D))

    def forward(self, h, gate):
        a = torch.tanh(torch.einsum("nd,edk->nek", h, self.w1.view(E, D, D)))
        return (gate.unsqueeze(-1) * torch.einsum("nek,ekj->nej", a, self.w2)).sum(1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.experts = Experts()

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.experts(h, torch.softmax(h[:, :E], dim=-1))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DTYPE)


def batch(step: int):
    gen = torch.Generator().manual_seed(700 + step)
    x = torch.randn(BATCH, D, generator=gen, dtype=DTYPE)
    a = torch.randn(D, D, generator=torch.Generator().manual_seed(5), dtype=DTYPE)
    return x, torch.sin(x @ a)


def local_batch(step: int):
    return C.rank_rows(*batch(step))


def groups(model: Net, experts: bool = True) -> list:
    """The ordinary weight in 4 x 4 blocks, the expert weights (each expert whole), the bias."""
    ex = {"params": [model.experts.w1, model.experts.w2], "block_size": None}
    if experts:
        ex["num_experts"] = E
    return [{"params": [model.inp.weight], "block_size": 4}, ex,
            {"params": [model.inp.bias], "block_size": None}]


def make_opt(name: str, model: Net, runtime: dict, experts: bool = True):
    return OPTS[name](groups(model, experts), lr=LR[name], precondition_frequency=FREQ,
                      runtime=runtime)


def fsdp_net(seed: int = 0) -> Net:
    from torch.distributed.fsdp import fully_shard

    model = make_net(seed)
    fully_shard(model.inp)
    fully_shard(model.experts)
    fully_shard(model)
    return model


@functools.lru_cache(maxsize=None)
def _reference(name: str, runtime: tuple, experts: bool) -> tuple:
    return tuple(C.single_process(make_net(),
                                  lambda m: make_opt(name, m, dict(runtime), experts),
                                  batch, STEPS))


def reference(name: str, runtime: dict, experts: bool = True) -> list:
    """The unsharded run of one process on the global batch (rank-local: no collectives),
    STEPS steps; computed once per (name, runtime, experts) in this process."""
    return list(_reference(name, tuple(sorted(runtime.items())), experts))


def start() -> list:
    return [p.detach().clone() for p in make_net().parameters()]


def factor_shapes(opt, p, name: str) -> dict:
    """{block key: [shape of its factor of each dim]} of p's state on this rank (shard tags
    left out)."""
    out: dict = {}
    for k, v in opt.state.get(p, {}).items():
        key = k.split("@")[0]
        blk, _, field = key.partition(".")
        f = FACTOR[name]
        if field.startswith(f) and field[len(f):].isdigit() and isinstance(v, torch.Tensor):
            out.setdefault(blk, {})[int(field[len(f):])] = list(C.local(v).shape)
    return {b: [s[i] for i in sorted(s)] for b, s in sorted(out.items())}


def run(name: str, runtime: dict) -> dict:
    """STEPS steps on this world size; rank 0 compares with the single-process run."""
    model = fsdp_net()
    opt = make_opt(name, model, runtime)
    C.train(model, opt, local_batch, 1, STEPS)
    stats = opt.asteria_stats()
    ex = model.experts
    res = {"finite": all(bool(torch.isfinite(C.local(p)).all()) for p in model.parameters()),
           "factors_w1": factor_shapes(opt, ex.w1, name),
           "factors_w2": factor_shapes(opt, ex.w2, name),
           "local_rows": {"w1": C.local(ex.w1).shape[0], "w2": C.local(ex.w2).shape[0]},
           "blocks": stats.get("fsdp_global_blocks"),
           "owned": stats.get("fsdp_global_blocks_owned")}
    opt.close()
    full = C.full_params(model)
    res["digest"] = C.digest(full)
    if dist.get_rank() == 0:
        rt = {k: v for k, v in runtime.items() if k != "fsdp_blocking"}
        res.update(C.compare(full, reference(name, rt), start()))
        if name == "soap" and runtime["mode"] == "sync":  # the control: plain expert weights
            res["plain_control"] = C.compare(full, reference(name, rt, experts=False), start())
    return res


def check_sync() -> dict:
    return {name: run(name, dict(SYNC, fsdp_blocking="global")) for name in OPTS}


def check_async() -> dict:
    return {name: run(name, dict(ASYNC, fsdp_blocking="global")) for name in OPTS}


def check_local() -> dict:
    """The default per-shard blocks: on 2 ranks each shard holds whole experts (and the 4 x 4
    blocks of the ordinary weight are the unsharded run's), so this is the single-process
    optimizer; on 4 ranks a shard holds half an expert, preconditioned on its own."""
    return {mode: {name: run(name, rt) for name in OPTS}
            for mode, rt in (("sync", SYNC), ("async", ASYNC))}


# ---- checkpoints: save on 4 ranks, resume on 2 --------------------------------------------------
SPLIT = 9  # a refresh is in flight after step 9 (SOAP: snapshot 9, install 11; Shampoo: 8, 10)


def _async_global(name: str, seed: int = 0) -> tuple:
    model = fsdp_net(seed)
    return model, make_opt(name, model, dict(ASYNC, fsdp_blocking="global"))


def check_save() -> dict:
    """Steps 1..SPLIT (async, global blocks), then a DCP checkpoint (model and flattened
    optimizer state) in $FSDP_GLOBAL_CKPT/<name>."""
    return C.save_each(OPTS, _async_global, local_batch, SPLIT)


def check_resume() -> dict:
    """Load $FSDP_GLOBAL_CKPT/<name> (saved on another world size) into a fresh model and
    optimizer, train steps SPLIT+1..STEPS; rank 0 compares with the uninterrupted
    single-process run."""
    fulls = C.resume_each(OPTS, lambda n: _async_global(n, seed=123), local_batch, SPLIT,
                          STEPS)
    if dist.get_rank() != 0:
        return {name: {} for name in fulls}
    return {name: C.compare(full, reference(name, ASYNC), start()) for name, full in fulls.items()}


CHECKS = {n[len("check_"):]: f for n, f in globals().items() if n.startswith("check_")}


def main() -> None:
    C.run_checks(CHECKS, timeout=120.0)


if __name__ == "__main__":
    main()
