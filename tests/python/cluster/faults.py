"""Per-rank body of the fault tests of tests/python/test_cluster.py: what a user of an emulated
cluster (netns.py) meets when a rank straggles, a node's link is cut, or a rank is killed, and
the resume from the last checkpoint on fewer nodes.

Every rank trains the same replicated model on the same global batch with no DDP wrapper (as
dist/die.py does), so the coherence protocol's collectives are the only ones linking the ranks,
and the trajectory does not depend on the world size: a run resumed on 2 ranks must be bitwise
the uninterrupted run on 4. SOAP, async, ``install="deterministic"``, a refresh every S steps
(precondition_frequency = S).

Launched without torchrun, the store apart on node 0 (dist/die.py and dist/store.py say why):

    python faults.py --out DIR --case recover|cut|kill|resume [--ckpt DIR] [--timeout S]
        [--at-step T]

Cases (each a function below); each rank writes DIR/<case>.rank<r>.json, also when it fails
(then it exits 1 without tearing the process group down, whose peer is gone):

- recover: the faults a run recovers from. For S = 1 and 5, the run without and with rank 3
  sleeping STRAGGLE_S after each step of STRAGGLE_STEPS: digests, losses, step and job times.
  Then the cut run below, for a cut shorter than the timeout (digest, step times). Then FSDP2
  (per-shard blocking, the default) for a few steps and a DCP checkpoint of it in
  --ckpt/fsdp_local.
- cut: S = 1; after step T rank 0 writes DIR/cut.request and goes on once the driver, having
  cut a link, wrote DIR/cut.down. The run either ends or, for a cut longer than the timeout,
  fails (the error, when).
- kill: S = 1 with a DCP checkpoint (model and flattened optimizer state) every CKPT_EVERY
  steps in --ckpt/step<t>; the last rank SIGKILLs itself inside the version exchange (its
  ``all_reduce`` started) of the first unit after step T, having written
  DIR/died (its CLOCK_MONOTONIC time). Survivors report the error and which saves completed.
- resume: from --ckpt (a checkpoint of the kill case, on any world size), steps after it to
  STEPS; then the FSDP2 checkpoint of 4 ranks loaded on this world size (refused: the error).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import signal
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.join(os.path.dirname(HERE), "dist"))
import checks  # noqa: E402
import common as C  # noqa: E402

import asteria  # noqa: E402
from asteria.rank_exit import exit_rank  # noqa: E402

STEPS = 12
STRAGGLER, STRAGGLE_STEPS, STRAGGLE_S = 3, (3, 7), 2.0
CKPT_EVERY = 3
FSDP_STEPS = 3


def runtime(staleness: int, timeout: float) -> dict:
    return {"mode": "async", "staleness": staleness, "workers": 1, "install": "deterministic",
            "coherence_timeout_s": timeout}


def make(staleness: int, timeout: float):
    model = C.make_model(layers=1)
    opt = asteria.SOAP(model.parameters(), lr=1e-2, block_size=8,
                       precondition_frequency=staleness, runtime=runtime(staleness, timeout))
    return model, opt


def digest(model, opt) -> dict:
    """The bits of the parameters, and of the parameters with every optimizer-state tensor."""
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"params": hashlib.sha256(params.view(torch.int64).numpy().tobytes()).hexdigest(),
            "state": hashlib.sha256(C.flat_state(model, opt).view(torch.int64).numpy()
                                    .tobytes()).hexdigest()}


def train(model, opt, steps, after_step=None) -> dict:
    """Train ``steps``; ``after_step(t)`` runs after each. Losses and step times (the step's
    own time, the callback's excluded)."""
    losses, times = [], []
    for t in steps:
        x, y = C.global_batch(t, 1)
        t0 = time.perf_counter()
        losses.append(C.train_step(model, opt, x, y))
        times.append(time.perf_counter() - t0)
        if after_step is not None:
            after_step(t)
    return {"losses": losses, "step_s": times}


def _flat():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict)

    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt, options=_flat())},
             checkpoint_id=path)


def load(model, opt, path: str) -> None:
    """As OLMo-core resumes: the fresh model's and optimizer's state dicts are the template."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    template = {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt, options=_flat())}
    dcp.load(template, checkpoint_id=path)
    set_model_state_dict(model, template["model"])
    set_optimizer_state_dict(model, opt, template["optim"], options=_flat())


# ---- cases ------------------------------------------------------------------------------------

def case_recover(args, out: dict) -> None:
    """The faults a run recovers from, each beside its baseline: a straggler at S = 1 and 5,
    then (S = 1) a link cut shorter than the timeout; then the FSDP2 checkpoint."""
    for s in (1, 5):
        for straggle in (False, True):
            model, opt = make(s, args.timeout)

            def nap(t):
                if straggle and dist.get_rank() == STRAGGLER and t in STRAGGLE_STEPS:
                    time.sleep(STRAGGLE_S)

            dist.barrier()
            t0 = time.perf_counter()
            res = train(model, opt, range(1, STEPS + 1), nap)
            opt.close()
            res["job_s"] = time.perf_counter() - t0
            dist.barrier()
            res.update(digest(model, opt), replicas_equal=C.all_true(C.gather_equal(
                C.flat_state(model, opt))))
            out[f"S{s}_{'straggler' if straggle else 'baseline'}"] = res
    out["straggle"] = {"rank": STRAGGLER, "after_steps": list(STRAGGLE_STEPS),
                       "sleep_s": STRAGGLE_S, "steps": STEPS}
    out["cut"] = cut_run(args)
    out["fsdp_local"] = fsdp_save(os.path.join(args.ckpt, "fsdp_local"))


def fsdp_save(path: str) -> dict:
    """FSDP2, per-shard blocking: a few steps, then a DCP checkpoint (tied to 4 shards)."""
    model = checks.fsdp_model()
    opt = checks.make_opt("soap", model.parameters(), {"mode": "sync"}, block_size=4,
                          precondition_frequency=1)
    for t in range(1, FSDP_STEPS + 1):
        C.train_step(model, opt, *C.local_batch(t, dist.get_rank(), dist.get_world_size()))
    save(model, opt, path)
    opt.close()
    return {"saved": path}


def cut_run(args) -> dict:
    """S = 1 with the handshake after step ``--at-step``: rank 0 asks for the cut and goes on
    once the link is down."""
    model, opt = make(1, args.timeout)

    def handshake(t):
        if t == args.at_step and dist.get_rank() == 0:
            open(os.path.join(args.out, "cut.request"), "w").close()
            down = os.path.join(args.out, "cut.down")
            deadline = time.monotonic() + 60
            while not os.path.exists(down) and time.monotonic() < deadline:
                time.sleep(0.01)

    res = train(model, opt, range(1, STEPS + 1), handshake)
    opt.close()
    res.update(digest(model, opt))
    return res


def case_cut(args, res: dict) -> None:
    res.update(cut_run(args))


def _die_inside_the_exchange(armed: threading.Event, died: str) -> None:
    """This rank's coherence thread, at its first version exchange once ``armed``: start the
    all_reduce (this rank's part is on the wire or queued), then SIGKILL this process."""
    orig = dist.all_reduce

    def all_reduce(tensor, *a, **kw):
        if not (armed.is_set() and threading.current_thread().name == "asteria-coherence"):
            return orig(tensor, *a, **kw)
        kw["async_op"] = True
        orig(tensor, *a, **kw)
        with open(died, "w") as fh:
            fh.write(repr(time.monotonic()))
        print(f"RANK {dist.get_rank()} DIES inside a version exchange", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    dist.all_reduce = all_reduce


def case_kill(args, res: dict) -> None:
    armed = threading.Event()
    if dist.get_rank() == dist.get_world_size() - 1:
        _die_inside_the_exchange(armed, os.path.join(args.out, "died"))
    model, opt = make(1, args.timeout)
    res.update(saved=[], ckpt_every=CKPT_EVERY)

    def checkpoint(t):
        if t % CKPT_EVERY == 0:
            save(model, opt, os.path.join(args.ckpt, f"step{t:03d}"))
            res["saved"].append(t)
        if t == args.at_step:
            armed.set()

    res.update(train(model, opt, range(1, STEPS + 1), checkpoint))
    opt.close()


def case_resume(args, res: dict) -> None:
    first = int(os.path.basename(os.path.normpath(args.ckpt))[len("step"):]) + 1
    model, opt = make(1, args.timeout)
    load(model, opt, args.ckpt)
    res.update(train(model, opt, range(first, STEPS + 1)))
    stats = opt.asteria_stats()
    opt.close()
    res.update(digest(model, opt), first=first, owned=stats.get("coherence_owned"),
               computed=stats.get("coherence_entries_computed"),
               received=stats.get("coherence_entries_received"),
               replicated=stats.get("coherence_topology", {}).get("world"))
    res["fsdp_local"] = fsdp_load(os.path.join(os.path.dirname(os.path.normpath(args.ckpt)),
                                               "fsdp_local"))


def fsdp_load(path: str) -> dict:
    """The FSDP2 checkpoint of 4 ranks into FSDP2 on this world size: the error, if any."""
    model = checks.fsdp_model(seed=1)
    opt = checks.make_opt("soap", model.parameters(), {"mode": "sync"}, block_size=4,
                          precondition_frequency=1)
    try:
        load(model, opt, path)
        out = {"loaded": True}
    except (Exception, CheckpointException) as exc:
        out = {"loaded": False, "error": f"{type(exc).__name__}: {exc}"}
    opt.close()
    return out


CASES = {"recover": case_recover, "cut": case_cut, "kill": case_kill, "resume": case_resume}


def main() -> NoReturn:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--at-step", type=int, default=0, help="cut: the step of the handshake; "
                    "kill: the step after which the last rank dies")
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    res = {"rank": rank, "world": dist.get_world_size()}
    path = os.path.join(args.out, f"{args.case}.rank{rank}.json")
    try:
        CASES[args.case](args, res)
    except (Exception, CheckpointException) as exc:  # the failure under test
        res["failed"] = {"at": time.monotonic(),
                         "error": " ".join(f"{type(exc).__name__}: {exc}".split())}
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"RANK {rank} FAILED {res['failed']['error']}", flush=True)
        exit_rank(1, teardown=False)  # a peer is gone: no collective teardown
    res["ended"] = time.monotonic()
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1)
    exit_rank(0)


if __name__ == "__main__":
    main()
