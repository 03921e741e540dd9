"""How well the cost model (asteria.refresh.cost) predicts a round on libasteria's pool.

``prediction_check`` runs rounds of a model's REFRESH jobs on a ``HostPoolEngine`` and predicts
each before it runs from every job seen so far (a calibration round at other sizes first, then
the rounds before), as a training run would. Used by bench_capacity.py (its --prediction part)
and by tests/python/test_capacity.py (the 25% bound); nothing in the package calls it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Sequence

import torch

from asteria.refresh.cost import CostModel, JobSpec, makespan, spd_and_basis
from asteria.refresh.host_pool import HostPoolEngine


def pool_round(engine: Any, sizes: Sequence[tuple], model: Optional[CostModel] = None,
               op: str = "soap_qr", dtype: torch.dtype = torch.float32) -> float:
    """Run one round on ``engine``: one job per (n, batch) of ``sizes``, as the schedule
    submits them; seconds from the first submit to the last job's end (the executor's own
    timing). ``model``, if given, learns the round's dispatch latency (the engine's observer
    feeds it the jobs)."""
    ins = [spd_and_basis(b, n, dtype, n) for n, b in sizes]
    t0 = time.monotonic_ns()
    tickets, ends = [], []
    for i, ((n, b), (f, q)) in enumerate(zip(sizes, ins)):
        t = time.monotonic_ns()
        tickets.append(engine.submit(op, f, q if op in ("soap_qr", "kl_qr") else None,
                                     block=i + 1, version=1, deadline=10, snapshot_step=0))
        ends.append(time.monotonic_ns())
        if model is not None:
            model.observe_submit(JobSpec(op, dtype, n, b).input_bytes, (ends[-1] - t) / 1e9)
    results = [engine.wait(t) for t in tickets]
    if model is not None:
        model.observe_dispatch((results[0].started_ns - ends[0]) / 1e9)
    return (max(r.done_ns for r in results) - t0) / 1e9


def prediction_check(workers: int, sizes: Sequence[tuple], calibration: Sequence[tuple],
                     repeats: int = 7) -> dict:
    """How well the model predicts a round on the C pool with ``workers``: each round is
    predicted before it runs from every job seen so far (a calibration round at other sizes
    first, then the rounds before), as in a training run. Returns the lists and their medians
    and the relative error of the median prediction."""
    model = CostModel()
    eng = HostPoolEngine({"workers": workers})
    eng.observer = model.observe
    jobs = [JobSpec("soap_qr", torch.float32, n, b) for n, b in sizes]
    predicted, measured = [], []
    try:
        pool_round(eng, calibration)  # warm the pool and the allocator
        for _ in range(repeats):
            pool_round(eng, calibration, model)
            predicted.append(makespan(model, jobs, workers))
            measured.append(pool_round(eng, sizes, model))
    finally:
        eng.close()
    p, m = statistics.median(predicted), statistics.median(measured)
    return {"workers": workers, "sizes": [list(x) for x in sizes],
            "calibration": [list(x) for x in calibration], "predicted_s": predicted,
            "measured_s": measured, "median_predicted_s": p, "median_measured_s": m,
            "relative_error": (p - m) / m, "rates": model.table(),
            "dispatch_s": model.dispatch_s}
