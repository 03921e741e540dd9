"""Residency of roots and eigenbases outside the device: host / pinned / UVM / NVMe blocks in a
``_C.Store``, staged for each step through the bounded device ring of a ``_C.Shadow``.

Owns: one store, one shadow (prefetch ring; the snapshot ring is the engine's), the block table
``(param index, state name) -> _Blk``, the copy counters and the copy events written to the
runtime's trace (on its ``TraceLane`` tracks) through the optimizer's one ``Tracer``, which it is
given (``tracer=``: the engine's, asteria.refresh.engine, "The trace"); it builds none. May call: torch, ``asteria._C``,
``asteria.tiers.plan``, ``asteria.tiers.quant`` (quantized bases), ``asteria.refresh.engine``
(the trace lane names).
Single-threaded: the optimizer's training thread (and the hooks it runs on that thread).

Data flow of one block (its plan gives a home tier: host, host_pinned, uvm or nvme)
 - stored format: every block is kept, copied and written to NVMe in
   ``plan.stored(key, its dtype, its shape)`` (tiers/plan.py rule 5; narrowed once, at the
   write). A narrowed block: what leaves the residency for use (``read_host``,
   ``materialize``) is widened to the block's own dtype here, and ``borrow``'s ring views
   (stored dtype) are widened where they are stacked (``optim/placement.py``, ``stack``;
   ``dtype_of`` says to what). A quantized eigenbasis (int8 / int4): its bytes are the
   quantized form (the store's block format, so its NVMe records name it and a record of
   another format is refused); a CPU value is quantized by libasteria, a CUDA one on its
   device, before the block is touched (a value with no quantized form changes nothing), and
   the bytes copied in. Where it is used it is widened and rectified (``quant.widen``) on the
   device that uses it: ``borrow`` widens the ring slot's bytes on the step's device (so only
   quantized bytes cross PCIe), ``read_host`` / ``job_input`` on the host for the refresh,
   ``as_stored`` a new basis on m's device exactly as the step will. ``materialize``
   (checkpoints, the state proxy) gives the stored value, dequantized but not rectified:
   quantizing it again gives the same bytes (``asteria.tiers.quant``), so a checkpoint
   resumes bit for bit.
 - write (first-step eigenbasis, install of a refresh, load_state_dict): into the block's
   host memory in place; a block whose home is NVMe is written to fresh host memory and
   written through to NVMe at once (one block of host memory at a time, not every install of
   the step). A write-through that fails keeps the block in host memory: it goes back to NVMe
   at the step end (best effort) or at the next step's ``prepare`` (raising).
 - NVMe blocks STREAM through the step: no step holds a host copy of every NVMe block. A read
   back makes the store's record stale (the store rewrites it in place at the next write), so
   every read is followed by a write of the same bytes once they are used; host memory for
   NVMe blocks is one chunk at a time (``PREPARE_CHUNK`` in ``prepare``, one ring chunk in
   ``borrow``, one block in ``read_host``), plus at most ``PREPARE_CHUNK`` fetched early.
 - ``prepare`` (start of ``step()``, before ANYTHING is mutated): the verify pass. Every NVMe
   record the step needs is read back (verified by its CRC) and written out again, one
   ``PREPARE_CHUNK`` at a time, and every NVMe-homed block still in host memory (a failed
   write-through) is written out. Any failure (ENOSPC, a missing or unreadable record, a
   checksum mismatch) raises ``TieredStateError`` naming the block, the file and the cause,
   and the step is not applied. The price of streaming: each NVMe block is read and written
   twice per step (here, and where it is used) instead of once into a step-long cache.
 - ``borrow`` (inside the step, per stack chunk): the chunk's NVMe blocks are read back (one
   batch), each block is prefetched into a ring slot (H2D on the shadow stream; a memcpy on
   the host path), the NVMe blocks are written out again once their copy has landed, the
   consuming stream waits on each slot's ready event only, the caller stacks the slot views
   and ``give_back`` releases the slots (``release_after`` the current stream on CUDA). A UVM
   block is read in place. A read that fails here (a record damaged between this step's
   verify pass and its use: nothing of Asteria's own does that) raises ``TieredStateError``
   saying that the step is PARTLY applied: stacks before this chunk were updated. Keeping the
   all-or-nothing promise for that case too would need every NVMe block in host memory for
   the whole step, which is what streaming removes.
 - ``prefetch`` (backward-pre hooks, start of ``step()``): the same ring copies ahead of time,
   as far as the ring has room (blocks on NVMe are staged by ``borrow``); the forward hooks
   fetch NVMe blocks into host memory early, at most ``PREPARE_CHUNK`` bytes of them, which
   the verify pass then needs not read. Prefetching never raises; the step re-does what failed
   and raises there.
Between steps the ring holds nothing: every slot is released at the step end, and every
NVMe-homed block is on NVMe (unless a write failed).

Stream ordering (CUDA; all on the parameters' device, ``plan.cuda_index``)
 - ring slots: the H2D copy runs on the shadow stream and records the block's ``slot_event``
   (on an ExternalStream over it); ``borrow`` makes the current stream wait on that event
   before the stack reads the slot; ``give_back`` releases the slot ``release_after`` the
   current stream, so the ring reuses its bytes only once the reads queued there have passed
   (asteria/shadow.h). The copy reads the block's host memory: before a host write, move or
   free of a block with a slot, ``_quiesce`` waits for its copy (``prefetch_wait``).
 - UVM blocks: read in place by kernels queued on the current stream (``borrow`` hands out a
   CUDA view of managed memory). ``give_back`` records the block's ``read_event`` there, and
   ``_quiesce`` waits for it before any host write, move or free: an install from host
   tensors (Shampoo's roots, SOAP's first bases) is a plain memcpy into the block, which
   would otherwise race the step's queued reads and leave them a torn mix of old and new
   values. A write from a CUDA tensor is a D2H copy on the current stream, behind its reads.

Views: every tensor over store or ring memory comes from ``torch.from_dlpack`` on a capsule of
``asteria._C`` (``Store.view`` for host views and UVM blocks, ``Shadow.slot_view`` for ring
slots), with the block's stored dtype (bfloat16 included) and shape; a quantized block's bytes
as int32 words (its size is a multiple of 4, quant.h; the views' dtypes have no byte type),
reinterpreted as bytes in torch (``view(torch.uint8)``, no copy). A store view pins its block
while it lives (move, free and the store's close raise BusyError: drop host views soon); a
ring view keeps the shadow's rings allocated, even past ``close``, but its contents are the
slot's only until the slot is released.

A filesystem without O_DIRECT makes the store fall back to buffered I/O (its stats say
``nvme_direct`` False); the residency warns once per directory (RuntimeWarning naming it).
Fork: the store's fork handler gives a forked child its own io_uring ring and records and never
lets it touch the parent's (asteria/store.h), so a child's finalizer closing this residency
cannot harm the parent.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import re
import time
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from asteria import _C
from asteria.refresh.engine import NO_TRACE, TraceLane
from asteria.tiers import quant
from asteria.tiers.plan import PREPARE_CHUNK, Plan, Stored, align

log = logging.getLogger("asteria")

def _chunks(blks: list, limit: int) -> list:
    """blks in order, cut into runs of at most ``limit`` bytes (a larger block alone)."""
    out, cur, n = [], [], 0
    for b in blks:
        if cur and n + b.nbytes > limit:
            out.append(cur)
            cur, n = [], 0
        cur.append(b)
        n += b.nbytes
    if cur:
        out.append(cur)
    return out


class TieredStateError(RuntimeError):
    """A tier operation failed before the step changed anything. ``cause`` is the store's
    exception, ``blocks`` the (param index, state name) keys involved, ``files`` their record
    files where known."""

    def __init__(self, message: str, cause: BaseException, blocks: list, files: list):
        super().__init__(message)
        self.cause = cause
        self.code = getattr(cause, "code", None)
        self.blocks = blocks
        self.files = files


class _Blk:
    __slots__ = ("key", "home", "shape", "dtype", "fmt", "sdtype", "sshape", "nbytes", "device",
                 "sid", "version", "slot", "slot_version", "slot_ptr", "slot_event", "consumed",
                 "read_event")

    def __init__(self, key, home, shape, dtype, fmt: Stored, device):
        self.key = key
        self.home = home
        self.shape = tuple(shape)
        self.dtype = dtype      # the state's (what users of the block see)
        self.fmt = fmt          # how it is stored: host memory, ring slots, NVMe records
        self.nbytes = fmt.nbytes(int(torch.Size(shape).numel()))
        # the elements of views of it: a quantized form is viewed as int32 words (its size is
        # a multiple of 4: quant.h), reinterpreted as its bytes where used (view(torch.uint8))
        self.sdtype = torch.int32 if fmt.qtype else fmt.dtype
        self.sshape = (self.nbytes // 4,) if fmt.qtype else self.shape
        self.device = device
        self.sid = 0
        self.version = 0
        self.slot = 0            # ring key while staged
        self.slot_version = -1
        self.slot_ptr = 0
        self.slot_event = None   # torch.cuda.Event on the CUDA path
        self.consumed = False
        self.read_event = None   # UVM: after the reads of its last borrow (module doc)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class OnNvme:
    """A block on NVMe handed out as a job input (``Residency.job_input``): read into the
    job's stack when the stack is made, one block at a time."""

    __slots__ = ("_res", "key", "shape", "dtype", "device")

    def __init__(self, res: "Residency", key, shape, dtype):
        self._res, self.key, self.shape, self.dtype = res, key, tuple(shape), dtype
        self.device = torch.device("cpu")

    def read_into(self, out: torch.Tensor) -> None:
        self._res.read_host(self.key, out=out)


def _libc_trim() -> Optional[Callable]:
    """glibc's ``malloc_trim``, or None elsewhere (musl, macOS)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_MALLOC_TRIM = _libc_trim()


#: directories already reported as lacking O_DIRECT (one warning per directory and process)
_BUFFERED_DIRS: set = set()


def _warn_buffered(nvme_dir) -> None:
    """The NVMe tier fell back to buffered I/O (the store's probe found no O_DIRECT there):
    say so once per directory, naming it."""
    path = os.path.realpath(os.fsdecode(nvme_dir))
    if path in _BUFFERED_DIRS:
        return
    _BUFFERED_DIRS.add(path)
    warnings.warn(f"asteria: nvme_dir {path!r} is on a filesystem without O_DIRECT; the NVMe "
                  "tier falls back to buffered I/O with an fdatasync per record (slower, and it "
                  "goes through the page cache). Use a directory on a filesystem that supports "
                  "O_DIRECT (ext4, xfs, ...) for the NVMe tier's full bandwidth",
                  RuntimeWarning, stacklevel=4)


class Residency:
    """The host/NVMe side of one optimizer's roots and eigenbases (see the module doc)."""

    #: the store's NVMe byte cap (0: the filesystem decides). A knob for operators and tests.
    nvme_budget_bytes = 0

    def __init__(self, plan: Plan, cfg: Any, *, tracer: Optional[Callable] = None,
                 describe: Optional[Callable] = None) -> None:
        self.plan = plan
        self._cfg = cfg
        self._trace = tracer or NO_TRACE
        self._describe = describe or (lambda key: f"param {key[0]} state {key[1]!r}")
        self.store = _C.Store(nvme_dir=cfg.nvme_dir, direct="fallback",
                              nvme_budget_bytes=int(self.nvme_budget_bytes)) \
            if cfg.nvme_dir else _C.Store()
        if cfg.nvme_dir and not self.store.stats()["nvme_direct"]:
            _warn_buffered(cfg.nvme_dir)
        cuda = plan.cuda and torch.cuda.is_available() and _C.HAVE_CUDA
        nblocks = max(8, len(plan.block_tier) + 8)
        self.shadow = _C.Shadow(mode="auto" if cuda else "host",
                                prefetch_ring_bytes=plan.ring_bytes,
                                snapshot_ring_bytes=4096, slots=nblocks,
                                device=plan.cuda_index if cuda else -1) \
            if plan.ring_bytes else None
        self.cuda = bool(self.shadow is not None and self.shadow.stats()["is_cuda"])
        self._ext_stream = None
        self._device = None  # the ring's CUDA device
        if self.cuda:
            self._device = torch.device("cuda", self.shadow.stats()["device"])
            self._ext_stream = torch.cuda.ExternalStream(self.shadow.stream_handle(),
                                                         device=self._device)
        self._blocks: dict = {}
        self._slots: "collections.OrderedDict[int, _Blk]" = collections.OrderedDict()
        self._next_slot = 1
        self._early: set = set()  # keys of NVMe blocks fetched early (clean, in host memory)
        # With an NVMe tier (host memory is what is short): after prepare's verify pass and at
        # each step end, hand the heap pages that the step's and the refresh's transient
        # buffers freed back to the kernel. glibc keeps them otherwise (its mmap threshold rises
        # to the largest block freed, so later blocks of up to 32 MiB come from heaps it does
        # not return), and under a memory cap retained memory counts as much as live memory.
        self._trim = _MALLOC_TRIM if cfg.nvme_dir else None
        self._in_step = False
        self.deferred_error: Optional[BaseException] = None  # last early fetch that failed
        self.counters = {"bytes_h2d": 0, "bytes_d2h": 0, "prefetches": 0, "prefetch_hits": 0,
                         "prefetches_ahead": 0, "prefetch_busy": 0, "ring_evictions": 0,
                         "nvme_window_bytes": 0, "nvme_fetches_early": 0,
                         "nvme_spill_deferred": 0, "nvme_writes_deferred": 0}
        self._closed = False

    # ---- the block table ------------------------------------------------------------------------
    def owns(self, key) -> bool:
        return self.plan.tier(key) != "device"

    def has(self, key) -> bool:
        return key in self._blocks

    def keys(self) -> list:
        return list(self._blocks)

    def dtype_of(self, key) -> torch.dtype:
        """The block's own dtype (``borrow``'s views are in the stored one)."""
        return self._blocks[key].dtype

    def record_path(self, key) -> str:
        """The record file of a block now on NVMe (diagnostics, fault tests)."""
        return self.store.record_path(self._blocks[key].sid)

    def on_nvme(self) -> list:
        return [k for k, b in self._blocks.items() if self.store.tier(b.sid) == "nvme"]

    def _label(self, blk: _Blk) -> str:
        return self._describe(blk.key)

    # ---- writes ----------------------------------------------------------------------------------
    def write(self, key, value: torch.Tensor) -> None:
        """Set a block's value (creating the block on first write). A value a quantized block
        cannot hold (NaN or Inf) raises ValueError naming the block before anything changes."""
        fmt = self.plan.stored(key, value.dtype, value.shape)
        q = self._quantized(key, fmt, value) if fmt.qtype else None
        blk = self._blocks.get(key)
        if blk is None or blk.shape != tuple(value.shape) or blk.dtype != value.dtype:
            if blk is not None:
                self.drop(key)
            home = self.plan.tier(key)
            blk = _Blk(key, home, value.shape, value.dtype, fmt, value.device)
            blk.sid = self._alloc(blk, "host" if home == "nvme" else home)
            self._blocks[key] = blk
        else:
            self._quiesce(blk)
            if self.store.tier(blk.sid) == "nvme":
                # the record keeps the old value until the block is spilled again
                sid = self._alloc(blk, "host")
                self.store.free(blk.sid)
                blk.sid = sid
        self._early.discard(key)
        view = self._host_view(blk)
        if q is not None:
            view.view(torch.uint8).copy_(q)  # the quantized form's bytes (D2H from a device)
        else:
            view.copy_(value.reshape(view.shape))  # narrowed here (round to nearest even)
        del view
        if value.device.type == "cuda":
            self.counters["bytes_d2h"] += blk.nbytes
        blk.version += 1
        if blk.home == "nvme":
            self._write_out([blk])

    def _alloc(self, blk: _Blk, tier: str) -> int:
        """A store block for blk in tier, in blk's format."""
        sid = self.store.alloc(tier, blk.nbytes)
        if blk.fmt.qtype:
            self.store.set_format(sid, blk.fmt.qtype, blk.fmt.block)
        return sid

    def _quantized(self, key, fmt: Stored, value: torch.Tensor) -> torch.Tensor:
        """value's quantized form, where value is (libasteria's kernel on the host)."""
        try:
            return quant.narrow(value, fmt.qtype, fmt.block)
        except (ValueError, _C.AsteriaError) as exc:  # NaN or Inf: no quantized form
            raise ValueError(f"asteria: {self._describe(key)} cannot be stored as "
                             f"{fmt.describe()} (tier_dtype {fmt.qtype!r}): {exc}") from None

    def as_stored(self, key, value: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``value`` on ``device`` as block ``key`` will hold it once written and as the step
        will see it there: rounded through a narrow dtype, or quantized (where value is, the
        bytes moved) and widened and rectified on ``device`` by ``borrow``'s computation."""
        fmt = self.plan.stored(key, value.dtype, value.shape)
        if fmt.qtype:
            q = quant.narrow(value, fmt.qtype, fmt.block).to(device)
            return quant.widen(q, fmt.qtype, value.shape, fmt.block, fmt.steps, value.dtype)
        if fmt.dtype != value.dtype:
            value = value.to(fmt.dtype).to(value.dtype)
        return value.to(device)

    def _widened(self, blk: _Blk, raw: torch.Tensor, rectified: bool = True) -> torch.Tensor:
        """A new tensor of blk's value from its stored elements ``raw`` (a view of its host
        memory, a ring slot or a UVM block), on raw's device, in blk's dtype."""
        if blk.fmt.qtype:
            return quant.widen(raw.view(torch.uint8), blk.fmt.qtype, blk.shape, blk.fmt.block,
                               blk.fmt.steps if rectified else 0, blk.dtype)
        return raw.to(blk.dtype, copy=True)

    def drop(self, key) -> None:
        blk = self._blocks.pop(key, None)
        if blk is not None:
            self._quiesce(blk)
            self._early.discard(key)
            self.store.free(blk.sid)

    def clear(self) -> None:
        for key in list(self._blocks):
            self.drop(key)

    # ---- host reads (job inputs, checkpoints) ----------------------------------------------------
    def _host_view(self, blk: _Blk) -> torch.Tensor:
        """A CPU tensor over the block's host memory (its stored elements); it pins the block
        while alive."""
        return torch.from_dlpack(self.store.view(blk.sid, blk.sdtype, blk.sshape))

    def read_host(self, key, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The block's value as a CPU tensor in its own dtype, as the refresh uses it (a
        quantized basis widened and rectified), copied into ``out`` when given; else a view of
        its host memory (drop it soon: it pins the block), or a widened copy of a narrowed or
        quantized block, or for a block on NVMe a copy read back (verified) for this call, the
        record written out again."""
        blk = self._blocks[key]
        on_nvme = self.store.tier(blk.sid) == "nvme"
        if on_nvme:
            self._nvme_move([blk], "host", "read")
        view = self._host_view(blk)
        if out is not None:
            out.copy_(self._widened(blk, view) if blk.fmt.qtype else view)
        elif on_nvme or blk.sdtype != blk.dtype:
            out = self._widened(blk, view)
        else:
            return view
        del view
        if on_nvme:
            self._write_out([blk])
        return out

    def job_input(self, key) -> Any:
        """A block as a REFRESH job input: its host value, or for a block on NVMe an
        ``OnNvme`` that the job's stack reads when it is made (``read_into``), so a round's
        inputs never hold a host copy of every NVMe block next to the stack."""
        blk = self._blocks[key]
        if self.store.tier(blk.sid) == "nvme":
            return OnNvme(self, key, blk.shape, blk.dtype)
        return self.read_host(key)

    def materialize(self, keys: Iterable, rectified: bool = False) -> dict:
        """Copies of blocks as tensors on their parameters' devices: their stored values
        (checkpoints, the state proxy), a quantized basis dequantized; ``rectified``: as the
        step uses them (a block moving to the device). Blocks on NVMe are read back (verified)
        and written out again."""
        keys = [k for k in keys if k in self._blocks]
        on_nvme = [self._blocks[k] for k in keys if self.store.tier(self._blocks[k].sid) == "nvme"]
        self._nvme_move(on_nvme, "host", "read")
        out = {}
        for k in keys:
            blk = self._blocks[k]
            v = self._host_view(blk)
            out[k] = (self._widened(blk, v, rectified).to(blk.device) if blk.fmt.qtype else
                      v.to(device=blk.device, dtype=blk.dtype, copy=True))
            del v
        if not self._in_step:  # inside a step the blocks wait for its end
            self._spill(best_effort=True)
        return out

    # ---- NVMe ------------------------------------------------------------------------------------
    def _nvme_move(self, blks: list, dst: str, what: str) -> None:
        """One batched move of blks to dst ('host' = read back, 'nvme' = write), traced and
        counted; failures become TieredStateError."""
        if not blks:
            return
        for b in blks:
            self._quiesce(b, release=False)
        ids = [b.sid for b in blks]
        nbytes = sum(b.nbytes for b in blks)
        files = {}
        if dst != "nvme":
            for b in blks:
                try:
                    files[b.sid] = self.store.record_path(b.sid)
                except Exception:
                    pass
        t0 = time.monotonic_ns()
        self._trace("copy_issued", TraceLane.NVME, name=f"nvme {what} issued", bytes=nbytes,
                    ts_ns=t0)
        try:
            self.store.move(ids, dst)
        except Exception as exc:
            self._trace("copy_done", TraceLane.NVME, name=f"nvme {what} failed", bytes=nbytes,
                        status=getattr(exc, "code", None))
            raise self._error(exc, blks, what, files) from exc
        t1 = time.monotonic_ns()
        self._trace("copy", TraceLane.NVME, name=f"nvme {what}", bytes=nbytes, ts_ns=t0,
                    dur_ns=t1 - t0)
        self._trace("copy_done", TraceLane.NVME, name=f"nvme {what} done", bytes=nbytes, ts_ns=t1)

    def _error(self, exc: BaseException, blks: list, what: str, files: dict):
        by_sid = {b.sid: b for b in blks}
        msg = str(exc)
        named = [by_sid[int(m)] for m in re.findall(r"block (\d+)", msg) if int(m) in by_sid]
        culprit = named[0] if named else None
        where = ""
        if culprit is not None:
            where = f" {self._label(culprit)}"
            path = files.get(culprit.sid)
            if path and path not in msg:
                where += f" (record file {path})"
        verb = {"read": "reading back", "write": "writing", "fetch": "reading back",
                "stream": "reading back"}[what]
        outcome = ("The step was not applied: parameters and optimizer state are unchanged"
                   if what != "stream" else
                   "The record changed after this step's verify pass: the step may be PARTLY "
                   "applied (stacks before this one were updated); load a checkpoint")
        return TieredStateError(
            f"Asteria NVMe tier: {verb} {len(blks)} block(s) failed at{where}: {msg}. "
            f"{outcome}",
            exc, [b.key for b in ([culprit] if culprit else blks)],
            [files[b.sid] for b in ([culprit] if culprit else blks) if b.sid in files])

    def _write_out(self, blks: list) -> None:
        """Write NVMe-homed blocks now in host memory to NVMe, best effort: a failure leaves
        them in host memory, for the step end or the next ``prepare`` to retry (and raise)."""
        blks = [b for b in blks if self.store.tier(b.sid) != "nvme"]
        if not blks:
            return
        try:
            self._nvme_move(blks, "nvme", "write")
        except TieredStateError as exc:  # the step end's spill retries, counts and warns
            self.counters["nvme_writes_deferred"] += 1
            log.debug("asteria: writing %d block(s) to NVMe failed, retried at the step end: "
                      "%s", len(blks), exc.cause)
        for b in blks:
            self._early.discard(b.key)

    def _spill(self, best_effort: bool, keep: Iterable = ()) -> None:
        """Write every NVMe-homed block that is in host memory back to NVMe (one batch), but
        the keys in ``keep``."""
        keep = set(keep)
        pending = [b for b in self._blocks.values() if b.home == "nvme"
                   and b.key not in keep and self.store.tier(b.sid) != "nvme"]
        self._early -= set(b.key for b in pending)
        if not pending:
            return
        try:
            self._nvme_move(pending, "nvme", "write")
        except TieredStateError as exc:
            if not best_effort:
                raise
            self.counters["nvme_spill_deferred"] += 1
            log.warning("asteria: spilling %d block(s) to NVMe failed, retried at the next "
                        "step: %s", len(pending), exc.cause)

    def prepare(self, keys: Iterable) -> None:
        """Phase A of a step (see the module doc): nothing of the optimizer is mutated yet, so
        any failure here leaves the training state as it was."""
        self._in_step = True
        need = [self._blocks[k] for k in keys if k in self._blocks]
        nv = [b for b in need if b.home == "nvme"]
        try:
            # the verify pass, PREPARE_CHUNK bytes at a time: read back (CRC-checked), write
            # out again; blocks fetched early were read (and checked) already and stay
            for chunk in _chunks([b for b in nv if self.store.tier(b.sid) == "nvme"],
                                 PREPARE_CHUNK):
                self._nvme_move(chunk, "host", "read")
                self._nvme_move(chunk, "nvme", "write")
            self.counters["nvme_window_bytes"] = max(
                self.counters["nvme_window_bytes"], sum(b.nbytes for b in nv))
            self._spill(best_effort=False, keep=self._early)
            self._trim_heap()
        except BaseException:
            self.end_step(spill=False)
            raise

    def end_step(self, spill: bool = True) -> None:
        """Release every ring slot, spill what is left in host memory of NVMe blocks."""
        for blk in list(self._slots.values()):
            self._release(blk)
        self._in_step = False
        if spill:
            self._spill(best_effort=True)
        self._trim_heap()

    def _trim_heap(self) -> None:
        if self._trim is not None:
            self._trim(0)

    def fetch_early(self, keys: Iterable) -> None:
        """Forward hooks: read NVMe blocks back into host memory ahead of the step, as long as
        the blocks fetched early stay within ``PREPARE_CHUNK`` bytes. Never raises (the step's
        ``prepare`` retries and reports)."""
        room = PREPARE_CHUNK - sum(self._blocks[k].nbytes for k in self._early)
        nv = []
        for k in keys:
            b = self._blocks.get(k)
            if b is None or self.store.tier(b.sid) != "nvme":
                continue
            if b.nbytes > room:
                break
            room -= b.nbytes
            nv.append(b)
        if not nv:
            return
        try:
            self._nvme_move(nv, "host", "fetch")
            self._early.update(b.key for b in nv)
            self.counters["nvme_fetches_early"] += len(nv)
        except TieredStateError as exc:
            self.deferred_error = exc

    # ---- the staging ring -----------------------------------------------------------------------
    def _src_ptr(self, blk: _Blk) -> Optional[int]:
        """The block's host memory; None while it is on NVMe (``borrow`` reads it back)."""
        if self.store.tier(blk.sid) != "nvme":
            return self.store.data_ptr(blk.sid)
        return None

    def _stage(self, blk: _Blk) -> bool:
        """Issue the prefetch of blk into a ring slot; False when the ring is full (or the
        block has no host copy now)."""
        if blk.slot and blk.slot_version == blk.version:
            return True
        if blk.slot:
            self._release(blk)
        src = self._src_ptr(blk)
        if src is None:
            return False
        key = self._next_slot
        self._next_slot += 1
        t0 = time.monotonic_ns()
        try:
            ptr = self.shadow.prefetch(src, blk.nbytes, key)
        except _C.BusyError:
            self.counters["prefetch_busy"] += 1
            return False
        blk.slot, blk.slot_ptr, blk.slot_version, blk.consumed = key, ptr, blk.version, False
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(self._ext_stream)
            blk.slot_event = ev
        self._slots[key] = blk
        self.counters["bytes_h2d"] += blk.nbytes
        self.counters["prefetches"] += 1
        self._trace("copy_issued", TraceLane.SHADOW, "prefetch issued", bytes=blk.nbytes,
                    direction="h2d", ts_ns=t0)
        if not self.cuda:  # the host path copied at issue
            t1 = time.monotonic_ns()
            self._trace("copy", TraceLane.SHADOW, "prefetch", bytes=blk.nbytes, direction="h2d",
                        ts_ns=t0, dur_ns=t1 - t0)
            self._trace("copy_done", TraceLane.SHADOW, "prefetch done", bytes=blk.nbytes,
                        direction="h2d", ts_ns=t1)
        return True

    def _release(self, blk: _Blk) -> None:
        if not blk.slot:
            return
        if self.cuda:
            self.shadow.release_after(blk.slot,
                                      torch.cuda.current_stream(self._device).cuda_stream)
        else:
            self.shadow.release(blk.slot)
        self._slots.pop(blk.slot, None)
        blk.slot, blk.slot_ptr, blk.slot_event, blk.slot_version = 0, 0, None, -1

    def _quiesce(self, blk: _Blk, release: bool = True) -> None:
        """No copy or kernel may still read blk's memory (before a write, move or free). A
        move keeps the slot (its copy has landed and the value does not change)."""
        if blk.read_event is not None:  # UVM: the reads queued by its last borrow
            blk.read_event.synchronize()
            blk.read_event = None
        if blk.slot:
            if self.cuda:
                self.shadow.prefetch_wait(blk.slot)
            if release:
                self._release(blk)

    def prefetch(self, keys: Iterable, reason: str = "") -> int:
        """Stage blocks ahead of their use, as far as the ring has room; returns how many are
        staged. Never raises for a full ring."""
        blks = [self._blocks[k] for k in keys if k in self._blocks]
        if self.shadow is None:
            return 0
        n = 0
        for blk in blks:
            if blk.home == "uvm" or (self._src_ptr(blk) is None and not (
                    blk.slot and blk.slot_version == blk.version)):
                continue  # read in place; or on NVMe: borrow stages it
            fresh = not (blk.slot and blk.slot_version == blk.version)
            if not self._stage(blk):
                break
            n += 1
            if fresh and reason != "step":
                self.counters["prefetches_ahead"] += 1
        return n

    def chunk_cost(self, keys: Iterable) -> int:
        return sum(align(self._blocks[k].nbytes) for k in keys
                   if k in self._blocks and self._blocks[k].home != "uvm")

    def borrow(self, keys: list) -> list:
        """Device tensors of blocks for this chunk (ring slot views, or UVM views, in the
        stored dtype; a quantized basis widened and rectified from them, a new tensor); the
        caller stacks them (widening narrowed ones to ``dtype_of``) and then calls
        give_back(keys).

        Two phases: first every block of the chunk gets a slot (a block staged ahead is a hit;
        the others are staged now, evicting the oldest slots of other blocks as needed), then
        the views are made. Slots are contiguous and the ring reclaims in FIFO order, so a
        chunk can fail to fit behind a hit in the middle of the ring although its bytes fit
        the ring: then the chunk's own slots are released too and it is staged again from an
        empty ring. Only a chunk larger than the ring raises."""
        blks = [self._blocks[k] for k in keys]
        staged = [b for b in blks if b.home != "uvm"]
        # the chunk's NVMe blocks, read back now (one batch) and written out once staged
        self._nvme_move([b for b in staged if self.store.tier(b.sid) == "nvme"
                         and not (b.slot and b.slot_version == b.version)], "host", "stream")
        hits = sum(1 for b in staged if b.slot and b.slot_version == b.version)
        mine = set(id(b) for b in blks)
        if not self._stage_all(staged, exclude=mine):
            for blk in list(self._slots.values()):  # restart from an empty ring
                self._release(blk)
                self.counters["ring_evictions"] += 1
            self._settle_releases()
            hits = 0
            if not self._stage_all(staged, exclude=mine):
                raise RuntimeError(
                    f"asteria: the staging ring ({self.plan.ring_bytes} bytes) cannot hold "
                    f"{self._label(staged[0])} with the rest of its chunk "
                    f"({self.chunk_cost(keys)} bytes); {self.shadow.last_error()}")
        self._write_out([b for b in staged if b.home == "nvme"])
        self.counters["prefetch_hits"] += hits
        out = []
        for blk in blks:
            if blk.home == "uvm":
                view = torch.from_dlpack(self.store.view(
                    blk.sid, blk.sdtype, blk.sshape, device=_cuda_index(blk.device)))
                out.append(self._widened(blk, view) if blk.fmt.qtype else view)
                continue
            if self.cuda:
                torch.cuda.current_stream(self._device).wait_event(blk.slot_event)
            view = torch.from_dlpack(self.shadow.slot_view(blk.slot, blk.sdtype, blk.sshape))
            if view.device != blk.device:
                # a ring on another device than the block's parameter (the planner never makes
                # one for a CUDA parameter: tiers/plan.py rule 2): a copy there, never a view
                # of the wrong device handed to the step
                view = view.to(blk.device)
            # a quantized basis: widened on the step's device, queued behind the slot's copy
            out.append(self._widened(blk, view) if blk.fmt.qtype else view)
            blk.consumed = True
        return out

    def _stage_all(self, blks: list, exclude: set) -> bool:
        """Give every block of blks a slot, evicting other blocks' slots oldest first; False
        when they do not fit together (nothing left to evict)."""
        for blk in blks:
            while not self._stage(blk):
                if self._evict(exclude=exclude):
                    continue
                if self._settle_releases():
                    if self._stage(blk):
                        break
                return False
        return True

    def _settle_releases(self) -> bool:
        """On CUDA a released slot is reclaimed once the stream that used it has passed its
        release point: wait for that (the consuming stream) so the space is really free.
        Returns whether there was anything to wait for."""
        if not self.cuda or not self.shadow.stats()["ring_used"]:
            return False
        torch.cuda.current_stream(self._device).synchronize()
        return True

    def _evict(self, exclude: set) -> bool:
        """Release the oldest staged slot not in use by the current chunk."""
        for blk in list(self._slots.values()):
            if id(blk) not in exclude:
                self._release(blk)
                self.counters["ring_evictions"] += 1
                return True
        return False

    def give_back(self, keys: list) -> None:
        for k in keys:
            blk = self._blocks.get(k)
            if blk is None:
                continue
            if blk.home == "uvm" and blk.device.type == "cuda":
                # its reads are queued on the current stream (module doc: stream ordering);
                # a blocking event, so that _quiesce's wait sleeps instead of spinning
                blk.read_event = torch.cuda.Event(blocking=True)
                blk.read_event.record(torch.cuda.current_stream(blk.device))
            self._release(blk)

    # ---- stats / lifetime -----------------------------------------------------------------------
    def stats(self) -> dict:
        if self._closed:
            return dict(self._final_stats)
        st = self.store.stats()
        # every store tier's bytes (the store's names, libasteria's) but the device's, which
        # the optimizer counts itself (its state on the device and this ring)
        out = {f"bytes_{t}": n for t, n in st["bytes"].items() if t != "device"}
        out["bytes_device_ring"] = self.plan.ring_bytes if self.shadow is not None else 0
        out["bytes_nvme_read"] = st["nvme_bytes_read"]
        out["bytes_nvme_written"] = st["nvme_bytes_written"]
        out["nvme_read_ns"] = st["nvme_read_ns"]
        out["nvme_write_ns"] = st["nvme_write_ns"]
        out["nvme_reads"] = st["nvme_reads"]
        out["nvme_writes"] = st["nvme_writes"]
        out["nvme_read_MBps"] = (st["nvme_bytes_read"] * 1e3 / st["nvme_read_ns"]
                                 if st["nvme_read_ns"] else 0.0)
        out["nvme_write_MBps"] = (st["nvme_bytes_written"] * 1e3 / st["nvme_write_ns"]
                                  if st["nvme_write_ns"] else 0.0)
        out["nvme_direct"] = st["nvme_direct"]
        out.update(self.counters)
        if self.shadow is not None:
            sh = self.shadow.stats()
            out["bytes_h2d_ring"] = sh["h2d_bytes"]
            for k in ("ring_capacity", "ring_used", "ring_high_water", "ring_wraps",
                      "ring_slots", "busy"):
                out[f"ring_{k}" if not k.startswith("ring") else k] = sh[k]
        return out

    def stats_final(self) -> dict:
        """stats(), with the staging counters frozen (the optimizer keeps them after close)."""
        return self.stats()

    def close(self) -> None:
        if self._closed:
            return
        self._final_stats = self.stats()
        self._closed = True
        for blk in list(self._slots.values()):
            self._release(blk)
        if self.shadow is not None:
            self.shadow.close()
        self.store.close()
