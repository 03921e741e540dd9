"""Time to reach tuned AdamW's final loss, per optimizer, where users train.

Setting "users" (the headline): TinyGPT d=128, 2 layers, context 128, batch 64 = 8,192 tokens
a step, 16x the widest layer dimension (the MLP's 4d = 512). Setting "optimizer-bound" (the
second row): the same model at context 64, batch 16 = 1,024 tokens a step, 2x the widest layer,
the setting of the earlier README figure. Why they differ: a step's forward and backward cost
grows with the tokens, SOAP's rotations and factor updates only with the layer sizes, so at
1,024 tokens they cost as much as the model's own matmuls and at 8,192 a few percent.

Every run: the same model, initial weights and batches for a given seed; linear warm-up over the
first 10% of the steps, then cosine decay to 10% of the peak lr at the last step. Optimizers:
AdamW, Asteria SOAP / KL-Shampoo / Shampoo async (S=0, deterministic install, one worker on the
other core: sync's trajectory, each refresh installed at the start of the next step, so it runs
during that step's forward and backward; at this size a REFRESH round ends well inside them;
bench_staleness.py measures S up to 10), Asteria one-sided SOAP async
("asteria-one-sided-soap-async": asteria.OneSidedSOAP, a factor and eigenbasis on each weight's
smaller side only; Asteria SOAP's runtime), native sync SOAP (asteria.SOAP,
runtime {"mode": "sync"}), and the third-party SOAPs of pytorch-optimizer and heavyball (eager;
see bench_third_party.py), all SOAPs with the same hyperparameters (SOAP_HP). The amortisation
question (AMORTISATION): native SOAP refreshing its eigenbasis every step
("asteria-soap-sync-f1", precondition_frequency=1) beside native f=10 and Asteria f=10 with
S=5 ("asteria-soap-async-s5"): the JSON's final_loss_at_equal_steps and time ratios, per seed.

Procedure, per setting:
  1. The lr sweep, seed 0, one run after another: AdamW at each lr of its grid for all steps;
     its tuned lr is the one with the lowest final loss (trailing mean of the last --window
     losses). Then every other optimizer at each lr of its grid; a run stops once its
     trailing-mean loss reaches AdamW's tuned final loss (or at the last step, or at --budget x
     AdamW's wall time). Its tuned lr is the one that reaches it in the fewest steps (lowest
     final loss if none does). Where a tuned lr sits at the edge of the lrs tried, the sweep
     goes on beyond it (x2 or /2, up to --extend more lrs). Losses are deterministic: the
     choice does not depend on the machine's load.
  2. The timed runs, every seed: all optimizers at their tuned lrs in lockstep, each on its own
     copy of the model (same initial weights and batches), taking turns of 10 consecutive steps
     (common.run_loops: so an Asteria run's worker jobs overlap its own forward and backward)
     for all steps. The VM's speed drifts by several percent over minutes (docs/step_time_tail.md),
     as much as the differences between the SOAPs' steps; in lockstep every optimizer's step i
     runs within seconds of the others', so the drift reaches all of them alike. Each run's
     clock counts its own steps only. The seed's target is AdamW's final loss there.
  3. The held-out loss: every --val-every steps (and at the last) a timed run's weights are
     copied; after training, each copy's mean loss on 8 batches of the corpus's held-out 10%
     (CharData's "val" split: no training batch reads it; one set for every seed) is its
     validation loss at that point of the run's own clock. The table gives each run's
     validation loss at AdamW's own time for all steps (interpolated between copies): the
     loss on text it never saw at equal time, the question a tuned target on training loss
     over 2+ epochs of a 1 MB corpus answers only in part.
  time_ratio = own time to reach the seed's target / AdamW's own time for all steps, per seed;
  the JSON keeps the whole sweep (its times are those of separate runs), every timed run's
  losses, times, step kinds and optimizer-state bytes per tier at its end ("memory").

Also (users setting): Asteria-SOAP's step against its limit, AdamW's step plus the FLOPs SOAP
adds to each step (6 m n (m + n) per m x n preconditioned matrix: two rotations of the gradient
and the two factor updates) at this machine's single-thread GEMM rate, measured here on the
training core; and Asteria-SOAP's mean step on steps without a refresh against native sync
SOAP's median step. Where the step goes beyond its limit: torch.profiler around the optimizer
step of N plain steps (--profile-steps, 16) of AdamW and of Asteria SOAP splits it into the
matrix products (and the GEMM rate they ran at, operands cold from the forward and backward),
the other torch ops and the interpreter.

Training: one torch thread pinned to the first core; Asteria's worker pool on the others.

The host users have (--round-steps R, users setting): where users train (OLMo-2 1B on 8 GPUs)
a REFRESH round of all factors takes R >= 10 steps of host worker time (docs/capacity.md,
"The users' R on this machine"). This machine's core computes a round far faster than its
step, so each REFRESH job of an Asteria run with a worker pool holds its worker k x its compute
(the test-only job stretch, common.stretch_refresh_jobs: the pool at 1/k of a core, burning no
CPU), k calibrated so a round takes R steps (calibrate_round_steps); per-step worker jobs
(soap_rotate, gram_ema: GPU work in users' runs) and inline refreshes (native SOAP in mode
"sync", the third-party SOAPs) run at the core's full speed, as a GPU's would in the step.
Each stretched run records the R it measured: round time over median step. With
stretched jobs the timed runs go one after another, not in turns: a stretched job holds its
worker for wall-clock time, so in turns a round would run on through the other runs' turns and
end within fewer of its own run's steps than R (train_lockstep).

Writes benchmarks/results/bench_convergence.{json,png}.

    python3 benchmarks/bench_convergence.py            # default: about an hour on 2 cores
    python3 benchmarks/bench_convergence.py --settings users --seeds 0 --runs adamw,asteria-soap-async
    python3 benchmarks/bench_convergence.py --quick --out-dir /tmp/x   # seconds
    python3 benchmarks/bench_convergence.py --settings users --round-steps 10   # then 30

The helpers above "this benchmark" (problem set-up, the timed curve, smoothing, the optimizer
factories) are shared with bench_third_party.py and bench_staleness.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import math
import os
import re
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import common  # noqa: E402
from tinygpt import (SCHEDULE, CharData, GPTConfig, TinyGPT, n_params,  # noqa: E402
                     warmup_cosine)

import asteria  # noqa: E402
from asteria.optim.cadence import full_round  # noqa: E402

NAME = "bench_convergence"
PRESETS = {
    "tiny": dict(d=64, layers=1, heads=2, block=32, batch=4),
    # the optimizer-bound setting: 1,024 tokens a step against layers up to 512 wide
    "conv": dict(d=128, layers=2, heads=4, block=64, batch=16),
    "small": dict(d=256, layers=2, heads=4, block=64, batch=8),
    # users' regime: 8,192 tokens a step, 16x the widest layer (4d = 512)
    "users": dict(d=128, layers=2, heads=4, block=128, batch=64),
}
SETTINGS = {"users": "users", "optimizer-bound": "conv"}
WHY_SETTINGS_DIFFER = (
    "Forward and backward cost grows with the tokens per step, SOAP's rotations and factor "
    "updates only with the layer sizes: at 1,024 tokens against 128-512-wide layers SOAP's "
    "added matmuls cost about as much as the model's, at 8,192 tokens a few percent, so the "
    "optimizer-bound row pays for SOAP's better steps with a slower step.")
# SOAP hyperparameters every SOAP gets (native, third-party); lr comes from the sweep.
SOAP_HP = {"lr": 3e-3, "betas": (0.95, 0.95), "shampoo_beta": 0.95, "eps": 1e-8,
           "weight_decay": 0.01}
ADAMW_BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.01
PIP = {"pytorch-optimizer": "pytorch-optimizer", "heavyball": "heavyball"}
RUNS = ("adamw", "asteria-soap-async", "asteria-one-sided-soap-async",
        "asteria-kl-shampoo-async", "asteria-shampoo-async",
        "asteria-soap-sync", "asteria-soap-sync-f1", "asteria-soap-async-s5",
        "pytorch-optimizer", "heavyball")
# The amortisation question: native SOAP refreshing its eigenbasis every step (f=1, as
# modded-nanogpt's SOAP record and NVIDIA's Emerging-Optimizers do) beside native f=10 and
# Asteria f=10 with staleness S=5 (the refresh hidden on a worker, installed 5 steps late).
AMORTISATION = ("asteria-soap-sync", "asteria-soap-sync-f1", "asteria-soap-async-s5")
#: a sweep whose best lr sits at its grid's edge is extended by this factor, up to --extend
#: times (AdamW: the lowest final loss; the others: the fewest steps to AdamW's loss)
EXTEND_FACTOR = 2.0
# Grids from two earlier runs (2026-12-03): AdamW's final loss was 2.276 / 1.961 / 1.870 / 1.924
# / 2.502 at 1e-3 / 3e-3 / 6e-3 / 1e-2 / 2e-2, so its grid brackets 6e-3; SOAPs were best at
# 1e-2 inside 6e-3..2e-2; KL-Shampoo and Shampoo were best at the top of 3e-3..3e-2 and
# 3e-3..1e-2, so their grids go up from there. One-sided SOAP (no earlier run) starts from SOAP's
# grid; the sweep extends it where its best lr sits at an edge.
GRIDS = {
    "adamw": (3e-3, 6e-3, 1e-2),
    "asteria-soap-async": (6e-3, 1e-2, 2e-2),
    "asteria-one-sided-soap-async": (6e-3, 1e-2, 2e-2),
    "asteria-kl-shampoo-async": (1e-2, 3e-2, 1e-1),
    "asteria-shampoo-async": (6e-3, 1e-2, 2e-2),
    "asteria-soap-sync": (6e-3, 1e-2, 2e-2),
    "asteria-soap-sync-f1": (6e-3, 1e-2, 2e-2),
    "asteria-soap-async-s5": (6e-3, 1e-2, 2e-2),
    "pytorch-optimizer": (6e-3, 1e-2, 2e-2),
    "heavyball": (6e-3, 1e-2, 2e-2),
}
#: an Asteria run at its own f and S: "<base>-f<N>" or "<base>-f<N>-s<S>" (S <= f; without -s,
#: --staleness, at most f), e.g. "asteria-soap-async-f1", "asteria-soap-async-f1-s1",
#: "asteria-soap-sync-f10"; its lr grid is its base's
VARIANT_BASES = ("asteria-soap-async", "asteria-soap-sync", "asteria-one-sided-soap-async",
                 "asteria-kl-shampoo-async", "asteria-shampoo-async")
_VARIANT = re.compile(r"^(?P<base>" + "|".join(map(re.escape, VARIANT_BASES))
                      + r")-f(?P<f>[1-9][0-9]*)(?:-s(?P<s>[0-9]+))?$")


#: Asteria SOAP runs named by their refresh policy rather than by f and S (mode "async", one
#: worker; their lr grid is asteria-soap-async's): (precondition_frequency, runtime keys over
#: async_runtime's). "asteria-soap-async-auto": f and S "auto" (chosen once from the measured
#: round and step times, docs/capacity.md); "asteria-soap-drift": f=1, refresh_policy "drift"
#: with its budget, install delay and max_age "auto" (docs/capacity.md, "Refresh per factor")
POLICY_RUNS = {
    "asteria-soap-async-auto": ("auto", {"staleness": "auto"}),
    "asteria-soap-drift": (1, {"refresh_policy": "drift", "refresh_budget": "auto",
                               "install_delay": "auto", "max_age": "auto"}),
}
POLICY_BASE = "asteria-soap-async"
#: "asteria-soap-drift-b<N>": the drift run with its budget fixed at a round's worth every N
#: steps (``refresh_budget`` 1/N; d and max_age "auto"): refresh per factor at the refresh
#: work of the round policy at f = N, which the "auto" budget's margin leaves below
_DRIFT_BUDGET = re.compile(r"^asteria-soap-drift-b(?P<n>[1-9][0-9]*)$")


def policy_run(name: str) -> Optional[tuple]:
    """(precondition_frequency, runtime keys) of a run named by its refresh policy
    (POLICY_RUNS, or "asteria-soap-drift-b<N>"), or None for any other name."""
    if name in POLICY_RUNS:
        return POLICY_RUNS[name]
    m = _DRIFT_BUDGET.match(name)
    if m is None:
        return None
    return 1, dict(POLICY_RUNS["asteria-soap-drift"][1], refresh_budget=1.0 / int(m["n"]))


def variant(name: str) -> Optional[tuple[str, int, Optional[int]]]:
    """(base, f, S or None) of a run name "<base>-f<N>[-s<S>]", or None for any other name
    (ValueError if S > f). "asteria-soap-sync-f1" of RUNS is one: native SOAP at f=1."""
    m = _VARIANT.match(name)
    if m is None:
        return None
    f, s = int(m["f"]), None if m["s"] is None else int(m["s"])
    if s is not None and s > f:
        raise ValueError(f"run {name!r}: staleness {s} > precondition_frequency {f}; "
                         f"allowed: S <= f")
    return m["base"], f, s


def known_run(name: str, runs: Sequence[str] = RUNS) -> bool:
    return name in runs or policy_run(name) is not None or variant(name) is not None


def grid_of(name: str, grids: dict) -> tuple:
    """A run's lr grid: its own, else (a variant, a policy run) its base's."""
    if name in grids:
        return grids[name]
    if policy_run(name) is not None:
        return grids.get(POLICY_BASE, ())
    v = variant(name)
    return grids[v[0]] if v is not None else ()


TARGETS = {"time_ratio_max": 0.60, "step_over_limit_max": 1.02,
           "nonrefresh_mean_over_sync_median_max": 1.03}
DISTURBED_CORES = 0.25  # same threshold as bench_step_time.py
VAL_BATCHES = 8    # held-out batches a validation loss averages (65,536 tokens in "users")
VAL_SEED = 12345   # their generator's seed: one held-out set for every seed and run
MIN_BUDGET_S = 10.0     # a run may always take this long, however fast AdamW was


# ---- shared with bench_third_party.py and bench_staleness.py ------------------------------------

@dataclasses.dataclass
class Problem:
    """One model configuration, its initial weights and the batches every run sees.
    ``model_cls``: the model, built from ``cfg`` (TinyGPT; bench_moe.py's has experts)."""

    preset: str
    cfg: GPTConfig
    init_state: dict
    batches: list
    seed: int
    batch: int
    data: Optional[CharData] = None
    model_cls: Callable = TinyGPT
    #: batches of the corpus's held-out 10% (CharData's "val" split, which no training batch
    #: reads), the same for every seed: the validation loss of make_problem's docstring
    val_batches: list = dataclasses.field(default_factory=list)

    def model(self) -> TinyGPT:
        torch.manual_seed(self.seed)
        m = self.model_cls(self.cfg)
        m.load_state_dict(self.init_state)
        return m

    def widest(self) -> int:
        """The widest dimension of any 2-D weight but the vocabulary's (the MLP's 4d)."""
        return max(max(d for d in p.shape if d != self.cfg.vocab)
                   for p in self.model().parameters() if p.dim() == 2)

    def describe(self) -> dict[str, Any]:
        c = self.cfg
        tokens = self.batch * c.block
        return {"name": "TinyGPT", "preset": self.preset, "params": n_params(self.model()),
                "d": c.d, "layers": c.layers, "heads": c.heads, "context": c.block,
                "vocab": c.vocab, "batch": self.batch, "tokens_per_step": tokens,
                "widest_layer_dim": self.widest(),
                "tokens_over_widest": tokens / self.widest(),
                "data": "Tiny Shakespeare (char level)"}


def build_problem(preset: str, steps: int, seed: int, batch: Optional[int] = None) -> Problem:
    p = PRESETS[preset]
    data = CharData(block=p["block"])
    cfg = GPTConfig(vocab=data.vocab, block=p["block"], d=p["d"], layers=p["layers"],
                    heads=p["heads"])
    return make_problem(preset, cfg, data, steps, seed, batch or p["batch"])


def make_problem(name: str, cfg: GPTConfig, data: CharData, steps: int, seed: int,
                 batch: int, model_cls: Callable = TinyGPT) -> Problem:
    """A Problem of model ``cfg`` (a ``model_cls``): initial weights from ``seed``, ``steps``
    training batches of ``batch`` sequences from a generator seeded with it."""
    torch.manual_seed(seed)
    init_state = {k: v.clone() for k, v in model_cls(cfg).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    batches = [data.batch("train", batch, gen) for _ in range(steps)]
    vgen = torch.Generator().manual_seed(VAL_SEED)
    val = [data.batch("val", batch, vgen) for _ in range(VAL_BATCHES)]
    return Problem(name, cfg, init_state, batches, seed, batch, data, model_cls, val)


def val_loss(problem: Problem, weights: dict) -> float:
    """The mean loss of a model with ``weights`` on the problem's held-out batches."""
    model = problem.model()
    model.load_state_dict(weights)
    with torch.no_grad():
        return sum(float(model(x, y)) for x, y in problem.val_batches) / len(problem.val_batches)


def at_time(times: Sequence[float], values: Sequence[float], t: float) -> float:
    """``values`` (at the increasing ``times``) linearly interpolated at ``t``; clamped to the
    first / last value outside them."""
    if t <= times[0]:
        return values[0]
    for (t0, v0), (t1, v1) in zip(zip(times, values), zip(times[1:], values[1:])):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1
    return values[-1]


def placement(train_cpu: Optional[int] = None) -> dict[str, Any]:
    """Pin the calling (training) thread to ``train_cpu`` (default: the first allowed core); the
    others are for the pool. Returns what was done, for the JSON."""
    if train_cpu is None:
        train_cpu, worker_cpus = common.split_cores()
    else:
        worker_cpus = [c for c in common.allowed_cpus() if c != train_cpu]
    common.pin_thread(None if train_cpu is None else [train_cpu])
    return {"training_cpu": train_cpu,
            "worker_cpus": common.cpu_list(worker_cpus) if train_cpu is not None else None}


def make_with_wide_mask(factory: Callable):
    """Build an optimizer with the thread on every core: pool threads inherit that mask."""
    with common.unpinned(common.allowed_cpus()):
        return factory()


def async_runtime(args, worker_cpus: Optional[str], staleness: Optional[int] = None,
                  install: str = "deterministic") -> dict[str, Any]:
    rt: dict[str, Any] = {"mode": "async",
                          "staleness": args.staleness if staleness is None else staleness,
                          "install": install, "workers": args.workers}
    if worker_cpus:
        rt["cpuset"] = worker_cpus
    return rt


def make_optimizer(name: str, params, lr: float, args, worker_cpus: Optional[str],
                   runtime: Optional[dict] = None):
    """(optimizer, the exact keyword arguments it got). ``args`` has frequency, staleness,
    workers and heavyball_compile. ``runtime`` overrides an Asteria run's. Third-party imports
    happen here, so a missing library fails only its own run."""
    f = args.frequency
    v = variant(name)
    if v is not None:  # its own f (and S): e.g. native SOAP refreshing every step
        name, f, s = v
        if name.endswith("-async"):
            stale = min(args.staleness if s is None else s, f)
            runtime = runtime or async_runtime(args, worker_cpus, staleness=stale)
    elif policy_run(name) is not None:
        f, keys = policy_run(name)
        runtime = runtime or dict(async_runtime(args, worker_cpus), **keys)
        name = POLICY_BASE
    elif name == "asteria-soap-async-s5":  # Asteria at f with S=5 (at most f)
        runtime = runtime or async_runtime(args, worker_cpus, staleness=min(5, f))
        name = "asteria-soap-async"
    if name == "adamw":
        kw = dict(lr=lr, betas=ADAMW_BETAS, weight_decay=WEIGHT_DECAY)
        return torch.optim.AdamW(params, **kw), kw
    if name.startswith("asteria"):
        rt = runtime or ({"mode": "sync"} if name.endswith("-sync")
                         else async_runtime(args, worker_cpus))
        if name in ("asteria-soap-sync", "asteria-soap-async", "asteria-one-sided-soap-async"):
            kw = dict(SOAP_HP, lr=lr, precondition_frequency=f, max_precond_dim=10000,
                      merge_dims=False, precondition_1d=False, correct_bias=True,
                      normalize_grads=False, runtime=rt)
            cls = asteria.OneSidedSOAP if name == "asteria-one-sided-soap-async" else asteria.SOAP
            return cls(params, **kw), kw
        if name == "asteria-kl-shampoo-async":
            kw = dict(lr=lr, weight_decay=WEIGHT_DECAY, precondition_frequency=f, runtime=rt)
            return asteria.KLShampoo(params, **kw), kw
        if name == "asteria-shampoo-async":
            kw = dict(lr=lr, weight_decay=WEIGHT_DECAY, precondition_frequency=f, runtime=rt)
            return asteria.Shampoo(params, **kw), kw
    if name == "pytorch-optimizer":
        from pytorch_optimizer import SOAP

        kw = dict(SOAP_HP, lr=lr, precondition_frequency=f, max_precondition_dim=10000,
                  merge_dims=False, precondition_1d=False, correct_bias=True,
                  normalize_gradient=False)
        return SOAP(params, **kw), kw
    if name == "heavyball":
        import heavyball
        import heavyball.utils

        if not args.heavyball_compile:
            heavyball.utils.compile_mode = None
        kw = dict(SOAP_HP, lr=lr, precondition_frequency=f, use_precond_schedule=False,
                  max_precond_dim=10000, merge_dims=False, precondition_1d=False,
                  warmup_steps=0)
        return heavyball.SOAP(params, **kw), kw
    raise ValueError(f"unknown optimizer {name!r}; allowed: {', '.join(RUNS)}")


def dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


smooth = common.smooth            # re-exported: bench_third_party and the suite's tests use them
first_reach = common.first_reach


def step_kind(before: dict, after: dict) -> str:
    """What the runtime did in a step, from asteria_stats() around it: "refresh" (REFRESH
    jobs submitted: the refresh's snapshot, or in sync mode the refresh itself; not the
    jobs every step may hand the workers, SOAP's factor EMAs), "install" (a refresh's result
    installed), both, or "plain"."""
    sub = after.get("refreshes_submitted", 0) > before.get("refreshes_submitted", 0)
    ins = after.get("installs", 0) > before.get("installs", 0)
    return "refresh+install" if sub and ins else "refresh" if sub else "install" if ins \
        else "plain"


class Curve:
    """One model's training under ``lr_at`` (the lr of step i set before it), on a
    common.StepLoop (``.loop``), for ``steps`` steps or until ``budget_s`` of the loop's own
    time, or until the trailing-mean loss reaches ``stop_below``. ``result()``: the losses,
    their trailing mean, the loop's own time at each step end (seconds since its first step
    began, bookkeeping included, other loops' turns not), each step's kind (step_kind; None for
    a torch optimizer), step-time statistics after ``warmup``, the training thread's CPU time
    plus barrier waits at each step end, and the CPU use of the machine while it ran."""

    def __init__(self, model, opt, problem: Problem, steps: int, *, window: int, label: str,
                 log: common.Progress, log_every: int, budget_s: Optional[float] = None,
                 warmup: int = 0, lr_at: Optional[Callable[[int], float]] = None,
                 stop_below: Optional[float] = None, val_every: int = 0) -> None:
        self.opt, self.steps, self.window, self.warmup = opt, steps, window, warmup
        self.model, self.val_every = model, val_every
        # (step, the loop's own time, weights) every val_every steps and at the last step
        # (and step 0): the validation losses are computed from them after training, so no
        # worker job of an optimizer overlaps them; a run's time holds only the copy (about
        # a millisecond for the users' model)
        self.snapshots: list = [(0, 0.0, self._weights())] if val_every else []
        self.lr_at, self.stop_below = lr_at, stop_below
        self.job_stretch = 1.0  # its REFRESH jobs' stretch (make_curve, --round-steps)
        self.rounds_s: list[float] = []  # with a stretch: each REFRESH round's measured time
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # training-thread CPU time + barrier waits, cumulative
        self.kinds: list[Optional[str]] = []
        # refresh_policy "drift": the factors' mean basis age after each step end (the bases
        # the next step uses; asteria_stats()' refresh_age_mean)
        self.ages: list[float] = []
        self.stats_fn = getattr(opt, "asteria_stats", None)
        self.last = self.stats_fn() if self.stats_fn is not None else None
        self.loss_sum = 0.0
        if lr_at is not None:
            self._set_lr(0)
        self.loop = common.StepLoop(model, opt, lambda i: problem.batches[i], steps, "cpu",
                                    budget_s=budget_s, log=log, log_every=log_every,
                                    label=label, on_step=self._on_step)

    def _weights(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def val_curve(self, problem: Problem) -> Optional[dict[str, list]]:
        """The held-out loss at each snapshot: {"step", "time_s", "loss"}; None without."""
        if not self.snapshots:
            return None
        out = {"step": [k for k, _, _ in self.snapshots],
               "time_s": [round(t, 5) for _, t, _ in self.snapshots],
               "loss": [round(val_loss(problem, w), 5) for _, _, w in self.snapshots]}
        self.snapshots = []
        return out

    def _set_lr(self, i: int) -> None:
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(i)

    def _on_step(self, i, step_s, opt_s, loss) -> bool:
        self.ends.append(self.loop.clock())
        wait_s = 0.0
        if self.stats_fn is not None:
            now = self.stats_fn()
            self.kinds.append(step_kind(self.last, now))
            rnd = now.get("capacity_measured_round_s")
            if self.job_stretch != 1.0 and rnd and rnd != self.last.get(
                    "capacity_measured_round_s"):
                self.rounds_s.append(rnd)
            wait_s = (now.get("barrier_wait_ns", 0) - self.last.get("barrier_wait_ns", 0)) / 1e9
            if "refresh_age_mean" in now:
                self.ages.append(now["refresh_age_mean"])
            self.last = now
        else:
            self.kinds.append(None)
        self.cpu_ends.append((self.cpu_ends[-1] if self.cpu_ends else 0.0)
                             + self.loop.cpu_s[-1] + wait_s)
        if self.lr_at is not None and i + 1 < self.steps:
            self._set_lr(i + 1)
        ls = self.loop.losses
        self.loss_sum += loss - (ls[-self.window - 1] if len(ls) > self.window else 0.0)
        stop = (self.stop_below is not None
                and self.loss_sum / min(len(ls), self.window) <= self.stop_below)
        if self.val_every and ((i + 1) % self.val_every == 0 or i + 1 == self.steps or stop):
            self.snapshots.append((i + 1, self.ends[-1], self._weights()))
        return stop

    def result(self, cpu: dict) -> dict[str, Any]:
        res = self.loop.result()
        losses = res["losses"]
        return {
            "steps_run": len(losses),
            "stopped_early": res["stopped_early"],
            "stopped_at_target": res["stopped_at_target"],
            "wall_s": self.ends[-1],
            "summary": common.summarize_ms(common.measured(res["step_s"], self.warmup)),
            "opt_summary": common.summarize_ms(common.measured(res["opt_s"], self.warmup)),
            "final_loss": common.final_loss(losses),
            "cpu": cpu,
            "disturbed": (cpu.get("foreign_cores_avg") or 0.0) > DISTURBED_CORES,
            "loadavg1_end": common.loadavg(),
            "time_s": self.ends,
            "cpu_time_s": self.cpu_ends,
            "losses": losses,
            "smoothed": smooth(losses, self.window),
            "step_ms": [1e3 * t for t in res["step_s"]],
            "opt_ms": [1e3 * t for t in res["opt_s"]],
            "minor_faults": res["minor_faults"],
            "step_kinds": self.kinds,
        }


def run_curves(curves: Sequence[Curve], turn: int = common.TURN_STEPS) -> list[dict[str, Any]]:
    """Train the curves, taking turns of ``turn`` steps (common.run_loops); their results,
    each with the machine's CPU use over the whole run."""
    cpu0 = common.cpu_snapshot()
    common.run_loops([c.loop for c in curves], turn)
    cpu = common.cpu_delta(cpu0, common.cpu_snapshot())
    return [c.result(cpu) for c in curves]


def train_curve(model, opt, problem: Problem, steps: int, **kwargs) -> dict[str, Any]:
    """One Curve (its arguments and result), trained alone."""
    return run_curves([Curve(model, opt, problem, steps, **kwargs)])[0]


def close(opt) -> dict[str, Any]:
    """Runtime counters of an Asteria optimizer, then close it ({} for a torch optimizer)."""
    stats = common.runtime_stats(opt)
    if hasattr(opt, "close"):
        opt.close()
    return stats


def time_to_target(run: dict, target: float, adamw_wall: float, n_steps: int,
                   adamw_cpu: Optional[float] = None) -> dict[str, Any]:
    """The first step whose trailing mean reaches ``target``, its wall time and the ratio to
    AdamW's; with ``adamw_cpu`` (and the run's "cpu_time_s") also the same ratio on the
    training thread's CPU time plus barrier waits, which foreign load stretches far less."""
    i = first_reach(run["smoothed"], target)
    if i is None:
        out = {"reached": False, "step": None, "time_s": None, "time_ratio": None,
               "steps_ratio": None}
    else:
        t = run["time_s"][i]
        out = {"reached": True, "step": i + 1, "time_s": t, "time_ratio": t / adamw_wall,
               "steps_ratio": (i + 1) / n_steps}
    if adamw_cpu and run.get("cpu_time_s"):
        c = None if i is None else run["cpu_time_s"][i]
        out.update(cpu_time_s=c, cpu_time_ratio=None if c is None else c / adamw_cpu)
    return out


# ---- this benchmark ------------------------------------------------------------------------------

def _round(xs: Sequence[Optional[float]], nd: int = 5) -> list:
    return [None if x is None else round(x, nd) for x in xs]


def model_optimizer(name: str, model, lr: float, args, worker_cpus: Optional[str]):
    """make_optimizer over all of ``model``'s parameters, one param group."""
    return make_optimizer(name, model.parameters(), lr, args, worker_cpus)


def make_curve(name: str, lr: float, problem: Problem, args, pin: dict, log: common.Progress,
               *, stop_below: Optional[float], budget_s: Optional[float],
               build: Callable = model_optimizer):
    """(Curve, the optimizer's keyword arguments): ``name`` at peak lr ``lr`` under the warm-up
    + cosine schedule, on a fresh model of ``problem``; ``build``: the optimizer factory
    (model_optimizer's arguments and result). A timed run (``stop_below`` None) keeps weight
    copies every ``args.val_every`` steps for its held-out loss (Curve.val_curve)."""
    model = problem.model()
    opt, kw = make_with_wide_mask(lambda: build(name, model, lr, args, pin["worker_cpus"]))
    stretch = getattr(args, "job_stretch", 1.0)
    stretched = common.stretch_refresh_jobs(opt, stretch) > 0
    log(f"run {name} lr {lr:g} seed {problem.seed}"
        + (f" (REFRESH jobs stretched x{stretch:.2f})" if stretched else "")
        + (f" (stops at loss {stop_below:.4f}" if stop_below is not None else "")
        + (f", or after {budget_s:.0f} s)" if budget_s else ")" if stop_below is not None else ""))
    c = Curve(model, opt, problem, args.steps, window=args.window, label=name, log=log,
              log_every=args.log_every, budget_s=budget_s, warmup=args.warmup,
              lr_at=warmup_cosine(lr, args.steps), stop_below=stop_below,
              val_every=getattr(args, "val_every", 0) if stop_below is None else 0)
    if stretched:
        c.job_stretch = stretch
    return c, kw


def full_round_steps(opt) -> Optional[dict[str, Any]]:
    """R of a whole REFRESH round of ``opt``'s factors as its cadence prices it when it
    chooses an "auto" f or drift budget (``Capacity.times_for_f``: the cost model at the rates
    this run measured, or its last measured round of every factor where that is longer) over
    its median step: {"R", "round_s", "step_s"}; None without a worker pool (a torch
    optimizer, mode "sync") or before a step was timed. A "drift" run submits a share of a
    round a step, so its measured rounds (``round_steps``) are that share; this is its R."""
    cad = getattr(opt, "cadence", None)
    if cad is None or not cad.run.is_async:
        return None
    times = cad.capacity.times_for_f(full_round(cad.run, cad.method), 0)
    if times is None:
        return None
    round_s, step_s, _ = times
    return {"R": round_s / step_s, "round_s": round_s, "step_s": step_s}


def refresh_record(kw: dict, stats: Optional[dict],
                   ages: Sequence[float]) -> Optional[dict[str, Any]]:
    """How often a run refreshed each factor and how old the basis a step used was:
    "refreshes_per_factor_per_100" (steps) and "mean_age" / "max_age" in steps, the age of a
    basis at a step end being that step minus its snapshot's step (the basis the next step
    uses; docs/capacity.md, "Refresh per factor"); None for a run without factors (AdamW).
    ``stats``: the run's last asteria_stats() (None for a torch optimizer); ``ages``: its mean
    basis age after each step end (refresh_policy "drift" only).
    "drift": measured, the refreshes started over the step ends and factors, the mean of
    ``ages``. "round": from f and S (the chosen ones of an "auto" run; f = 1, S = 0 in the
    three steps before the choice): every factor refreshed every f steps, installed S steps
    after its snapshot (deterministic install), so its ages run S ... S + f - 1, mean
    S + (f - 1) / 2 (``asteria.plan.expected_ages`` at budget 1/f, d = S); native SOAP (mode
    "sync") and the third-party SOAPs refresh inline: S = 0."""
    f = kw.get("precondition_frequency")
    if f is None:
        return None
    stats = stats or {}
    if stats.get("refresh_policy") == "drift":
        count = sum(stats["refresh_age_hist"].values())
        ends = stats["refresh_step_ends"]
        return {"policy": "drift", "f": f, "budget": stats["refresh_budget"],
                "install_delay": stats["install_delay"],
                "max_age_bound": stats["refresh_max_age"], "factors": count,
                "refreshes_per_factor_per_100": (100.0 * stats["refresh_started"]
                                                 / (ends * count)) if ends and count else None,
                "mean_age": sum(ages) / len(ages) if ages else None,
                "max_age": stats["refresh_age_max_seen"],
                "source": "measured: asteria_stats() after every step end"}
    if f == "auto":
        f = stats.get("frequency_auto_f")
    s = stats.get("staleness", 0) if (kw.get("runtime") or {}).get("mode") == "async" else 0
    if not isinstance(f, int) or not isinstance(s, int):
        return {"policy": "round", "f": f, "S": s, "source": "f or S not chosen"}
    return {"policy": "round", "f": f, "S": s, "refreshes_per_factor_per_100": 100.0 / f,
            "mean_age": s + (f - 1) / 2, "max_age": s + f - 1,
            "source": "from f and S: ages S ... S + f - 1"}


def finish_run(name: str, lr: float, problem: Problem, c: Curve, kw: dict,
               r: dict) -> dict[str, Any]:
    """A trained curve's result with its optimizer's name, lr, seed, keyword arguments, runtime
    counters, state bytes per tier at the end (common.tier_bytes), its refreshes and basis
    ages (refresh_record) and, with a worker pool, a whole round in steps (full_round_steps);
    the optimizer is closed."""
    r["memory"] = common.tier_bytes(c.opt, "cpu")
    r["refresh"] = refresh_record(kw, c.last, c.ages)
    full = full_round_steps(c.opt)
    if full is not None:
        r["full_round"] = full
    stats = close(c.opt)
    if c.job_stretch != 1.0:  # --round-steps: the round in steps this run measured
        r["round_steps"] = dict(common.round_steps(stats, c.rounds_s) or {"R": None},
                                job_stretch=c.job_stretch)
    r["val"] = c.val_curve(problem)
    r.update(optimizer=name, lr=lr, seed=problem.seed,
             kwargs={k: (v if not isinstance(v, tuple) else list(v)) for k, v in kw.items()},
             runtime_counters=common.pick_runtime_counters(stats))
    if name in PIP:
        r["version"] = dist_version(PIP[name])
    for k in ("time_s", "cpu_time_s", "losses", "smoothed", "step_ms", "opt_ms"):
        r[k] = _round(r[k])
    return r


def train_one(name: str, lr: float, problem: Problem, args, pin: dict, log: common.Progress,
              *, stop_below: Optional[float], budget_s: Optional[float],
              make: Callable = make_curve) -> dict[str, Any]:
    """One run of ``name`` at peak lr ``lr``, alone; ``make``: the factory of its Curve
    (make_curve's arguments and result)."""
    c, kw = make(name, lr, problem, args, pin, log, stop_below=stop_below, budget_s=budget_s)
    r = finish_run(name, lr, problem, c, kw, run_curves([c])[0])
    del c
    gc.collect()
    return r


def train_lockstep(names: list, lrs: dict, problem: Problem, args, pin: dict,
                   log: common.Progress, make: Callable = make_curve) -> list[dict[str, Any]]:
    """Every optimizer of ``names`` at its lr, each on its own copy of the model (same initial
    weights and batches), taking turns of common.TURN_STEPS steps for all steps: every
    optimizer's step i runs within seconds of the others', so the machine's drift over
    minutes (docs/step_time_tail.md) reaches all of them alike. Each run's times are its own steps'.
    With stretched REFRESH jobs (--round-steps) they run one after another instead: a
    stretched job holds its worker for wall-clock time, so in turns a round would go on
    through the other runs' turns and end within fewer of its own run's steps than the R
    asked (with six runs in turns of 10 steps, any round under 50 steps long would end before
    the run's next turn)."""
    made = []
    for name in names:
        try:
            made.append((name,) + make(name, lrs[name], problem, args, pin, log,
                                       stop_below=None, budget_s=None))
        except Exception as e:  # a missing library: the others still run
            log(f"run {name}: FAILED: {type(e).__name__}: {e}")
    alone = getattr(args, "job_stretch", 1.0) != 1.0
    log(f"seed {problem.seed}: {', '.join(n for n, _, _ in made)} "
        + ("one after another (stretched REFRESH jobs)" if alone else "in lockstep")
        + f", {args.steps} steps each; load {common.loadavg()}")
    results = run_curves([c for _, c, _ in made], args.steps if alone else common.TURN_STEPS)
    out = [finish_run(name, lrs[name], problem, c, kw, r)
           for (name, c, kw), r in zip(made, results)]
    for r in out:
        if "round_steps" in r:
            log(f"  {r['optimizer']} seed {problem.seed}: {round_steps_line(r['round_steps'])}")
    del made
    gc.collect()
    return out


def sweep_entry(r: dict, target: Optional[float], adamw: Optional[dict],
                steps: int) -> dict[str, Any]:
    e = {"lr": r["lr"], "steps_run": r["steps_run"], "final_loss": r["final_loss"],
         "final_smoothed": r["smoothed"][-1], "wall_s": r["wall_s"],
         "cpu_s": r["cpu_time_s"][-1], "median_step_ms": r["summary"]["median_ms"],
         "foreign_cores_avg": r["cpu"].get("foreign_cores_avg"), "disturbed": r["disturbed"]}
    if "round_steps" in r:
        e["round_steps"] = r["round_steps"]
    if target is not None and adamw:
        e.update(time_to_target(r, target, adamw["wall_s"], steps, adamw["cpu_s"]))
    return e


def best_of(name: str, entries: list[dict]) -> dict:
    """AdamW: the lowest final loss. Others: the fewest steps to the target, then the lowest
    final (smoothed) loss."""
    if name == "adamw":
        return min(entries, key=lambda e: e["final_smoothed"])
    return min(entries, key=lambda e: (e["step"] if e.get("reached") else math.inf,
                                       e["final_smoothed"]))


def extend_grid(name: str, entries: list[dict]) -> Optional[float]:
    """The next lr to try where the best of ``entries`` (best_of) sits at the edge of the lrs
    tried: EXTEND_FACTOR beyond it; None where it is inside them (or nothing ran)."""
    if not entries:
        return None
    lrs = sorted(e["lr"] for e in entries)
    best = best_of(name, entries)["lr"]
    if len(lrs) < 2 or lrs[0] < best < lrs[-1]:
        return None
    return best * EXTEND_FACTOR if best == lrs[-1] else best / EXTEND_FACTOR


def sweep(names: list, problem: Problem, args, pin: dict, log: common.Progress,
          make: Callable = make_curve) -> tuple[dict[str, list], dict[str, float]]:
    """Every optimizer at each lr of its grid, one run after another: (the sweep's entries per
    optimizer, the tuned lr per optimizer). AdamW first, for all steps; the others stop at its
    tuned final loss or at --budget x its time. A grid whose best lr sits at its edge is
    extended (extend_grid) up to --extend times. ``make``: the Curve factory (make_curve)."""
    entries: dict[str, list] = {}
    tuned: dict[str, float] = {}
    target = adamw_ref = None
    for name in ["adamw"] + [n for n in names if n != "adamw"]:
        grid = list(args.grids[name])
        extended = 0
        while grid:
            lr = grid.pop(0)
            stop = None if name == "adamw" else target
            budget = None if name == "adamw" else max(args.budget * adamw_ref["wall_s"],
                                                      MIN_BUDGET_S)
            try:
                r = train_one(name, lr, problem, args, pin, log, stop_below=stop,
                              budget_s=budget, make=make)
            except Exception as e:  # a missing library or a failing step: record, go on
                log(f"run {name} lr {lr:g}: FAILED: {type(e).__name__}: {e}")
                entries.setdefault(name, []).append(
                    {"lr": lr, "seed": problem.seed, "error": f"{type(e).__name__}: {e}"})
                continue
            e = sweep_entry(r, target, adamw_ref, args.steps)
            e["seed"] = problem.seed
            entries.setdefault(name, []).append(e)
            if name != "adamw":
                log(f"  {name} lr {lr:g}: " + (
                    f"reached {target:.4f} at step {e['step']}" if e.get("reached") else
                    f"did not reach {target:.4f} (final {e['final_smoothed']:.4f})"))
            else:
                log(f"  adamw lr {lr:g}: final loss {e['final_smoothed']:.4f}")
            if not grid and extended < args.extend:
                more = extend_grid(name, [x for x in entries.get(name, []) if "error" not in x])
                if more is not None:
                    extended += 1
                    log(f"  {name}: best lr at the grid's edge; trying {more:g}")
                    grid.append(more)
        ok = [e for e in entries.get(name, []) if "error" not in e]
        if not ok:
            if name == "adamw":  # no target: nothing else can be measured
                break
            continue
        tuned[name] = best_of(name, ok)["lr"]
        log(f"  {name}: tuned lr {tuned[name]:g}")
        if name == "adamw":
            best = best_of(name, ok)
            target = best["final_smoothed"]
            adamw_ref = {"wall_s": best["wall_s"], "cpu_s": best["cpu_s"]}
    return entries, tuned


def run_setting(setting: str, args, pin: dict, log: common.Progress) -> dict[str, Any]:
    preset = "tiny" if args.quick else SETTINGS[setting]
    names = args.runs if setting == "users" else args.bound_runs
    seeds = args.seeds if setting == "users" else args.bound_seeds
    problems = {s: build_problem(preset, args.steps, s) for s in seeds}
    info = problems[seeds[0]].describe()
    log(f"setting {setting}: TinyGPT {info['params'] / 1e6:.2f}M params, {info['tokens_per_step']}"
        f" tokens a step = {info['tokens_over_widest']:.0f}x the widest layer "
        f"({info['widest_layer_dim']}); {args.steps} steps; optimizers {', '.join(names)}; "
        f"seeds {seeds}; load {common.loadavg()}")
    args.job_stretch = 1.0
    cal = None
    if setting == "users" and args.round_steps:
        cal = calibrate_round_steps(problems[seeds[0]], names, args, pin, log)
        args.job_stretch = cal["job_stretch"]
    try:
        out = compare(setting, preset, info, names, problems, args, pin, log)
    finally:
        args.job_stretch = 1.0
    if cal is not None:
        out["round_steps"] = cal
    return out


def calibrate_round_steps(problem: Problem, names: list, args, pin: dict,
                          log: common.Progress) -> dict[str, Any]:
    """The host users have, on this machine (--round-steps R): the job stretch k that makes
    a REFRESH round take R steps. R at a stretch is a round's time (submit to its last job's
    end) over the median step (barrier stalls excluded; ``common.round_steps``), measured on
    the first Asteria run of ``names`` with a worker pool (mode "async") that refreshes whole
    rounds at a fixed f (not a POLICY_RUNS one: an "auto" f leaves the steps of its rounds
    open, a "drift" run submits a share of a round a step), at its grid's middle lr, over
    2f + S + 2 steps. First unstretched (R1); then at k1 = R / R1 (R2); a round's time
    is its compute, which the stretch multiplies, plus what it does not (the dispatch, the
    snapshots' submits), so R(k) = a + b k through the two, and k = (R - a) / b (at least 1;
    k1 where R2 does not exceed R1, or where R1 reaches R already). Every Asteria run with a
    worker pool then holds its workers on each REFRESH job k x its compute
    (``common.stretch_refresh_jobs``): a host 1/k as fast, with the same GPU-side step. Runs
    without a pool (native SOAP in mode "sync", the third-party SOAPs) refresh inline, at the
    core's full speed, as a GPU would in the step. Each stretched run records the R it
    measured ("round_steps" of its result)."""
    want = args.round_steps
    for name in names:
        if not name.startswith("asteria") or policy_run(name) is not None:
            continue
        grid = sorted(args.grids[name])
        lr = grid[len(grid) // 2]
        passes = []
        for k in (1.0, None):
            if k is None:  # the second pass, at the first one's estimate
                if passes[0]["R"] >= want:
                    break
                k = want / passes[0]["R"]
            got = _calibration_pass(name, lr, k, problem, args, pin, log)
            if got is None:  # a sync run: nothing to stretch
                break
            passes.append(got)
        if not passes:
            continue
        if len(passes) == 1:
            k = 1.0
        else:
            (r1, _), (r2, k1) = [(p["R"], p["job_stretch"]) for p in passes]
            b = (r2 - r1) / (k1 - 1.0)
            k = max(1.0, (want - (r1 - b)) / b) if b > 0 else k1
        log(f"  job stretch x{k:.2f}")
        return {"asked": want, "job_stretch": k, "calibrated_on": name,
                "calibration_lr": lr, "passes": passes, "stretched_ops": common.refresh_ops(),
                "rule": "R(k) = a + b k through an unstretched pass and one at R / R(1); "
                        "k = (R - a) / b, at least 1; each stretched run's R: the median of "
                        "its measured rounds over its median step"}
    raise ValueError(f"--round-steps: no Asteria run with a worker pool (mode 'async') and a "
                     f"fixed f among {', '.join(names)}; add one, e.g. asteria-soap-async-f10-s10")


def _calibration_pass(name: str, lr: float, k: float, problem: Problem, args, pin: dict,
                      log: common.Progress) -> Optional[dict[str, Any]]:
    """One pass of calibrate_round_steps: ``name`` at lr ``lr`` with its REFRESH jobs stretched
    ``k``x, 2f + S + 2 steps; ``common.round_steps`` of its last measured round, with the
    stretch and the steps. None for a run without a worker pool."""
    model = problem.model()
    opt, kw = make_with_wide_mask(lambda: model_optimizer(name, model, lr, args,
                                                          pin["worker_cpus"]))
    rt = kw.get("runtime") or {}
    if rt.get("mode") != "async":
        close(opt)
        return None
    common.stretch_refresh_jobs(opt, k)
    steps = min(len(problem.batches),
                2 * kw["precondition_frequency"] + int(rt.get("staleness") or 0) + 2)
    log(f"--round-steps {args.round_steps:g}: calibrating on {name} lr {lr:g}, {steps} steps, "
        f"REFRESH jobs stretched x{k:.2f}")
    c = Curve(model, opt, problem, steps, window=args.window, label=f"{name} (calibration)",
              log=log, log_every=args.log_every, lr_at=warmup_cosine(lr, args.steps))
    run_curves([c])
    got = common.round_steps(close(opt))
    if got is None:
        raise RuntimeError(f"--round-steps: {name} measured no REFRESH round in {steps} steps; "
                           f"give more --steps")
    log(f"  last round {got['round_s'] * 1e3:.1f} ms = R {got['R']:.2f} steps of "
        f"{got['step_s'] * 1e3:.1f} ms")
    return dict(got, job_stretch=k, steps=steps)


def round_steps_line(rs: dict) -> str:
    """A stretched run's measured round in words (its result's "round_steps")."""
    if rs.get("R") is None:
        return f"no REFRESH round measured (job stretch x{rs['job_stretch']:.2f})"
    return (f"a REFRESH round took R = {rs['R']:.1f} steps ({rs['round_s']:.2f} s over a "
            f"median step of {rs['step_s'] * 1e3:.1f} ms) at job stretch "
            f"x{rs['job_stretch']:.2f}")


def compare(setting: str, preset: str, info: dict, names: list, problems: dict, args,
            pin: dict, log: common.Progress, make: Callable = make_curve) -> dict[str, Any]:
    """The procedure of the module's docstring on ``problems`` ({seed: Problem}, the first
    seed sweeps): the lr sweep, the timed lockstep runs per seed, each optimizer's time to
    tuned AdamW's final loss. ``make``: the Curve factory (make_curve)."""
    seeds = list(problems)
    if getattr(args, "no_sweep", False):  # the lrs of an earlier sweep, one per optimizer
        entries, tuned = {}, {n: args.grids[n][0] for n in names}
        log("no sweep: " + ", ".join(f"{n} at lr {lr:g}" for n, lr in tuned.items()))
    else:
        entries, tuned = sweep(names, problems[seeds[0]], args, pin, log, make)
    runs: list[dict] = []         # the timed runs at the tuned lrs, every seed
    per_seed: dict[int, dict] = {}
    timed = [n for n in names if n in tuned]
    for seed in seeds if "adamw" in tuned else []:
        rs = train_lockstep(timed, tuned, problems[seed], args, pin, log, make)
        runs += rs
        adamw = next((r for r in rs if r["optimizer"] == "adamw"), None)
        if adamw is None:
            continue
        target, adamw_wall = adamw["smoothed"][-1], adamw["wall_s"]
        per_seed[seed] = {"target": target, "adamw_wall_s": adamw_wall,
                          "adamw_cpu_s": adamw["cpu_time_s"][-1],
                          "adamw_steps": adamw["steps_run"], "runs": {}}
        # the held-out loss of every run at AdamW's own time for all its steps (each run's
        # weights at that point of its own clock, interpolated between snapshots)
        per_seed[seed]["val_at_adamw_time"] = {
            r["optimizer"]: round(at_time(r["val"]["time_s"], r["val"]["loss"], adamw_wall), 5)
            for r in rs if r.get("val")}
        per_seed[seed]["val_final"] = {r["optimizer"]: r["val"]["loss"][-1]
                                       for r in rs if r.get("val")}
        for r in rs:
            if r["optimizer"] == "adamw":
                continue
            tt = time_to_target(r, target, adamw_wall, args.steps, adamw["cpu_time_s"][-1])
            per_seed[seed]["runs"][r["optimizer"]] = tt
            log(f"  seed {seed} {r['optimizer']}: " + (
                f"reached {target:.4f} at step {tt['step']}, {tt['time_s']:.1f} s = "
                f"{tt['time_ratio']:.3f}x AdamW" if tt["reached"] else
                f"did not reach {target:.4f} (final {r['smoothed'][-1]:.4f})"))
    return {"setting": setting, "preset": preset, "model": info, "seeds": seeds,
            "optimizers": names, "grids": {n: list(args.grids[n]) for n in names},
            "tuned_lr": tuned,
            "tuned_at_grid_edge": {n: lr in (min(args.grids[n]), max(args.grids[n]))
                                   for n, lr in tuned.items()},
            "lrs_tried": {n: sorted(e["lr"] for e in es if "error" not in e)
                          for n, es in entries.items()},
            "tuned_at_edge_of_lrs_tried": {
                n: lr in (min(e["lr"] for e in entries[n] if "error" not in e),
                          max(e["lr"] for e in entries[n] if "error" not in e))
                for n, lr in tuned.items() if n in entries},
            "final_loss_at_equal_steps": {n: {str(r["seed"]): r["smoothed"][-1] for r in runs
                                              if r["optimizer"] == n} for n in timed},
            "sweep": entries, "time_to_adamw_final": per_seed,
            "ratios": ratio_summary(per_seed, names), "runs": runs}


def ratio_summary(per_seed: dict, names: list) -> dict[str, Any]:
    """Per optimizer: time ratio and steps ratio per seed, their mean, min and max."""
    out = {}
    for name in names:
        if name == "adamw":
            vs = [per_seed[s].get("val_at_adamw_time", {}).get(name) for s in per_seed]
            gv = [x for x in vs if x is not None]
            out[name] = {"val_at_adamw_time_per_seed": vs,
                         "val_at_adamw_time_mean": sum(gv) / len(gv) if gv else None}
            continue
        tr = [per_seed[s]["runs"].get(name, {}).get("time_ratio") for s in per_seed]
        sr = [per_seed[s]["runs"].get(name, {}).get("steps_ratio") for s in per_seed]
        got = [x for x in tr if x is not None]
        gs = [x for x in sr if x is not None]
        cr = [per_seed[s]["runs"].get(name, {}).get("cpu_time_ratio") for s in per_seed]
        gc_ = [x for x in cr if x is not None]
        vs = [per_seed[s].get("val_at_adamw_time", {}).get(name) for s in per_seed]
        gv = [x for x in vs if x is not None]
        out[name] = {"time_ratio_per_seed": tr, "steps_ratio_per_seed": sr,
                     "val_at_adamw_time_per_seed": vs,
                     "val_at_adamw_time_mean": sum(gv) / len(gv) if gv else None,
                     "cpu_time_ratio_per_seed": cr,
                     "cpu_time_ratio_mean": sum(gc_) / len(gc_) if gc_ else None,
                     "reached_all_seeds": bool(tr) and len(got) == len(tr),
                     "time_ratio_mean": sum(got) / len(got) if got else None,
                     "time_ratio_min": min(got) if got else None,
                     "time_ratio_max": max(got) if got else None,
                     "steps_ratio_mean": sum(gs) / len(gs) if gs else None}
    return out


# ---- step against its limit ----------------------------------------------------------------------

def precond_shapes(problem: Problem, max_dim: int = 10000) -> list[tuple[int, int]]:
    """(m, n) of each matrix SOAP preconditions on both sides (every 2-D parameter here)."""
    return [tuple(p.shape) for p in problem.model().parameters()
            if p.dim() == 2 and max(p.shape) <= max_dim]


def added_flops(mats: Sequence[tuple[int, int]]) -> float:
    """The FLOPs SOAP adds to a step: 6 m n (m + n) per m x n preconditioned matrix."""
    return sum(6.0 * m * n * (m + n) for m, n in mats)


def rotation_shapes(mats: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """The (m, k, n) GEMM shapes of those matrices' rotations, for ``gemm_rate``."""
    return sorted({(m, m, n) for m, n in mats} | {(m, n, n) for m, n in mats})


def flop_ms(flops: float, gflops: float) -> float:
    """Milliseconds ``flops`` take at ``gflops`` GFLOP/s."""
    return 1e3 * flops / (gflops * 1e9)


def gemm_rate(shapes: Sequence[tuple[int, int, int]], reps: int) -> dict[str, Any]:
    """Single-thread float32 GEMM rate (torch.mm, on the calling thread's core), best of
    ``reps`` per shape (m, k, n): GFLOP/s per shape and over all of them together."""
    torch.set_num_threads(1)
    per, flops, best_total = [], 0.0, 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        c = torch.empty(m, n)
        for _ in range(2):
            torch.mm(a, b, out=c)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b, out=c)
            ts.append(time.perf_counter() - t0)
        f = 2.0 * m * k * n
        per.append({"m": m, "k": k, "n": n, "gflops_best": f / min(ts) / 1e9,
                    "gflops_median": f / common.percentile(ts, 50) / 1e9})
        flops += f
        best_total += min(ts)
    return {"shapes": per, "gflops_all": flops / best_total / 1e9}


def step_limit(users: dict, args, log: common.Progress) -> Optional[dict[str, Any]]:
    """Asteria-SOAP's step against AdamW's step + SOAP's added FLOPs at the measured GEMM
    rate; and its mean step without a refresh against native sync SOAP's median."""
    by = {}
    for r in users["runs"]:
        by.setdefault(r["optimizer"], []).append(r)
    if "adamw" not in by or "asteria-soap-async" not in by:
        return None
    w = args.warmup

    def steps_of(name, keep=lambda kind: True):
        return [t for r in by.get(name, []) for t, kind in
                zip(r["step_ms"][w:], r["step_kinds"][w:]) if keep(kind)]

    def opt_of(name):
        return [t for r in by.get(name, []) for t in r["opt_ms"][w:]]

    problem = build_problem(users["preset"], 1, users["seeds"][0])
    mats = precond_shapes(problem)
    added = added_flops(mats)
    rot = rotation_shapes(mats)
    log(f"GEMM rate on the training core: {len(rot)} rotation shapes and 512^3, 1024^3")
    rate_rot = gemm_rate(rot, args.gemm_reps)
    rate_sq = gemm_rate([(512, 512, 512), (1024, 1024, 1024)], args.gemm_reps)
    peak = max(s["gflops_best"] for s in rate_rot["shapes"] + rate_sq["shapes"])
    adamw = common.percentile(steps_of("adamw"), 50)
    soap_all = steps_of("asteria-soap-async")
    soap = common.percentile(soap_all, 50)
    soap_mean = sum(soap_all) / len(soap_all)
    out: dict[str, Any] = {
        "preconditioned_matrices": [list(s) for s in mats],
        "added_flops_per_step": added,
        "added_flops_formula": "6 m n (m + n) per m x n matrix: Q_L^T G Q_R, its inverse "
                               "rotation of the update, G G^T and G^T G",
        "gemm_rate_rotation_shapes": rate_rot, "gemm_rate_square": rate_sq,
        "gemm_gflops_peak": peak,
        "adamw_step_median_ms": adamw, "asteria_soap_step_median_ms": soap,
        "asteria_soap_step_mean_ms": soap_mean,
        "adamw_opt_median_ms": common.percentile(opt_of("adamw"), 50),
        "asteria_soap_opt_median_ms": common.percentile(opt_of("asteria-soap-async"), 50),
        "runs_used": {n: [(r["lr"], r["seed"]) for r in rs] for n, rs in by.items()},
    }
    out["flop_ms_at_peak"] = flop_ms(added, peak)  # the FLOP time every limit here adds
    for key, rate in (("rotation_shapes", rate_rot["gflops_all"]), ("peak", peak)):
        limit = adamw + flop_ms(added, rate)
        out[f"limit_ms_at_{key}_rate"] = limit
        out[f"step_median_over_limit_{key}"] = soap / limit
        out[f"step_mean_over_limit_{key}"] = soap_mean / limit
    # the target: the median step against the limit at the peak rate (the stricter limit)
    out["step_over_limit"] = out["step_median_over_limit_peak"]
    def fb_of(name):
        return [s - o for r in by[name] for s, o in zip(r["step_ms"][w:], r["opt_ms"][w:])]

    fb = fb_of("asteria-soap-async")
    out["asteria_fwd_bwd_median_ms"] = common.percentile(fb, 50)
    out["adamw_fwd_bwd_median_ms"] = common.percentile(fb_of("adamw"), 50)
    # the same with Asteria's own forward + backward in place of AdamW's: the models' weights
    # differ after a few steps and a forward / backward's time depends on them, so the limit
    # above can flatter (or wrong) a SOAP; this one compares optimizer work only
    equal = common.percentile(fb, 50) + out["adamw_opt_median_ms"] + out["flop_ms_at_peak"]
    out["limit_equal_fwd_bwd_ms"] = equal
    out["step_over_limit_equal_fwd_bwd"] = soap / equal
    nonref = steps_of("asteria-soap-async", lambda k: k not in ("refresh", "refresh+install"))
    plain = steps_of("asteria-soap-async", lambda k: k == "plain")
    out["asteria_nonrefresh_steps"] = len(nonref)
    out["asteria_nonrefresh_mean_ms"] = sum(nonref) / len(nonref) if nonref else None
    out["asteria_plain_mean_ms"] = sum(plain) / len(plain) if plain else None
    sync = steps_of("asteria-soap-sync")
    if sync and nonref:
        out["native_sync_median_ms"] = common.percentile(sync, 50)
        out["nonrefresh_mean_over_sync_median"] = (out["asteria_nonrefresh_mean_ms"]
                                                   / out["native_sync_median_ms"])
    return out


#: the torch ops that are a step's matrix products (SOAP's rotations, update and factor EMAs)
MATMUL_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::addmm_", "aten::baddbmm",
              "aten::baddbmm_")


def profile_steps(problem: Problem, args, pin: dict, log: common.Progress, tuned: dict,
                  flops: Optional[float] = None) -> dict[str, Any]:
    """Where the optimizer step's time goes: torch.profiler around ``opt.step()`` alone, on
    ``args.profile_steps`` plain steps (no refresh, no install: the steps the median step is)
    after 12 unprofiled ones, of AdamW and Asteria SOAP. Per step: the matrix products' self
    CPU time (``MATMUL_OPS``), the other torch ops' (elementwise, stacking, the finiteness
    check), the interpreter's (the step's own self time: Python between the ops), and the top
    ops. With ``flops`` (SOAP's added FLOPs a step), the GEMM rate the step's products ran
    at, where they ran (operands cold from the forward and backward), against the warm rate
    the limit takes. The profiler's own cost inflates every figure a little (see
    ``opt_ms_profiled`` against ``opt_ms_unprofiled``)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in ("adamw", "asteria-soap-async"):
        model = problem.model()
        opt, _ = make_with_wide_mask(lambda: make_optimizer(
            name, model.parameters(), tuned.get(name, 3e-3), args, pin["worker_cpus"]))
        stats = getattr(opt, "asteria_stats", lambda: {})
        agg: dict[str, list[float]] = {}
        walls, plain_walls, n, i = [], [], 0, 0
        step_self = 0.0
        while n < args.profile_steps and i < len(problem.batches):
            opt.zero_grad(set_to_none=True)
            model(*problem.batches[i]).backward()
            before = stats()
            if i < 12 or i % 2:  # unprofiled: warm-up, and every other step for the plain time
                t0 = time.perf_counter()
                opt.step()
                t = time.perf_counter() - t0
                if i >= 12 and step_kind(before, stats()) == "plain":
                    plain_walls.append(t)
                i += 1
                continue
            # one profiler per step (only plain steps are kept); torch warns that each one's
            # events end with it, which is what is wanted here
            with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU]) as prof:
                warnings.filterwarnings("ignore", message="Warning: Profiler clears events")
                t0 = time.perf_counter()
                opt.step()
                t = time.perf_counter() - t0
            i += 1
            if step_kind(before, stats()) != "plain":
                continue
            n += 1
            walls.append(t)
            for e in prof.key_averages():
                if e.key.startswith("Optimizer.step#"):
                    step_self += e.self_cpu_time_total
                    continue
                a = agg.setdefault(e.key, [0.0, 0])
                a[0] += e.self_cpu_time_total
                a[1] += e.count
        close(opt)
        if not n:
            continue
        ms = {k: (v[0] / 1e3 / n, v[1] / n) for k, v in agg.items()}
        matmul = sum(t for k, (t, _) in ms.items() if k in MATMUL_OPS)
        other = sum(t for k, (t, _) in ms.items() if k not in MATMUL_OPS)
        rows = sorted(ms.items(), key=lambda kv: -kv[1][0])
        r: dict[str, Any] = {
            "plain_steps_profiled": n,
            "opt_ms_profiled": common.percentile([1e3 * t for t in walls], 50),
            "opt_ms_unprofiled": (common.percentile([1e3 * t for t in plain_walls], 50)
                                  if plain_walls else None),
            "matmul_ms": matmul, "other_ops_ms": other, "interpreter_ms": step_self / 1e3 / n,
            "top": [{"op": k, "calls_per_step": c, "self_cpu_ms_per_step": t}
                    for k, (t, c) in rows[:15]]}
        if flops and matmul > 0 and name != "adamw":
            r["matmul_gflops_in_step"] = flops / (matmul * 1e6)
        out[name] = r
        log(f"profile {name} ({n} plain steps): opt {r['opt_ms_profiled']:.1f} ms profiled = "
            f"matmul {matmul:.1f} + other ops {other:.1f} + interpreter "
            f"{r['interpreter_ms']:.1f}; top: " + ", ".join(
                f"{t['op']} {t['self_cpu_ms_per_step']:.2f}" for t in r["top"][:4]))
    return out


def breakdown(limit: dict, prof: dict) -> None:
    """Where Asteria-SOAP's step goes beyond its limit, into ``limit["excess"]`` (ms a step):
    its forward + backward over AdamW's (medians: weights differ, so do their times), and its
    optimizer step over AdamW's + the FLOP time, split by the profile of plain steps into the
    matrix products' time over the FLOP time at the peak rate, the other torch ops' and the
    interpreter's over AdamW's."""
    a, s = prof.get("adamw"), prof.get("asteria-soap-async")
    at_peak = limit["flop_ms_at_peak"]
    out: dict[str, Any] = {
        "step_over_limit_ms": (limit["asteria_soap_step_median_ms"]
                               - limit["limit_ms_at_peak_rate"]),
        "fwd_bwd_over_adamw_ms": (limit["asteria_fwd_bwd_median_ms"]
                                  - limit["adamw_fwd_bwd_median_ms"]),
        "opt_over_adamw_plus_flops_ms": (limit["asteria_soap_opt_median_ms"]
                                         - limit["adamw_opt_median_ms"] - at_peak),
        "flop_ms_at_peak": at_peak}
    if a and s:
        out["profiled"] = {
            "matmul_over_flop_time_ms": s["matmul_ms"] - a["matmul_ms"] - at_peak,
            "other_ops_over_adamw_ms": s["other_ops_ms"] - a["other_ops_ms"],
            "interpreter_over_adamw_ms": s["interpreter_ms"] - a["interpreter_ms"],
            "matmul_gflops_in_step": s.get("matmul_gflops_in_step")}
        rate = s.get("matmul_gflops_in_step")
        if rate:
            lim = limit["adamw_step_median_ms"] + flop_ms(limit["added_flops_per_step"], rate)
            limit["limit_ms_at_in_step_rate"] = lim
            limit["step_median_over_limit_in_step_rate"] = (limit["asteria_soap_step_median_ms"]
                                                            / lim)
    limit["excess"] = out


def targets(users: Optional[dict], limit: Optional[dict]) -> dict[str, Any]:
    def check(value, threshold, op, note):
        met = None if value is None else (value <= threshold if op == "<=" else value < threshold)
        return {"value": value, "threshold": threshold, "op": op, "met": met, "note": note}

    r = (users or {}).get("ratios", {})
    soap = r.get("asteria-soap-async", {})
    v = soap.get("time_ratio_max")
    out = {"soap_async_time_ratio": check(
        v, TARGETS["time_ratio_max"], "<=",
        "Asteria-SOAP async time to tuned AdamW's final loss / AdamW's time, the worst seed")}
    for other in ("asteria-soap-sync", "pytorch-optimizer", "heavyball"):
        o = r.get(other, {})
        mine, theirs = soap.get("time_ratio_mean"), o.get("time_ratio_mean")
        if other in r:
            val = None if mine is None else (mine / theirs if theirs else 0.0)
            out[f"soap_async_faster_than_{other}"] = check(
                val, 1.0, "<", f"Asteria-SOAP's mean time ratio / {other}'s (0: {other} "
                               f"never reached the target)")
    lim = limit or {}
    out["step_over_limit"] = check(
        lim.get("step_over_limit"), TARGETS["step_over_limit_max"], "<=",
        "median Asteria-SOAP step / (AdamW median step + SOAP's added FLOPs at the peak "
        "single-thread GEMM rate)")
    out["nonrefresh_mean_over_sync_median"] = check(
        lim.get("nonrefresh_mean_over_sync_median"),
        TARGETS["nonrefresh_mean_over_sync_median_max"], "<=",
        "Asteria-SOAP mean step on steps without a refresh / native sync SOAP's median step")
    return out


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    for pkg in ("pytorch-optimizer", "heavyball"):
        meta["versions"][pkg] = dist_version(pkg)
    torch.set_num_threads(args.threads)
    pin = placement()
    cpu0 = common.cpu_snapshot()
    settings = {}
    for s in args.settings:
        settings[s] = run_setting(s, args, pin, log)
    users = settings.get("users")
    limit = step_limit(users, args, log) if users else None
    prof = None
    if users and args.profile_steps > 0:
        prof = profile_steps(build_problem(users["preset"], 12 + 4 * args.profile_steps,
                                           users["seeds"][0]), args, pin, log,
                             users["tuned_lr"],
                             limit["added_flops_per_step"] if limit else None)
        if limit:
            breakdown(limit, prof)
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    meta["cpu"] = common.cpu_delta(cpu0, common.cpu_snapshot())
    data = {
        **meta,
        "settings": {"steps": args.steps, "warmup": args.warmup, "val_every": args.val_every,
                     "frequency": args.frequency,
                     "staleness": args.staleness, "install": "deterministic",
                     "workers": args.workers, "torch_threads": args.threads,
                     "round_steps": args.round_steps,
                     "schedule": SCHEDULE,
                     "adamw_betas": list(ADAMW_BETAS), "soap_hp": SOAP_HP,
                     "weight_decay": WEIGHT_DECAY, "quick": args.quick,
                     "smoothing": f"trailing mean over {args.window} steps",
                     "window": args.window, "budget_x_adamw": args.budget,
                     "pinning": pin, "heavyball_compile": args.heavyball_compile,
                     "lr_choice": ("the one lr given per optimizer (--no-sweep: the tuned lr "
                                   "of an earlier sweep)" if args.no_sweep else
                                   "AdamW: lowest final loss on seed 0; others: fewest steps to "
                                   "AdamW's final loss on seed 0 (then lowest loss)"),
                     "sweep": not args.no_sweep,
                     "time_axis": "the run's own seconds (its steps and their bookkeeping, "
                                  "not the other runs' turns in lockstep) from the start of its "
                                  "first step to the end of each step (batches prepared "
                                  "beforehand)",
                     "timed_runs": ("every optimizer at its tuned lr, one after another "
                                    "(stretched REFRESH jobs: --round-steps)"
                                    if args.round_steps else
                                    "every optimizer at its tuned lr, in lockstep (turns of "
                                    f"{common.TURN_STEPS} consecutive steps)")
                                   + ", all steps, per seed; the sweep's times are those "
                                     "of separate runs, one after another",
                     "disturbed_if_foreign_cores_above": DISTURBED_CORES},
        "why_settings_differ": WHY_SETTINGS_DIFFER,
        "setting_results": settings,
        "step_limit": limit,
        "profile": prof,
        "targets": targets(users, limit),
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


COLORS = {"adamw": "tab:gray", "asteria-soap-async": "tab:blue",
          "asteria-one-sided-soap-async": "tab:brown",
          "asteria-kl-shampoo-async": "tab:purple", "asteria-shampoo-async": "tab:olive",
          "asteria-soap-sync": "tab:red", "asteria-soap-sync-f1": "tab:pink",
          "asteria-soap-async-s5": "tab:cyan", "pytorch-optimizer": "tab:orange",
          "heavyball": "tab:green"}


def plot_timed_runs(ax, s: dict, smoothing: str, colors: dict, title: str = "") -> int:
    """On ``ax``: the timed runs of compare() result ``s``' first seed, loss against time,
    and tuned AdamW's final loss; ``title`` goes before the panel's own. Returns the seed."""
    seed = s["seeds"][0]
    tt = s["time_to_adamw_final"].get(str(seed)) or s["time_to_adamw_final"].get(seed)
    for r in s["runs"]:
        if r["seed"] == seed:
            ax.plot(r["time_s"], r["smoothed"], color=colors.get(r["optimizer"]), lw=1.3,
                    label=f"{r['optimizer']} (lr {r['lr']:g})")
    if tt:
        ax.axhline(tt["target"], color="k", ls=":", lw=1, label="tuned AdamW's final loss")
    ax.set(xlabel="time (s): the run's own steps (in lockstep: not the others' turns)",
           ylabel=f"train loss ({smoothing})",
           title=f"{title}timed runs at the tuned lrs, seed {seed}")
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.legend(fontsize=7)
    return seed


def plot_steps_by_age(ax, s: dict) -> None:
    """On ``ax``: each timed run of compare() result ``s`` (every seed), its steps to the
    seed's target against the mean age of the basis its steps used (refresh_record)."""
    marks = "osD^v"
    for r in s["runs"]:
        rec = r.get("refresh") or {}
        tt = s["time_to_adamw_final"].get(r["seed"]) or s["time_to_adamw_final"].get(
            str(r["seed"])) or {}
        step = tt.get("runs", {}).get(r["optimizer"], {}).get("step")
        if rec.get("mean_age") is None or step is None:
            continue
        i = s["seeds"].index(r["seed"])
        ax.plot([rec["mean_age"]], [step], marks[i % len(marks)],
                color=COLORS.get(r["optimizer"], POLICY_COLORS.get(r["optimizer"])),
                label=f"{r['optimizer']}, seed {r['seed']}", ms=6)
    ax.set(xlabel="mean age of the basis a step uses (steps)",
           ylabel="steps to tuned AdamW's final loss",
           title=f"{s['setting']}: steps to the target against the basis's age")


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    sets = data["setting_results"]
    first = sets.get("users") or next(iter(sets.values()))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 5.2))
    seed = plot_timed_runs(a, first, data["settings"]["smoothing"], COLORS,
                           f"{first['setting']}: ")
    kinds = [(sname, s, key) for sname, s in sets.items() for key in ("time", "cpu_time")]
    width = 0.8 / len(kinds)
    names = [n for n in first["optimizers"] if n != "adamw"]
    for k, (sname, s, key) in enumerate(kinds):
        xs, ys, lo, hi = [], [], [], []
        for i, n in enumerate(names):
            q = s["ratios"].get(n)
            per = [x for x in (q or {}).get(f"{key}_ratio_per_seed", []) if x is not None]
            if not per:
                continue
            mean = sum(per) / len(per)
            xs.append(i + (k - (len(kinds) - 1) / 2) * width)
            ys.append(mean)
            lo.append(mean - min(per))
            hi.append(max(per) - mean)
        what = "own time" if key == "time" else "thread CPU + barrier"
        b.bar(xs, ys, width, yerr=[lo, hi], capsize=3, hatch="" if key == "time" else "//",
              label=f"{sname}, {what} ({s['model']['tokens_per_step']} tokens/step)")
    b.axhline(1.0, color="k", lw=0.8)
    b.axhline(TARGETS["time_ratio_max"], color="tab:blue", ls="--", lw=0.8,
              label=f"target {TARGETS['time_ratio_max']}")
    b.set_xticks(range(len(names)), [n.replace("asteria-", "") for n in names], rotation=25,
                 fontsize=8)
    b.set(ylabel="time to tuned AdamW's final loss / AdamW's time",
          title="Time ratio (bar: mean over seeds, whiskers: range; none: not reached)")
    b.legend(fontsize=7)
    for n, entries in first["sweep"].items():
        ok = [e for e in entries if "error" not in e and e["seed"] == seed]
        if n == "adamw" or not ok:
            continue
        c.plot([e["lr"] for e in ok],
               [e["step"] if e.get("reached") else e["steps_run"] * 1.05 for e in ok],
               "o-", color=COLORS.get(n), label=n, ms=4)
    if first["sweep"]:
        c.axhline(data["settings"]["steps"], color="k", ls=":", lw=0.8,
                  label="AdamW's steps (above: not reached)")
        c.set(xscale="log", xlabel="peak lr", ylabel="steps to tuned AdamW's final loss",
              title=f"{first['setting']}: lr sweep (seed {seed}); AdamW tuned lr "
                    f"{first['tuned_lr'].get('adamw', float('nan')):g}")
    else:  # --no-sweep: what the refresh policies gave, steps against the basis's age
        plot_steps_by_age(c, first)
    c.legend(fontsize=7)
    m = first["model"]
    common.save_figure(fig, (a, b, c), path,
                       f"{m['params'] / 1e6:.2f}M-param TinyGPT, {m['tokens_per_step']} "
                       f"tokens/step ({m['tokens_over_widest']:.1f}x widest layer), "
                       f"f={data['settings']['frequency']}, S={data['settings']['staleness']}",
                       data["machine"], legend=False)


POLICY_COLORS = {"asteria-soap-async-auto": "tab:purple", "asteria-soap-drift": "tab:green"}
NAME_W = max(len(n) for n in RUNS) + 2  # the table's optimizer column


def table_rows(s: dict) -> Iterator[tuple[str, dict[str, Any]]]:
    """(optimizer, its table cells) of a compare() result ``s``, in its optimizers' order.
    Cells: "failed" (the sweep's errors) where no lr was tuned; otherwise "lr", "median_ms"
    (median over the timed runs), "steps" (to tuned AdamW's final loss per seed; AdamW's own
    count), "finals" (final loss per seed), and beside AdamW "ratios" (s["ratios"]' entry) and
    "per" (time ratio per seed)."""
    meds: dict[str, list] = {}
    for r in s["runs"]:
        meds.setdefault(r["optimizer"], []).append(r["summary"]["median_ms"])
    for name in s["optimizers"]:
        if name not in s["tuned_lr"]:
            yield name, {"failed": "; ".join(e.get("error", "")
                                             for e in s["sweep"].get(name, []))[:90]}
            continue
        med = common.percentile(meds[name], 50) if name in meds else None
        cells = {"lr": s["tuned_lr"][name], "median_ms": common.fmt(med, ".1f"),
                 "finals": "/".join(common.fmt(v, ".4f") for v in
                                    s.get("final_loss_at_equal_steps", {}).get(name, {})
                                    .values())}
        val = s["ratios"].get(name, {}).get("val_at_adamw_time_per_seed") or []
        cells["val"] = "/".join(common.fmt(v, ".4f") for v in val)
        if name == "adamw":
            cells["steps"] = "/".join(str(v["adamw_steps"])
                                      for v in s["time_to_adamw_final"].values())
        else:
            q = cells["ratios"] = s["ratios"][name]
            cells["steps"] = "/".join(common.fmt(v["runs"].get(name, {}).get("step"), "d")
                                      for v in s["time_to_adamw_final"].values())
            cells["per"] = "/".join(common.fmt(x, ".2f") for x in q["time_ratio_per_seed"])
        yield name, cells


def print_table(data: dict) -> None:
    for sname, s in data["setting_results"].items():
        m = s["model"]
        print(f"{sname}: {m['tokens_per_step']} tokens/step, {m['tokens_over_widest']:.1f}x the "
              f"widest layer; seeds {s['seeds']}")
        common.print_header(
            f"{'optimizer':<{NAME_W}}{'lr':>8}{'median ms':>11}{'steps to target':>18}"
            f"{'time ratio (per seed)':>26}{'mean':>7}{'cpu ratio':>11}"
            f"{'final loss (per seed)':>24}{'held-out at AdamW time':>25}")
        for name, c in table_rows(s):
            if "failed" in c:
                print(f"{name:<{NAME_W}}  FAILED: " + c["failed"])
                continue
            head = f"{name:<{NAME_W}}{c['lr']:>8g}{c['median_ms']:>11}{c['steps']:>18}"
            if name == "adamw":
                print(f"{head}{'1 (target: final loss)':>26}{'':>18}{c['finals']:>24}"
                      f"{c['val']:>25}")
                continue
            q = c["ratios"]
            print(f"{head}{c['per']:>26}{common.fmt(q['time_ratio_mean'], '.2f'):>7}"
                  f"{common.fmt(q['cpu_time_ratio_mean'], '.2f'):>11}{c['finals']:>24}"
                  f"{c['val']:>25}")
        print("(time ratio: own time (in lockstep; with --round-steps one run after another); cpu ratio: the training thread's CPU time plus barrier "
              "waits, which other processes' load stretches far less; held-out: the loss on the "
              "corpus's held-out 10% of each run's weights at AdamW's own time for all steps)")
        mem = {r["optimizer"]: r["memory"] for r in s["runs"] if r["seed"] == s["seeds"][0]
               and "memory" in r}
        if mem:
            print("optimizer state at the end (bytes per tier, seed "
                  f"{s['seeds'][0]}): " + "; ".join(
                      f"{n} " + (", ".join(f"{t} {b}" for t, b in m["tiers"].items() if b)
                                 or "none found") + f" ({m['source']})"
                      for n, m in mem.items()))
        rs = s.get("round_steps")
        if rs:
            print(f"host 1/{rs['job_stretch']:.2f} as fast (--round-steps {rs['asked']:g}, "
                  f"calibrated on {rs['calibrated_on']}: unstretched R = "
                  f"{rs['passes'][0]['R']:.2f}); measured R per run: " + "; ".join(
                      f"{r['optimizer']} s{r['seed']} "
                      + common.fmt(r["round_steps"].get("R"), ".1f")
                      for r in s["runs"] if "round_steps" in r))
        recs = [r for r in s["runs"] if (r.get("refresh") or {}).get("mean_age") is not None]
        if recs:
            print("refreshes per factor per 100 steps, mean basis age (steps), whole round R: "
                  + "; ".join(f"{r['optimizer']} s{r['seed']} "
                              f"{r['refresh']['refreshes_per_factor_per_100']:.1f}, "
                              f"{r['refresh']['mean_age']:.2f}, "
                              + common.fmt((r.get("full_round") or {}).get("R"), ".1f")
                              for r in recs))
        print()
    lim = data.get("step_limit")
    if lim:
        print(f"Asteria-SOAP step {lim['asteria_soap_step_median_ms']:.1f} ms (median) vs its "
              f"limit {lim['limit_ms_at_peak_rate']:.1f} ms = AdamW {lim['adamw_step_median_ms']:.1f}"
              f" ms + {lim['added_flops_per_step'] / 1e9:.2f} GFLOP at "
              f"{lim['gemm_gflops_peak']:.0f} GFLOP/s: x{lim['step_over_limit']:.3f} "
              f"(at the rotation shapes' {lim['gemm_rate_rotation_shapes']['gflops_all']:.0f} "
              f"GFLOP/s: x{lim['step_median_over_limit_rotation_shapes']:.3f}); with its own "
              f"forward + backward in AdamW's: x{lim['step_over_limit_equal_fwd_bwd']:.3f}")
        ex = lim.get("excess")
        if ex:
            print(f"over the limit by {ex['step_over_limit_ms']:.1f} ms a step: forward + "
                  f"backward {ex['fwd_bwd_over_adamw_ms']:+.1f} ms against AdamW's, optimizer "
                  f"step {ex['opt_over_adamw_plus_flops_ms']:+.1f} ms against AdamW's + "
                  f"{ex['flop_ms_at_peak']:.1f} ms of FLOPs")
            pr = ex.get("profiled")
            if pr:
                print(f"  profiled plain steps: matrix products "
                      f"{pr['matmul_over_flop_time_ms']:+.1f} ms over the FLOP time (they ran at "
                      f"{common.fmt(pr['matmul_gflops_in_step'], '.0f')} GFLOP/s), other ops "
                      f"{pr['other_ops_over_adamw_ms']:+.1f} ms and the interpreter "
                      f"{pr['interpreter_over_adamw_ms']:+.1f} ms over AdamW's")
            if lim.get("limit_ms_at_in_step_rate"):
                print(f"  against the limit at that in-step rate "
                      f"({lim['limit_ms_at_in_step_rate']:.1f} ms): "
                      f"x{lim['step_median_over_limit_in_step_rate']:.3f}")
        if lim.get("nonrefresh_mean_over_sync_median") is not None:
            print(f"Asteria-SOAP mean step without a refresh {lim['asteria_nonrefresh_mean_ms']:.1f}"
                  f" ms vs native sync SOAP median {lim['native_sync_median_ms']:.1f} ms: "
                  f"x{lim['nonrefresh_mean_over_sync_median']:.3f}")
    for key, t in data["targets"].items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target {key}: {common.fmt(t['value'])} {t['op']} {t['threshold']}: {met}")
    noisy = sorted({f"{r['optimizer']}@{r['lr']:g}/s{r['seed']}"
                    for s in data["setting_results"].values() for r in s["runs"]
                    if r["disturbed"]})
    if noisy:
        print(f"WARNING: other processes kept > {DISTURBED_CORES} cores busy during "
              f"{', '.join(noisy)}: wall times are the machine's as much as the optimizer's")


def add_procedure_args(ap) -> None:
    """compare()'s arguments that every benchmark running it takes alike: --window, --extend,
    --budget, --workers, --threads."""
    ap.add_argument("--val-every", type=int, default=None,
                    help="held-out loss of the timed runs every this many steps (20; --quick 6)")
    ap.add_argument("--window", type=int, default=None,
                    help="steps of the trailing mean that smooths the loss (20; --quick 4)")
    ap.add_argument("--extend", type=int, default=2,
                    help="times a sweep whose best lr sits at its grid's edge is extended "
                         f"by x{EXTEND_FACTOR:g} (or /{EXTEND_FACTOR:g}) beyond it")
    ap.add_argument("--budget", type=float, default=3.0,
                    help="a run stops once its wall time passes this many times AdamW's")
    ap.add_argument("--workers", type=int, default=1, help="Asteria worker threads")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training")


def parse_runs(text: str, ap, runs: Sequence[str] = RUNS) -> list[str]:
    """A comma-separated list of optimizers: those of ``runs`` it names, in that order, AdamW
    first whether named or not (``ap``'s error otherwise)."""
    names = [r.strip() for r in text.split(",") if r.strip()]
    for r in names:
        try:
            ok = known_run(r, runs)
        except ValueError as e:
            ap.error(str(e))
        if not ok:
            ap.error(f"unknown optimizer {r!r}; allowed: {', '.join(runs)}, "
                     f"{', '.join(POLICY_RUNS)}, asteria-soap-drift-b<N>, or "
                     f"<base>-f<N>[-s<S>] with base one of {', '.join(VARIANT_BASES)}")
    extra = [r for r in names if r not in runs]
    return ["adamw"] + [r for r in runs if r in names and r != "adamw"] + extra


def check_procedure_args(ap, args, grids: dict, runs: Sequence[str] = RUNS) -> None:
    """args.grids: ``grids`` with each --lrs NAME=LR,LR,... in place of its NAME's; then S and
    the step counts checked (``ap``'s error)."""
    args.grids = dict(grids)
    for name in list(getattr(args, "runs", ())) + list(getattr(args, "bound_runs", ())):
        if name not in args.grids and (variant(name) is not None or policy_run(name) is not None):
            args.grids[name] = grid_of(name, grids)
    for spec in args.lrs:
        name, _, lrs = spec.partition("=")
        if not known_run(name, runs) or not lrs:
            ap.error(f"--lrs {spec!r}: want NAME=LR,LR,... with NAME one of {', '.join(runs)}")
        args.grids[name] = tuple(float(x) for x in lrs.split(","))
    if not 0 <= args.staleness <= args.frequency:
        ap.error("need 0 <= --staleness <= --frequency")
    if args.steps < 2 or args.window < 1:
        ap.error("need --steps >= 2 and --window >= 1")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--settings", default="users,optimizer-bound",
                    help="comma-separated subset of " + ", ".join(SETTINGS))
    ap.add_argument("--steps", type=int, default=None, help="steps per run (300; --quick 24)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (10; --quick 4)")
    ap.add_argument("--frequency", type=int, default=None,
                    help="precondition_frequency f of every preconditioner (10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=None,
                    help="Asteria's staleness budget S (0: sync's trajectory, the refresh "
                         "overlapping the next forward and backward)")
    add_procedure_args(ap)
    ap.add_argument("--runs", default=",".join(RUNS),
                    help="optimizers of the users setting (adamw always runs first)")
    ap.add_argument("--bound-runs", default="adamw,asteria-soap-async",
                    help="optimizers of the optimizer-bound setting")
    ap.add_argument("--seeds", default="0,1", help="seeds of the users setting (the first "
                                                   "one sweeps the lr)")
    ap.add_argument("--bound-seeds", default="0", help="seeds of the optimizer-bound setting")
    ap.add_argument("--lrs", action="append", default=[], metavar="NAME=LR,LR,...",
                    help="an optimizer's lr grid (repeatable); defaults: " + "; ".join(
                        f"{k} {','.join(f'{x:g}' for x in v)}" for k, v in GRIDS.items()))
    ap.add_argument("--gemm-reps", type=int, default=None, help="GEMM timings per shape (30)")
    ap.add_argument("--profile-steps", type=int, default=None,
                    help="profile this many steps of AdamW and Asteria SOAP (16; --quick 0)")
    ap.add_argument("--heavyball-compile", action="store_true",
                    help="keep heavyball's torch.compile (minutes of CPU autotuning)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="no lr sweep: the timed runs only, each optimizer at the one lr of its "
                         "grid (--lrs NAME=LR: the tuned lr of an earlier sweep)")
    ap.add_argument("--round-steps", type=float, default=None, metavar="R",
                    help="the users setting on a host 1/k as fast: k chosen so a REFRESH round "
                         "of the first Asteria async run takes R steps (calibrate_round_steps); "
                         "each stretched run records the R it measured")
    args = common.parse_quick(ap, argv, lambda q: dict(
        steps=24 if q else 300, warmup=4 if q else 10, frequency=4 if q else 10,
        staleness=0, window=4 if q else 20, log_every=12 if q else 50, val_every=6 if q else 20,
        gemm_reps=3 if q else 30, profile_steps=0 if q else 16,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in args.settings:
        if s not in SETTINGS:
            ap.error(f"unknown setting {s!r}; allowed: {', '.join(SETTINGS)}")
    args.runs = parse_runs(args.runs, ap)
    args.bound_runs = parse_runs(args.bound_runs, ap)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.bound_seeds = [int(s) for s in args.bound_seeds.split(",") if s.strip()]
    if not args.seeds or not args.bound_seeds:
        ap.error("need at least one seed")
    if args.round_steps is not None and (not args.round_steps > 0
                                         or "users" not in args.settings):
        ap.error(f"--round-steps {args.round_steps:g}: need R > 0 and the users setting in "
                 f"--settings")
    check_procedure_args(ap, args, GRIDS)
    if args.no_sweep:
        swept = ((args.runs if "users" in args.settings else [])
                 + (args.bound_runs if "optimizer-bound" in args.settings else []))
        many = sorted({n for n in swept if len(args.grids[n]) != 1})
        if many:
            ap.error(f"--no-sweep: {', '.join(many)} without a one-lr grid; give each "
                     f"--lrs NAME=LR")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
