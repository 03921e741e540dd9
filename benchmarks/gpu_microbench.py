"""What a GPU's own REFRESH kernels cost: torch.linalg.eigh, torch.linalg.qr, one QR power step
and the drift score's GEMMs, in float32 at full precision ("highest") against TF32 ("high"),
per size n and batch: the rates the planner (asteria.plan) needs to price a device lane.

Ops, on a batch of b symmetric positive definite n x n factors L (A A^T / n + I) and n x n
matrices Q (Gaussian / sqrt(n): every op's cost is that of any dense operand):

  linalg_eigh     torch.linalg.eigh(L): eigenvalues and eigenvectors (cuSOLVER on CUDA)
  linalg_qr       torch.linalg.qr(Q): Q and R
  qr_power_step   torch.linalg.qr(L @ Q): one step of SOAP's QR refresh (a GEMM, then QR)
  score_gemm      B = Q^T (L Q) and the drift score r = ||B - diag(B)||_F / ||B||_F: two
                  GEMMs and the norms

Precisions: "highest" (torch.set_float32_matmul_precision("highest"): IEEE float32 GEMMs) and
"tf32" ("high": TF32 tensor cores where the GPU has them). The setting is torch's, process-wide;
whether a library call obeys it is the library's (cuBLAS GEMMs do; cuSOLVER's factorisations
may not), which is why every op is timed under both.

Timing: on CUDA, CUDA events around each call (the stream synchronised before the first), one
untimed call first (cuSOLVER's workspace, cuBLAS's heuristics), then calls until --rep-s of
them or --max-reps; on the CPU (--device cpu: the logic, any machine) time.perf_counter. Order:
batch ascending, then n ascending, precision, op: one factor at every size (the planner's rate)
before the batches, and what is cheap first. Budget (--budget-s): a
measurement whose predicted time (the same op and precision measured at a smaller size, scaled
by n^3 and the batch, times the calls it would make) exceeds what is left is skipped, and so is
one whose tensors would not fit the device's free memory (an estimate: SIZE_FACTOR tensors of
b x n x n float32); each skip is listed with its reason. An out-of-memory error skips that one
measurement too. The JSON is rewritten after every measurement, so a stage timed out from
outside leaves what it measured.

JSON (--out), schema "asteria.gpu_microbench/1":
  schema, state ("running", "passed", "failed", "timed out"), error (where not passed),
  date (UTC, ISO 8601), device ("cuda" / "cpu"), device_name (torch's name of the GPU, or the
  CPU's model), torch (torch.__version__), cuda (torch.version.cuda or null),
  dtype ("float32"), sizes, batches, precisions, ops (what was asked),
  budget_s, wall_s (spent so far), memory {total_bytes, free_bytes} (CUDA at the start; null
  on the CPU),
  results: [{op, n, batch, precision, ms (median of the timed calls, one call = the whole
             batch), ms_min, reps}],
  skipped: [{op, n, batch, precision, reason}].
The planner reads results: ms / batch is one factor's time at that n, op and precision.

    python3 benchmarks/gpu_microbench.py --out $OUT/gpu_microbench.json --budget-s 60  # run.sh
    python3 benchmarks/gpu_microbench.py --device cpu --sizes 64 --batches 1 --out /tmp/m.json

Exit: 0 measured (skips included); 1 an error (the JSON says which); 77 no GPU (cuda only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch

SCHEMA = "asteria.gpu_microbench/1"
TAG = "[gpu-microbench]"
SIZES = (1024, 2048, 4096, 8192)
BATCHES = (1, 16)
OPS = ("linalg_eigh", "linalg_qr", "qr_power_step", "score_gemm")
PRECISIONS = {"highest": "highest", "tf32": "high"}  # ours -> torch.set_float32_matmul_precision
#: b x n x n float32 tensors a measurement holds at its peak, at most (L, Q, L Q or B, the
#: outputs, the solver's workspace): the memory check's estimate
SIZE_FACTOR = 6
MEMORY_SHARE = 0.8   # of the free memory a measurement may plan to use


class Terminated(Exception):
    """The stage's SIGTERM (its timeout)."""


def _on_term(signum, frame):
    raise Terminated(f"terminated by signal {signum} (the stage's timeout)")


def make_ops() -> dict[str, Callable]:
    """op name -> f(L, Q) running it once on the batch."""
    def score(L, Q):
        B = Q.mT @ (L @ Q)
        off = B - torch.diag_embed(torch.diagonal(B, dim1=-2, dim2=-1))
        return torch.linalg.matrix_norm(off) / torch.linalg.matrix_norm(B)

    return {"linalg_eigh": lambda L, Q: torch.linalg.eigh(L),
            "linalg_qr": lambda L, Q: torch.linalg.qr(Q),
            "qr_power_step": lambda L, Q: torch.linalg.qr(L @ Q),
            "score_gemm": score}


def inputs(n: int, batch: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, Q): b symmetric positive definite n x n factors and b Gaussian n x n matrices."""
    g = torch.Generator(device=device).manual_seed(n * 131 + batch)
    A = torch.randn(batch, n, n, generator=g, device=device)
    L = A @ A.mT / n
    del A
    L.diagonal(dim1=-2, dim2=-1).add_(1.0)
    Q = torch.randn(batch, n, n, generator=g, device=device) / n ** 0.5
    return L, Q


class Clock:
    """Wall time of one call on ``device``: CUDA events (the work queued between them) or
    perf_counter."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def device_facts(device: str) -> dict[str, Any]:
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return {"device_name": torch.cuda.get_device_name(), "memory": {
            "total_bytes": total, "free_bytes": free}}
    name = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f
                         if ln.lower().startswith("model name")), name)
    except OSError:
        pass
    return {"device_name": name, "memory": None}


class Bench:
    """The measurements of one run into ``rec`` (the JSON), within ``budget_s``."""

    def __init__(self, rec: dict, args, write: Callable[[], None]) -> None:
        self.rec, self.args, self.write = rec, args, write
        self.clock = Clock(args.device)
        self.t0 = time.perf_counter()
        self.ops = make_ops()
        # (op, precision) -> (n, batch, ms per call) of its largest measurement so far
        self.seen: dict[tuple, tuple] = {}

    def left_s(self) -> float:
        return self.args.budget_s - (time.perf_counter() - self.t0)

    def skip(self, op: str, n: int, batch: int, prec: str, reason: str) -> None:
        self.rec["skipped"].append({"op": op, "n": n, "batch": batch, "precision": prec,
                                    "reason": reason})
        print(f"{TAG} skipped {op} n={n} batch={batch} {prec}: {reason}", flush=True)
        self.write()

    def predicted_s(self, op: str, prec: str, n: int, batch: int) -> Optional[float]:
        """The time a measurement would take: the untimed call and up to --max-reps timed
        calls, or --rep-s, from the same op and precision at its largest measured size."""
        prior = self.seen.get((op, prec))
        if prior is None:
            return None
        n0, b0, ms0 = prior
        call_s = ms0 / 1e3 * (n / n0) ** 3 * batch / b0
        return call_s + min(self.args.max_reps * call_s, max(self.args.rep_s, call_s))

    def fits_memory(self, n: int, batch: int) -> Optional[str]:
        """None where b x n x n float32 tensors (SIZE_FACTOR of them) fit the free memory;
        else why not."""
        if self.args.device != "cuda":
            return None
        need = SIZE_FACTOR * batch * n * n * 4
        free, _ = torch.cuda.mem_get_info()
        if need > MEMORY_SHARE * free:
            return (f"out of memory: about {need / 2**30:.1f} GiB ({SIZE_FACTOR} tensors of "
                    f"{batch} x {n} x {n} float32) > {MEMORY_SHARE:.0%} of the "
                    f"{free / 2**30:.1f} GiB free")
        return None

    def measure(self, op: str, n: int, batch: int, prec: str, L, Q) -> None:
        fn = self.ops[op]
        torch.set_float32_matmul_precision(PRECISIONS[prec])
        self.clock.sync()
        first = self.clock.time_ms(lambda: fn(L, Q))  # untimed: set-up, workspace
        times: list[float] = []
        while len(times) < self.args.max_reps and (not times or sum(times) / 1e3 < self.args.rep_s):
            if (times[-1] if times else first) / 1e3 > self.left_s():  # the next call would not fit
                break
            times.append(self.clock.time_ms(lambda: fn(L, Q)))
        if not times:  # the budget ran out after the untimed call: that call is the figure
            times = [first]
        ms = statistics.median(times)
        self.rec["results"].append({"op": op, "n": n, "batch": batch, "precision": prec,
                                    "ms": round(ms, 4), "ms_min": round(min(times), 4),
                                    "reps": len(times)})
        prior = self.seen.get((op, prec))
        if prior is None or n ** 3 * batch >= prior[0] ** 3 * prior[1]:
            self.seen[(op, prec)] = (n, batch, ms)
        print(f"{TAG} {op} n={n} batch={batch} {prec}: {ms:.3f} ms ({len(times)} calls)",
              flush=True)
        self.write()

    def run(self) -> None:
        a = self.args
        for batch in sorted(a.batches):
            for n in sorted(a.sizes):
                todo = [(prec, op) for prec in a.precisions for op in a.ops]
                why = self.fits_memory(n, batch)
                if why is None:
                    try:
                        L, Q = inputs(n, batch, a.device)
                    except torch.cuda.OutOfMemoryError as e:
                        why = f"out of memory making the inputs: {str(e).splitlines()[0]}"
                if why is not None:
                    for prec, op in todo:
                        self.skip(op, n, batch, prec, why)
                    continue
                for prec, op in todo:
                    pred = self.predicted_s(op, prec, n, batch)
                    left = self.left_s()
                    if left <= 0 or (pred is not None and pred > left):
                        self.skip(op, n, batch, prec, f"would not fit the budget: "
                                  f"{max(left, 0):.1f} s left of {a.budget_s:g} s"
                                  + (f", predicted {pred:.1f} s" if pred is not None else ""))
                        continue
                    try:
                        self.measure(op, n, batch, prec, L, Q)
                    except torch.cuda.OutOfMemoryError as e:
                        if a.device == "cuda":
                            torch.cuda.empty_cache()
                        self.skip(op, n, batch, prec,
                                  f"out of memory: {str(e).splitlines()[0]}")
                del L, Q
                if a.device == "cuda":
                    torch.cuda.empty_cache()


def _ints(text: str) -> list[int]:
    out = [int(x) for x in text.split(",") if x.strip()]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed: positive integers, comma-separated")
    return out


def _names(allowed) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        out = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in out if x not in allowed]
        if not out or bad:
            raise argparse.ArgumentTypeError(f"{text!r}: allowed: {', '.join(allowed)}")
        return out
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON file")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--sizes", type=_ints, default=list(SIZES), help="n, comma-separated")
    ap.add_argument("--batches", type=_ints, default=list(BATCHES), help="b, comma-separated")
    ap.add_argument("--ops", type=_names(OPS), default=list(OPS))
    ap.add_argument("--precisions", type=_names(tuple(PRECISIONS)), default=list(PRECISIONS))
    ap.add_argument("--budget-s", type=float, default=60.0,
                    help="seconds for the measurements and their inputs together (the "
                         "device's start not counted)")
    ap.add_argument("--rep-s", type=float, default=0.5,
                    help="timed calls per measurement until they took this long")
    ap.add_argument("--max-reps", type=int, default=5)
    args = ap.parse_args(argv)
    if args.budget_s <= 0 or args.rep_s < 0 or args.max_reps < 1:
        ap.error("need --budget-s > 0, --rep-s >= 0 and --max-reps >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"{TAG} no GPU: skipped", flush=True)
        return 77
    t_start = time.perf_counter()
    rec: dict[str, Any] = {
        "schema": SCHEMA, "state": "running",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
        "dtype": "float32", "sizes": args.sizes, "batches": args.batches,
        "precisions": args.precisions, "ops": args.ops, "budget_s": args.budget_s,
        "results": [], "skipped": []}

    def write() -> None:
        rec["wall_s"] = round(time.perf_counter() - t_start, 3)
        tmp = args.out + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)

    before = torch.get_float32_matmul_precision()
    try:
        rec.update(device_facts(args.device))
        print(f"{TAG} {rec['device_name']}, torch {rec['torch']}, budget {args.budget_s:g} s",
              flush=True)
        write()
        Bench(rec, args, write).run()
        rec["state"] = "passed"
        print(f"{TAG} {len(rec['results'])} measured, {len(rec['skipped'])} skipped", flush=True)
        return 0
    except Terminated as e:
        rec["state"], rec["error"] = "timed out", str(e)
        return 1
    except Exception as e:  # recorded, then the stage fails
        rec["state"], rec["error"] = "failed", traceback.format_exc(limit=8)
        print(f"{TAG} FAILED: {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        torch.set_float32_matmul_precision(before)
        write()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # past here a SIGTERM just ends it


if __name__ == "__main__":
    sys.exit(main())
