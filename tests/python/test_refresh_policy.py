"""refresh_policy="drift" (asteria.optim.cadence, docs/capacity.md "Refresh per factor"): each
factor that comes due starts a refresh on its own, stalest first by its drift score
(asteria.optim.drift), within a budget of a full round's FLOPs per step, and installs d steps
after its start.

 - bad values of each key name the key and what is allowed;
 - with the budget of a whole round every step and d = S it is today's trajectory bit for bit
   (refresh_policy="round" at f and S), for SOAP, Shampoo and KL-Shampoo;
 - with a smaller budget the trajectory is bitwise the same whatever the workers' timing (the
   test-only job delay, varied from step to step), and so is a run whose "auto" budget and d
   were chosen under one delay against one given those values under another;
 - no basis gets older than max_age (recomputed here from the decisions), and a threshold
   skips factors that have not drifted, counted per parameter;
 - a state dict taken with factors of one parameter in flight with different install steps
   resumes bit for bit;
 - the probes' score against the exact relative change, and the bound it is of Purifying
   Shampoo's r;
 - replicas (DDP) agree and owners (FSDP2, fsdp_blocking="global") decide: two ranks,
   tests/python/dist/refresh_policy.py.

The runs are real: libasteria's pool on this machine's cores, the float64 models of models.py.
"""

from __future__ import annotations

import copy
import math
import os
import time

import pytest
import torch

from asteria import RuntimeConfig
from asteria.optim import SOAP
from asteria.optim import _layout as K
from asteria.optim.drift import PROBES, Probes
from asteria.optim.per_factor import age_floor
from asteria.refresh import cost as C
from asteria.refresh.capacity import Capacity
from job_delay import delay_jobs, runtimes_of, set_job_delay
from models import (assert_resumes_bitwise, loss_and_grad, make_model, optimizer_pairs,
                    params_of, require_c_extension, run)

NAMES = ("soap", "shampoo", "kl_shampoo")
KIND = "block"  # six 8 x 8 weights: twelve factors of one size


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def drift(**kw) -> dict:
    return {"mode": "async", "workers": 2, "refresh_policy": "drift", **kw}


def maker(name: str, f: int = 1):
    return optimizer_pairs(f)[name][0]


def train(model, opt, first: int, last: int, each=None) -> list:
    traj = []
    for t in range(first, last + 1):
        if each is not None:
            each(t)
        loss_and_grad(model, KIND, t)
        opt.step()
        traj.append(params_of(model))
    return traj


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for pa, pb in zip(a, b)
                                    for x, y in zip(pa, pb))


# ---- the keys ---------------------------------------------------------------------------------

BAD = [("refresh_policy", "stale", '"round", "drift"'), ("refresh_policy", 1, '"round"'),
       ("refresh_budget", 0, "(0, 1]"), ("refresh_budget", 1.5, "(0, 1]"),
       ("refresh_budget", -0.2, "(0, 1]"), ("refresh_budget", float("nan"), "(0, 1]"),
       ("refresh_budget", True, "(0, 1]"), ("refresh_budget", "fast", '"auto"'),
       ("install_delay", -1, "integer d >= 0"), ("install_delay", 1.0, "integer d >= 0"),
       ("install_delay", True, "integer d >= 0"), ("install_delay", "soon", '"auto"'),
       ("max_age", 0, "integer >= 1"), ("max_age", 2.5, "integer >= 1"),
       ("max_age", "old", '"auto"'),
       ("skip_threshold", -0.1, "number >= 0"), ("skip_threshold", float("inf"), ">= 0"),
       ("skip_threshold", "low", "None"), ("skip_threshold", False, "None")]


@pytest.mark.parametrize("key,bad,allowed", BAD)
def test_bad_value_names_the_key_and_what_is_allowed(key, bad, allowed):
    with pytest.raises(ValueError) as err:
        RuntimeConfig.from_user(drift(**{key: bad}))
    msg = str(err.value)
    assert f"runtime key {key!r}" in msg and "allowed" in msg and allowed in msg, msg


def test_the_keys_against_each_other():
    model = make_model(KIND)
    # S is not read: the default S = 5 beside f = 1 is no error with "drift"
    SOAP(model.parameters(), precondition_frequency=1, runtime=drift(
        refresh_budget=0.5, install_delay=2)).close()
    with pytest.raises(ValueError, match="precondition_frequency='auto'.*refresh_budget"):
        SOAP(model.parameters(), precondition_frequency="auto", runtime=drift())
    # d = 3 at f = 1: the basis is 2 d - 1 = 5 steps old before each install, at the least
    with pytest.raises(ValueError, match=r"runtime key 'max_age': got 4; allowed: an integer >= 5"):
        SOAP(model.parameters(), precondition_frequency=1,
             runtime=drift(refresh_budget=0.5, install_delay=3, max_age=4))
    with pytest.raises(ValueError, match="runtime key 'refresh_budget'.*fsdp_blocking"):
        RuntimeConfig.from_user(drift(fsdp_blocking="global", install_delay=1))
    with pytest.raises(ValueError, match="runtime key 'install_delay'.*fsdp_blocking"):
        RuntimeConfig.from_user(drift(fsdp_blocking="global", refresh_budget=0.5))
    RuntimeConfig.from_user(drift(fsdp_blocking="global", refresh_budget=0.5, install_delay=1))
    assert RuntimeConfig().refresh_policy == "round"


def test_the_per_factor_key_names():
    for name, field in ((K.pending_in(0, 1), K.PENDING_IN_FIELD),
                        (K.pending_age(3, 10), K.PENDING_AGE_FIELD),
                        (K.basis_age(2, 0), K.BASIS_AGE), (K.drift(12, 1), K.DRIFT)):
        key = K.Key.parse(name)
        assert key.field == field and key.format() == name and key.entry
        assert not K.is_pending_ok(name) and not K.is_pending_output(name)
        assert K.Key.parse(K.renumber(name, lambda j: j + 1)).block == key.block + 1
    assert K.pending_in(0, 1) == "b0.pending_in1" and K.drift(2, 0) == "b2.drift0"


def test_age_floor():
    # start at every chance: f = 1, d = 2 -> starts every 2 steps, 3 steps old before an install
    assert [age_floor(1, d) for d in range(4)] == [0, 1, 3, 5]
    assert age_floor(3, 0) == 2 and age_floor(3, 2) == 4 and age_floor(3, 4) == 9


# ---- the whole round every step is today's trajectory ----------------------------------------

@pytest.mark.parametrize("f,s", [(3, 2), (2, 0), (1, 1)])
@pytest.mark.parametrize("name", NAMES)
def test_full_round_budget_reproduces_the_round_bitwise(name, f, s):
    make = maker(name, f)
    rnd, o1 = run(KIND, lambda p: make(p, runtime={"mode": "async", "workers": 2,
                                                   "staleness": s}), 16)
    per, o2 = run(KIND, lambda p: make(p, runtime=drift(refresh_budget=1.0, install_delay=s)),
                  16)
    assert same(rnd, per)
    a, b = o1.asteria_stats(), o2.asteria_stats()
    assert a["installs"] == b["installs"] > 0 and a["max_install_lag"] == b["max_install_lag"]
    assert b["refresh_waiting"] == b["refresh_skipped"] == b["refresh_scores"] == 0


# ---- determinism ------------------------------------------------------------------------------

def jitter(opt, delays):
    """Each step, every job of the optimizer's pool sleeps a different time first."""
    rts = runtimes_of(opt)
    assert rts

    def each(t):
        for rt in rts:
            set_job_delay(rt, delays[t % len(delays)])
    return each


@pytest.mark.parametrize("name", NAMES)
def test_same_trajectory_whatever_the_timing(name):
    make = maker(name)
    rt = drift(refresh_budget=0.34, install_delay=2, skip_threshold=0.02)
    runs = []
    for delays in ([0], [9, 0, 3, 17, 1], [0, 25, 0, 0, 6, 2, 11]):
        model = make_model(KIND)
        opt = make(model.parameters(), runtime=rt)
        try:
            runs.append(train(model, opt, 1, 14, jitter(opt, delays)))
            st = opt.asteria_stats()
            assert st["refresh_waiting"] > 0 and st["refresh_scores"] > 0  # the budget bites
        finally:
            opt.close()
    assert same(runs[0], runs[1]) and same(runs[0], runs[2])


def hold_times(monkeypatch, round_s: float, largest_s: float, step_s: float,
               fb_s: float) -> None:
    """The seconds the cadence chooses an "auto" budget and d from (``Capacity.times_for_f``),
    the test's once the real record has any: a full round's (or a batch-1 job's, the largest
    factor's), the step's and the forward and backward's."""
    real = Capacity.times_for_f

    def held(self, jobs, stall_ns=0):
        if real(self, jobs, stall_ns) is None:
            return None
        whole = len(jobs) > 1 or any(j.batch > 1 for j in jobs)
        return (round_s if whole else largest_s), step_s, fb_s

    monkeypatch.setattr(Capacity, "times_for_f", held)


def test_auto_values_chosen_once_then_the_trajectory_is_theirs(monkeypatch):
    """SOAP chooses an "auto" budget and d once (the step end after its first REFRESH round's
    install), from the capacity record's seconds, and stores them in the state: a second run
    under other job delays, which make every round's measured time another, is the same bit
    for bit. The seconds are the test's, injected where the cadence reads them
    (``times_for_f``, once the real record has them): a full round of 1 s, its largest factor
    10 ms, steps of 100 ms with 90 ms of forward and backward, so the rule gives budget 1/15
    and d = 1 whatever the machine's load (test_choose_refresh_budget_rule)."""
    hold_times(monkeypatch, 1.0, 0.010, 0.100, 0.090)
    runs = []
    for delays in ([40], [0, 7, 1]):
        model = make_model(KIND)
        opt = SOAP(model.parameters(), precondition_frequency=1, runtime=drift())
        try:
            runs.append(train(model, opt, 1, 12, jitter(opt, delays)))
            st = opt.asteria_stats()
            assert st["refresh_budget_auto_chosen"] and st["install_delay_auto_chosen"]
            b, d = st["refresh_budget"], st["install_delay"]
            assert (b, d) == (1.0 / 15, 1)
            sd = opt.state_dict()
            assert {v[K.AUTO_BUDGET] for v in sd["state"].values()
                    if K.AUTO_BUDGET in v} == {b}
            assert {v[K.AUTO_DELAY] for v in sd["state"].values() if K.AUTO_DELAY in v} == {d}
        finally:
            opt.close()
    assert same(*runs)


def test_auto_budget_is_chosen_from_calibration_jobs(monkeypatch):
    """SOAP chooses an "auto" budget and d at its first counted step end (the run's second),
    before any REFRESH round: the REFRESH op timed by calibration jobs submitted with the
    first-step eigendecompositions, whose results are dropped. So the pricing of the choice
    saw no REFRESH round and the op's own measured rate, not the eigendecompositions' rate
    applied to another op's FLOPs; and no REFRESH was submitted before it."""
    seen = []
    real = Capacity.times_for_f

    def record(self, jobs, stall_ns=0):
        out = real(self, jobs, stall_ns)
        seen.append((len(self.measured_refresh_s()),
                     self.model.sources(next(iter(self.lanes())), jobs)))
        return out

    monkeypatch.setattr(Capacity, "times_for_f", record)
    model = make_model(KIND)
    opt = SOAP(model.parameters(), precondition_frequency=1, runtime=drift())
    try:
        chosen_after, submitted = None, []
        for t in range(1, 5):
            train(model, opt, t, t)
            st = opt.asteria_stats()
            submitted.append(st["refreshes_submitted"])
            if chosen_after is None and st["refresh_budget_auto_chosen"]:
                chosen_after = t
        assert chosen_after == 2, chosen_after
        # the one pricing of the choice: no REFRESH round measured, the op's own rate
        assert seen and seen[0] == (0, ["measured"]), seen
        assert submitted[0] == 1  # the first-step eigendecompositions (one job): no refresh
    finally:
        opt.close()


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_auto_whole_round_with_no_delay_is_the_round_policy_at_f1_s0(name, monkeypatch):
    """Where a round fits the forward and backward (the rule's whole round every step, d = 0:
    the seconds injected where the cadence reads them), "drift" with "auto" budget and d is
    refresh_policy="round" at f = 1, S = 0 bit for bit: the choice comes before any REFRESH
    round, so no provisional round installs a step late first."""
    hold_times(monkeypatch, 0.010, 0.002, 0.100, 0.050)
    make = maker(name)
    runs = []
    for runtime in (drift(), {"mode": "async", "workers": 2, "staleness": 0}):
        model = make_model(KIND)
        opt = make(model.parameters(), runtime=runtime)
        try:
            runs.append(train(model, opt, 1, 8))
            st = opt.asteria_stats()
            if runtime.get("refresh_policy") == "drift":
                assert (st["refresh_budget"], st["install_delay"]) == (1.0, 0)
        finally:
            opt.close()
    assert same(*runs)


def test_choose_refresh_budget_rule():
    # 1.5 x 10 ms fits a 50 ms forward and backward: a whole round every step, d = 0
    assert C.choose_refresh_budget(0.010, 0.100, 0.050, 0.002) == (1.0, 0)
    # 1.5 x 1 s = 15 steps of 100 ms: a fifteenth per step, installed the next step end
    assert C.choose_refresh_budget(1.0, 0.100, 0.090, 0.010) == (1.0 / 15, 1)
    # one factor alone takes 0.25 s: d covers 1.5 x that
    assert C.choose_refresh_budget(1.0, 0.100, 0.090, 0.250) == (1.0 / 15, 4)
    # budget given: d for its work; d given: the budget whose work fits its window
    assert C.choose_refresh_budget(1.0, 0.100, 0.090, 0.010, budget=0.5) == (0.5, 8)
    assert C.choose_refresh_budget(1.0, 0.100, 0.090, 0.010, delay=0) == (1.0 / 17, 0)
    assert C.default_max_age(1.0 / 15, 1) == 61


# ---- max_age, the threshold, the report ---------------------------------------------------------

def decisions(opt) -> list:
    """[(t, (param index, j, dim), install step)] of every factor's start, as the cadence
    answers the schedule (recorded around ``Cadence.due``)."""
    log = []
    due = opt.cadence.due

    def recording(end):
        out = due(end)
        for (_, p, j, dims), at in out:
            log.extend((end.t, (opt.run.pindex[p], j, dim), at) for dim in dims)
        return out
    opt.cadence.due = recording
    return log


def oldest_basis(log: list, factors: list, steps: int, first: int) -> int:
    """The oldest basis any step ran with, from the starts alone: after the end of step u a
    factor's basis is from the last start installed by then (d = 0: at its own step end), or
    from step ``first`` (its state's creation)."""
    worst = 0
    for key in factors:
        starts = [(t, at) for t, k, at in log if k == key]
        for u in range(first, steps + 1):
            snap = max([t for t, at in starts if at <= u], default=first)
            worst = max(worst, u - snap)
    return worst


@pytest.mark.parametrize("d", [0, 1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_no_basis_older_than_max_age(name, d):
    make = maker(name)
    age = max(6, age_floor(1, d))
    model = make_model(KIND)
    # a twelfth of the twelve factors per step (one factor): most would wait far longer
    opt = make(model.parameters(), runtime=drift(refresh_budget=1 / 12, install_delay=d,
                                                 max_age=age))
    try:
        log = decisions(opt)
        train(model, opt, 1, 30)
        st = opt.asteria_stats()
        factors = sorted({k for _, k, _ in log})
        assert len(factors) == 12 and st["refresh_forced"] > 0
        assert oldest_basis(log, factors, 30, 1) <= age
        assert st["refresh_age_max_seen"] <= age == st["refresh_max_age"]
        assert max(at - t for t, _, at in log) == min(at - t for t, _, at in log) == d
    finally:
        opt.close()


@pytest.mark.parametrize("name", NAMES)
def test_threshold_skips_and_is_reported_per_parameter(name):
    make = maker(name)
    model = make_model(KIND)
    opt = make(model.parameters(), runtime=drift(refresh_budget=1.0, install_delay=1,
                                                 skip_threshold=0.1, max_age=4))
    try:
        train(model, opt, 1, 30)
        st = opt.asteria_stats()
        assert 0 < st["refresh_skipped_share"] < 1 and st["refresh_forced"] > 0
        by = st["refresh_skipped_share_by_param"]
        assert len(by) == 6 and all(0 <= v <= 1 for v in by.values())
        assert st["refresh_skipped_share"] == pytest.approx(
            st["refresh_skipped"] / st["refresh_candidates"])
        assert st["refresh_age_max_seen"] <= 4
        hist = st["refresh_age_hist"]
        assert sum(hist.values()) == 12 and list(hist)[:3] == ["0-1", "2-3", "4-7"]
        assert st["refresh_age_p50"] <= st["refresh_age_p90"] <= st["refresh_age_max"]
        assert st["refresh_per_step"] == st["refresh_started"] / st["refresh_step_ends"]
        plan = "\n".join(opt.asteria_plan())
        assert "refresh_policy 'drift'" in plan and "max_age = 4" in plan
        assert "drift score below 0.1" in plan
    finally:
        opt.close()


def test_round_policy_reports_its_name_only():
    model = make_model(KIND)
    opt = SOAP(model.parameters(), runtime={"mode": "async", "workers": 2, "staleness": 2})
    try:
        train(model, opt, 1, 4)
        st = opt.asteria_stats()
        assert st["refresh_policy"] == "round" and "refresh_budget" not in st
        sd = opt.state_dict()
        assert not any(K.Key.parse(k) is not None and K.Key.parse(k).field in (
            K.BASIS_AGE, K.DRIFT, K.PENDING_IN_FIELD) for v in sd["state"].values() for k in v)
    finally:
        opt.close()


# ---- state dicts --------------------------------------------------------------------------------

def spread_in_flight(opt) -> bool:
    """Factors of one parameter in flight with different install steps."""
    by_param: dict = {}
    for (p, _, _), (_, at) in opt.schedule.flight().items():
        by_param.setdefault(p, set()).add(at)
    return any(len(v) > 1 for v in by_param.values())


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_mid_flight_resumes_bitwise(name):
    make = maker(name)
    rt = drift(refresh_budget=0.2, install_delay=3, skip_threshold=0.01, max_age=9)
    assert_resumes_bitwise(KIND, lambda p: make(p, runtime=rt), 20, 11, in_flight=lambda opt: (
        spread_in_flight(opt) and any(r.outputs is None for r in opt.schedule.rounds)))


def test_state_dict_says_each_factors_install_step():
    model = make_model(KIND)
    opt = SOAP(model.parameters(), precondition_frequency=1,
               runtime=drift(refresh_budget=0.2, install_delay=3))
    try:
        train(model, opt, 1, 8)
        assert spread_in_flight(opt)
        sd = opt.state_dict()
        ins = [{k: v for k, v in st.items() if K.Key.parse(k) is not None
                and K.Key.parse(k).field == K.PENDING_IN_FIELD} for st in sd["state"].values()]
        assert any(len({v for v in d.values() if v >= 0}) > 1 for d in ins)
        assert all(K.PENDING_IN not in st for st in sd["state"].values())
        ages = [v for st in sd["state"].values() for k, v in st.items()
                if K.Key.parse(k) is not None and K.Key.parse(k).field == K.BASIS_AGE]
        assert len(ages) == 12 and all(0 <= a <= 8 for a in ages)
        refs = [v for st in sd["state"].values() for k, v in st.items()
                if K.Key.parse(k) is not None and K.Key.parse(k).field == K.DRIFT]
        assert all(r.shape == (8, PROBES) and r.dtype == torch.float32 for r in refs)
    finally:
        opt.close()


@pytest.mark.parametrize("saved,loaded", [("round", "drift"), ("drift", "round")])
def test_a_run_resumes_under_the_other_policy(saved, loaded):
    rts = {"round": {"mode": "async", "workers": 2, "staleness": 1},
           "drift": drift(refresh_budget=0.5, install_delay=1)}
    model = make_model(KIND)
    opt = SOAP(model.parameters(), precondition_frequency=1, runtime=rts[saved])
    try:
        train(model, opt, 1, 6)
        sd = copy.deepcopy(opt.state_dict())
    finally:
        opt.close()
    opt = SOAP(model.parameters(), precondition_frequency=1, runtime=rts[loaded])
    try:
        opt.load_state_dict(sd)
        train(model, opt, 7, 10)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.close()


# ---- the score --------------------------------------------------------------------------------

def test_probe_score_estimates_the_relative_change_and_bounds_r():
    """The probes' score against ||F_t - F_s|| / ||F_t|| (within 35% on these), and that
    ratio against Purifying Shampoo's r = ||offdiag(Q^T F_t Q)|| / ||Q^T F_t Q|| with Q
    F_s's eigenbasis (never above it)."""
    gen = torch.Generator().manual_seed(3)
    probes = Probes()
    for n in (16, 64, 256):
        for scale in (1e-3, 1e-2, 1e-1):
            a = torch.randn(n, 2 * n, generator=gen, dtype=torch.float64)
            fs = a @ a.T / n
            e = torch.randn(n, n, generator=gen, dtype=torch.float64)
            ft = fs + scale * (e + e.T)
            exact = float(torch.linalg.norm(ft - fs) / torch.linalg.norm(ft))
            (got,), _ = probes.scores([ft], [probes.sketch(fs)])
            assert 0.65 * exact <= got <= 1.35 * exact, (n, scale, got, exact)
            q = torch.linalg.eigh(fs).eigenvectors
            b = q.T @ ft @ q
            r = float(torch.linalg.norm(b - torch.diag(torch.diag(b))) / torch.linalg.norm(b))
            assert r <= exact * (1 + 1e-9)
    zero = torch.zeros(8, 8, dtype=torch.float64)
    assert probes.scores([zero], [torch.zeros(8, PROBES)])[0] == [0.0]
    one = torch.eye(8, dtype=torch.float64)
    assert probes.scores([one], [torch.zeros(8, PROBES)])[0] == [1.0]  # no start yet


# ---- two ranks --------------------------------------------------------------------------------

@pytest.mark.skipif(not (torch.distributed.is_available()
                         and torch.distributed.is_gloo_available()),
                    reason="torch.distributed with gloo is needed")
def test_two_ranks_replicas_agree_and_owners_decide(tmp_path):
    from test_distributed import _child_env, _rank_results, _torchrun, _wait

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist",
                          "refresh_policy.py")
    t0 = time.monotonic()
    procs, logs = _torchrun(script, ["--out", str(tmp_path)], str(tmp_path), 1, 2,
                            _child_env())
    _wait(procs, logs, t0, 300, "refresh_policy on 2 ranks")
    res = _rank_results(str(tmp_path), 2)
    for name in NAMES:
        ddp = [res[r]["ddp"][name] for r in range(2)]
        assert all(x["replicas_equal"] and x["decisions_equal"] for x in ddp), ddp
        assert ddp[0]["waiting"] > 0 and ddp[0]["started"] > 0 and ddp[0]["moved"] > 1e-3
        glob = [res[r]["fsdp_global"][name] for r in range(2)]
        # each rank decides for the factors of its own blocks, and every block has one owner
        assert all(g["decided_own_only"] and g["started"] > 0 for g in glob), glob
        assert glob[0]["reproducible"] and glob[0]["moved"] > 1e-3
        local = [res[r]["fsdp_local"][name] for r in range(2)]
        assert all(x["reproducible"] and x["started"] > 0 for x in local), local
    for name in ("soap", "shampoo"):
        hsdp = [res[r]["hsdp"][name] for r in range(2)]
        assert all(x["replicas_equal"] and x["decisions_equal"] for x in hsdp), hsdp
        assert hsdp[0]["engine"] == "ReplicatedEngine" and hsdp[0]["waiting"] > 0
    assert all(res[r]["ddp_auto_raises"]["raised"] for r in range(2))
