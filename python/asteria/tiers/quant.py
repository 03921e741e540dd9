"""Eigenbases block-quantized to int8 / int4 outside the device, and their rectification: the
torch side of libasteria's format (``asteria/quant.h``), bit for bit, and the host kernels of
libasteria over CPU tensors.

Owns: the format's torch kernels, which run on any device (``quantize``; ``dequantize``, the
device side: it widens the quantized bytes after their host-to-device copy; ``rectify`` and
``orth_error``), the thin wrappers of libasteria's kernels for CPU tensors
(``quantize_host``, ``dequantize_host``, ``rectify_host``: what a host worker writes and reads),
and what the tiers do with a basis (``narrow``: a basis of any floating dtype to its quantized
form; ``widen``: the form to the basis the step uses, rectified).

Quantizing a dequantized form gives its bytes back: the block's largest value widens to
``fl(qmax s)``, and ``fl(fl(qmax s) / qmax)`` is ``s`` again for every scale that is itself a
quotient ``fl(a / qmax)`` (checked over every float32 mantissa, tests/python/
test_quant_tiers.py), so the scales and then the codes come back. A checkpoint that holds a
quantized basis dequantized therefore restores its bytes exactly.
The layout (sizes and offsets) and the block-size rule have one home, libasteria
(``_C.quant_layout``); ``layout`` asks it.
May call: torch, ``asteria._C``. No state, no locks: any thread.

The format (``asteria/quant.h`` has the full statement): ``count`` float32 values in blocks of
``block`` (even, 2..``_C.QUANT_BLOCK_MAX``; ``BLOCK_DEFAULT`` 64); per block the scale
``s = absmax / qmax`` (qmax 127 for int8, 7 for int4) and the codes
``clamp(round_half_even(x / s), -qmax, qmax)`` (0 where s is 0); widened ``code * s`` (float32),
or that rounded to bfloat16. Bytes: the codes (int8 one a byte; int4 two a byte, value 2k in
the low nibble, two's complement nibbles), zeros up to ``scales_offset`` (a multiple of 4), then
the float32 scales. Each step is one IEEE float32 operation with round-to-nearest-even, which
torch's CPU and CUDA kernels and libasteria's compute alike, so both sides give the same bytes
and the same widened values (tests/python/test_quant.py).

Rectify: Bjorck steps ``V <- 1.5 V - 0.5 V (V^T V)``; with ``A = V^T V - I`` a step leaves
``-(3/4) A^2 + (1/4) A^3``: quadratic convergence while V's singular values are in (0, sqrt 3).

Checks: shapes, dtypes and devices are checked here (ValueError / TypeError naming the
argument); the values are checked by libasteria on the host (NaN or Inf in x: AsteriaError
AST_ENONFINITE; a scale negative or not finite: ValueError). The torch kernels check that x is
finite (``quantize``: one device synchronisation) but not the scales (``dequantize`` stays
asynchronous: its bytes are ones libasteria wrote, or a record whose CRC the store verified).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch

from asteria import _C

#: the quantized types and their largest code (symmetric: -qmax..qmax)
QMAX = {"int8": 127, "int4": 7}
#: values per scale unless a caller says otherwise (4-bit Shampoo's 64)
BLOCK_DEFAULT = _C.QUANT_BLOCK_DEFAULT


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the parts of a quantized form lie (``asteria/quant.h``, ``ast_quant_layout``)."""

    count: int          # values
    block: int          # values per scale
    nblocks: int        # scales
    value_bytes: int    # the codes
    scales_offset: int  # the first scale (a multiple of 4)
    nbytes: int         # the whole form


def layout(qtype: str, count: int, block: int = BLOCK_DEFAULT) -> Layout:
    """The layout of ``count`` values of ``qtype`` ("int8" or "int4") in blocks of ``block``;
    ValueError naming a bad qtype or block."""
    return Layout(**_C.quant_layout(qtype, count, block))


def _qmax(qtype: str) -> int:
    if qtype not in QMAX:
        raise ValueError(f"unknown qtype {qtype!r}; allowed: 'int8', 'int4'")
    return QMAX[qtype]


def _need(t: torch.Tensor, what: str, dtype: torch.dtype, cpu: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, not {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{what} must be {dtype}, not {t.dtype}")
    if cpu and t.device.type != "cpu":
        raise ValueError(f"{what} must be a CPU tensor (the host kernels), not on {t.device}")
    if cpu and not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")


def _out(out: Optional[torch.Tensor], what: str, n: int, dtype: torch.dtype,
         device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(n, dtype=dtype, device=device)
    _need(out, what, dtype)
    if out.numel() != n or out.device != device or not out.is_contiguous():
        raise ValueError(f"{what} must be a contiguous tensor of {n} {dtype} values on {device},"
                         f" not {tuple(out.shape)} on {out.device}")
    return out


# ---- torch kernels (any device) ------------------------------------------------------------------

def quantize(x: torch.Tensor, qtype: str, block: int = BLOCK_DEFAULT,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The quantized form of the float32 values of ``x`` (flattened), as a uint8 tensor of
    ``layout(...).nbytes`` bytes on x's device (``out`` when given)."""
    qmax = _qmax(qtype)
    _need(x, "x", torch.float32)
    x = x.detach().reshape(-1)
    lay = layout(qtype, x.numel(), block)
    q = _out(out, "out", lay.nbytes, torch.uint8, x.device)
    if lay.count == 0:
        return q
    xb = torch.nn.functional.pad(x, (0, lay.nblocks * block - lay.count)).view(lay.nblocks,
                                                                                block)
    amax = xb.abs().amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("x holds NaN or Inf")
    s = amax / qmax
    div = torch.where(s > 0, s, torch.ones_like(s))  # a zero block: |x| / 1 rounds to 0
    codes = torch.round(xb / div[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
    q.zero_()
    if qtype == "int8":
        q[:lay.value_bytes] = codes[:lay.count].view(torch.uint8)
    else:
        c = codes[:2 * lay.value_bytes].view(torch.uint8)  # a padding code 0 after an odd count
        q[:lay.value_bytes] = (c[0::2] & 0xF) | ((c[1::2] & 0xF) << 4)
    q[lay.scales_offset:] = s.view(torch.uint8)
    return q


def _scales(q: torch.Tensor, lay: Layout) -> torch.Tensor:
    part = q[lay.scales_offset:lay.nbytes]
    if part.storage_offset() % 4:
        part = part.clone()  # a form at an odd offset of a larger buffer
    return part.view(torch.float32)


def _codes(q: torch.Tensor, qtype: str, lay: Layout) -> torch.Tensor:
    """The codes as int8, padded with zeros to whole blocks."""
    full = torch.zeros(lay.nblocks * lay.block, dtype=torch.int8, device=q.device)
    if qtype == "int8":
        full[:lay.count] = q[:lay.count].view(torch.int8)
    else:
        b = q[:lay.value_bytes]
        lo = (b << 4).view(torch.int8) >> 4  # arithmetic shifts: the nibbles sign-extended
        hi = b.view(torch.int8) >> 4
        full[:lay.count] = torch.stack((lo, hi), dim=1).view(-1)[:lay.count]
    return full


def dequantize(q: torch.Tensor, qtype: str, count: int, block: int = BLOCK_DEFAULT,
               dtype: torch.dtype = torch.float32,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``count`` values of the quantized form ``q`` (a uint8 tensor of exactly the layout's
    bytes, any device), widened to ``dtype`` (float32 or bfloat16) on q's device, flat
    (``out`` when given)."""
    _qmax(qtype)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, not {dtype}")
    _need(q, "q", torch.uint8)
    q = q.reshape(-1)
    lay = layout(qtype, count, block)
    if q.numel() != lay.nbytes:
        raise ValueError(f"q: {q.numel()} bytes, but the {qtype} form of {count} values in blocks"
                         f" of {block} takes {lay.nbytes}")
    x = _out(out, "out", count, dtype, q.device)
    if count == 0:
        return x
    codes = _codes(q, qtype, lay).view(lay.nblocks, block).to(torch.float32)
    w = (codes * _scales(q, lay)[:, None]).view(-1)[:count]
    x.copy_(w)  # to bfloat16: round to nearest even
    return x


def orth_error(v: torch.Tensor) -> torch.Tensor:
    """``||V^T V - I||_F`` of each n x n matrix of ``v`` (..., n, n), in float64."""
    v = v.detach().to(torch.float64)
    eye = torch.eye(v.shape[-1], dtype=v.dtype, device=v.device)
    return torch.linalg.matrix_norm(v.mT @ v - eye)


def rectify(v: torch.Tensor, steps: int) -> torch.Tensor:
    """``steps`` Bjorck steps ``V <- 1.5 V - 0.5 V (V^T V)`` on each n x n float32 matrix of
    ``v`` (..., n, n), any device; returns the result (v is not modified)."""
    _need(v, "v", torch.float32)
    if v.dim() < 2 or v.shape[-1] != v.shape[-2]:
        raise ValueError(f"v must be (..., n, n), not {tuple(v.shape)}")
    if not isinstance(steps, int) or not 0 <= steps <= _C.QUANT_MAX_STEPS:
        raise ValueError(f"steps {steps!r}; allowed: 0..{_C.QUANT_MAX_STEPS}")
    for _ in range(steps):
        v = 1.5 * v - 0.5 * (v @ (v.mT @ v))
    return v


# ---- libasteria's kernels on CPU tensors ----------------------------------------------------------

def quantize_host(x: torch.Tensor, qtype: str, block: int = BLOCK_DEFAULT,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``quantize`` by libasteria, for a contiguous CPU float32 tensor: the same bytes."""
    _need(x, "x", torch.float32, cpu=True)
    lay = layout(qtype, x.numel(), block)
    q = _out(out, "out", lay.nbytes, torch.uint8, torch.device("cpu"))
    _C.quant_quantize(qtype, x.detach().reshape(-1).numpy(), q.numpy(), block)
    return q


def dequantize_host(q: torch.Tensor, qtype: str, count: int, block: int = BLOCK_DEFAULT,
                    dtype: torch.dtype = torch.float32,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dequantize`` by libasteria, for a contiguous CPU uint8 tensor: the same values; the
    scales are checked (ValueError for one negative or not finite, ``out`` untouched)."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, not {dtype}")
    _need(q, "q", torch.uint8, cpu=True)
    x = _out(out, "out", count, dtype, torch.device("cpu"))
    bf16 = dtype == torch.bfloat16
    _C.quant_dequantize(qtype, q.reshape(-1).numpy(),
                        (x.view(torch.int16) if bf16 else x).numpy(), block, bf16)
    return x


def rectify_host(v: torch.Tensor, steps: int) -> List[List[float]]:
    """``steps`` Bjorck steps by libasteria on each n x n matrix of the contiguous CPU float32
    tensor ``v`` (..., n, n), IN PLACE; returns ``||V^T V - I||_F`` of each matrix before each
    step and after the last (steps 0: measures only)."""
    _need(v, "v", torch.float32, cpu=True)
    if v.dim() < 2 or v.shape[-1] != v.shape[-2]:
        raise ValueError(f"v must be (..., n, n), not {tuple(v.shape)}")
    return _C.quant_rectify(v.detach().reshape(-1).numpy(), v.shape[-1], steps)


# ---- a basis in the tiers (asteria.tiers.residency) ----------------------------------------------

def narrow(x: torch.Tensor, qtype: str, block: int = BLOCK_DEFAULT,
           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The quantized form of ``x`` (any floating dtype: its values rounded to float32 first),
    on x's device (``out`` when given): libasteria's kernel for a CPU tensor, the torch kernel
    elsewhere; the same bytes either way."""
    x = x.detach().to(torch.float32)
    if x.device.type == "cpu":
        return quantize_host(x.contiguous(), qtype, block, out=out)
    q = quantize(x, qtype, block)
    if out is None:
        return q
    out.copy_(q)
    return out


def widen(q: torch.Tensor, qtype: str, shape, block: int, steps: int,
          dtype: torch.dtype) -> torch.Tensor:
    """The n x n basis (``shape``) that the quantized form ``q`` stands for where it is used,
    on q's device: dequantized to float32, ``steps`` Bjorck steps, then in ``dtype``. The one
    computation the tiers use for it (the step's stacks, m's re-expression at an install, the
    refresh's input): Bjorck steps agree between devices and libraries only to rounding, so
    what must agree bit for bit is widened here, on one device."""
    n = int(shape[-1])
    v = dequantize(q.reshape(-1), qtype, n * n, block).view(n, n)
    return rectify(v, steps).to(dtype)
