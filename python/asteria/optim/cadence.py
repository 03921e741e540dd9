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
``refresh_policy="drift"`` the answer is the per-factor policy's (``asteria.optim.per_factor``:
its candidates, order, budget, d, ``max_age``, "auto" choice, per-factor state and report),
which the cadence builds (``policy``) and hands the step end, its capacity record and the price
of a full round (``full_round``); the cadence's entry points (``delay``, ``lags``,
``check_engine``, ``fixed_state``, ``reset``, ``restore``, ``export_state``, ``factor_keys``,
``stats``, ``plan_lines``) pass to it what is the policy's.
Built with what it uses (``Cadence(run, method)``): the run record (``run.py``: config, engine,
step counter, param groups and state). May call: the capacity record
(``asteria.refresh.capacity.Capacity``: ``times_for_s``, ``times_for_f``, ``summary``), the
cost model's rules (``asteria.refresh.cost``), the per-factor policy
(``asteria.optim.per_factor``: ``PerFactor``, ``check_max_age``), the method's declarations for
pricing a round (``REFRESH_OP``, ``state_dtype``, ``has_factor``), ``_layout`` (key names), and
what a ``StepEnd`` hands it. Single-threaded (the training thread); the engine's workers never
see these objects.

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
parameter of such a group takes its ``choose_f_at``-th counted step (``CHOOSE_F_AT``), after
that step end's installs and before its snapshots, whose due factors are those of the new f:
- SOAP and KL-Shampoo choose at their first counted step (the run's second ``step()``), before
  any REFRESH round. The REFRESH op is timed by calibration jobs instead (``calibrates``,
  ``Schedule.calibrate``): one factor of each size and dtype, submitted after the first-step
  eigendecompositions' install, run during the next forward and backward, waited for at the
  choice, results dropped. So no basis is refreshed before the choice, and the run is the run
  of the f (and S) it chose, bit for bit, whichever f that is (with ``factor_emas="thread"``:
  the EMAs of the choice step are computed on the training thread, as with f = 1).
  A run resumed from a state dict saved before the choice has no forward and backward timed
  at that step end: it keeps its first basis (no refresh starts) and chooses at the next step
  end, the run of the f it chose but for an f of 1 (whose refresh at the first count it
  skipped).
- Shampoo (no first step) chooses at its second counted step, from its first REFRESH round.
The rule is ``asteria.refresh.cost.choose_frequency`` on the capacity record's numbers
(``Capacity.times_for_f``): a round of every factor as the cost model prices it (measured
rates: the INIT round's, the calibration jobs', the REFRESH rounds'), the step (median of the
steps so far and the one in progress), the forward and backward (a step's end to the next
step's start). 1.5x the round within the forward and backward: f = 1 with S = 0; else f = the
fewest steps that cover it, and with ``staleness="auto"`` S = f (never below an integer S; with
an integer S, S stays). Both auto: S is chosen here, at most the smallest integer f of the other
groups; ``choose_s`` leaves it alone. The choice step depends on step counts alone, and f is
stored in every preconditioned parameter's state of such a group (``frequency.auto``, -1 before
the choice), so the trajectory is a pure function of the inputs and that f, and a resumed run
keeps it (``restore``).

``refresh_policy="drift"``: refresh per factor, continuously, stalest first (docs/capacity.md,
"Refresh per factor"; ``asteria.optim.per_factor`` has its rule). S is not read, and f must be
an integer (``check_frequency``).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Optional, Union

from asteria.optim import _layout as K
from asteria.optim._state import _count
from asteria.optim.method import REFRESH, is_int, require
from asteria.optim.per_factor import AUTO, DRIFT, PerFactor, check_max_age
from asteria.optim.step_end import StepEnd
from asteria.refresh.capacity import Capacity, report_lines
from asteria.refresh.cost import JobSpec, choose_frequency, choose_staleness
#: precondition_frequency="auto" is chosen when a parameter of such a group reaches this step
#: count, by ``Method.init_step``: SOAP and KL-Shampoo at their first counted step (the REFRESH
#: op timed by calibration jobs submitted with the first-step eigendecompositions), Shampoo at
#: its second (from its first REFRESH round: it has no first step to submit them with)
CHOOSE_F_AT = {True: 1, False: 2}


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


def full_round(run, method) -> list:
    """A REFRESH round of every factor of the preconditioned parameters, as the cost model
    prices it: [JobSpec] per (factor size, dtype), the method's REFRESH op."""
    op, pw = method.REFRESH_OP
    sizes: Counter = Counter()
    for group in run.param_groups:
        for p in group["params"]:
            if p.numel() == 0 or run.is_adamw(p, group):
                continue
            dtype = method.state_dtype(p, group)
            for shape in run.layout(p, group).block_shapes:
                for d, has in zip(shape, method.has_factor(shape, group)):
                    if has:
                        sizes[(int(d), dtype)] += 1
    return [JobSpec(op, dt, n, k, p=pw) for (n, dt), k in sizes.items()]


class Cadence:
    """The cadence part of an ``AsteriaOptimizer`` (``opt.cadence``): f and S (module doc)."""

    #: the numbers the cadence keeps in a preconditioned parameter's state: the S, the f, the
    #: budget and the d an "auto" run chose (-1 before the choice; the checkpoint part loads
    #: them as flags)
    STATE_KEYS = (K.AUTO_S, K.AUTO_F, *PerFactor.STATE_KEYS)

    def __init__(self, run, method) -> None:
        self.run = run
        self.method = method
        self.auto_s: Optional[int] = None  # staleness="auto": the S chosen, once chosen
        self.auto_f: Optional[int] = None  # precondition_frequency="auto": the f, once chosen
        self._capacity: Optional[Capacity] = None
        # refresh_policy="drift": the per-factor policy (built whatever the policy: a state
        # saved under one may be loaded under the other)
        self.policy = PerFactor(run, method, functools.partial(full_round, run, method))

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
        if self.per_factor:
            self.policy.check_engine()

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

    @property
    def choose_f_at(self) -> int:
        """The step count of a parameter at which an "auto" f is chosen (``CHOOSE_F_AT``)."""
        return CHOOSE_F_AT[bool(self.method.init_step)]

    @property
    def calibrates(self) -> bool:
        """Is an "auto" f, or refresh_policy="drift"'s "auto" budget or d, still to be chosen
        by a method whose REFRESH op is timed first by calibration jobs
        (``Schedule.calibrate``: with the first-step eigendecompositions)?"""
        pending = (self.policy.choosing if self.per_factor
                   else self.auto_f is None and self.auto_frequency)
        return pending and self.run.is_async and bool(self.method.init_step)

    # ---- S ---------------------------------------------------------------------------------------
    @property
    def delay(self) -> int:
        """S: steps between a snapshot and its install (0 in sync mode); with
        refresh_policy="drift" d, the ``install_delay`` (``PerFactor.delay``)."""
        if not self.run.is_async:
            return 0
        if self.per_factor:
            return self.policy.delay
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
            return self.policy.lags
        return self.delay > 0 or (self.run.is_async and self.run.cfg.staleness == AUTO)

    # ---- the step end's question -----------------------------------------------------------------
    def due(self, end: StepEnd) -> list:
        """[(item, install step)] of the factors that start a refresh at this step end (the
        items of ``end.due``, in their order). First the choices this step end makes (an auto
        S from the measured rounds, an auto f at its step count), then the install step of
        each: t + S (an auto S not chosen yet is chosen from the price of this round first).
        With refresh_policy="drift", the per-factor policy's answer (``PerFactor.due``)."""
        if self.per_factor:
            return self.policy.due(end, self.capacity)
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
        if max(steps.values(), default=0) < self.choose_f_at:
            return end.due
        if self.method.init_step:
            if self.capacity.fb_s() is None:
                return []  # a run resumed before the choice: its first basis until then
            end.calibrate()  # the REFRESH op's rates, timed without a REFRESH installed
        # both auto: S is chosen with f, unless it was chosen before (an "auto" group added
        # after an auto S was chosen for the integer groups: S stays, once chosen)
        joint = self.run.cfg.staleness == AUTO and self.auto_s is None
        fixed = self.auto_s if self.run.cfg.staleness == AUTO else self.run.cfg.staleness
        times = self.capacity.times_for_f(full_round(self.run, self.method), end.stall_ns)
        if times is None:
            return [] if self.method.init_step else end.due
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

    # ---- refresh per factor (refresh_policy="drift") -------------------------------------------
    @property
    def per_factor(self) -> bool:
        """refresh_policy="drift": does each factor start and install on its own? (The
        schedule's wire form of the refreshes in flight is then per factor.)"""
        return self.run.cfg.refresh_policy == DRIFT

    def factor_keys(self, n: int, j: int, dim: int) -> tuple[set, dict]:
        """(flags, {name: (shape, dtype)}) of one factor's keys in the state with
        refresh_policy="drift": its basis age and its sketch (the checkpoint part's check of a
        loaded state accepts them whatever the policy: a run may resume under another)."""
        return self.policy.factor_keys(n, j, dim)


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
        "async") the S chosen, -1 before the choice; with refresh_policy="drift" the policy's
        (``PerFactor.fixed_state``: an "auto" budget's and d's, each factor's basis age and
        sketch). Under "round" the per-factor keys, loaded from a "drift" state, are
        dropped."""
        st = self.run.state[p]
        if group["precondition_frequency"] == AUTO and K.AUTO_F not in st:
            st[K.AUTO_F] = -1 if self.auto_f is None else self.auto_f
        if not self.per_factor:
            if self.run.is_async and self.run.cfg.staleness == AUTO and K.AUTO_S not in st:
                st[K.AUTO_S] = -1 if self.auto_s is None else self.auto_s
            self.policy.drop_state(p, group, st)  # a state saved with "drift"
            return
        self.policy.fixed_state(p, group, st)

    def reset(self) -> None:
        """Before a load replaces the state: the loaded state says which S, f, budget and d an
        auto run chose and how old each factor's basis is (``restore``); the report starts
        again."""
        self.auto_s = None
        self.auto_f = None
        self.policy.reset()

    def restore(self) -> None:
        """After a load, once every parameter's state is back: the S and f a saved auto run
        chose, if it chose them; with refresh_policy="drift" the policy's (``PerFactor.restore``:
        its budget and d, each factor's installed basis's snapshot step)."""
        if self.run.cfg.staleness == AUTO:
            chosen = [int(st[K.AUTO_S]) for _, st in self.run.param_states() if K.AUTO_S in st]
            chosen = [c for c in chosen if c >= 0]
            self.auto_s = max(chosen) if chosen else None
        chosen = [int(st[K.AUTO_F]) for _, st in self.run.param_states() if K.AUTO_F in st]
        chosen = [c for c in chosen if c >= 1]
        self.auto_f = max(chosen) if chosen and self.auto_frequency else None
        if self.per_factor:
            self.policy.restore()

    def export_state(self, states: dict, index: dict) -> None:
        """Write the numbers the cadence keeps outside the state into a state dict's ``states``
        ({index[param]: its state, a copy}): with refresh_policy="drift" each factor's basis
        age (steps since the snapshot of its installed basis)."""
        if self.per_factor:
            self.policy.export_state(states, index)

    # ---- the report ------------------------------------------------------------------------------
    def stats(self, defers: bool) -> dict:
        """The cadence's entries of ``asteria_stats()``: S as applied now, whether "auto" S
        and f were chosen yet, the f of the "auto" groups now, and the capacity report's
        figures (``capacity_*``); with refresh_policy="drift" the policy's (``PerFactor.stats``).
        ``defers``: an S = 0 round runs during the next forward and
        backward (``Schedule.defers``), its window."""
        s = self.delay
        out = {"staleness": s, "staleness_auto": self.run.cfg.staleness == AUTO,
               "staleness_auto_chosen": self.auto_s is not None,
               "frequency_auto": self.auto_frequency,
               "frequency_auto_f": self.auto_frequency_now() if self.auto_frequency else None,
               "frequency_auto_chosen": self.auto_f is not None,
               "refresh_policy": self.run.cfg.refresh_policy}
        if self.per_factor:
            out.update(self.policy.stats())
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
        lines = self.policy.plan_lines() if self.per_factor else []
        if self.run.cfg.staleness == AUTO:
            lines.append(f"staleness 'auto': S = {s} " + (
                "(chosen from the measured round time)" if self.auto_s is not None
                else "(0, to be chosen with precondition_frequency 'auto')"
                if self.auto_frequency else
                "(the frequency, until a REFRESH round has been measured)"))
        if self.auto_frequency:
            how = ("chosen from the measured round and step times" if self.auto_f
                   else f"until the choice, at a parameter's step {self.choose_f_at}")
            lines.append(f"precondition_frequency 'auto': f = "
                         f"{self.auto_frequency_now()} ({how})")
        lines.extend(report_lines(self.capacity.summary(s, defers)))
        return lines

