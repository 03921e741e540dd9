"""asteria.OneSidedSOAP: SOAP with a factor and eigenbasis on the smallest dimension of each
block only (the first of them on a tie; none where it exceeds max_precond_dim), against
reference.SOAPRef(one_sided=True), the plain-torch restatement, float64.

 - sync against the restatement after every step (test_soap.py's tolerances): tall (32 x 8),
   wide (8 x 32), 16 x 8 and square (16 x 16: dimension 0 only) weights, a 3-D weight whose
   smallest size appears twice (5 x 3 x 3: dimension 1), blocks (block_size), merged dimensions,
   and max_precond_dim below the smallest dimension (no factor at all) or between the sizes;
   the state holds the chosen side's b{j}.GG{i} / b{j}.Q{i} only, of the small size;
 - async: S = 0 equal to sync to the pool's LAPACK rounding (test_staleness.py), S = 2 equal
   to the restatement with its installs 2 steps late;
 - checkpoints (float32, float64, bfloat16; sync, async with a REFRESH in flight, host tier)
   resume bitwise; copy.deepcopy gives a working optimizer;
 - the host and NVMe tiers are bitwise the all-device run; tier_dtype "bfloat16" equals the
   restatement with its bases rounded to bfloat16 where stored (test_tier_dtype.py);
 - asteria_memory_plan(): a 64 x 256 weight plans exactly the 256 x 256 factor and basis less
   than under SOAP;
 - OLMo-core: the config asteria.olmo.AsteriaOneSidedSOAPConfig ("asteria_one_sided_soap"),
   made from the optimizer registry like the others.

Unlike models.py's square-only models, rectangular weights are fine here: the one factor is
the small side's, full rank with distinct eigenvalues when a batch has more tokens than that
side (64 here, against sides of at most 16).
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

import asteria
import models
from asteria.optim import OneSidedSOAP, SOAP
from models import (assert_lockstep, assert_params_close, assert_same_state, blocks_view,
                    grid_blocks, lockstep_tol, require_c_extension)
from reference import SOAPRef
from test_tier_dtype import SOAPRefBF16

F64 = torch.float64
TOKENS = 64
WIDTHS = (8, 32, 8, 16, 16)  # weights 32x8 (tall), 8x32 (wide), 16x8 (tall), 16x16 (square)
#: the one factor of each chain weight under the defaults: (state key, its size)
CHAIN_FACTORS = [("b0.GG1", 8), ("b0.GG0", 8), ("b0.GG1", 8), ("b0.GG0", 16)]
SYNC = {"mode": "sync"}
ALL_DEVICE = {"roots": "device", "eigenbases": "device"}
HOST = {"roots": "host", "eigenbases": "host"}

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def chain() -> nn.Module:
    """Linear layers 8 -> 32 -> 8 -> 16 -> 16 with tanh between them."""
    return models.MLP(WIDTHS)


class Tensor3(nn.Module):
    """One 5 x 3 x 3 weight, y_n,a = tanh(sum_bc W_abc x_n,bc): the smallest size twice."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 3, 3) / 3)

    def forward(self, x):
        return torch.tanh(torch.einsum("abc,nbc->na", self.w, x))


def make_model(kind: str, dtype=F64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"chain": chain, "tensor3": Tensor3}[kind]().to(dtype)


def batch(kind: str, step: int):
    """Deterministic (input, target) of a step, float64 (as models.batch)."""
    gen = torch.Generator().manual_seed(1000 + step)
    fixed = torch.Generator().manual_seed(7)
    if kind == "chain":
        x = torch.randn(TOKENS, WIDTHS[0], generator=gen, dtype=F64)
        return x, torch.sin(x @ torch.randn(WIDTHS[0], WIDTHS[-1], generator=fixed, dtype=F64))
    x = torch.randn(TOKENS, 3, 3, generator=gen, dtype=F64)
    a = torch.randn(5, 3, 3, generator=fixed, dtype=F64)
    return x, torch.sin(torch.einsum("abc,nbc->na", a, x))


def loss_and_grad(model: nn.Module, kind: str, step: int) -> None:
    dtype = next(model.parameters()).dtype
    for p in model.parameters():
        p.grad = None
    x, y = batch(kind, step)
    ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def train(model, opt, kind, steps):
    """opt.step() on the batches of ``steps``; the parameters after each."""
    out = []
    for t in steps:
        loss_and_grad(model, kind, t)
        opt.step()
        out.append(params_of(model))
    return out


def run(kind, make_opt, steps, dtype=F64):
    """Train a fresh model; (params after every step, the optimizer, closed)."""
    model = make_model(kind, dtype)
    opt = make_opt(model.parameters())
    try:
        return train(model, opt, kind, range(1, steps + 1)), opt
    finally:
        opt.close()


def lockstep(kind, make_opt, make_ref, steps, ref_views=None):
    """models.lockstep on this file's models: [(step, package params, reference params)] and
    the optimizer (closed)."""
    return models.lockstep(kind, make_opt, make_ref, steps, ref_views,
                           models=(make_model, loss_and_grad))


def max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for t, (x, y) in enumerate(zip(a, b), 1):
        for i, (u, v) in enumerate(zip(x, y)):
            assert torch.equal(u, v), f"step {t} param {i} differs"


def factor_keys(st) -> dict:
    """{key: shape} of a parameter state's factors and eigenbases (tiered ones included)."""
    return {k: tuple(st[k].shape) for k in list(st.keys())
            if isinstance(k, str) and (".GG" in k or ".Q" in k)}


def one_side(shape, max_dim=10000) -> list:
    """The restated rule for the state checks: the dimensions of a block with a factor."""
    side = list(shape).index(min(shape))
    return [side] if shape[side] <= max_dim else []


def merged_view(model):
    """(5, 3, 3) with max_precond_dim 9 merges to (5, 9) (SOAP's rule: 5 x 3 > 9, 3 x 3 <= 9)."""
    w = model.w
    return [w.data.view(5, 9)], lambda: [w.grad.view(5, 9)]


def one_sided(p, **kw):
    kw.setdefault("precondition_frequency", 5)
    return OneSidedSOAP(p, **kw)


def reference(p, **kw):
    kw.setdefault("precondition_frequency", 5)
    return SOAPRef(p, one_sided=True, **kw)


# ---- sync against the restatement --------------------------------------------------------------

CASES = {
    "chain": ("chain", {}, None),
    "tensor3_tie": ("tensor3", {}, None),
    "block_size_6": ("chain", dict(block_size=6), blocks_view(6)),
    "merge_dims": ("tensor3", dict(merge_dims=True, max_precond_dim=9), merged_view),
    "max_precond_dim_4": ("chain", dict(max_precond_dim=4), None),   # below every size
    "max_precond_dim_12": ("chain", dict(max_precond_dim=12), None),  # the 16 x 16: none
}


@pytest.mark.parametrize("case", CASES)
def test_sync_matches_one_sided_reference(case):
    kind, hp, views = CASES[case]
    history, opt = lockstep(kind, lambda p: one_sided(p, runtime=SYNC, **hp),
                            lambda p: reference(p, **{k: v for k, v in hp.items()
                                                      if k not in ("block_size", "merge_dims")}),
                            steps=30, ref_views=views)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    refreshes = case != "max_precond_dim_4"  # no factor: nothing to refresh
    assert (stats["installs"] > 0) == refreshes
    assert stats["max_install_lag"] == 0 and stats["refresh_failures"] == 0


@pytest.mark.parametrize("case", CASES)
def test_state_has_the_small_side_only(case):
    kind, hp, _ = CASES[case]
    _, opt = run(kind, lambda p: one_sided(p, runtime=SYNC, **hp), 7)
    max_dim = hp.get("max_precond_dim", 10000)
    weights = [p for p in opt.state if p.dim() > 1]
    assert weights
    for p in weights:
        st = opt.state[p]
        if "block_size" in hp:
            shapes = [(r[1] - r[0], c[1] - c[0]) for r, c in grid_blocks(p.shape, hp["block_size"])]
        elif "merge_dims" in hp:
            shapes = [(5, 9)]
        else:
            shapes = [tuple(p.shape)]
        want = {}
        for j, shape in enumerate(shapes):
            assert tuple(st[f"b{j}.exp_avg"].shape) == shape
            for i in one_side(shape, max_dim):
                want[f"b{j}.GG{i}"] = want[f"b{j}.Q{i}"] = (shape[i], shape[i])
        assert factor_keys(st) == want, (tuple(p.shape), factor_keys(st))
    if case == "chain":  # the table, written out: the small side, dimension 0 on the tie
        got = [{k: v for k, v in factor_keys(opt.state[p]).items() if ".GG" in k}
               for p in weights]
        assert got == [{k: (n, n)} for k, n in CHAIN_FACTORS]
    if case == "tensor3_tie":
        assert set(factor_keys(opt.state[weights[0]])) == {"b0.GG1", "b0.Q1"}
    if case == "max_precond_dim_4":
        assert all(not factor_keys(opt.state[p]) for p in weights)


def test_differs_from_two_sided_soap():
    """The comparisons above can fail: SOAP (both sides) and the two-sided restatement are far
    from the one-sided trajectory; where no weight has a factor beyond its smallest side
    (max_precond_dim 8: the 8-sides only, as under SOAP) the two are the same optimizer."""
    history, _ = lockstep("chain", lambda p: one_sided(p, runtime=SYNC),
                          lambda p: SOAPRef(p, precondition_frequency=5), steps=30)
    with pytest.raises(AssertionError):
        assert_lockstep(history)
    one, _ = run("chain", lambda p: one_sided(p, runtime=SYNC), 30)
    two, _ = run("chain", lambda p: SOAP(p, precondition_frequency=5, runtime=SYNC), 30)
    assert max_diff(one[-1], two[-1]) > 1e-4
    one8, _ = run("chain", lambda p: one_sided(p, max_precond_dim=8, runtime=SYNC), 30)
    two8, _ = run("chain", lambda p: SOAP(p, precondition_frequency=5, max_precond_dim=8,
                                          runtime=SYNC), 30)
    assert_bitwise(one8, two8)


def test_square_tie_takes_dimension_zero():
    """On the 16 x 16 weight the factor is dimension 0's; the other choice (the restatement
    given the transposed weight) is another trajectory."""
    def transposed(model):
        ps = list(model.parameters())
        tensors = [p.data.T if p.shape == (16, 16) else p.data for p in ps]
        return tensors, lambda: [p.grad.T if p.shape == (16, 16) else p.grad for p in ps]

    history, _ = lockstep("chain", lambda p: one_sided(p, runtime=SYNC), reference, steps=30,
                          ref_views=transposed)
    with pytest.raises(AssertionError):
        assert_lockstep(history)


# ---- async ----------------------------------------------------------------------------------

def deterministic(s, workers=2, **kw):
    return {"mode": "async", "staleness": s, "install": "deterministic", "workers": workers,
            **kw}


@pytest.mark.parametrize("kind", ["chain", "tensor3"])
def test_async_s0_equals_sync(kind):
    """The pool computes with OpenBLAS's LAPACK, sync with torch's: equal to rounding
    (test_staleness.py's tolerance), not bitwise."""
    sync, _ = run(kind, lambda p: one_sided(p, runtime=SYNC), 30)
    asyn, opt = run(kind, lambda p: one_sided(p, runtime=deterministic(0)), 30)
    for t, (a, b) in enumerate(zip(asyn, sync), 1):
        assert_params_close(a, b, rtol=lockstep_tol(t), atol=lockstep_tol(t), what=f"step {t}")
    stats = opt.asteria_stats()
    assert stats["jobs_done"] == stats["jobs_submitted"] > 0
    assert stats["installs"] > 0 and stats["max_install_lag"] == 0


@pytest.mark.parametrize("kind", ["chain", "tensor3"])
def test_async_s2_equals_delayed_reference(kind):
    history, opt = lockstep(kind, lambda p: one_sided(p, precondition_frequency=4,
                                                      runtime=deterministic(2)),
                            lambda p: reference(p, precondition_frequency=4, install_delay=2),
                            steps=30)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["max_install_lag"] == 2 and stats["installs"] > 0
    # not vacuous: the installs' delay moves the trajectory beyond the tolerance
    sync, _ = run(kind, lambda p: one_sided(p, precondition_frequency=4, runtime=SYNC), 30)
    assert max_diff(sync[-1], history[-1][1]) > 1e-6


def test_async_block_size_equals_delayed_reference():
    history, _ = lockstep("chain", lambda p: one_sided(p, precondition_frequency=4, block_size=6,
                                                       runtime=deterministic(2)),
                          lambda p: reference(p, precondition_frequency=4, install_delay=2),
                          steps=24, ref_views=blocks_view(6))
    assert_lockstep(history)


def test_async_reproducible_across_worker_counts():
    runs = [run("chain", lambda p: one_sided(p, precondition_frequency=4,
                                             runtime=deterministic(2, workers=w)), 20)[0]
            for w in (1, 2, 4)]
    for other in runs[1:]:
        assert_bitwise(runs[0], other)


# ---- checkpoints and copies -----------------------------------------------------------------

MODES = {
    "sync": SYNC,
    "async": deterministic(2),
    "async-host": deterministic(2, placement=HOST),
}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
SPLIT, STEPS = 6, 14  # f = 4: the refresh snapshotted at step 5 installs at step 7 under S = 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_save_load_step_round_trip_is_bitwise(mode, dtype):
    dt = DTYPES[dtype]

    def make(p):
        return one_sided(p, precondition_frequency=4, runtime=MODES[mode])

    want, _ = run("chain", make, STEPS, dt)
    model = make_model("chain", dt)
    opt = make(model.parameters())
    train(model, opt, "chain", range(1, SPLIT + 1))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    opt.close()
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    pending = [st["pending.install_in"] for st in saved["optim"]["state"].values()
               if "pending.install_in" in st]
    if mode == "sync":
        assert not pending
    else:  # the four weights' refresh, in flight
        assert pending == [1] * 4
    model2 = make_model("chain", dt, seed=1)
    model2.load_state_dict(saved["model"])
    opt2 = make(model2.parameters())
    opt2.load_state_dict(saved["optim"])
    assert_same_state(saved["optim"], opt2.state_dict())  # nothing cast, nothing lost
    got = train(model2, opt2, "chain", range(SPLIT + 1, STEPS + 1))
    opt2.close()
    assert_bitwise(got, want[SPLIT:])
    assert max_diff(want[SPLIT], want[-1]) > 0  # it trained on after the split


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_gives_a_working_optimizer(mode):
    model = make_model("chain", torch.float32)
    opt = one_sided(model.parameters(), precondition_frequency=4, runtime=MODES[mode])
    train(model, opt, "chain", range(1, 6))
    model2, opt2 = copy.deepcopy((model, opt))
    assert type(opt2) is OneSidedSOAP and opt2.run.engine is not opt.run.engine
    assert opt2.param_groups[0]["params"][0] is model2.layers[0].weight
    assert factor_keys(opt2.state[model2.layers[0].weight]) == {"b0.GG1": (8, 8),
                                                                "b0.Q1": (8, 8)}
    a = train(model, opt, "chain", range(6, 14))
    b = train(model2, opt2, "chain", range(6, 14))
    opt.close()
    opt2.close()
    assert_bitwise(b, a)


def test_soap_checkpoint_is_refused_by_name():
    """A SOAP state dict has the large sides' factors too: OneSidedSOAP refuses it, naming the
    key, and keeps its own state."""
    model = make_model("chain")
    src = SOAP(model.parameters(), precondition_frequency=4, runtime=SYNC)
    train(model, src, "chain", range(1, 4))
    sd = src.state_dict()
    src.close()
    dst = one_sided(model.parameters(), precondition_frequency=4, runtime=SYNC)
    train(model, dst, "chain", range(1, 4))
    before = copy.deepcopy(dst.state_dict())
    with pytest.raises(ValueError, match=r"parameter 0 \(32, 8\) does not fit this OneSidedSOAP: "
                                         r"unexpected key 'b0.GG0'"):
        dst.load_state_dict(sd)
    assert_same_state(before, dst.state_dict())
    dst.close()


# ---- tiers ----------------------------------------------------------------------------------

Q_BYTES = (3 * 8 * 8 + 16 * 16) * 8  # the chain's four bases, float64


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_tiers_are_bitwise_the_all_device_run(tier, tmp_path):
    def make(rt):
        return lambda p: one_sided(p, precondition_frequency=4, runtime=rt)

    dev, _ = run("chain", make(deterministic(2, placement=ALL_DEVICE)), 16)
    rt = (deterministic(2, placement=HOST) if tier == "host" else
          deterministic(2, nvme_dir=str(tmp_path), host_budget_bytes=8 * 8 * 8))
    got, opt = run("chain", make(rt), 16)
    assert_bitwise(got, dev)
    st = opt.asteria_stats()
    assert st["installs"] > 0
    assert st["bytes_host"] + st["bytes_nvme"] == Q_BYTES  # the one-sided bases, no more
    if tier == "nvme":
        assert st["bytes_nvme"] > 0 and st["bytes_nvme_read"] > 0
        assert st["bytes_host"] <= 8 * 8 * 8
    else:
        assert st["bytes_nvme"] == 0 and st["prefetches"] > 0
    assert (opt.asteria_memory_plan()["planned_bytes"].get("host", 0)
            + opt.asteria_memory_plan()["planned_bytes"].get("nvme", 0)) == Q_BYTES


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_bf16_tier_equals_rounded_reference(tier, tmp_path):
    rt = deterministic(2, placement=HOST, tier_dtype="bfloat16")
    if tier == "nvme":
        rt.update(nvme_dir=str(tmp_path), host_budget_bytes=8 * 8 * 2)
    history, opt = lockstep("chain", lambda p: one_sided(p, precondition_frequency=4, runtime=rt),
                            lambda p: SOAPRefBF16(p, one_sided=True, precondition_frequency=4,
                                                  install_delay=2), steps=20)
    assert_lockstep(history)
    st = opt.asteria_stats()
    assert st["bytes_host"] + st["bytes_nvme"] == Q_BYTES // 4  # float64 -> bfloat16
    # not vacuous: bfloat16 storage moves the trajectory beyond the tolerance
    full, _ = run("chain", lambda p: one_sided(p, precondition_frequency=4,
                                               runtime=deterministic(2, placement=HOST)), 20)
    assert max_diff(full[-1], history[-1][1]) > 1e-6


# ---- memory -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sync", "async"])
def test_memory_plan_drops_the_large_factor_and_basis(mode):
    """64 x 256 float32: SOAP plans moments, 64^2 and 256^2 factors and bases; one-sided SOAP
    the moments and the 64^2 pair, 2 x 256^2 x 4 bytes less."""
    plans = {}
    for cls in (SOAP, OneSidedSOAP):
        w = nn.Parameter(torch.randn(64, 256))
        opt = cls([w], runtime={"mode": mode})
        plans[cls] = opt.asteria_memory_plan()
        opt.close()
    soap, one = plans[SOAP]["planned_bytes"], plans[OneSidedSOAP]["planned_bytes"]
    assert set(soap) == set(one) == {"device"}
    assert soap["device"] - one["device"] == 2 * 256 * 256 * 4
    assert one["device"] == (2 * 64 * 256 + 2 * 64 * 64) * 4


def test_stats_bytes_after_training():
    """What the optimizer holds once it trains matches the plan: moments and the 64^2 pair."""
    w = nn.Parameter(torch.randn(64, 256))
    opt = OneSidedSOAP([w], precondition_frequency=2, runtime=SYNC)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        w.grad = torch.randn(64, 256, generator=gen)
        opt.step()
    st = opt.asteria_stats()
    plan = opt.asteria_memory_plan()
    opt.close()
    assert factor_keys(opt.state[w]) == {"b0.GG0": (64, 64), "b0.Q0": (64, 64)}
    assert st["bytes_device"] == plan["planned_bytes"]["device"] == (2 * 64 * 256
                                                                      + 2 * 64 * 64) * 4


# ---- OLMo-core --------------------------------------------------------------------------------

def _olmo_config():
    pytest.importorskip("olmo_core", reason="OLMo-core (ai2-olmo-core) is not installed")
    import asteria.olmo as ao

    return getattr(ao, "AsteriaOneSidedSOAPConfig", None)


def test_olmo_config_resolves_and_builds():
    """As test_olmo.py's configs: "type": "asteria_one_sided_soap" resolves to the config, its
    fields are OneSidedSOAP's keywords with their defaults, and the optimizer it builds
    preconditions the matrices with OneSidedSOAP (one side's state only)."""
    import dataclasses

    cfg_cls = _olmo_config()
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import OptimConfig

    assert cfg_cls is not None, "asteria.olmo has no AsteriaOneSidedSOAPConfig"
    cfg = OptimConfig.from_dict({"type": "asteria_one_sided_soap", "lr": 3e-3,
                                 "precondition_frequency": 3,
                                 "runtime": {"mode": "async", "staleness": 2,
                                             "install": "deterministic", "workers": 1}})
    assert type(cfg) is cfg_cls
    sig = inspect.signature(OneSidedSOAP).parameters
    base = {f.name for f in dataclasses.fields(OptimConfig)} | {"runtime"}
    for f in dataclasses.fields(cfg_cls):
        if f.name not in base:
            assert f.name in sig, f.name
            want = sig[f.name].default
            assert (tuple(f.default) if isinstance(want, tuple) else f.default) == want, f.name
    torch.manual_seed(0)
    model = TransformerConfig.olmo2_1M(vocab_size=256, n_layers=2).build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    opt = cfg.build(model)
    try:
        assert type(opt.second_order) is OneSidedSOAP
        for t in range(1, 6):
            x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(t))
            model(x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        for g in opt.second_order.param_groups:
            for p in g["params"]:
                st = opt.second_order.state[p]
                assert {k for k in factor_keys(st) if ".GG" in k} == {
                    f"b0.GG{i}" for i in one_side(p.shape)}
    finally:
        opt.close()


def test_public_name_and_keywords_are_soaps():
    assert asteria.OneSidedSOAP is OneSidedSOAP and issubclass(OneSidedSOAP, SOAP)
    assert inspect.signature(OneSidedSOAP) == inspect.signature(SOAP)
