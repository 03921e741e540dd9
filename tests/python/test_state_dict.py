"""state_dict / load_state_dict of the three optimizers, mid-run with a refresh in flight.

With S = 3 and f = 5 the refresh snapshotted at step 6 (SOAP, KL-Shampoo; step 5 for Shampoo)
is still in flight after step 7. state_dict() waits for it and stores its result, not
installed, with the steps left until its install; a fresh optimizer loaded from it (directly or
through torch.save / torch.load) continues bitwise like the uninterrupted run. Loading into an
optimizer of another runtime mode works too: the stored result still installs on schedule and
later refreshes follow the new mode (checked against the restatement).
"""

import io

import pytest
import torch

from asteria.optim import SOAP, Shampoo
from models import (assert_params_close, lockstep_tol, loss_and_grad, make_model,
                    optimizer_pairs, params_of, require_c_extension)

OPTIMIZERS = optimizer_pairs(5)
NAMES = list(OPTIMIZERS)
ASYNC = {"mode": "async", "staleness": 3, "install": "deterministic", "workers": 2}
# the host tier explicitly (state_dict gathers the residency's blocks, load puts them back):
# "auto" keeps a CPU parameter's roots / eigenbases in optimizer.state
ASYNC_HOST = dict(ASYNC, placement={"roots": "host", "eigenbases": "host"})
SPLIT, STEPS = 7, 20


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def train(model, opt, steps, each=None):
    out = []
    for t in steps:
        loss_and_grad(model, "mlp", t)
        opt.step()
        if each is not None:
            each(t, opt)
        out.append(params_of(model))
    return out


def uninterrupted(name, runtime, each=None):
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=runtime)
    traj = train(model, opt, range(1, STEPS + 1), each)
    opt.close()
    return traj


def resumed(name, runtime, through, new_runtime=None):
    """Train to SPLIT, checkpoint, rebuild model and optimizer from it, train to STEPS.
    Returns (params after steps SPLIT+1..STEPS, the optimizer state dict)."""
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=runtime)
    train(model, opt, range(1, SPLIT + 1))
    sd, msd = opt.state_dict(), model.state_dict()
    if through == "bytes":
        buf = io.BytesIO()
        torch.save({"optim": sd, "model": msd}, buf)
        buf.seek(0)
        loaded = torch.load(buf)
        sd, msd = loaded["optim"], loaded["model"]
    opt.close()
    fresh = make_model("mlp", seed=123)
    fresh.load_state_dict(msd)
    opt2 = make_opt(fresh.parameters(), runtime=new_runtime or runtime)
    opt2.load_state_dict(sd)
    traj = train(fresh, opt2, range(SPLIT + 1, STEPS + 1))
    opt2.close()
    return traj, sd


@pytest.mark.parametrize("runtime", [ASYNC, ASYNC_HOST], ids=["async", "async-host"])
@pytest.mark.parametrize("through", ["direct", "bytes"])
@pytest.mark.parametrize("name", NAMES)
def test_resume_with_refresh_in_flight_is_bitwise(name, through, runtime):
    want = uninterrupted(name, ASYNC)
    got, sd = resumed(name, runtime, through)
    pending = [st for st in sd["state"].values() if "pending.install_in" in st]
    assert len(pending) == 3  # the three weight matrices; biases are AdamW
    install_step = (5 if name == "shampoo" else 6) + ASYNC["staleness"]
    for st in pending:
        assert st["pending.install_in"] == install_step - SPLIT
        assert any(".pending" in k for k in st)
    for t, (a, b) in enumerate(zip(got, want[SPLIT:]), SPLIT + 1):
        assert_params_close(a, b, rtol=0, atol=0, what=f"step {t}")


@pytest.mark.parametrize("name", NAMES)
def test_sync_round_trip_is_bitwise(name):
    want = uninterrupted(name, {"mode": "sync"})
    got, sd = resumed(name, {"mode": "sync"}, "bytes")
    assert not any("pending.install_in" in st for st in sd["state"].values())
    for t, (a, b) in enumerate(zip(got, want[SPLIT:]), SPLIT + 1):
        assert_params_close(a, b, rtol=0, atol=0, what=f"step {t}")


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_does_not_disturb_the_run(name):
    """state_dict() waits for the refresh in flight but installs nothing early."""
    want = uninterrupted(name, ASYNC)
    got = uninterrupted(name, ASYNC, each=lambda t, opt: opt.state_dict() if t in (6, 7) else None)
    for t, (a, b) in enumerate(zip(got, want), 1):
        assert_params_close(a, b, rtol=0, atol=0, what=f"step {t}")


@pytest.mark.parametrize("name", NAMES)
def test_load_into_sync_optimizer(name):
    """Async checkpoint resumed in mode="sync": the stored refresh installs at its recorded
    step, later ones at once; equals the restatement whose install delay drops from 3 to 0."""
    got, _ = resumed(name, ASYNC, "bytes", new_runtime={"mode": "sync"})
    _, make_ref = OPTIMIZERS[name]
    model = make_model("mlp")
    ref = make_ref([p.data for p in model.parameters()], install_delay=3)
    want = []
    for t in range(1, STEPS + 1):
        if t == SPLIT + 1:
            ref.install_delay = 0
        loss_and_grad(model, "mlp", t)
        ref.step([p.grad for p in model.parameters()])
        want.append(params_of(model))
    for t, (a, b) in enumerate(zip(got, want[SPLIT:]), SPLIT + 1):
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    # and it is not the async continuation
    asyn = uninterrupted(name, ASYNC)
    assert max(float((a - b).abs().max()) for a, b in zip(got[-1], asyn[-1])) > 1e-9


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_after_close_says_what_close_did(name):
    """close() stops the engine: a refresh in flight then has no results any more, and
    state_dict() says so (before: "unknown or already waited-for ticket"). Taken before close(),
    the state dict holds the refresh, and a later one (after close) is the same; with no
    refresh in flight the state stays checkpointable after close()."""
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=ASYNC)
    train(model, opt, range(1, SPLIT + 1))  # a refresh in flight (see the module's header)
    opt.close()
    with pytest.raises(RuntimeError, match=r"state_dict\(\) after close\(\): close\(\) stopped "
                       r"the engine with a REFRESH in flight \(snapshotted at step [56], to be "
                       r"installed at step [89]; this run is at step 7\).*Call state_dict\(\) "
                       r"before close\(\)"):
        opt.state_dict()
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=ASYNC)
    train(model, opt, range(1, SPLIT + 1))
    before = opt.state_dict()
    opt.close()
    after = opt.state_dict()  # the refresh was waited for before the close: it is kept
    for i, st in before["state"].items():
        for k, v in st.items():
            w = after["state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=ASYNC)
    train(model, opt, range(1, 4))  # nothing in flight yet
    opt.close()
    assert all(st["pending.install_in"] == -1 for st in opt.state_dict()["state"].values()
               if "pending.install_in" in st)
