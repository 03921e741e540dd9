"""Placement by life cycle (asteria.tiers.plan, asteria.tiers.residency) on the CPU path.

 - the planner's decisions: factors and moments on the device, roots / eigenbases in host
   memory in async mode (a CPU parameter's stay in optimizer.state under "auto" unless a
   budget or nvme_dir asks for spilling: its device is host memory already), everything on
   the device in sync mode; logged once at INFO;
 - impossible explicit placements and budgets raise ValueError naming the key, why, and what
   is allowed;
 - asteria_stats() carries the contract keys in both modes, with the bytes per tier;
 - tiered async runs are BITWISE equal to the all-device async path, for all three optimizers,
   also when the device budget spills part of the roots from the device to host, and when a
   ring smaller than the state makes the step stream chunks and the ring wrap around;
 - checkpoints of the tiered path are the all-device path's (same keys, same tensors) and
   resume on the same trajectory;
 - a CUDA parameter's roots / eigenbases (the planner alone, capabilities given): where
   libasteria cannot reach the device (built without nvcc, or its runtime finds no device: no
   driver, or an older one) they stay on the device, and an explicit host tier or a device
   budget that would spill them is refused; without coherent managed memory they go to
   host_pinned; under any capabilities, placement and budget a block reaches a CUDA step only
   through a device ring or a coherent UVM view, never as a host-path (CPU) view.
"""

import logging

import pytest
import torch

from asteria import SOAP
from asteria.optim.optimizer import STATS_KEYS
from models import deterministic_runtime as rt
from models import (loss_and_grad, make_model, optimizer_makers, params_of,
                    require_c_extension, run, train_hooked)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

MAKERS = optimizer_makers(4)
NAMES = list(MAKERS)
ALL_DEVICE = {"roots": "device", "eigenbases": "device"}
HOST = {"roots": "host", "eigenbases": "host"}  # the residency + staging ring on CPU
STEPS = 12


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for t, (x, y) in enumerate(zip(a, b), 1):
        for i, (u, v) in enumerate(zip(x, y)):
            assert torch.equal(u, v), f"step {t} param {i} differs"


def test_auto_plan_async_and_logged_once(caplog):
    # a host budget asks for spilling, so "auto" keeps a CPU parameter's eigenbases in the
    # host tier (without one they stay in optimizer.state: test_auto_keeps_cpu_bases_in_place)
    model = make_model("mlp")
    with caplog.at_level(logging.INFO, logger="asteria"):
        opt = SOAP(model.parameters(), runtime=rt(host_budget_bytes=1 << 30))
    try:
        plan = opt.asteria_plan()
        assert any("factors" in d and "device" in d for d in plan)
        assert any(d.startswith("eigenbases") and "host memory (host)" in d for d in plan)
        assert any("staging ring" in d for d in plan)
        logged = [r.getMessage() for r in caplog.records if r.name == "asteria"]
        assert logged == [f"asteria plan: {d}" for d in plan]  # each decision once
        w = model.layers[0].weight
        assert opt.placement.plan.tier((opt.run.pindex[w], "b0.Q0")) == "host"
        assert opt.placement.plan.tier((opt.run.pindex[w], "b0.GG0")) == "device"
    finally:
        opt.close()


AUTO_KINDS = {"soap": ("eigenbases", "b0.Q0"), "shampoo": ("roots", "b0.Linv0")}
CPU_BLOCKS, CPU_BYTES = 6, 6 * 8 * 8 * 8  # the mlp: 3 weights x 2 sides, 8x8 float64


def train_open(name, runtime, steps=STEPS):
    """Train the mlp; return (params after every step, the optimizer, still open)."""
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), runtime)
    traj = []
    for t in range(1, steps + 1):
        loss_and_grad(model, "mlp", t)
        opt.step()
        traj.append(params_of(model))
    return traj, opt


@pytest.mark.parametrize("name", list(AUTO_KINDS))
def test_auto_keeps_cpu_bases_in_place(name, caplog):
    """Rule 2 on CPU: with placement "auto" and no budget / nvme_dir a CPU parameter's roots /
    eigenbases stay in optimizer.state: no residency, no staging ring, no host bytes for them,
    and the same trajectory as the explicit all-device placement."""
    kind, key = AUTO_KINDS[name]
    with caplog.at_level(logging.INFO, logger="asteria"):
        opt = MAKERS[name](make_model("mlp").parameters(), rt())
    try:
        plan = opt.asteria_plan()
        logged = [r.getMessage() for r in caplog.records if r.name == "asteria"]
        assert logged == [f"asteria plan: {d}" for d in plan]  # each decision once
    finally:
        opt.close()
    dev, opt_d = run("mlp", lambda p: MAKERS[name](p, rt(placement=ALL_DEVICE)), STEPS)
    auto, opt = train_open(name, rt())
    try:
        assert_bitwise(auto, dev)
        assert not opt.placement.off_device
        assert set(opt.placement.plan.block_tier.values()) == {"device"} and not opt.placement.plan.tiered
        assert opt.placement.plan.tiers[kind] == "auto"
        plan = opt.asteria_plan()
        assert f"{kind} ({CPU_BYTES / 1024:.1f} KiB, {CPU_BLOCKS} blocks) on the parameters' " \
               "device (CPU: host memory already; no staging)" in plan
        assert not any("staging ring" in d or "in host memory" in d for d in plan)
        mp, md = opt.asteria_memory_plan(), opt_d.asteria_memory_plan()
        assert mp["ring_bytes"] == 0 and mp["planned_bytes"].get("host", 0) == 0
        assert mp["planned_bytes"] == md["planned_bytes"]
        assert mp["planned_bytes"]["device"] >= CPU_BYTES
        assert mp["peak_total"] == sum(mp["peak_parts"].values()) == \
            sum(mp["peak_bytes"].values())
        assert mp["peak_parts"]["state"] == sum(mp["planned_bytes"].values())
        assert mp["peak_bytes"] == md["peak_bytes"] and mp["peak_parts"] == md["peak_parts"]
        held = [dict.__getitem__(st, key) for st in opt.state.values() if key in dict.keys(st)]
        assert len(held) == 3 and all(torch.is_tensor(v) and v.shape == (8, 8) for v in held)
        st = opt.asteria_stats()
        assert st["bytes_host"] == 0 and st["bytes_device_ring"] == 0
        assert st.get("prefetches", 0) == 0 and st.get("bytes_h2d_ring", 0) == 0
        assert st["installs"] > 0
    finally:
        opt.close()


@pytest.mark.parametrize("name", list(AUTO_KINDS))
@pytest.mark.parametrize("ask", ["host_budget", "nvme_dir", "device_budget", "explicit"])
def test_cpu_bases_still_tier_when_asked(name, ask, tmp_path):
    """A budget, nvme_dir or an explicit "host" keeps the host tier on CPU: the blocks live in
    the residency and reach the step through the staging ring, on the all-device
    trajectory."""
    kind, key = AUTO_KINDS[name]
    kw = {"host_budget": dict(host_budget_bytes=1 << 30),
          "nvme_dir": dict(nvme_dir=str(tmp_path)),
          "device_budget": dict(device_budget_bytes=1 << 30),
          "explicit": dict(placement={kind: "host"})}[ask]
    dev, _ = run("mlp", lambda p: MAKERS[name](p, rt(placement=ALL_DEVICE)), STEPS)
    host, opt = train_open(name, rt(**kw))
    try:
        assert_bitwise(host, dev)
        assert opt.placement.off_device and opt.placement.plan.tiered
        assert set(opt.placement.plan.block_tier.values()) == {"host"}
        plan = opt.asteria_plan()
        assert any("staging ring" in d for d in plan)
        assert not any("no staging" in d for d in plan)
        mp = opt.asteria_memory_plan()
        assert mp["planned_bytes"]["host"] == CPU_BYTES and mp["ring_bytes"] > 0
        assert mp["peak_total"] == sum(mp["peak_parts"].values())
        assert sum(opt.placement._residency.owns((i, key)) for i in opt.run.pindex.values()) == 3
        assert not any(key in dict.keys(st) for st in opt.state.values())
        st = opt.asteria_stats()
        assert st["bytes_host"] == CPU_BYTES and st["prefetches"] > 0
        assert st["bytes_h2d_ring"] > 0
    finally:
        opt.close()


def test_auto_rule_is_per_parameter_device():
    """make_plan alone, a CUDA and a CPU parameter side by side (no device needed: the
    capabilities are given): "auto" stages the CUDA parameter's bases from pinned host memory
    and keeps the CPU parameter's in place; a host budget sends both to host memory."""
    from asteria.config import RuntimeConfig
    from asteria.tiers.plan import Capabilities, StateEntry, make_plan

    caps = Capabilities(cuda=True, pinned=True, pinned_reason="", uvm=False, uvm_reason="no")
    f64 = torch.float64
    entries = [StateEntry(0, "b0.GG0", "factors", 512, torch.device("cuda", 0), f64),
               StateEntry(0, "b0.Q0", "eigenbases", 512, torch.device("cuda", 0), f64),
               StateEntry(1, "b0.GG0", "factors", 512, torch.device("cpu"), f64),
               StateEntry(1, "b0.Q0", "eigenbases", 512, torch.device("cpu"), f64)]
    plan = make_plan(RuntimeConfig.from_user({"mode": "async"}), entries, caps)
    assert plan.block_tier == {(0, "b0.Q0"): "host_pinned", (1, "b0.Q0"): "device"}
    assert "eigenbases (512 B, 1 blocks) on the parameters' device (CPU: host memory " \
           "already; no staging)" in plan.decisions
    assert any(d.startswith("eigenbases (512 B, 1 blocks) in host memory (host_pinned)")
               for d in plan.decisions)
    assert plan.planned_bytes == {"device": 3 * 512 + plan.ring_bytes, "host_pinned": 512}
    assert sum(plan.peak_parts.values()) == sum(plan.peak_bytes.values())
    plan = make_plan(RuntimeConfig.from_user({"mode": "async", "host_budget_bytes": 1 << 20}),
                     entries, caps)
    assert plan.block_tier == {(0, "b0.Q0"): "host_pinned", (1, "b0.Q0"): "host"}
    assert any("CPU parameters' too: host_budget_bytes set" in d for d in plan.decisions)


def test_sync_plan_is_all_device_and_stats_keys():
    _, opt = run("mlp", lambda p: SOAP(p, precondition_frequency=4, runtime={"mode": "sync"}),
                 6)
    assert opt.asteria_plan()[0].startswith("mode 'sync' (native reference)")
    st = opt.asteria_stats()
    assert set(STATS_KEYS) <= set(st)
    assert st["bytes_device"] > 0
    assert st["bytes_host"] == st["bytes_nvme"] == st["bytes_h2d"] == st["bytes_d2h"] == 0


def test_async_stats_keys_and_tier_bytes():
    _, opt = run("mlp", lambda p: MAKERS["soap"](p, rt(placement=HOST)), 8)
    st = opt.asteria_stats()
    assert set(STATS_KEYS) <= set(st)
    q_bytes = 6 * 8 * 8 * 8  # 3 weights x 2 eigenbases, 8x8 float64
    assert st["bytes_host"] == q_bytes and st["bytes_nvme"] == 0
    assert st["bytes_device"] == st["bytes_state_device"] + st["bytes_device_ring"]
    assert st["bytes_h2d"] > 0 and st["bytes_d2h"] > 0  # ring prefetches, factor snapshots
    assert st["jobs_done"] == st["jobs_submitted"] > 0 and st["jobs_queued"] == 0
    assert st["jobs_running"] == 0 and st["barrier_wait_ns"] >= 0  # waits only if it blocked
    assert st["snapshots_shadow"] > 0 and st["snapshots_fallback"] == 0


@pytest.mark.parametrize("placement, match", [
    ({"factors": "host"}, "factors='host' is not possible: factors are updated every step"),
    ({"moments": "nvme"}, "moments='nvme' is not possible"),
    ({"roots": "host_pinned"}, "roots='host_pinned' is not possible: page-locked memory needs "
                               "a CUDA device"),
    ({"eigenbases": "uvm"}, "eigenbases='uvm' is not possible: a UVM view needs coherent host "
                            "access"),
    ({"roots": "nvme"}, "'nvme_dir' is not set"),
])
def test_impossible_placement_names_key_reason_allowed(placement, match):
    with pytest.raises(ValueError, match=match) as ei:
        SOAP(make_model("mlp").parameters(), runtime=rt(placement=placement))
    assert "runtime key 'placement'" in str(ei.value) and "allowed for" in str(ei.value)


def test_sync_refuses_tiers_and_budgets_that_cannot_hold():
    with pytest.raises(ValueError, match="mode 'sync' is the native reference"):
        SOAP(make_model("mlp").parameters(),
             runtime={"mode": "sync", "placement": {"eigenbases": "host"}})
    with pytest.raises(ValueError, match="'device_budget_bytes': got 100; factors and moments "
                                         "need"):
        SOAP(make_model("mlp").parameters(), runtime=rt(device_budget_bytes=100))
    with pytest.raises(ValueError, match="'host_budget_bytes': got 10; .*no 'nvme_dir'"):
        SOAP(make_model("mlp").parameters(), runtime=rt(host_budget_bytes=10))


def budgets(name):
    """(device bytes of factors + moments, the ring's minimum) of the mlp for an optimizer."""
    opt = MAKERS[name](make_model("mlp").parameters(), rt(placement=HOST))
    plan = opt.placement.plan
    opt.close()
    return plan.planned_bytes["device"] - plan.ring_bytes, plan.ring_min


@pytest.mark.parametrize("name", NAMES)
def test_tiered_is_bitwise_the_all_device_path(name):
    dev, opt_d = run("mlp", lambda p: MAKERS[name](p, rt(placement=ALL_DEVICE)), STEPS)
    host, opt_h = run("mlp", lambda p: MAKERS[name](p, rt(placement=HOST)), STEPS)
    assert_bitwise(host, dev)
    sd, sh = opt_d.asteria_stats(), opt_h.asteria_stats()
    # all-device: refresh results are copied to the device; tiered: they stay in host memory
    # and the step's roots come through the ring
    assert sd["bytes_host"] == 0 and sd["bytes_device_ring"] == 0
    assert sd["bytes_h2d"] == sd["bytes_h2d_results"] > 0
    assert sh["bytes_host"] > 0 and sh["prefetches"] > 0 and sh["bytes_h2d_results"] == 0
    assert sh["bytes_h2d"] == sh["bytes_h2d_ring"] > 0
    assert sh["installs"] == sd["installs"] > 0


def test_device_budget_spills_roots_to_host_first():
    fixed, ring_min = budgets("shampoo")
    root = 8 * 8 * 8
    budget = fixed + 2 * root + ring_min  # room for two roots besides the ring
    dev, _ = run("mlp", lambda p: MAKERS["shampoo"](p, rt(placement=ALL_DEVICE)), STEPS)
    opt_box = []

    def make(p):
        opt_box.append(MAKERS["shampoo"](p, rt(placement=ALL_DEVICE,
                                                 device_budget_bytes=budget)))
        return opt_box[0]

    spilled, opt = run("mlp", make, STEPS)
    assert_bitwise(spilled, dev)
    tiers = sorted(opt.placement.plan.block_tier.values())
    assert tiers == ["device"] * 2 + ["host"] * 4
    assert any("spilled from device to host memory" in d for d in opt.asteria_plan())
    st = opt.asteria_stats()
    assert st["bytes_host"] == 4 * root and st["bytes_device"] <= budget


@pytest.mark.parametrize("name", ["soap", "kl_shampoo"])
def test_small_ring_streams_chunks_and_wraps_around(name):
    fixed, ring_min = budgets(name)
    budget = fixed + ring_min + ring_min // 2  # one and a half blocks of eigenbases
    dev, _ = run("mlp", lambda p: MAKERS[name](p, rt(placement=ALL_DEVICE)), STEPS)
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), rt(device_budget_bytes=budget))
    # attached: backward prefetches in reverse order, as the step consumes
    traj, st, _ = train_hooked(model, opt, STEPS)
    assert_bitwise(traj, dev)
    assert st["ring_capacity"] == ring_min + ring_min // 2 < 6 * 512
    assert st["ring_wraps"] > 0 and st["ring_busy"] > 0
    # the step runs the last parameters first, so it finds what backward staged and never
    # has to evict a block staged ahead
    assert st["ring_evictions"] == 0 and st["prefetch_hits"] > 0
    assert st["ring_high_water"] <= st["ring_capacity"]
    assert st["bytes_device"] <= budget


def test_borrow_restages_a_chunk_that_fits_only_from_an_empty_ring():
    """The ring is contiguous and FIFO: a chunk whose bytes fit the ring can still find no room
    behind one of its own blocks staged ahead in the middle. borrow then stages the chunk
    again from an empty ring (what a tight device_budget_bytes used to turn into an error)."""
    import types

    from asteria.tiers.plan import Plan
    from asteria.tiers.residency import Residency

    keys = {(0, "x"): (16, 16), (1, "y"): (16, 16), (2, "z"): (16, 32)}  # 1, 1 and 2 KiB
    plan = Plan("async", {}, {k: "host" for k in keys}, ring_bytes=3072, ring_min=3072,
                snapshot_ring_bytes=4096)
    res = Residency(plan, types.SimpleNamespace(nvme_dir=None, tier_dtype="float32"))
    try:
        values = {k: torch.randn(shape) for k, shape in keys.items()}
        for k, v in values.items():
            res.write(k, v)
        assert res.prefetch([(0, "x"), (1, "y")]) == 2  # x at 0, y at 1 KiB
        got = res.borrow([(1, "y"), (2, "z")])  # z needs 2 KiB after y: only from empty
        assert torch.equal(got[0], values[(1, "y")]) and torch.equal(got[1], values[(2, "z")])
        res.give_back([(1, "y"), (2, "z")])
        st = res.stats()
        assert st["ring_evictions"] >= 2 and st["ring_high_water"] <= 3072
        with pytest.raises(RuntimeError, match="cannot hold"):  # larger than the ring
            res.borrow(list(keys))
    finally:
        res.close()


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_of_tiered_state_is_the_all_device_one(name):
    def train(placement, steps, model=None, sd=None):
        model = model or make_model("mlp")
        opt = MAKERS[name](model.parameters(), rt(placement=placement))
        if sd is not None:
            opt.load_state_dict(sd)
        for t in range(steps[0], steps[1] + 1):
            loss_and_grad(model, "mlp", t)
            opt.step()
        return model, opt

    m_d, o_d = train(ALL_DEVICE, (1, 7))
    m_h, o_h = train(HOST, (1, 7))
    sd_d, sd_h = o_d.state_dict(), o_h.state_dict()
    assert sd_d["state"].keys() == sd_h["state"].keys()
    for i in sd_d["state"]:
        a, b = sd_d["state"][i], sd_h["state"][i]
        assert a.keys() == b.keys(), i
        for k in a:
            same = torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
            assert same, (i, k)
    assert all(type(st) is dict for st in sd_h["state"].values())  # plain, picklable
    # resume the tiered run from its checkpoint in a fresh tiered optimizer
    o_d.close()
    twin = make_model("mlp")
    twin.load_state_dict(m_h.state_dict())
    _, o_r = train(HOST, (8, STEPS), model=twin, sd=sd_h)
    for t in range(8, STEPS + 1):
        loss_and_grad(m_h, "mlp", t)
        o_h.step()
    for a, b in zip(params_of(twin), params_of(m_h)):
        assert torch.equal(a, b)
    o_h.close()
    o_r.close()
    # after close the state stays inspectable, as plain tensors
    st = o_r.state[twin.layers[0].weight]
    key = "b0.Linv0" if name == "shampoo" else "b0.Q0"
    assert type(st) is dict and torch.is_tensor(st[key]) and st[key].shape == (8, 8)


@pytest.mark.parametrize("name", list(AUTO_KINDS))
def test_cpu_bases_tier_when_narrowing_is_asked(name):
    """tier_dtype "bfloat16" narrows blocks outside the device only: asking for it puts a CPU
    parameter's blocks in the residency (narrowed) instead of leaving it without effect."""
    kind, key = AUTO_KINDS[name]
    _, opt = train_open(name, rt(tier_dtype="bfloat16"))
    try:
        assert opt.placement.off_device and set(opt.placement.plan.block_tier.values()) == {"host"}
        plan = opt.asteria_plan()
        assert any("tier_dtype 'bfloat16' set" in d for d in plan), plan
        assert 0 < opt.asteria_memory_plan()["planned_bytes"]["host"] < CPU_BYTES
    finally:
        opt.close()


# ---- CUDA parameters when a piece of CUDA is missing (the planner alone, no device needed) ----

NO_NVCC = "libasteria was built without CUDA (ASTERIA_WITH_CUDA=OFF)"
NO_DRIVER = ("tier host_pinned: no CUDA device (cudaGetDeviceCount reports none or no driver "
             "is loaded)")
NO_MANAGED = "tier uvm: device 0 has no coherent host access to managed memory"
# what Capabilities.probe finds: libasteria without CUDA (no nvcc at its build), libasteria's
# runtime finding no device (no driver, or one older than that runtime), a device without
# coherent managed memory, and everything there
CAPS = {
    "no-nvcc": dict(cuda=False, pinned=False, pinned_reason=NO_NVCC, uvm=False,
                    uvm_reason=NO_NVCC),
    "no-driver": dict(cuda=True, pinned=False, pinned_reason=NO_DRIVER, uvm=False,
                      uvm_reason=NO_DRIVER),
    "no-managed": dict(cuda=True, pinned=True, pinned_reason="", uvm=False,
                       uvm_reason=NO_MANAGED),
    "all": dict(cuda=True, pinned=True, pinned_reason="", uvm=True, uvm_reason=""),
}


def cuda_entries(n_params=3, dev=None):
    f32 = torch.float32
    dev = dev or torch.device("cuda", 0)
    out = []
    for i in range(n_params):
        out += [StateEntry(i, "b0.GG0", "factors", 4096, dev, f32),
                StateEntry(i, "b0.exp_avg", "moments", 1024, dev, f32),
                StateEntry(i, "b0.Q0", "eigenbases", 4096, dev, f32),
                StateEntry(i, "b0.Q1", "eigenbases", 4096, dev, f32)]
    return out


from asteria.config import RuntimeConfig  # noqa: E402
from asteria.tiers.plan import Capabilities, StateEntry, make_plan  # noqa: E402


def plan_for(caps, **runtime):
    return make_plan(RuntimeConfig.from_user({"mode": "async", **runtime}), cuda_entries(),
                     Capabilities(**CAPS[caps]) if isinstance(caps, str) else caps)


@pytest.mark.parametrize("caps,tier", [("no-nvcc", "device"), ("no-driver", "device"),
                                       ("no-managed", "host_pinned"), ("all", "uvm")])
def test_auto_tier_of_cuda_bases_follows_what_libasteria_reaches(caps, tier):
    """Without libasteria's CUDA path (built without nvcc, or its runtime finds no device)
    nothing can stage a host block into device memory: a CUDA parameter's bases stay on its
    device, and the plan says why. With it, pinned memory and the ring, or UVM where the
    device reads managed memory coherently."""
    plan = plan_for(caps)
    assert set(plan.block_tier.values()) == {tier}
    if tier == "device":
        assert plan.ring_bytes == 0 and not plan.tiered
        why = CAPS[caps]["pinned_reason"]
        line = next(d for d in plan.decisions if d.startswith("eigenbases"))
        assert "on the parameters' device" in line and "cannot stage" in line and why in line
    elif tier == "host_pinned":
        assert plan.ring_bytes > 0


@pytest.mark.parametrize("caps", ["no-nvcc", "no-driver"])
@pytest.mark.parametrize("tier", ["host", "host_pinned", "nvme"])
def test_explicit_host_tier_for_cuda_bases_without_libasteria_cuda_raises(caps, tier, tmp_path):
    with pytest.raises(ValueError) as ei:
        plan_for(caps, placement={"eigenbases": tier}, nvme_dir=str(tmp_path))
    msg = str(ei.value)
    assert f"eigenbases={tier!r} is not possible" in msg
    assert "allowed for eigenbases: 'device'" in msg
    assert CAPS[caps]["pinned_reason"] in msg


@pytest.mark.parametrize("caps", ["no-nvcc", "no-driver"])
def test_device_budget_cannot_spill_cuda_bases_without_libasteria_cuda(caps):
    everything = sum(e.nbytes for e in cuda_entries())
    with pytest.raises(ValueError) as ei:
        plan_for(caps, placement={"eigenbases": "device"}, device_budget_bytes=everything // 2)
    msg = str(ei.value)
    assert "runtime key 'device_budget_bytes'" in msg and "cannot be spilled" in msg
    assert CAPS[caps]["pinned_reason"] in msg


def test_probe_on_this_machine_keeps_cuda_bases_on_the_device():
    """The planner's own probe (no capabilities given), for parameters on a CUDA device of a
    machine where libasteria's runtime finds none (this one, without a GPU; a GPU machine whose
    driver is older than the runtime libasteria was built with): the bases stay on the device,
    never in a host-path ring that would hand a CPU view to a CUDA step."""
    from asteria import _C

    caps = Capabilities.probe(True)
    if caps.pinned:
        pytest.skip("libasteria reaches a CUDA device here")
    assert not caps.uvm and caps.pinned_reason
    if not _C.HAVE_CUDA:
        assert "without CUDA" in caps.pinned_reason
    plan = make_plan(RuntimeConfig.from_user({"mode": "async"}), cuda_entries())
    assert set(plan.block_tier.values()) == {"device"} and plan.ring_bytes == 0


@pytest.mark.parametrize("caps", list(CAPS))
@pytest.mark.parametrize("placement", [None, "host", "host_pinned", "uvm", "nvme", "device"])
@pytest.mark.parametrize("budget", [None, "half"])
def test_no_cuda_step_is_handed_a_host_path_view(caps, placement, budget, tmp_path):
    """Every plan for CUDA parameters, under any capabilities, placement and budget: a block
    staged through the ring (host, host_pinned, nvme) exists only where libasteria's ring is
    device memory (it reaches the device: caps.pinned), a uvm block only where managed memory
    is coherent; any other combination either keeps the block on the device or is refused
    (ValueError) before a step runs."""
    runtime = {"nvme_dir": str(tmp_path)}
    if placement is not None:
        runtime["placement"] = {"eigenbases": placement}
    if budget:
        runtime["device_budget_bytes"] = sum(e.nbytes for e in cuda_entries()) // 2 + 8192
    try:
        plan = plan_for(caps, **runtime)
    except ValueError:
        return
    c = CAPS[caps]
    for key, tier in plan.block_tier.items():
        if tier in ("host", "host_pinned", "nvme"):
            assert c["pinned"], (key, tier, caps)
            assert plan.ring_bytes > 0
        elif tier == "uvm":
            assert c["uvm"], (key, tier, caps)
        else:
            assert tier == "device", (key, tier)
