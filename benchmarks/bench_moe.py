"""Mixture of experts: does giving each expert its own preconditioner pay, where users train?

The model: bench_convergence.py's TinyGPT (examples/tinygpt.py) whose MLP is a mixture of
experts (``MoEGPT``): 8 experts of width 4d, top-2 routing by a linear router (softmax, the two
largest gates renormalised), plain torch (tokens sorted by expert, one matrix product per expert,
no triton), and a Switch-style load-balancing term of weight 0.01 whose gradient joins the
cross-entropy's (its value is left out of the reported loss). Each layer's experts are one
parameter per projection, torchtitan's layout ``w_in`` (8, d, 4d) and ``w_out`` (8, 4d, d)
(``--layout 3d``, the default), or OLMo-core's (8 d, 4d) and (8 * 4d, d) (``--layout flat``):
the same values in the same order, so AdamW and soap-experts are the same runs in either
layout, and only soap-plain differs. Default: d=64,
2 layers, 2 heads, context 128, batch 32: 4,096 tokens a step, 16x an expert's width (4d = 256;
each expert sees about 1,024 tokens a step), trained on the bundled corpus (CharData).

Optimizers:
  adamw         torch AdamW (bench_convergence's betas and weight decay);
  soap-experts  Asteria SOAP async (bench_convergence's "asteria-soap-async": S=0, deterministic
                installs, one worker on the other core, SOAP_HP) with the expert weights in a
                param group of their own with ``num_experts=8``: each expert its own factors,
                eigenbases and Adam statistics, a layer's experts one batched REFRESH job;
  soap-plain    the same, the expert weights taken as plain tensors (no num_experts): one
                factor per dimension of the 3-D tensor, shared by the experts (8^2, d^2 and
                (4d)^2: 3d layout); with the flat layout one (8 d)^2 and one (4d)^2 factor
                for ``w_in``, (32 d)^2 and d^2 for ``w_out``: at d=64 a 2048 x 2048 factor
                per layer, whose eigendecomposition takes seconds on one core and holds up
                every refresh's install (S=0), which is why the default layout is 3d.

Procedure: bench_convergence.py's (its docstring), through its helpers: the lr sweep on seed 0
(AdamW's tuned lr: lowest final loss; the others': fewest steps to AdamW's tuned final loss, a
grid extended beyond its edge while the best sits there), the timed runs of every seed in
lockstep at the tuned lrs, linear warm-up over the first 10% of the steps and cosine decay to
10% of the peak lr. Reported per optimizer: time to tuned AdamW's final loss over AdamW's time
(per seed), final loss at equal steps, and the optimizer state per memory tier
(``asteria_stats``'s bytes per tier, ``asteria_memory_plan``'s planned and peak bytes; AdamW's:
its state tensors), measured on a separate short run at the tuned lr after the first refresh
is installed. The state is split by kind (factors, eigenbases, moments) for the expert weights.

Training: one torch thread pinned to the first core; Asteria's worker pool on the others.

Writes benchmarks/results/moe/bench_moe.{json,png}.

    python3 benchmarks/bench_moe.py            # about half an hour on 2 idle cores (estimated)
    python3 benchmarks/bench_moe.py --layout 3d --seeds 0
    python3 benchmarks/bench_moe.py --quick --out-dir /tmp/x   # seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import subprocess
import sys
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import bench_convergence as bc  # noqa: E402
import common  # noqa: E402
from tinygpt import SCHEDULE, Block, CharData, GPTConfig, TinyGPT, n_params  # noqa: E402

NAME = "bench_moe"
RUNS = ("adamw", "soap-experts", "soap-plain")
GRIDS = {"adamw": (3e-3, 6e-3, 1e-2), "soap-experts": (6e-3, 1e-2, 2e-2),
         "soap-plain": (6e-3, 1e-2, 2e-2)}
MODEL = dict(d=64, layers=2, heads=2, block=128, batch=32)
QUICK_MODEL = dict(d=16, layers=1, heads=2, block=32, batch=8)
STATE_KINDS = {"factors": ("GG",), "eigenbases": ("Q",), "moments": ("exp_avg",)}


# ---- the model ----------------------------------------------------------------------------------

@dataclasses.dataclass
class MoEConfig(GPTConfig):
    experts: int = 8
    top_k: int = 2
    layout: str = "3d"        # "3d": (E, d_in, d_out) (torchtitan); "flat": (E * d_in, d_out)
    balance: float = 0.01     # weight of the load-balancing term's gradient


class Experts(nn.Module):
    """Top-k routed experts x -> gelu(x W_in[e]) W_out[e], the gates renormalised over the
    chosen k; ``aux`` after a forward: the Switch load-balancing term E * sum_e f_e P_e (f_e:
    the fraction of routed slots expert e got, P_e: its mean router probability)."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        e, d, h = c.experts, c.d, 4 * c.d
        self.e, self.k, self.d, self.h = e, c.top_k, d, h
        self.router = nn.Linear(d, e, bias=False)
        flat = c.layout == "flat"
        self.w_in = nn.Parameter(torch.empty((e * d, h) if flat else (e, d, h)))
        self.w_out = nn.Parameter(torch.empty((e * h, d) if flat else (e, h, d)))
        nn.init.normal_(self.w_in, std=0.02)  # as TinyGPT's fc and out
        nn.init.normal_(self.w_out, std=0.02 / math.sqrt(2 * c.layers))
        self.aux: Optional[torch.Tensor] = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, self.d)
        n = x.shape[0]
        probs = self.router(x).softmax(-1)
        gate, idx = probs.topk(self.k, dim=-1)
        gate = gate / gate.sum(-1, keepdim=True)
        slot_expert = idx.reshape(-1)
        order = slot_expert.argsort(stable=True)
        counts = torch.bincount(slot_expert, minlength=self.e)
        token = torch.arange(n).repeat_interleave(self.k)[order]
        w_in = self.w_in.view(self.e, self.d, self.h)
        w_out = self.w_out.view(self.e, self.h, self.d)
        parts = x[token].split(counts.tolist())
        y = torch.cat([F.gelu(p @ w_in[j]) @ w_out[j] for j, p in enumerate(parts)])
        y = y * gate.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token, y)
        self.aux = self.e * (counts.to(x.dtype) / (n * self.k) * probs.mean(0)).sum()
        return out.view(shape)


class MoEBlock(Block):
    def __init__(self, c: MoEConfig):
        super().__init__(c)
        del self.fc, self.out
        self.moe = Experts(c)

    def mlp(self, h):
        return self.moe(h)


class MoEGPT(TinyGPT):
    """TinyGPT with a mixture of experts for every MLP. The loss it returns is the
    cross-entropy; the load-balancing term adds its gradient only (``a - a.detach()`` is 0)."""

    block_type = MoEBlock

    def forward(self, idx, targets=None):
        out = super().forward(idx, targets)
        if targets is None:
            return out
        aux = sum(b.moe.aux for b in self.blocks)
        return out + self.c.balance * (aux - aux.detach())

    def expert_weights(self) -> list:
        return [w for b in self.blocks for w in (b.moe.w_in, b.moe.w_out)]


def describe(problem: bc.Problem) -> dict[str, Any]:
    c = problem.cfg
    tokens = problem.batch * c.block
    model = problem.model()
    width = 4 * c.d
    expert = sum(w.numel() for w in model.expert_weights())
    return {"name": "MoE TinyGPT", "params": n_params(model), "expert_params": expert,
            "active_params": n_params(model) - expert + expert * c.top_k // c.experts,
            "d": c.d, "layers": c.layers, "heads": c.heads, "context": c.block,
            "vocab": c.vocab, "batch": problem.batch, "tokens_per_step": tokens,
            "experts": c.experts, "top_k": c.top_k, "layout": c.layout,
            "expert_weight_shapes": [list(w.shape) for w in model.expert_weights()[:2]],
            "expert_width": width, "tokens_over_expert_width": tokens / width,
            "tokens_per_expert_per_step": tokens * c.top_k / c.experts,
            "routing": f"top-{c.top_k} of a linear router's softmax, gates renormalised; "
                       f"Switch load-balancing gradient x{c.balance}",
            "data": "Tiny Shakespeare (char level)"}


def make_problems(args) -> dict[int, bc.Problem]:
    m = QUICK_MODEL if args.quick else MODEL
    data = CharData(block=m["block"])
    cfg = MoEConfig(vocab=data.vocab, block=m["block"], d=m["d"], layers=m["layers"],
                    heads=m["heads"], experts=args.experts, top_k=args.top_k,
                    layout=args.layout)
    return {s: bc.make_problem("moe", cfg, data, args.steps, s, m["batch"], MoEGPT)
            for s in args.seeds}


# ---- the optimizers -----------------------------------------------------------------------------

def build(name: str, model: MoEGPT, lr: float, args, worker_cpus: Optional[str]):
    """(optimizer, its keyword arguments) of ``name`` over ``model``: bench_convergence's AdamW
    or async Asteria SOAP, the expert weights in a group with num_experts for soap-experts."""
    if name == "adamw":
        return bc.make_optimizer("adamw", model.parameters(), lr, args, worker_cpus)
    params: Any = model.parameters()
    if name == "soap-experts":
        ex = set(model.expert_weights())
        params = [{"params": [p for p in model.parameters() if p not in ex]},
                  {"params": model.expert_weights(), "num_experts": model.c.experts}]
    opt, kw = bc.make_optimizer("asteria-soap-async", params, lr, args, worker_cpus)
    kw = dict(kw, expert_weights_num_experts=(model.c.experts if name == "soap-experts"
                                              else None))
    return opt, kw


make_curve = functools.partial(bc.make_curve, build=build)


def state_bytes(opt, model: MoEGPT) -> dict[str, Any]:
    """Bytes of the expert weights' optimizer state by kind (STATE_KINDS, from the state keys),
    and of the whole state."""
    ex = set(model.expert_weights())
    out = {k: 0 for k in STATE_KINDS}
    out.update(expert_other=0, expert_total=0, total=0)
    for p, st in opt.state.items():
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                continue
            n = v.numel() * v.element_size()
            out["total"] += n
            if p not in ex:
                continue
            out["expert_total"] += n
            field = key.split(".")[-1]
            kind = next((k for k, pre in STATE_KINDS.items() if field.startswith(pre)),
                        "expert_other")
            out[kind] += n
    return out


def memory(problems: dict, tuned: dict, args, pin: dict, log: common.Progress) -> dict:
    """Each optimizer's state after its first refresh is installed (frequency + 2 steps at
    its tuned lr, seed 0): bytes per tier, the memory plan, the expert weights' state by
    kind."""
    problem = problems[next(iter(problems))]
    out = {}
    for name in [n for n in args.runs if n in tuned]:
        model = problem.model()
        opt, _ = bc.make_with_wide_mask(lambda: build(name, model, tuned[name], args,
                                                      pin["worker_cpus"]))
        for i in range(min(args.frequency + 2, args.steps)):
            opt.zero_grad(set_to_none=True)
            model(*problem.batches[i]).backward()
            opt.step()
        stats = common.runtime_stats(opt)
        r = {"tiers": common.tier_bytes(opt, "cpu", stats), "by_kind": state_bytes(opt, model)}
        if hasattr(opt, "asteria_memory_plan"):
            r["memory_plan"] = opt.asteria_memory_plan()
        bc.close(opt)
        out[name] = r
        log(f"memory {name}: {r['tiers']['total'] / 2**20:.2f} MiB in tiers "
            f"({', '.join(f'{t} {b / 2**20:.2f}' for t, b in r['tiers']['tiers'].items() if b)})"
            f"; expert weights' state {r['by_kind']['expert_total'] / 2**20:.2f} MiB")
    return out


# ---- the run ------------------------------------------------------------------------------------

def uptime() -> Optional[str]:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run(args, argv) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    meta["machine"]["uptime_start"] = uptime()
    log(f"start: {meta['machine']['uptime_start']}")
    torch.set_num_threads(args.threads)
    pin = bc.placement()
    cpu0 = common.cpu_snapshot()
    problems = make_problems(args)
    info = describe(problems[args.seeds[0]])
    log(f"MoE TinyGPT {info['params'] / 1e6:.2f}M params ({info['experts']} experts, top-"
        f"{info['top_k']}, {info['layout']} layout {info['expert_weight_shapes']}), "
        f"{info['tokens_per_step']} tokens a step = {info['tokens_over_expert_width']:.0f}x an "
        f"expert's width; {args.steps} steps; {', '.join(args.runs)}; seeds {args.seeds}")
    res = bc.compare("moe", "quick" if args.quick else "moe", info, args.runs, problems, args,
                     pin, log, make_curve)
    res["memory"] = memory(problems, res["tuned_lr"], args, pin, log)
    meta["machine"]["loadavg1_end"] = common.loadavg()
    meta["machine"]["loadavg_end"] = list(os.getloadavg())
    meta["machine"]["uptime_end"] = uptime()
    log(f"end: {meta['machine']['uptime_end']}")
    meta["cpu"] = common.cpu_delta(cpu0, common.cpu_snapshot())
    data = {
        **meta,
        "settings": {"steps": args.steps, "warmup": args.warmup, "frequency": args.frequency,
                     "staleness": args.staleness, "install": "deterministic",
                     "workers": args.workers, "torch_threads": args.threads,
                     "schedule": SCHEDULE, "adamw_betas": list(bc.ADAMW_BETAS),
                     "soap_hp": bc.SOAP_HP, "weight_decay": bc.WEIGHT_DECAY,
                     "quick": args.quick, "smoothing": f"trailing mean over {args.window} steps",
                     "window": args.window, "budget_x_adamw": args.budget, "pinning": pin,
                     "lr_choice": "AdamW: lowest final loss on seed 0; others: fewest steps to "
                                  "AdamW's final loss on seed 0 (then lowest loss)",
                     "timed_runs": "every optimizer at its tuned lr, in lockstep (turns of "
                                   f"{common.TURN_STEPS} consecutive steps), all steps, per "
                                   "seed; the sweep's times are those of separate runs",
                     "memory": f"a separate run of frequency + 2 steps at the tuned lr, seed "
                               f"{args.seeds[0]}"},
        "model": info,
        "results": res,
    }
    return common.finish(data, NAME, args.out_dir, args.no_plot, print_table, plot, log)


COLORS = {"adamw": "tab:gray", "soap-experts": "tab:blue", "soap-plain": "tab:orange"}


def plot(data: dict, path: str) -> None:
    plt = common.pyplot()
    res = data["results"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 5.2))
    bc.plot_timed_runs(a, res, data["settings"]["smoothing"], COLORS)
    names = [n for n in res["optimizers"] if n != "adamw" and n in res["ratios"]]
    for i, n in enumerate(names):
        per = [x for x in res["ratios"][n]["time_ratio_per_seed"] if x is not None]
        if per:
            mean = sum(per) / len(per)
            b.bar(i, mean, 0.6, yerr=[[mean - min(per)], [max(per) - mean]], capsize=3,
                  color=COLORS.get(n))
    b.axhline(1.0, color="k", lw=0.8)
    b.set_xticks(range(len(names)), names)
    b.set(ylabel="time to tuned AdamW's final loss / AdamW's time",
          title="Time ratio (bar: mean over seeds, whiskers: range; none: not reached)")
    mem = res.get("memory", {})
    tiers = [t for t in common.TIERS if any(m["tiers"]["tiers"][t] for m in mem.values())]
    bottom = [0.0] * len(mem)
    for t in tiers:
        ys = [m["tiers"]["tiers"][t] / 2**20 for m in mem.values()]
        c.bar(range(len(mem)), ys, 0.6, bottom=bottom, label=t)
        bottom = [x + y for x, y in zip(bottom, ys)]
    c.set_xticks(range(len(mem)), list(mem))
    c.set(ylabel="optimizer state (MiB)", title="Optimizer state per memory tier")
    c.legend(fontsize=7)
    m = data["model"]
    common.save_figure(fig, (a, b, c), path,
                       f"{m['params'] / 1e6:.2f}M-param MoE TinyGPT ({m['experts']} experts, "
                       f"top-{m['top_k']}, {m['layout']}), {m['tokens_per_step']} tokens/step "
                       f"({m['tokens_over_expert_width']:.0f}x an expert's width), "
                       f"f={data['settings']['frequency']}, S={data['settings']['staleness']}",
                       data["machine"], legend=False)


def print_table(data: dict) -> None:
    res, m = data["results"], data["model"]
    print(f"MoE TinyGPT, {m['experts']} experts top-{m['top_k']}, {m['layout']} layout, "
          f"{m['tokens_per_step']} tokens/step; seeds {res['seeds']}")
    common.print_header(
        f"{'optimizer':<14}{'lr':>8}{'median ms':>11}{'steps to target':>17}"
        f"{'time ratio (per seed)':>24}{'mean':>7}{'final loss (per seed)':>24}"
        f"{'state MiB (tiers)':>20}{'planned peak MiB':>18}")
    for name, c in bc.table_rows(res):
        if "failed" in c:
            print(f"{name:<14}  FAILED: " + c["failed"])
            continue
        mem = res.get("memory", {}).get(name)
        tiers = "-" if mem is None else ", ".join(
            f"{t} {b / 2**20:.2f}" for t, b in mem["tiers"]["tiers"].items() if b)
        peak = "-" if not mem or "memory_plan" not in mem else \
            f"{mem['memory_plan']['peak_total'] / 2**20:.2f}"
        if name == "adamw":
            per, mean = "1 (target)", ""
        else:
            per, mean = c["per"], common.fmt(c["ratios"]["time_ratio_mean"], ".2f")
        print(f"{name:<14}{c['lr']:>8g}{c['median_ms']:>11}{c['steps']:>17}"
              f"{per:>24}{mean:>7}{c['finals']:>24}{tiers:>20}{peak:>18}")
    print("(time ratio: own time to tuned AdamW's final loss in lockstep / AdamW's time; state: "
          "asteria_stats' bytes per tier, AdamW's its state tensors; peak: the memory plan's)")
    for name, mem in res.get("memory", {}).items():
        k = mem["by_kind"]
        print(f"  {name}: expert weights' state {k['expert_total'] / 2**20:.2f} MiB = factors "
              f"{k['factors'] / 2**20:.2f} + eigenbases {k['eigenbases'] / 2**20:.2f} + moments "
              f"{k['moments'] / 2**20:.2f} + other {k['expert_other'] / 2**20:.2f}")


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per run (300; --quick 24)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="leading steps left out of the step-time statistics (10; --quick 4)")
    ap.add_argument("--frequency", type=int, default=None,
                    help="precondition_frequency f (10; --quick 4)")
    ap.add_argument("--staleness", type=int, default=0, help="Asteria's staleness budget S")
    bc.add_procedure_args(ap)
    ap.add_argument("--runs", default=",".join(RUNS), help="optimizers (adamw always first)")
    ap.add_argument("--seeds", default="0,1", help="seeds (the first one sweeps the lr)")
    ap.add_argument("--lrs", action="append", default=[], metavar="NAME=LR,LR,...",
                    help="an optimizer's lr grid (repeatable); defaults: " + "; ".join(
                        f"{k} {','.join(f'{x:g}' for x in v)}" for k, v in GRIDS.items()))
    ap.add_argument("--layout", choices=("3d", "flat"), default="3d",
                    help="expert weights as (E, d_in, d_out) (torchtitan) or (E * d_in, d_out) "
                         "(OLMo-core); only soap-plain's factors differ")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    args = common.parse_quick(ap, argv, lambda q: dict(
        steps=24 if q else 300, warmup=4 if q else 10, frequency=4 if q else 10,
        window=4 if q else 20, log_every=12 if q else 50,
        out_dir=os.path.join(common.RESULTS_DIR, "tmp" if q else "moe")))
    args.runs = bc.parse_runs(args.runs, ap, RUNS)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not args.seeds:
        ap.error("need at least one seed")
    bc.check_procedure_args(ap, args, GRIDS, RUNS)
    if not 1 <= args.top_k <= args.experts:
        ap.error("need 1 <= --top-k <= --experts")
    args.heavyball_compile = False  # bench_convergence's factory reads it
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
