"""Eigenbases stored in every tier dtype (runtime key ``tier_dtype``: float32, bfloat16, int8,
int4; asteria.config.TIER_DTYPES), on the host tier and again on NVMe, against tuned AdamW, in
the users' regime, on two seeds.

Every run trains examples/train_tiny.py's problem (bench_convergence.py's "users" setting:
TinyGPT d=128, 2 layers, context 128, batch 64 = 8,192 tokens a step, 16x the widest layer),
warm-up + cosine over all steps (300: the schedule of the sweep; at 200 these lrs leave SOAP level
with AdamW, docs/results.md), each optimizer at its swept lr from bench_convergence's users
sweep (benchmarks/results/bench_convergence.json: AdamW's and Asteria SOAP async's tuned lr):
AdamW, and Asteria SOAP async (f=10, S=5, deterministic install) with its eigenbases on the host
tier (``placement={"eigenbases": "host"}``) in each tier dtype. Per seed the runs go in lockstep
(bench_convergence.train_lockstep: turns of 10 steps, each on its own copy of the model, so the
machine's drift reaches them alike; each run's clock counts its own steps). The same Asteria
runs with every eigenbasis on NVMe (``host_budget_bytes=0``, ``nvme_dir`` under a temporary
directory) follow, for all steps too (--tiers: "host", "nvme" or both; the parts may run as
separate invocations into their own --out-dir and be joined with --merge).

Reported per run (tier_dtype_report.py computes the comparisons):
  - steps to AdamW's final loss (the trailing mean of its last --window losses; the first step
    whose trailing mean reaches it, bench_convergence.time_to_target) and the ratio to float32's
    on the same seed and tier;
  - the held-out loss (bench_convergence's: 8 batches of the corpus's held-out 10%, weights
    copied every --val-every steps) at AdamW's own time for all its steps (interpolated on the
    run's own clock, as bench_convergence's table) and at the last step (equal steps);
  - optimizer-state bytes per tier (asteria_stats(), after the last step), the ratio of the tier
    bytes (every tier but the device: the eigenbases, scales included) to float32's, the
    planner's figures (asteria_memory_plan()), and bytes read from / written to NVMe per step;
  - the orthogonality error ||V^T V - I||_F (Frobenius) of the stored eigenbases of at least
    TIER_QUANT_MIN_DIM rows after the last step: the state after close() holds a quantized basis
    as stored, dequantized but not rectified (docs/memory.md); measured as it is ("widened") and
    after the configured TIER_RECTIFY_STEPS Bjorck steps (asteria.tiers.quant.rectify, the
    steps' own computation; 0 steps for float32 / bfloat16); max and mean over the bases;
  - an NVMe run's losses compared bit for bit with the host run's of its dtype and seed
    (tests/python/test_nvme_training.py: they should be equal).
The targets (issue "Eigenbases at 8 and 4 bits", tier_dtype_report.TARGETS) per seed: int8 within
2% of float32's steps to AdamW's loss, within 0.01 of its held-out loss, at <= 0.27x its tier
bytes; int4 within 5%, 0.02, <= 0.14x.

Writes benchmarks/results/bench_tier_dtype.{json,png} (the JSON after every seed too; --tiers
nvme alone writes bench_tier_dtype_nvme.json).

    python3 benchmarks/bench_tier_dtype.py              # 300 steps, 2 seeds x (5 + 4) runs
    python3 benchmarks/bench_tier_dtype.py --tiers host --seeds 0 --out-dir /tmp/h0
    python3 benchmarks/bench_tier_dtype.py --merge /tmp/h0 /tmp/h1 /tmp/n0 /tmp/n1
    python3 benchmarks/bench_tier_dtype.py --quick --out-dir /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402
import tier_dtype_report as report  # noqa: E402
from bench_convergence import (SOAP_HP, async_runtime, build_problem, make_curve,  # noqa: E402
                               make_optimizer, model_optimizer, placement, train_lockstep)
from tinygpt import SCHEDULE  # noqa: E402

from asteria.config import TIER_DTYPES, TIER_QUANT_MIN_DIM, TIER_RECTIFY_STEPS  # noqa: E402
from asteria.tiers import quant  # noqa: E402

NAME = "bench_tier_dtype"
TIER_CHOICES = ("host", "nvme")
SOAP = "asteria-soap-async"
#: the swept lrs' home: bench_convergence's users sweep (AdamW's and Asteria SOAP async's)
SWEEP_JSON = os.path.join(common.RESULTS_DIR, "bench_convergence.json")
_BASIS = re.compile(r"^b\d+\.Q\d+$")


def swept_lrs(path: str = SWEEP_JSON) -> dict[str, float]:
    """{"adamw": lr, SOAP: lr}: the tuned lrs of bench_convergence's users setting."""
    try:
        with open(path, encoding="utf-8") as f:
            tuned = json.load(f)["setting_results"]["users"]["tuned_lr"]
        return {"adamw": float(tuned["adamw"]), SOAP: float(tuned[SOAP])}
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"{path}: no users-setting tuned lr of adamw and {SOAP} ({e}); pass "
                         f"--lr and --adamw-lr") from e


def run_name(dtype: str, tier: str) -> str:
    return dtype if tier == "host" else f"{dtype}-nvme"


def split_name(name: str) -> tuple[str, str]:
    """(tier dtype, tier) of a run name of run_name."""
    return (name[:-5], "nvme") if name.endswith("-nvme") else (name, "host")


def losses_digest(losses: Sequence[float]) -> str:
    """SHA-256 of the float64 losses' bytes: equal digests, bitwise equal losses."""
    return hashlib.sha256(struct.pack(f"<{len(losses)}d", *losses)).hexdigest()


def orthogonality(opt, dtype: str) -> Optional[dict[str, Any]]:
    """||V^T V - I||_F of the stored eigenbases of at least TIER_QUANT_MIN_DIM rows of a closed
    optimizer (its state: the stored basis, dequantized, not rectified), as stored and after
    the tier dtype's Bjorck steps; None without bases."""
    steps = TIER_RECTIFY_STEPS.get(dtype, 0)
    before, after, sizes = [], [], []
    for st in opt.state.values():
        for k, v in st.items():
            if (_BASIS.match(k) and torch.is_tensor(v) and v.dim() == 2
                    and v.shape[0] == v.shape[1] >= TIER_QUANT_MIN_DIM):
                v = v.detach().to("cpu", torch.float32)
                before.append(float(quant.orth_error(v)))
                after.append(float(quant.orth_error(quant.rectify(v, steps))))
                sizes.append(int(v.shape[0]))
    if not sizes:
        return None
    return {"norm": "Frobenius", "bases": len(sizes), "sizes": sizes, "bjorck_steps": steps,
            "widened_max": max(before), "widened_mean": sum(before) / len(before),
            "rectified_max": max(after), "rectified_mean": sum(after) / len(after)}


class Maker:
    """The Curve factory of train_lockstep (make_curve's arguments and result) for AdamW and
    the tier-dtype runs; keeps each Asteria optimizer (for its state after close) and its
    planner's figures at construction."""

    def __init__(self, args, nvme_root: Optional[str]) -> None:
        self.args, self.nvme_root = args, nvme_root
        self.opts: dict[str, Any] = {}
        self.plans: dict[str, dict] = {}
        self.runtimes: dict[str, dict] = {}

    def build(self, name: str, model, lr: float, args, worker_cpus: Optional[str]):
        if name == "adamw":
            return model_optimizer(name, model, lr, args, worker_cpus)
        dtype, tier = split_name(name)
        rt = dict(async_runtime(args, worker_cpus), tier_dtype=dtype)
        if tier == "host":
            rt["placement"] = {"eigenbases": "host"}  # "auto" keeps CPU eigenbases in place
        else:
            rt.update(nvme_dir=tempfile.mkdtemp(prefix=f"{name}-", dir=self.nvme_root),
                      host_budget_bytes=0)
        opt, kw = make_optimizer(SOAP, model.parameters(), lr, args, None, runtime=rt)
        self.opts[name], self.plans[name] = opt, opt.asteria_memory_plan()
        self.runtimes[name] = dict(rt, nvme_dir="<tmp>") if "nvme_dir" in rt else rt
        return opt, kw

    def __call__(self, name, lr, problem, args, pin, log, *, stop_below, budget_s):
        c, kw = make_curve(name, lr, problem, args, pin, log, stop_below=stop_below,
                           budget_s=budget_s, build=self.build)
        self.opts[name + ".curve"] = c
        return c, kw


def run_seed(names: list, lrs: dict, problem, args, pin: dict, log, nvme_root) -> list:
    make = Maker(args, nvme_root)
    rs = train_lockstep(names, lrs, problem, args, pin, log, make)
    for r in rs:
        name = r["optimizer"]
        c = make.opts.pop(name + ".curve")
        r["losses_sha256"] = losses_digest(c.loop.losses)
        r["label"] = f"{name} seed {problem.seed}"
        r["val_final"] = r["val"]["loss"][-1]
        if name == "adamw":
            r.update(tier_dtype=None, tier=None)
            continue
        dtype, tier = split_name(name)
        opt = make.opts.pop(name)
        mem, cnt, steps = r["memory"]["tiers"], r["runtime_counters"], r["steps_run"]
        r.update(tier_dtype=dtype, tier=tier, runtime=make.runtimes[name],
                 memory_plan=make.plans[name], orthogonality=orthogonality(opt, dtype),
                 tier_bytes=sum(b for t, b in mem.items() if t != "device"),
                 nvme_read_per_step=cnt.get("bytes_nvme_read", 0) / steps,
                 nvme_written_per_step=cnt.get("bytes_nvme_written", 0) / steps)
        o = r["orthogonality"] or {}
        log(f"  {r['label']}: final {r['smoothed'][-1]:.4f}, held-out {r['val_final']:.4f}; "
            f"tier bytes {r['tier_bytes']}, NVMe read {r['nvme_read_per_step']:.0f} B/step; "
            f"||V^T V - I||_F max {o.get('widened_max', float('nan')):.3g} -> "
            f"{o.get('rectified_max', float('nan')):.3g}")
        del opt, c
    del make
    gc.collect()
    return rs


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    if args.merge:
        data = report.merge(args.merge, meta)
        return common.finish(data, NAME, args.out_dir, args.no_plot, report.print_table,
                             report.plot, log)
    torch.set_num_threads(args.threads)
    pin = placement(args.train_cpu)
    cpu0 = common.cpu_snapshot()
    lrs = {"adamw": args.adamw_lr, **{run_name(d, t): args.lr for d in TIER_DTYPES
                                      for t in TIER_CHOICES}}
    name = NAME if "host" in args.tiers else f"{NAME}_nvme"
    settings = {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                "staleness": args.staleness, "install": "deterministic",
                "lr": args.lr, "adamw_lr": args.adamw_lr, "lr_source": args.lr_source,
                "schedule": SCHEDULE, "soap_hp": dict(SOAP_HP, lr=args.lr),
                "workers": args.workers, "torch_threads": args.threads, "window": args.window,
                "val_every": args.val_every, "seeds": args.seeds, "tiers": args.tiers,
                "tier_dtypes": list(TIER_DTYPES), "rectify_steps": TIER_RECTIFY_STEPS,
                "quant_min_dim": TIER_QUANT_MIN_DIM, "in_lockstep": True,
                "quick": args.quick, "pinning": pin}
    results: list = []
    info = None
    with tempfile.TemporaryDirectory(dir=args.nvme_dir) as nvme_root:
        for seed in args.seeds:
            problem = build_problem(args.model_size, args.steps, seed)
            if info is None:
                info = problem.describe()
                log(f"TinyGPT {info['params'] / 1e6:.2f}M params, {info['tokens_per_step']} "
                    f"tokens a step = {info['tokens_over_widest']:.1f}x the widest layer; "
                    f"{args.steps} steps; tier dtypes {', '.join(TIER_DTYPES)} on "
                    f"{', '.join(args.tiers)}; seeds {args.seeds}; load {common.loadavg()}")
            for tier in args.tiers:
                names = (["adamw"] if tier == "host" else []) + [run_name(d, tier)
                                                                 for d in TIER_DTYPES]
                results += run_seed(names, lrs, problem, args, pin, log, nvme_root)
                common.write_json({**meta, "complete": False, "settings": settings,
                                   "model": info, "results": results}, f"{name}.json",
                                  args.out_dir)
            del problem
            gc.collect()
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    meta["cpu"] = common.cpu_delta(cpu0, common.cpu_snapshot())
    data = report.analyse({**meta, "complete": True, "settings": settings, "model": info,
                           "results": results})
    if name != NAME:
        return common.write_json(data, f"{name}.json", args.out_dir)
    return common.finish(data, NAME, args.out_dir, args.no_plot, report.print_table,
                         report.plot, log)


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run (300, the schedule the lrs were swept for; --quick 12)")
    ap.add_argument("--seeds", default="0,1", help="comma-separated seeds (>= 2 for the noise)")
    ap.add_argument("--tiers", default="host,nvme",
                    help=f"comma-separated tiers of the eigenbases, of {', '.join(TIER_CHOICES)}"
                         " (host runs with AdamW, NVMe runs after them)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                    help="join the JSONs of earlier invocations in these directories (their "
                         "bench_tier_dtype.json / bench_tier_dtype_nvme.json) into --out-dir")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (10; --quick 2)")
    ap.add_argument("--model-size", default=None, help="bench_convergence preset (users; "
                                                       "--quick tiny)")
    ap.add_argument("--frequency", type=int, default=10, help="precondition_frequency f")
    ap.add_argument("--staleness", type=int, default=5, help="staleness budget S")
    ap.add_argument("--lr", type=float, default=None,
                    help=f"peak lr of the SOAP runs (default: {SOAP}'s swept one)")
    ap.add_argument("--adamw-lr", type=float, default=None,
                    help="peak lr of AdamW (default: its swept one)")
    ap.add_argument("--window", type=int, default=None,
                    help="trailing mean of the losses (20; --quick 4)")
    ap.add_argument("--val-every", type=int, default=None,
                    help="steps between weight copies for the held-out loss (20; --quick 4)")
    ap.add_argument("--nvme-dir", default=None,
                    help="parent of the NVMe runs' directory (default: the system's tmp)")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")
    ap.add_argument("--train-cpu", type=int, default=None,
                    help="the training thread's core (default: the first allowed one)")
    args = common.parse_quick(ap, argv, lambda q: dict(
        steps=12 if q else 300, warmup=2 if q else 10, model_size="tiny" if q else "users",
        window=4 if q else 20, val_every=4 if q else 20, log_every=6 if q else 50,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    args.heavyball_compile = False  # bench_convergence's factory reads it
    bad = [t for t in args.tiers if t not in TIER_CHOICES]
    if bad or not args.tiers:
        ap.error(f"--tiers {','.join(args.tiers)}: allowed: {', '.join(TIER_CHOICES)}")
    if not 0 <= args.staleness <= args.frequency:
        ap.error(f"staleness {args.staleness}: need 0 <= S <= --frequency ({args.frequency})")
    if args.steps < 2 or args.window < 1 or args.val_every < 1 or not args.seeds:
        ap.error("need --steps >= 2, --window >= 1, --val-every >= 1 and a seed")
    if not args.merge:
        swept = swept_lrs() if args.lr is None or args.adamw_lr is None else {}
        args.lr_source = (f"{os.path.relpath(SWEEP_JSON, common.ROOT)}: users setting's "
                          f"tuned_lr" if swept else "command line")
        args.lr = swept.get(SOAP) if args.lr is None else args.lr
        args.adamw_lr = swept.get("adamw") if args.adamw_lr is None else args.adamw_lr
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
