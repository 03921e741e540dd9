"""The bytes of the roots / eigenbases the planner prices: what the tiers hold and what a round
copies between the host and the device.

Tier dtypes (``tier_bytes``): per GPU and per ``tier_dtype`` (float32, bfloat16, int8, int4:
eigenbases block-quantized in libasteria's layout, ``asteria.tiers.quant.layout``), the bytes
of the roots / eigenbases in host memory (or on NVMe), of a round's installs over PCIe and of
what the staging ring copies per step. A REFRESH on the host workers copies each factor it
decomposes from the device (the snapshot, n x n float32) and each result back (the install:
the n x n basis or root as the tier stores it, ``stored_bytes``, and SOAP's sort order, n
int64); the bases and roots themselves live in host memory (placement "auto"), so the snapshot
does not copy them: those bytes per round are ``transfer_bytes``.

The compute a quantized tier adds (``widen_flops``): every step widens each quantized basis on
the device, ``TIER_RECTIFY_STEPS`` Bjorck steps of two n x n products (4 n^3 FLOPs each), as the
staging ring hands it out.

Owns: ``output_kind``, ``stored_bytes``, ``tier_bytes``, ``transfer_bytes``, ``widen_flops``.
May call:
``asteria.optim.method`` (a method's outputs and state kinds), ``asteria.config``
(TIER_DTYPES), ``asteria.tiers.plan`` (the stored format, the tier dtype check), torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch

from asteria.config import TIER_DTYPES
from asteria.optim.method import method_of
from asteria.tiers.plan import check_tier_dtype, stored_format


def output_kind(optimizer: str) -> str:
    """"eigenbases" or "roots": the kind of the method's REFRESH output."""
    return next(f.kind for f in method_of(optimizer).METHOD.STATE
                if f.kind in ("roots", "eigenbases"))


def stored_bytes(n: int, tier_dtype: str, kind: str = "eigenbases") -> int:
    """Bytes of one n x n float32 root or eigenbasis (``kind``) outside the device under
    ``tier_dtype``, in the form the runtime keeps it (``tiers.plan.stored_format``: 4 or 2 a
    value, or block-quantized as libasteria lays it out). ValueError for a tier_dtype the
    runtime does not know, and for a quantized one with roots (``check_tier_dtype``: an
    inverse root is not orthogonal)."""
    if tier_dtype not in TIER_DTYPES:
        raise ValueError(f"tier_dtype={tier_dtype!r}: allowed: {', '.join(TIER_DTYPES)}")
    check_tier_dtype(tier_dtype, [kind] if kind == "roots" else [])
    return stored_format(tier_dtype, kind, torch.float32, (n, n)).nbytes(n * n)


def tier_bytes(held: Counter, optimizer: str, tier_dtype: str) -> Optional[dict]:
    """One GPU's bytes under ``tier_dtype`` for the factors it holds {size n: count} (its
    shard's, replicated or not), placement "auto" in mode "async": ``host`` (the roots /
    eigenbases in host memory; the same payload on NVMe when spilled), ``install_h2d`` (a
    round's installs: the new bases as stored, plus the extra outputs), ``step_h2d`` (what the
    staging ring copies to the device every step: every basis as stored), ``widen_flops``
    (``widen_flops``: the step's rectification of them). None where the runtime refuses the
    dtype for the method (roots quantized)."""
    kind = output_kind(optimizer)
    try:
        host = sum(k * stored_bytes(n, tier_dtype, kind) for n, k in held.items())
    except ValueError:
        return None
    return {"host": host, "install_h2d": transfer_bytes(held, optimizer, tier_dtype)[1],
            "step_h2d": host, "bases": sum(held.values()),
            "widen_flops": widen_flops(held, tier_dtype)}


def widen_flops(held: Counter, tier_dtype: str) -> int:
    """FLOPs one step spends rectifying the quantized bases of {size n: count} where it widens
    them: the Bjorck steps ``V <- 1.5 V - 0.5 V (V^T V)`` of the form the tier keeps each basis
    in (``stored_format``: ``TIER_RECTIFY_STEPS`` for a quantized one, none for a basis kept as
    it is or narrowed by a cast), 4 n^3 FLOPs each."""
    return sum(k * stored_format(tier_dtype, "eigenbases", torch.float32, (n, n)).steps
               * 4 * n ** 3 for n, k in held.items())


def transfer_bytes(sizes: Counter, optimizer: str,
                   tier_dtype: str = "float32") -> tuple[int, int]:
    """(device-to-host, host-to-device) bytes of a REFRESH round on the host workers of
    float32 factors {size n: count}: each snapshot copies its factor (n x n), each install its
    outputs (the n x n basis or root as the tier stores it, ``stored_bytes``, and the method's
    extra outputs: SOAP's sort order, n int64)."""
    extra = sum(torch.empty((), dtype=d).element_size()
                for d in method_of(optimizer).METHOD.EXTRA_OUTPUTS)
    kind = output_kind(optimizer)
    d2h = sum(k * n * n * 4 for n, k in sizes.items())
    h2d = sum(k * (stored_bytes(n, tier_dtype, kind) + n * extra) for n, k in sizes.items())
    return d2h, h2d
