"""refresh_policy "drift" as the planner answers it: the budget and d of its "auto" values and
its steady state.

Refresh per factor (``refresh_policy="drift"``, ``drift_plan``): the budget and d that its
"auto" values take by the runtime's rule (``cost.choose_refresh_budget``), and the policy's
steady state (``drift_steady_state``: the factors round-robin, the room and the in-flight rule
of the runtime, the pool's slots): refreshes per factor per 100 steps, the mean and the largest
age of the bases at step ends, and whether each step's work is done within d steps (else d is
raised until it is); ``expected_ages`` is the closed form for equal factors.

Owns: ``expected_ages``, ``spread_order``, ``drift_steady_state``, ``drift_plan``. May call:
``asteria.refresh.cost`` (the rule, the prices, the slots' assignment), ``asteria.optim.method``
(the method's op), ``asteria.plan.storage`` (a factor's copies), torch.
"""

from __future__ import annotations

import math
from collections import Counter, deque

import torch

from asteria.optim.method import method_of
from asteria.plan.storage import transfer_bytes
from asteria.refresh import cost as C


def expected_ages(count: int, budget: float, delay: int) -> dict:
    """The round-robin steady state of ``count`` equal-cost factors at ``budget`` and d =
    ``delay`` (f = 1, no skips), exactly: m = max(1, floor(budget x count)) factors start per
    step, so each starts every p = count / m steps, in intervals of q = floor(p) and q + 1
    steps, a share r = p - q of them the longer. A basis installed d steps after its start is
    d, d + 1, ... steps old at the step ends of its interval, so over time its age averages
    d + (E[p^2] / E[p] - 1) / 2 with E[p^2] = q^2 + r (2 q + 1), E[p] = p; at most
    d + ceil(p) - 1. With 1 / budget an integer that divides count, p = 1 / budget: refreshes
    100 x budget, age d + (1 / budget - 1) / 2 on average, d + 1 / budget - 1 at most.
    (Exact for d <= 1; with d >= 2 the room of d steps lets a step take a factor that the
    step before left, m is then budget x count on average.) Returns refreshes_per_100 (per
    factor per 100 steps), mean_age and max_age."""
    m = max(1, math.floor(budget * count + 1e-9))
    period = count / m
    q = math.floor(period + 1e-12)
    r = period - q
    mean = delay + ((q * q + r * (2 * q + 1)) / period - 1) / 2
    return {"refreshes_per_100": 100.0 * m / count, "mean_age": mean,
            "max_age": delay + math.ceil(period - 1e-12) - 1}


def spread_order(sizes: Counter) -> list:
    """The factors {size n: count} as one list, each size's factors spread evenly over it (as a
    model's edge blocks are spread over its layers): the order round-robin walks them in."""
    return [n for _, n in sorted(((i + 0.5) / k, n) for n, k in sizes.items() for i in range(k))]


def drift_steady_state(sizes: Counter, budget: float, delay: int, step_s: float, fb_s: float,
                       model: C.CostModel, optimizer: str, lanes: dict,
                       pcie_gbps: float = 0.0, tier_dtype: str = "float32") -> dict:
    """refresh_policy "drift" in its steady state, simulated step by step. The factors of
    ``sizes`` (``spread_order``) are the candidates of every step (f = 1, no skips) in
    round-robin order, the stalest basis first (what equal drift scores give); those with a
    refresh in flight wait; they start while their FLOPs fit the room, ``budget`` x a round's
    FLOPs x max(d, 1) less the FLOPs in flight (the first of a step beyond it when the room is
    positive and none started; after the first that does not fit none does), as the
    runtime's cadence starts them, and install d steps later. It starts uniform: for the
    first cycle and d steps the room is one step's budget, nothing carried, so the rule's
    room of d steps does not start as one burst of d steps' work (all bases at step 0, none
    in flight). Each step's starts run on the ``lanes``' slots (entries to the slot where
    they finish first, carried over from step to step, as the split executor does) after
    their snapshots' copies, and their installs' copies after them (``pcie_gbps``; 0: none).

    Returns refreshes_per_100 (per factor per 100 steps, the mean), mean_age and max_age
    (steps: at each step end, the step minus its installed basis's snapshot step),
    started_per_step, latency_s (the longest a step's work took, copies included), window_s
    (d steps, or the forward and backward for d = 0) and wait_s (the longest any install
    waited past it: 0 is hidden)."""
    op, p = method_of(optimizer).METHOD.REFRESH_OP
    order = spread_order(sizes)
    count = len(order)
    if count == 0:
        return {"refreshes_per_100": 0.0, "mean_age": 0.0, "max_age": 0,
                "started_per_step": 0.0, "latency_s": 0.0, "window_s": 0.0, "wait_s": 0.0}
    cost = {n: C.flops(op, n, p=p) for n in sizes}
    secs = {n: {lane: model.entry_seconds(lane, C.JobSpec(op, torch.float32, n, 1, p=p))
                for lane in lanes} for n in sizes}
    copy = {n: (transfer_bytes(Counter({n: 1}), optimizer, tier_dtype) if pcie_gbps
                else (0, 0)) for n in sizes}
    rate = pcie_gbps * 1e9 if pcie_gbps else 1.0
    total = sum(cost[n] for n in order)
    tol = 1e-9 * total
    per_step = max(1, math.floor(budget * count + 1e-9))
    cycle = max(math.ceil(1.0 / budget - 1e-9), math.ceil(count / per_step))
    warm, meas = 2 * cycle + 2 * delay + 2, min(4000, max(16, 8 * cycle))
    window = delay * step_s if delay >= 1 else fb_s
    queue = deque(range(count))       # the stalest first; ties by index
    basis = [0] * count               # the snapshot step of each installed basis
    basis_sum = 0
    flight: dict = {}                 # factor -> its refresh's start step
    installs: dict = {}               # install step -> [factors]
    free = {(lane, i): 0.0 for lane, k in lanes.items() for i in range(k)}
    starts = age_sum = 0
    max_age, latency, wait = 0, 0.0, 0.0
    for t in range(1, warm + meas + 1):
        for k in installs.pop(t, ()):
            basis_sum += flight[k] - basis[k]
            basis[k] = flight.pop(k)
        if t <= cycle + delay:  # a uniform start: a step's budget, nothing carried
            left = budget * total
        else:
            left = budget * total * max(delay, 1) - sum(cost[order[k]] for k in flight)
        started: list = []
        while queue and queue[0] not in flight:
            c = cost[order[queue[0]]]
            if not (c <= left + tol or (not started and left > 0)):
                break
            started.append(queue.popleft())
            left -= c
        queue.extend(started)
        for k in started:
            if delay == 0:
                basis_sum += t - basis[k]
                basis[k] = t
            else:
                flight[k] = t
                installs.setdefault(t + delay, []).append(k)
        if started:
            t0 = t * step_s
            by_size = Counter(order[k] for k in started)
            down = sum(copy[n][0] * c for n, c in by_size.items()) / rate
            up = sum(copy[n][1] * c for n, c in by_size.items()) / rate
            end = t0
            for n, c in by_size.items():
                for slot in free:
                    free[slot] = max(free[slot], t0 + down)
                used = C.assign(secs[n], c, free)
                end = max(end, max(free[slot] for slot in used))
            took = end + up - t0
        else:
            took = 0.0
        if t > warm:
            starts += len(started)
            age_sum += count * t - basis_sum
            max_age = max(max_age, t - min(basis))
            latency = max(latency, took)
            wait = max(wait, took - window)
    return {"refreshes_per_100": 100.0 * starts / (count * meas),
            "mean_age": age_sum / (count * meas), "max_age": max_age,
            "started_per_step": starts / meas, "latency_s": latency, "window_s": window,
            "wait_s": max(0.0, wait)}


def drift_plan(sizes: Counter, round_s: float, step_s: float, fb_s: float,
               model: C.CostModel, optimizer: str, lanes: dict, pcie_gbps: float = 0.0,
               tier_dtype: str = "float32") -> dict:
    """The planner's answer for refresh_policy "drift" on one rank's factors ``sizes`` whose
    round takes ``round_s`` on ``lanes``: the budget and d of ``cost.choose_refresh_budget`` (the runtime's
    "auto"), then the steady state (``drift_steady_state``); where a step's work on whole
    factors still runs past d (more factors a step than slots), d is raised until it does
    not, and the rule's d is kept as ``rule_delay``. ``hidden`` False: no d up to the cycle's
    length hides it."""
    op, p = method_of(optimizer).METHOD.REFRESH_OP

    def one(n: int) -> float:
        t = C.split_makespan(model, [C.JobSpec(op, torch.float32, n, 1, p=p)], lanes)
        return t + (sum(transfer_bytes(Counter({n: 1}), optimizer, tier_dtype)) /
                    (pcie_gbps * 1e9) if pcie_gbps else 0.0)

    largest = max((one(n) for n in sizes), default=0.0)
    budget, rule = C.choose_refresh_budget(round_s, step_s, fb_s, largest)
    delay = rule
    limit = rule + math.ceil(1.0 / budget - 1e-9) + 1
    while True:
        sim = drift_steady_state(sizes, budget, delay, step_s, fb_s, model, optimizer, lanes,
                                 pcie_gbps, tier_dtype)
        if sim["wait_s"] <= 1e-9 or delay >= limit:
            break
        delay += 1
    return {"budget": budget, "delay": delay, "rule_delay": rule, "round_s": round_s,
            "R": round_s / step_s, "factors": sum(sizes.values()), "largest_s": largest,
            "hidden": sim["wait_s"] <= 1e-9, **sim}
