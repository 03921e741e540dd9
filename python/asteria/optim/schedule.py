"""The refresh rounds of an Asteria optimizer (``opt.schedule``): snapshot at a step end,
install at the step the cadence names, the bounded barrier and what a failed REFRESH does.

Owns: the rounds of REFRESH jobs in flight, the jobs that time the REFRESH op before an "auto"
f is chosen (``calibrate``, ``calibrated``: results dropped), the block keys and versions of
the jobs it submits (from 1; a method's background jobs number theirs, ``background``), the one
consecutive-failure count per factor, installs deferred to the next use, when the background
jobs that still write state are taken (``writes``: at a step's start, before a checkpoint; a
``BackgroundJobs``), device-side counts (``count_lazy``), the step end (installs, then new
snapshots) and the wire form of the refreshes in flight (``wait_pending``, ``export_pending``,
``reset``, ``restore_pending``: the checkpoint part calls them and never sees a round). Which
factors refresh and when each is installed is the cadence's (``asteria.optim.cadence``: f and
S, fixed or "auto"): at every step end the schedule asks it (``Cadence.due``) and submits what
it is told, each job with its install step as the engine's deadline (a replicated engine's
budget is ``deadline - snapshot_step``).
Built with what it uses (``Schedule(run, method, placement, writes, cadence)``): the run
record (``run.py``: engine, config, step counter, parameter index, counters, replicas). May
call: the engine (``submit`` / ``ready`` / ``wait`` / ``step_end``), the cadence (``due``,
``lags``, and its capacity record, ``asteria.refresh.capacity.Capacity``, which the schedule
feeds every round's jobs, step and stall times), the method (``refresh_input``, ``install``,
``output_specs``, ``has_factor``, ``output_name``) and the placement's ``owned``.
Single-threaded (the training thread); the engine's workers never see these objects.

Schedule (DESIGN.md, "Staleness"). Steps are counted per ``step()`` call (t = 1, 2, ...).
 - At the end of step t, first every round whose time has come is installed: its install step
   (t_snapshot + S) has come (``install="deterministic"``: exactly then, waiting at the bounded
   barrier if need be), or (``install="eager"``) all its jobs are ready. Then the factors that
   start a refresh (``Cadence.due``: those that came due in step t, k % f == 0 for their
   parameter) are snapshotted and submitted: one batched job per (op, factor size, dtype,
   device), grouped over all same-shape blocks of all parameters, one round per install
   step. A round whose install step is t (``mode="sync"``, or S = 0) is installed at once;
   in ``mode="async"`` with a rank-local executor, an S = 0 round's install is carried out at
   the next use of the state instead (the next ``step()``'s start, a read of
   ``optimizer.state``, ``state_dict()``, ``close()``, ``add_param_group``): nothing changes
   the state in between, so the trajectory is the same (sync's), and the REFRESH runs during
   the next forward and backward rather than at a barrier in this step's end.
   So a refresh always starts from the newest installed basis. Each job carries a block key
   that is stable for its set of (parameter, block, dimension) targets (the engine's traces
   and a replicated engine's owners see one block across rounds).
 - The first-step eigendecomposition of SOAP and KL-Shampoo goes through the engine too, but is
   waited for at once whatever S is: before it no basis exists to precondition with. A factor
   that is c*I (the all-zero "fake step" of torch.distributed.checkpoint) gets the identity as
   its basis without any job.
 - A parameter with a non-finite gradient is skipped entirely (parameter, state, step count and
   refresh schedule untouched) and counted. A job that fails keeps the previous preconditioner.
 - ``state_dict()`` waits for the rounds in flight and stores their results, not installed,
   with the number of steps until their install, in the parameters' state; ``load_state_dict``
   turns them back into rounds, so the run resumes on the same trajectory.
 - A wait at the bounded barrier that a signal interrupts (Ctrl-C) loses nothing: the results
   already waited for stay with their round, and what is left of the step end is finished
   first by the next ``step()``, ``state_dict()`` or ``close()``, so a caught
   KeyboardInterrupt leaves the run on the trajectory of an uninterrupted one.
 - After ``max_failures`` failed refreshes in a row of one factor the step raises (or, with
   ``on_failure="keep"``, warns), naming the parameter and the cause, in every mode.
 - ``staleness="auto"`` and ``precondition_frequency="auto"``: the cadence chooses them
   (``asteria.optim.cadence``), in ``Cadence.due``, at the step ends its module doc names.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections import defaultdict
from typing import Optional

import torch

from asteria.optim import _layout as K
from asteria.optim._blocking import Layout
from asteria.optim._state import _count, _States, local
from asteria.optim.background import BackgroundJobs
from asteria.optim.step_end import StepEnd
from asteria.optim.method import INIT, REFRESH
from asteria.refresh.capacity import CALIBRATION
from asteria.refresh.cost import JobSpec
from asteria.refresh.engine import SubmitOptions


# The fixed state keys of a REFRESH in flight (present from a preconditioned parameter's state
# creation on whenever a refresh may be in flight at a step end, ``Cadence.lags``; see
# "Checkpoints" in checkpoint.py's docstring; names in _layout): K.PENDING_IN (steps until the
# install; NO_ROUND: nothing in flight), K.PENDING_AGE, and per (block, dim) its outputs
# (K.pending_output) and their flag (K.pending_ok)
NO_ROUND = -1


@dataclasses.dataclass
class _Job:
    ticket: int
    targets: list  # [(param, block index j, block dimension)], one per batch entry


class _Round:
    """The REFRESH jobs snapshotted at one step end; installed together, at one step end."""

    def __init__(self, kind: str, snapshot_step: int, install_step: int, jobs: list[_Job],
                 outputs: Optional[dict] = None):
        self.kind = kind
        self.snapshot_step = snapshot_step
        self.install_step = install_step
        self.jobs = jobs
        self.failed = 0
        # param -> {(j, dim): output tuple, or None where the job failed}; None until resolved
        self.outputs = outputs
        # [(targets, error)] of the jobs that failed, once resolved
        self.failures: list = []
        # ticket -> Result of the jobs already waited for: a wait interrupted by a signal
        # (Ctrl-C) loses nothing, and the next resolve waits for the others only
        self._results: dict = {}

    def ready(self, engine) -> bool:
        return self.outputs is not None or all(
            j.ticket in self._results or engine.ready(j.ticket) for j in self.jobs)

    def resolve(self, engine) -> dict:
        """Wait (the bounded barrier) for every job and keep the results."""
        if self.outputs is None:
            for job in self.jobs:
                if job.ticket not in self._results:
                    self._results[job.ticket] = engine.wait(job.ticket)
            out: dict = {}
            for job in self.jobs:
                res = self._results[job.ticket]
                if res.status:
                    self.failed += 1
                    self.failures.append((job.targets, res.error or f"status {res.status}"))
                for b, (p, j, dim) in enumerate(job.targets):
                    per_param = out.setdefault(p, {})
                    per_param[(j, dim)] = (None if res.status
                                           else tuple(o[b] for o in res.outputs))
            self.outputs = out
            self._results = {}
        return self.outputs

    def drop(self, engine) -> None:
        if self.outputs is None:
            for job in self.jobs:
                if job.ticket in self._results:
                    continue
                engine.cancel(job.ticket)  # a job already running just finishes
                engine.wait(job.ticket)
        self.outputs = {}
        self._results = {}


def _stack_inputs(qs: list) -> torch.Tensor:
    """The stack of a job's bases / roots. Blocks on NVMe (``OnNvme``: no ``copy_``) are read
    straight into it one at a time; a mix of host and device blocks is stacked in host memory."""
    if len({x.device for x in qs}) == 1 and all(isinstance(x, torch.Tensor) for x in qs):
        return torch.stack(qs)
    q = torch.empty((len(qs),) + tuple(qs[0].shape), dtype=qs[0].dtype)
    for x, dst in zip(qs, q.unbind(0)):
        if isinstance(x, torch.Tensor):
            dst.copy_(x)
        else:
            x.read_into(dst)
    return q


class Schedule:
    """The schedule part of an ``AsteriaOptimizer`` (``opt.schedule``)."""

    def __init__(self, run, method, placement, writes: BackgroundJobs, cadence) -> None:
        self.run = run
        self.method = method
        self.placement = placement
        self.cadence = cadence  # which factors refresh, and when each is installed
        # a method's background jobs that still write state: taken before a step starts and
        # before a checkpoint (every other reader of the state settles them itself)
        self.writes = writes
        self.rounds: list[_Round] = []
        self.block_keys: dict[tuple, int] = {}
        self.versions: dict[int, int] = {}
        self.zeros: dict = {}  # (dtype, device) -> the zero behind the placeholders
        self.unfinished_end: Optional[list] = None  # see step_end
        self.starts: Optional[list] = None  # the cadence's answer at this step end (see due)
        self.deferred: list = []  # S = 0 rounds installed at the next use (see defers)
        self.settling = False     # a deferred install is running (its reads must not recurse)
        self.fail_streak: dict = {}  # (param index, block, dim) -> consecutive failures
        self.failed: list = []       # failures to raise at the end of this step
        self.lazy_counts: dict = {}  # name -> device tensor (see count_lazy)
        self.stall_ns = 0  # this step end's time at the bounded barrier
        self.grouped: Optional[tuple] = None  # the last round's jobs as grouped (see group)
        # refresh per factor (Cadence.per_factor): the results installed since the last step
        # end, [((param, j, dim), snapshot step)], for the cadence's basis ages
        self.installed: list = []
        # precondition_frequency="auto": the jobs that time the REFRESH op before the choice,
        # results dropped (see calibrate)
        self.calibration: Optional[_Round] = None

    def step_start(self) -> None:
        """A ``step()`` starts: the capacity record times the forward and backward before it;
        the jobs that write state, done during that forward and backward, are taken in one go
        (so the step's reads of the state take the direct path); then what an earlier step end
        left is finished (``settle``): the installs deferred to this use. Their own jobs that
        write state (SOAP's m, on a worker) run on while the step works on state they do not
        write; the method's read of what they write waits for them (``SOAPMethod.step_blocks``)
        and the step takes the rest before its end."""
        self.cadence.capacity.step_start()
        self.writes.start_due()  # what an interrupted step left to start
        if self.writes:
            self.writes.settle_all()
        self.settle()

    @property
    def eager(self) -> bool:
        return self.run.is_async and self.run.cfg.install == "eager"

    def fixed_state(self, p: torch.Tensor, group: dict, layout: Layout) -> None:
        """Add the schedule's keys of the fixed key set that p's state lacks (at creation,
        after a load, after the cadence's): where a refresh may be in flight at a step end
        (``Cadence.lags``), the placeholders of a REFRESH in flight: its install step and age
        per parameter, or per factor where each factor starts and installs on its own
        (``Cadence.per_factor``: ``b{j}.pending_in{dim}``, ``b{j}.pending_age{dim}``)."""
        if not self.cadence.lags:
            return
        st = self.run.state[p]
        per_factor = self.cadence.per_factor
        if K.PENDING_IN not in st and not per_factor:
            st[K.PENDING_IN], st[K.PENDING_AGE] = NO_ROUND, 0
        for j, shape in enumerate(layout.block_shapes):
            for dim, has in enumerate(self.method.has_factor(shape, group)):
                if not has:
                    continue
                if per_factor and K.pending_in(j, dim) not in st:
                    st[K.pending_in(j, dim)], st[K.pending_age(j, dim)] = NO_ROUND, 0
                ok = K.pending_ok(j, dim)
                if ok not in st:
                    st[ok] = 0
                specs = self.method.output_specs(p, group, shape[dim])
                for i, (oshape, dtype) in enumerate(specs):
                    key = K.pending_output(j, dim, i)
                    if key not in st:
                        st[key] = self.placeholder(oshape, dtype, local(p).device)

    # ---- the wire form of the refreshes in flight (the checkpoint part calls these) ----------
    def wait_pending(self) -> None:
        """Before a state dict is made: finish what a signal interrupted and the jobs that write
        state, then wait for every refresh in flight (its results are stored, not installed).
        After ``close()`` a refresh that was in flight is gone with the engine: RuntimeError."""
        self.settle()
        self.writes.settle_all()
        lost = [r for r in self.rounds if r.outputs is None] if self.run.closed else []
        if lost:  # close() stopped the engine: the results of these rounds no longer exist
            r = lost[0]
            raise RuntimeError(
                f"state_dict() after close(): close() stopped the engine with a REFRESH in "
                f"flight (snapshotted at step {r.snapshot_step}, to be installed at step "
                f"{r.install_step}; this run is at step {self.run.t}), and its results went "
                f"with it, so this state would not resume the run's trajectory. Call "
                f"state_dict() before close(): it waits for the refresh and stores its results")
        for rnd in self.rounds:
            rnd.resolve(self.run.engine)

    def export_pending(self, states: dict, index: dict) -> None:
        """Write the refreshes in flight (``wait_pending`` first) into a state dict's
        ``states`` ({index[param]: its state, a copy}): real zeros for the placeholders, then
        each round's results with ``pending.install_in`` / ``pending.age`` (per factor,
        ``b{j}.pending_in{dim}`` / ``b{j}.pending_age{dim}``, where factors start on their own:
        ``Cadence.per_factor``) and their flags."""
        for i, st in list(states.items()):
            if isinstance(st, dict) and K.PENDING_IN in st:
                # real zeros for the placeholders (a checkpoint writes them)
                st = states[i] = dict(st)
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and K.is_pending_output(k):
                        st[k] = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        t = self.run.t
        per_factor = self.cadence.per_factor
        for rnd in self.rounds:
            for p, outs in rnd.outputs.items():
                st = dict(states[index[p]])
                if not per_factor:
                    st[K.PENDING_IN] = rnd.install_step - t
                    st[K.PENDING_AGE] = t - rnd.snapshot_step
                for (j, dim), out in outs.items():
                    if per_factor:  # a failed one too: the factor is in flight until then
                        st[K.pending_in(j, dim)] = rnd.install_step - t
                        st[K.pending_age(j, dim)] = t - rnd.snapshot_step
                    if out is None:  # the job failed: nothing to install
                        continue
                    for i, tensor in enumerate(out):
                        st[K.pending_output(j, dim, i)] = tensor
                    st[K.pending_ok(j, dim)] = 1
                states[index[p]] = st

    def reset(self) -> None:
        """Before a load replaces the state: nothing in flight, pending or failing is kept (the
        jobs that write state are applied first; the refreshes in flight are dropped)."""
        self.unfinished_end = self.starts = self.grouped = None
        self.deferred = []  # its rounds are dropped below with the others
        self.writes.settle_all()
        if self.calibration is not None:
            self.calibration.drop(self.run.engine)
            self.calibration = None
        for rnd in self.rounds:
            rnd.drop(self.run.engine)
        self.rounds = []
        self.fail_streak, self.failed = {}, []
        self.installed = []

    def restore_pending(self, p: torch.Tensor, st: dict) -> None:
        """Take the refreshes in flight out of p's loaded state ``st`` (a plain dict, changed in
        place; after ``reset``) and make them rounds again: rounds are per (install step,
        snapshot step), read per parameter or, where saved so, per factor."""
        install_in = _count(st.pop(K.PENDING_IN, NO_ROUND))
        age = _count(st.pop(K.PENDING_AGE, 0))
        outs: dict = defaultdict(dict)
        oks: dict = {}
        when: dict = {}  # (block, dim) -> (install_in, age): saved per factor
        for k in list(dict.keys(st)):
            key = K.Key.parse(k)
            if K.is_pending_output(k):
                outs[(key.block, key.dim)][key.output] = st.pop(k)
            elif K.is_pending_ok(k):
                oks[(key.block, key.dim)] = _count(st.pop(k))
            elif key is not None and key.field in (K.PENDING_IN_FIELD, K.PENDING_AGE_FIELD):
                i = 0 if key.field == K.PENDING_IN_FIELD else 1
                when.setdefault((key.block, key.dim), [NO_ROUND, 0])[i] = _count(st.pop(k))
        t = self.run.t
        # without a flag (a state dict from before the fixed key set): present = a result
        results = {key: tuple(v[n] for n in sorted(v))
                   for key, v in outs.items() if oks.get(key, 1)}
        rounds: dict = defaultdict(dict)  # (install_in, age) -> {(j, dim): result or None}
        if install_in != NO_ROUND:  # saved per parameter
            rounds[(install_in, age)] = {key: out for key, out in results.items()
                                         if key not in when}
        for key, (inn, ago) in when.items():
            if inn != NO_ROUND:  # None: its job failed, nothing to install
                rounds[(inn, ago)][key] = results.get(key)
        for (inn, ago), mine in rounds.items():
            rnd = next((r for r in self.rounds if r.install_step == t + inn
                        and r.snapshot_step == t - ago), None)
            if rnd is None:
                rnd = _Round(REFRESH, t - ago, t + inn, [], outputs={})
                self.rounds.append(rnd)
            rnd.outputs[p] = mine

    def in_flight(self) -> list:
        """The parameters of the refreshes in flight (an install at a step end writes them)."""
        return [p for rnd in self.rounds
                for p in [t[0] for job in rnd.jobs for t in job.targets] + list(rnd.outputs or ())]

    def placeholder(self, shape, dtype, device) -> torch.Tensor:
        """A zero tensor of this shape that costs one element: a stride-0 view of a shared
        zero. ``state_dict()`` hands out real zeros in its place."""
        key = (dtype, device)
        zero = self.zeros.get(key)
        if zero is None:
            zero = self.zeros[key] = torch.zeros((), dtype=dtype, device=device)
        return zero.expand(shape)

    def step_end(self, due: list) -> None:
        self.run.engine.step_end(self.run.t)  # ReplicatedEngine: finished owner results to the sync
        # what is left of this step end, should a wait in it be interrupted (Ctrl-C at the
        # bounded barrier): the next step(), state_dict() or close() finishes it first, so a
        # caught KeyboardInterrupt leaves the run on the trajectory of an uninterrupted one
        self.unfinished_end = list(due)
        self.finish_step_end()

    def finish_step_end(self) -> None:
        t = self.run.t
        for rnd in list(self.rounds):
            if rnd.install_step <= t or (self.eager and rnd.ready(self.run.engine)):
                self.install_round(rnd)
        init = [d for d in self.unfinished_end if d[0] == INIT]
        if init:  # the first-step eigendecompositions: installed now, whatever S is
            rnd = self.submit(INIT, init, t)
            self.rounds.append(rnd)
            self.unfinished_end = [d for d in self.unfinished_end if d[0] != INIT]
            self.install_round(rnd)
            if self.cadence.calibrates:
                self.calibrate(init)
        if self.starts is None:  # asked once per step end: an interrupted one keeps the answer
            due = self.unfinished_end
            self.starts = self.cadence.due(StepEnd(t, due, self.stall_ns, self.defers(),
                                                   self.price, self.flight, self.installed,
                                                   self.factor,
                                                   calibrate=lambda: self.calibrated(due)))
            self.unfinished_end = []
            self.installed = []
        rounds: dict = {}  # install step -> its REFRESH items, one round each
        for item, at in self.starts:
            rounds.setdefault(at, []).append(item)
        for at, items in rounds.items():
            rnd = self.submit(REFRESH, items, at)
            self.rounds.append(rnd)
            self.starts = [x for x in self.starts if x[1] != at]
            if rnd.install_step == t and self.defers():
                self.deferred.append(rnd)
            elif rnd.install_step == t or (self.eager and rnd.ready(self.run.engine)):
                self.install_round(rnd)
        self.unfinished_end = self.starts = self.grouped = None
        self.cadence.capacity.step_end(self.stall_ns)
        self.stall_ns = 0
        self.raise_failures()

    def settle(self) -> None:
        """Finish a step end that a signal interrupted (see ``step_end``), then carry out the
        installs deferred from it (``settle_deferred``)."""
        if self.unfinished_end is not None:
            self.finish_step_end()
        self.settle_deferred()

    def defers(self) -> bool:
        """May an S = 0 round's install wait for the next use of the state? Its install step is
        the step that submitted it, and nothing changes the state between that step's end and
        the next step's start: installing it then, or at the first read of ``optimizer.state``
        or ``state_dict()`` / ``close()`` before, is the same trajectory, while the REFRESH
        runs during the next forward and backward instead of at a barrier. Only with a
        rank-local background executor (a replicated engine's waits are collective: every
        rank must wait at the same point) and the state proxy that settles reads."""
        return (self.run.is_async and not self.run.engine.replicated
                and isinstance(self.run.state, _States))

    def settle_deferred(self) -> None:
        """Install the rounds deferred from the last step end (waiting for them if need be).
        A wait a signal interrupts keeps what was waited for; the next settle finishes it."""
        if not self.deferred or self.settling:
            return
        self.settling = True
        try:
            while self.deferred:
                if self.deferred[0] in self.rounds:  # else a step end installed it already
                    self.install_round(self.deferred[0])
                self.deferred.pop(0)
        finally:
            self.settling = False
        # its barrier time counts in the next step end's stall; failures it records are raised
        # at the end of the next step, which completes first

    def group(self, kind: str, items: list) -> dict:
        """A round's jobs: {(op, factor size, dtype, device, power, eps, replicas): [(param, j,
        dim, F, Q)]} of the items [(kind, param, j, dims)], in their order. The last grouping
        is kept until that round is submitted (the cadence may price it first: the method's
        inputs are asked for once)."""
        key = (kind, [(self.run.pindex[p], j, tuple(dims)) for _, p, j, dims in items])
        if self.grouped is not None and self.grouped[0] == key:
            return self.grouped[1]
        groups: dict = defaultdict(list)
        for _, p, j, dims in items:
            for dim in dims:
                op, f, q, pw, eps = self.method.refresh_input(kind, p, j, dim)
                k = (op, f.shape[-1], f.dtype, f.device, pw, eps, self.run.replicas(p))
                groups[k].append((p, j, dim, f, q))
        self.grouped = (key, groups)
        return groups

    def price(self, items: list) -> list:
        """[JobSpec] of the REFRESH round these items would make (``StepEnd.price``)."""
        return [JobSpec(k[0], k[2], int(k[1]), len(v), p=k[4])
                for k, v in self.group(REFRESH, items).items()]

    def flight(self) -> dict:
        """{(param, j, dim): (snapshot step, install step)} of the REFRESH results in flight
        (``StepEnd.in_flight``)."""
        out = {}
        for rnd in self.rounds:
            if rnd.kind != REFRESH:
                continue
            when = (rnd.snapshot_step, rnd.install_step)
            for job in rnd.jobs:
                for p, j, dim in job.targets:
                    out[(p, j, dim)] = when
            for p, outs in (rnd.outputs or {}).items():
                for j, dim in outs:
                    out[(p, j, dim)] = when
        return out

    def factor(self, p: torch.Tensor, j: int, dim: int) -> torch.Tensor:
        """The factor a REFRESH of (p, j, dim) would take now (``StepEnd.factor``)."""
        return self.method.refresh_input(REFRESH, p, j, dim)[1]

    # ---- the calibration of an "auto" f (``Cadence.choose_f``) -------------------------------
    def calibrate(self, items: list) -> None:
        """Time the REFRESH op on one factor of each job of the round ``items`` [(kind, param,
        j, dims)] would make (per op, factor size and dtype; their REFRESH inputs): jobs whose
        results are dropped, so that the cost model has the op's rates when an "auto" f is
        chosen, and no REFRESH is installed before the choice (the run is then the run of the
        f chosen). Submitted with the first-step eigendecompositions, after their install;
        they run during the next forward and backward. Not counted as refreshes."""
        if self.calibration is not None or not items:
            return
        refresh = [(REFRESH, p, j, dims) for _, p, j, dims in items]
        self.calibration = self.submit(REFRESH, refresh, self.run.t + 1, calibration=True)

    def calibrated(self, items: list) -> None:
        """The calibration jobs done, their times with the capacity record
        (``StepEnd.calibrate``): waits for them (time at the bounded barrier), first
        submitting them from ``items`` if none are in flight and no REFRESH round has measured
        the op (a run resumed from a state dict saved before the choice), and drops their
        results."""
        if self.calibration is None:
            if self.cadence.capacity.measured_refresh_s():
                return  # a REFRESH round has measured the op (a run resumed before the choice)
            self.calibrate(items)
        if self.calibration is None:
            return
        t0 = time.monotonic_ns()
        # a wait a signal interrupts is taken again; the step the choice reads excludes it
        self.cadence.capacity.stalled(lambda: self.calibration.resolve(self.run.engine))
        self.stall_ns += time.monotonic_ns() - t0
        self.calibration = None

    def submit(self, kind: str, items: list, install_step: int,
               calibration: bool = False) -> _Round:
        """Submit a round of items [(kind, param, j, dims)], to be installed at the end of step
        ``install_step`` (the engine's deadline); with ``calibration``, one entry of each job
        only, recorded as such, not as a round (``calibrate``)."""
        groups = self.group(kind, items)
        if calibration:
            groups = {k: v[:1] for k, v in groups.items()}
        self.grouped = None  # its inputs live as long as this round's submission only
        jobs, specs, submit_s = [], {}, {}
        start_ns = time.monotonic_ns()
        # libasteria's pool takes the factors as parts: its shadow snapshots them straight into
        # one ring slot, with no stack in fresh memory first (whose page faults were half of a
        # refresh step's extra time on the host)
        local = self.takes_parts()
        for (op, _, _, _, pw, eps, replicas), entries in groups.items():
            fs = [e[3] for e in entries]
            f = fs if local else torch.stack(fs)
            q = None
            if entries[0][4] is not None:
                q = _stack_inputs([e[4] for e in entries])
            targets = [(p, j, dim) for p, j, dim, _, _ in entries]
            key = (kind, op, tuple((self.run.pindex[p], j, dim) for p, j, dim in targets))
            block = self.block_keys.setdefault(key, len(self.block_keys) + 1)
            version = self.versions[block] = self.versions.get(block, 0) + 1
            opts = SubmitOptions(
                # the basis stack was made here for the job: the worker may read it in place
                donate=("q",) if q is not None and local else (),
                # the results go to host memory: no round trip
                host_outputs=all(self.placement.owned(p, self.method.output_name(p, j, dim))
                                 for p, j, dim in targets),
                replicas=replicas)  # synchronised within S = install_step - t
            t_sub = time.monotonic_ns()
            ticket = self.run.engine.submit(op, f, q, block=block, version=version,
                                            deadline=install_step, snapshot_step=self.run.t,
                                            p=pw, eps=eps, opts=opts)
            submit_s[ticket] = (time.monotonic_ns() - t_sub) / 1e9
            self.run.counters["refreshes_submitted"] += not calibration
            jobs.append(_Job(ticket, targets))
            specs[ticket] = JobSpec(op, fs[0].dtype, int(fs[0].shape[-1]), len(fs), p=pw)
        self.cadence.capacity.round_submitted(CALIBRATION if calibration else kind, self.run.t,
                                              specs, start_ns, submit_s)
        return _Round(kind, self.run.t, install_step, jobs)

    def install_round(self, rnd: _Round) -> None:
        if rnd.outputs is None and not rnd.ready(self.run.engine):
            # the bounded barrier: a job is late (the first round of a run excepted, the
            # capacity report says how far the refresh falls behind)
            t0 = time.monotonic_ns()
            outputs = rnd.resolve(self.run.engine)
            waited = time.monotonic_ns() - t0
            self.stall_ns += waited
            counters = self.run.counters
            counters["install_waits"] = counters.get("install_waits", 0) + 1
            counters["install_wait_ns"] = counters.get("install_wait_ns", 0) + waited
        outputs = rnd.resolve(self.run.engine)
        self.method.install(rnd.kind, outputs)
        if rnd.kind == REFRESH and self.cadence.per_factor:
            self.installed.extend(((p, j, dim), rnd.snapshot_step)
                                  for p, outs in outputs.items()
                                  for (j, dim), out in outs.items() if out is not None)
        self.run.counters["refresh_failures"] += rnd.failed
        self.count_failures(rnd)
        lag = self.run.t - rnd.snapshot_step
        # one install per job; a round restored from a checkpoint has one per parameter
        for _ in range(len(rnd.jobs) if rnd.jobs else len(outputs)):
            self.run.engine.note_install(rnd.snapshot_step, self.run.t)
            self.run.counters["installs"] += 1
        self.run.counters["max_install_lag"] = max(self.run.counters["max_install_lag"], lag)
        if rnd in self.rounds:
            self.rounds.remove(rnd)

    def count_failures(self, rnd: _Round) -> None:
        """Consecutive failed refreshes per (parameter, block, dimension), the same count in
        every mode. At ``max_failures`` in a row the failure is recorded for
        ``_raise_failures`` (``on_failure="raise"``) or warned about once (``"keep"``)."""
        failed = {}
        for targets, error in rnd.failures:
            for p, j, dim in targets:
                failed[(self.run.pindex[p], j, dim)] = error
        for p, outs in rnd.outputs.items():
            for (j, dim), out in outs.items():
                key = (self.run.pindex[p], j, dim)
                if key not in failed:
                    self.fail_streak.pop(key, None)
        limit = self.run.cfg.max_failures
        params = {i: p for p, i in self.run.pindex.items()}
        for key, error in failed.items():
            n = self.fail_streak[key] = self.fail_streak.get(key, 0) + 1
            if n != limit:
                continue
            factor = self.method.refresh_input(REFRESH, params[key[0]], key[1], key[2])[1]
            if not bool(torch.isfinite(factor).all()):
                error = "its Kronecker factor is not finite: it overflowed; last error: " + error
            what = (f"the REFRESH of {self.run.describe(key[0])}, block {key[1]}, "
                    f"dimension {key[2]} failed {n} times in a row ({error})")
            if self.run.cfg.on_failure == "raise":
                self.failed.append(what)
            else:
                warnings.warn(f"Asteria: {what}; the previous preconditioner is kept "
                              f"(runtime on_failure='keep')", RuntimeWarning, stacklevel=5)

    def count_lazy(self, name: str, n: torch.Tensor) -> None:
        """Add a count that lives on the device (no sync in the step); read by
        ``asteria_stats()``."""
        prev = self.lazy_counts.get(name)
        self.lazy_counts[name] = n if prev is None else prev + n.to(prev.device)

    def raise_failures(self) -> None:
        if not self.failed:
            return
        whats, self.failed = self.failed, []
        raise RuntimeError(
            "Asteria: " + "; ".join(whats) + ". This step is complete and the state is "
            "consistent; runtime {'on_failure': 'keep'} keeps training with the previous "
            "preconditioner instead of raising")

    def takes_parts(self) -> bool:
        """May jobs be given inputs made for them, and inputs as parts (an executor that reads
        them in place: libasteria's pool, not a distributed wrapper)?"""
        return self.run.engine.takes_parts
