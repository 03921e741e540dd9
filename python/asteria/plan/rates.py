"""The lanes' rates the planner prices a round at: this machine's per-core rate, measured here
(``calibrated``), and the device lane's (``device_rate``).

The device executor (``refresh_device``) computes on the device, with no transfer, at the
device lane's rate: given (``--device-gflops``), else measured by benchmarks/gpu_microbench.py
(``--gpu-json``, by default where tests/gpu/run.sh leaves it), else a published figure
(``asteria.refresh.cost.DEVICE_PRIOR_GFLOPS``, labelled so); a line says which. The choices
(``-f auto``, the policy) take the device lane only where its rate is given or measured.

Owns: ``calibrated``, ``device_rate``. May call: ``asteria.refresh.cost`` (the model, its
calibration, the GPU microbenchmark's reader, the prior), ``asteria.refresh.engine`` (lane
names), ``asteria.optim.method`` (the method's op).
"""

from __future__ import annotations

from typing import Optional

from asteria.optim.method import method_of
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane


def calibrated(optimizer: str) -> tuple[C.CostModel, str]:
    """(this machine's per-core model for the optimizer's REFRESH op, where it comes from)."""
    op = method_of(optimizer).METHOD.REFRESH_OP[0]
    model = C.calibrate(ops=(op,), sizes=(256, 512, 1024))
    rates = ", ".join(f"{r['gflops']:.1f} at n={r['n']}" for r in model.table())
    return model, f"measured here for {op} (libasteria pool, 1 worker): {rates} GFLOP/s"


def device_rate(model: C.CostModel, device_gflops: Optional[float],
                gpu_json: Optional[str], optimizer: str) -> tuple[bool, str]:
    """Price ``model``'s device lane: ``device_gflops`` given, else the GPU microbenchmark's
    JSON at ``gpu_json`` (``cost.add_gpu_microbench``: its "highest" precision, float32 as the
    device executor computes unless a run sets TF32), else the published prior
    (``cost.DEVICE_PRIOR_GFLOPS``). Returns (whether the rate was given or measured: then the
    choices may take the device lane, where a run on a CUDA machine does by default), the
    sentence that says where it came from). ValueError from the JSON's reader, naming it."""
    if device_gflops:
        model.base_gflops[Lane.DEVICE] = device_gflops
        return True, f"given: {device_gflops:g} GFLOP/s (--device-gflops)"
    if gpu_json:
        rec = C.read_gpu_microbench(gpu_json)
        added = C.add_gpu_microbench(model, rec, "highest")
        if not added:
            raise ValueError(f"GPU microbenchmark JSON {gpu_json!r}: no result of "
                             f"{', '.join(C.GPU_MICROBENCH_OPS)} at precision 'highest'")
        op = method_of(optimizer).METHOD.REFRESH_OP[0]
        pts = ", ".join(f"{o} n={n} {s * 1e3:.1f} ms (batch {b})" for o, n, b, s in added)
        state = rec.get("state")
        return True, (f"measured on {rec.get('device_name', '?')} ({gpu_json}, "
                      f"{'state ' + repr(state) + ', ' if state != 'passed' else ''}float32 "
                      f"at precision 'highest', one factor's time at the largest batch): {pts}; "
                      f"{op} priced from "
                      + next((k for k, (_, ops) in C.GPU_MICROBENCH_OPS.items() if op in ops),
                             "the lane's other ops"))
    return False, (f"{C.DEVICE_PRIOR_SOURCE}: {C.DEVICE_PRIOR_GFLOPS:.0f} GFLOP/s for every "
                   f"op (docs/capacity.md; give --gpu-json or --device-gflops)")
