"""Bounded staleness on the real C worker pool (asteria._C, HostPoolEngine), all three optimizers.

 - async + deterministic + S=0 equals sync;
 - async + deterministic + S=k equals the restatement with install_delay=k (a refresh
   snapshotted at the end of step t installed at the end of step t+k), k = 2, 3, 5 (5 = f:
   the install and the next snapshot fall on the same step end, install first);
 - the trajectory is bitwise the same with 1, 2 and 4 workers;
 - eager installs never use a refresh older than S;
 - the install happens exactly S steps after the snapshot.

The pool computes with OpenBLAS's LAPACK, sync with torch's (MKL), so results agree to
rounding (models.lockstep_tol), not bitwise; the models keep every factor's eigenvalues
distinct (see models.py), without which eigenbases would differ at O(1).
"""

import pytest
import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from models import (assert_lockstep, assert_params_close, lockstep, lockstep_tol, loss_and_grad,
                    make_model, optimizer_pairs, require_c_extension, run)

OPTIMIZERS = optimizer_pairs(5)
NAMES = list(OPTIMIZERS)


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def deterministic(s, workers=2):
    return {"mode": "async", "staleness": s, "install": "deterministic", "workers": workers}


@pytest.mark.parametrize("kind", ["mlp", "block"])
@pytest.mark.parametrize("name", NAMES)
def test_async_s0_equals_sync(name, kind):
    make_opt, _ = OPTIMIZERS[name]
    sync, _ = run(kind, lambda p: make_opt(p, runtime={"mode": "sync"}), 30)
    asyn, opt = run(kind, lambda p: make_opt(p, runtime=deterministic(0)), 30)
    for t, (a, b) in enumerate(zip(asyn, sync), 1):
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    stats = opt.asteria_stats()
    assert stats["workers"] == 2 and stats["jobs_done"] == stats["jobs_submitted"] > 0
    assert stats["max_install_lag"] == 0


@pytest.mark.parametrize("s", [2, 3, 5])
@pytest.mark.parametrize("name", NAMES)
def test_async_deterministic_equals_delayed_reference(name, s):
    make_opt, make_ref = OPTIMIZERS[name]
    history, opt = lockstep("mlp", lambda p: make_opt(p, runtime=deterministic(s)),
                            lambda p: make_ref(p, install_delay=s), steps=30)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["max_install_lag"] == s and stats["installs"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_async_deterministic_block_equals_delayed_reference(name):
    make_opt, make_ref = OPTIMIZERS[name]
    history, _ = lockstep("block", lambda p: make_opt(p, runtime=deterministic(3)),
                          lambda p: make_ref(p, install_delay=3), steps=30)
    assert_lockstep(history)


@pytest.mark.parametrize("name", NAMES)
def test_delayed_trajectory_differs_from_sync(name):
    """The comparisons above are not vacuous: staleness changes the trajectory."""
    make_opt, _ = OPTIMIZERS[name]
    sync, _ = run("mlp", lambda p: make_opt(p, runtime={"mode": "sync"}), 20)
    late, _ = run("mlp", lambda p: make_opt(p, runtime=deterministic(3)), 20)
    assert max(float((a - b).abs().max()) for a, b in zip(sync[-1], late[-1])) > 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_reproducible_across_worker_counts(name):
    make_opt, _ = OPTIMIZERS[name]
    runs = [run("block", lambda p: make_opt(p, runtime=deterministic(3, workers=w)), 25)[0]
            for w in (1, 2, 4)]
    for other in runs[1:]:
        for t, (a, b) in enumerate(zip(runs[0], other), 1):
            assert_params_close(a, b, rtol=0, atol=0, what=f"step {t}")


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_eager_never_older_than_s(name, s):
    make_opt, _ = OPTIMIZERS[name]
    rt = {"mode": "async", "staleness": s, "install": "eager", "workers": 2}
    traj, opt = run("mlp", lambda p: make_opt(p, runtime=rt), 29)  # last refresh installed
    stats = opt.asteria_stats()
    assert stats["installs"] > 0 and stats["installs"] == stats["refreshes_submitted"]
    assert 0 <= stats["max_install_lag"] <= s
    assert all(torch.isfinite(p).all() for p in traj[-1])


def _watched(name, s):
    """An "mlp" model, its optimizer at staleness s, the first layer's weight, the state key
    of that weight's first basis (root for Shampoo) and the step whose end snapshots its first
    REFRESH (the step where k reaches 5)."""
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=deterministic(s))
    key = "b0.Linv0" if name == "shampoo" else "b0.Q0"
    return model, opt, model.layers[0].weight, key, 5 if name == "shampoo" else 6


@pytest.mark.parametrize("name", ["soap", "kl_shampoo", "shampoo"])
def test_install_exactly_s_steps_after_snapshot(name):
    """With S = 3 the refresh snapshotted at the end of step t changes the basis at the end of
    step t + 3, not before."""
    model, opt, w, key, snapshot = _watched(name, 3)
    seen = []
    for t in range(1, 12):
        loss_and_grad(model, "mlp", t)
        opt.step()
        seen.append(opt.state[w][key].clone() if key in opt.state[w] else None)
    changes = [t for t in range(2, 12) if seen[t - 1] is not None
               and (seen[t - 2] is None or not torch.equal(seen[t - 1], seen[t - 2]))]
    assert changes == [snapshot + 3]
    opt.close()


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_first_step_eigh_is_waited_for_at_once(name):
    """The initial eigendecomposition runs on the pool too, but installs in step 1 whatever S
    is: without it there is no basis to precondition with."""
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=deterministic(5))
    loss_and_grad(model, "mlp", 1)
    opt.step()
    stats = opt.asteria_stats()
    assert stats["jobs_submitted"] == stats["installs"] == 1  # 6 factors of size 8: one job
    assert stats["max_install_lag"] == 0
    q = opt.state[model.layers[0].weight]["b0.Q0"]
    f = opt.state[model.layers[0].weight]["b0.GG0" if name == "soap" else "b0.S0"]
    lam = torch.diagonal(q.T @ f @ q)
    assert torch.all(lam[:-1] >= lam[1:])  # descending eigenvalues, not the identity start
    torch.testing.assert_close(q.T @ f @ q, torch.diag(lam), rtol=0, atol=1e-12)
    opt.close()


def _no_deferral(monkeypatch):
    from asteria.optim import schedule as _schedule
    monkeypatch.setattr(_schedule.Schedule, "defers", lambda self: False)


@pytest.mark.parametrize("name", NAMES)
def test_s0_install_waits_for_the_next_use(name):
    """S = 0 in async mode: the refresh of step t is installed when the state is next used
    (here: a read of optimizer.state), not at step t's end; the read sees the state that an
    install at step t's end leaves."""
    make_opt, _ = OPTIMIZERS[name]
    model, opt, w, key, refresh = _watched(name, 0)
    for t in range(1, refresh + 1):
        loss_and_grad(model, "mlp", t)
        opt.step()
    before = opt.asteria_stats()["installs"]
    assert opt.schedule.deferred, "the round of the refresh step waits for the next use"
    seen = opt.state[w][key].clone()  # the read installs it
    assert not opt.schedule.deferred and opt.asteria_stats()["installs"] > before
    opt.close()
    ref_model = make_model("mlp")
    ref = make_opt(ref_model.parameters(), runtime=deterministic(0))
    for t in range(1, refresh + 1):
        loss_and_grad(ref_model, "mlp", t)
        ref.step()
        assert not (ref.schedule.deferred and t < refresh)
    ref.state_dict()  # settles too
    assert not ref.schedule.deferred
    assert torch.equal(seen, ref.state[ref_model.layers[0].weight][key])
    ref.close()


@pytest.mark.parametrize("kind", ["mlp", "block"])
@pytest.mark.parametrize("name", NAMES)
def test_s0_deferred_install_is_the_same_trajectory(name, kind, monkeypatch):
    """Installing at the next step's start is the trajectory of installing at the step end
    (the same executor, the same math), with a checkpoint round trip in between: bitwise,
    SOAP's too (its re-expression of m runs in the pool's kernel wherever the install
    happens: at the step end, at the next step's start, or at the checkpoint's read)."""
    make_opt, _ = OPTIMIZERS[name]

    def train(steps, resume_at=None):
        model = make_model(kind)
        opt = make_opt(model.parameters(), runtime=deterministic(0))
        out = []
        for t in range(1, steps + 1):
            loss_and_grad(model, kind, t)
            opt.step()
            out.append([p.detach().clone() for p in model.parameters()])
            if t == resume_at:  # a deferred round is pending here (t % 5 == 1: SOAP's k = 5)
                sd = opt.state_dict()
                opt.close()
                opt = make_opt(model.parameters(), runtime=deterministic(0))
                opt.load_state_dict(sd)
        opt.close()
        return out, opt

    deferred, opt = train(17, resume_at=11)
    assert opt.asteria_stats()["installs"] > 0
    with monkeypatch.context() as m:
        _no_deferral(m)
        at_end, _ = train(17)
    for t, (a, b) in enumerate(zip(deferred, at_end), 1):
        for x, y in zip(a, b):
            assert torch.equal(x, y), f"step {t}"


def test_s0_deferred_refresh_runs_before_the_next_step():
    """The point of the deferral: the round's jobs run while the training thread does other
    work (the next forward and backward), so the next step finds them done."""
    import time

    make_opt, _ = OPTIMIZERS["soap"]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=deterministic(0))
    for t in range(1, 7):
        loss_and_grad(model, "mlp", t)
        opt.step()
    assert opt.schedule.deferred
    rnd = opt.schedule.deferred[0]
    deadline = time.monotonic() + 30
    while not rnd.ready(opt.run.engine) and time.monotonic() < deadline:
        time.sleep(0.01)  # the "forward and backward"
    assert rnd.ready(opt.run.engine)
    waits = opt.asteria_stats().get("install_waits", 0)
    loss_and_grad(model, "mlp", 7)
    opt.step()
    assert not opt.schedule.deferred
    assert opt.asteria_stats().get("install_waits", 0) == waits  # no barrier wait
    opt.close()


# ---- S against precondition_frequency: one check, at each entry point ------------------------

_S_RANGE = r"runtime key 'staleness': got 4; allowed: 0 <= S <= precondition_frequency \(3\)"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_staleness_above_frequency_rejected_at_construction(name):
    cls = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}[name]
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=_S_RANGE + " of param group 0"):
        cls([w], precondition_frequency=3, runtime={"mode": "async", "staleness": 4,
                                                     "workers": 1})


def test_staleness_above_frequency_rejected_by_add_param_group():
    w, v = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3, 3))
    opt = SOAP([w], precondition_frequency=5, runtime={"mode": "async", "staleness": 4,
                                                       "workers": 1})
    with pytest.raises(ValueError, match=_S_RANGE + " of param group 1"):
        opt.add_param_group({"params": [v], "precondition_frequency": 3})
    assert len(opt.param_groups) == 1  # nothing was added
    opt.add_param_group({"params": [v], "precondition_frequency": 4})  # S = f is allowed
    opt.close()


def test_staleness_above_frequency_rejected_by_load_state_dict():
    w = torch.nn.Parameter(torch.randn(4, 4))
    src = SOAP([w], precondition_frequency=3, runtime={"mode": "sync"})
    sd = src.state_dict()
    src.close()
    dst = SOAP([w], precondition_frequency=5, runtime={"mode": "async", "staleness": 4,
                                                       "workers": 1})
    with pytest.raises(ValueError, match=_S_RANGE + " of param group 0 of the state dict"):
        dst.load_state_dict(sd)
    dst.close()


def test_sync_and_auto_take_any_frequency():
    """sync installs at once and "auto" chooses S <= f: the key's value is not checked against f
    there (it is still checked for its own range at construction)."""
    w = torch.nn.Parameter(torch.randn(4, 4))
    for rt in ({"mode": "sync", "staleness": 9}, {"mode": "async", "staleness": "auto",
                                                  "workers": 1}):
        opt = SOAP([w], precondition_frequency=2, runtime=rt)
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 3))],
                             "precondition_frequency": 1})
        opt.close()
    with pytest.raises(ValueError, match=r"runtime key 'staleness': got -1"):
        SOAP([w], runtime={"mode": "sync", "staleness": -1})
