"""``python3 -m asteria.plan``: will the REFRESH work keep up, for a model this machine need not hold?

The offline form of the capacity report of ``optimizer.asteria_plan()``: the same cost model
(``asteria.refresh.cost``) priced on parameter shapes alone. For each model and step time it
prints the work per round (GFLOP), the predicted round time on the given host cores (divided
among them, as the split executor does on a CUDA machine), the window S x step time, the pool's
utilisation (its busy share of the f steps between rounds), the smallest S that hides a round
and the fewest cores that hide it at the given S.

Owns: the presets (OLMo-2 1B and 7B, read from OLMo-core's model configs: built on the meta
device, no memory allocated, and their 2-D weights listed; embeddings and the output head take
AdamW, as asteria.olmo routes them), the factor list of a set of shapes (the optimizers' own
blocking, ``asteria.optim._blocking.make_layout``), the step time from tokens per step, the
table. May call: ``asteria.refresh.cost``, ``asteria.refresh.engine`` (lane names),
``asteria.optim._blocking``, olmo_core (presets
only), torch.

Examples:
    python3 -m asteria.plan --preset olmo2-1b                        # calibrates here first
    python3 -m asteria.plan --preset olmo2-1b --preset olmo2-7b --cores 14 \\
        --tokens 65536 --tokens 524288 --gflops-per-core 20 --markdown
    python3 -m asteria.plan --shape 4096x4096 --shape 11008x4096 --step-time 1.5
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from typing import Optional, Sequence

import torch

from asteria.optim import METHODS
from asteria.optim._blocking import make_layout
from asteria.optim.method import method_of
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane

PRESETS = {"olmo2-1b": "olmo2_1B", "olmo2-7b": "olmo2_7B"}
H200_BF16_TFLOPS = 989.0  # dense bf16 peak
VOCAB = 100352            # OLMo-2's padded dolma2 vocabulary


def preset(name: str, seq_len: int = 4096) -> dict:
    """{"shapes": [2-D weight shapes given to the method], "flops_per_token": training FLOPs
    per token, "params": all parameters} of an OLMo-2 preset, from OLMo-core's config."""
    import logging
    import warnings

    logging.getLogger("olmo_core").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from olmo_core.nn.transformer import TransformerConfig

        cfg = getattr(TransformerConfig, PRESETS[name])(vocab_size=VOCAB)
        model = cfg.build(init_device="meta")
    shapes = [tuple(p.shape) for n, p in model.named_parameters()
              if p.dim() == 2 and "embeddings" not in n and "lm_head" not in n]
    # 6 FLOPs per parameter of the matmuls (forward + backward), plus attention's scores
    # and values: 12 n_layers d_model seq_len
    fpt = 6.0 * cfg.num_non_embedding_params + 12.0 * cfg.n_layers * cfg.d_model * seq_len
    return {"shapes": shapes, "flops_per_token": fpt, "params": cfg.num_params}


def factors(shapes: Sequence[tuple], max_dim: int, block_size: Optional[int],
            optimizer: str = "soap") -> Counter:
    """{factor size: count} of these weights under the optimizer's blocking and its rule of
    which dimensions of a block get a factor (``Method.has_factor``)."""
    method = method_of(optimizer).METHOD(None)
    group = {"block_size": block_size, "max_precond_dim": max_dim,
             "max_preconditioner_dim": max_dim, "merge_dims": False}
    out: Counter = Counter()
    for shape in shapes:
        for block in make_layout(torch.Size(shape), block_size, False, max_dim).block_shapes:
            for d, has in zip(block, method.has_factor(block, group)):
                if has:
                    out[d] += 1
    return out


def round_jobs(sizes: Counter, optimizer: str) -> list:
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    return [C.JobSpec(op, torch.float32, n, k, p=p) for n, k in sorted(sizes.items())]


def row(model: C.CostModel, name: str, sizes: Counter, optimizer: str, cores: int,
        step_s: float, staleness: int, frequency: int, device: int, tokens: Optional[int]):
    jobs = round_jobs(sizes, optimizer)
    lanes = {Lane.HOST: cores, **({Lane.DEVICE: 1} if device else {})}
    round_s = C.split_makespan(model, jobs, lanes)
    whole_s = C.makespan(model, jobs, cores)
    gflop = sum(j.flops for j in jobs) / 1e9
    window = staleness * step_s
    s_min = C.smallest_s(round_s, step_s)
    w_min = C.smallest_workers(model, jobs, window, True, device)
    busy = sum(model.job_seconds(Lane.HOST, j) for j in jobs)
    return {"model": name, "tokens": tokens, "step_s": step_s,
            "factors": sum(sizes.values()), "sizes": dict(sorted(sizes.items())),
            "gflop": gflop, "round_s": round_s, "round_whole_jobs_s": whole_s,
            "window_s": window, "utilisation": min(1.0, busy / (cores * frequency * step_s)),
            "smallest_s": s_min, "fits": s_min is not None and s_min <= staleness,
            "smallest_cores": w_min}


def fmt_table(rows: list, cores: int, staleness: int, frequency: int, markdown: bool) -> str:
    head = ["model", "tokens/GPU/step", "step s", "factors", "GFLOP/round",
            f"round s ({cores} cores)", f"window S={staleness} (s)",
            f"pool busy (f={frequency})", "smallest S", f"cores for S={staleness}",
            f"hidden at S={staleness}"]
    lines = []
    for r in rows:
        s_min = r["smallest_s"]
        lines.append([r["model"], "-" if r["tokens"] is None else f"{r['tokens'] // 1024}k",
                      f"{r['step_s']:.2f}", str(r["factors"]), f"{r['gflop']:.0f}",
                      f"{r['round_s']:.1f}", f"{r['window_s']:.1f}",
                      f"{100 * r['utilisation']:.0f}%",
                      str(s_min) + ("" if s_min <= frequency else f" (> f={frequency})"),
                      "> 256" if r["smallest_cores"] is None else str(r["smallest_cores"]),
                      "yes" if r["fits"] else "no"])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out)
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(head)]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    out += ["  ".join(c.ljust(w) for c, w in zip(x, widths)) for x in lines]
    return "\n".join(out)


def parse_shape(s: str) -> tuple:
    try:
        dims = tuple(int(x) for x in s.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) < 2 or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape {s!r}: expected sizes joined by x, e.g. "
                                         f"2048x8192")
    return dims


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m asteria.plan", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[])
    ap.add_argument("--shape", action="append", type=parse_shape, default=[],
                    help="a weight shape (e.g. 2048x8192); repeat for each weight")
    ap.add_argument("--optimizer", choices=sorted(METHODS), default="soap")
    ap.add_argument("--cores", type=int, default=14, help="host cores (workers) per GPU")
    ap.add_argument("--gflops-per-core", type=float, default=None,
                    help="per-core REFRESH throughput; default: measured here (libasteria's "
                         "pool, one worker, the optimizer's op at 256, 512, 1024)")
    ap.add_argument("--device-gflops", type=float, default=None,
                    help="add a device lane of this throughput (hybrid rounds)")
    step = ap.add_mutually_exclusive_group()
    step.add_argument("--step-time", type=float, default=None, help="seconds per step")
    step.add_argument("--tokens", type=int, action="append", default=None,
                      help="tokens per GPU per step (presets: step time from the model's "
                           "FLOPs, --mfu and --peak-tflops); repeatable")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("-f", "--frequency", type=int, default=10, help="precondition_frequency")
    ap.add_argument("-S", "--staleness", type=int, default=5)
    ap.add_argument("--max-precond-dim", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if not args.preset and not args.shape:
        ap.error("give --preset and/or --shape")
    if args.shape and args.tokens:
        ap.error("--tokens needs a preset (its FLOPs per token); give --step-time for --shape")
    op = method_of(args.optimizer).METHOD.REFRESH_OP[0]
    if args.gflops_per_core is None:
        model = C.calibrate(ops=(op,), sizes=(256, 512, 1024))
        rates = ", ".join(f"{r['gflops']:.1f} at n={r['n']}" for r in model.table())
        source = f"measured here for {op} (libasteria pool, 1 worker): {rates} GFLOP/s"
    else:
        model = C.CostModel({Lane.HOST: args.gflops_per_core}, "given")
        source = f"given: {args.gflops_per_core} GFLOP/s per core"
    if args.device_gflops:
        model.base_gflops[Lane.DEVICE] = args.device_gflops
    models = [(p, preset(p, args.seq_len)) for p in args.preset]
    if args.shape:
        models.append(("shapes", {"shapes": args.shape, "flops_per_token": None}))
    rows = []
    for name, m in models:
        sizes = factors(m["shapes"], args.max_precond_dim, args.block_size, args.optimizer)
        if args.step_time is not None:
            steps = [(None, args.step_time)]
        else:
            toks = args.tokens or [65536, 524288]
            steps = [(t, m["flops_per_token"] * t / (args.mfu * args.peak_tflops * 1e12))
                     for t in toks]
        for tokens, step_s in steps:
            rows.append(row(model, name, sizes, args.optimizer, args.cores, step_s,
                            args.staleness, args.frequency,
                            1 if args.device_gflops else 0, tokens))
    print(fmt_table(rows, args.cores, args.staleness, args.frequency, args.markdown))
    print()
    print(f"per-core throughput: {source}; beyond the largest measured size the rate is held "
          f"(time grows as n^3).")
    print(f"{args.optimizer} ({op}), max_precond_dim {args.max_precond_dim}, block_size "
          f"{args.block_size}, f={args.frequency}, S={args.staleness}"
          + ("" if args.step_time is not None else
             f"; step time = FLOPs/token x tokens / ({args.mfu:.0%} MFU x "
             f"{args.peak_tflops:.0f} TFLOP/s)"))
    for r in {r["model"]: r for r in rows}.values():
        sizes = ", ".join(f"{k} x{n}" for n, k in r["sizes"].items())
        print(f"{r['model']}: factors {sizes}; a round as one job per size on one worker each "
              f"(the CPU-only executor) would take {r['round_whole_jobs_s']:.1f} s")
    if args.device_gflops:
        print(f"with a device lane of {args.device_gflops} GFLOP/s (hybrid rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
