"""Mixture-of-experts weights (param group ``num_experts``, asteria.optim._blocking "Experts"):
one preconditioner per expert, the experts of a layer in one stack.

- the layout: experts of an (E, d_in, d_out) and of a flattened (E * d_in, d_out) weight,
  blocking within each expert, a shard cut where its experts end;
- each method, sync and async (S = 0 and S = 2), float64: bitwise the run of one independent
  optimizer per expert slice (the same package on E separate parameters), and the plain-torch
  restatement (reference.py) run per expert slice to rounding;
- a layer of experts is one REFRESH job per factor size, not one per expert;
- checkpoints (state_dict round trip, in float32 and bfloat16), the host / NVMe tiers and
  tier_dtype, as for any parameter;
- the OLMo-core routing of a real OLMo-core MoE config: its expert weights get num_experts;
- bad input: a group whose parameters do not hold num_experts experts.
"""

from __future__ import annotations

import copy

import pytest
import torch

import asteria
from asteria.optim._blocking import experts_of, make_layout
from models import require_c_extension
from reference import KLShampooRef, ShampooRef, SOAPRef

E, D_IN, D_OUT = 4, 6, 5
METHODS = {
    "soap": (asteria.SOAP, {}),
    "one_sided_soap": (asteria.OneSidedSOAP, {}),
    "shampoo": (asteria.Shampoo, {}),
    "kl_shampoo": (asteria.KLShampoo, {"compute_dtype": torch.float64}),
}
RUNTIMES = {
    "sync": {"mode": "sync"},
    "async_s0": {"mode": "async", "staleness": 0, "workers": 1},
    "async_s2": {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 1},
}


def grads(shape, steps, seed=1, dtype=torch.float64):
    """Gradients of full rank per expert: products of more samples than any width."""
    g = torch.Generator().manual_seed(seed)
    rows = shape[0] * shape[1] if len(shape) == 3 else shape[0]
    out = []
    for _ in range(steps):
        x = torch.randn(rows // E, E, 32, dtype=dtype, generator=g)
        y = torch.randn(E, 32, shape[-1], dtype=dtype, generator=g)
        out.append((x.transpose(0, 1) @ y).reshape(shape) / 32)
    return out


def experts_run(cls, kw, runtime, shape, steps=9, f=2, dtype=torch.float64, **group):
    """Train one expert weight with num_experts; returns (weights per step, optimizer)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
    opt = cls([dict({"params": [w], "num_experts": E}, **group)], precondition_frequency=f,
              runtime=runtime, **kw)
    out = []
    try:
        for g in grads(shape, steps, dtype=dtype):
            w.grad = g.clone()
            opt.step()
            out.append(w.detach().clone())
    finally:
        opt.close()
    return out, opt


def per_expert_run(cls, kw, runtime, shape, steps=9, f=2, **group):
    """The same weights as E separate parameters, one independent optimizer state each."""
    torch.manual_seed(0)
    full = torch.randn(shape, dtype=torch.float64).reshape(E, -1, shape[-1])
    parts = [torch.nn.Parameter(full[e].clone()) for e in range(E)]
    opt = cls([dict({"params": parts}, **group)], precondition_frequency=f, runtime=runtime,
              **kw)
    out = []
    try:
        for g in grads(shape, steps):
            for e, gi in enumerate(g.reshape(E, -1, shape[-1])):
                parts[e].grad = gi.clone()
            opt.step()
            out.append(torch.stack([p.detach().clone() for p in parts]).reshape(shape))
    finally:
        opt.close()
    return out, opt


# ---- the layout -------------------------------------------------------------------------------
def test_layout_cuts_at_experts_and_blocks_within_each():
    lay = make_layout((E, D_IN, D_OUT), experts=experts_of((E, D_IN, D_OUT), E))
    assert lay.view_shape == (E * D_IN, D_OUT) and lay.block_shapes == ((D_IN, D_OUT),) * E
    assert lay.row_blocks
    flat = make_layout((E * D_IN, D_OUT), experts=experts_of((E * D_IN, D_OUT), E))
    assert flat.slices == lay.slices
    # block_size 4 within each expert of 6 rows: rows 0-3, 4-5 of every expert, never across
    blocked = make_layout((E * D_IN, D_OUT), 4, experts=experts_of((E * D_IN, D_OUT), E))
    rows = sorted({(s[0].start, s[0].stop) for s in blocked.slices})
    assert rows == [(e * D_IN + a, e * D_IN + b) for e in range(E) for a, b in ((0, 4), (4, 6))]
    assert not blocked.row_blocks  # D_OUT = 5 is cut at 4: blocks are not whole rows
    # a shard holding rows 5..13 of the flattened weight: expert 0's last row, expert 1
    # whole, expert 2's first row
    shard = make_layout((9, D_OUT), experts=experts_of((E * D_IN, D_OUT), E, (5, 14)))
    assert [(s[0].start, s[0].stop) for s in shard.slices] == [(0, 1), (1, 7), (7, 9)]
    # a plain layout (no experts) of the same weight is one block: the factors span experts
    assert make_layout((E * D_IN, D_OUT)).block_shapes == ((E * D_IN, D_OUT),)


def test_merge_dims_merges_within_an_expert():
    shape = (E, 3, 2, D_OUT)
    lay = make_layout(shape, None, True, 6, experts=experts_of(shape, E))
    # each expert (3, 2, 5) merged as SOAP merges a parameter: (6, 5)
    assert lay.block_shapes == ((6, D_OUT),) * E
    plain = make_layout((3, 2, D_OUT), None, True, 6)
    assert plain.view_shape == (6, D_OUT)


# ---- one independent optimizer per expert ---------------------------------------------------
@pytest.mark.parametrize("shape", [(E, D_IN, D_OUT), (E * D_IN, D_OUT)],
                         ids=["stacked", "flattened"])
@pytest.mark.parametrize("runtime", list(RUNTIMES))
@pytest.mark.parametrize("name", list(METHODS))
def test_bitwise_one_optimizer_per_expert(name, runtime, shape):
    if runtime != "sync":
        require_c_extension()
    cls, kw = METHODS[name]
    got, opt = experts_run(cls, kw, RUNTIMES[runtime], shape)
    want, _ = per_expert_run(cls, kw, RUNTIMES[runtime], shape)
    for t, (a, b) in enumerate(zip(got, want), 1):
        assert torch.equal(a, b), f"step {t}: max diff {float((a - b).abs().max())}"
    assert float((got[-1] - got[0]).abs().max()) > 1e-5  # it trained (KL-Shampoo: lr 1e-4)
    # the state is per expert: E blocks of (D_IN, D_OUT), none spanning experts
    st = opt.state[next(iter(opt.state))]
    assert st["step"] > 0 and not any(k.startswith(f"b{E}.") for k in st)
    moments = [k for k in st if k.endswith((".exp_avg", ".momentum"))]
    assert sorted(moments) == sorted(f"b{e}.{moments[0].split('.')[1]}" for e in range(E))


def test_differs_from_the_plain_tensor():
    """Not vacuous: the same weight as one plain tensor (factors over all experts) trains
    differently."""
    cls, kw = METHODS["soap"]
    got, _ = experts_run(cls, kw, RUNTIMES["sync"], (E * D_IN, D_OUT))
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(E * D_IN, D_OUT, dtype=torch.float64))
    opt = cls([w], precondition_frequency=2, runtime=RUNTIMES["sync"])
    for g in grads((E * D_IN, D_OUT), 9):
        w.grad = g.clone()
        opt.step()
    assert float((w.detach() - got[-1]).abs().max()) > 1e-4
    assert opt.state[w]["b0.GG0"].shape == (E * D_IN, E * D_IN)


REFS = {"soap": (SOAPRef, {}), "shampoo": (ShampooRef, {}), "kl_shampoo": (KLShampooRef, {})}


@pytest.mark.parametrize("name", list(REFS))
def test_matches_the_reference_per_expert_slice(name):
    """The plain-torch restatement, one instance per expert slice, in float64 (sync): to the
    rounding the package's other reference tests allow."""
    cls, kw = METHODS[name]
    ref_cls, ref_kw = REFS[name]
    shape = (E * D_IN, D_OUT)
    got, _ = experts_run(cls, kw, RUNTIMES["sync"], shape, steps=11, f=3)
    torch.manual_seed(0)
    full = torch.randn(shape, dtype=torch.float64).reshape(E, D_IN, D_OUT)
    tensors = [full[e].clone() for e in range(E)]
    refs = [ref_cls([tensors[e]], precondition_frequency=3, **ref_kw) for e in range(E)]
    for t, g in enumerate(grads(shape, 11), 1):
        for e, gi in enumerate(g.reshape(E, D_IN, D_OUT)):
            refs[e].step([gi.clone()])
        want = torch.stack(tensors).reshape(shape)
        torch.testing.assert_close(got[t - 1], want, rtol=1e-7, atol=1e-10,
                                   msg=lambda m: f"step {t}: {m}")


def test_a_layer_of_experts_is_one_job_per_factor_size():
    require_c_extension()
    cls, kw = METHODS["soap"]
    many = 8
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(many * D_IN, D_OUT, dtype=torch.float64))
    opt = cls([{"params": [w], "num_experts": many}], precondition_frequency=2,
              runtime=RUNTIMES["async_s0"])
    try:
        w.grad = torch.randn_like(w)
        opt.step()  # the first-step eigendecompositions: one round
        first = opt.asteria_stats()["refreshes_submitted"]
        for _ in range(2):
            w.grad = torch.randn_like(w)
            opt.step()  # step count 2 % 2 == 0: a REFRESH round
        rounds = opt.asteria_stats()["refreshes_submitted"]
    finally:
        opt.close()
    # two factor sizes (D_IN, D_OUT): one batched job each, whatever the number of experts
    assert first == 2 and rounds - first == 2


# ---- checkpoints and tiers --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("runtime", ["sync", "async_s2"])
def test_state_dict_round_trip_resumes_bitwise(runtime, dtype):
    if runtime != "sync":
        require_c_extension()
    shape = (E, D_IN, D_OUT)
    steps, cut = 10, 5
    gs = grads(shape, steps, dtype=dtype)

    def make(w):
        return asteria.SOAP([{"params": [w], "num_experts": E}], precondition_frequency=2,
                            runtime=RUNTIMES[runtime])

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
    w2 = torch.nn.Parameter(w.detach().clone())
    opt = make(w)
    try:
        for g in gs[:cut]:
            w.grad = g.clone()
            opt.step()
        sd = copy.deepcopy(opt.state_dict())
        w2.data.copy_(w.detach())
        for g in gs[cut:]:
            w.grad = g.clone()
            opt.step()
    finally:
        opt.close()
    opt2 = make(w2)
    try:
        opt2.load_state_dict(sd)
        for g in gs[cut:]:
            w2.grad = g.clone()
            opt2.step()
    finally:
        opt2.close()
    assert torch.equal(w.detach(), w2.detach())
    assert all(sd["state"][0][f"b{e}.exp_avg"].shape == (D_IN, D_OUT) for e in range(E))


def test_dcp_flattened_checkpoint_resumes_bitwise(tmp_path):
    """torch.distributed.checkpoint's flattened form, through files, as OLMo-core resumes:
    saved with a refresh in flight, loaded into a fresh optimizer, the run goes on bitwise."""
    require_c_extension()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    flat_opts = StateDictOptions(flatten_optimizer_state_dict=True)
    shape, steps, cut = (E * D_IN, D_OUT), 10, 5
    gs = grads(shape, steps)

    def make():
        torch.manual_seed(0)
        model = torch.nn.Linear(D_OUT, E * D_IN, bias=False).double()
        opt = asteria.SOAP([{"params": [model.weight], "num_experts": E}],
                           precondition_frequency=2, runtime=RUNTIMES["async_s2"])
        return model, opt

    model, opt = make()
    try:
        for t, g in enumerate(gs):
            if t == cut:
                flat = get_optimizer_state_dict(model, opt, options=flat_opts)
                assert any(k.endswith("pending.install_in") and v > 0 for k, v in flat.items())
                assert sum(k.endswith(".exp_avg") for k in flat) == E
                dcp.save({"optim": flat}, storage_writer=FileSystemWriter(str(tmp_path)))
                weights = model.weight.detach().clone()
            model.weight.grad = g.clone()
            opt.step()
    finally:
        opt.close()
    fresh, opt2 = make()
    try:
        with torch.no_grad():
            fresh.weight.copy_(weights)
        template = {"optim": get_optimizer_state_dict(fresh, opt2, options=flat_opts)}
        dcp.load(template, storage_reader=FileSystemReader(str(tmp_path)))
        set_optimizer_state_dict(fresh, opt2, template["optim"], options=flat_opts)
        for g in gs[cut:]:
            fresh.weight.grad = g.clone()
            opt2.step()
    finally:
        opt2.close()
    assert torch.equal(fresh.weight.detach(), model.weight.detach())


@pytest.mark.parametrize("placement", [
    {"placement": {"roots": "host", "eigenbases": "host"}},
    {"nvme": True},
    {"placement": {"roots": "host", "eigenbases": "host"}, "tier_dtype": "bfloat16"},
], ids=["host", "nvme", "host_bf16"])
def test_tiers_are_bitwise_the_device_run(placement, tmp_path):
    require_c_extension()
    runtime = dict(RUNTIMES["async_s2"])
    placement = dict(placement)
    nvme = placement.pop("nvme", False)
    if nvme:
        runtime.update(nvme_dir=str(tmp_path), host_budget_bytes=1)
    runtime.update(placement)
    cls, kw = METHODS["soap"]
    shape = (E * D_IN, D_OUT)
    got, opt = experts_run(cls, kw, runtime, shape)
    if runtime.get("tier_dtype") == "bfloat16":
        # the bases as the tier stores them: the device run with the same narrowing is not
        # available here, so the run must differ from the device run only by that rounding
        want, _ = experts_run(cls, kw, RUNTIMES["async_s2"], shape)
        torch.testing.assert_close(got[-1], want[-1], rtol=0.05, atol=0.05)
        assert not torch.equal(got[-1], want[-1])
    else:
        want, _ = experts_run(cls, kw, RUNTIMES["async_s2"], shape)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    plan = opt.asteria_memory_plan()
    tier = "nvme" if nvme else "host"
    assert plan["planned_bytes"].get(tier, 0) > 0, plan["planned_bytes"]


# ---- OLMo-core ----------------------------------------------------------------------------------
def test_olmo_core_moe_config_routes_expert_weights():
    pytest.importorskip("olmo_core")
    from olmo_core.nn.transformer import TransformerConfig

    from asteria.olmo import AsteriaSOAPConfig

    cfg = TransformerConfig.llama_like_moe(d_model=32, vocab_size=64, n_layers=2, n_heads=2,
                                           num_experts=4, top_k=2, expert_hidden_size=16)
    model = cfg.build(init_device="cpu")
    names = {p: n for n, p in model.named_parameters()}
    optim = AsteriaSOAPConfig(precondition_frequency=2, runtime={"mode": "sync"})
    groups = optim.build_groups(model)
    expert = [g for g in groups if g.get("num_experts")]
    assert len(expert) == 1 and expert[0]["num_experts"] == 4
    assert sorted(names[p].rsplit(".", 1)[1] for p in expert[0]["params"]) == [
        "w1", "w1", "w2", "w2", "w3", "w3"]
    assert all(".experts." in names[p] for p in expert[0]["params"])
    plain = [g for g in groups if g["algorithm"] == "soap" and not g.get("num_experts")]
    assert all(".experts." not in names[p] for g in plain for p in g["params"])
    # built and stepped (OLMo-core's MoE forward needs a GPU kernel: gradients are set here)
    opt = optim.build(model)
    try:
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.randn_like(p) * 1e-2
            opt.step()
        w1 = model.blocks["0"].feed_forward_moe.experts.mlp.w1  # (4 * 32, 16)
        st = opt.second_order.state[w1]
        assert [st[f"b{e}.GG0"].shape for e in range(4)] == [(32, 32)] * 4
        assert "b4.GG0" not in st
    finally:
        opt.close()


# ---- bad input ----------------------------------------------------------------------------------
def test_parameters_that_do_not_hold_the_experts_are_refused():
    w = torch.nn.Parameter(torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0: num_experts=2: a "
                                         r"parameter of shape \(7, 3\) does not hold 2 experts"):
        asteria.SOAP([{"params": [w], "num_experts": 2}], runtime={"mode": "sync"})
    with pytest.raises(ValueError, match="invalid num_experts: 0; allowed: None or an integer"):
        asteria.SOAP([{"params": [w], "num_experts": 0}], runtime={"mode": "sync"})
    bias = torch.nn.Parameter(torch.zeros(7))  # AdamW path: no experts needed
    asteria.SOAP([{"params": [bias], "num_experts": 2}], runtime={"mode": "sync"}).close()
