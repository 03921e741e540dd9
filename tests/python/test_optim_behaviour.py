"""torch.optim behaviour of the three Asteria optimizers, and bad input.

Param groups, LR schedulers, closures, zero_grad, parameters without gradients, the AdamW path
of 1-D parameters against torch.optim.AdamW itself, the all-zero "fake step" of
torch.distributed.checkpoint (no engine job), non-finite gradients and failing refreshes (the
previous preconditioner is kept), and ValueErrors that name the bad key.
"""

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

import asteria.refresh.select
from asteria.refresh.inline_torch import InlineTorchEngine
from asteria.optim import KLShampoo, SOAP, Shampoo
from models import (assert_lockstep, assert_params_close, lockstep, loss_and_grad, make_model,
                    params_of, require_c_extension)
from reference import KLShampooRef, SOAPRef, ShampooRef
from tolerance import adamw_tol

SYNC = {"mode": "sync"}
F64 = dict(compute_dtype=torch.float64)
OPTIMIZERS = {
    "soap": (lambda p, **kw: SOAP(p, precondition_frequency=5, **kw),
             lambda p, **kw: SOAPRef(p, precondition_frequency=5, **kw)),
    "shampoo": (lambda p, **kw: Shampoo(p, precondition_frequency=5, **kw),
                lambda p, **kw: ShampooRef(p, precondition_frequency=5, **kw)),
    "kl_shampoo": (lambda p, **kw: KLShampoo(p, precondition_frequency=5, **F64, **kw),
                   lambda p, **kw: KLShampooRef(p, precondition_frequency=5, **kw)),
}
NAMES = list(OPTIMIZERS)


class _Both:
    """Two reference optimizers over consecutive slices of the parameter list."""

    def __init__(self, first, second, split):
        self.first, self.second, self.split = first, second, split

    def step(self, grads):
        self.first.step(grads[:self.split])
        self.second.step(grads[self.split:])


@pytest.mark.parametrize("name", NAMES)
def test_param_groups_with_different_lr(name):
    make_opt, make_ref = OPTIMIZERS[name]
    split = 2  # layers[0] (weight, bias) in the first group

    def opt(params):
        params = list(params)
        return make_opt([{"params": params[:split], "lr": 1e-2},
                         {"params": params[split:]}], lr=2e-3, runtime=SYNC)

    def ref(tensors):
        return _Both(make_ref(tensors[:split], lr=1e-2), make_ref(tensors[split:], lr=2e-3),
                     split)

    history, _ = lockstep("mlp", opt, ref, steps=20)
    assert_lockstep(history)


@pytest.mark.parametrize("name", NAMES)
def test_lambda_lr_scheduler(name):
    make_opt, make_ref = OPTIMIZERS[name]
    base = 3e-3

    def factor(epoch):
        return 1.0 / (1.0 + 0.3 * epoch)

    scheds = []

    def before_step(t, opt, ref):
        if t == 1:
            scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, factor))
        else:
            scheds[0].step()
        ref.lr = base * factor(t - 1)
        assert opt.param_groups[0]["lr"] == pytest.approx(ref.lr)

    history, _ = lockstep("mlp", lambda p: make_opt(p, lr=base, runtime=SYNC),
                          lambda p: make_ref(p, lr=base), steps=20, before_step=before_step)
    assert_lockstep(history)
    # the schedule matters: a constant lr gives a different trajectory
    const, _ = lockstep("mlp", lambda p: make_opt(p, lr=base, runtime=SYNC),
                        lambda p: make_ref(p, lr=base), steps=20)
    assert not torch.allclose(history[-1][1][0], const[-1][1][0], rtol=1e-3)


@pytest.mark.parametrize("name", NAMES)
def test_closure_returns_loss(name):
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    twin = copy.deepcopy(model)
    opt = make_opt(model.parameters(), runtime=SYNC)
    opt2 = make_opt(twin.parameters(), runtime=SYNC)
    for t in range(1, 8):
        calls = []

        def closure():
            calls.append(torch.is_grad_enabled())
            return loss_and_grad(model, "mlp", t)

        loss = opt.step(closure)
        want = loss_and_grad(twin, "mlp", t)
        opt2.step()
        assert calls == [True]  # evaluated once, with grad enabled inside the no_grad step
        assert torch.equal(loss, want)
        assert_params_close(params_of(model), params_of(twin), rtol=0, atol=0)
    opt.close()
    opt2.close()


@pytest.mark.parametrize("name", NAMES)
def test_one_d_parameters_follow_torch_adamw(name):
    """A bias vector alone: exactly torch.optim.AdamW with the group's lr, betas, eps and weight
    decay (for Shampoo: betas (betas[0], grafting_beta2), eps grafting_epsilon)."""
    torch.manual_seed(3)
    bias = torch.nn.Parameter(torch.randn(16, dtype=torch.float64))
    twin = torch.nn.Parameter(bias.detach().clone())
    if name == "shampoo":
        opt = Shampoo([bias], lr=1e-2, betas=(0.8, 1.0), grafting_beta2=0.95,
                      grafting_epsilon=1e-6, weight_decay=0.1, runtime=SYNC)
        adamw = torch.optim.AdamW([twin], lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=0.1)
    else:
        cls = SOAP if name == "soap" else KLShampoo
        opt = cls([bias], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, runtime=SYNC)
        adamw = torch.optim.AdamW([twin], lr=1e-2, betas=(0.8, 0.95), eps=1e-6,
                                  weight_decay=0.1)
    target = torch.linspace(-1, 1, 16, dtype=torch.float64)
    for t in range(1, 21):
        for p in (bias, twin):
            p.grad = (p.detach() - target) * math.cos(t) + 0.01 * t
        opt.step()
        adamw.step()
        tol = adamw_tol(torch.float64, t)  # ~10 roundings an element a step, over t steps
        torch.testing.assert_close(bias.detach(), twin.detach(), rtol=tol, atol=tol)
    assert opt.asteria_stats()["jobs_submitted"] == 0
    opt.close()


@pytest.mark.parametrize("name", NAMES)
def test_params_without_grad_are_skipped_and_zero_grad(name):
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    frozen = model.layers[1].weight
    before = frozen.detach().clone()
    opt = make_opt(model.parameters(), runtime=SYNC)
    for t in range(1, 12):
        loss_and_grad(model, "mlp", t)
        frozen.grad = None
        opt.step()
    assert torch.equal(frozen.detach(), before)
    assert frozen not in opt.state
    assert model.layers[0].weight in opt.state
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", NAMES)
def test_fake_step_launches_no_job(name, mode):
    """torch.distributed.checkpoint materialises state by step() with all-zero grads (lr 0):
    the bases start as the identity, without an engine job; then a real run proceeds."""
    if mode == "async":
        require_c_extension()
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    before = params_of(model)
    opt = make_opt(model.parameters(), lr=1e-3, runtime={"mode": mode, "staleness": 2})
    _init_optim_state(opt)
    assert opt.asteria_stats()["jobs_submitted"] == 0
    assert_params_close(params_of(model), before, rtol=0, atol=0)
    weight = opt.state[model.layers[0].weight]
    eye = torch.eye(8, dtype=torch.float64)
    if name == "shampoo":
        assert torch.equal(weight["b0.L0"], torch.zeros(8, 8, dtype=torch.float64))
    else:
        assert torch.equal(weight["b0.Q0"], eye) and torch.equal(weight["b0.Q1"], eye)
    assert opt.param_groups[0]["lr"] == 1e-3
    for t in range(1, 12):
        loss_and_grad(model, "mlp", t)
        opt.step()
    assert opt.asteria_stats()["jobs_submitted"] > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_gradient_skips_parameter_and_refresh(name):
    """At a refresh step (k = 10) one weight gets a NaN gradient: it, its state and its basis
    stay exactly as they were, its refresh is not submitted, and both counters count it."""
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=SYNC)
    bad = model.layers[1].weight
    bad_step = 11 if name != "shampoo" else 10  # the step where k reaches 10
    for t in range(1, bad_step):
        loss_and_grad(model, "mlp", t)
        opt.step()
    state_before = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[bad].items()}
    w_before = bad.detach().clone()
    other_before = model.layers[0].weight.detach().clone()
    submitted = opt.asteria_stats()["refreshes_submitted"]
    basis = "b0.Linv0" if name == "shampoo" else "b0.Q0"
    good = opt.state[model.layers[0].weight]
    good_basis = good[basis].clone() if basis in good else None
    loss_and_grad(model, "mlp", bad_step)
    bad.grad[0, 0] = float("nan")
    opt.step()
    stats = opt.asteria_stats()
    assert stats["nonfinite_skipped"] == 1
    assert torch.equal(bad.detach(), w_before)
    assert not torch.equal(model.layers[0].weight.detach(), other_before)
    for k, v in state_before.items():
        same = torch.equal(opt.state[bad][k], v) if torch.is_tensor(v) else opt.state[bad][k] == v
        assert same, k
    # the others' refresh was submitted (one job per factor size: 8 x 8), the bad one's not:
    # its basis is the one from before, while a good weight's changed
    assert stats["refreshes_submitted"] == submitted + 1
    assert torch.equal(opt.state[bad][basis], state_before[basis])
    assert good_basis is None or not torch.equal(good[basis], good_basis)
    assert basis in good
    opt.close()


class _FailingEngine(InlineTorchEngine):
    """Every refresh after the first-step eigendecompositions fails as non-finite."""

    def submit(self, op, f, q=None, **kw):
        if op != "eigh":
            f = torch.full_like(f, float("nan"))
        return super().submit(op, f, q, **kw)


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_failed_refresh_keeps_previous_basis(name, monkeypatch):
    monkeypatch.setattr(asteria.refresh.select, "make_engine",
                        lambda cfg, plan=None, params=(): _FailingEngine())
    make_opt, _ = OPTIMIZERS[name]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=SYNC)
    w = model.layers[0].weight
    for t in range(1, 6):
        loss_and_grad(model, "mlp", t)
        opt.step()
    q_before = opt.state[w]["b0.Q0"].clone()
    v_before = opt.state[w]["b0.exp_avg"].clone()
    loss_and_grad(model, "mlp", 6)
    opt.step()  # k = 5: refresh submitted, fails
    stats = opt.asteria_stats()
    assert stats["refresh_failures"] > 0 and stats["jobs_failed"] == stats["refresh_failures"]
    assert torch.equal(opt.state[w]["b0.Q0"], q_before)
    assert not torch.equal(opt.state[w]["b0.exp_avg"], v_before)  # the step itself happened
    for t in range(7, 12):
        loss_and_grad(model, "mlp", t)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


# ---- bad input -------------------------------------------------------------------------------

@pytest.mark.parametrize("runtime, key", [
    ({"stalenes": 2}, "stalenes"),
    ({"staleness": -1}, "staleness"),
    ({"mode": "async", "staleness": 11}, "staleness"),  # S > precondition_frequency (10)
    ({"workers": 0}, "workers"),
    ({"mode": "fast"}, "mode"),
    ({"install": "lazy"}, "install"),
])
@pytest.mark.parametrize("name", NAMES)
def test_bad_runtime_raises_naming_key(name, runtime, key):
    cls = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}[name]
    with pytest.raises(ValueError, match=repr(key)):
        cls(make_model("mlp").parameters(), runtime=runtime)


def test_staleness_above_a_groups_frequency_raises():
    model = make_model("mlp")
    with pytest.raises(ValueError, match="'staleness'"):
        SOAP([{"params": list(model.layers[0].parameters()), "precondition_frequency": 2},
              {"params": list(model.layers[1].parameters())}],
             runtime={"mode": "async", "staleness": 3})


@pytest.mark.parametrize("kwargs, key", [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
    (dict(betas=(0.9, -0.1)), r"betas\[1\]"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(precondition_frequency=0), "precondition_frequency"),
    (dict(block_size=0), "block_size"),
])
@pytest.mark.parametrize("name", NAMES)
def test_bad_hyperparameters_raise(name, kwargs, key):
    cls = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}[name]
    with pytest.raises(ValueError, match=key):
        cls(make_model("mlp").parameters(), runtime=SYNC, **kwargs)


@pytest.mark.parametrize("cls, kwargs, key", [
    (SOAP, dict(shampoo_beta=1.5), "shampoo_beta"),
    (SOAP, dict(eps=-1.0), "eps"),
    (Shampoo, dict(grafting_beta2=1.0), "grafting_beta2"),
    (Shampoo, dict(epsilon=-1.0), "epsilon"),
    (Shampoo, dict(start_preconditioning_step=0), "start_preconditioning_step"),
    (KLShampoo, dict(init_factor=0.0), "init_factor"),
    (KLShampoo, dict(compute_dtype=torch.int32), "compute_dtype"),
])
def test_bad_method_hyperparameters_raise(cls, kwargs, key):
    with pytest.raises(ValueError, match=key):
        cls(make_model("mlp").parameters(), runtime=SYNC, **kwargs)


def test_bad_group_hyperparameter_raises():
    model = make_model("mlp")
    opt = SOAP(model.layers[0].parameters(), runtime=SYNC)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": list(model.layers[1].parameters()), "lr": -1.0})
    assert len(opt.param_groups) == 1
    opt.close()
