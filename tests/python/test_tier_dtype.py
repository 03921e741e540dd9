"""Reduced-precision tier storage (runtime key ``tier_dtype``).

 - With ``tier_dtype="bfloat16"`` roots / eigenbases outside the device (host and NVMe tiers)
   are stored rounded to bfloat16 and widened where used. Each optimizer (async, deterministic
   S = 2, on the C pool) equals the plain-torch restatement (reference.py) in which every basis
   / root is rounded to bfloat16 when it is stored (first-step eigenbasis, each install) and
   widened before it is used (the step, the next refresh, SOAP's re-expression of m at
   install). Tolerances are test_staleness.py's for async against the restatement
   (models.lockstep_tol): the pool's LAPACK differs from torch's in the last bits, far below
   a bfloat16 step, so roundings agree; bfloat16 itself moves the trajectory by more than that
   (checked).
 - The stats and the plan report the narrowed blocks at 2 bytes an element (half a float32
   block's bytes), on the host and the NVMe tier; blocks already that narrow stay as they are.
 - state_dict() returns a tiered block widened, in the state's dtype (checkpoints move between
   tier_dtype settings); loading narrows again, and a resumed run continues bitwise.
 - A bad value is a ValueError naming the key, the value and the allowed values.
 - asteria_memory_plan(): the planner's figures before the first step.
The float32 default is covered bit for bit by the other tests (test_staleness, test_nvme_training,
test_state_dict, ...), which run with it.
"""

import copy

import pytest
import torch

from asteria import RuntimeConfig
from asteria.optim import SOAP
from models import (assert_lockstep, batch, lockstep, make_model, optimizer_pairs, params_of,
                    require_c_extension, resume, run, train_mlp)
from reference import KLShampooRef, SOAPRef, ShampooRef

BF16 = torch.bfloat16
S = 2
BLOCKS = 6  # the mlp's 3 square weights x 2 factors
HOST_BUDGET = 2 * 8 * 8 * 2  # two 8 x 8 bfloat16 blocks on the host, the other 4 on NVMe


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the tier stores it: rounded to bfloat16 (nearest even), widened back."""
    return x.to(BF16).to(x.dtype)


class SOAPRefBF16(SOAPRef):
    """SOAPRef with Q stored in bfloat16: the first-step eigenbasis and each refreshed one are
    rounded when stored; m is re-expressed in the rounded new basis (the one the steps use)."""

    def update(self, w, g, st):
        first = not st
        due = super().update(w, g, st)
        if first:
            st["Q"] = [None if q is None else rounded(q) for q in st["Q"]]
        return due

    def install(self, st, result):
        super().install(st, [None if r is None else (r[0], rounded(r[1])) for r in result])


class KLShampooRefBF16(KLShampooRef):
    def update(self, w, g, st):
        first = not st
        due = super().update(w, g, st)
        if first:
            st["Q"] = {d: rounded(q) for d, q in st["Q"].items()}
        return due

    def install(self, st, result):
        super().install(st, {d: rounded(q) for d, q in result.items()})


class ShampooRefBF16(ShampooRef):
    def install(self, st, result):
        super().install(st, {d: rounded(r) for d, r in result.items()})


OPTIMIZERS = optimizer_pairs(4, {"soap": SOAPRefBF16, "shampoo": ShampooRefBF16,
                                 "kl_shampoo": KLShampooRefBF16})
NAMES = list(OPTIMIZERS)


def rt(tier_dtype="bfloat16", **kw):
    # explicit host tier: "auto" keeps a CPU parameter's blocks in optimizer.state (nothing to
    # narrow) unless a budget / nvme_dir asks for spilling
    base = {"mode": "async", "staleness": S, "install": "deterministic", "workers": 2,
            "tier_dtype": tier_dtype, "placement": {"roots": "host", "eigenbases": "host"}}
    base.update(kw)
    return base


def nvme(tmp_path, **kw):
    return rt(nvme_dir=str(tmp_path), host_budget_bytes=HOST_BUDGET, **kw)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("name", NAMES)
def test_bf16_storage_equals_rounded_reference(name, tier, tmp_path):
    make_opt, make_ref = OPTIMIZERS[name]
    runtime = rt() if tier == "host" else nvme(tmp_path)
    history, opt = lockstep("mlp", lambda p: make_opt(p, runtime=runtime),
                            lambda p: make_ref(p, install_delay=S), steps=20)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["installs"] > 0 and stats["max_install_lag"] == S
    if tier == "nvme":
        assert stats["bytes_nvme"] == 4 * 8 * 8 * 2 and stats["bytes_nvme_read"] > 0
    # not vacuous: bfloat16 storage moves the trajectory beyond the tolerance
    full, _ = run("mlp", lambda p: make_opt(p, runtime=rt("float32")), 20)
    assert max(float((a - b).abs().max()) for a, b in zip(full[-1], history[-1][1])) > 1e-6


def test_soap_block_model_equals_rounded_reference():
    """Several block shapes and stacks of them (attention and MLP weights)."""
    make_opt, make_ref = OPTIMIZERS["soap"]
    history, _ = lockstep("block", lambda p: make_opt(p, runtime=rt()),
                          lambda p: make_ref(p, install_delay=S), steps=20)
    assert_lockstep(history)


def narrow_step(model, opt, t):
    """loss_and_grad for a model in another dtype than the float64 batches."""
    dtype = next(model.parameters()).dtype
    opt.zero_grad(set_to_none=True)
    x, y = batch("mlp", t)
    ((model(x.to(dtype)) - y.to(dtype)) ** 2).mean().backward()
    opt.step()


def stats_after(make_opt, model, runtime, steps=6):
    opt = make_opt(model.parameters(), runtime=runtime)
    plan = opt.asteria_memory_plan()  # before the first step
    for t in range(1, steps + 1):
        narrow_step(model, opt, t)
    stats = opt.asteria_stats()
    opt.close()
    return plan, stats


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_stats_and_plan_report_half_the_bytes(tier, tmp_path):
    """float32 parameters: the tiered blocks take half their bytes in bfloat16; device state
    (factors, moments) is unchanged."""
    make_opt, _ = OPTIMIZERS["soap"]
    out = {}
    for dt in ("float32", "bfloat16"):
        model = make_model("mlp").float()
        d = tmp_path / dt
        d.mkdir()
        runtime = rt(dt) if tier == "host" else rt(dt, nvme_dir=str(d), host_budget_bytes=0)
        out[dt] = stats_after(make_opt, model, runtime)
    (p32, s32), (p16, s16) = out["float32"], out["bfloat16"]
    block32 = 8 * 8 * 4
    assert s32[f"bytes_{tier}"] == BLOCKS * block32
    assert s16[f"bytes_{tier}"] == BLOCKS * block32 // 2
    assert p32["planned_bytes"][tier] == BLOCKS * block32
    assert p16["planned_bytes"][tier] == BLOCKS * block32 // 2
    assert p16["tier_dtype"] == "bfloat16" and p32["tier_dtype"] == "float32"
    assert s16["bytes_state_device"] == s32["bytes_state_device"]
    assert 0 < s16["bytes_device_ring"] <= s32["bytes_device_ring"]
    assert 0 < s16["bytes_h2d"] < s32["bytes_h2d"]
    if tier == "nvme":
        # the NVMe blocks stream through the host in their stored dtype: for blocks this small,
        # one early-fetch window and one read-back chunk, each all of them (tiers/plan.py)
        assert p16["peak_parts"]["nvme stream buffers"] == 2 * BLOCKS * block32 // 2
        assert p32["peak_parts"]["nvme stream buffers"] == 2 * BLOCKS * block32
    # the refresh results are in the state's dtype whatever the tier keeps
    assert p16["peak_parts"]["refresh results"] == p32["peak_parts"]["refresh results"]


def test_nvme_records_move_half_the_bytes(tmp_path):
    """Blocks of 64 x 64 (records larger than the 4 KiB an O_DIRECT record rounds up to): the
    NVMe tier reads and writes half the bytes."""
    moved = {}
    for dt in ("float32", "bfloat16"):
        w = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
        d = tmp_path / dt
        d.mkdir()
        opt = SOAP([w], precondition_frequency=2,
                   runtime=rt(dt, nvme_dir=str(d), host_budget_bytes=0))
        gen = torch.Generator().manual_seed(1)
        for _ in range(6):
            w.grad = torch.randn(64, 64, generator=gen)
            opt.step()
        st = opt.asteria_stats()
        opt.close()
        assert st["bytes_nvme"] == 2 * 64 * 64 * (4 if dt == "float32" else 2)
        moved[dt] = (st["bytes_nvme_read"], st["bytes_nvme_written"])
    for wide, narrow in zip(moved["float32"], moved["bfloat16"]):
        assert 0 < narrow and abs(narrow / wide - 0.5) < 0.1, moved


def test_narrow_parameters_are_stored_as_they_are():
    """bfloat16 parameters: their blocks are already bfloat16; the setting changes nothing."""
    make_opt, _ = OPTIMIZERS["soap"]
    trajs, stats = [], []
    for dt in ("float32", "bfloat16"):
        model = make_model("mlp").to(BF16)
        opt = make_opt(model.parameters(), runtime=rt(dt))
        traj = []
        for t in range(1, 11):
            narrow_step(model, opt, t)
            traj.append(params_of(model))
        trajs.append(traj)
        stats.append(opt.asteria_stats())
        opt.close()
    assert all(torch.equal(a, b) for x, y in zip(*trajs) for a, b in zip(x, y))
    assert stats[0]["bytes_host"] == stats[1]["bytes_host"] == BLOCKS * 8 * 8 * 2




@pytest.mark.parametrize("name", NAMES)
def test_state_dict_widened_and_resumes_bitwise(name, tmp_path):
    """state_dict() holds tiered blocks in the state's dtype (float64 here), with values that
    are exactly bfloat16 numbers; a fresh bfloat16 optimizer loaded from it (a refresh in
    flight: f = 4, S = 2, split after step 6) continues bitwise like the uninterrupted run, on
    the host and the NVMe tier."""
    make_opt, _ = OPTIMIZERS[name]
    split, steps = 6, 14
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=rt())
    train_mlp(model, opt, range(1, split + 1))
    sd = copy.deepcopy(opt.state_dict())
    params = params_of(model)
    want = train_mlp(model, opt, range(split + 1, steps + 1))
    opt.close()
    key = "b0.Linv0" if name == "shampoo" else "b0.Q0"
    blocks = [st[key] for st in sd["state"].values() if key in st]
    assert len(blocks) == 3
    for q in blocks:
        assert q.dtype == torch.float64 and torch.equal(q, rounded(q))
    assert any(bool((q != 0).any()) for q in blocks)
    for runtime in (rt(), nvme(tmp_path)):
        got = resume("mlp", make_opt, runtime, params, sd, range(split + 1, steps + 1))
        for t, (a, b) in enumerate(zip(got, want), split + 1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {t}"


def test_checkpoints_move_between_tier_dtypes():
    """A float32-tier checkpoint loads into a bfloat16-tier optimizer (narrowed on load: its
    state then shows the rounded basis) and the other way round (kept exactly)."""
    make_opt, _ = OPTIMIZERS["soap"]
    model = make_model("mlp")
    opt = make_opt(model.parameters(), runtime=rt("float32"))
    train_mlp(model, opt, range(1, 7))
    sd = opt.state_dict()
    opt.close()
    wide = [st["b0.Q0"] for st in sd["state"].values() if "b0.Q0" in st]
    assert any(not torch.equal(q, rounded(q)) for q in wide)
    opt16 = make_opt(make_model("mlp").parameters(), runtime=rt())
    opt16.load_state_dict(copy.deepcopy(sd))
    back = opt16.state_dict()
    got = [st["b0.Q0"] for st in back["state"].values() if "b0.Q0" in st]
    assert all(torch.equal(g, rounded(q)) for g, q in zip(got, wide))
    opt16.close()
    opt32 = make_opt(make_model("mlp").parameters(), runtime=rt("float32"))
    opt32.load_state_dict(copy.deepcopy(back))
    again = [st["b0.Q0"] for st in opt32.state_dict()["state"].values() if "b0.Q0" in st]
    assert all(torch.equal(a, g) for a, g in zip(again, got))
    opt32.close()


@pytest.mark.parametrize("value", ["fp8", "bf16", "float64", torch.bfloat16, None, 16, "uint8",
                                   "int2", "INT8", torch.int8])
def test_bad_value_names_key_value_and_allowed(value):
    with pytest.raises(ValueError) as ei:
        RuntimeConfig.from_user({"tier_dtype": value})
    msg = str(ei.value)
    assert "runtime key 'tier_dtype'" in msg and repr(value) in msg
    assert 'allowed: "float32", "bfloat16", "int8", "int4"' in msg


@pytest.mark.parametrize("value", ["int8", "int4"])
def test_quantized_values_are_accepted_once(value):
    """The quantized tiers are values of the one key (tests/python/test_quant_tiers.py tests
    what they do); the plan says what they quantize."""
    assert RuntimeConfig.from_user({"tier_dtype": value}).tier_dtype == value
    opt = SOAP(make_model("mlp").parameters(),
               runtime={"mode": "async", "tier_dtype": value, "placement": {"eigenbases": "host"}})
    plan = opt.asteria_memory_plan()
    lines = [d for d in opt.asteria_plan() if d.startswith(f"tier_dtype {value!r}")]
    opt.close()
    # the mlp's 8 x 8 bases are below the quantized tiers' 64 x 64: kept as they are
    assert plan["tier_dtype"] == value and plan["planned_bytes"]["host"] == BLOCKS * 8 * 8 * 8
    assert lines == [f"tier_dtype {value!r}: no block outside the device is an eigenbasis of "
                     "float32 / float64 of at least 64 x 64, nothing is quantized"]


def test_default_is_float32():
    assert RuntimeConfig().tier_dtype == "float32"
    assert RuntimeConfig.from_user({"tier_dtype": "bfloat16"}).tier_dtype == "bfloat16"
    opt = SOAP(make_model("mlp").parameters(), runtime={"mode": "async"})
    assert opt.asteria_memory_plan()["tier_dtype"] == "float32"
    assert not any("tier_dtype" in line for line in opt.asteria_plan())
    opt.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_memory_plan_before_training(mode):
    """asteria_memory_plan(): the planner's figures from construction on, no step needed."""
    opt = SOAP(make_model("mlp").float().parameters(),
               runtime={"mode": mode, "tier_dtype": "bfloat16",
                        # async: the host tier explicitly (what is narrowed)
                        **({"placement": {"eigenbases": "host"}} if mode == "async" else {})})
    plan = opt.asteria_memory_plan()
    opt.close()
    assert set(plan) >= {"peak_bytes", "peak_total", "peak_parts", "planned_bytes",
                         "ring_bytes", "snapshot_ring_bytes", "tier_dtype", "mode"}
    assert plan["mode"] == mode and plan["peak_total"] == sum(plan["peak_bytes"].values())
    assert plan["peak_total"] >= sum(plan["planned_bytes"].values()) > 0
    eig = BLOCKS * 8 * 8 * 4
    if mode == "sync":  # everything on the device, nothing narrowed
        assert set(plan["planned_bytes"]) == {"device"} and plan["ring_bytes"] == 0
    else:
        assert plan["planned_bytes"]["host"] == eig // 2
        assert plan["ring_bytes"] > 0
