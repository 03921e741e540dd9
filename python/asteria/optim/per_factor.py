"""Refresh per factor (``refresh_policy="drift"``): which of the factors that came due start a
refresh at a step end, each on its own within a budget, and when each is installed; the
cadence (``asteria.optim.cadence``) asks it at every step end of a run with that policy
(``Cadence.due``) and answers the schedule with it.

Owns: the candidates, their order (the drift score x the basis age), the room of the budget,
the forced starts and skips (``PerFactor.due``, ``select``); the budget, d, ``max_age`` and
``skip_threshold`` as applied (``budget``, ``delay``, ``max_age``) and the rule that bounds an
integer ``max_age`` (``age_floor``, ``check_max_age``: ``check_frequency`` calls it); the
choice of an "auto" budget and d (``choose``); their state keys (``STATE_KEYS``:
``refresh_budget.auto``, ``install_delay.auto``), each factor's installed basis's snapshot step
(``basis``; in a state dict its age, ``export_state``) and its sketch at its last start (the
state's ``b{j}.drift{dim}``), made (``fixed_state``), restored after a load (``reset``,
``restore``); and the report of the decisions (``PolicyReport``, ``stats``, ``plan_lines``).
Built by the cadence with what it uses (``PerFactor(run, method, full_round)``): the run record
(``run.py``: config, step counter, param groups and state, layouts), the method (``REFRESH_OP``,
``has_factor``) and the price of a full round (the cadence's ``full_round``: [JobSpec]). May
call: the drift score (``asteria.optim.drift``), the cost model's rules
(``asteria.refresh.cost``), the capacity record the cadence hands ``due`` (``times_for_f``,
``model.observed``), ``_layout`` (key names), and what a ``StepEnd`` hands it. Holds no
reference to the cadence. Single-threaded (the training thread); the engine's workers never
see it.

The policy: refresh per factor, continuously, stalest first (docs/capacity.md,
"Refresh per factor"). The unit is the factor (parameter, block, dimension), not the round:
at a step end (``due``) the candidates are the factors that came due (f's rule: every
step with f = 1) and have no refresh in flight (``StepEnd.in_flight``, the schedule's). A
candidate whose basis would grow older than ``max_age`` if it waited for its next chance
starts (forced); the others are ordered by priority, the drift score (``asteria.optim.drift``:
the change of the factor since its last start, from fixed random probes) times the age of its
basis in steps (ties by parameter, block, dimension), and start while their FLOPs fit the
room, budget x a full round's FLOPs x max(d, 1) less the FLOPs in flight (the first beyond it
when the room is positive and none started yet); below ``skip_threshold`` a factor skips.
Each starter is installed d steps later (``install_delay``), on its own: one round per step
end, and a parameter's factors in flight with different install steps, which the schedule's
wire form stores per factor. S is not read
(a factor in flight never starts again), f must be an integer (``check_frequency``), and an
integer ``max_age`` must be reachable (``age_floor``, ``check_max_age``). Every decision reads
step counts, factor values, FLOP counts and values stored in the state: the same seed gives
the same trajectory whatever the machine's timing, replicas (DDP, HSDP) take the same
decisions, and with ``fsdp_blocking="global"`` each block's owner decides for its factors
alone (its budget is a round of its own factors). With a budget of 1 and d = S no score is
read and every factor that came due starts: the round policy's trajectory. "auto" budget and
d (mode "async"; refused with replicated parameters and global blocking) are chosen once
(``choose``), stored in the state (``refresh_budget.auto``, ``install_delay.auto``) and
kept by a resumed run; before the choice (SOAP and KL-Shampoo choose before any REFRESH
round) the budget is a whole round and d is ``PROVISIONAL_DELAY``; in sync mode d = 0 and an
"auto" budget is a whole round.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from asteria.optim import _layout as K
from asteria.optim._state import _count, local
from asteria.optim.drift import PROBES, Probes
from asteria.optim.step_end import StepEnd
from asteria.refresh.capacity import Capacity
from asteria.refresh.cost import JobSpec, choose_refresh_budget, default_max_age

#: the keys' word for a value chosen from measured times
AUTO = "auto"
DRIFT = "drift"  # refresh_policy: per factor, stalest first, within a budget
#: refresh_policy="drift" with install_delay="auto": d until it is chosen (Shampoo, or a run
#: resumed before the choice: with the budget a whole round, the first REFRESH round is
#: measured at its install the next step end, where the choice is made)
PROVISIONAL_DELAY = 1
#: the basis ages asteria_stats() counts in its histogram: [0, 1], [2, 3], [4, 7], ... (powers
#: of two), the last bin open
AGE_BINS = 8


def age_floor(f: int, d: int) -> int:
    """The oldest a basis gets when its factor starts a refresh at every chance (refresh_policy
    "drift"): it comes due every f steps and may not start while its refresh of d steps is in
    flight, so the next install is f * ceil(max(d, 1) / f) steps after the last start, which
    was d steps before that install."""
    return f * -(-max(d, 1) // f) + d - 1


def check_max_age(f: int, cfg, where: str = "") -> None:
    """refresh_policy="drift": an integer ``max_age`` no basis can keep with f and an integer
    d (``age_floor``) is a ValueError naming the key. ("auto" is at least the floor; with an
    "auto" d the policy chooses d within it, ``choose``.)"""
    d = 0 if cfg.mode == "sync" else cfg.install_delay
    if cfg.max_age == AUTO or d == AUTO:
        return
    floor = age_floor(f, d)
    if cfg.max_age < floor:
        raise ValueError(
            f"runtime key 'max_age': got {cfg.max_age}; allowed: an integer >= {floor} with "
            f"precondition_frequency {f}{' of ' + where if where else ''} and install_delay "
            f"{d} (a factor starts a refresh at most every {f * -(-max(d, 1) // f)} steps and "
            f"its basis is {d} steps old when installed), or \"auto\"")



class PerFactor:
    """refresh_policy="drift" (module doc): the cadence's answer at a step end of a run with
    this policy, and what the policy keeps (``Cadence.policy``)."""

    #: the numbers the policy keeps in a preconditioned parameter's state: the budget and the
    #: d an "auto" run chose (-1 before the choice; the checkpoint part loads them as flags,
    #: through the cadence's ``STATE_KEYS``)
    STATE_KEYS = (K.AUTO_BUDGET, K.AUTO_DELAY)

    def __init__(self, run, method, full_round: Callable[[], list]) -> None:
        self.run = run
        self.method = method
        self.full_round = full_round  # () -> [JobSpec]: a REFRESH round of every factor
        self.auto_budget: Optional[float] = None  # refresh_budget="auto": once chosen
        self.auto_delay: Optional[int] = None     # install_delay="auto": once chosen
        # (param, j, dim) -> the snapshot step of its installed basis (the state's
        # b{j}.basis_age{dim}, relative, in a state dict), the probes of the score, the cost of
        # a full round, and the report's counts
        self.basis: dict = {}
        self.probes = Probes()
        self._round_flops: Optional[tuple] = None
        self.report = PolicyReport()

    def check_engine(self) -> None:
        """Once the engine exists (mode "async"): an "auto" ``refresh_budget`` or
        ``install_delay`` with replicated parameters (DDP, HSDP) is refused."""
        cfg = self.run.cfg
        if self.run.is_async and self.run.engine.replicated:
            for key, allowed in (("refresh_budget", "a number in (0, 1]"),
                                 ("install_delay", "an integer >= 0")):
                if getattr(cfg, key) == AUTO:
                    raise ValueError(
                        f"runtime key {key!r}: got 'auto' with replicated parameters (DDP / "
                        f"HSDP): each rank would choose it from its own timings and the "
                        f"replicas of a factor would start or install it at different steps; "
                        f"allowed there: {allowed}")

    # ---- the values as applied -------------------------------------------------------------------
    @property
    def delay(self) -> int:
        """d, the ``install_delay`` (0 in sync mode; ``PROVISIONAL_DELAY`` before an "auto" d
        is chosen)."""
        if not self.run.is_async:
            return 0
        d = self.run.cfg.install_delay
        if d != AUTO:
            return d
        return PROVISIONAL_DELAY if self.auto_delay is None else self.auto_delay

    @property
    def lags(self) -> bool:
        """May a refresh be in flight at a step end (d > 0, or an "auto" d)?"""
        return self.run.is_async and (self.run.cfg.install_delay == AUTO
                                      or self.run.cfg.install_delay > 0)

    @property
    def budget(self) -> float:
        """The share of a full round that may start per step: the key's number, or the one
        "auto" chose (1, a whole round, before the choice and in sync mode)."""
        b = self.run.cfg.refresh_budget
        if b != AUTO:
            return float(b)
        return 1.0 if self.auto_budget is None else self.auto_budget

    @property
    def max_age(self) -> int:
        """No basis gets older (steps): the key's integer, or "auto"'s ceil(4 / budget) + d,
        at least what the groups' f and d allow (``age_floor``)."""
        a = self.run.cfg.max_age
        if a != AUTO:
            return a
        floor = max((age_floor(f, self.delay) for f in self.frequencies()), default=0)
        return max(default_max_age(self.budget, self.delay), floor)

    @staticmethod
    def frequency(group: dict) -> int:
        """A group's f: an integer with this policy (``check_frequency`` refuses "auto")."""
        return group["precondition_frequency"]

    def frequencies(self) -> set:
        return {self.frequency(g) for g in self.run.param_groups}

    @property
    def scoring(self) -> bool:
        """Is a factor's drift score ever read (a budget below a whole round, a threshold)?
        Else no probe is taken: every factor that comes due starts."""
        return self.budget < 1.0 or self.run.cfg.skip_threshold is not None

    # ---- the step end's answer -------------------------------------------------------------------
    def due(self, end: StepEnd, capacity: Capacity) -> list:
        """[(item, t + d)] of the factors that start a refresh at this step end
        (docs/capacity.md, "Refresh per factor"). The candidates are the factors that
        came due (f's rule) with no refresh in flight; those whose basis would grow older than
        ``max_age`` if they waited for their next chance start whatever the budget (forced);
        the others, by priority (the drift score times the basis's age in steps, highest
        first, ties by parameter, block, dimension), while their cost fits the room: budget x
        a full round's FLOPs x max(d, 1), less the FLOPs of the refreshes in flight (the
        workers' backlog stays what d was chosen for; what a step leaves unused is not
        carried). The first of them starts even beyond the room when the room is positive and
        nothing started yet (so a factor larger than a step's budget is never blocked); one
        whose score is below ``skip_threshold`` skips. Every
        decision reads step counts, factor values and FLOP counts only: replicas agree, and
        the trajectory does not depend on the machine's timing."""
        t = end.t
        for key, snap in end.installed:
            self.basis[key] = snap
        self.choose(end, capacity)
        flight = end.in_flight()
        cands = [(p, j, dim) for _, p, j, dims in end.due for dim in dims
                 if (p, j, dim) not in flight]
        started = self.select(t, cands, flight, end) if cands else []
        chosen = set(started)
        # the ages the next step is preconditioned with (a start with d = 0 installs now)
        now = chosen if self.delay == 0 else ()
        self.report.step_end([t - (t if k in now else s) for k, s in self.basis.items()])
        if not started:
            return []
        install = t + self.delay
        out = []
        for kind, p, j, dims in end.due:
            mine = [dim for dim in dims if (p, j, dim) in chosen]
            if mine:
                out.append(((kind, p, j, dims if len(mine) == len(dims) else mine), install))
        return out

    def select(self, t: int, cands: list, flight: dict, end: StepEnd) -> list:
        """The candidates that start (``due``), forced first, then by priority."""
        d = self.delay
        total = self.round_flops()
        tol = 1e-9 * total  # sums of the same FLOPs in another order
        cost = {k: self.factor_flops(k) for k in cands}
        room = self.budget * total * max(d, 1) - sum(self.factor_flops(k) for k in flight)
        oldest = self.max_age

        def order(k):
            return (self.run.pindex[k[0]], k[1], k[2])

        forced, free = [], []
        for k in cands:
            f = self.frequency(self.run.group_of(k[0]))
            # waiting, it would start at t + f at the soonest, installed d steps later
            late = t + f + d - 1 - self.basis.get(k, t) > oldest
            (forced if late else free).append(k)
        forced.sort(key=order)
        threshold = self.run.cfg.skip_threshold
        scores, sketches = {}, {}
        if free and (threshold is not None or sum(cost.values()) > room + tol):
            t0 = time.perf_counter()
            vals, ys = self.probes.scores([end.factor(*k) for k in free],
                                          [self.reference(k) for k in free])
            self.report.score_s += time.perf_counter() - t0
            self.report.scored += len(free)
            scores, sketches = dict(zip(free, vals)), dict(zip(free, ys))
            # the drift weighted by the steps the basis has served it (docs/capacity.md: by
            # the drift alone, noisy factors take the budget and the others wait for max_age)
            free.sort(key=lambda k: (-scores[k] * max(1, t - self.basis.get(k, t)), order(k)))
        else:
            free.sort(key=order)
        started = list(forced)
        left = room - sum(cost[k] for k in forced)
        skipped, waiting = [], []
        for k in free:
            if threshold is not None and scores[k] < threshold:
                skipped.append(k)
            elif not waiting and (cost[k] <= left + tol or (not started and left > 0)):
                started.append(k)
                left -= cost[k]
            else:
                waiting.append(k)  # stalest first: none after it starts this step
        if self.scoring:  # what the next scores compare with
            t0 = time.perf_counter()
            for k in started:
                y = sketches.get(k)
                if y is None:
                    y = self.probes.sketch(end.factor(*k))
                self.reference(k).copy_(y)
            self.report.score_s += time.perf_counter() - t0
        self.report.decided(cands, started, forced, skipped, waiting, self.run.pindex)
        return started

    def reference(self, key: tuple) -> torch.Tensor:
        """The factor's sketch at its last refresh start (the state's ``b{j}.drift{dim}``;
        zeros before the first: a score of 1)."""
        p, j, dim = key
        return self.run.state[p][K.drift(j, dim)]

    def factor_flops(self, key: tuple) -> float:
        """The cost model's FLOPs of one factor's refresh (the method's REFRESH op)."""
        p, j, dim = key
        n = int(self.run.layout(p, self.run.group_of(p)).block_shapes[j][dim])
        op, pw = self.method.REFRESH_OP
        return JobSpec(op, torch.float32, n, 1, p=pw).flops_per_entry

    def round_flops(self) -> float:
        """The cost model's FLOPs of a full round (``full_round``), kept until a parameter is
        added."""
        n = len(self.run.pindex)
        if self._round_flops is None or self._round_flops[0] != n:
            self._round_flops = (n, sum(j.flops for j in self.full_round()))
        return self._round_flops[1]

    @property
    def choosing(self) -> bool:
        """Is an "auto" budget or d still to be chosen (``choose``)?"""
        cfg = self.run.cfg
        return self.run.is_async and (
            (cfg.refresh_budget == AUTO and self.auto_budget is None)
            or (cfg.install_delay == AUTO and self.auto_delay is None))

    def choose(self, end: StepEnd, capacity: Capacity) -> None:
        """Fix an "auto" budget and d, once, at the first step end with factors due once the
        REFRESH op's rate is measured and a forward and backward timed. SOAP and KL-Shampoo: at
        their first counted step end, before any REFRESH round, the op timed by the
        calibration jobs submitted with the first-step eigendecompositions
        (``StepEnd.calibrate``, ``Schedule.calibrate``: results dropped), so a choice of a
        whole round with d = 0 is the round policy's f = 1, S = 0 trajectory bit for bit.
        Shampoo (no first step): at the step end after its first REFRESH round's install (a
        whole round, d = ``PROVISIONAL_DELAY``), from that round; so too a run resumed from a
        state dict saved before the choice (no forward and backward timed at its first step
        end). Not from the first-step eigendecompositions alone: the cost model would price the
        REFRESH op (a QR power step, a Newton root) at the eigendecomposition's FLOP rate,
        which the op's own rate differs from by up to 2x (docs/capacity.md, "Refresh per
        factor"). By ``asteria.refresh.cost.choose_refresh_budget`` on ``capacity``'s prices of
        a full round and of its largest factor alone, the step and the forward and backward.
        An integer ``max_age`` bounds d (``age_floor``). Stored in every preconditioned
        parameter's state (``refresh_budget.auto``, ``install_delay.auto``)."""
        if not self.choosing or not end.due or capacity.fb_s() is None:
            return
        if self.method.init_step:
            end.calibrate()  # the REFRESH op's rates (none if a round measured them already)
        elif not capacity.measured_refresh_s():
            return
        full = self.full_round()
        times = capacity.times_for_f(full, end.stall_ns)
        if times is None:
            return
        round_s, step_s, fb_s = times
        big = max(full, key=lambda j: j.flops_per_entry)
        largest_s = capacity.times_for_f([dataclasses.replace(big, batch=1)],
                                         end.stall_ns)[0]
        cfg = self.run.cfg
        b = None if cfg.refresh_budget == AUTO else float(cfg.refresh_budget)
        d = None if cfg.install_delay == AUTO else cfg.install_delay
        budget, delay = choose_refresh_budget(round_s, step_s, fb_s if end.defers else None,
                                              largest_s, b, d)
        if d is None and cfg.max_age != AUTO:  # the largest d whose bases keep max_age
            while delay > 0 and any(age_floor(f, delay) > cfg.max_age
                                    for f in self.frequencies()):
                delay -= 1
        if b is None:
            self.auto_budget = budget
        if d is None:
            self.auto_delay = delay
        for _, st in self.run.param_states():
            if K.AUTO_BUDGET in st and b is None:
                st[K.AUTO_BUDGET] = budget
            if K.AUTO_DELAY in st and d is None:
                st[K.AUTO_DELAY] = delay


    # ---- state -----------------------------------------------------------------------------------
    def fixed_state(self, p, group: dict, st) -> None:
        """Add the policy's keys that p's state ``st`` lacks (at creation, after a load): an
        "auto" budget's and d's (-1 before the choice), and per factor its basis age
        (``b{j}.basis_age{dim}``: a number a state dict writes, the steps since the snapshot of
        the installed basis) and its sketch at its last refresh start (``b{j}.drift{dim}``,
        n x PROBES float32, zeros before the first)."""
        cfg = self.run.cfg
        if self.run.is_async and cfg.refresh_budget == AUTO and K.AUTO_BUDGET not in st:
            st[K.AUTO_BUDGET] = -1.0 if self.auto_budget is None else self.auto_budget
        if self.run.is_async and cfg.install_delay == AUTO and K.AUTO_DELAY not in st:
            st[K.AUTO_DELAY] = -1 if self.auto_delay is None else self.auto_delay
        device = local(p).device
        for j, dim, n in self.factors_of(p, group):
            # a factor's basis is from its state's creation (SOAP's first-step eigh, or none)
            self.basis.setdefault((p, j, dim), self.run.t)
            if K.basis_age(j, dim) not in st:
                st[K.basis_age(j, dim)] = 0  # written by a state dict (``export_state``)
            if K.drift(j, dim) not in st:
                st[K.drift(j, dim)] = torch.zeros((n, PROBES), dtype=torch.float32,
                                                  device=device)

    def drop_state(self, p, group: dict, st) -> None:
        """Under the "round" policy: drop the per-factor keys a state saved with "drift" has."""
        for j, dim, _ in self.factors_of(p, group):
            st.pop(K.basis_age(j, dim), None)
            st.pop(K.drift(j, dim), None)

    def factors_of(self, p, group: dict) -> list:
        """[(j, dim, n)] of p's factors (the blocks of its layout: a rank's own with
        fsdp_blocking="global")."""
        out = []
        for j, shape in enumerate(self.run.layout(p, group).block_shapes):
            for dim, has in enumerate(self.method.has_factor(shape, group)):
                if has:
                    out.append((j, dim, int(shape[dim])))
        return out

    @staticmethod
    def factor_keys(n: int, j: int, dim: int) -> tuple[set, dict]:
        """(flags, {name: (shape, dtype)}) of one factor's keys in the state: its basis age and
        its sketch."""
        return {K.basis_age(j, dim)}, {K.drift(j, dim): ((n, PROBES), torch.float32)}

    def reset(self) -> None:
        """Before a load replaces the state: the loaded state says which budget and d an auto
        run chose and how old each factor's basis is (``restore``); the report starts again."""
        self.auto_budget = None
        self.auto_delay = None
        self.basis = {}
        self.report = PolicyReport()

    def restore(self) -> None:
        """After a load, once every parameter's state is back: the budget and d a saved auto
        run chose, and each factor's installed basis's snapshot step from its basis age."""
        states = self.run.param_states()
        chosen = [float(st[K.AUTO_BUDGET]) for _, st in states if K.AUTO_BUDGET in st]
        chosen = [c for c in chosen if c > 0]
        self.auto_budget = max(chosen) if chosen else None
        chosen = [_count(st[K.AUTO_DELAY]) for _, st in states if K.AUTO_DELAY in st]
        chosen = [c for c in chosen if c >= 0]
        self.auto_delay = max(chosen) if chosen else None
        t = self.run.t
        for p, st in states:
            group = self.run.group_of(p) if p in self.run.gindex else None
            if group is None or p.numel() == 0 or self.run.is_adamw(p, group):
                continue
            for j, dim, _ in self.factors_of(p, group):
                if (p, j, dim) in self.basis and K.basis_age(j, dim) in st:
                    self.basis[(p, j, dim)] = t - _count(st[K.basis_age(j, dim)])

    def export_state(self, states: dict, index: dict) -> None:
        """Write each factor's basis age (steps since the snapshot of its installed basis) into
        a state dict's ``states`` ({index[param]: its state, a copy})."""
        t = self.run.t
        copied = set()
        for (p, j, dim), snap in self.basis.items():
            i = index.get(p)
            st = states.get(i)
            if not isinstance(st, dict):
                continue
            if i not in copied:
                st = states[i] = dict(st)
                copied.add(i)
            st[K.basis_age(j, dim)] = t - snap

    # ---- the report ------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The policy's entries of ``asteria_stats()``: the budget, d, max_age and threshold as
        applied, whether "auto" ones were chosen, and the report's ``refresh_*`` figures."""
        out = {"refresh_budget": self.budget,
               "refresh_budget_auto_chosen": self.auto_budget is not None,
               "install_delay": self.delay,
               "install_delay_auto_chosen": self.auto_delay is not None,
               "refresh_max_age": self.max_age,
               "refresh_skip_threshold": self.run.cfg.skip_threshold}
        out.update(self.report.stats(self.run.describe))
        return out

    def plan_lines(self) -> list:
        """The policy's lines of ``asteria_plan()``: the budget, d, max_age and the
        threshold as applied now, and how each was set."""
        cfg = self.run.cfg
        chosen = "chosen from the measured round and step times"
        until = "until chosen at the first step end with factors due after a measured job"

        def how(key, value):
            return "" if getattr(cfg, key) != AUTO else (
                f" ('auto': {chosen})" if value is not None else f" ('auto': {until})")

        gflop = self.round_flops() / 1e9
        lines = [
            f"refresh_policy 'drift': the factors that come due start stalest first (drift "
            f"score x basis age), within refresh_budget = {self.budget:.4g} of a full round "
            f"({gflop:.3g} GFLOP) per step{how('refresh_budget', self.auto_budget)}; each is "
            f"installed install_delay d = {self.delay} step(s) after its start"
            f"{how('install_delay', self.auto_delay)}",
            f"refresh_policy 'drift': no basis older than max_age = {self.max_age} steps"
            + (" ('auto': ceil(4 / budget) + d)" if cfg.max_age == AUTO else "")
            + (f"; a factor with a drift score below {cfg.skip_threshold:g} skips"
               if cfg.skip_threshold is not None else "; no skip threshold")]
        rep = self.report
        if rep.step_ends:
            lines.append(f"refresh_policy 'drift': {rep.started / rep.step_ends:.3g} refreshes "
                         f"started per step, {rep.skipped} skipped of {rep.candidates} "
                         f"candidates, basis age mean {rep.mean_age():.3g} max "
                         f"{rep.max_age_seen} steps")
        return lines



class PolicyReport:
    """What refresh_policy="drift" decided, for ``asteria_stats()`` (since the optimizer's
    construction or its last load; nothing here decides anything)."""

    def __init__(self) -> None:
        self.step_ends = 0
        self.candidates = self.started = self.forced = self.skipped = self.waiting = 0
        self.per_param: dict = {}  # param index -> [candidates, skipped]
        self.ages: list = []       # the basis ages after the last step end
        self.max_age_seen = 0
        self.scored = 0            # scores computed
        self.score_s = 0.0         # seconds in scores and sketches

    def decided(self, cands, started, forced, skipped, waiting, pindex) -> None:
        self.candidates += len(cands)
        self.started += len(started)
        self.forced += len(forced)
        self.skipped += len(skipped)
        self.waiting += len(waiting)
        for k in cands:
            self.per_param.setdefault(pindex[k[0]], [0, 0])[0] += 1
        for k in skipped:
            self.per_param[pindex[k[0]]][1] += 1

    def step_end(self, ages: list) -> None:
        self.step_ends += 1
        self.ages = ages
        if ages:
            self.max_age_seen = max(self.max_age_seen, max(ages))

    def mean_age(self) -> float:
        return sum(self.ages) / len(self.ages) if self.ages else 0.0

    def stats(self, describe) -> dict:
        """The ``refresh_*`` entries of ``asteria_stats()``: refreshes started per step, the
        share of candidates skipped (overall and per parameter, by name), the basis ages after
        the last step end (mean, median, 90th percentile, max, and a histogram of bins [0, 1],
        [2, 3], [4, 7], ...), the largest age seen, and the seconds spent on drift scores."""
        ages = sorted(self.ages)

        def q(x):
            return ages[min(len(ages) - 1, int(x * len(ages)))] if ages else 0

        hist: dict = {}
        for i in range(AGE_BINS):
            lo, hi = (0 if i == 0 else 2 ** i), 2 ** (i + 1) - 1
            label = f"{lo}-{hi}" if i + 1 < AGE_BINS else f"{lo}+"
            hist[label] = sum(1 for a in ages if a >= lo and (a <= hi or i + 1 == AGE_BINS))
        return {
            "refresh_step_ends": self.step_ends,
            "refresh_candidates": self.candidates, "refresh_started": self.started,
            "refresh_forced": self.forced, "refresh_skipped": self.skipped,
            "refresh_waiting": self.waiting,
            "refresh_per_step": self.started / self.step_ends if self.step_ends else 0.0,
            "refresh_skipped_share": self.skipped / self.candidates if self.candidates else 0.0,
            "refresh_skipped_share_by_param": {
                describe(i): (s / c if c else 0.0) for i, (c, s) in sorted(self.per_param.items())},
            "refresh_age_mean": self.mean_age(), "refresh_age_p50": q(0.5),
            "refresh_age_p90": q(0.9), "refresh_age_max": ages[-1] if ages else 0,
            "refresh_age_hist": hist, "refresh_age_max_seen": self.max_age_seen,
            "refresh_scores": self.scored, "refresh_score_s": self.score_s}
