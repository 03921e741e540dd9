"""asteria._C.Shadow on the host path (mode="host": the same state machine, rings and
statistics as with CUDA, copies done by memcpy): snapshot / prefetch round trips of torch
tensors by data_ptr, ring wrap-around, the full-ring BusyError, per-direction byte counts, and
bad input. The CUDA path runs in the GPU device checks."""

import ctypes

import pytest
import torch

from asteria import _C

ALIGN = 256  # AST_SHADOW_ALIGN: slots start at multiples of it


def at(ptr, like):
    """A tensor over nbytes of host memory at ptr, shaped like `like` (no copy)."""
    nbytes = like.numel() * like.element_size()
    raw = (ctypes.c_char * nbytes).from_address(ptr)
    return torch.frombuffer(raw, dtype=like.dtype).reshape(like.shape)


@pytest.fixture
def sh():
    s = _C.Shadow(mode="host", snapshot_ring_bytes=1 << 16, prefetch_ring_bytes=1 << 16, slots=8)
    yield s
    s.close()


def test_snapshot_and_prefetch_round_trip(sh):
    assert sh.is_cuda is False
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 50, generator=g)
    t = sh.snapshot(x.data_ptr(), x.nbytes)
    assert t > 0
    host = sh.snapshot_wait(t)
    assert host != x.data_ptr() and host % ALIGN == 0
    assert sh.snapshot_query(t) is True and sh.snapshot_event(t) == 0
    staged = at(host, x)
    assert torch.equal(staged, x)
    x0 = x.clone()
    x.mul_(2.0)  # the snapshot is a copy: the source may change after the copy landed
    assert torch.equal(staged, x0)
    del staged
    sh.snapshot_release(t)
    with pytest.raises(FileNotFoundError, match=f"ticket {t}"):
        sh.snapshot_wait(t)

    y = torch.randn(1000, dtype=torch.float64, generator=g)
    dev = sh.prefetch(y.data_ptr(), y.nbytes, 7)
    assert dev % ALIGN == 0
    assert sh.lookup(7) == (dev, 8000, True)
    assert sh.prefetch_wait(7) is None and sh.ready_event(7) == 0
    assert torch.equal(at(dev, y), y)
    sh.release(7)
    assert sh.lookup(7) is None
    with pytest.raises(FileNotFoundError, match="key 7 is not staged"):
        sh.prefetch_wait(7)
    # release_after on the host path releases at once.
    sh.prefetch(y.data_ptr(), y.nbytes, 8)
    sh.release_after(8, 0)
    assert sh.lookup(8) is None and sh.stats()["ring_slots"] == 0


def test_prefetch_ring_wraps_around_and_refuses_when_full():
    s = _C.Shadow(mode="host", snapshot_ring_bytes=4096, prefetch_ring_bytes=4096, slots=8)
    try:
        g = torch.Generator().manual_seed(1)
        xs = {k: torch.randn(256, generator=g) for k in range(1, 7)}  # 1024 bytes each
        ptr = {k: s.prefetch(xs[k].data_ptr(), 1024, k) for k in range(1, 5)}
        base = ptr[1]
        assert [ptr[k] - base for k in range(1, 5)] == [0, 1024, 2048, 3072]
        st = s.stats()
        assert st["ring_capacity"] == 4096 and st["ring_used"] == 4096
        assert st["ring_slots"] == 4 and st["ring_wraps"] == 0 and st["busy"] == 0

        with pytest.raises(_C.BusyError) as ei:  # full: nothing changes
            s.prefetch(xs[5].data_ptr(), 1024, 5)
        e = ei.value
        assert isinstance(e, _C.AsteriaError) and e.code == _C.AST_EBUSY
        assert "no room for 1024 bytes" in str(e) and "4096 of 4096" in str(e)
        st = s.stats()
        assert st["busy"] == 1 and st["ring_slots"] == 4 and st["h2d_copies"] == 4
        assert s.lookup(5) is None

        # Freeing the two oldest slots makes room at the start: the next slot wraps there.
        s.release(1)
        s.release(2)
        assert s.stats()["ring_used"] == 2048
        p5 = s.prefetch(xs[5].data_ptr(), 1024, 5)
        assert p5 == base
        assert s.stats()["ring_wraps"] == 1
        assert torch.equal(at(p5, xs[5]), xs[5])
        assert torch.equal(at(ptr[3], xs[3]), xs[3]) and torch.equal(at(ptr[4], xs[4]), xs[4])

        # A slot released behind an older live one is not reclaimed until that one is.
        s.release(4)
        st = s.stats()
        assert st["ring_slots"] == 3 and st["ring_used"] == 4096 - 1024
        with pytest.raises(_C.BusyError):
            s.prefetch(xs[6].data_ptr(), 2048, 6)
        s.release(3)
        st = s.stats()
        assert st["ring_slots"] == 1 and st["ring_used"] == 1024
        assert st["ring_high_water"] == 4096 and st["busy"] == 2
        p6 = s.prefetch(xs[6].data_ptr(), 1024, 6)
        assert p6 == base + 1024 and torch.equal(at(p6, xs[6]), xs[6])
    finally:
        s.close()


def test_snapshot_ring_slot_limit_and_wrap():
    s = _C.Shadow(mode="host", snapshot_ring_bytes=2048, prefetch_ring_bytes=2048, slots=2)
    try:
        x = torch.arange(256, dtype=torch.float32)  # 1024 bytes
        t1 = s.snapshot(x.data_ptr(), 512)
        t2 = s.snapshot(x.data_ptr() + 512, 512)
        with pytest.raises(_C.BusyError, match="all 2 slots are in use"):
            s.snapshot(x.data_ptr(), 100)
        h2 = s.snapshot_wait(t2)
        assert torch.equal(at(h2, x[128:]), x[128:])
        s.snapshot_release(t1)
        s.snapshot_release(t2)
        t3 = s.snapshot(x.data_ptr(), 1024)
        t4 = s.snapshot(x.data_ptr(), 1024)
        assert s.snapshot_wait(t4) - s.snapshot_wait(t3) == 1024
        s.snapshot_release(t3)
        t5 = s.snapshot(x.data_ptr(), 768)  # does not fit after t4: wraps to the start
        st = s.stats()
        assert st["snapshot_wraps"] == 1 and st["snapshot_slots"] == 2
        assert torch.equal(at(s.snapshot_wait(t5), x[:192]), x[:192])
        assert st["busy"] == 1
    finally:
        s.close()


def test_stats_bytes_per_direction(sh):
    g = torch.Generator().manual_seed(2)
    snap_sizes = [4 * n for n in (10, 300, 1000)]
    pre_sizes = [8 * n for n in (7, 500)]
    src = torch.randn(4096, generator=g)
    tickets = [sh.snapshot(src.data_ptr(), n) for n in snap_sizes]
    keys = []
    for k, n in enumerate(pre_sizes, start=100):
        sh.prefetch(src.data_ptr(), n, k)
        keys.append(k)
    st = sh.stats()
    assert st["d2h_bytes"] == sum(snap_sizes) and st["d2h_copies"] == 3
    assert st["h2d_bytes"] == sum(pre_sizes) and st["h2d_copies"] == 2
    rounded = lambda n: (n + ALIGN - 1) // ALIGN * ALIGN
    assert st["snapshot_used"] == sum(map(rounded, snap_sizes)) and st["snapshot_slots"] == 3
    assert st["ring_used"] == sum(map(rounded, pre_sizes)) and st["ring_slots"] == 2
    assert st["is_cuda"] is False and st["device"] == -1 and st["priority"] == 0
    for t in tickets:
        sh.snapshot_release(t)
    for k in keys:
        sh.release(k)
    st = sh.stats()
    assert st["snapshot_used"] == st["ring_used"] == 0
    assert st["d2h_bytes"] == sum(snap_sizes) and st["h2d_bytes"] == sum(pre_sizes)


def test_bad_input_and_closed(sh):
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="exceeds the ring capacity"):
        sh.snapshot(x.data_ptr(), (1 << 16) + 1)
    with pytest.raises(ValueError, match="needs the CUDA path"):
        sh.snapshot(x.data_ptr(), 256, 0x1234)
    with pytest.raises(ValueError, match="NULL source"):
        sh.prefetch(0, 16, 1)
    sh.prefetch(x.data_ptr(), 256, 3)
    with pytest.raises(_C.AsteriaError, match="already staged") as ei:
        sh.prefetch(x.data_ptr(), 256, 3)
    assert ei.value.code == _C.AST_ESTATE
    with pytest.raises(FileNotFoundError, match="ticket 999"):
        sh.snapshot_release(999)
    with pytest.raises(_C.AsteriaError, match="host path") as ei:
        sh.stream_handle()
    assert ei.value.code == _C.AST_ENODEV
    with pytest.raises(ValueError, match="'auto', 'host' or 'cuda'"):
        _C.Shadow(mode="gpu")
    with pytest.raises(ValueError, match="must be > 0"):
        _C.Shadow(mode="host", slots=0)
    sh.close()
    sh.close()
    assert sh.closed
    with pytest.raises(_C.AsteriaError, match="shadow is closed") as ei:
        sh.lookup(3)
    assert ei.value.code == _C.AST_ESHUTDOWN


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device behaviour")
def test_cuda_mode_without_a_device():
    with pytest.raises(_C.AsteriaError, match="mode cuda") as ei:
        _C.Shadow(mode="cuda")
    assert ei.value.code == _C.AST_ENODEV
    with _C.Shadow(mode="auto", snapshot_ring_bytes=4096, prefetch_ring_bytes=4096) as s:
        assert s.is_cuda is False


def test_snapshot_gather_copies_pieces_back_to_back(sh):
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(n, generator=g) for n in (3, 100, 64)]
    t = sh.snapshot_gather([(p.data_ptr(), 4 * p.numel()) for p in parts])
    whole = torch.cat(parts)
    got = at(sh.snapshot_wait(t), whole).clone()
    for p in parts:
        p.zero_()  # a copy: the sources may change once it has landed
    assert torch.equal(got, whole)
    st = sh.stats()
    assert st["d2h_bytes"] == 4 * 167 and st["d2h_copies"] == 1 and st["snapshot_slots"] == 1
    sh.snapshot_release(t)

    x = torch.zeros(64)
    with pytest.raises(ValueError, match="1 to"):
        sh.snapshot_gather([])
    with pytest.raises(ValueError, match="piece 1 of 2"):
        sh.snapshot_gather([(x.data_ptr(), 8), (x.data_ptr(), 0)])
    with pytest.raises(TypeError, match="piece 0 must be a"):
        sh.snapshot_gather([x.data_ptr()])
    with pytest.raises(ValueError, match="exceeds the ring capacity"):
        sh.snapshot_gather([(x.data_ptr(), 256)] * 300)  # each fits, together they do not
    assert sh.stats()["d2h_copies"] == 1 and sh.stats()["snapshot_slots"] == 0
