"""asteria.tiers.quant and asteria._C's quant_* functions: the int8 / int4 block-quantized format
of eigenbases (asteria/quant.h).

libasteria's kernels (``*_host``), the torch kernels (``quantize``, ``dequantize``) and a plain
restatement written here (one block at a time, the int4 nibbles by arithmetic instead of shifts
and views) must give the same bytes and the same widened values, bit for bit: ties included
(round half to even on both sides), zero and subnormal blocks, odd counts, partial last blocks.
The widened error is bounded by the format's step: |x - x'| <= s/2 + u (s (qmax + 1) + |x'|),
s = absmax / qmax of the block, u = 2^-24 (the division and the multiply each round once; the
derivation is in tests/c/test_quant.c). Rectification converges quadratically: one Bjorck step
takes A = V^T V - I to -(3/4) A^2 + (1/4) A^3, so ||A'||_F <= (3/4 + ||A||_2 / 4) ||A||_2
||A||_F, plus the float32 rounding floor n^1.5 u.
"""

import math

import pytest
import torch

from asteria import _C
from asteria.config import TIER_QUANT_BLOCK, TIER_RECTIFY_STEPS
from asteria.tiers import quant as Q

U = 2.0 ** -24


def floor_of(n):
    """The float32 rounding floor of ||V^T V - I||_F for an n x n V (tests/c/test_quant.c)."""
    return n * math.sqrt(n) * U


# ---- the restatement -------------------------------------------------------------------------------

def ref_quantize(x, qtype, block):
    """The header's definition, block by block, packed by arithmetic: bytes as a uint8 tensor."""
    qmax = Q.QMAX[qtype]
    x = x.reshape(-1)
    count = x.numel()
    codes, scales = [], []
    for start in range(0, count, block):
        xb = x[start:start + block]
        s = xb.abs().max() / qmax if xb.numel() else torch.tensor(0.0)
        scales.append(s.reshape(1))
        c = torch.zeros_like(xb) if s == 0 else torch.round(xb / s).clamp(-qmax, qmax)
        codes.append(c.to(torch.int32))
    codes = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.int32)
    if qtype == "int8":
        values = torch.remainder(codes, 256)
    else:
        if count % 2:
            codes = torch.cat([codes, torch.zeros(1, dtype=torch.int32)])
        values = torch.remainder(codes[0::2], 16) + 16 * torch.remainder(codes[1::2], 16)
    values = values.to(torch.uint8)
    pad = (-values.numel()) % 4
    s = torch.cat(scales).to(torch.float32) if scales else torch.zeros(0)
    return torch.cat([values, torch.zeros(pad, dtype=torch.uint8), s.view(torch.uint8)])


def ref_dequantize(q, qtype, count, block):
    """code * scale per value, the int4 nibbles by arithmetic."""
    lay = Q.layout(qtype, count, block)
    if qtype == "int8":
        codes = q[:count].to(torch.int32)
        codes = codes - 256 * (codes > 127).to(torch.int32)
    else:
        b = q[:lay.value_bytes].to(torch.int32)
        nib = torch.stack([b % 16, b // 16], dim=1).reshape(-1)[:count]
        codes = nib - 16 * (nib > 7).to(torch.int32)
    scales = q[lay.scales_offset:].clone().view(torch.float32)
    per_value = scales.repeat_interleave(block)[:count]
    return codes.to(torch.float32) * per_value


def values(kind, count, gen):
    """Entries of an orthogonal basis (about 1/sqrt(n)), wide ranges, exact zeros, ties."""
    x = torch.randn(count, generator=gen)
    if kind == "basis":
        return x / 32
    if kind == "wide":
        return x * torch.exp(8 * (torch.rand(count, generator=gen) - 0.5))
    if kind == "zeros":
        return torch.where(torch.rand(count, generator=gen) < 0.3, torch.zeros(count), x)
    if kind == "ties":  # absmax = qmax in every block: s = 1, half-integers are ties
        t = torch.randint(-14, 15, (count,), generator=gen).to(torch.float32) / 2
        return t
    raise AssertionError(kind)


CASES = [(qtype, count, block, kind)
         for qtype in ("int8", "int4")
         for count in (1, 2, 7, 64, 65, 1000, 4097)
         for block in (2, 32, 64, 128)
         for kind in ("basis", "wide", "zeros", "ties")]


# ---- layout -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_layout_is_the_formula(qtype):
    for count in (0, 1, 2, 3, 63, 64, 65, 1 << 20):
        for block in (2, 32, 64, 128):
            lay = Q.layout(qtype, count, block)
            vb = count if qtype == "int8" else (count + 1) // 2
            assert lay.value_bytes == vb
            assert lay.scales_offset == (vb + 3) // 4 * 4
            assert lay.nblocks == -(-count // block)
            assert lay.nbytes == lay.scales_offset + 4 * lay.nblocks
    assert Q.BLOCK_DEFAULT == 64 and Q.layout(qtype, 10).block == 64


# ---- bit for bit: C == torch == restatement ---------------------------------------------------------

@pytest.mark.parametrize("qtype,count,block,kind", CASES)
def test_quantize_and_dequantize_agree_bitwise(qtype, count, block, kind):
    gen = torch.Generator().manual_seed(count * 131 + block)
    x = values(kind, count, gen)
    if kind == "ties":
        x[::block] = float(Q.QMAX[qtype])  # s = 1 exactly in every block
    want = ref_quantize(x, qtype, block)
    c = Q.quantize_host(x, qtype, block)
    t = Q.quantize(x, qtype, block)
    assert torch.equal(c, want), "libasteria's bytes differ from the restatement"
    assert torch.equal(t, want), "torch's bytes differ from the restatement"

    w = ref_dequantize(want, qtype, count, block)
    wc = Q.dequantize_host(c, qtype, count, block)
    wt = Q.dequantize(c, qtype, count, block)
    assert torch.equal(wc.view(torch.int32), w.view(torch.int32))
    assert torch.equal(wt.view(torch.int32), w.view(torch.int32))
    hc = Q.dequantize_host(c, qtype, count, block, dtype=torch.bfloat16)
    ht = Q.dequantize(c, qtype, count, block, dtype=torch.bfloat16)
    hw = w.to(torch.bfloat16)
    assert torch.equal(hc.view(torch.int16), hw.view(torch.int16))
    assert torch.equal(ht.view(torch.int16), hw.view(torch.int16))


def test_ties_go_to_even():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    q = Q.quantize_host(x, "int8")
    assert q[:8].view(torch.int8).tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    assert torch.equal(Q.quantize(x, "int8"), q)
    x4 = torch.tensor([7.0, 0.5, 1.5, 2.5, 3.5, -3.5, 6.5, -6.5])
    q4 = Q.quantize_host(x4, "int4")
    assert torch.equal(Q.quantize(x4, "int4"), q4)
    assert Q.dequantize(q4, "int4", 8).tolist() == [7, 0, 2, 2, 4, -4, 6, -6]


def test_zero_and_subnormal_blocks():
    tiny = 190 * 2.0 ** -149
    x = torch.tensor([0.0, -0.0, 0.0, 0.0, tiny, -tiny, 2.0 ** -149, 0.0])
    for qtype in ("int8", "int4"):
        q = Q.quantize_host(x, qtype, 4)
        assert torch.equal(Q.quantize(x, qtype, 4), q)
        assert torch.equal(q, ref_quantize(x, qtype, 4))
        w = Q.dequantize(q, qtype, 8, 4)
        assert torch.equal(w[:4], torch.zeros(4))
        assert bool((w[4:].abs() <= 1.5 * tiny).all())


def test_a_form_inside_a_larger_buffer():
    """dequantize reads a form at any byte offset of a uint8 tensor (its scales copied out when
    they are not float32-aligned there)."""
    x = torch.randn(100)
    q = Q.quantize(x, "int4", 32)
    for off in (0, 1, 3, 4):
        buf = torch.zeros(off + q.numel() + 5, dtype=torch.uint8)
        buf[off:off + q.numel()] = q
        assert torch.equal(Q.dequantize(buf[off:off + q.numel()], "int4", 100, 32),
                           Q.dequantize_host(q, "int4", 100, 32))


# ---- the error bound ----------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["int8", "int4"])
@pytest.mark.parametrize("block", [32, 64, 128])
def test_error_within_half_a_step(qtype, block):
    qmax = Q.QMAX[qtype]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1 << 14, generator=gen) / 32
    q = Q.quantize_host(x, qtype, block)
    w = Q.dequantize_host(q, qtype, x.numel(), block).double()
    lay = Q.layout(qtype, x.numel(), block)
    s = q[lay.scales_offset:].clone().view(torch.float32).double().repeat_interleave(block)
    err = (x.double() - w).abs()
    bound = s / 2 + U * (s * (qmax + 1) + w.abs())
    assert bool((err <= bound).all()), float((err - bound).max())
    ratio = float((err / s).max())
    assert 0.49 < ratio <= 0.5 + 1e-5  # the bound is the format's step, not slack


# ---- rectification ------------------------------------------------------------------------------------

def random_orthogonal(n, gen):
    return torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0].contiguous()


@pytest.mark.parametrize("size", [0.3, 0.1, 0.02])
def test_one_bjorck_step_is_quadratic(size):
    n = 64
    gen = torch.Generator().manual_seed(17)
    q = random_orthogonal(n, gen)
    v = (q + size / (2 * n) * torch.randn(n, n, generator=gen, dtype=torch.float64)).float()
    a = v.double().T @ v.double() - torch.eye(n, dtype=torch.float64)
    fro, two = float(torch.linalg.matrix_norm(a)), float(torch.linalg.matrix_norm(a, ord=2))
    bound = (0.75 + two / 4) * two * fro + floor_of(n)
    assert bound <= (0.75 + fro / 4) * fro * fro + floor_of(n)  # the Frobenius-only form

    after_t = float(Q.orth_error(Q.rectify(v, 1)))
    vc = v.clone()
    errs = Q.rectify_host(vc, 1)
    after_c = float(Q.orth_error(vc))
    assert after_t <= bound and after_c <= bound
    assert after_c < fro and after_t < fro
    assert abs(errs[0][0] - fro) <= floor_of(n) and abs(errs[0][1] - after_c) <= floor_of(n)
    # libasteria and torch compute the same step (to rounding, not bitwise: other BLAS)
    assert float((vc - Q.rectify(v, 1)).abs().max()) <= 16 * n * U
    # three steps: the rounding floor
    v3 = v.clone()
    e3 = Q.rectify_host(v3, 3)[0]
    assert e3[1] < e3[0] and e3[3] <= floor_of(n)
    assert float(Q.orth_error(Q.rectify(v, 3))) <= floor_of(n)


@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_quantized_basis_rectified_batch(qtype):
    n = 128
    gen = torch.Generator().manual_seed(29)
    basis = torch.stack([random_orthogonal(n, gen) for _ in range(3)]).float()
    q = Q.quantize_host(basis, qtype)
    w = Q.dequantize(q, qtype, basis.numel()).view(3, n, n)
    before = Q.orth_error(w)
    errs = Q.rectify_host(w, 4)
    assert len(errs) == 3 and all(len(e) == 5 for e in errs)
    for i, e in enumerate(errs):
        assert abs(e[0] - float(before[i])) <= floor_of(n)
        assert e[1] < e[0] and e[2] < e[1]
        assert e[4] <= floor_of(n)
    assert bool((Q.orth_error(w) <= floor_of(n)).all())


def training_like_bases(n):
    """Eigenbases of the two kinds of factors training makes: G G^T (G Gaussian: delocalized
    eigenvectors, every entry near 1 / sqrt n) and a dominant diagonal plus 0.03 G G^T / n
    (partly localized ones, a few large entries a column: their blocks' scales are large for
    most of their values, as in the bases bench_tier_dtype.py's runs store)."""
    gen = torch.Generator().manual_seed(n)
    g = torch.randn(n, n, generator=gen, dtype=torch.float64)
    diag = torch.diag(torch.linspace(1, 2, n, dtype=torch.float64))
    return [torch.linalg.eigh(f)[1].float().contiguous()
            for f in (g @ g.T, diag + 0.03 * g @ g.T / n)]


def test_configured_steps_are_the_fewest_below_the_bfloat16_tier():
    """TIER_RECTIFY_STEPS's rule: the fewest Bjorck steps after which every quantized
    eigenbasis is nearer orthogonal than the same basis rounded to bfloat16, the bfloat16
    tier's, which is not rectified and trains as float32 does (docs/results.md)."""
    errs = {q: [] for q in TIER_RECTIFY_STEPS}  # per basis: (bfloat16's, after each step)
    for n in (64, 256, 1024):
        for basis in training_like_bases(n):
            bf16 = float(Q.orth_error(basis.to(torch.bfloat16).float()))
            for qtype, k in TIER_RECTIFY_STEPS.items():
                block = TIER_QUANT_BLOCK[qtype]  # as the tier stores it
                w = Q.dequantize_host(Q.quantize_host(basis, qtype, block), qtype, n * n,
                                      block).view(n, n)
                errs[qtype].append((bf16, Q.rectify_host(w.contiguous(), k)[0]))
    for qtype, k in TIER_RECTIFY_STEPS.items():
        assert all(e[k] < bf16 for bf16, e in errs[qtype]), (qtype, errs[qtype])
        assert any(e[k - 1] >= bf16 for bf16, e in errs[qtype]), (qtype, errs[qtype])


def test_rectify_steps_zero_measures_only():
    v = torch.eye(8) + 0.01
    keep = v.clone()
    errs = Q.rectify_host(v, 0)
    assert torch.equal(v, keep) and len(errs) == 1 and len(errs[0]) == 1
    assert abs(errs[0][0] - float(Q.orth_error(keep))) < 1e-5
    assert torch.equal(Q.rectify(v, 0), v)


# ---- bad arguments ------------------------------------------------------------------------------------

def test_bad_arguments_name_what_is_wrong():
    x = torch.randn(64)
    with pytest.raises(ValueError, match="'int2'.*'int8', 'int4'"):
        Q.quantize_host(x, "int2")
    with pytest.raises(ValueError, match="'int2'.*'int8', 'int4'"):
        Q.quantize(x, "int2")
    with pytest.raises(ValueError, match="block 63: must be even"):
        Q.quantize(x, "int8", 63)
    with pytest.raises(ValueError, match="block 0: must be even"):
        Q.layout("int4", 10, 0)
    with pytest.raises(TypeError, match="x must be torch.float32"):
        Q.quantize_host(x.double(), "int8")
    with pytest.raises(ValueError, match="x must be contiguous"):
        Q.quantize_host(torch.randn(8, 8).T, "int8")
    with pytest.raises(ValueError, match="out must be a contiguous tensor of 68 "):
        Q.quantize(x, "int8", out=torch.empty(60, dtype=torch.uint8))
    q = Q.quantize_host(x, "int8")
    with pytest.raises(ValueError, match="q: 60 bytes, but the int8 form of 64 values"):
        Q.dequantize(q[:60], "int8", 64)
    with pytest.raises(ValueError, match="qbytes 60"):
        Q.dequantize_host(q[:60], "int8", 64)
    with pytest.raises(ValueError, match="dtype must be torch.float32 or torch.bfloat16"):
        Q.dequantize(q, "int8", 64, dtype=torch.float16)

    bad = x.clone()
    bad[40] = float("nan")
    with pytest.raises(_C.AsteriaError, match="values 0..63") as e:
        Q.quantize_host(bad, "int8")
    assert e.value.name == "AST_ENONFINITE"
    with pytest.raises(ValueError, match="NaN or Inf"):
        Q.quantize(bad, "int8")

    lay = Q.layout("int8", 64)
    broken = q.clone()
    broken[lay.scales_offset:lay.scales_offset + 4] = torch.tensor([-1.0]).view(torch.uint8)
    out = torch.full((64,), 7.0)
    with pytest.raises(ValueError, match="scale 0 is -1: not a quantized form"):
        Q.dequantize_host(broken, "int8", 64, out=out)
    assert bool((out == 7.0).all())  # untouched

    with pytest.raises(ValueError, match="steps 17; allowed: 0..16"):
        Q.rectify_host(torch.eye(4), 17)
    with pytest.raises(ValueError, match="steps 17; allowed: 0..16"):
        Q.rectify(torch.eye(4), 17)
    with pytest.raises(ValueError, match=r"v must be \(..., n, n\)"):
        Q.rectify_host(torch.zeros(4, 3), 1)
    nan = torch.eye(4)
    nan[1, 1] = float("inf")
    with pytest.raises(_C.AsteriaError, match="matrix 0 holds NaN or Inf"):
        Q.rectify_host(nan, 1)


def test_binding_checks_buffers():
    x = torch.randn(16)
    q = torch.empty(Q.layout("int8", 16).nbytes, dtype=torch.uint8)
    raw = bytearray(x.numpy().tobytes()) + b"\0"
    with pytest.raises(ValueError, match="x: 65 bytes is not a whole number of 4-byte values"):
        _C.quant_quantize("int8", raw, q.numpy())
    with pytest.raises(ValueError, match="x is not 4-byte aligned"):
        _C.quant_quantize("int8", memoryview(raw)[1:], q.numpy())
    with pytest.raises(TypeError):
        _C.quant_quantize("int8", x.numpy(), bytes(len(q)))  # out must be writable
    with pytest.raises(TypeError, match="qtype must be a str"):
        _C.quant_layout(8, 10)
    with pytest.raises(ValueError, match="v: 10 float32 values are not a whole number of 3 x 3"):
        _C.quant_rectify(torch.zeros(10).numpy(), 3, 1)
    assert _C.QUANT_BLOCK_MAX == 65536 and _C.QUANT_MAX_STEPS == 16


# ---- the device side ----------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", ["int8", "int4"])
def test_cuda_kernels_give_the_host_bits(qtype):
    """The device side: quantize on the device, or widen there after the copy of the bytes,
    gives libasteria's bytes and values."""
    gen = torch.Generator().manual_seed(3)
    for count, block in ((4097, 64), (1 << 16, 32), (1001, 128)):
        x = torch.randn(count, generator=gen) / 32
        q = Q.quantize_host(x, qtype, block)
        assert torch.equal(Q.quantize(x.cuda(), qtype, block).cpu(), q)
        wd = Q.dequantize(q.cuda(), qtype, count, block).cpu()
        assert torch.equal(wd.view(torch.int32),
                           Q.dequantize_host(q, qtype, count, block).view(torch.int32))
        hd = Q.dequantize(q.cuda(), qtype, count, block, dtype=torch.bfloat16).cpu()
        assert torch.equal(hd.view(torch.int16), Q.dequantize_host(
            q, qtype, count, block, dtype=torch.bfloat16).view(torch.int16))
    n = 256
    v = Q.dequantize(Q.quantize_host(random_orthogonal(n, gen).float(), qtype).cuda(), qtype,
                     n * n).view(n, n)
    assert float(Q.orth_error(Q.rectify(v, 4))) <= floor_of(n)
