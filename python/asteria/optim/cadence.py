"""When refreshes run: the cadence of an Asteria optimizer (``opt.cadence``), its f and S, and
its refresh policy (which of the factors that came due start: all of them as one round, or
each on its own within a budget).

Owns: a param group's refresh frequency f (``precondition_frequency``) and the staleness S (the
runtime's ``staleness``: steps from a snapshot to its install), each fixed (an integer) or
``"auto"`` (chosen once from measured times); the one check of the two keys against each other
and the run (``check_frequency``: f an integer >= 1 or "auto", "auto" with mode "async" and
local blocking, S <= f; ``Cadence.check_engine``: no "auto" f with replicated parameters); when
the "auto" values are chosen and from what (``choose_s``, ``choose_f``: the capacity record's
numbers under ``asteria.refresh.cost``'s rule, ``choose_staleness`` / ``choose_frequency``);
the capacity record those numbers come from (``capacity``; the schedule feeds it its rounds and
step times); the state keys of the values chosen (``STATE_KEYS``: ``staleness.auto``,
``frequency.auto``), made (``fixed_state``), written at the choice and restored after a load
(``reset``, ``restore``); the report of f and S (``stats``, ``plan_lines``); and the question
the schedule asks at every step end, ``due``: which of the factors that came due start a
refresh now, and at which step each one is installed. S and f are read here and nowhere else
(``delay``, ``frequency``); the schedule submits and installs what ``due`` says. With
``refresh_policy="drift"`` (below) also: the budget, d, ``max_age`` and ``skip_threshold`` as
applied (``budget``, ``delay``, ``max_age``), the choice of an "auto" budget and d
(``choose_drift``), each factor's installed basis's snapshot step (``basis``; in a state dict
its age, ``export_state``) and its sketch at its last start (the state's ``b{j}.drift{dim}``),
and the report of the decisions (``PolicyReport``).
Built with what it uses (``Cadence(run, method)``): the run record (``run.py``: config, engine,
step counter, param groups and state). May call: the capacity record
(``asteria.refresh.capacity.Capacity``: ``times_for_s``, ``times_for_f``, ``summary``,
``model.observed``), the cost model's rules (``asteria.refresh.cost``), the drift score
(``asteria.optim.drift``), the method's declarations for pricing a round (``REFRESH_OP``,
``state_dtype``, ``has_factor``), ``_layout`` (key names), and what a ``StepEnd`` hands it.
Single-threaded (the training thread); the engine's workers never see these objects.

The due rule. A factor comes due at the end of a step that brings its parameter's step count
k to a multiple of its group's f (``comes_due``: the optimizer collects those, SOAP asks it
before handing a step's factor EMAs to a worker); ``due`` takes them all but at the choice of
an "auto" f (below), and installs them at t + S. So with 0 <= S <= f a parameter never has
two refreshes in flight.

``staleness="auto"`` (``mode="async"``): S is chosen once: 0 where 1.5x a REFRESH round's time
fits the measured forward and backward (an S = 0 round runs during the next forward and
backward: the schedule's ``defers``), else the fewest steps that cover it, at least 1 and at
most the smallest ``precondition_frequency`` of the groups (``ceiling``). SOAP and KL-Shampoo
choose it when their first REFRESH round is submitted, from the cost model's prediction of
that round (``StepEnd.price``): the model has measured the first-step eigendecompositions (the
INIT round) and the steps since. Shampoo (no INIT round) runs its first REFRESH round at S =
that frequency (the largest S allowed, so it does not stall) and chooses at its install, from
the larger of its measured time (submit to last job's end) and the prediction. From then on S
is fixed. It is stored in every preconditioned parameter's state (``staleness.auto``, -1
before the choice), so a resumed run keeps it: the trajectory is a pure function of the inputs
and that S (timing picks S once; it never moves S again).

``precondition_frequency="auto"`` (``mode="async"``; ``check_frequency`` refuses it in sync
mode and with ``fsdp_blocking="global"``, ``check_engine`` with replicated parameters: each
rank would choose from its own timings). One f serves every group that asks for "auto". Before the
choice f is ``initial_frequency()``: max(1, S) for an integer S (S <= f), 1 with
``staleness="auto"``, whose S is then 0 (sync's trajectory: every step's round runs during the
next forward and backward). f is chosen at the end of the step in which a preconditioned
parameter of such a group takes its second counted step (``step`` = 2, ``CHOOSE_F_AT``: SOAP
and KL-Shampoo at the run's third step, after the first-step eigendecompositions and one
REFRESH round; Shampoo at its second), after that step end's installs and before its
snapshots, whose due factors are those of the new f. The rule is
``asteria.refresh.cost.choose_frequency`` on the capacity record's numbers
(``Capacity.times_for_f``): a round of every factor as the cost model prices it (measured
rates: the INIT round's, the first REFRESH rounds'), the step (median of the steps so far and
the one in progress), the forward and backward (a step's end to the next step's start). 1.5x
the round within the forward and backward: f = 1 with S = 0; else f = the fewest steps that
cover it, and with ``staleness="auto"`` S = f (never below an integer S; with an integer S, S
stays). Both auto: S is chosen here, at most the smallest integer f of the other groups;
``choose_s`` leaves it alone. The choice step depends on step counts alone, and f is stored in
every preconditioned parameter's state of such a group (``frequency.auto``, -1 before the
choice), so the trajectory is a pure function of the inputs and that f, and a resumed run
keeps it (``restore``).

``refresh_policy="drift"``: refresh per factor, continuously, stalest first (docs/capacity.md,
"Refresh per factor"). The unit is the factor (parameter, block, dimension), not the round:
at a step end (``drift_due``) the candidates are the factors that came due (f's rule: every
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
(``choose_drift``), stored in the state (``refresh_budget.auto``, ``install_delay.auto``) and
kept by a resumed run; before the choice the budget is a whole round and d is
``PROVISIONAL_DELAY``; in sync mode d = 0 and an "auto" budget is a whole round.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from typing import Callable, Optional, Union

import torch

from asteria.optim import _layout as K
from asteria.optim._state import _count, local
from asteria.optim.drift import PROBES, Probes
from asteria.optim.method import REFRESH, is_int, require
from asteria.refresh.capacity import Capacity, report_lines
from asteria.refresh.cost import (JobSpec, choose_frequency, choose_refresh_budget,
                                  choose_staleness, default_max_age)

AUTO = "auto"
DRIFT = "drift"  # refresh_policy: per factor, stalest first, within a budget
#: precondition_frequency="auto" is chosen when a parameter of such a group reaches this count
CHOOSE_F_AT = 2
#: refresh_policy="drift" with install_delay="auto": d until it is chosen (with the budget a
#: whole round, the first round of a method without first-step eigendecompositions is
#: measured at its install the next step end)
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
    "auto" d the cadence chooses d within it.)"""
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


def check_frequency(f: Union[int, str], cfg, where: str = "") -> None:
    """The one check of a param group's ``precondition_frequency`` f against the runtime config
    ``cfg`` (the optimizer's construction and ``add_param_group`` and ``load_state_dict`` call
    it for every group; ``where`` names the group in the error): an integer >= 1 or "auto";
    "auto" (chosen from measured times by the cadence) needs ``mode="async"`` (in sync mode
    every REFRESH stalls its step, there is no window to fit) and local blocking, as
    staleness="auto" does (each rank would choose its own f); S <= f, as a refresh must be
    installed before the next one is snapshotted. ``mode="sync"`` installs at once (S = 0
    whatever the key says), an "auto" S stays within f and an "auto" f is at least an integer
    S by construction, so none of those is checked. S's own range is checked with the other
    runtime keys (``RuntimeConfig``); "auto" with replicated parameters once the engine exists
    (``Cadence.check_engine``). With ``refresh_policy="drift"`` S is not read (a factor with a
    refresh in flight does not start another): f is an integer, and an integer ``max_age`` at
    least what f and d allow (``check_max_age``)."""
    ok = (is_int(f) and f >= 1) or (isinstance(f, str) and f == AUTO)
    require("precondition_frequency", ok, f,
            'an integer >= 1, or "auto" (chosen from measured times, runtime mode "async")')
    if cfg.refresh_policy == DRIFT:  # S is not read: each factor installs d steps after its start
        if f == AUTO:
            raise ValueError(
                f"precondition_frequency='auto'{' (' + where + ')' if where else ''} with "
                f"runtime refresh_policy 'drift': the policy chooses how many refreshes start "
                f"per step instead (refresh_budget); allowed there: an integer >= 1 (1: every "
                f"factor may start at every step)")
        check_max_age(f, cfg, where)
        return
    if f == AUTO:
        where = f" ({where})" if where else ""
        if cfg.mode != "async":
            raise ValueError(
                f"precondition_frequency='auto'{where} needs runtime mode 'async' (f is "
                f"chosen so that a REFRESH round fits under the steps; sync mode runs it "
                f"inside the step); allowed in mode {cfg.mode!r}: an integer >= 1")
        if cfg.fsdp_blocking != "local":
            raise ValueError(
                f"precondition_frequency='auto'{where} needs runtime fsdp_blocking 'local' "
                f"(global blocking needs one f on every rank); allowed with "
                f"{cfg.fsdp_blocking!r}: an integer >= 1")
        return
    if cfg.mode == "sync" or cfg.staleness == AUTO:
        return
    if cfg.staleness > f:
        raise ValueError(
            f"runtime key 'staleness': got {cfg.staleness}; allowed: 0 <= S <= "
            f"precondition_frequency ({f}){' of ' + where if where else ''}")


@dataclasses.dataclass
class StepEnd:
    """A step end as the schedule asks the cadence about it (``Cadence.due``)."""

    t: int
    #: [(REFRESH, param, block j, dims)]: the factors whose step count made them due
    #: (``Cadence.comes_due``), in the order the schedule batches them
    due: list
    #: this step end's time at the bounded barrier so far
    stall_ns: int
    #: does an S = 0 round run during the next forward and backward (``Schedule.defers``)?
    defers: bool
    #: [(REFRESH, param, j, dims)] -> [JobSpec]: the round these would make, as submitted
    price: Callable[[list], list]
    #: refresh_policy="drift": () -> {(param, j, dim): (snapshot step, install step)} of the
    #: refreshes in flight after this step end's installs
    in_flight: Callable[[], dict] = dict
    #: refresh_policy="drift": [((param, j, dim), snapshot step)] of the results installed since
    #: the last step end (a failed job's factor is not among them: its basis stays)
    installed: list = dataclasses.field(default_factory=list)
    #: refresh_policy="drift": (param, j, dim) -> the factor its refresh would take now
    factor: Optional[Callable] = None


class Cadence:
    """The cadence part of an ``AsteriaOptimizer`` (``opt.cadence``): f and S (module doc)."""

    #: the numbers the cadence keeps in a preconditioned parameter's state: the S, the f, the
    #: budget and the d an "auto" run chose (-1 before the choice; the checkpoint part loads
    #: them as flags)
    STATE_KEYS = (K.AUTO_S, K.AUTO_F, K.AUTO_BUDGET, K.AUTO_DELAY)

    def __init__(self, run, method) -> None:
        self.run = run
        self.method = method
        self.auto_s: Optional[int] = None  # staleness="auto": the S chosen, once chosen
        self.auto_f: Optional[int] = None  # precondition_frequency="auto": the f, once chosen
        self.auto_budget: Optional[float] = None  # refresh_budget="auto": once chosen
        self.auto_delay: Optional[int] = None     # install_delay="auto": once chosen
        self._capacity: Optional[Capacity] = None
        # refresh_policy="drift": (param, j, dim) -> the snapshot step of its installed basis
        # (the state's b{j}.basis_age{dim}, relative, in a state dict), the probes of the score,
        # the cost of a full round, and the report's counts
        self.basis: dict = {}
        self.probes = Probes()
        self._round_flops: Optional[tuple] = None
        self.report = PolicyReport()

    # ---- the checks of f and S -------------------------------------------------------------------
    def check_engine(self) -> None:
        """Once the engine exists: ``precondition_frequency="auto"`` with replicated
        parameters (DDP, HSDP) is refused, as each rank would choose f from its own timings
        and the replicas of a block would refresh at different steps; so are an "auto"
        ``refresh_budget`` and ``install_delay`` (refresh_policy="drift", mode "async")."""
        if self.auto_frequency and self.run.engine.replicated:
            raise ValueError(
                "precondition_frequency='auto' with replicated parameters (DDP / HSDP): each "
                "rank would choose f from its own timings; allowed: an integer >= 1 there")
        cfg = self.run.cfg
        if self.per_factor and self.run.is_async and self.run.engine.replicated:
            for key, allowed in (("refresh_budget", "a number in (0, 1]"),
                                 ("install_delay", "an integer >= 0")):
                if getattr(cfg, key) == AUTO:
                    raise ValueError(
                        f"runtime key {key!r}: got 'auto' with replicated parameters (DDP / "
                        f"HSDP): each rank would choose it from its own timings and the "
                        f"replicas of a factor would start or install it at different steps; "
                        f"allowed there: {allowed}")

    # ---- f ---------------------------------------------------------------------------------------
    @property
    def auto_frequency(self) -> bool:
        """Does a param group ask for ``precondition_frequency="auto"``?"""
        return any(g["precondition_frequency"] == AUTO for g in self.run.param_groups)

    def frequency(self, group: dict, initial: bool = False) -> int:
        """The f a param group refreshes at: its integer, or for "auto" the f chosen
        (``initial_frequency()`` before the choice, and always with ``initial``: the f the run
        started with, Shampoo's start_preconditioning_step=-1)."""
        f = group["precondition_frequency"]
        if f != AUTO:
            return f
        return self.initial_frequency() if initial else self.auto_frequency_now()

    def auto_frequency_now(self) -> int:
        """The f of the groups with "auto": the one chosen, or ``initial_frequency()``."""
        return self.initial_frequency() if self.auto_f is None else self.auto_f

    def initial_frequency(self) -> int:
        """f="auto" before its choice: max(1, S) for an integer S (S <= f), else 1."""
        s = self.run.cfg.staleness
        return 1 if s == AUTO else max(1, s)

    def comes_due(self, group: dict, count: int) -> bool:
        """Does a factor of a parameter of ``group`` come due at the end of the step that
        brought the parameter's step count to ``count`` (k % f == 0)? ``due`` then says
        whether it starts a refresh there."""
        return count % self.frequency(group) == 0

    # ---- S ---------------------------------------------------------------------------------------
    @property
    def delay(self) -> int:
        """S: steps between a snapshot and its install (0 in sync mode); with
        refresh_policy="drift" d, the ``install_delay`` (``PROVISIONAL_DELAY`` before an "auto"
        d is chosen)."""
        if not self.run.is_async:
            return 0
        if self.per_factor:
            d = self.run.cfg.install_delay
            if d != AUTO:
                return d
            return PROVISIONAL_DELAY if self.auto_delay is None else self.auto_delay
        if self.run.cfg.staleness == AUTO:
            cap = self.ceiling()  # a group added later may lower it
            if self.auto_s is None:  # both auto: S = 0 until f and S are chosen together
                return 0 if self.auto_frequency else cap
            return min(self.auto_s, cap)
        return self.run.cfg.staleness

    def ceiling(self) -> int:
        """The largest S allowed: the smallest f of the groups (as ``frequency`` gives it)."""
        return min((self.frequency(g) for g in self.run.param_groups), default=1)

    @property
    def lags(self) -> bool:
        """May a refresh be in flight at a step end (S > 0, or an "auto" S, which may be 0
        only until it is chosen)? Then a preconditioned parameter's state has the keys of a
        refresh in flight from its creation on (the schedule's fixed keys)."""
        if self.per_factor:
            return self.run.is_async and (self.run.cfg.install_delay == AUTO
                                          or self.run.cfg.install_delay > 0)
        return self.delay > 0 or (self.run.is_async and self.run.cfg.staleness == AUTO)

    # ---- the step end's question -----------------------------------------------------------------
    def due(self, end: StepEnd) -> list:
        """[(item, install step)] of the factors that start a refresh at this step end (the
        items of ``end.due``, in their order). First the choices this step end makes (an auto
        S from the measured rounds, an auto f at its step count), then the install step of
        each: t + S (an auto S not chosen yet is chosen from the price of this round first).
        With refresh_policy="drift", ``drift_due``."""
        if self.per_factor:
            return self.drift_due(end)
        self.choose_s(defers=end.defers)
        starts = self.choose_f(end)
        if not starts:
            return []
        if self.choosing_s:
            self.choose_s(end.price(starts), end.defers)
        install = end.t + self.delay
        return [(d, install) for d in starts]

    @property
    def choosing_s(self) -> bool:
        """Is S "auto" and still to be chosen by ``choose_s``? (With an "auto" f too, S is
        chosen with f, by ``choose_f``.)"""
        return (self.run.cfg.staleness == AUTO and self.run.is_async and self.auto_s is None
                and not self.auto_frequency and not self.per_factor)

    def choose_s(self, jobs: Optional[list] = None, defers: bool = False) -> None:
        """staleness="auto": fix S, once. Before the first REFRESH round is submitted
        (``jobs``: its jobs), from the cost model's prediction of it if the model has measured
        jobs already (SOAP's and KL-Shampoo's first-step eigendecompositions); else at the
        install of the first REFRESH round, from its measured time. ``defers``: an S = 0
        round would run during the next forward and backward (else S = 0 is not chosen)."""
        if not self.choosing_s:
            return
        times = self.capacity.times_for_s(jobs)
        if times is None:
            return
        need, step, fb = times
        window = min(fb, step) if defers and fb else None  # no S = 0 window without one
        self.auto_s = min(self.ceiling(), choose_staleness(need, step, window))
        for _, st in self.run.param_states():
            if K.AUTO_S in st:
                st[K.AUTO_S] = self.auto_s

    def choose_f(self, end: StepEnd) -> list:
        """precondition_frequency="auto": fix f (and with staleness="auto" S), once, at the
        end of the step in which a parameter of such a group took its CHOOSE_F_AT-th step
        (module doc). Returns the items of ``end.due`` that start a refresh: at the choice
        those the new f makes due, else all of them."""
        if self.auto_f is not None or not self.run.is_async or not self.auto_frequency:
            return end.due
        auto = [p for g in self.run.param_groups if g["precondition_frequency"] == AUTO
                for p in g["params"]]
        states = self.run.state
        # the preconditioned parameters' own entries (no settling read: nothing is due here)
        steps = {p: _count(dict.__getitem__(st, K.STEP)) for p in auto
                 for st in [dict.get(states, p)]
                 if st is not None and dict.__contains__(st, K.AUTO_F)}
        if max(steps.values(), default=0) < CHOOSE_F_AT:
            return end.due
        # both auto: S is chosen with f, unless it was chosen before (an "auto" group added
        # after an auto S was chosen for the integer groups: S stays, once chosen)
        joint = self.run.cfg.staleness == AUTO and self.auto_s is None
        fixed = self.auto_s if self.run.cfg.staleness == AUTO else self.run.cfg.staleness
        times = self.capacity.times_for_f(self.full_round(), end.stall_ns)
        if times is None:
            return end.due
        self.auto_f, s = choose_frequency(*times, fixed)
        if joint:
            self.auto_s = min(s, self.ceiling())
        for p in steps:
            states[p][K.AUTO_F] = self.auto_f
        if joint:
            for _, st in self.run.param_states():
                if K.AUTO_S in st:
                    st[K.AUTO_S] = self.auto_s
        return [d for d in end.due if d[0] != REFRESH
                or d[1] not in steps or steps[d[1]] % self.auto_f == 0]

    def full_round(self) -> list:
        """A REFRESH round of every factor of the preconditioned parameters, as the cost
        model prices it: [JobSpec] per (factor size, dtype), the method's REFRESH op."""
        op, pw = self.method.REFRESH_OP
        sizes: Counter = Counter()
        for group in self.run.param_groups:
            for p in group["params"]:
                if p.numel() == 0 or self.run.is_adamw(p, group):
                    continue
                dtype = self.method.state_dtype(p, group)
                for shape in self.run.layout(p, group).block_shapes:
                    for d, has in zip(shape, self.method.has_factor(shape, group)):
                        if has:
                            sizes[(int(d), dtype)] += 1
        return [JobSpec(op, dt, n, k, p=pw) for (n, dt), k in sizes.items()]

    # ---- refresh per factor (refresh_policy="drift") -------------------------------------------
    @property
    def per_factor(self) -> bool:
        """refresh_policy="drift": does each factor start and install on its own? (The
        schedule's wire form of the refreshes in flight is then per factor.)"""
        return self.run.cfg.refresh_policy == DRIFT

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

    def frequencies(self) -> set:
        return {self.frequency(g) for g in self.run.param_groups}

    @property
    def scoring(self) -> bool:
        """Is a factor's drift score ever read (a budget below a whole round, a threshold)?
        Else no probe is taken: every factor that comes due starts."""
        return self.budget < 1.0 or self.run.cfg.skip_threshold is not None

    def drift_due(self, end: StepEnd) -> list:
        """refresh_policy="drift": [(item, t + d)] of the factors that start a refresh at this
        step end (docs/capacity.md, "Refresh per factor"). The candidates are the factors that
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
        self.choose_drift(end)
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
        """The candidates that start (``drift_due``), forced first, then by priority."""
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
    def choosing_drift(self) -> bool:
        """Is an "auto" budget or d still to be chosen (``choose_drift``)?"""
        cfg = self.run.cfg
        return self.per_factor and self.run.is_async and (
            (cfg.refresh_budget == AUTO and self.auto_budget is None)
            or (cfg.install_delay == AUTO and self.auto_delay is None))

    def choose_drift(self, end: StepEnd) -> None:
        """refresh_policy="drift": fix an "auto" budget and d, once, at the first step end with
        factors due after the cost model has measured a job (SOAP's and KL-Shampoo's first-step
        eigendecompositions: their first REFRESH step end, where an "auto" S is chosen;
        Shampoo: the step end after its first round, at whose install it was measured), by
        ``asteria.refresh.cost.choose_refresh_budget`` on the capacity record's prices of a
        full round and of its largest factor alone, the step and the forward and backward. An
        integer ``max_age`` bounds d (``age_floor``). Stored in every preconditioned
        parameter's state (``refresh_budget.auto``, ``install_delay.auto``)."""
        if not self.choosing_drift or not end.due or not self.capacity.model.observed:
            return
        full = self.full_round()
        times = self.capacity.times_for_f(full, end.stall_ns)
        if times is None:
            return
        round_s, step_s, fb_s = times
        big = max(full, key=lambda j: j.flops_per_entry)
        largest_s = self.capacity.times_for_f([dataclasses.replace(big, batch=1)],
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

    def factors_of(self, p, group: dict) -> list:
        """[(j, dim, n)] of p's factors (the blocks of its layout: a rank's own with
        fsdp_blocking="global")."""
        out = []
        for j, shape in enumerate(self.run.layout(p, group).block_shapes):
            for dim, has in enumerate(self.method.has_factor(shape, group)):
                if has:
                    out.append((j, dim, int(shape[dim])))
        return out

    def factor_keys(self, n: int, j: int, dim: int) -> tuple[set, dict]:
        """(flags, {name: (shape, dtype)}) of one factor's keys in the state with
        refresh_policy="drift": its basis age and its sketch (the checkpoint part's check of a
        loaded state accepts them whatever the policy: a run may resume under another)."""
        return {K.basis_age(j, dim)}, {K.drift(j, dim): ((n, PROBES), torch.float32)}

    # ---- the capacity record ---------------------------------------------------------------------
    @property
    def capacity(self) -> Capacity:
        """The capacity record of this optimizer's REFRESH work (asteria.refresh.capacity)."""
        if self._capacity is None or self._capacity._engine is not self.run.engine:
            self._capacity = Capacity(self.run.engine)
        return self._capacity

    @property
    def measured(self) -> bool:
        """Has the capacity record measured a round yet?"""
        return self._capacity is not None and bool(self._capacity.rounds)

    # ---- state: the values chosen ----------------------------------------------------------------
    def fixed_state(self, p, group: dict) -> None:
        """Add the cadence's keys of the fixed key set that p's state lacks (at creation, after
        a load): with precondition_frequency="auto" the f chosen, with staleness="auto" (mode
        "async") the S chosen, -1 before the choice; with refresh_policy="drift" an "auto"
        budget's and d's (-1 before the choice), and per factor its basis age
        (``b{j}.basis_age{dim}``: a number a state dict writes, the steps since the snapshot of
        the installed basis) and its sketch at its last refresh start (``b{j}.drift{dim}``,
        n x PROBES float32, zeros before the first). Under "round" the last two, loaded from a
        "drift" state, are dropped."""
        st = self.run.state[p]
        if group["precondition_frequency"] == AUTO and K.AUTO_F not in st:
            st[K.AUTO_F] = -1 if self.auto_f is None else self.auto_f
        if not self.per_factor:
            if self.run.is_async and self.run.cfg.staleness == AUTO and K.AUTO_S not in st:
                st[K.AUTO_S] = -1 if self.auto_s is None else self.auto_s
            for j, dim, _ in self.factors_of(p, group):  # a state saved with "drift"
                st.pop(K.basis_age(j, dim), None)
                st.pop(K.drift(j, dim), None)
            return
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

    def reset(self) -> None:
        """Before a load replaces the state: the loaded state says which S, f, budget and d an
        auto run chose and how old each factor's basis is (``restore``); the report starts
        again."""
        self.auto_s = None
        self.auto_f = None
        self.auto_budget = None
        self.auto_delay = None
        self.basis = {}
        self.report = PolicyReport()

    def restore(self) -> None:
        """After a load, once every parameter's state is back: the S and f a saved auto run
        chose, if it chose them; with refresh_policy="drift" its budget and d, and each
        factor's installed basis's snapshot step from its basis age."""
        if self.run.cfg.staleness == AUTO:
            chosen = [int(st[K.AUTO_S]) for _, st in self.run.param_states() if K.AUTO_S in st]
            chosen = [c for c in chosen if c >= 0]
            self.auto_s = max(chosen) if chosen else None
        chosen = [int(st[K.AUTO_F]) for _, st in self.run.param_states() if K.AUTO_F in st]
        chosen = [c for c in chosen if c >= 1]
        self.auto_f = max(chosen) if chosen and self.auto_frequency else None
        if not self.per_factor:
            return
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
        """Write the numbers the cadence keeps outside the state into a state dict's ``states``
        ({index[param]: its state, a copy}): with refresh_policy="drift" each factor's basis
        age (steps since the snapshot of its installed basis)."""
        if not self.per_factor:
            return
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
    def stats(self, defers: bool) -> dict:
        """The cadence's entries of ``asteria_stats()``: S as applied now, whether "auto" S
        and f were chosen yet, the f of the "auto" groups now, and the capacity report's
        figures (``capacity_*``). ``defers``: an S = 0 round runs during the next forward and
        backward (``Schedule.defers``), its window."""
        s = self.delay
        out = {"staleness": s, "staleness_auto": self.run.cfg.staleness == AUTO,
               "staleness_auto_chosen": self.auto_s is not None,
               "frequency_auto": self.auto_frequency,
               "frequency_auto_f": self.auto_frequency_now() if self.auto_frequency else None,
               "frequency_auto_chosen": self.auto_f is not None,
               "refresh_policy": self.run.cfg.refresh_policy}
        if self.per_factor:
            cfg = self.run.cfg
            out.update({"refresh_budget": self.budget,
                        "refresh_budget_auto_chosen": self.auto_budget is not None,
                        "install_delay": self.delay,
                        "install_delay_auto_chosen": self.auto_delay is not None,
                        "refresh_max_age": self.max_age,
                        "refresh_skip_threshold": cfg.skip_threshold})
            out.update(self.report.stats(self.run.describe))
        cap = self.capacity.summary(s, defers)
        for key in ("round_gflop", "predicted_round_s", "measured_round_s", "step_s", "fb_s",
                    "window_s", "utilisation", "smallest_s", "smallest_workers"):
            out[f"capacity_{key}"] = cap.get(key)
        return out

    def plan_lines(self, defers: bool) -> list:
        """The cadence's lines of ``asteria_plan()``: how S and f were set, then the capacity
        report (none in sync mode or before a round was submitted: nothing measured)."""
        if not self.run.is_async or not self.measured:
            return []
        s = self.delay
        lines = self.drift_lines() if self.per_factor else []
        if self.run.cfg.staleness == AUTO:
            lines.append(f"staleness 'auto': S = {s} " + (
                "(chosen from the measured round time)" if self.auto_s is not None
                else "(0, to be chosen with precondition_frequency 'auto')"
                if self.auto_frequency else
                "(the frequency, until a REFRESH round has been measured)"))
        if self.auto_frequency:
            how = ("chosen from the measured round and step times" if self.auto_f
                   else f"until the choice, at a parameter's step {CHOOSE_F_AT}")
            lines.append(f"precondition_frequency 'auto': f = "
                         f"{self.auto_frequency_now()} ({how})")
        lines.extend(report_lines(self.capacity.summary(s, defers)))
        return lines

    def drift_lines(self) -> list:
        """refresh_policy="drift"'s lines of ``asteria_plan()``: the budget, d, max_age and the
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
