"""Is the trajectory a function of the factors? Three measurements on a rank-deficient model.

Where a Kronecker factor is rank-deficient (a block wider than the rows that fed it: early
steps, small batches, rectangular layers), the basis of its null space is whatever the
eigensolver or QR happened to produce. When an optimizer's update depends on that basis
(SOAP's Adam moments live in the rotated basis), two runs whose factors differ by rounding
follow different trajectories. The model: an MLP 24 -> 30 -> 18 -> 8 (tanh), float64 unless
stated, a global batch of 16 rows per step (4 per rank on 4 ranks), targets a fixed smooth map
of the inputs, SOAP / Shampoo / KL-Shampoo with one block per weight (biases on AdamW),
precondition_frequency 4, 20 steps, lr 2e-2 (SOAP), 1e-2 (Shampoo), 1e-3 (KL-Shampoo). Every
weight is rectangular and the batch is narrower than the first layer, so the first factors are
rank-deficient.

 (a) rank-count agreement: FSDP2 (``fully_shard`` per layer, gloo) with
     ``fsdp_blocking="global"`` on 1, 2 and 4 ranks (30 and 18 rows split 8+8+8+6 and 5+5+5+3
     on 4 ranks) against the same model trained in one process without FSDP, sync and async
     (S = 0, deterministic installs, 1 worker). Global blocking computes every block whole on
     one owner, so the only difference is the gradient's reduction order (FSDP2's
     reduce-scatter against one backward): a basis-invariant method agrees to rounding.
 (b) sync against async (S = 0): one process, the same model, float64 and float32, after 8
     and 20 steps: the inline torch.linalg eigensolver (sync) against libasteria's LAPACK
     (async) on the same factors.
 (c) perturbation sensitivity: one process, train 20 steps twice, the second time with every
     gradient multiplied elementwise by (1 + 1e-6 r), r uniform in [-1, 1] from a fixed seed
     ("grad"), or with every input batch so multiplied ("data"); SOAP, Shampoo and KL-Shampoo
     (sync and async S = 0) and torch.optim.AdamW (lr 1e-2). AdamW's update is nearly
     invariant to a per-element gradient scaling, so "data" is the fair comparison for it.
     The two differ in kind for SOAP: "data" keeps every gradient's rank (the null space stays
     null), while an elementwise scaling of a gradient makes it full rank, its former null
     directions carrying ~1e-6 of the gradient (eigenvalues ~1e-12 of the largest, above a
     rounding floor); SOAP's Adam, elementwise in the eigenbasis, turns those into O(lr)
     steps: a property of the method, not of a basis choice.

Where SOAP's trajectory depends on the null-space basis, the size of (a)-(c) grows with the step
size (before the fix, (a) at 2 and 4 ranks: ~0.04 at SOAP lr 3e-3, ~0.13 at 1e-2, ~0.26 at
2e-2, ~0.4 at 3e-2); lr 2e-2 gives 25-27%, the issue's 27-30%. A basis-invariant method
agrees to rounding at every lr, up to the conditioning of the range: with 16 rows the 18 x 30
layer's first factor has a nonzero eigenvalue at 6e-6 of the largest (16 rows against 18), so
two backward-stable eigensolvers differ by ~eps / 6e-6 in the directions next to it whatever
the null-space rule (~1e-11 after the fix); ``--rows 8`` separates the spectrum (>= 5e-4).

Each number is the largest relative parameter difference, max over parameters of
||p - p_ref|| / ||p_ref||; ``max_abs_over_scale`` is tests/python/test_fsdp_global.py's measure
(largest elementwise difference over the largest reference entry); ``moved`` is how far the
reference travelled from the initial weights (max over parameters of ||p - p0|| / ||p0||), so a
difference can be read against it.

Writes benchmarks/results/bench_basis_invariance.json (``--out`` names another file): machine,
versions (asteria_path: which package was measured, also each rank's), the command, every
number.

    python3 benchmarks/bench_basis_invariance.py                 # ~50 s on 2 cores
    PYTHONPATH=/tmp/before/python python3 benchmarks/bench_basis_invariance.py \\
        --out benchmarks/results/bench_basis_invariance_before.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, NoReturn, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

NAME = "bench_basis_invariance"
METHODS = ("soap", "shampoo", "kl_shampoo")
LR = {"soap": 2e-2, "shampoo": 1e-2, "kl_shampoo": 1e-3, "adamw": 1e-2}
MODES = ("sync", "async")
RUNTIME = {"sync": {"mode": "sync"},
           "async": {"mode": "async", "staleness": 0, "install": "deterministic",
                     "workers": 1}}
WORLDS = (1, 2, 4)
PERTURB = 1e-6


# ---- the problem -----------------------------------------------------------------------------

def make_model(widths: Sequence[int], dtype, seed: int = 0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).to(dtype)


def batch(step: int, widths: Sequence[int], rows: int, dtype):
    """The global batch of a step (generated in float64, then cast: the same data in every
    dtype)."""
    import torch

    x = torch.randn(rows, widths[0], generator=torch.Generator().manual_seed(500 + step),
                    dtype=torch.float64)
    a = torch.randn(widths[0], widths[-1], generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    return x.to(dtype), torch.sin(x @ a).to(dtype)


def make_opt(method: str, params, runtime: Optional[dict], frequency: int):
    import torch

    import asteria

    if method == "adamw":
        return torch.optim.AdamW(params, lr=LR["adamw"])
    cls = {"soap": asteria.SOAP, "shampoo": asteria.Shampoo, "kl_shampoo": asteria.KLShampoo}
    return cls[method](params, lr=LR[method], precondition_frequency=frequency,
                       runtime=runtime)


def train(method: str, mode: Optional[str], dtype, args, perturb: float = 0.0,
          keep: Sequence[int] = (), on: str = "grad") -> dict:
    """One process, no FSDP: {step: parameters after it} for every step in ``keep`` and the
    last; "start": the initial parameters. ``perturb``: every gradient (``on="grad"``) or
    every input batch (``on="data"``) multiplied elementwise by 1 + perturb * r, r uniform in
    [-1, 1], fixed."""
    import torch

    model = make_model(args.widths, dtype)
    out = {"start": [p.detach().clone() for p in model.parameters()]}
    opt = make_opt(method, model.parameters(), RUNTIME.get(mode), args.frequency)
    gen = torch.Generator().manual_seed(11)
    shapes = ([p.shape for p in model.parameters()] if on == "grad" else
              [(args.rows, args.widths[0])])
    noise = [torch.rand(s, generator=gen, dtype=torch.float64).mul_(2).sub_(1) for s in shapes]
    try:
        for t in range(1, args.steps + 1):
            opt.zero_grad(set_to_none=True)
            x, y = batch(t, args.widths, args.rows, torch.float64)
            if perturb and on == "data":
                x = x * (1 + perturb * noise[0])
            x, y = x.to(dtype), y.to(dtype)
            ((model(x) - y) ** 2).mean().backward()
            if perturb and on == "grad":
                for p, r in zip(model.parameters(), noise):
                    p.grad.mul_(1 + perturb * r.to(dtype))
            opt.step()
            if t in keep or t == args.steps:
                out[t] = [p.detach().clone() for p in model.parameters()]
    finally:
        if hasattr(opt, "close"):
            opt.close()
    return out


def compare(got: list, ref: list, start: list) -> dict:
    import torch

    rel = max(float((a.double() - b.double()).norm() / b.double().norm())
              for a, b in zip(got, ref))
    absd = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, ref))
    scale = max(float(b.double().abs().max()) for b in ref)
    moved = max(float((b.double() - s.double()).norm() / s.double().norm())
                for b, s in zip(ref, start))
    return {"rel": rel, "max_abs_over_scale": absd / scale, "moved": moved,
            "bitwise_equal": all(torch.equal(a, b) for a, b in zip(got, ref))}


# ---- (a) the ranks -----------------------------------------------------------------------------

def worker(args) -> NoReturn:
    """One rank: every method x mode under FSDP2 global blocking; rank 0 saves the full
    parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import asteria
    from asteria.rank_exit import exit_rank

    rank, world = common.init_gloo(300)
    dtype = torch.float64
    n = args.rows // world
    full, info = {}, {"rank": rank, "asteria_path": os.path.dirname(asteria.__file__),
                      "owned": {}}
    for method in args.methods:
        for mode in MODES:
            model = make_model(args.widths, dtype)
            for m in model:
                if isinstance(m, torch.nn.Linear):
                    fully_shard(m)
            fully_shard(model)
            opt = make_opt(method, model.parameters(),
                           dict(RUNTIME[mode], fsdp_blocking="global"), args.frequency)
            for t in range(1, args.steps + 1):
                x, y = batch(t, args.widths, args.rows, dtype)
                x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
                opt.zero_grad(set_to_none=True)
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
            info["owned"][f"{method}/{mode}"] = opt.asteria_stats().get(
                "fsdp_global_blocks_owned")
            opt.close()
            full[f"{method}/{mode}"] = [p.full_tensor().detach().clone()
                                        for p in model.parameters()]
    if rank == 0:
        torch.save(full, os.path.join(args.worker_dir, "params.pt"))
    with open(os.path.join(args.worker_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(info, fh)
    dist.barrier()
    exit_rank(0)


def rank_counts(args, refs: dict, progress) -> dict:
    import torch

    out = {}
    for world in args.worlds:
        if args.rows % world:
            raise SystemExit(f"--rows {args.rows} is not a multiple of {world} ranks")
        with common.scratch_dir(f"{NAME}-w{world}-") as tmp:
            progress(f"(a) {world} rank(s), torchrun: {len(args.methods)} methods x {MODES}, "
                     f"{args.steps} steps, {args.rows // world} rows per rank")
            wargs = ["--worker", "--worker-dir", tmp, "--steps", str(args.steps),
                     "--rows", str(args.rows), "--frequency", str(args.frequency),
                     "--widths", ",".join(map(str, args.widths)),
                     "--lr", ",".join(f"{k}={v!r}" for k, v in LR.items()),
                     "--methods", ",".join(args.methods)]
            common.launch_torchrun(__file__, wargs, tmp, 1, world, args.timeout, NAME)
            full = torch.load(os.path.join(tmp, "params.pt"))
            ranks = common.read_ranks(tmp, world)
        res = {"rows_per_rank": args.rows // world,
               "shard_rows": {str(w): shard_rows(w, world) for w in args.widths[1:]},
               "ranks_asteria_path": sorted({r["asteria_path"] for r in ranks}),
               "blocks_owned": {k: [r["owned"][k] for r in ranks] for k in ranks[0]["owned"]}}
        for key, params in full.items():
            method, mode = key.split("/")
            ref = refs[(method, mode, "float64")]
            res[key] = compare(params, ref[args.steps], ref["start"])
            progress(f"    {world} rank(s) {key:>18}: rel {res[key]['rel']:.3g}")
        out[str(world)] = res
    return out


def shard_rows(rows: int, world: int) -> list:
    """FSDP2's dim-0 split: chunks of ceil(rows / world), the last ones smaller or empty."""
    c = -(-rows // world)
    return [max(0, min(c, rows - r * c)) for r in range(world)]


# ---- main ------------------------------------------------------------------------------------

def package_commit(path: Optional[str]) -> dict:
    """The git HEAD of the checkout the measured asteria package lives in (a worktree of the
    commit before a fix, say: common.versions()' git_commit is this script's checkout), and
    whether its tracked files differ from it."""
    import subprocess

    if not path:
        return {}
    try:
        head = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    if head.returncode:
        return {}
    return {"asteria_git_commit": head.stdout.strip(),
            "asteria_tree_modified": sorted(ln[3:] for ln in dirty.stdout.splitlines())}


def run(args, progress) -> dict:
    import torch

    torch.set_num_threads(1)
    keep = tuple(s for s in args.short_steps if s < args.steps)
    refs = {}
    for dtype in (torch.float64, torch.float32):
        dn = str(dtype).split(".")[1]
        for method in args.methods:
            for mode in MODES:
                refs[(method, mode, dn)] = train(method, mode, dtype, args, keep=keep)
        progress(f"one-process runs in {dn} done")
    # (b) sync against async (S = 0)
    sync_async = {}
    for (method, mode, dn), traj in refs.items():
        if mode != "async":
            continue
        sref = refs[(method, "sync", dn)]
        for t in keep + (args.steps,):
            r = compare(traj[t], sref[t], sref["start"])
            sync_async[f"{method}/{dn}/{t}"] = r
            progress(f"(b) {method:>10} {dn} after {t:2d} steps: sync vs async rel "
                     f"{r['rel']:.3g} (moved {r['moved']:.3g})")
    # (c) perturbation sensitivity (float64): of the gradients, and of the inputs
    sens = {"grad": {}, "data": {}}
    adamw = train("adamw", None, torch.float64, args)
    for on in ("grad", "data"):
        for method in args.methods + ("adamw",):
            for mode in (MODES if method != "adamw" else (None,)):
                base = refs[(method, mode, "float64")] if mode else adamw
                pert = train(method, mode, torch.float64, args, perturb=args.perturb, on=on)
                key = method if mode is None else f"{method}/{mode}"
                r = sens[on][key] = compare(pert[args.steps], base[args.steps], base["start"])
                progress(f"(c) {key:>18}: rel change {r['rel']:.3g} under a "
                         f"{args.perturb:g} relative perturbation of the {on}")
    res = {"sync_vs_async": sync_async, "perturbation": sens}
    if not args.skip_ranks:
        res["rank_counts"] = rank_counts(args, refs, progress)
    return res


def summary(res: dict, args) -> dict:
    out: dict[str, Any] = {}
    if "rank_counts" in res:
        out["a_rank_counts_rel"] = {
            f"{method}/{mode}": {w: res["rank_counts"][w][f"{method}/{mode}"]["rel"]
                                 for w in res["rank_counts"]}
            for method in args.methods for mode in MODES}
        out["a_one_rank_bitwise_equal_no_fsdp"] = {
            k: v["bitwise_equal"] for k, v in res["rank_counts"].get("1", {}).items()
            if isinstance(v, dict) and "bitwise_equal" in v}
    out["b_sync_vs_async_rel"] = {k: v["rel"] for k, v in res["sync_vs_async"].items()}
    for on, runs in res["perturbation"].items():
        out[f"c_perturbation_{on}_rel"] = {k: v["rel"] for k, v in runs.items()}
    return out


def main(argv: Optional[Sequence[str]] = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-dir", help=argparse.SUPPRESS)
    ap.add_argument("--widths", default="24,30,18,8",
                    help="layer widths, input first (default 24,30,18,8)")
    ap.add_argument("--rows", type=int, default=16,
                    help="rows of the global batch per step (default 16: 4 per rank on 4)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--short-steps", default="8",
                    help="earlier steps at which (b) also compares (default 8)")
    ap.add_argument("--frequency", type=int, default=4, help="precondition_frequency")
    ap.add_argument("--lr", default="",
                    help="learning-rate overrides, e.g. soap=3e-3,adamw=1e-3 (defaults: "
                         + ", ".join(f"{k} {v:g}" for k, v in LR.items()) + ")")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="a subset of " + ",".join(METHODS))
    ap.add_argument("--perturb", type=float, default=PERTURB)
    ap.add_argument("--worlds", default=",".join(map(str, WORLDS)))
    ap.add_argument("--skip-ranks", action="store_true", help="no multi-rank runs: (b), (c)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default=None,
                    help=f"the JSON file (default benchmarks/results/{NAME}.json)")
    args = ap.parse_args(argv)
    args.widths = [int(w) for w in args.widths.split(",")]
    for kv in filter(None, args.lr.split(",")):
        k, v = kv.split("=")
        LR[k] = float(v)
    args.methods = tuple(m for m in args.methods.split(",") if m)
    if args.worker:
        worker(args)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.short_steps = tuple(int(s) for s in args.short_steps.split(",") if s)
    progress = common.Progress(NAME)
    meta = common.run_metadata(NAME, __file__, argv)
    progress(f"asteria from {meta['versions'].get('asteria_path')}")
    res = run(args, progress)
    data = dict(meta)
    data["settings"] = {"widths": args.widths, "rows_global": args.rows, "steps": args.steps,
                        "short_steps": list(args.short_steps), "frequency": args.frequency,
                        "lr": LR, "perturb": args.perturb, "worlds": args.worlds,
                        "runtimes": RUNTIME, "backend": "gloo", "fsdp_blocking": "global",
                        "block_size": None, "dtype_a_c": "float64",
                        "measure": "max over parameters of ||p - p_ref|| / ||p_ref||"}
    data["machine"]["loadavg1_end"] = common.loadavg()
    data["versions"].update(package_commit(data["versions"].get("asteria_path")))
    data["results"] = res
    data["summary"] = summary(res, args)
    out = args.out or os.path.join(common.RESULTS_DIR, f"{NAME}.json")
    path = common.write_json(data, os.path.basename(out), os.path.dirname(os.path.abspath(out)))
    progress(f"wrote {path}")
    print(json.dumps(data["summary"], indent=1))
    return data


if __name__ == "__main__":
    main()
