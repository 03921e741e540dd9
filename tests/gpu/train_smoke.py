"""Stage 1 of the GPU check (tests/gpu/run.sh): does Asteria train at all on this GPU?

In well under two minutes, each part written to the JSON (``--out``) as soon as it is done, so
a part that fails, or the stage's timeout, leaves the parts before it and its own error:

  libasteria   what the built asteria._C reaches: its CUDA build, a Shadow on the CUDA path
               (torch seeing a GPU that libasteria cannot reach is a failure: its CUDA runtime
               may be newer than the driver), the planner's probe of pinned and managed memory
               and the tier "auto" picks for a CUDA parameter's bases
  sync         SOAP mode "sync" (torch.linalg inline on the GPU): the reference
  async        SOAP mode "async", S=0, deterministic installs, the default tiers
  async-pinned the same with placement host_pinned: the staging ring and its stream
  sync-f32, async-f32   sync and async (default tiers) again in float32, the usual dtype
  fork-pinned  a forked child reads page-locked memory (the C pool re-runs jobs over such
               buffers in a forked child, pool.h; a driver that marks them MADV_DONTFORK
               would crash it): reported, not a failure of the stage

Every run trains the same small model for STEPS steps: square layers and more tokens than any
layer is wide, so every factor is full rank with distinct eigenvalues and the executors agree
to rounding. Checked: parameters finite after every step; in float64 each async run's
parameters equal sync's within TOL relative to the size of sync's whole update; in float32 the
losses within TOL_F32_LOSS of sync's at every step (the parameter difference is reported).
Not bitwise: cuSOLVER's and LAPACK's eigendecompositions are both backward stable (about
n * eps * |A| for n x n factors) but round differently, the async runs divide rounds between
host LAPACK and the device lane, and an eigenvector moves by that error over its eigenvalue's
gap. On a CPU the parameter comparison gives about 1e-10 in float64, and in float32 from 1e-3
to, once, 0.25 (a near-degenerate pair of eigenvalues turns its basis), which is why float32
is judged by its losses (they agree to about 1e-6 there). A tiered block read torn or stale, or
a basis from the wrong round, moves the float64 result at O(1).

    python3 tests/gpu/train_smoke.py --out $OUT/train_smoke.json     # run.sh, on the GPU
    python3 tests/gpu/train_smoke.py --device cpu --out /tmp/t.json  # the logic, any machine

Exit: 0 every check passed; 1 a check failed (the JSON says which); 77 no GPU (cuda only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
import traceback

import torch

WIDTH = 64       # every layer WIDTH x WIDTH: factors 64 x 64
LAYERS = 3
TOKENS = 256     # > WIDTH: full-rank factors
STEPS = 12
FREQ = 4         # precondition_frequency: refreshes at steps 1, 5, 9
DTYPE = torch.float64
TOL = 1e-6       # |async - sync| / |sync's whole update|, float64 (module doc)
TOL_F32_LOSS = 1e-3  # float32: |loss - sync's loss| / sync's loss, every step


class Terminated(Exception):
    pass


_TERMINATED: list = []  # the signal's message, once one came


def _on_term(signum, frame):  # coreutils timeout sends SIGTERM: record it, then exit
    # kept aside too: the exception may surface wrapped by the code it interrupted
    _TERMINATED.append(f"terminated by signal {signum} (the stage's timeout)")
    raise Terminated(_TERMINATED[-1])


def make_model(device: str, dtype: torch.dtype = DTYPE) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1]).to(device=device, dtype=dtype)


def batch(step: int, device: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, WIDTH, generator=g, dtype=dtype)
    a = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7), dtype=dtype)
    return x.to(device), torch.sin(x @ a).to(device)


def train(name: str, runtime: dict, device: str, dtype: torch.dtype,
          rec: dict) -> list[torch.Tensor]:
    import asteria

    model = make_model(device, dtype)
    start = [p.detach().clone() for p in model.parameters()]
    opt = asteria.SOAP(model.parameters(), lr=3e-3, precondition_frequency=FREQ,
                       runtime=runtime)
    out = {"runtime": runtime, "dtype": str(dtype), "plan": opt.asteria_plan(), "steps": []}
    rec[name] = out
    t0 = time.perf_counter()
    try:
        for step in range(1, STEPS + 1):
            x, y = batch(step, device, dtype)
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            out["steps"].append({"step": step, "loss": loss.item(), "finite": finite})
            if not finite:
                raise AssertionError(f"{name}: non-finite parameters after step {step}")
        if device == "cuda":
            torch.cuda.synchronize()
        st = opt.asteria_stats()
        out["stats"] = {k: v for k, v in st.items() if k.startswith(
            ("bytes_", "prefetch", "ring_", "jobs_", "installs", "split_", "workers"))}
    finally:
        opt.close()
        out["s"] = round(time.perf_counter() - t0, 3)
    final = [p.detach().clone() for p in model.parameters()]
    out["update_norm"] = math.sqrt(sum(float((f - s).double().pow(2).sum())
                                       for f, s in zip(final, start)))
    return final


def rel_diff(got: list, want: list, start_norm: float) -> float:
    d = math.sqrt(sum(float((a - b).double().pow(2).sum()) for a, b in zip(got, want)))
    return d / max(start_norm, 1e-30)


def libasteria_part(device: str) -> dict:
    from asteria import _C
    from asteria.tiers.plan import Capabilities

    out = {"have_cuda": bool(_C.HAVE_CUDA)}
    if device == "cuda":
        try:
            sh = _C.Shadow(mode="cuda", snapshot_ring_bytes=1 << 16, prefetch_ring_bytes=1 << 16)
            out["shadow"] = {k: v for k, v in sh.stats().items()
                             if k in ("is_cuda", "device", "priority")}
            sh.close()
        except Exception as exc:  # the finding this stage exists for: say it plainly
            out["shadow_error"] = f"{type(exc).__name__}: {exc}"
    caps = Capabilities.probe(device == "cuda")
    out["caps"] = {"pinned": caps.pinned, "pinned_reason": caps.pinned_reason,
                   "uvm": caps.uvm, "uvm_reason": caps.uvm_reason}
    return out


def fork_pinned() -> dict:
    """A forked child reads page-locked memory written by the parent."""
    t = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    pid = os.fork()
    if pid == 0:  # the child: plain host reads only, no CUDA
        ok = float(t[12345]) == 12345.0 and float(t.sum()) == float((1 << 16) * ((1 << 16) - 1) / 2)
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return {"ok": False, "detail": f"child killed by signal {os.WTERMSIG(status)}"}
    code = os.WEXITSTATUS(status)
    return {"ok": code == 0, "detail": "child read the pinned tensor" if code == 0
            else f"child exit {code}: wrong values"}



def stage_record(rec: dict, out: str, tag: str):
    """(write, check) over a stage's JSON record ``rec``: write() replaces ``out`` atomically
    (a stage killed at any point leaves its last whole record) with the wall time so far;
    check(name, ok, detail) records and prints one check, then writes."""
    t_start = time.perf_counter()

    def write() -> None:
        rec["wall_s"] = round(time.perf_counter() - t_start, 3)
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rec, f, indent=1, default=str)
        os.replace(tmp, out)

    def check(name: str, ok: bool, detail: str) -> None:
        rec["checks"][name] = {"ok": bool(ok), "detail": detail}
        print(f"[{tag}] {name}: {'ok' if ok else 'FAILED'} ({detail})", flush=True)
        write()

    return write, check


def record_failure(rec: dict, exc: BaseException, tag: str) -> None:
    """A stage's record after ``exc`` ended it: "timed out" when the stage's SIGTERM did it
    (Terminated, or whatever the handler's exception turned into on its way up), else
    "failed", with the traceback."""
    if isinstance(exc, Terminated):
        rec["state"], rec["error"] = "timed out", str(exc)
        return
    rec["state"] = "timed out" if _TERMINATED else "failed"
    rec["error"] = (_TERMINATED[0] + "\n" if _TERMINATED else "") + traceback.format_exc(limit=8)
    print(f"[{tag}] FAILED: {type(exc).__name__}: {exc}", flush=True)


def terminated(rec: dict) -> bool:
    """At a stage's end: did its SIGTERM come though no exception said so (one swallowed on the
    way up)? Then the record says "timed out", with the signal's message."""
    if not _TERMINATED or rec["state"] == "timed out":
        return False
    rec["state"] = "timed out"
    rec.setdefault("error", _TERMINATED[0])
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[train-smoke] no GPU: skipped")
        return 77
    rec = {"script": "tests/gpu/train_smoke.py", "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "tolerance": {"float64_params": TOL, "float32_loss": TOL_F32_LOSS},
           "steps_each": STEPS,
           "state": "running", "checks": {}}
    write, check = stage_record(rec, args.out, "train-smoke")
    write()
    failed = False
    host_tier = "host_pinned" if args.device == "cuda" else "host"
    try:
        lib = libasteria_part(args.device)
        rec["libasteria"] = lib
        check("libasteria", "shadow_error" not in lib and (args.device == "cpu" or lib["have_cuda"]),
              lib.get("shadow_error") or f"HAVE_CUDA={lib['have_cuda']}, pinned={lib['caps']['pinned']}"
              f", uvm={lib['caps']['uvm']} ({lib['caps']['uvm_reason'] or 'coherent'})")
        base = {"mode": "async", "staleness": 0, "install": "deterministic"}
        f32 = torch.float32
        runs = {"sync": ({"mode": "sync"}, DTYPE), "async": (dict(base), DTYPE),
                "async-pinned": (dict(base, placement={"eigenbases": host_tier}), DTYPE),
                "sync-f32": ({"mode": "sync"}, f32), "async-f32": (dict(base), f32)}
        finals = {}
        for name, (runtime, dtype) in runs.items():
            try:
                finals[name] = train(name, runtime, args.device, dtype, rec)
                check(name, True, f"{STEPS} steps, finite, {rec[name]['s']} s")
            except Terminated:
                raise
            except Exception as exc:
                rec[name]["error"] = traceback.format_exc(limit=8)
                check(name, False, f"{type(exc).__name__}: {exc}")
                failed = True
        for name, ref in (("async", "sync"), ("async-pinned", "sync"), ("async-f32", "sync-f32")):
            if ref not in finals or name not in finals:
                continue
            d = rel_diff(finals[name], finals[ref], rec[ref]["update_norm"])
            rec[name]["rel_diff_to_sync"] = d
            if rec[name]["dtype"] == str(DTYPE):
                check(f"{name}={ref}", d <= TOL, f"|{name} - {ref}| / |{ref} update| = "
                      f"{d:.2e} (tolerance {TOL:g})")
                failed |= d > TOL
                continue
            dl = max(abs(a["loss"] - b["loss"]) / abs(b["loss"])
                     for a, b in zip(rec[name]["steps"], rec[ref]["steps"]))
            rec[name]["loss_rel_diff_to_sync"] = dl
            check(f"{name}={ref}", dl <= TOL_F32_LOSS, f"losses within {dl:.2e} of {ref}'s "
                  f"(tolerance {TOL_F32_LOSS:g}); parameters {d:.2e} of its update")
            failed |= dl > TOL_F32_LOSS
        if "async-pinned" in rec and "stats" in rec["async-pinned"]:
            st = rec["async-pinned"]["stats"]
            ring = st.get("prefetches", 0) > 0 and st.get("bytes_h2d_ring", 0) > 0
            check("ring-used", ring, f"prefetches {st.get('prefetches')}, "
                  f"bytes_h2d_ring {st.get('bytes_h2d_ring')}")
            failed |= not ring
        if args.device == "cuda":
            fk = fork_pinned()
            rec["fork_pinned"] = fk
            print(f"[train-smoke] fork-pinned: {'ok' if fk['ok'] else 'PROBLEM'} "
                  f"({fk['detail']}; reported only)", flush=True)
        rec["state"] = "failed" if failed else "passed"
    except BaseException as exc:
        record_failure(rec, exc, "train-smoke")
        failed = True
    finally:
        if terminated(rec):
            failed = True
        write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
