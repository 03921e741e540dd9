"""One line of the planner's table (``row``): a model's round at one step time, its window,
where it must run, the ``-f auto`` choice and the policy's answer.

The window of a round (``asteria.refresh.cost.window_s``): S x step for S >= 1; at S = 0 in
mode "async" the round runs during the next forward and backward (its install waits for the
next step's start), so its window is the forward and backward's share of the step
(``fb_share``). The host workers' round holds its PCIe copies (``storage.transfer_bytes`` at the
given rate, one direction after the other); the device executor's holds none. Where the round
must run ("REFRESH on"): "host" where the host workers' round with its transfers fits the
window, "device" where only the device's fits (``refresh_device=True`` must take it), "host +
device" where only the round divided among both fits, "neither" where none does.

``-f auto`` (``precondition_frequency="auto"``): the f the runtime would choose
(``asteria.refresh.cost.choose_frequency``: 1.5x the round within the S = 0 window gives f = 1
and S = 0; else the fewest steps that cover it, S as given or, with ``-S auto``, as small as
hides it), from the round that runs (one rank's, with several) on the lanes (the host
workers, with their transfers; with a device rate given or measured, the round divided with
the device or the device's alone, whichever gives the smaller f); the table's f, S and window
columns are then the chosen ones. Without ``-S`` it chooses S too. It never chooses a setting
it reports as not hidden: with an S given that no f hides, it says so ("none"), with the
smallest S that hides the round and the policy; with replicated parameters (DDP, HSDP over
nodes), where the runtime refuses "auto", it says that.

Owns: ``row``. May call: ``asteria.refresh.cost``, ``asteria.refresh.engine`` (lane names),
``asteria.plan.shapes`` (a round's jobs), ``asteria.plan.storage`` (its copies),
``asteria.plan.drift`` (the policy's answer).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from asteria.plan.drift import drift_plan
from asteria.plan.shapes import round_jobs
from asteria.plan.storage import transfer_bytes
from asteria.refresh import cost as C
from asteria.refresh.engine import Lane


def row(model: C.CostModel, name: str, sizes: Counter, optimizer: str, cores: int,
        step_s: float, staleness, frequency, device: int, tokens: Optional[int],
        fb_share: float = 0.0, pcie_gbps: float = 0.0, *, owned: Optional[list] = None,
        replicated: bool = False, tier_dtype: str = "float32"):
    """One line of the table. ``frequency``: f or "auto" (chosen here); ``staleness``: S, or
    "auto" with f "auto"; ``device``: 1 adds the device lane to the round (divided with the
    host workers) and lets the choice take the device executor's; ``fb_share``: the forward
    and backward's share of ``step_s`` (the S = 0 window); ``pcie_gbps``: per direction (0:
    transfers left out); ``owned``: with several ranks, the factors {size: count} each rank
    computes (``replica_round``'s ``owner_factors``): the round that runs is then the slowest
    rank's, its own factors' copies included, and "hidden", ``-f auto`` and the policy are
    judged on it; ``replicated``: the ranks share replicated factors (DDP, HSDP over nodes),
    where the runtime refuses an "auto" f and budget; ``tier_dtype``: the form of the bases
    the installs copy back.

    ``-f auto`` chooses as the runtime would (``cost.choose_frequency``); with S given and a
    round that S cannot hide it chooses nothing (``auto_hidden`` False; ``frequency`` is then
    the f the runtime's rule would take, and each install waits), so the table never reports a
    chosen setting as not hidden."""
    jobs = round_jobs(sizes, optimizer)
    lanes = {Lane.HOST: cores, **({Lane.DEVICE: 1} if device else {})}
    d2h, h2d = transfer_bytes(sizes, optimizer, tier_dtype)
    xfer_s = (d2h + h2d) / (pcie_gbps * 1e9) if pcie_gbps else 0.0
    round_s = C.split_makespan(model, jobs, lanes) + xfer_s
    host_s = C.split_makespan(model, jobs, {Lane.HOST: cores}) + xfer_s
    device_s = C.makespan(model, jobs, 1, Lane.DEVICE)  # the device executor: no transfer
    whole_s = C.makespan(model, jobs, cores)
    gflop = sum(j.flops for j in jobs) / 1e9
    fb_s = fb_share * step_s
    # the round that runs: the whole model on this rank, or each rank's own factors
    run_sizes, run_s, run_dev, run_host, run_x, rank = (sizes, round_s, device_s, host_s,
                                                        xfer_s, None)
    if owned is not None:
        per = []
        for r, o in enumerate(owned):
            c = Counter(o)
            j_r = round_jobs(c, optimizer)
            x = sum(transfer_bytes(c, optimizer, tier_dtype)) / (pcie_gbps * 1e9) \
                if pcie_gbps else 0.0
            per.append((C.split_makespan(model, j_r, lanes) + x if j_r else 0.0, -r, x))
        run_s, rank, run_x = max(per)
        rank = -rank
        run_sizes = Counter(owned[rank])
        run_jobs = round_jobs(run_sizes, optimizer)
        run_dev = C.makespan(model, run_jobs, 1, Lane.DEVICE)
        run_host = C.split_makespan(model, run_jobs, {Lane.HOST: cores}) + run_x
    else:
        run_jobs = jobs
    choice_s = min(run_s, run_dev) if device else run_s
    auto = frequency == "auto"
    auto_hidden, runtime_f = True, None
    if auto:
        fixed = None if staleness == "auto" else staleness
        frequency, staleness = C.choose_frequency(choice_s, step_s, fb_s, fixed)
        auto_hidden = choice_s <= C.window_s(staleness, step_s, fb_s) + 1e-12
        runtime_f = frequency
    window = C.window_s(staleness, step_s, fb_s)
    s_min = 0 if round_s <= fb_s else C.smallest_s(round_s, step_s)
    run_min = 0 if choice_s <= fb_s else C.smallest_s(choice_s, step_s)
    # judged on the round that runs (one rank's, with several)
    w_min = C.smallest_workers(model, run_jobs, window - run_x, True, device)
    busy = sum(model.job_seconds(Lane.HOST, j) for j in run_jobs)
    where = ("host" if run_host <= window else "device" if run_dev <= window
             else "host + device" if run_s <= window else "neither")
    policy = drift_plan(run_sizes, run_s, step_s, fb_s, model, optimizer, lanes, pcie_gbps,
                        tier_dtype)
    return {"model": name, "tokens": tokens, "step_s": step_s,
            "factors": sum(sizes.values()), "sizes": dict(sorted(sizes.items())),
            "gflop": gflop, "round_s": round_s, "round_whole_jobs_s": whole_s,
            "window_s": window, "utilisation": min(1.0, busy / (cores * frequency * step_s)),
            "smallest_s": s_min, "fits": choice_s <= window + 1e-12,
            "smallest_cores": w_min, "fb_s": fb_s, "bytes_d2h": d2h, "bytes_h2d": h2d,
            "transfer_s": xfer_s, "host_round_s": host_s, "device_round_s": device_s,
            "device_rate": model.sources(Lane.DEVICE, jobs), "refresh_on": where,
            "frequency": frequency, "staleness": staleness, "frequency_auto": auto,
            "auto_hidden": auto_hidden, "auto_refused": auto and replicated,
            "runtime_f": runtime_f, "run_round_s": run_s, "run_device_s": run_dev,
            "run_host_s": run_host,
            "choice_round_s": choice_s, "run_smallest_s": run_min, "run_rank": rank,
            "run_factors": sum(run_sizes.values()), "policy": policy,
            "tier_dtype": tier_dtype}
