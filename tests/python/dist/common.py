"""Support of the per-rank scripts of tests/python/test_distributed.py: a tiny float64
transformer whose every weight is square (its blocks: models.py's Block), deterministic global batches cut per rank, and
collective comparisons, and the main of a per-rank script (``run_checks``). For the FSDP2
scripts (fsdp_global.py, experts.py): a rank's rows of a global batch, the single-process
reference run, the full parameters and their comparison, and DCP checkpoints.

Numerics (see tests/python/models.py): every factor must be full rank with distinct eigenvalues,
or eigenvectors of a degenerate eigenvalue are arbitrary and SOAP / KL-Shampoo trajectories move
at O(1) between two correct runs. So every weight is D x D, the model reads continuous features
(no embedding table: unused tokens would give zero rows), every block the optimizer sees is
square (block sizes divide the shard shapes), and a rank's local batch has more tokens than any
block is wide.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from asteria.rank_exit import exit_rank

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import Block  # noqa: E402  (tests/python/models.py: the transformer block)

D = 16          # width: every weight is D x D
SEQ = 8         # tokens per sequence
PER_RANK = 2    # sequences per rank and step (16 tokens > any block width)
DTYPE = torch.float64

torch.set_num_threads(1)


class TinyTransformer(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(D) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, D)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def make_model(seed: int = 0, layers: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer(layers).to(DTYPE)


def global_batch(step: int, world: int):
    """(x, y) of one step for the whole job: world * PER_RANK sequences."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * PER_RANK, SEQ, D, generator=gen, dtype=DTYPE)
    a = torch.randn(D, D, generator=torch.Generator().manual_seed(7), dtype=DTYPE)
    return x, torch.sin(x @ a)


def local_batch(step: int, rank: int, world: int):
    x, y = global_batch(step, world)
    sl = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[sl], y[sl]


def train_step(model, opt, x, y) -> float:
    opt.zero_grad(set_to_none=True)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    opt.step()
    return float(loss.detach())


def local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def flat_state(model, opt) -> torch.Tensor:
    """Every parameter's local tensor and every tensor of its optimizer state, flattened in a
    fixed order (float64; int64 state such as permutations converted exactly)."""
    parts = []
    for p in model.parameters():
        parts.append(local(p).detach().reshape(-1).to(torch.float64))
        st = opt.state.get(p, {})
        for k in sorted(st):
            v = st[k]
            if isinstance(v, torch.Tensor):
                parts.append(local(v).detach().reshape(-1).to(torch.float64))
            elif isinstance(v, (int, float)):
                parts.append(torch.tensor([float(v)], dtype=torch.float64))
    return torch.cat(parts)


def gather_equal(vec: torch.Tensor, partners=None) -> bool:
    """Whether this rank's vector equals, bit for bit, that of every rank in partners (default:
    every rank). Collective over the world."""
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([vec.numel()]))
    n = max(int(s) for s in sizes)
    padded = torch.full((n,), float("nan"), dtype=torch.float64)
    padded[:vec.numel()] = vec
    out = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(out, padded)
    mine = out[dist.get_rank()].view(torch.int64)
    others = range(world) if partners is None else partners
    return all(int(sizes[r]) == vec.numel() and torch.equal(out[r].view(torch.int64), mine)
               for r in others)


def all_true(flag: bool) -> bool:
    t = torch.tensor([1 if flag else 0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())



# ---- FSDP2 against one process (fsdp_global.py, experts.py) --------------------------------------

def rank_rows(x, y):
    """This rank's equal share of the rows of a global batch (x, y)."""
    n = x.shape[0] // dist.get_world_size()
    sl = slice(dist.get_rank() * n, (dist.get_rank() + 1) * n)
    return x[sl], y[sl]


def train(model, opt, batch, first: int, last: int) -> None:
    """train_step on ``batch(t)`` for t = first..last."""
    for t in range(first, last + 1):
        train_step(model, opt, *batch(t))


def single_process(model, make_opt, batch, steps: int) -> list:
    """The unsharded run of one process on the global batches ``batch(1..steps)``, declared
    rank-local (no collectives) with ``make_opt(model)``: its parameters after."""
    from asteria import distributed as AD

    AD.set_replicas(model.parameters(), None)
    opt = make_opt(model)
    train(model, opt, batch, 1, steps)
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


def full_params(model) -> list:
    """The full tensors of an FSDP2 model's parameters (collective)."""
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def digest(full: list) -> str:
    """The bits of the full parameters."""
    import hashlib

    flat = torch.cat([p.detach().reshape(-1).to(DTYPE) for p in full])
    return hashlib.sha256(flat.view(torch.int64).numpy().tobytes()).hexdigest()


def compare(full: list, ref: list, start: list) -> dict:
    diff = max(float((a - b).abs().max()) for a, b in zip(full, ref))
    scale = max(float(b.abs().max()) for b in ref)
    moved = max(float((b - s).abs().max()) for b, s in zip(ref, start))
    return {"max_abs_diff": diff, "max_rel_diff": diff / scale, "max_moved": moved}


def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def _ckpt(name: str) -> str:
    return os.path.join(os.environ["FSDP_GLOBAL_CKPT"], name)


def save_checkpoint(model, opt, name: str) -> dict:
    """A DCP checkpoint of the model and the flattened optimizer state in
    $FSDP_GLOBAL_CKPT/<name>: {"in_flight": the install steps of the refreshes in flight,
    "keys": how many keys the optimizer state has}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    flat = get_optimizer_state_dict(model, opt, options=_flat())
    dcp.save({"model": get_model_state_dict(model), "optim": flat}, checkpoint_id=_ckpt(name))
    return {"in_flight": sorted(int(v) for k, v in flat.items()
                                if k.endswith("pending.install_in")),
            "keys": len(flat)}


def save_each(names, make, batch, split: int) -> dict:
    """Per optimizer name: ``make(name)`` -> (model, optimizer) trained on ``batch(t)`` for
    t = 1..split, then save_checkpoint; {name: what it returned}."""
    out = {}
    for name in names:
        model, opt = make(name)
        train(model, opt, batch, 1, split)
        out[name] = save_checkpoint(model, opt, name)
        opt.close()
    return out


def resume_each(names, make, batch, split: int, steps: int) -> dict:
    """Per optimizer name: ``make(name)`` -> (model, optimizer), load_checkpoint, trained on
    ``batch(t)`` for t = split+1..steps; {name: its full parameters after}."""
    out = {}
    for name in names:
        model, opt = make(name)
        load_checkpoint(model, opt, name)
        train(model, opt, batch, split + 1, steps)
        opt.close()
        out[name] = full_params(model)
    return out


def load_checkpoint(model, opt, name: str) -> None:
    """Load $FSDP_GLOBAL_CKPT/<name> (save_checkpoint's, from any world size) into the model
    and the optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    template = {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt, options=_flat())}
    dcp.load(template, checkpoint_id=_ckpt(name))
    set_model_state_dict(model, template["model"])
    set_optimizer_state_dict(model, opt, template["optim"], options=_flat())

def jsonable(stats: dict) -> dict:
    out = {}
    for k, v in stats.items():
        if isinstance(v, dict):
            out[k] = {str(kk): (jsonable(vv) if isinstance(vv, dict) else vv)
                      for kk, vv in v.items()}
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[k] = v
    return out


def env_rank_info() -> dict:
    return {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK",
                                           "LOCAL_WORLD_SIZE", "WORLD_SIZE")}


def checks_in(namespace: dict) -> dict:
    """A per-rank script's checks for run_checks: its ``check_<name>`` functions (namespace:
    its globals()) by <name>, in the order defined."""
    return {n[len("check_"):]: f for n, f in namespace.items() if n.startswith("check_")}


def run_checks(checks: dict, timeout: float) -> NoReturn:
    """A per-rank script's main: ``--checks`` (comma-separated names of ``checks``, all by
    default) run in order over a gloo process group with a barrier after each; each one's
    result and time go to ``--out``/rank{r}.json, written even when a check raises. The rank
    ends through ``asteria.rank_exit.exit_rank``: 0 once every check passed, 1 after one raised
    (its traceback printed; no collective teardown, a peer may be gone)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--checks", default=",".join(checks))
    ap.add_argument("--timeout", type=float, default=timeout)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    results = {"env": env_rank_info(), "world": dist.get_world_size(), "timings": {}}
    failed = False
    try:
        for name in args.checks.split(","):
            t0 = time.perf_counter()
            results[name] = checks[name]()
            results["timings"][name] = time.perf_counter() - t0
            dist.barrier()
    except Exception:  # reported by the driver from this rank's output and missing results
        traceback.print_exc()
        failed = True
    finally:
        with open(os.path.join(args.out, f"rank{dist.get_rank()}.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    exit_rank(1 if failed else 0, teardown=not failed)
