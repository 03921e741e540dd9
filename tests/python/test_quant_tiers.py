"""Eigenbases block-quantized on the host and NVMe tiers (runtime ``tier_dtype`` "int8", "int4").

 - Each eigenbasis method (SOAP, one-sided SOAP, KL-Shampoo; async, deterministic S = 2, on the C
   pool) on each tier (host; NVMe with part of the blocks on the host) equals the plain-torch
   restatement (reference.py) in which every basis of at least 64 x 64 is, where it is stored
   (first-step eigenbasis, each install), quantized by this file's own restatement of the
   format (asteria/quant.h: one float32 scale absmax / qmax per 64 values, codes rounded half
   to even), dequantized and rectified by the Bjorck steps of its type (int8 1, int4 3); the
   step, the next refresh and SOAP's re-expression of m use that basis. Smaller bases, factors,
   moments and eigenvalues are untouched. Tolerances are test_tier_dtype.py's (models.
   lockstep_tol): the pool's LAPACK differs from torch's in the last bits of float64, which
   moves a float32 code only where a value sits within that much of a rounding boundary.
 - The format's error and the rectification, where the tiers use them: a basis written to a
   quantized tier comes back (the state proxy, a checkpoint) within half a step of each value
   (s / 2, s = absmax / qmax of its block, plus the roundings quant.h names); the basis the step
   uses is the dequantized one after k Bjorck steps, each of which takes ||V^T V - I||_F from
   e to at most (3/4 + e/4) e^2 (quant.h), and no further than that.
 - The bytes: the tiers, the plan and the stats count each quantized basis at the layout's size
   (codes, padding to 4, the float32 scales), derived here; the NVMe records carry the format
   (header byte 40, bytes 44-47); a damaged record and one of another format are refused naming
   the file, and the step is not applied.
 - Checkpoints: state_dict() holds a quantized basis dequantized (not rectified); quantizing
   that again gives the same bytes (the scale round trip, checked over every float32 mantissa),
   so a fresh optimizer loaded mid-run (a refresh in flight) continues bitwise like the
   uninterrupted run, on the host and the NVMe tier.
 - Shampoo refuses the quantized values (its inverse roots are not orthogonal), naming the key,
   the method and what is allowed.
"""

import copy
import math

import pytest
import torch
from torch import nn

from asteria import RuntimeConfig, _C
from asteria.optim import KLShampoo, OneSidedSOAP, Shampoo, SOAP
from asteria.tiers.residency import TieredStateError
from models import (DTYPE, F64, assert_lockstep, lockstep, lockstep_tol, params_of,
                    require_c_extension, resume, train_steps)
from reference import KLShampooRef, SOAPRef

S = 2
F = 4
#: values per scale as the tiers store each type (config.TIER_QUANT_BLOCK, restated)
BLOCK = {"int8": 64, "int4": 64}
QMAX = {"int8": 127, "int4": 7}
STEPS = {"int8": 1, "int4": 3}
MIN_DIM = 64
TOKENS = 128  # rows per batch: more than any layer is wide (full-rank factors)
HEADER = 64


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


# ---- the format, restated ------------------------------------------------------------------------

def layout_bytes(qtype: str, count: int) -> int:
    """asteria/quant.h's layout: the codes (one a byte, or two), zeros to a multiple of 4, one
    float32 scale per block of BLOCK[qtype]."""
    codes = count if qtype == "int8" else (count + 1) // 2
    return (codes + 3) // 4 * 4 + 4 * math.ceil(count / BLOCK[qtype])


def scales_and_codes(x: torch.Tensor, qtype: str):
    """Per block of BLOCK[qtype] values of x (float32, flat): s = absmax / qmax and the
    codes."""
    qmax, block = QMAX[qtype], BLOCK[qtype]
    n = x.numel()
    xb = torch.cat([x, x.new_zeros(-n % block)]).view(-1, block)
    s = xb.abs().amax(dim=1) / qmax
    codes = torch.round(xb / torch.where(s > 0, s, torch.ones_like(s))[:, None])
    return s, codes.clamp(-qmax, qmax)


def dequantized(q: torch.Tensor, qtype: str) -> torch.Tensor:
    """q's values as the tier stores them: quantized and dequantized (float32 arithmetic)."""
    x = q.to(torch.float32).reshape(-1)
    s, codes = scales_and_codes(x, qtype)
    return (codes * s[:, None]).reshape(-1)[:x.numel()].view(q.shape)


def bjorck(v: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        v = 1.5 * v - 0.5 * (v @ (v.mT @ v))
    return v


def stored(q: torch.Tensor, qtype: str) -> torch.Tensor:
    """The basis a step uses where the tier stores q: a basis of at least MIN_DIM rows
    quantized, dequantized and rectified (float32), in q's dtype; a smaller one as it is."""
    if q.shape[-1] < MIN_DIM:
        return q
    return bjorck(dequantized(q, qtype), STEPS[qtype]).to(q.dtype)


def orth(v: torch.Tensor) -> float:
    v = v.to(torch.float64)
    return float(torch.linalg.matrix_norm(v.mT @ v - torch.eye(v.shape[-1], dtype=v.dtype)))


# ---- the restatements ----------------------------------------------------------------------------

def soap_ref(qtype: str, one_sided: bool = False):
    class SOAPRefQ(SOAPRef):
        def update(self, w, g, st):
            first = not st
            due = super().update(w, g, st)
            if first:
                st["Q"] = [None if q is None else stored(q, qtype) for q in st["Q"]]
            return due

        def install(self, st, result):
            super().install(st, [None if r is None else (r[0], stored(r[1], qtype))
                                 for r in result])

    return lambda p, **kw: SOAPRefQ(p, precondition_frequency=F, one_sided=one_sided, **kw)


# a small init_factor: lambda (s) moves away from its uniform start within the run, so the
# basis matters to the step (with s uniform, Q diag(s) Q^T is the same for every Q)
KL = dict(precondition_frequency=F, lr=3e-3, init_factor=1e-3)


def kl_ref(qtype: str):
    class KLShampooRefQ(KLShampooRef):
        def update(self, w, g, st):
            first = not st
            due = super().update(w, g, st)
            if first:
                st["Q"] = {d: stored(q, qtype) for d, q in st["Q"].items()}
            return due

        def install(self, st, result):
            super().install(st, {d: stored(q, qtype) for d, q in result.items()})

    return lambda p, **kw: KLShampooRefQ(p, **KL, **kw)


METHODS = {
    "soap": (lambda p, **kw: SOAP(p, precondition_frequency=F, **kw), soap_ref),
    "one_sided_soap": (lambda p, **kw: OneSidedSOAP(p, precondition_frequency=F, **kw),
                       lambda qt: soap_ref(qt, one_sided=True)),
    "kl_shampoo": (lambda p, **kw: KLShampoo(p, **KL, **F64, **kw), kl_ref),
}


# ---- the model: bases of 96 x 96 and 64 x 64 (quantized) and 8 x 8 (kept) ----------------------

class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 96, bias=False)  # bases 96 x 96 and 64 x 64
        self.b = nn.Linear(96, 64)              # 64 x 64 and 96 x 96; the bias is AdamW
        self.c = nn.Linear(64, 8, bias=False)   # 8 x 8 (below MIN_DIM: kept) and 64 x 64

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def make_wide(kind="wide", seed=0):
    torch.manual_seed(seed)
    return Wide().to(DTYPE)


def wide_grad(model, kind, step):
    for p in model.parameters():
        p.grad = None
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, 64, generator=gen, dtype=DTYPE)
    a = torch.randn(64, 8, generator=torch.Generator().manual_seed(7), dtype=DTYPE)
    loss = ((model(x) - torch.sin(x @ a)) ** 2).mean()
    loss.backward()
    return loss.detach()


WIDE = (make_wide, wide_grad)
STEPS_RUN = 16


def rt(qtype, **kw):
    # explicit host tier: "auto" keeps a CPU parameter's blocks in optimizer.state
    base = {"mode": "async", "staleness": S, "install": "deterministic", "workers": 2,
            "tier_dtype": qtype, "placement": {"eigenbases": "host"}}
    base.update(kw)
    return base


def runtime_for(tier, qtype, tmp_path, name):
    if tier == "host":
        return rt(qtype)
    # the first parameter's first basis on the host, every later one on NVMe (plan rule 4)
    first = wide_blocks(name)[0][0]
    return rt(qtype, nvme_dir=str(tmp_path), host_budget_bytes=layout_bytes(qtype, first ** 2))


def train(model, opt, steps):
    return train_steps(model, opt, steps, "wide", wide_grad)


# ---- every method and tier against the restatement -----------------------------------------------

@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("name", list(METHODS))
def test_quantized_storage_equals_restatement(name, tier, qtype, tmp_path):
    make_opt, make_ref = METHODS[name]
    runtime = runtime_for(tier, qtype, tmp_path, name)
    history, opt = lockstep("wide", lambda p: make_opt(p, runtime=runtime),
                            lambda p: make_ref(qtype)(p, install_delay=S), steps=STEPS_RUN,
                            models=WIDE)
    assert_lockstep(history)
    stats = opt.asteria_stats()
    assert stats["installs"] > 0 and stats["max_install_lag"] == S
    if tier == "nvme":
        assert stats["bytes_nvme"] > 0 and stats["bytes_host"] > 0
        assert stats["bytes_nvme_read"] > 0
    # not vacuous: the quantized tier moves the trajectory beyond the tolerance
    model = make_wide()
    opt = make_opt(model.parameters(), runtime=rt("float32"))
    full = train(model, opt, range(1, STEPS_RUN + 1))
    opt.close()
    moved = max(float((a - b).abs().max()) for a, b in zip(full[-1], history[-1][1]))
    assert moved > 1e3 * lockstep_tol(STEPS_RUN)


# ---- the format's error and the rectification, where the tiers use them --------------------------

def one_weight(qtype, n=MIN_DIM, dtype=torch.float32, **kw):
    w = nn.Parameter(torch.randn(n, n, dtype=dtype, generator=torch.Generator().manual_seed(3)))
    return w, SOAP([w], precondition_frequency=F, runtime=rt(qtype, **kw))


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_stored_value_within_half_a_step_and_rectified_as_the_math_says(qtype):
    """A basis written to the tier comes back (the state proxy: the stored value) within half
    a quantization step of each value; the step's basis is the dequantized one after
    STEPS[qtype] Bjorck steps, and each step took ||A||_F (A = V^T V - I) from e to at most
    (3/4 + e/4) e^2."""
    w, opt = one_weight(qtype, n=96)
    w.grad = torch.randn(96, 96, generator=torch.Generator().manual_seed(4))
    opt.step()  # the blocks exist
    q, _ = torch.linalg.qr(torch.randn(96, 96, generator=torch.Generator().manual_seed(5)))
    opt.state[w]["b0.Q0"] = q
    back = opt.state[w]["b0.Q0"]
    assert back.dtype == torch.float32 and not torch.equal(back, q)
    s, codes = scales_and_codes(q.reshape(-1), qtype)
    # quant.h: |x - x'| <= s / 2 up to the division's rounding (qmax 2^-24 s) and the
    # multiply's (half an ulp of x', <= qmax s 2^-24)
    bound = (s * (0.5 + 2 * QMAX[qtype] * 2.0 ** -24))[:, None].expand(-1, BLOCK[qtype]).reshape(-1)
    err = (back - q).abs().reshape(-1)
    assert bool((err <= bound[:err.numel()]).all())
    assert float(err.max()) > 0.2 * float(s.max())  # the bound is not loose by orders
    assert torch.equal(back, dequantized(q, qtype))
    # the basis the step uses: stacked from the ring, widened and rectified there
    used = opt.placement.stack([(w, 0)], "Q", 0)[0]
    assert torch.equal(used, bjorck(back, STEPS[qtype]))
    e = orth(back)
    assert e > (1e-3 if qtype == "int8" else 1e-1)  # there is something to rectify
    v = back
    for _ in range(STEPS[qtype]):
        nxt = bjorck(v, 1)
        assert orth(nxt) <= (0.75 + e / 4) * e * e + 1e-5  # float32 rounding of a step
        v, e = nxt, orth(nxt)
    # TIER_RECTIFY_STEPS's rule: nearer orthogonal than the basis rounded to bfloat16
    assert orth(used) == orth(v) and orth(used) < orth(q.to(torch.bfloat16).float())
    opt.close()


def test_small_bases_and_other_state_keep_their_dtype():
    """Under int8 a basis below 64 x 64 and everything on the device (factors, moments) keep
    their dtype and values: the 8 x 8 run equals the float32-tier run bitwise."""
    trajs = {}
    for dt in ("float32", "int8"):
        w, opt = one_weight(dt, n=8)
        gen = torch.Generator().manual_seed(9)
        traj = []
        for _ in range(10):
            w.grad = torch.randn(8, 8, generator=gen)
            opt.step()
            traj.append(w.detach().clone())
        trajs[dt] = traj
        st = opt.asteria_stats()
        assert st["bytes_host"] == 2 * 8 * 8 * 4
        opt.close()
    assert all(torch.equal(a, b) for a, b in zip(trajs["float32"], trajs["int8"]))


def test_quantizing_a_dequantized_form_gives_its_scale_back():
    """The checkpoint's promise (tiers/quant.py): for every float32 mantissa a (two binades)
    and s = fl(a / qmax), fl(fl(qmax s) / qmax) == s, so the dequantized block's absmax,
    fl(qmax s), gives back its scale and then its codes."""
    m = torch.arange(1 << 23, dtype=torch.int32)
    for exp in (120, 126):
        a = ((exp << 23) | m).view(torch.float32)
        for qmax in (127.0, 7.0):
            s = a / qmax
            assert torch.equal((qmax * s) / qmax, s)


# ---- bytes: tiers, plan, stats, records ----------------------------------------------------------

def wide_blocks(name):
    """The quantized (n) and kept (n) bases of the wide model under a method."""
    if name == "one_sided_soap":
        return [64, 64], [8]  # a: its 64 side, b: its 64 side, c: its 8 side (kept)
    return [96, 64, 64, 96, 64], [8]


@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_stats_and_plan_count_the_quantized_bytes(qtype, tier, tmp_path):
    q_dims, kept = wide_blocks("soap")
    want = sum(layout_bytes(qtype, n * n) for n in q_dims) + sum(n * n * 8 for n in kept)
    wide = sum(n * n * 8 for n in q_dims + kept)
    model = make_wide()
    runtime = rt(qtype) if tier == "host" else rt(qtype, nvme_dir=str(tmp_path),
                                                   host_budget_bytes=0)
    opt = SOAP(model.parameters(), precondition_frequency=F, runtime=runtime)
    plan = opt.asteria_memory_plan()
    assert plan["tier_dtype"] == qtype
    assert plan["planned_bytes"][tier] == want
    assert plan["transfer_bytes"] == {"per_step": 0, "per_install": 0}  # CPU parameters
    lines = [d for d in opt.asteria_plan() if d.startswith(f"tier_dtype {qtype!r}")]
    assert len(lines) == 1 and "5 eigenbasis blocks" in lines[0] and "1 smaller" in lines[0]
    train(model, opt, range(1, 7))
    st = opt.asteria_stats()
    assert st[f"bytes_{tier}"] == want and want < 0.3 * wide
    if tier == "nvme":
        res = opt.placement._residency
        for key in res.on_nvme():
            with open(res.record_path(key), "rb") as f:
                head = f.read(HEADER)
            n = int(math.isqrt(res._blocks[key].nbytes // 8)) if head[40] == 0 else None
            if head[40] == 0:
                assert n in kept and int.from_bytes(head[44:48], "little") == 0
            else:
                assert head[40] == (1 if qtype == "int8" else 2)
                assert int.from_bytes(head[44:48], "little") == BLOCK[qtype]
    opt.close()


def test_plan_counts_pcie_bytes_of_cuda_parameters():
    """make_plan alone (the capabilities given, no device needed): CUDA parameters' quantized
    bases cross PCIe at the layout's bytes, once per install and, staged, once per step."""
    from asteria.tiers.plan import Capabilities, StateEntry, make_plan

    caps = Capabilities(cuda=True, pinned=True, pinned_reason="", uvm=False, uvm_reason="no")
    dev, f32 = torch.device("cuda", 0), torch.float32
    entries = [StateEntry(0, "b0.GG0", "factors", 128 * 128 * 4, dev, f32),
               StateEntry(0, "b0.Q0", "eigenbases", 128 * 128 * 4, dev, f32),
               StateEntry(0, "b0.Q1", "eigenbases", 32 * 32 * 4, dev, f32)]
    for qtype in ("int8", "int4"):
        plan = make_plan(RuntimeConfig.from_user({"mode": "async", "tier_dtype": qtype}),
                         entries, caps)
        want = layout_bytes(qtype, 128 * 128) + 32 * 32 * 4
        assert plan.planned_bytes["host_pinned"] == want
        assert plan.transfer_bytes == {"per_step": want, "per_install": want}
    plan = make_plan(RuntimeConfig.from_user({"mode": "async"}), entries, caps)
    assert plan.transfer_bytes["per_install"] == (128 * 128 + 32 * 32) * 4


def crc32c(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def rewrite_format(path, qtype_byte):
    """Give the record another payload type, its checksums recomputed (an intact record of
    another format)."""
    with open(path, "r+b") as f:
        rec = bytearray(f.read())
        plen = int.from_bytes(rec[32:40], "little")
        assert crc32c(bytes(rec[:60])) == int.from_bytes(rec[60:64], "little")
        rec[40] = qtype_byte
        rec[60:64] = crc32c(bytes(rec[:60])).to_bytes(4, "little")
        rec[HEADER + plen:HEADER + plen + 4] = crc32c(bytes(rec[:HEADER + plen])).to_bytes(
            4, "little")
        f.seek(0)
        f.write(rec)


@pytest.mark.parametrize("fault", ["damaged", "foreign format"])
def test_bad_record_refused_naming_the_file(fault, tmp_path):
    w, opt = one_weight("int8", nvme_dir=str(tmp_path), host_budget_bytes=0)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        w.grad = torch.randn(64, 64, generator=gen)
        opt.step()
    res = opt.placement._residency
    key = sorted(res.on_nvme())[0]
    path = res.record_path(key)
    with open(path, "rb") as f:
        orig = f.read()
    before = w.detach().clone()
    if fault == "damaged":
        with open(path, "r+b") as f:
            f.seek(HEADER + 100)
            f.write(bytes([orig[HEADER + 100] ^ 1]))
    else:
        rewrite_format(path, 2)
    w.grad = torch.randn(64, 64, generator=gen)
    with pytest.raises(TieredStateError) as ei:
        opt.step()
    msg = str(ei.value)
    assert path in msg and ei.value.files == [path] and ei.value.blocks == [key]
    assert "parameters and optimizer state are unchanged" in msg
    if fault == "damaged":
        assert "checksum mismatch" in msg
    else:
        assert "record holds int4 in blocks of 64, expected int8 in blocks of 64" in msg
    assert torch.equal(w, before)
    with open(path, "wb") as f:  # repaired: the step goes on
        f.write(orig)
    opt.step()
    assert not torch.equal(w, before)
    opt.close()


# ---- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("name", list(METHODS))
def test_state_dict_holds_stored_values_and_resumes_bitwise(name, qtype, tmp_path):
    """state_dict() holds each quantized basis dequantized (quantizing it again changes
    nothing); a fresh optimizer loaded from it with a refresh in flight (f = 4, S = 2, split
    after step 6) continues bitwise like the uninterrupted run, on the host and NVMe tiers."""
    make_opt, _ = METHODS[name]
    split, steps = 6, 14
    model = make_wide()
    opt = make_opt(model.parameters(), runtime=rt(qtype))
    train(model, opt, range(1, split + 1))
    sd = copy.deepcopy(opt.state_dict())
    params = params_of(model)
    want = train(model, opt, range(split + 1, steps + 1))
    opt.close()
    bases = [v for st in sd["state"].values() for k, v in st.items()
             if ".Q" in k and torch.is_tensor(v) and v.dim() == 2 and v.shape[0] >= MIN_DIM]
    assert len(bases) == len(wide_blocks(name)[0])
    for q in bases:
        assert q.dtype == DTYPE and torch.equal(dequantized(q, qtype).to(DTYPE), q)
        assert orth(q) > orth(bjorck(q.float(), STEPS[qtype]))
    for runtime in (rt(qtype), runtime_for("nvme", qtype, tmp_path, name)):
        got = resume("wide", make_opt, runtime, params, sd, range(split + 1, steps + 1), WIDE)
        for t, (a, b) in enumerate(zip(got, want), split + 1):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {t}"


def test_float32_checkpoint_loads_into_a_quantized_tier():
    """A float32-tier checkpoint loads into an int8 tier (quantized on load: its state then
    shows the dequantized basis) and back (kept exactly)."""
    make_opt, _ = METHODS["soap"]
    model = make_wide()
    opt = make_opt(model.parameters(), runtime=rt("float32"))
    train(model, opt, range(1, 7))
    sd = opt.state_dict()
    opt.close()
    opt8 = make_opt(make_wide().parameters(), runtime=rt("int8"))
    opt8.load_state_dict(copy.deepcopy(sd))
    back = opt8.state_dict()
    opt8.close()
    for i, st in sd["state"].items():
        for k, v in st.items():
            if ".Q" in k and torch.is_tensor(v) and v.dim() == 2:
                got = back["state"][i][k]
                want = dequantized(v, "int8").to(DTYPE) if v.shape[0] >= MIN_DIM else v
                assert torch.equal(got, want), (i, k)
    opt32 = make_opt(make_wide().parameters(), runtime=rt("float32"))
    opt32.load_state_dict(copy.deepcopy(back))
    again = opt32.state_dict()
    opt32.close()
    for i, st in back["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(again["state"][i][k], v), (i, k)


# ---- refusals ------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_shampoo_refuses_quantized_tiers(qtype, mode):
    with pytest.raises(ValueError) as ei:
        Shampoo(make_wide().parameters(), runtime={"mode": mode, "tier_dtype": qtype})
    msg = str(ei.value)
    assert "runtime key 'tier_dtype'" in msg and repr(qtype) in msg
    assert "Shampoo's inverse roots (Linv) are not orthogonal" in msg
    assert 'allowed with inverse roots: "float32", "bfloat16"' in msg
    Shampoo(make_wide().parameters(), runtime={"mode": mode, "tier_dtype": "bfloat16"}).close()


def test_a_basis_that_cannot_be_quantized_is_refused_naming_the_block():
    w, opt = one_weight("int8")
    w.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(4))
    opt.step()
    before = opt.state[w]["b0.Q0"]
    with pytest.raises(ValueError) as ei:
        opt.state[w]["b0.Q0"] = torch.full((64, 64), float("nan"))
    msg = str(ei.value)
    assert "eigenbasis block 'b0.Q0'" in msg and "int8 in blocks of 64" in msg
    assert "NaN or Inf" in msg
    del ei
    assert torch.equal(opt.state[w]["b0.Q0"], before)  # nothing changed
    opt.close()


# ---- on a CUDA device: the ring carries the bytes, the device widens them ------------------------

needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _C.HAVE_CUDA),
                                reason="needs a CUDA device that libasteria reaches")


@needs_cuda
@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_cuda_step_uses_the_basis_widened_on_the_device_and_resumes_bitwise(qtype):
    """A CUDA parameter's bases in pinned host memory: the basis a step stacks is the stored
    one dequantized and rectified on the device (this file's restatement, run there: the same
    operations on the same device give the same bits), only quantized bytes cross PCIe, and a
    checkpoint resumes bitwise."""
    dev = torch.device("cuda")
    runtime = rt(qtype, placement={"eigenbases": "host_pinned"})

    def run(steps, sd=None, w0=None):
        w = nn.Parameter(torch.randn(96, 64, generator=torch.Generator().manual_seed(3)).to(dev)
                         if w0 is None else w0.clone())
        opt = SOAP([w], precondition_frequency=F, runtime=runtime)
        if sd is not None:
            opt.load_state_dict(copy.deepcopy(sd))
        gen = torch.Generator().manual_seed(8)
        out = []
        for t in range(steps[-1]):
            g = torch.randn(96, 64, generator=gen)
            if t + 1 in steps:
                w.grad = g.to(dev)
                opt.step()
                out.append(w.detach().clone())
        return w, opt, out

    w, opt, _ = run(range(1, 7))
    stored_q = opt.state[w]["b0.Q0"]
    used = opt.placement.stack([(w, 0)], "Q", 0)[0]
    assert used.device.type == "cuda"
    assert torch.equal(used, bjorck(stored_q.to(dev), STEPS[qtype]))
    st = opt.asteria_stats()
    assert st["bytes_host_pinned"] == layout_bytes(qtype, 96 * 96) + layout_bytes(qtype, 64 * 64)
    assert opt.asteria_memory_plan()["transfer_bytes"]["per_step"] == st["bytes_host_pinned"]
    sd, w_mid = copy.deepcopy(opt.state_dict()), w.detach().clone()
    want = []
    gen = torch.Generator().manual_seed(8)
    for t in range(14):
        g = torch.randn(96, 64, generator=gen)
        if t >= 6:
            w.grad = g.to(dev)
            opt.step()
            want.append(w.detach().clone())
    opt.close()
    _, opt2, got = run(range(7, 15), sd=sd, w0=w_mid)
    opt2.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_store_block_format_binding(tmp_path):
    """asteria._C.Store.set_format / format: what the residency gives each quantized block."""
    with _C.Store(nvme_dir=str(tmp_path), direct="fallback") as store:
        sid = store.alloc("host", layout_bytes("int4", 64 * 64))
        assert store.format(sid) == ("none", 0)
        store.set_format(sid, "int4", BLOCK["int4"])
        assert store.format(sid) == ("int4", BLOCK["int4"])
        with pytest.raises(ValueError, match="unknown qtype 'int3'; allowed: 'none', 'int8'"):
            store.set_format(sid, "int3", BLOCK["int4"])
        with pytest.raises(ValueError, match="int8 in blocks of 63"):
            store.set_format(sid, "int8", 63)
        store.move([sid], "nvme")
        with pytest.raises(_C.AsteriaError, match="is on nvme"):
            store.set_format(sid, "int8", BLOCK["int8"])
        with open(store.record_path(sid), "rb") as f:
            head = f.read(HEADER)
        assert head[40] == 2 and int.from_bytes(head[44:48], "little") == BLOCK["int4"]
        store.move([sid], "host")
        store.set_format(sid, "none")
        assert store.format(sid) == ("none", 0)
