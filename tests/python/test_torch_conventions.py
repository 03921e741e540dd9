"""torch.optim's conventions, as ML engineers rely on them, for SOAP, Shampoo and KL-Shampoo in
sync and async mode:

- a save / load / step round trip is bitwise in every parameter dtype (float32, float64,
  bfloat16): the loaded state keeps the dtype the optimizer keeps it in (KL-Shampoo's compute
  dtype), where torch's generic load would cast it to the parameter's dtype;
- ``copy.deepcopy`` and pickling give a working optimizer with its own runtime;
- entries of ``optimizer.state`` that are not a parameter's state, and the four state-dict
  hooks, work as torch.optim has them;
- complex parameters are optimised as their real view, as torch.optim's optimizers take them
  (and a real-view parameter the caller keeps works the same);
- a state dict that does not fit raises a clear error and changes nothing;
- the group keys torch.optim adds itself (``differentiable`` after any load or copy;
  ``foreach``, ``maximize``, ``capturable``, ``fused``) may be present or absent in a state
  dict: a self round trip (accelerate's prepare) or a copy does not break later loads;
- a Tensor lr with more than one element fails with torch's wording.
"""

import copy
import io
import pickle

import pytest
import torch

from asteria.optim import KLShampoo, SOAP, Shampoo
from models import assert_same_state, require_c_extension

torch.set_num_threads(1)

CLASSES = {"soap": SOAP, "shampoo": Shampoo, "kl_shampoo": KLShampoo}
MODES = {
    "sync": {"mode": "sync"},
    "async": {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1},
    # the host tier asked for: "auto" keeps a CPU parameter's roots / eigenbases in
    # optimizer.state, this keeps them in the residency (copies, pickles and loads go through it)
    "async-host": {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1,
                   "placement": {"roots": "host", "eigenbases": "host"}},
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def make(name, mode, dtype=torch.float32, seed=0, **kw):
    """A small rectangular model (so every factor size differs) and its optimizer (f = 3)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(),
                                torch.nn.Linear(6, 8)).to(dtype)
    opt = CLASSES[name](model.parameters(), lr=3e-3, precondition_frequency=3,
                        runtime=MODES[mode], **kw)
    return model, opt


def train(model, opt, steps):
    dtype = next(model.parameters()).dtype
    for t in steps:
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(t)).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same_params(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()


# ---- 1. checkpoints in every dtype ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_save_load_step_round_trip_is_bitwise(name, mode, dtype):
    model, opt = make(name, mode, DTYPES[dtype])
    train(model, opt, range(1, 8))  # a refresh in flight at the save with S = 2
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2, opt2 = make(name, mode, DTYPES[dtype], seed=1)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optim"])
    assert_same_state(saved["optim"], opt2.state_dict())  # nothing cast, nothing lost
    if name == "kl_shampoo":  # its state stays in compute_dtype whatever the parameter's
        st = opt2.state[model2[0].weight]
        assert st["b0.Q0"].dtype == st["b0.S0"].dtype == torch.float32
    train(model, opt, range(8, 15))
    train(model2, opt2, range(8, 15))
    assert_same_params(params(model), params(model2))
    opt.close()
    opt2.close()


# ---- 2. copies --------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_deepcopy_and_pickle_give_working_optimizers(name, mode):
    model, opt = make(name, mode)
    train(model, opt, range(1, 6))
    model2, opt2 = copy.deepcopy((model, opt))
    model3, opt3 = pickle.loads(pickle.dumps((model, opt)))
    assert opt2.run.engine is not opt.run.engine and opt3.run.engine is not opt.run.engine
    assert opt2.param_groups[0]["params"][0] is model2[0].weight  # the copy's own parameters
    for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
        train(m, o, range(6, 14))
    assert_same_params(params(model), params(model2))
    assert_same_params(params(model), params(model3))
    for o in (opt, opt2, opt3):
        o.close()


def test_copy_of_a_closed_optimizer_says_what_to_do():
    model, opt = make("soap", "async")
    opt.close()
    with pytest.raises(RuntimeError, match="closed SOAP.*load_state_dict"):
        copy.deepcopy(opt)


# ---- 3. non-parameter state entries and the state-dict hooks ----------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_non_parameter_state_and_state_dict_hooks(name, mode):
    model, opt = make(name, mode)
    seen = {}

    def sd_pre(o):
        o.state["saves"] = o.state.get("saves", 0) + 1  # a non-parameter entry

    def sd_post(o, sd):
        seen["post_keys"] = sorted(sd["state"][0])  # sees the finished state dict
        sd["extra"] = "kept"
        return sd

    def load_pre(o, sd):
        seen["load_pre"] = sd["state"]["saves"]
        return None

    def load_post(o):
        o.state["resumed"] = True  # a load post hook storing a value

    opt.register_state_dict_pre_hook(sd_pre)
    opt.register_state_dict_post_hook(sd_post)
    train(model, opt, range(1, 5))
    sd = opt.state_dict()
    assert sd["state"]["saves"] == 1 and sd["extra"] == "kept"
    if mode != "sync":
        assert "pending.install_in" in seen["post_keys"]
    model2, opt2 = make(name, mode, seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.register_load_state_dict_pre_hook(load_pre)
    opt2.register_load_state_dict_post_hook(load_post)
    opt2.load_state_dict(sd)
    assert seen["load_pre"] == 1
    assert opt2.state["saves"] == 1 and opt2.state["resumed"] is True
    train(model, opt, range(5, 10))
    train(model2, opt2, range(5, 10))
    assert_same_params(params(model), params(model2))
    assert opt2.state_dict()["state"]["resumed"] is True
    opt2.asteria_stats()
    opt.close()
    opt2.close()
    assert opt2.state["saves"] == 1  # close keeps the entries


# ---- 4. complex parameters ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_complex_parameters_are_optimised_as_their_real_view(name, mode):
    """torch.optim's convention: a complex parameter, given at construction or added later, is
    optimised as its real view, bitwise as the run on ``torch.view_as_real(p)`` itself
    (tests/python/test_complex_params.py checks the state, blocks and checkpoints)."""
    torch.manual_seed(0)
    w = torch.randn(4, 4)
    zs = [torch.randn(4, 4, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)]
    target = torch.randn(4, 4, dtype=torch.complex64)
    runs = []
    for cplx in (True, False):
        ps = [torch.nn.Parameter(w.clone())] + [
            torch.nn.Parameter(z.clone() if cplx else torch.view_as_real(z).clone()) for z in zs]
        c = (lambda p: p) if cplx else torch.view_as_complex
        opt = CLASSES[name](ps[:2], lr=1e-2, precondition_frequency=2, runtime=MODES[mode])
        opt.add_param_group({"params": [ps[2]]})
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = ((ps[0] * c(ps[1]) - target).abs().square().mean()
                    + (c(ps[2]).abs() - 1).square().sum())
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs.append(([torch.view_as_real(p.detach()) if p.is_complex() else p.detach()
                      for p in ps], losses))
        opt.close()
    (got, got_losses), (want, want_losses) = runs
    assert got_losses == want_losses and got_losses[-1] < got_losses[0]
    assert_same_params(got, want)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_complex_model_trains_through_its_real_view(name, mode):
    torch.manual_seed(0)
    real = torch.nn.Parameter(torch.view_as_real(torch.randn(6, 6, dtype=torch.complex64) * 0.3))
    opt = CLASSES[name]([real], lr=1e-2, precondition_frequency=2, runtime=MODES[mode])
    target = torch.randn(6, 6, dtype=torch.complex64)
    losses = []
    for _ in range(12):
        opt.zero_grad()
        loss = (torch.view_as_complex(real) - target).abs().square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    opt.close()


# ---- 5. state dicts that do not fit ----------------------------------------------------------

def _unchanged_after(opt, model, bad_sd, match):
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad_sd)
    assert_same_state(before, opt.state_dict())
    return before


@pytest.mark.parametrize("mode", MODES)
def test_state_dict_of_another_optimizer_is_rejected(mode):
    model, opt = make("soap", mode)
    train(model, opt, range(1, 5))
    other_model, other = make("shampoo", mode)
    train(other_model, other, range(1, 5))
    _unchanged_after(opt, model, other.state_dict(), r"lacks SOAP's hyperparameter")
    # the groups made to fit: the per-parameter state still names the key and the parameter
    sd = other.state_dict()
    sd["param_groups"] = copy.deepcopy(opt.state_dict()["param_groups"])
    _unchanged_after(opt, model, sd, r"state of parameter 0 \(6, 8\).*key 'b0.GG0' is missing")
    # the rejected loads left a working optimizer on its trajectory
    ref_model, ref = make("soap", mode)
    train(ref_model, ref, range(1, 5))
    train(model, opt, range(5, 10))
    train(ref_model, ref, range(5, 10))
    assert_same_params(params(model), params(ref_model))
    for o in (opt, other, ref):
        o.close()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLASSES)
def test_state_dict_for_other_shapes_is_rejected(name, mode):
    model, opt = make(name, mode)
    train(model, opt, range(1, 5))
    torch.manual_seed(0)
    wide = torch.nn.Sequential(torch.nn.Linear(8, 7), torch.nn.Tanh(), torch.nn.Linear(7, 8))
    wopt = CLASSES[name](wide.parameters(), lr=3e-3, precondition_frequency=3,
                         runtime=MODES[mode])
    train(wide, wopt, range(1, 5))
    _unchanged_after(opt, model, wopt.state_dict(),
                     r"state of parameter 0 \(6, 8\) does not fit.*expected shape \(6,? ?8?")
    opt.close()
    wopt.close()


def test_bad_state_entry_kind_is_rejected():
    model, opt = make("soap", "sync")
    train(model, opt, range(1, 4))
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["b0.Q0"] = 3.0
    _unchanged_after(opt, model, sd, r"key 'b0.Q0': expected a tensor of shape \(6, 6\), "
                                     r"found float")
    sd = copy.deepcopy(opt.state_dict())
    sd["state"][0]["b0.bogus"] = torch.zeros(2)
    _unchanged_after(opt, model, sd, r"unexpected key 'b0.bogus'")
    opt.close()


# ---- 6. the group keys torch.optim adds itself ----------------------------------------------

# torch.optim's __setstate__ (the end of every load_state_dict, and of a copy) adds
# "differentiable" to the defaults; torch's own optimizers keep the other four in their groups
TORCH_GROUP_KEYS = ("differentiable", "foreach", "maximize", "capturable", "fused")


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", CLASSES)
def test_load_after_a_self_round_trip_or_a_copy(name, mode):
    """accelerate's prepare() does opt.load_state_dict(opt.state_dict()) before a resume loads
    the checkpoint; a copy goes through the same load. Neither may make a later load demand the
    keys torch added."""
    model, opt = make(name, mode)
    train(model, opt, range(1, 6))
    saved = opt.state_dict()
    with_keys = copy.deepcopy(saved)
    for g in with_keys["param_groups"]:
        g.update({k: False for k in TORCH_GROUP_KEYS}, foreach=None)
    model2, opt2 = make(name, mode, seed=1)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(opt2.state_dict())  # as accelerate's prepare() does
    opt2.load_state_dict(saved)
    model3, fresh = make(name, mode, seed=1)
    model3.load_state_dict(model.state_dict())
    model3, opt3 = copy.deepcopy((model3, fresh))
    opt3.load_state_dict(with_keys)  # torch's keys present load too
    opt2.load_state_dict(with_keys)
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (model2, opt2), (model3, opt3)):
        train(m, o, range(6, 12))
    assert_same_params(params(model), params(model2))
    assert_same_params(params(model), params(model3))
    for o in (opt, opt2, fresh, opt3):
        o.close()


@pytest.mark.parametrize("name", CLASSES)
def test_another_optimizers_state_dict_is_refused_after_a_self_round_trip(name):
    model, opt = make(name, "sync")
    opt.load_state_dict(opt.state_dict())
    train(model, opt, range(1, 4))
    adamw = torch.optim.AdamW(model.parameters())  # its groups hold all of torch's keys
    train(model, adamw, range(1, 3))
    before = _unchanged_after(opt, model, adamw.state_dict(),
                              rf"lacks {type(opt).__name__}'s hyperparameter\(s\) \[")
    with pytest.raises(ValueError) as err:
        opt.load_state_dict(adamw.state_dict())
    missing = str(err.value).split("hyperparameter(s) ")[1].split("]")[0]
    assert not any(k in missing for k in TORCH_GROUP_KEYS), missing  # only its own
    assert "betas" not in missing and "precondition_frequency" in missing
    assert before["param_groups"][0].keys() == opt.state_dict()["param_groups"][0].keys()
    opt.load_state_dict(before)  # its own still loads
    assert_same_state(before, opt.state_dict())
    opt.close()


# ---- 7. Tensor lr -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", CLASSES)
def test_tensor_lr_must_be_one_element(name):
    w = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="^Tensor lr must be 1-element$"):
        CLASSES[name]([w], lr=torch.tensor([1e-3, 1e-3]), runtime={"mode": "sync"})
    opt = CLASSES[name]([w], lr=torch.tensor(1e-3), runtime={"mode": "sync"})
    opt.close()
