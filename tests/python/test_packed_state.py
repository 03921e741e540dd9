"""Packed state (``asteria.optim.packing``, used by the placement): the device state of a stack of
same-shape blocks lives in one buffer per name, the members' entries its slices, so the step
updates it in place with no stack copied in or out.

 - after a few steps the stack's state tensors share one storage, stay where they are, and
   the step stacks none of them (torch.stack is watched during ``_step_blocks``);
 - a parameter skipped (non-finite gradient), one without a gradient, a group added and a
   load_state_dict in between leave the run bitwise that of an optimizer that never packs
   (``packing.PACK = False``), in mode "sync" and "async";
 - a saved state dict is no larger than one of the same state unpacked (torch.save writes a
   view's whole storage: a pack must not outlive its members' use of it);
 - the steady state looks at no member's layout: a pack is recognised by its slice objects
   (no ``_slices_of``) and a stack handed out packed is not walked back (no ``same_memory``), and
   an entry replaced between steps (through the proxy, or by a load) is seen, bitwise as a
   run that never packs;
 - a one-block layout hands out the parameter itself and writes it with one copy, a
   non-contiguous parameter included, bitwise as the blocked path.
"""

from __future__ import annotations

import io
import re

import pytest
import torch

from asteria import SOAP, Shampoo
from asteria.optim import packing as packing_mod
from asteria.optim.background import BackgroundJobs
from asteria.optim._blocking import make_layout
from models import loss_and_grad, make_model, optimizer_makers, require_c_extension

MAKERS = optimizer_makers(3)
ASYNC = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2}
RUNTIMES = {
    "sync": {"mode": "sync"},
    "async": ASYNC,  # roots / bases in the residency (copied through the ring)
    "async-device": dict(ASYNC, placement={"roots": "device", "eigenbases": "device"}),
    # SOAP's factor EMAs on the workers, in place in the packs (test_soap_factor_offload.py)
    "async-workers": dict(ASYNC, factor_emas="workers"),
}
# the per-block state a step reads and updates (not the refresh placeholders)
_STEP_KEY = re.compile(r"b\d+\.(exp_avg|exp_avg_sq|momentum|grafting_v|(GG|Q|L|Linv|S|s)\d+)")


@pytest.fixture(autouse=True)
def _c_ext():
    require_c_extension()


def weights(model):
    return [p for p in model.parameters() if p.dim() == 2]


def step_state(opt, p) -> dict:
    """p's device tensors of the step's keys (the live entries, not through the proxy)."""
    return {k: v for k, v in dict.items(opt.state[p])
            if isinstance(v, torch.Tensor) and _STEP_KEY.fullmatch(k)}


def train(opt, model, steps):
    for t in steps:
        loss_and_grad(model, "mlp", t)
        opt.step()


def _mark_inside_step_blocks(monkeypatch, opt, inside: list) -> None:
    """``inside`` is non-empty while ``opt.method.step_blocks`` runs."""
    real_blocks = opt.method.step_blocks

    def watched_blocks(*args, **kwargs):
        inside.append(1)
        try:
            return real_blocks(*args, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(opt.method, "step_blocks", watched_blocks)


@pytest.mark.parametrize("mode", list(RUNTIMES))
@pytest.mark.parametrize("name", list(MAKERS))
def test_stack_state_is_packed_and_not_copied(name, mode, monkeypatch):
    model = make_model("mlp")
    ws = weights(model)
    opt = MAKERS[name](model.parameters(), RUNTIMES[mode])
    try:
        # past the first installs (Shampoo's roots change its stacks once they are all set)
        train(opt, model, range(1, 10))
        before = {(i, k): v.data_ptr() for i, p in enumerate(ws)
                  for k, v in step_state(opt, p).items()}
        assert before
        one_chunk = not opt.placement.off_device  # with a residency the ring may split a stack
        if one_chunk:
            keys = set(step_state(opt, ws[0]))
            for k in keys:  # the three weights' blocks: one stack, one storage per name
                ts = [step_state(opt, p)[k] for p in ws]
                assert len({t.untyped_storage().data_ptr() for t in ts}) == 1, k
                assert ts[0].untyped_storage().nbytes() == sum(t.nbytes for t in ts), k

        stacked, inside = [], []
        real_stack = torch.stack

        def watched_stack(tensors, *args, **kwargs):
            if inside:
                stacked.append([t.data_ptr() for t in tensors])
            return real_stack(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, "stack", watched_stack)
        _mark_inside_step_blocks(monkeypatch, opt, inside)
        train(opt, model, range(10, 14))  # a refresh comes due and is installed in here
        monkeypatch.undo()
        after = {(i, k): v.data_ptr() for i, p in enumerate(ws)
                 for k, v in step_state(opt, p).items()}
        assert after == before  # updated in place, never re-made
        state_ptrs = set(before.values())
        copied = [ptr for call in stacked for ptr in call if ptr in state_ptrs]
        assert not copied, f"the step stacked {len(copied)} state tensors"
        if one_chunk:
            assert not stacked  # nothing at all is stacked by the step's state reads
    finally:
        opt.close()


def trajectory(name, mode, pack, monkeypatch):
    """Losses, parameters and final state of a run that changes its stacks' membership:
    a skipped parameter (step 4), one without a gradient (step 6), a group added (step 7),
    a load_state_dict of a saved state dict (step 9)."""
    monkeypatch.setattr(packing_mod, "PACK", pack)
    model = make_model("mlp")
    ws = weights(model)
    torch.manual_seed(5)
    extra = [torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64)) for _ in range(2)]
    opt = MAKERS[name](model.parameters(), RUNTIMES[mode])
    losses = []
    try:
        for t in range(1, 15):
            losses.append(loss_and_grad(model, "mlp", t))
            if t == 4:
                ws[1].grad.fill_(float("nan"))
            if t == 6:
                ws[0].grad = None
            if t == 7:
                opt.add_param_group({"params": extra})
            for i, e in enumerate(extra):
                e.grad = torch.sin((t + i) * e.detach())
            if t == 9:
                buf = io.BytesIO()
                torch.save(opt.state_dict(), buf)
                buf.seek(0)
                opt.load_state_dict(torch.load(buf, weights_only=False))
            opt.step()
        packed = [t._base is not None for p in ws for t in step_state(opt, p).values()]
        sd = opt.state_dict()
        assert opt.asteria_stats()["nonfinite_skipped"] == 1
    finally:
        opt.close()
    params = [p.detach().clone() for p in list(model.parameters()) + extra]
    return losses, params, sd, packed


def assert_same_state(a, b):
    assert a["state"].keys() == b["state"].keys()
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        assert sa.keys() == sb.keys(), i
        for k in sa:
            if isinstance(sa[k], torch.Tensor):
                assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), (i, k)
            else:
                assert sa[k] == sb[k], (i, k)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_membership_changes_bitwise_as_unpacked(name, mode, monkeypatch):
    want_loss, want_params, want_sd, unpacked = trajectory(name, mode, False, monkeypatch)
    got_loss, got_params, got_sd, packed = trajectory(name, mode, True, monkeypatch)
    assert not any(unpacked)
    assert packed and all(packed)  # the comparison is not vacuous: the state is packed
    assert all(torch.equal(a, b) for a, b in zip(got_loss, want_loss))
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))
    assert_same_state(got_sd, want_sd)


def saved_bytes(sd) -> int:
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.tell()


def unpacked(sd) -> dict:
    return dict(sd, state={i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                                for k, v in st.items()} for i, st in sd["state"].items()})


@pytest.mark.parametrize("name", list(MAKERS))
def test_saved_state_dict_does_not_grow(name):
    model = make_model("mlp")
    ws = weights(model)
    opt = MAKERS[name](model.parameters(), {"mode": "sync"})
    try:
        train(opt, model, range(1, 6))
        assert all(t._base is not None for t in step_state(opt, ws[1]).values())
        for skipped in (False, True):
            if skipped:  # the stack is re-made without ws[1]: ws[1] must not keep the old one
                loss_and_grad(model, "mlp", 6)
                ws[1].grad = None
                opt.step()
            sd = opt.state_dict()
            got, want = saved_bytes(sd), saved_bytes(unpacked(sd))
            assert got <= want * 1.01, (skipped, got, want)
            for st in sd["state"].values():  # no saved tensor drags a larger storage along
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v._base is not None:
                        assert v.untyped_storage().nbytes() <= 3 * v.nbytes, k
    finally:
        opt.close()


@pytest.mark.parametrize("name", list(MAKERS))
def test_steady_state_walks_no_member(name, monkeypatch):
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), dict(RUNTIMES["async-device"]))
    try:
        train(opt, model, range(1, 10))
        calls = {"_slices_of": 0, "same_memory": 0}  # made by the step's kernels' stacks
        inside = []
        for fn in calls:
            real = getattr(packing_mod, fn)

            def counted(*args, _fn=fn, _real=real):
                calls[_fn] += bool(inside)
                return _real(*args)

            monkeypatch.setattr(packing_mod, fn, counted)
        _mark_inside_step_blocks(monkeypatch, opt, inside)
        train(opt, model, range(10, 14))  # a refresh comes due and is installed in here
        monkeypatch.undo()
        assert calls == {"_slices_of": 0, "same_memory": 0}
        assert not opt.placement.packing.handed  # nothing handed out outlives its _step_blocks
    finally:
        opt.close()


def replaced_entry_run(name, mode, pack, monkeypatch):
    """Losses and parameters of a run whose step state is replaced between steps: a member's
    entry set through the proxy (step 5), the state reloaded from its own state dict (step 8)."""
    monkeypatch.setattr(packing_mod, "PACK", pack)
    model = make_model("mlp")
    ws = weights(model)
    opt = MAKERS[name](model.parameters(), RUNTIMES[mode])
    losses = []
    try:
        for t in range(1, 12):
            losses.append(loss_and_grad(model, "mlp", t))
            if t == 5:
                st = opt.state[ws[1]]
                for k in list(step_state(opt, ws[1])):
                    if k.endswith("exp_avg") or k.endswith("momentum"):
                        st[k] = st[k] * 0.5  # a new tensor: no longer the pack's slice
            if t == 8:
                opt.load_state_dict(opt.state_dict())
            opt.step()
    finally:
        opt.close()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["sync", "async-device"])
@pytest.mark.parametrize("name", list(MAKERS))
def test_replaced_entries_bitwise_as_unpacked(name, mode, monkeypatch):
    want_loss, want_params = replaced_entry_run(name, mode, False, monkeypatch)
    got_loss, got_params = replaced_entry_run(name, mode, True, monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got_loss, want_loss))
    assert all(torch.equal(a, b) for a, b in zip(got_params, want_params))


@pytest.mark.parametrize("run", [trajectory, replaced_entry_run],
                         ids=["membership", "replaced"])
def test_offloaded_factor_emas_follow_the_packs(run, monkeypatch):
    """The same runs with SOAP's factor EMAs on the workers (written into the packs in place)
    follow the on-thread ones to rounding: a job never writes a pack its entries have left."""
    want = run("soap", "async", True, monkeypatch)
    jobs = []
    real = BackgroundJobs.start
    monkeypatch.setattr(BackgroundJobs, "start",
                        lambda self, job: (job.kind.op == "gram_ema" and jobs.append(1))
                        or real(self, job))
    got = run("soap", "async-workers", True, monkeypatch)
    assert len(jobs) >= 5  # not vacuous
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_one_block_layout_is_the_parameter():
    whole, cut = make_layout((6, 8)), make_layout((6, 8), block_size=4)
    assert whole.whole and not cut.whole
    assert whole.block_shapes == ((6, 8),) and cut.block_shapes == ((4, 4),) * 2 + ((2, 4),) * 2
    t = torch.randn(6, 8)
    assert whole.blocks(t)[0] is t
    p = torch.zeros(8, 6).t()  # non-contiguous
    whole.write(p, 0, t)
    assert torch.equal(p, t)
    q = torch.zeros(8, 6).t()
    for j, b in enumerate(cut.blocks(t)):
        cut.write(q, j, b)
    assert torch.equal(q, t)


def test_non_contiguous_parameter_bitwise_as_contiguous():
    torch.manual_seed(3)
    w = torch.randn(12, 10, dtype=torch.float64)
    a = torch.nn.Parameter(w.clone())
    b = torch.nn.Parameter(w.t().contiguous().t())  # same values, transposed storage
    assert not b.is_contiguous()
    opts = [SOAP([x], precondition_frequency=2, runtime={"mode": "sync"}) for x in (a, b)]
    try:
        for t in range(1, 8):
            g = torch.sin(t * torch.arange(120, dtype=torch.float64)).view(12, 10)
            for x, opt in zip((a, b), opts):
                x.grad = g.clone()
                opt.step()
            assert torch.equal(a, b), t
    finally:
        for opt in opts:
            opt.close()
