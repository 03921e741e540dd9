"""How far from orthogonal a quantized eigenbasis is, per block size and Bjorck step: the
measurement behind the quantized tiers' format (``config.TIER_QUANT_BLOCK``) and step counts
(``config.TIER_RECTIFY_STEPS``).

For each n and each of two kinds of factor, the eigenbasis V (float64 eigh, then float32) of
  G G^T                    G n x n Gaussian: delocalized eigenvectors, every entry near 1/sqrt n;
  diag(1..2) + 0.03 G G^T / n   partly localized eigenvectors, a few large entries a column,
                           as the factors training makes have (docs/memory.md),
it gives ||V^T V - I||_F of: V rounded to bfloat16 (the bfloat16 tier's basis, unrectified:
the bar a quantized basis must be under), and V quantized in libasteria's format
(``asteria.tiers.quant``) for each (qtype, block) asked, dequantized, then after 0, 1, ...
--max-steps Bjorck steps (libasteria's ``rectify_host``, float32); and each form's bytes over
float32's, scales included. The rows at the configured (block, steps) are the tiers' own.

Writes bench_quant_orth.json and bench_quant_orth.png (error against steps, per n and kind).

    python3 benchmarks/bench_quant_orth.py --out-dir benchmarks/results/quant_orth
    python3 benchmarks/bench_quant_orth.py --quick --out-dir /tmp/x
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional, Sequence

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from asteria.config import TIER_QUANT_BLOCK, TIER_RECTIFY_STEPS  # noqa: E402
from asteria.tiers import quant  # noqa: E402

NAME = "bench_quant_orth"
KINDS = ("G G^T", "diag + 0.03 G G^T / n")


def basis(n: int, kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 100003 + n)
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    f = g @ g.T if kind == KINDS[0] else (
        torch.diag(torch.linspace(1, 2, n, dtype=torch.float64)) + 0.03 * g @ g.T / n)
    return torch.linalg.eigh(f)[1].float().contiguous()


def measure(v: torch.Tensor, qtype: str, block: int, steps: int) -> dict[str, Any]:
    n = v.shape[-1]
    q = quant.quantize_host(v, qtype, block)
    w = quant.dequantize_host(q, qtype, n * n, block).view(n, n).contiguous()
    return {"qtype": qtype, "block": block, "bytes_ratio": q.numel() / (4 * n * n),
            "orth_error": [float(e) for e in quant.rectify_host(w, steps)[0]],
            "tiers_block": TIER_QUANT_BLOCK[qtype] == block}


def run(args, argv: Optional[Sequence[str]]) -> dict[str, Any]:
    log, meta = common.start_run(NAME, __file__, argv)
    forms = [(q, b) for q in args.qtypes for b in args.blocks]
    rows = []
    for n in args.sizes:
        for kind in KINDS:
            v = basis(n, kind, args.seed)
            row = {"n": n, "kind": kind,
                   "bfloat16": float(quant.orth_error(v.to(torch.bfloat16).float())),
                   "forms": [measure(v, q, b, args.max_steps) for q, b in forms]}
            rows.append(row)
            log(f"n {n:5d} {kind:24s} bfloat16 {row['bfloat16']:.3g}  " + "  ".join(
                f"{f['qtype']}/{f['block']}: " + ", ".join(f"{e:.2g}" for e in f["orth_error"])
                for f in row["forms"]))
    meta["machine"]["loadavg1_end"] = common.loadavg()
    out = dict(meta, sizes=args.sizes, kinds=list(KINDS), max_steps=args.max_steps,
               configured_block=dict(TIER_QUANT_BLOCK),
               configured_steps=dict(TIER_RECTIFY_STEPS), rows=rows)
    path = common.write_json(out, NAME + ".json", args.out_dir)
    log(f"wrote {path}")
    if not args.no_plot:
        common.try_plot(plot, out, os.path.join(args.out_dir, NAME + ".png"), log)
    return out


def plot(out: dict, path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, len(KINDS), figsize=(11, 4.2), sharey=True)
    for ax, kind in zip(axes, KINDS):
        for row in (r for r in out["rows"] if r["kind"] == kind):
            for f in row["forms"]:
                ax.semilogy(range(len(f["orth_error"])), f["orth_error"], marker="o", ms=3,
                            label=f"n {row['n']} {f['qtype']}/{f['block']}")
            ax.axhline(row["bfloat16"], color="gray", lw=0.6, ls=":")
        ax.set_title(kind + " (dotted: bfloat16, unrectified)", fontsize=9)
        ax.set_xlabel("Bjorck steps")
        ax.set_ylabel("||V^T V - I||_F")
    common.save_figure(fig, axes, path, "Quantized eigenbases", out["machine"])


def parse_args(argv: Optional[Sequence[str]]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--sizes", type=ints, default=None, help="n of the bases (64,256,512,1024)")
    ap.add_argument("--qtypes", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                    default=["int8", "int4"])
    ap.add_argument("--blocks", type=ints, default=[64, 128], help="values per scale")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = common.parse_quick(ap, argv, lambda q: dict(
        sizes=[64, 128] if q else [64, 256, 512, 1024],
        out_dir=os.path.join(common.RESULTS_DIR, "tmp") if q else common.RESULTS_DIR))
    for q in args.qtypes:
        if q not in quant.QMAX:
            ap.error(f"--qtypes: unknown {q!r}; allowed: {', '.join(quant.QMAX)}")
    if args.max_steps < 0 or any(n < 1 for n in args.sizes):
        ap.error("--max-steps must be >= 0 and every --sizes entry >= 1")
    return args


main = common.make_main(run, parse_args)


if __name__ == "__main__":
    main()
