"""The placement planner: which memory tier each piece of optimizer state lives in.

Owns: the ``Plan`` of one optimizer and the rules that make it (DESIGN.md, "Tiered state").
May call: torch, ``asteria._C`` (only to probe what the machine offers), ``asteria.tiers.quant``
(the quantized layout's size). No optimizer state.

State kinds and their life cycle
 - ``factors`` (Kronecker factors L, R / S_a, S_b, and KL-Shampoo's scales s) and ``moments``
   (Adam / momentum buffers) are read and written every step: they stay on the parameter's
   device. Nothing else is possible for them in either mode (the step computes there).
 - ``roots`` (Shampoo's Linv, Rinv) and ``eigenbases`` (SOAP's Q_L, Q_R, KL-Shampoo's Q_a, Q_b)
   are written once per refresh and read every step: in ``mode="async"`` those of a CUDA
   parameter live in host memory and reach the step through the device staging ring
   (``asteria.tiers.residency``); those of a CPU parameter are in host memory already and
   stay in optimizer.state unless the run asks for budgeting or spilling (rule 2).

Rules (``mode="async"``)
 1. factors and moments: "device". Their bytes must fit ``device_budget_bytes`` (else
    ValueError naming the key).
 2. roots / eigenbases under ``placement="auto"``: for a CUDA parameter, the host tier of its
    device: "uvm" where the device reports coherent host access to managed memory (probed
    through the store, never assumed), else "host_pinned". Where libasteria cannot reach
    the device (built without CUDA, or its CUDA runtime finds none: no driver, or one older
    than that runtime) nothing could stage a host block back into device memory, so a CUDA
    parameter's blocks stay on "device" with a decision line saying why, and an explicit
    host tier or a device budget that would spill them raises ValueError. For a parameter
    whose device is not CUDA (a CPU parameter: its device IS host memory) they stay on
    "device", i.e. in
    optimizer.state with no residency and no staging ring (a host->host copy each step buys
    nothing), unless the run asks for budgeting, spilling or narrowing: with
    ``host_budget_bytes``, ``nvme_dir``, ``device_budget_bytes`` or a narrowing
    ``tier_dtype`` (rule 5) set they go to "host" as for any host-resident
    block, so rules 3 and 4 apply (CPU-only runs can still spill to NVMe). An explicit tier
    in a placement dict replaces that preference (explicit "host" on a CPU parameter puts
    its blocks in the residency); an impossible one raises ValueError naming the key, the
    reason and the allowed tiers.
 3. device budget: roots / eigenbases placed on "device" (explicitly) are kept there in
    parameter order while ``device_budget_bytes`` allows, the rest spill to the host tier
    (roots -> host first). Whenever any block is host-resident, the staging ring is carved out
    of the budget too: it gets min(64 MiB, the bytes of all staged blocks, the headroom) and
    at least one preconditioner block's matrices (``ring_min``); the step streams stacks
    through it in chunks that fit (half the ring each when it holds two, so the next chunk's
    copy overlaps this one's use). Without a device budget the ring is bounded too: the
    larger of ``ring_min`` and an eighth of the staged bytes, at most 64 MiB and at most
    every staged block (host residency exists to save device memory; a ring as large as
    the blocks it stages would save none).
 4. host budget: host-resident blocks fill ``host_budget_bytes`` in parameter order; the
    remaining ones (the LAST parameters: they are prefetched first in backward, so their
    NVMe read has the most time) go to "nvme". Exceeding it without ``nvme_dir`` is a
    ValueError. Explicit "nvme" places every block of that kind on NVMe.
 5. stored format (``tier_dtype``): a block whose home is outside the device (host,
    host_pinned, uvm, nvme) is stored, staged through the ring and written to NVMe in
    ``stored_format(tier_dtype, its kind, dtype, shape)``: "bfloat16" narrows wider floating
    blocks, a block already that narrow (or narrower) stays as it is; "int8" / "int4"
    block-quantize float32 / float64 eigenbases of at least ``TIER_QUANT_MIN_DIM`` rows
    (``asteria/quant.h``: codes and one float32 scale per ``TIER_QUANT_BLOCK[qtype]``
    values), which are widened where used and rectified by ``TIER_RECTIFY_STEPS`` Bjorck
    steps (an eigenbasis is orthogonal: its entries are bounded and the error can be pulled
    back), while roots
    (Shampoo's inverse roots are not orthogonal: a method with roots refuses these values,
    ``check_tier_dtype``), smaller bases, factors, moments and eigenvalues keep their dtype;
    "float32" keeps every block as it is. Every byte figure of a block outside the device
    (budgets, ring, tiers, peaks, transfers) is in that format; blocks on the device and
    refresh results keep the state's dtype.
``mode="sync"`` is the native reference: everything on the parameter's device; a placement
dict naming another tier is a ValueError, budgets are reported but not enforced.
Every decision is written to ``Plan.decisions`` in plain words.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Mapping, Optional, Sequence

import torch

from asteria.config import (PLACEMENT_KINDS, TIER_QUANT_BLOCK, TIER_QUANT_MIN_DIM,
                            TIER_RECTIFY_STEPS)
from asteria.tiers import quant

log = logging.getLogger("asteria")

DEVICE_KINDS = ("factors", "moments")        # updated every step on the parameter's device
TIERED_KINDS = ("roots", "eigenbases")       # written per refresh, read every step
HOST_TIERS = ("host", "host_pinned", "uvm")  # host-addressable store tiers
RING_ALIGN = 256                             # AST_SHADOW_ALIGN
RING_DEFAULT = 64 << 20
RING_FRACTION = 8                            # default ring: 1/8 of the staged bytes (>= ring_min)
SNAPSHOT_RING_DEFAULT = 64 << 20
SNAPSHOT_RING_MIN = 64 << 10
PREPARE_CHUNK = 16 << 20                     # NVMe bytes residency reads back at a time
#: the narrowing tier dtypes (config.TIER_DTYPES; "float32" narrows nothing)
_NARROW = {"bfloat16": torch.bfloat16}
#: the quantizing ones (eigenbases only, rule 5)
QUANTIZED = tuple(TIER_RECTIFY_STEPS)


def align(n: int) -> int:
    return (n + RING_ALIGN - 1) // RING_ALIGN * RING_ALIGN


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class Stored:
    """How a block is kept outside the device (rule 5): values of ``dtype``, or with ``qtype``
    ("int8" / "int4") the quantized form of its values in blocks of ``block`` (``dtype`` is
    then torch.uint8, the bytes), widened with ``steps`` Bjorck steps."""

    dtype: torch.dtype
    qtype: Optional[str] = None
    block: int = 0
    steps: int = 0

    def nbytes(self, numel: int) -> int:
        """The bytes of a block of ``numel`` values in this form."""
        if self.qtype is None:
            return numel * _itemsize(self.dtype)
        return quant.layout(self.qtype, numel, self.block).nbytes

    def describe(self) -> str:
        return (f"{self.qtype} in blocks of {self.block}" if self.qtype
                else str(self.dtype).removeprefix("torch."))


def stored_format(tier_dtype: str, kind: str, dtype: torch.dtype, shape: Sequence[int]) -> Stored:
    """The form a block of ``kind`` ("roots", "eigenbases", ...), ``dtype`` and ``shape`` is
    kept in outside the device under the runtime key ``tier_dtype`` (rule 5)."""
    steps = TIER_RECTIFY_STEPS.get(tier_dtype)
    if steps is not None:
        square = len(shape) == 2 and shape[0] == shape[1]
        if (kind == "eigenbases" and dtype in (torch.float32, torch.float64) and square
                and shape[0] >= TIER_QUANT_MIN_DIM):
            return Stored(torch.uint8, tier_dtype, TIER_QUANT_BLOCK[tier_dtype], steps)
        return Stored(dtype)
    narrow = _NARROW.get(tier_dtype)
    if narrow is None or not dtype.is_floating_point or _itemsize(dtype) <= _itemsize(narrow):
        return Stored(dtype)
    return Stored(narrow)


def check_tier_dtype(tier_dtype: str, roots: Sequence[str]) -> None:
    """Refuse a quantizing ``tier_dtype`` for a method that keeps roots (``roots``: the names
    of its state fields of kind "roots", Shampoo's): an inverse root is not orthogonal, its
    entries are not bounded, and rectification would not pull its quantization error back."""
    if tier_dtype in QUANTIZED and roots:
        raise ValueError(
            f"runtime key 'tier_dtype': got {tier_dtype!r}; Shampoo's inverse roots "
            f"({', '.join(roots)}) are not orthogonal: the int8 / int4 tiers store eigenbases "
            "only (block-quantized, rectified where used: SOAP, one-sided SOAP, KL-Shampoo); "
            "allowed with inverse roots: " + ", ".join(f'"{t}"' for t in ("float32", "bfloat16")))


@dataclasses.dataclass(frozen=True)
class StateEntry:
    """One tensor of optimizer state, as the planner sees it."""

    pidx: int                 # the parameter's stable index
    name: str                 # its key in the parameter's state ("b0.Q1")
    kind: str                 # one of PLACEMENT_KINDS
    nbytes: int               # in its own dtype (on the device)
    device: torch.device      # the parameter's device
    dtype: Optional[torch.dtype] = None  # None: nbytes everywhere
    host_nbytes: int = -1     # outside the device (rule 5); set by make_plan
    shape: Optional[tuple] = None  # None: a root / eigenbasis is square (n x n from nbytes)

    @property
    def key(self) -> tuple[int, str]:
        return (self.pidx, self.name)


@dataclasses.dataclass
class Capabilities:
    """What this machine offers, probed (not assumed)."""

    cuda: bool
    pinned: bool
    pinned_reason: str
    uvm: bool
    uvm_reason: str

    @classmethod
    def probe(cls, need_cuda: bool) -> "Capabilities":
        from asteria import _C

        cuda = bool(torch.cuda.is_available() and _C.HAVE_CUDA)
        if not need_cuda:
            why = "the parameters are not on a CUDA device"
            return cls(cuda, False, why, False, why)
        ok = {}
        with _C.Store() as store:
            for tier in ("host_pinned", "uvm"):
                try:
                    store.free(store.alloc(tier, 4096))
                    ok[tier] = (True, "")
                except Exception as exc:  # the store says why (no device, no coherence)
                    ok[tier] = (False, str(exc))
        return cls(cuda, ok["host_pinned"][0], ok["host_pinned"][1], ok["uvm"][0],
                   ok["uvm"][1])


@dataclasses.dataclass
class Plan:
    mode: str
    tiers: dict                 # kind -> the tier asked for (after "auto" resolution)
    block_tier: dict            # (pidx, name) -> tier, for roots / eigenbases blocks
    ring_bytes: int             # device staging ring (0: nothing staged)
    ring_min: int               # the largest (parameter, block)'s staged bytes (aligned)
    snapshot_ring_bytes: int
    decisions: list = dataclasses.field(default_factory=list)
    planned_bytes: dict = dataclasses.field(default_factory=dict)  # tier -> bytes
    cuda: bool = False          # some parameter is on a CUDA device
    peak_bytes: dict = dataclasses.field(default_factory=dict)  # tier -> bytes at the peak
    peak_parts: dict = dataclasses.field(default_factory=dict)  # owner -> bytes (the sum)
    #: the CUDA device of the first CUDA parameter (-1: the current one), where a residency's
    #: staging ring and stream go
    cuda_index: int = -1
    tier_dtype: str = "float32"  # the runtime key (rule 5)
    block_kind: dict = dataclasses.field(default_factory=dict)  # (pidx, name) -> kind, tiered
    #: bytes over PCIe (CUDA parameters' blocks outside the device, in their stored form):
    #: "per_step" staged host -> device through the ring, "per_install" one install of every
    #: such block (written to its tier, and SOAP's new basis to the device for m)
    transfer_bytes: dict = dataclasses.field(default_factory=dict)

    def stored(self, key, dtype: torch.dtype, shape: Sequence[int]) -> Stored:
        """The form block ``key`` (of ``dtype`` and ``shape``) is kept in outside the device."""
        return stored_format(self.tier_dtype, self.block_kind.get(key, "roots"), dtype, shape)

    def tier(self, key) -> str:
        return self.block_tier.get(key, "device")

    @property
    def tiered(self) -> bool:
        return any(t != "device" for t in self.block_tier.values())

    def log(self) -> None:
        for line in self.decisions:
            log.info("asteria plan: %s", line)


def _mib(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"


def _check_explicit(kind: str, tier: str, mode: str, caps: Capabilities,
                    nvme_dir: Any, cuda_params: bool = False) -> None:
    def bad(why: str, allowed: Sequence[str]) -> None:
        raise ValueError(f"runtime key 'placement': {kind}={tier!r} is not possible: {why}; "
                         f"allowed for {kind}: {', '.join(repr(a) for a in allowed)}")

    if mode == "sync":
        if tier != "device":
            bad("mode 'sync' is the native reference, all state stays on the parameter's "
                "device (tiers need mode 'async')", ["device"])
        return
    if kind in DEVICE_KINDS:
        if tier != "device":
            bad(f"{kind} are updated every step on the parameter's device", ["device"])
        return
    allowed = ["device", "host"] + (["host_pinned"] if caps.pinned else []) + \
        (["uvm"] if caps.uvm else []) + (["nvme"] if nvme_dir else [])
    if cuda_params and not caps.pinned:
        allowed = ["device"]  # rule 2: nothing could bring a host block back to the device
        if tier in ("host", "nvme"):
            bad(f"a CUDA parameter's {kind} in host memory reach its step through libasteria's "
                f"CUDA staging ring, and libasteria cannot reach the device "
                f"({caps.pinned_reason})", allowed)
    if tier == "host_pinned" and not caps.pinned:
        bad(f"page-locked memory needs a CUDA device ({caps.pinned_reason})", allowed)
    if tier == "uvm" and not caps.uvm:
        bad(f"a UVM view needs coherent host access ({caps.uvm_reason})", allowed)
    if tier == "nvme" and not nvme_dir:
        bad("runtime key 'nvme_dir' is not set", allowed)


def make_plan(cfg: Any, entries: Sequence[StateEntry],
              caps: Optional[Capabilities] = None) -> Plan:
    """The plan for ``entries`` (every piece of optimizer state, in parameter order) under the
    validated RuntimeConfig ``cfg``."""
    entries = [dataclasses.replace(e, host_nbytes=_host_nbytes(e, cfg.tier_dtype))
               for e in entries]
    kinds = {e.key: e.kind for e in entries if e.kind in TIERED_KINDS}
    cuda_params = any(e.device.type == "cuda" for e in entries)
    caps = caps or Capabilities.probe(cuda_params)
    explicit = dict(cfg.placement) if isinstance(cfg.placement, Mapping) else {}
    mode = cfg.mode
    for kind, tier in explicit.items():
        _check_explicit(kind, tier, mode, caps, cfg.nvme_dir, cuda_params)
    dec: list[str] = []
    by_kind = {k: [e for e in entries if e.kind == k] for k in PLACEMENT_KINDS}
    kind_bytes = {k: sum(e.nbytes for e in v) for k, v in by_kind.items()}
    dev_budget, host_budget = cfg.device_budget_bytes, cfg.host_budget_bytes

    # rule 2: a parameter off CUDA already lives in host memory, so its roots / eigenbases
    # stay in place under "auto" unless the run asks for budgeting or spilling
    asked = [k for k, v in (("device_budget_bytes", dev_budget is not None),
                            ("host_budget_bytes", host_budget is not None),
                            ("nvme_dir", bool(cfg.nvme_dir)),
                            (f"tier_dtype {cfg.tier_dtype!r}", cfg.tier_dtype != "float32"))
              if v]
    spill_asked = bool(asked)

    def host_tier(e: StateEntry) -> str:
        if e.device.type != "cuda":
            return "host"
        return "uvm" if caps.uvm else ("host_pinned" if caps.pinned else "host")

    if mode == "sync":
        total = sum(kind_bytes.values())
        dec.append(f"mode 'sync' (native reference): all {_mib(total)} of optimizer state on "
                   "the parameters' device; REFRESH inline with torch.linalg")
        if dev_budget is not None and total > dev_budget:
            dec.append(f"device_budget_bytes {_mib(dev_budget)} is below that and is not "
                       "enforced in mode 'sync'")
        # Inline refreshes: the factorisation's outputs exist next to the bases they replace.
        parts = {"state": total, "refresh results": sum(kind_bytes[k] for k in TIERED_KINDS)}
        peak = {"device": sum(parts.values())}
        dec.append(_peak_line(peak, parts))
        return Plan(mode, {k: "device" for k in PLACEMENT_KINDS}, {}, 0, 0, 0, dec,
                    {"device": total}, cuda_params, peak, parts, tier_dtype=cfg.tier_dtype,
                    block_kind=kinds, transfer_bytes={"per_step": 0, "per_install": 0})

    tiers = {k: "device" for k in DEVICE_KINDS}
    fixed = kind_bytes["factors"] + kind_bytes["moments"]
    dec.append(f"factors ({_mib(kind_bytes['factors'])}) and moments "
               f"({_mib(kind_bytes['moments'])}) on the parameters' device: updated every step")
    if dev_budget is not None and fixed > dev_budget:
        raise ValueError(
            f"runtime key 'device_budget_bytes': got {dev_budget}; factors and moments need "
            f"{fixed} bytes on the device (they are updated every step and cannot be spilled); "
            f"allowed: None or a byte count >= {fixed}")
    block_tier: dict = {}
    staged: list[StateEntry] = []  # blocks that reach the step through the ring
    for kind in TIERED_KINDS:
        es = by_kind[kind]
        want = explicit.get(kind)
        tiers[kind] = want or "auto"
        if not es:
            continue
        if want is None:
            in_place = [e for e in es if e.device.type != "cuda" and not spill_asked]
            # a CUDA parameter's blocks leave the device only where libasteria reaches it:
            # without that, a block in host memory would reach the step as a CPU tensor
            stuck = [e for e in es if e.device.type == "cuda" and not caps.pinned]
            hosted = [e for e in es if e not in in_place and e not in stuck]
            for e in in_place + stuck:
                block_tier[e.key] = "device"
            if stuck:
                dec.append(f"{kind} ({_mib(sum(e.nbytes for e in stuck))}, {len(stuck)} blocks) "
                           "of CUDA parameters on the parameters' device: libasteria cannot "
                           f"stage them from host memory ({caps.pinned_reason}); no staging")
            for e in hosted:
                block_tier[e.key] = host_tier(e)
            if in_place:
                types = sorted({e.device.type for e in in_place})
                why = "; ".join("CPU: host memory already" if t == "cpu" else
                                f"{t}: not a CUDA device" for t in types)
                dec.append(f"{kind} ({_mib(sum(e.nbytes for e in in_place))}, "
                           f"{len(in_place)} blocks) on the parameters' device ({why}; "
                           "no staging)")
            if hosted:
                names = sorted({block_tier[e.key] for e in hosted})
                dec.append(f"{kind} ({_mib(sum(e.nbytes for e in hosted))}, {len(hosted)} "
                           f"blocks) in host memory ({', '.join(names)}): written once per "
                           "refresh, staged for each step"
                           + ("; coherent host access detected, read in place (no prefetch "
                              "copy)" if "uvm" in names else "")
                           + (f"; CPU parameters' too: {' and '.join(asked)} set "
                              "(budgeting / spilling / narrowing asked for)"
                              if any(e.device.type != "cuda" for e in hosted) else ""))
        else:
            for e in es:
                block_tier[e.key] = want if want != "host_pinned" or e.device.type == "cuda" \
                    else "host"
            dec.append(f"{kind} ({_mib(kind_bytes[kind])}, {len(es)} blocks) on {want!r} "
                       "(explicit placement)")

    tiered_entries = [e for k in TIERED_KINDS for e in by_kind[k]]

    def staged_min(es: Sequence[StateEntry], every: bool = False) -> int:
        """The ring must hold at least one preconditioner block's staged matrices (the unit
        the step streams: one (parameter, block) with all its dimensions). ``every``: count
        blocks wherever they are (the reserve before spilling)."""
        per_block: dict = {}
        for e in es:
            if every or block_tier[e.key] in ("host", "host_pinned", "nvme"):
                unit = (e.pidx, e.name.split(".")[0])
                per_block[unit] = per_block.get(unit, 0) + align(e.host_nbytes)
        return max(per_block.values(), default=0)

    # device budget: explicit device blocks in parameter order, the rest spill to host
    on_dev = [e for e in tiered_entries if block_tier[e.key] == "device"]
    if dev_budget is not None and on_dev:
        room = dev_budget - fixed
        if sum(e.nbytes for e in on_dev) > room:
            # something spills, so a staging ring is needed: reserve it before filling
            room -= staged_min(tiered_entries, every=True)
            kept, spilled = 0, []
            for e in sorted(on_dev, key=lambda e: (e.pidx, e.name)):
                if e.nbytes <= room:
                    room -= e.nbytes
                    kept += e.nbytes
                else:
                    spilled.append(e)
                    room = -1  # keep parameter order: no later block jumps the queue
            stuck = [e for e in spilled if e.device.type == "cuda" and not caps.pinned]
            if stuck:
                need = fixed + sum(e.nbytes for e in on_dev)
                raise ValueError(
                    f"runtime key 'device_budget_bytes': got {dev_budget}; {len(stuck)} "
                    f"root/eigenbasis blocks of CUDA parameters cannot be spilled to host "
                    f"memory: libasteria cannot stage them back to the device "
                    f"({caps.pinned_reason}); allowed: None or a byte count >= {need}")
            for e in spilled:
                block_tier[e.key] = host_tier(e)
            dec.append(f"device_budget_bytes {_mib(dev_budget)}: {len(spilled)} root/eigenbasis "
                       f"blocks ({_mib(sum(e.nbytes for e in spilled))}) spilled from device to "
                       f"host memory; {_mib(kept)} kept on device")

    # host budget: host-resident blocks in parameter order, the rest to NVMe
    on_host = [e for e in tiered_entries if block_tier[e.key] in HOST_TIERS]
    host_bytes = sum(e.host_nbytes for e in on_host)
    if host_budget is not None and host_bytes > host_budget:
        if not cfg.nvme_dir:
            raise ValueError(
                f"runtime key 'host_budget_bytes': got {host_budget}; roots and eigenbases need "
                f"{host_bytes} bytes of host memory and no 'nvme_dir' is set to spill to; "
                f"allowed: None, a byte count >= {host_bytes}, or set 'nvme_dir'")
        room, spilled = host_budget, []
        for e in sorted(on_host, key=lambda e: (e.pidx, e.name)):
            if e.host_nbytes <= room and not spilled:
                room -= e.host_nbytes
            else:
                spilled.append(e)
        for e in spilled:
            block_tier[e.key] = "nvme"
        dec.append(f"host_budget_bytes {_mib(host_budget)}: {len(spilled)} blocks "
                   f"({_mib(sum(e.host_nbytes for e in spilled))}) of the last parameters "
                   f"spilled to NVMe under {cfg.nvme_dir} (read back, checksummed, for each "
                   "step)")
    elif host_budget is not None:
        dec.append(f"host_budget_bytes {_mib(host_budget)}: all {_mib(host_bytes)} of host-"
                   "resident blocks fit")

    # the staging ring
    staged = [e for e in tiered_entries if block_tier[e.key] in ("host", "host_pinned", "nvme")]
    ring_min = staged_min(tiered_entries)
    ring = 0
    if staged:
        total = sum(align(e.host_nbytes) for e in staged)
        # without a budget: a bounded ring (host residency is there to save device memory);
        # with one: whatever the budget leaves, up to every staged block
        ring = min(RING_DEFAULT, total) if dev_budget is not None else \
            min(RING_DEFAULT, total, max(ring_min, align(total // RING_FRACTION)))
        if dev_budget is not None:
            dev_now = fixed + sum(e.nbytes for e in tiered_entries
                                  if block_tier[e.key] == "device")
            headroom = dev_budget - dev_now
            if headroom < ring_min:
                raise ValueError(
                    f"runtime key 'device_budget_bytes': got {dev_budget}; the state that must "
                    f"stay on the device takes {dev_now} bytes and the staging ring needs at "
                    f"least {ring_min} bytes (one preconditioner block's roots/eigenbases); "
                    f"allowed: None or a byte count >= {dev_now + ring_min}")
            ring = min(ring, headroom)
        # whole slots (ring_min is aligned): rounding down keeps the ring inside the budget
        ring = max(ring_min, ring // RING_ALIGN * RING_ALIGN)
        dec.append(f"device staging ring of {_mib(ring)} for {len(staged)} host/NVMe blocks "
                   f"({_mib(total)}); steps stream them through it"
                   + (" in chunks" if ring < total else ""))
    # snapshot ring: the inputs of the refreshes in flight; with S <= f a block has at most one
    # refresh in flight, so every factor and its basis once (jobs beyond it use private buffers)
    snap_need = sum(align(e.nbytes) for e in entries if e.kind in ("factors",) + TIERED_KINDS)
    snap = min(SNAPSHOT_RING_DEFAULT, max(SNAPSHOT_RING_MIN, 2 * snap_need))
    if "nvme" in block_tier.values():
        # host memory is what is short: the ring holds one round's factors (a round's bases are
        # given to its jobs, not snapshotted; a job that finds no room uses a private buffer)
        snap = min(snap, max(SNAPSHOT_RING_MIN,
                             sum(align(e.nbytes) for e in entries if e.kind == "factors")))
    planned: dict = {}
    for e in entries:
        t = block_tier.get(e.key, "device")
        planned[t] = planned.get(t, 0) + (e.nbytes if t == "device" else e.host_nbytes)
    planned["device"] = planned.get("device", 0) + ring
    dec.extend(_format_lines(cfg.tier_dtype, [e for e in tiered_entries
                                              if block_tier[e.key] != "device"]))
    peak, parts = _peaks(entries, block_tier, planned, snap, cuda_params, ring)
    dec.append(_peak_line(peak, parts))
    cuda_index = next((e.device.index for e in entries
                       if e.device.type == "cuda" and e.device.index is not None), -1)
    off = [e for e in tiered_entries if block_tier[e.key] != "device" and e.device.type == "cuda"]
    transfer = {"per_step": sum(e.host_nbytes for e in off
                                if block_tier[e.key] in ("host", "host_pinned", "nvme")),
                "per_install": sum(e.host_nbytes for e in off)}
    return Plan(mode, tiers, block_tier, ring, ring_min, snap, dec, planned, cuda_params, peak,
                parts, cuda_index, tier_dtype=cfg.tier_dtype, block_kind=kinds,
                transfer_bytes=transfer)


def _shape(e: StateEntry) -> tuple:
    if e.shape is not None:
        return tuple(e.shape)
    numel = e.nbytes // _itemsize(e.dtype)
    n = math.isqrt(numel)
    return (n, n) if n * n == numel else (numel,)


def _host_nbytes(e: StateEntry, tier_dtype: str) -> int:
    if e.dtype is None or e.kind not in TIERED_KINDS:
        return e.nbytes
    return stored_format(tier_dtype, e.kind, e.dtype, _shape(e)).nbytes(
        e.nbytes // _itemsize(e.dtype))


def _format_lines(tier_dtype: str, outside: Sequence[StateEntry]) -> list:
    """The decision lines of rule 5 for the blocks outside the device."""
    if tier_dtype == "float32":
        return []
    changed = [e for e in outside if e.host_nbytes != e.nbytes]
    if not changed:
        return [f"tier_dtype {tier_dtype!r}: no block outside the device is "
                + ("an eigenbasis of float32 / float64 of at least "
                   f"{TIER_QUANT_MIN_DIM} x {TIER_QUANT_MIN_DIM}, nothing is quantized"
                   if tier_dtype in QUANTIZED else "wider, nothing is narrowed")]
    was, now = _mib(sum(e.nbytes for e in changed)), _mib(sum(e.host_nbytes for e in changed))
    if tier_dtype not in QUANTIZED:
        return [f"tier_dtype {tier_dtype!r}: {len(changed)} root/eigenbasis blocks outside the "
                f"device stored and moved as {tier_dtype} ({now} instead of {was}), widened to "
                "their state's dtype where the step and the refresh use them"]
    kept = len(outside) - len(changed)
    return [f"tier_dtype {tier_dtype!r}: {len(changed)} eigenbasis blocks outside the device "
            f"stored and moved block-quantized ({tier_dtype}, one float32 scale per "
            f"{TIER_QUANT_BLOCK[tier_dtype]} values: {now} instead of {was}), widened and "
            f"rectified ({TIER_RECTIFY_STEPS[tier_dtype]} Bjorck steps) where the step and the "
            "refresh use them"
            + (f"; {kept} smaller or non-eigenbasis blocks kept in their dtype" if kept else "")]


def _peaks(entries: Sequence[StateEntry], block_tier: dict, planned: dict, snap: int,
           cuda: bool, ring: int) -> tuple[dict, dict]:
    """Peak optimizer-state bytes per tier in mode "async", and by owner: the steady state
    (planned) plus what a step and a refresh hold at once: the snapshot ring (the refresh
    inputs in flight), the results of one refresh round waiting for install (S <= f: at most one
    round per block), SOAP's re-expressed moments while the rotation runs (for parameters whose
    bases are NVMe-homed one chunk's rotation at a time: its m, result and (old, new) basis
    pairs, each chunk at most the ring), and for NVMe-homed blocks the host memory they stream
    through (tiers/residency.py): blocks fetched early (at most PREPARE_CHUNK) and one chunk
    read back (the larger of PREPARE_CHUNK, a ring chunk and the largest NVMe block); their
    installs are written through one block at a time, inside that."""
    tiered = [e for e in entries if e.kind in TIERED_KINDS]
    nv_blocks = [e for e in tiered if block_tier.get(e.key) == "nvme"]
    nvme = sum(e.host_nbytes for e in nv_blocks)  # in the tier dtype, as they stream
    results = sum(e.nbytes for e in tiered)  # refresh results are in the state's dtype
    nv_params = {e.pidx for e in nv_blocks if e.kind == "eigenbases"}
    rotating = {e.pidx for e in tiered if e.kind == "eigenbases"}
    mom = {i: sum(e.nbytes for e in entries if e.kind == "moments" and e.pidx == i)
           for i in rotating}
    moments = sum(b for i, b in mom.items() if i not in nv_params)
    if nv_params:
        whole = sum(mom[i] for i in nv_params) + 2 * sum(
            e.nbytes for e in nv_blocks if e.kind == "eigenbases")
        moments += min(whole, 4 * max(ring, PREPARE_CHUNK))
    largest = max((e.host_nbytes for e in nv_blocks), default=0)
    stream = min(nvme, PREPARE_CHUNK) + min(nvme, max(PREPARE_CHUNK, ring, largest))
    host_side = "host_pinned" if cuda else "host"
    parts = {"state": sum(planned.values()), "snapshot ring": snap, "refresh results": results,
             "rotated moments": moments, "nvme stream buffers": stream}
    peak = dict(planned)
    peak[host_side] = peak.get(host_side, 0) + snap + results + stream
    peak["device" if not cuda else host_side] = peak.get("device" if not cuda else host_side,
                                                         0) + moments
    return peak, parts


def _peak_line(peak: dict, parts: dict) -> str:
    return ("peak optimizer-state bytes, planned before training: " +
            ", ".join(f"{t} {_mib(b)}" for t, b in sorted(peak.items()) if b) +
            f" (total {_mib(sum(peak.values()))}: " +
            ", ".join(f"{k} {_mib(b)}" for k, b in parts.items() if b) + ")")
