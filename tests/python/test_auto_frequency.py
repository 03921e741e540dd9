"""precondition_frequency="auto": the value and its checks, the rule that picks f (and S) from
a round's and a step's seconds (asteria.refresh.cost.choose_frequency), the choice a run makes
from its capacity record at a parameter's second step, its one home (the cadence) and its
place in the state dict, the reports, and the offline planner's S = 0 window, PCIe bytes and
``-f auto``.

The runs are real: libasteria's pool on this machine's cores. Where a test wants a known
choice it holds the capacity record's clock (capacity_clock.py): each step's forward and
backward lasts what the test says there, whatever the machine's load. A round that certainly
fits the forward and backward comes from a small model (milliseconds) against 60 s of forward
and backward; a round that certainly does not, from the test-only job delay (every job sleeps
first on its worker, so the model prices the round from jobs that took at least that long)
against steps of 5 ms.
"""

import copy
import time

import pytest
import torch

import asteria
from asteria import plan
from asteria.optim import SOAP, KLShampoo, OneSidedSOAP, Shampoo
from asteria.refresh import cost as C
from capacity_clock import hold_capacity_clock
from job_delay import delay_jobs
from models import loss_and_grad, make_model, params_of, require_c_extension

CLASSES = (SOAP, OneSidedSOAP, KLShampoo, Shampoo)
ALLOWED = 'an integer >= 1, or "auto"'


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def rt(staleness="auto", workers=2, **kw):
    return {"mode": "async", "staleness": staleness, "workers": workers, **kw}


# seconds of forward and backward a step on the capacity record's clock: FB_FITS holds 1.5x any
# round of these models (it would take a round of 40 s to break it); FB_SHORT is below 1.5x a
# round whose jobs sleep 60 ms or more first
FB_FITS, FB_SHORT = 60.0, 0.005


def train(model, opt, steps, start=1, fb_sleep=0.0, record=None, clock=None, fb_s=0.0):
    """``steps`` steps; ``fb_sleep``: a real sleep before each step (a forward and backward of
    some substance); with ``clock`` (capacity_clock.StepClock) each forward and backward lasts
    ``fb_s`` on the capacity record's clock instead."""
    for t in range(start, start + steps):
        loss_and_grad(model, "mlp", t)
        if fb_sleep:
            time.sleep(fb_sleep)
        if clock is not None:
            clock.advance(fb_s)
        opt.step()
        if record is not None:
            record.append(opt.asteria_stats()["refreshes_submitted"])


# ---- the rule ----------------------------------------------------------------------------------

def test_choose_frequency_rule():
    # 1.5 x 10 ms within a 50 ms forward and backward: every step, S = 0
    assert C.choose_frequency(0.010, 0.100, 0.050) == (1, 0)
    # 1.5 x 50 ms is above the forward and backward, within a step: f = S = 1
    assert C.choose_frequency(0.050, 0.100, 0.050) == (1, 1)
    # 1.5 x 1 s = 15 steps of 100 ms
    assert C.choose_frequency(1.0, 0.100, 0.090) == (15, 15)
    # S fixed: S = 0 stays (installs wait), f covers the round; never f < S
    assert C.choose_frequency(1.0, 0.100, 0.090, staleness=0) == (15, 0)
    assert C.choose_frequency(0.010, 0.100, 0.050, staleness=0) == (1, 0)
    assert C.choose_frequency(0.010, 0.100, 0.050, staleness=3) == (3, 3)
    assert C.choose_frequency(1.0, 0.100, 0.090, staleness=2) == (15, 2)
    assert C.choose_frequency(1.0, 0.100, 0.090, margin=1.0) == (10, 10)
    with pytest.raises(ValueError, match="step_s"):
        C.choose_frequency(1.0, 0.0, 0.0)
    # its S alone, the rule of staleness="auto" too: no S = 0 window (None), no S = 0
    assert C.choose_staleness(0.010, 0.100, 0.050) == 0
    assert C.choose_staleness(0.010, 0.100, None) == 1
    assert C.choose_staleness(1.0, 0.100, 0.090) == 15
    # the window of a round: the forward and backward at S = 0, else S steps
    assert C.window_s(0, 2.0, 1.5) == 1.5
    assert C.window_s(3, 2.0, 1.5) == 6.0


# ---- the value ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["fast", 0, -1, 1.5, True])
@pytest.mark.parametrize("cls", CLASSES)
def test_bad_value_names_the_key_and_the_allowed_values(cls, bad):
    model = make_model("mlp")
    with pytest.raises(ValueError, match="precondition_frequency") as err:
        cls(model.parameters(), precondition_frequency=bad, runtime=rt())
    assert ALLOWED in str(err.value)
    opt = cls([model.layers[0].weight], precondition_frequency=2, runtime=rt(2))
    try:
        with pytest.raises(ValueError, match="precondition_frequency") as err:
            opt.add_param_group({"params": [model.layers[1].weight],
                                "precondition_frequency": bad})
        assert ALLOWED in str(err.value)
    finally:
        opt.close()


def test_auto_needs_async_and_local_blocking():
    model = make_model("mlp")
    with pytest.raises(ValueError, match="precondition_frequency='auto'.*'async'"):
        SOAP(model.parameters(), precondition_frequency="auto", runtime={"mode": "sync"})
    with pytest.raises(ValueError, match="precondition_frequency='auto'.*fsdp_blocking"):
        SOAP(model.parameters(), precondition_frequency="auto",
             runtime=rt(2, fsdp_blocking="global"))


@pytest.mark.parametrize("cls", CLASSES)
def test_constructs_and_chooses_once(cls):
    model = make_model("mlp")
    opt = cls(model.parameters(), precondition_frequency="auto", runtime=rt())
    try:
        st = opt.asteria_stats()
        assert st["frequency_auto"] and not st["frequency_auto_chosen"]
        assert st["frequency_auto_f"] == 1 and st["staleness"] == 0  # before the choice
        train(model, opt, 4, fb_sleep=0.02)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen"] and st["frequency_auto_f"] >= 1
        f = st["frequency_auto_f"]
        assert opt.cadence.auto_f == f
        assert any(line.startswith("precondition_frequency 'auto': f = ")
                   for line in opt.asteria_plan())
        sd = opt.state_dict()
        assert sd["param_groups"][0]["precondition_frequency"] == "auto"
        assert {int(v["frequency.auto"]) for v in sd["state"].values()
                if "frequency.auto" in v} == {f}
    finally:
        opt.close()


def test_integer_frequency_has_no_auto_key():
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=3, runtime=rt(2))
    try:
        train(model, opt, 3)
        assert not any("frequency.auto" in v for v in opt.state_dict()["state"].values())
        st = opt.asteria_stats()
        assert not st["frequency_auto"] and st["frequency_auto_f"] is None
    finally:
        opt.close()


# ---- the choice in a run -----------------------------------------------------------------------

def test_round_within_the_forward_and_backward_gives_f1_s0(monkeypatch):
    # a small model's round is a few milliseconds; the forward and backward takes 60 s (on the
    # capacity record's clock)
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency="auto", runtime=rt())
    twin = make_model("mlp")
    ref = SOAP(twin.parameters(), precondition_frequency=1, runtime=rt(0))
    try:
        train(model, opt, 8, clock=clock, fb_s=FB_FITS)
        train(twin, ref, 8)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen"], opt.asteria_plan()
        assert (st["frequency_auto_f"], st["staleness"]) == (1, 0), opt.asteria_plan()
        assert st["capacity_fb_s"] == FB_FITS and st["capacity_window_s"] == FB_FITS
        assert any("window at S=0 = the next forward and backward" in line
                   for line in opt.asteria_plan())
        # f = 1 and S = 0 from the first step on: the run of the integers f = 1, S = 0
        for a, b in zip(params_of(model), params_of(twin)):
            assert torch.equal(a, b)
    finally:
        opt.close()
        ref.close()


@pytest.mark.parametrize("staleness", ["auto", 0, 2])
def test_slow_round_gives_a_larger_f_used_from_then_on(staleness, monkeypatch):
    # every job sleeps 100 ms: the model prices a round at 50 ms or more against 5 ms steps
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency="auto", runtime=rt(staleness))
    try:
        delay_jobs(opt, 100)
        submitted: list = []
        train(model, opt, 3, record=submitted, clock=clock, fb_s=FB_SHORT)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen"]
        f, s = st["frequency_auto_f"], st["staleness"]
        assert f >= 3, opt.asteria_plan()  # 1.5 x 50 ms or more over steps of 5 ms or less
        assert s == (f if staleness == "auto" else staleness)
        train(model, opt, f + 2, start=4, record=submitted)
        # SOAP's count k is the step t - 1; after the choice (t = 3) a round only at k % f == 0
        for t in range(3, 3 + f + 2):
            new = submitted[t - 1] - submitted[t - 2]
            assert bool(new) == ((t - 1) % f == 0), (t, f, submitted)
    finally:
        opt.close()


@pytest.mark.parametrize("cls", [SOAP, KLShampoo])
@pytest.mark.parametrize("resumed", [False, True])
def test_auto_is_the_run_of_the_f_it_chose_bitwise(cls, resumed, monkeypatch):
    # SOAP and KL-Shampoo choose f at their first counted step (the run's second step), the
    # REFRESH op timed by calibration jobs whose results are dropped: no basis is refreshed
    # before the choice, so the run is the run of the integers f and S it chose, whatever they
    # are. Resumed from a state dict saved before the choice, it calibrates at its choice, one
    # step later (it times a forward and backward first), with no refresh in between.
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = cls(model.parameters(), precondition_frequency="auto", runtime=rt())
    try:
        delay_jobs(opt, 100)  # the round priced at 50 ms or more against 5 ms steps
        submitted: list = []
        train(model, opt, 1, record=submitted, clock=clock, fb_s=FB_SHORT)
        if resumed:
            sd = copy.deepcopy(opt.state_dict())
            opt.close()
            opt = cls(model.parameters(), precondition_frequency="auto", runtime=rt())
            opt.load_state_dict(sd)
            delay_jobs(opt, 100)
        train(model, opt, 1, start=2, record=submitted, clock=clock, fb_s=FB_SHORT)
        assert opt.asteria_stats()["frequency_auto_chosen"] != resumed, opt.asteria_plan()
        train(model, opt, 1, start=3, record=submitted, clock=clock, fb_s=FB_SHORT)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen"], opt.asteria_plan()
        f, s = st["frequency_auto_f"], st["staleness"]
        assert f >= 3 and s == f, opt.asteria_plan()
        if resumed:  # the counts of the optimizer that took steps 2, 3, ... start from 0
            submitted[1:] = [n + submitted[0] for n in submitted[1:]]
        # the first-step eigendecompositions only: the calibration jobs are no refresh
        assert submitted[2] == submitted[0]
        assert st["installs"] == (0 if resumed else submitted[0])
        steps = 2 * f + 3
        later: list = []
        train(model, opt, steps - 3, start=4, record=later)
        submitted += [n + resumed * submitted[0] for n in later]
        twin = make_model("mlp")
        ref = cls(twin.parameters(), precondition_frequency=f, runtime=rt(s))
        try:
            twin_submitted: list = []
            train(twin, ref, steps, record=twin_submitted)
            assert submitted == twin_submitted
            for a, b in zip(params_of(model), params_of(twin)):
                assert torch.equal(a, b)
        finally:
            ref.close()
    finally:
        opt.close()


#: each job's sleep before it computes in the test below: a step of the "mlp" model computes
#: for milliseconds, so a step read with the calibration wait in it is at least 4x the bound
CALIBRATION_DELAY_MS = 2000


@pytest.mark.parametrize("policy", ["round", "drift"])
def test_the_choice_reads_the_step_without_the_calibration_wait(policy, monkeypatch):
    # SOAP's "auto" f (and drift's "auto" budget) is chosen at its first counted step end,
    # after waiting there for the calibration jobs. That wait is a stall, not the step's work:
    # read into the step, it made the round look R times shorter against it, and the choice
    # overcommitted the host (its installs then waited). The step the choice reads excludes it.
    from asteria.refresh.capacity import Capacity

    steps = []
    real = Capacity.times_for_f

    def record(self, jobs, stall_ns=0):
        out = real(self, jobs, stall_ns)
        if out is not None:
            steps.append(out[1])
        return out

    monkeypatch.setattr(Capacity, "times_for_f", record)
    model = make_model("mlp")
    kw = ({"precondition_frequency": "auto", "runtime": rt()} if policy == "round" else
          {"precondition_frequency": 1, "runtime": rt(refresh_policy="drift")})
    opt = SOAP(model.parameters(), **kw)
    try:
        delay_jobs(opt, CALIBRATION_DELAY_MS)
        train(model, opt, 2)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen" if policy == "round" else
                  "refresh_budget_auto_chosen"], opt.asteria_plan()
        # the choice's step: the forward and backward and the optimizer's own work only
        assert steps and steps[0] < CALIBRATION_DELAY_MS / 1e3 / 4, steps
    finally:
        opt.close()


def test_auto_group_beside_an_integer_group_keeps_s_within_both(monkeypatch):
    # both auto: S is chosen with f, and at most the integer group's f (S <= f for every group)
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    first, *rest = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    opt = SOAP([{"params": [first], "precondition_frequency": 3},
                {"params": rest + others, "precondition_frequency": "auto"}], runtime=rt())
    try:
        delay_jobs(opt, 60)
        train(model, opt, 4, clock=clock, fb_s=FB_SHORT)
        st = opt.asteria_stats()
        assert st["frequency_auto_chosen"] and st["frequency_auto_f"] >= 3
        assert st["staleness"] == 3  # the round wants more, the integer group allows 3
        assert opt.cadence.frequency(opt.param_groups[0]) == 3
        sd = opt.state_dict()
        assert [g["precondition_frequency"] for g in sd["param_groups"]] == [3, "auto"]
        assert "frequency.auto" not in sd["state"][0]
    finally:
        opt.close()


def test_shampoo_chooses_at_its_second_step():
    model = make_model("mlp")
    opt = Shampoo(model.parameters(), precondition_frequency="auto", runtime=rt(0))
    try:
        train(model, opt, 1, fb_sleep=0.02)
        assert not opt.asteria_stats()["frequency_auto_chosen"]
        train(model, opt, 1, start=2, fb_sleep=0.02)
        assert opt.asteria_stats()["frequency_auto_chosen"]
        # start_preconditioning_step=-1 is the f the run started with
        assert opt.cadence.frequency(opt.param_groups[0], initial=True) == 1
    finally:
        opt.close()


def test_chosen_f_survives_a_checkpoint_bitwise(monkeypatch):
    clock = hold_capacity_clock(monkeypatch)
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency="auto", runtime=rt())
    try:
        delay_jobs(opt, 60)
        train(model, opt, 5, clock=clock, fb_s=FB_SHORT)
        st = opt.asteria_stats()
        f, s = st["frequency_auto_f"], st["staleness"]
        assert st["frequency_auto_chosen"] and f > 1
        sd = copy.deepcopy(opt.state_dict())
        twin = make_model("mlp")
        twin.load_state_dict(model.state_dict())
        opt2 = SOAP(twin.parameters(), precondition_frequency="auto", runtime=rt())
        try:
            opt2.load_state_dict(sd)
            st2 = opt2.asteria_stats()
            assert st2["frequency_auto_chosen"] and st2["frequency_auto_f"] == f
            assert st2["staleness"] == s
            train(model, opt, 2 * f + 1, start=6)
            train(twin, opt2, 2 * f + 1, start=6)
            for a, b in zip(params_of(model), params_of(twin)):
                assert torch.equal(a, b)
            assert opt2.cadence.auto_f == f  # never chosen again
        finally:
            opt2.close()
    finally:
        opt.close()


# ---- python3 -m asteria.plan ---------------------------------------------------------------------

def test_plan_s0_window_is_the_forward_and_backward():
    sizes = plan.factors([(512, 512)], 2048, 2048)
    model = C.CostModel({"host": 10.0})
    r = plan.row(model, "x", sizes, "soap", 2, 0.5, 0, 1, 0, None, fb_share=0.8)
    assert r["window_s"] == pytest.approx(0.4)
    assert r["smallest_s"] == 0 and r["fits"]  # 63 ms within 0.4 s
    # without a share (the function's default) S = 0 has no window, as before
    r = plan.row(model, "x", sizes, "soap", 2, 0.5, 0, 1, 0, None)
    assert r["window_s"] == 0.0 and r["smallest_s"] == 1


def test_plan_olmo2_1b_s0_window(capsys):
    pytest.importorskip("olmo_core")
    assert plan.main(["--preset", "olmo2-1b", "--tokens", "65536", "-f", "1", "-S", "0",
                      "--gflops-per-core", "50"]) == 0
    head, line = capsys.readouterr().out.splitlines()[:2]
    cols = line.split()
    # the step time (the forward and backward's FLOPs) is the S = 0 window
    assert "window S=0 (s)" in head and float(cols[6]) > 0
    assert float(cols[6]) == pytest.approx(float(cols[2]), abs=0.05)


def test_plan_transfer_bytes_by_hand():
    # 512 x 512: two factors of 512; 512 x 2048: one of 512, one of 2048
    sizes = plan.factors([(512, 512), (512, 2048)], 2048, 2048)
    assert sizes == {512: 3, 2048: 1}
    factor_bytes = (3 * 512 * 512 + 2048 * 2048) * 4
    # SOAP's install also returns the sort order: n int64 per factor
    assert plan.transfer_bytes(sizes, "soap") == (factor_bytes,
                                                  factor_bytes + (3 * 512 + 2048) * 8)
    assert plan.transfer_bytes(sizes, "shampoo") == (factor_bytes, factor_bytes)
    r = plan.row(C.CostModel({"host": 10.0}), "x", sizes, "soap", 2, 0.5, 1, 1, 0, None,
                 pcie_gbps=50.0)
    assert r["bytes_d2h"] == factor_bytes
    assert r["transfer_s"] == pytest.approx((2 * factor_bytes + (3 * 512 + 2048) * 8) / 50e9)
    plain = plan.row(C.CostModel({"host": 10.0}), "x", sizes, "soap", 2, 0.5, 1, 1, 0, None)
    assert r["round_s"] == pytest.approx(plain["round_s"] + r["transfer_s"])


def test_plan_f_auto(capsys):
    n512 = C.flops("soap_qr", 512) / 10e9  # one 512 factor on a 10 GFLOP/s core: 63 ms
    base = ["--shape", "512x512", "--gflops-per-core", "10", "--cores", "2", "-f", "auto"]
    assert plan.main(base + ["--step-time", "0.5", "-S", "0"]) == 0
    out = capsys.readouterr().out
    assert "-f auto chooses f=1, S=0" in out and "f auto" in out.splitlines()[0]
    # a 10 ms step: 1.5 x 63 ms needs 10 steps
    steps = -(-1.5 * n512 // 0.01)
    assert plan.main(base + ["--step-time", "0.01", "-S", "auto", "--pcie-gbps", "0"]) == 0
    out = capsys.readouterr().out
    assert f"-f auto chooses f={int(steps)}, S={int(steps)}" in out
    with pytest.raises(SystemExit):
        plan.main(base[:-2] + ["--step-time", "1", "-S", "auto"])  # -S auto needs -f auto
    assert "-S auto needs -f auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(base[:-1] + ["fast", "--step-time", "1"])
    assert "'fast': allowed: an integer >= 1, or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(base + ["--step-time", "1", "--pcie-gbps", "-1"])
    assert "--pcie-gbps" in capsys.readouterr().err


def test_plan_says_when_the_device_must_take_the_round(capsys):
    # a slow host (1 GFLOP/s, 1 core) against a device lane of 1000 GFLOP/s, S = 1 of 0.5 s
    assert plan.main(["--shape", "1024x1024", "--step-time", "0.5", "--gflops-per-core", "1",
                      "--cores", "1", "--device-gflops", "1000", "-f", "1", "-S", "1"]) == 0
    out = capsys.readouterr().out
    assert "device executor" in out and "must take the round" in out
    assert "refresh_device=True" in out
