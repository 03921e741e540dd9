"""Tensor views of the extension's memory as DLPack capsules (Store.view, Shadow.slot_view,
Shadow.snapshot_view), the way asteria.tiers.residency and refresh/host_pool.py make every view.

A view aliases the memory (writes go both ways, for every dtype the tiers use), checks its
dtype and size, and keeps to the lifetime rule: a store view pins its block (move, free and
close raise BusyError while it lives) and keeps the Store alive; a shadow view keeps the Shadow
alive and its rings allocated past close(). CPU here; the CUDA views run where a device is."""

import gc
import types

import pytest
import torch

from asteria import _C
from models import require_c_extension

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
SHAPE = (3, 5)


def values(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(SHAPE, generator=g).to(dtype)
    return torch.randint(-1000, 1000, SHAPE, generator=g, dtype=dtype)


def nbytes(dtype):
    return torch.Size(SHAPE).numel() * torch.empty((), dtype=dtype).element_size()


def as_bytes(t):
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


@pytest.fixture
def store():
    require_c_extension()
    s = _C.Store()
    yield s
    gc.collect()
    s.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_view_aliases_the_block(store, dtype):
    sid = store.alloc("host", nbytes(dtype))
    view = torch.from_dlpack(store.view(sid, dtype, SHAPE))
    assert view.dtype == dtype and view.shape == SHAPE and view.device.type == "cpu"
    assert view.data_ptr() == store.data_ptr(sid) and view.is_contiguous()
    # through the view, read back through the store (its bytes buffer)
    a = values(dtype, 1)
    view.copy_(a)
    assert bytes(memoryview(store.buffer(sid))) == as_bytes(a)
    # through the store, read back through the view
    b = values(dtype, 2)
    memoryview(store.buffer(sid))[:] = as_bytes(b)
    assert torch.equal(view, b)
    # a second view of the same block (dtype given by name) sees the same memory
    again = torch.from_dlpack(store.view(sid, str(dtype).removeprefix("torch."), SHAPE))
    again.zero_()
    assert not view.any()


def test_store_view_survives_nvme_round_trip(tmp_path):
    require_c_extension()
    with _C.Store(nvme_dir=str(tmp_path), direct="fallback") as s:
        sid = s.alloc("host", nbytes(torch.bfloat16))
        a = values(torch.bfloat16, 3)
        view = torch.from_dlpack(s.view(sid, torch.bfloat16, SHAPE))
        view.copy_(a)
        del view
        s.move([sid], "nvme")
        with pytest.raises(_C.AsteriaError, match="nvme"):
            s.view(sid, torch.bfloat16, SHAPE)
        s.move([sid], "host")
        back = torch.from_dlpack(s.view(sid, torch.bfloat16, SHAPE))
        assert torch.equal(back, a)
        del back
        s.free(sid)


def test_store_view_pins_its_block_and_keeps_the_store(store):
    sid = store.alloc("host", nbytes(torch.float32))
    view = torch.from_dlpack(store.view(sid, torch.float32, SHAPE))
    view.fill_(7)
    assert store.exports(sid) == 1
    for call in (lambda: store.free(sid), lambda: store.move([sid], "host_pinned"),
                 store.close):
        with pytest.raises(_C.BusyError, match="Store.view"):
            call()
    reshaped = view.reshape(-1)[2:]  # views of the view share its storage, and its pin
    del view
    gc.collect()
    assert store.exports(sid) == 1 and torch.all(reshaped == 7)
    del reshaped
    assert store.exports(sid) == 0
    store.free(sid)
    # a capsule never handed to torch releases its pin when it goes
    sid = store.alloc("host", 64)
    cap = store.view(sid, torch.float64, (8,))
    assert store.exports(sid) == 1
    del cap
    assert store.exports(sid) == 0
    # the Store object lives as long as a view over it
    s2 = _C.Store()
    sid2 = s2.alloc("host", nbytes(torch.float16))
    v2 = torch.from_dlpack(s2.view(sid2, torch.float16, SHAPE))
    v2.copy_(values(torch.float16, 4))
    del s2
    gc.collect()
    assert torch.equal(v2, values(torch.float16, 4))
    del v2


def test_store_view_bad_dtype_size_or_tier(store):
    sid = store.alloc("host", 64)
    with pytest.raises(ValueError, match="unsupported dtype 'uint8'"):
        store.view(sid, "uint8", (64,))
    with pytest.raises(ValueError, match="unsupported dtype torch.complex64"):
        store.view(sid, torch.complex64, (8,))
    with pytest.raises(ValueError, match=r"64 bytes.* make 60 bytes: they must be equal"):
        store.view(sid, torch.float32, (3, 5))
    with pytest.raises(ValueError, match="make 128 bytes"):
        store.view(sid, torch.float64, (16,))
    with pytest.raises(ValueError, match="bad shape"):
        store.view(sid, torch.float32, (-1, 16))
    with pytest.raises(TypeError):
        store.view(sid, torch.float32, 16)
    with pytest.raises(ValueError, match="at most 8"):
        store.view(sid, torch.float32, (1,) * 9 + (16,))
    with pytest.raises(ValueError, match="its views are CPU tensors"):
        store.view(sid, torch.float32, (16,), device=0)
    assert store.exports(sid) == 0  # no refusal leaves a pin behind
    store.free(sid)
    with pytest.raises(FileNotFoundError, match="no block"):
        store.view(sid, torch.float32, (16,))  # freed
    assert store.exports() == 0


@pytest.fixture
def shadow():
    require_c_extension()
    s = _C.Shadow(mode="host", snapshot_ring_bytes=1 << 16, prefetch_ring_bytes=1 << 16, slots=8)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shadow_views_alias_slots_and_snapshots(shadow, dtype):
    a = values(dtype, 5)
    shadow.prefetch(a.data_ptr(), a.nbytes, 1)
    slot = torch.from_dlpack(shadow.slot_view(1, dtype, SHAPE))
    ptr, n, ready = shadow.lookup(1)
    assert slot.data_ptr() == ptr and n == a.nbytes and torch.equal(slot, a)
    slot.neg_()  # writes land in the slot
    assert torch.equal(torch.from_dlpack(shadow.slot_view(1, dtype, SHAPE)), -a)
    shadow.release(1)
    ticket = shadow.snapshot(a.data_ptr(), a.nbytes)
    host = shadow.snapshot_wait(ticket)
    snap = torch.from_dlpack(shadow.snapshot_view(ticket, dtype, SHAPE))
    assert snap.data_ptr() == host and torch.equal(snap, a)
    shadow.snapshot_release(ticket)


def test_shadow_view_errors(shadow):
    with pytest.raises(FileNotFoundError, match="not staged"):
        shadow.slot_view(9, torch.float32, (4,))
    with pytest.raises(FileNotFoundError, match="ticket 9"):
        shadow.snapshot_view(9, torch.float32, (4,))
    x = torch.arange(16, dtype=torch.float32)
    shadow.prefetch(x.data_ptr(), x.nbytes, 2)
    with pytest.raises(ValueError, match="prefetch slot 2 is 64 bytes"):
        shadow.slot_view(2, torch.float64, (16,))
    with pytest.raises(ValueError, match="unsupported dtype"):
        shadow.slot_view(2, "int8", (64,))
    shadow.release(2)


def test_shadow_view_outlives_close_and_the_shadow():
    """close() with a view alive closes the handle at once but frees the rings only when the
    last view goes; dropping every other reference to the Shadow keeps it alive too."""
    require_c_extension()
    sh = _C.Shadow(mode="host", snapshot_ring_bytes=4096, prefetch_ring_bytes=1 << 16, slots=4)
    x = values(torch.bfloat16, 6)
    sh.prefetch(x.data_ptr(), x.nbytes, 1)
    view = torch.from_dlpack(sh.slot_view(1, torch.bfloat16, SHAPE))
    sh.close()
    assert sh.closed
    with pytest.raises(_C.AsteriaError, match="closed"):
        sh.slot_view(1, torch.bfloat16, SHAPE)
    junk = [torch.randn(4096) for _ in range(64)]  # allocations that would reuse freed memory
    assert torch.equal(view, x)
    del sh, junk
    gc.collect()
    assert torch.equal(view, x)
    view.zero_()
    del view
    gc.collect()


def residency(ring_bytes=1 << 16):
    from asteria.tiers.plan import Plan
    from asteria.tiers.residency import Residency

    keys = {(0, "x"): (8, 8), (1, "y"): (4, 6)}
    plan = Plan("async", {}, {k: "host" for k in keys}, ring_bytes=ring_bytes,
                ring_min=ring_bytes, snapshot_ring_bytes=4096)
    return Residency(plan, types.SimpleNamespace(nvme_dir=None, tier_dtype="float32")), keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_residency_views_alias_and_outlive_the_residency(dtype):
    require_c_extension()
    res, keys = residency()
    vals = {k: torch.randn(shape).to(dtype) for k, shape in keys.items()}
    for k, v in vals.items():
        res.write(k, v)
    host = res.read_host((0, "x"))
    assert torch.equal(host, vals[(0, "x")])
    host.mul_(2)  # a host view is the block itself
    assert torch.equal(res.materialize([(0, "x")])[(0, "x")], vals[(0, "x")] * 2)
    staged = res.borrow(list(keys))
    assert torch.equal(staged[0], vals[(0, "x")] * 2) and torch.equal(staged[1], vals[(1, "y")])
    # the lifetime rule: the views keep their Store / Shadow; nothing else has to
    store = res.store
    del res
    gc.collect()
    assert torch.equal(host, vals[(0, "x")] * 2) and torch.equal(staged[1], vals[(1, "y")])
    with pytest.raises(_C.BusyError):  # the host view pins its block, so the store stays open
        store.close()
    del host, staged
    gc.collect()
    store.close()


def test_residency_close_with_a_borrowed_view_alive():
    require_c_extension()
    res, keys = residency()
    x = torch.randn(keys[(0, "x")])
    res.write((0, "x"), x)
    staged = res.borrow([(0, "x")])
    res.give_back([(0, "x")])
    res.close()  # the shadow's close waits for the view; the store has no view
    assert res.store.closed and res.shadow.closed
    assert torch.equal(staged[0], x)  # released slot, but its memory is still the ring's
    del staged
    gc.collect()


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and _C.HAVE_CUDA),
                                reason="needs a CUDA device and asteria._C built with CUDA")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_views(dtype):
    dev = torch.cuda.current_device()
    with _C.Store() as s:
        sid = s.alloc("uvm", nbytes(dtype))
        a = values(dtype, 7)
        cpu = torch.from_dlpack(s.view(sid, dtype, SHAPE))
        gpu = torch.from_dlpack(s.view(sid, dtype, SHAPE, device=dev))
        assert cpu.device.type == "cpu" and gpu.device == torch.device("cuda", dev)
        gpu.copy_(a.cuda())
        torch.cuda.synchronize()
        assert torch.equal(cpu, a)
        with pytest.raises(ValueError, match="give device"):
            dsid = s.alloc("device", nbytes(dtype))
            try:
                s.view(dsid, dtype, SHAPE)
            finally:
                s.free(dsid)
        del cpu, gpu
        s.free(sid)
    sh = _C.Shadow(mode="cuda", snapshot_ring_bytes=4096, prefetch_ring_bytes=1 << 16, slots=4)
    try:
        a = values(dtype, 8).pin_memory()
        sh.prefetch(a.data_ptr(), a.nbytes, 1)
        sh.prefetch_wait(1)
        slot = torch.from_dlpack(sh.slot_view(1, dtype, SHAPE))
        assert slot.device.type == "cuda" and torch.equal(slot.cpu(), a)
        del slot
        sh.release(1)
    finally:
        sh.close()
