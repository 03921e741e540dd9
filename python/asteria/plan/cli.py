"""``python3 -m asteria.plan``: will the REFRESH work keep up, for a model this machine need not hold?

The command line of the planner (``main``): its arguments and their checks, the step time from
tokens per step (the forward and backward's FLOPs at ``--mfu`` of ``--peak-tflops``, by default
``H200_BF16_TFLOPS``), and the order of its answers. With ``--tokens`` the S = 0 window's share
of the step (``--fb-share``) defaults to 1 (the optimizer's own step is not in it); with
``--step-time`` a measured step also holds the optimizer's step and the data loading, and the
share defaults to 0.9 (an assumption, printed with the table: give the share measured, e.g.
``asteria_stats()``'s ``capacity_fb_s`` / ``capacity_step_s``).

PCIe (``--pcie-gbps``, per direction; 0 leaves transfers out). The default, ``PCIE_GBPS`` =
50 GB/s, is a planning figure for PCIe 5.0 x16: 32 GT/s x 16 lanes with 128b/130b encoding is
63 GB/s per direction (the PCI-SIG PCIe 5.0 base specification), and packet headers and flow
control leave about 80% of that to large copies; it is not measured here. The GPU
microbenchmark's JSON is read by default from ``GPU_JSON``, where it is present.

The widening of quantized bases (``--fp32-tflops``): the device's float32 matmul rate. The
default, ``H200_FP32_TFLOPS`` = 67 TFLOP/s, is the published float32 peak of an H100 or H200
SXM without tensor cores, what torch's float32 matmuls use unless TF32 is allowed; a peak, so
the seconds it gives are a lower bound. Not measured here.

Owns: the arguments, ``main``. May call: the planner's modules (``asteria.plan.*``),
``asteria.optim`` (the methods), ``asteria.refresh.cost``, ``asteria.refresh.engine`` (lane
names), ``asteria.config`` (the tier dtypes), ``asteria.tiers.plan`` (the quantized ones).
"""

from __future__ import annotations

import argparse
import os
from collections import Counter
from typing import Optional, Sequence

from asteria.config import TIER_DTYPES, TIER_QUANT_BLOCK, TIER_RECTIFY_STEPS
from asteria.optim import METHODS
from asteria.optim.method import method_of
from asteria.plan.rates import calibrated, device_rate
from asteria.plan.replicas import PARALLEL, replica_round
from asteria.plan.report import (auto_line, fmt_policy, fmt_table, fmt_tiers, policy_note,
                                 replicas_note)
from asteria.plan.shapes import PRESETS, factors, preset
from asteria.plan.storage import output_kind, tier_bytes
from asteria.plan.verdict import row
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane
from asteria.tiers.plan import QUANTIZED

H200_BF16_TFLOPS = 989.0  # dense bf16 peak
#: float32 peak without tensor cores (H100 / H200 SXM, published): torch's float32 matmuls
#: by default (TF32 off), which widen a quantized tier's bases
H200_FP32_TFLOPS = 67.0


def frequency_arg(s: str):
    if s == "auto":
        return s
    try:
        return positive(s)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 1, or auto") from None


def staleness_arg(s: str):
    if s == "auto":
        return s
    try:
        v = int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 0, or auto")
    return v


def bounded_float(low: float, high: float, allowed: str):
    """An argparse type: a float in [low, high]; the error says what is ``allowed``."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = float("nan")
        if not low <= v <= high:
            raise argparse.ArgumentTypeError(f"{s!r}: allowed: {allowed}")
        return v
    return parse


share_arg = bounded_float(0.0, 1.0, "a fraction in [0, 1]")
rate_arg = bounded_float(0.0, float("inf"), "GB/s >= 0 (0: transfers left out)")
tflops_arg = bounded_float(1e-9, float("inf"), "TFLOP/s > 0")


PCIE_GBPS = 50.0  # PCIe 5.0 x16 per direction, a planning figure (module doc)


def positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: allowed: an integer >= 1")
    return v


def parse_shape(s: str) -> tuple:
    try:
        dims = tuple(int(x) for x in s.lower().split("x"))
    except ValueError:
        dims = ()
    if len(dims) < 2 or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape {s!r}: expected sizes joined by x, e.g. "
                                         f"2048x8192")
    return dims


#: where tests/gpu/run.sh leaves the GPU microbenchmark when $OUT is not set, from the
#: repository's root: the planner reads it from there when present
GPU_JSON = os.path.join("benchmarks", "results", "gpu_microbench.json")


def gpu_json_arg(s: str) -> str:
    if s != "none" and not os.path.isfile(s):
        raise argparse.ArgumentTypeError(f"{s!r}: no such file; allowed: the JSON of "
                                         f"benchmarks/gpu_microbench.py, or none")
    return s


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m asteria.plan", description=__doc__.split(
        "\n")[0])
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), default=[])
    ap.add_argument("--shape", action="append", type=parse_shape, default=[],
                    help="a weight shape (e.g. 2048x8192); repeat for each weight")
    ap.add_argument("--optimizer", choices=sorted(METHODS), default="soap")
    ap.add_argument("--cores", type=positive, default=14, help="host cores (workers) per GPU")
    ap.add_argument("--nodes", type=positive, default=1, help="nodes of the job (default 1)")
    ap.add_argument("--gpus-per-node", type=positive, default=1,
                    help="ranks (GPUs) per node (default 1)")
    ap.add_argument("--parallel", choices=PARALLEL, default="hsdp",
                    help="how the weights are laid out over the ranks: ddp (replicated on "
                         "every rank), hsdp (dim 0 sharded over a node's GPUs, replicated "
                         "across nodes), fsdp (sharded over all ranks); default hsdp")
    ap.add_argument("--gflops-per-core", type=float, default=None,
                    help="per-core REFRESH throughput; default: measured here (libasteria's "
                         "pool, one worker, the optimizer's op at 256, 512, 1024)")
    dev = ap.add_mutually_exclusive_group()
    dev.add_argument("--device-gflops", type=float, default=None,
                     help="the device lane's throughput, given (hybrid rounds)")
    dev.add_argument("--gpu-json", type=gpu_json_arg, default=None,
                     help="the device lane's rates from benchmarks/gpu_microbench.py's JSON "
                          f"(default: {GPU_JSON} where present; none: the published prior)")
    step = ap.add_mutually_exclusive_group()
    step.add_argument("--step-time", type=float, default=None, help="seconds per step")
    step.add_argument("--tokens", type=int, action="append", default=None,
                      help="tokens per GPU per step (presets: step time from the model's "
                           "FLOPs, --mfu and --peak-tflops); repeatable")
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS)
    ap.add_argument("--fp32-tflops", type=tflops_arg, default=H200_FP32_TFLOPS,
                    help=f"the device's float32 matmul rate, TFLOP/s, that prices the widening "
                         f"of int8 / int4 bases each step (default {H200_FP32_TFLOPS:g}: an "
                         "H100's or H200's float32 peak without tensor cores)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("-f", "--frequency", type=frequency_arg, default=10,
                    help="precondition_frequency: an integer >= 1, or auto (chosen here as "
                         "the runtime would)")
    ap.add_argument("-S", "--staleness", type=staleness_arg, default=None,
                    help="an integer >= 0, or auto (with -f auto: chosen with f); default 5, "
                         "with -f auto: auto")
    ap.add_argument("--fb-share", type=share_arg, default=None,
                    help="the forward and backward's share of the step time, the S=0 window "
                         "(default: 1 with --tokens, whose step is the forward and backward's "
                         "FLOPs; 0.9 with --step-time)")
    ap.add_argument("--pcie-gbps", type=rate_arg, default=PCIE_GBPS,
                    help=f"host<->device copy rate per direction, GB/s (default {PCIE_GBPS:g}: "
                         "PCIe 5.0 x16's 63 GB/s less packet overhead; 0: transfers left out)")
    ap.add_argument("--tier-dtype", choices=TIER_DTYPES, default="float32",
                    help="the runtime's tier_dtype: the form of the bases the installs copy "
                         "back (the bytes table lists every one)")
    ap.add_argument("--max-precond-dim", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    if not args.preset and not args.shape:
        ap.error("give --preset and/or --shape")
    if args.shape and args.tokens:
        ap.error("--tokens needs a preset (its FLOPs per token); give --step-time for --shape")
    if args.staleness is None:
        args.staleness = "auto" if args.frequency == "auto" else 5
    if args.staleness == "auto" and args.frequency != "auto":
        ap.error("-S auto needs -f auto here (staleness 'auto' with an integer f is chosen "
                 "from a run's measurements: optimizer.asteria_plan())")
    if args.fb_share is None:
        args.fb_share = 0.9 if args.step_time is not None else 1.0
    kind = output_kind(args.optimizer)
    if args.tier_dtype in QUANTIZED and kind != "eigenbases":
        ap.error(f"argument --tier-dtype: {args.tier_dtype!r} with --optimizer "
                 f"{args.optimizer} ({kind}): only eigenbases are quantized; allowed: "
                 f"float32, bfloat16")
    if args.gpu_json is None and args.device_gflops is None and os.path.isfile(GPU_JSON):
        args.gpu_json = GPU_JSON
    op = method_of(args.optimizer).METHOD.REFRESH_OP[0]
    if args.gflops_per_core is None:
        model, source = calibrated(args.optimizer)
    else:
        model = C.CostModel({Lane.HOST: args.gflops_per_core}, "given")
        source = f"given: {args.gflops_per_core} GFLOP/s per core"
    try:
        device, device_source = device_rate(model, args.device_gflops,
                                            None if args.gpu_json == "none" else args.gpu_json,
                                            args.optimizer)
    except ValueError as e:
        ap.error(f"argument --gpu-json: {e}")
    models = [(p, preset(p, args.seq_len)) for p in args.preset]
    if args.shape:
        models.append(("shapes", {"shapes": args.shape, "flops_per_token": None}))
    rows, tiers = [], []
    world = args.nodes * args.gpus_per_node
    for name, m in models:
        sizes = factors(m["shapes"], args.max_precond_dim, args.block_size, args.optimizer)
        rep = None if world == 1 else replica_round(
            m["shapes"], args.optimizer, args.nodes, args.gpus_per_node, args.parallel,
            args.cores, model, args.max_precond_dim, args.block_size, device=int(device))
        held = [sizes] if rep is None else [Counter(h) for h in rep["held_factors"]]
        for dt in TIER_DTYPES:
            b = [tier_bytes(h, args.optimizer, dt) for h in held]
            tiers.append((name, world, dt, None if None in b else
                          max(b, key=lambda x: x["host"])))
        if args.step_time is not None:
            steps = [(None, args.step_time)]
        else:
            toks = args.tokens or [65536, 524288]
            steps = [(t, m["flops_per_token"] * t / (args.mfu * args.peak_tflops * 1e12))
                     for t in toks]
        for tokens, step_s in steps:
            rows.append(row(model, name, sizes, args.optimizer, args.cores, step_s,
                            args.staleness, args.frequency, int(device), tokens,
                            fb_share=args.fb_share, pcie_gbps=args.pcie_gbps,
                            owned=None if rep is None else rep["owner_factors"],
                            replicated=rep is not None and rep["replica_set_size"] > 1,
                            tier_dtype=args.tier_dtype))
            if rep is not None:
                rows[-1]["replicas"] = rep
    print(fmt_table(rows, args.cores, args.staleness, args.frequency, args.markdown))
    print()
    print(f"per-core throughput: {source}; beyond the largest measured size the rate is held "
          f"(time grows as n^3).")
    print(f"device executor's rate: {device_source}" + (
        "; the choices below may take the device lane (a run on a CUDA machine does by "
        "default, refresh_device=True)" if device else
        "; the choices below are the host workers' (give the device's rate to add it)"))
    print(f"{args.optimizer} ({op}), max_precond_dim {args.max_precond_dim}, block_size "
          f"{args.block_size}, f={args.frequency}, S={args.staleness}, tier_dtype "
          f"{args.tier_dtype}" + ("" if args.step_time is not None else
             f"; step time = FLOPs/token x tokens / ({args.mfu:.0%} MFU x "
             f"{args.peak_tflops:.0f} TFLOP/s)"))
    print(f"window at S=0: the next forward and backward, {args.fb_share:g} x the step "
          f"time; at S >= 1: S x the step time")
    for r in {r["model"]: r for r in rows}.values():
        sizes = ", ".join(f"{k} x{n}" for n, k in r["sizes"].items())
        print(f"{r['model']}: factors {sizes}; a round as one job per size on one worker each "
              f"(the CPU-only executor) would take {r['round_whole_jobs_s']:.1f} s")
        print(f"{r['model']}: PCIe per round on the host workers: {r['bytes_d2h'] / 1e9:.2f} GB "
              f"device-to-host (the factors) + {r['bytes_h2d'] / 1e9:.2f} GB host-to-device "
              f"(the new bases / roots) at {args.pcie_gbps:g} GB/s per direction = "
              f"{r['transfer_s']:.2f} s, in the round; on the device executor the round "
              f"takes {r['device_round_s']:.1f} s")
    for r in rows:
        print(auto_line(r, args) if r["frequency_auto"] else "", end="")
        tok = "" if r["tokens"] is None else f" at {r['tokens'] // 1024}k tokens"
        whose = "" if r["run_rank"] is None else " (the slowest rank's)"
        if r["refresh_on"] == "device":
            print(f"{r['model']}{tok}: the host workers' round{whose} with its transfers "
                  f"({r['run_host_s']:.1f} s) does not fit the window ({r['window_s']:.1f} s) "
                  f"but the device executor's ({r['run_device_s']:.1f} s) does: it must "
                  f"take the round (runtime refresh_device=True)")
        elif r["refresh_on"] == "neither":
            print(f"{r['model']}{tok}: neither the host workers' round{whose} with its "
                  f"transfers ({r['run_host_s']:.1f} s) nor the device executor's "
                  f"({r['run_device_s']:.1f} s) fits the window ({r['window_s']:.1f} s)")
    if world > 1:
        print(replicas_note(args, rows))
    print()
    print(fmt_policy(rows, args.markdown))
    print()
    print(policy_note(rows, device))
    print()
    print(fmt_tiers(tiers, args.pcie_gbps, args.fp32_tflops, args.markdown))
    print()
    print(f"bytes per GPU (the rank holding the most; placement \"auto\", mode \"async\"): "
          f"every root / eigenbasis of its factors in host memory (on NVMe when spilled: the "
          f"same payload, each record adding a header, a CRC and zeros to 4 KiB); each "
          f"install copies the new basis to the device as stored (SOAP: with its sort order, "
          f"n int64); with no coherent host access (an H100 on x86) the staging ring copies "
          f"every basis to the device each step. int8 / int4: blocks of "
          f"{TIER_QUANT_BLOCK['int8']} (int8) / {TIER_QUANT_BLOCK['int4']} (int4) values with one "
          f"float32 scale each (libasteria's "
          f"quant_layout), eigenbases only (Shampoo's roots are refused); every step widens "
          f"each quantized basis on the device: {TIER_RECTIFY_STEPS['int8']} / "
          f"{TIER_RECTIFY_STEPS['int4']} Bjorck steps (int8 / int4) of 4 n^3 FLOPs, priced at "
          f"--fp32-tflops (a peak: a lower bound on the time)")
    return 0
