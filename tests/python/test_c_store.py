"""asteria._C.Store: tiered blocks through the binding, with real torch tensors.

HOST and NVMe round trips of a tensor's bytes, zero-copy torch views over HOST blocks
(Store.buffer) and the pin they hold, batched moves and their accounting, a corrupted record
file, a missing directory, the CUDA tiers on a machine without a device, and the one warning of
an NVMe tier on a filesystem without O_DIRECT (a real ramfs in a private mount namespace). NVMe
records go to pytest's tmp_path (direct="fallback" so a filesystem without O_DIRECT still runs
the test; nvme_direct in stats says which path ran)."""

import errno
import gc
import os
import threading
import textwrap
import time

import pytest
import torch

from asteria import _C
from models import run_on_private_mount

HEADER = 64  # record header bytes before the payload (src/nvme.h)


def view(store, block, dtype=torch.float32):
    """A torch tensor sharing the block's memory (keeps a BlockBuffer alive: pins the block)."""
    return torch.frombuffer(store.buffer(block), dtype=dtype)


def put(store, block, x):
    """Copies tensor x's bytes into a HOST block; no view survives the call."""
    v = view(store, block, x.dtype)
    assert v.numel() == x.numel()
    v.copy_(x.reshape(-1))
    del v


def get(store, block, like):
    """A copy of the block's bytes as a tensor shaped like `like`."""
    v = view(store, block, like.dtype)
    out = v.clone().reshape(like.shape)
    del v
    return out


@pytest.fixture
def host_store():
    s = _C.Store()
    yield s
    gc.collect()
    s.close()


@pytest.fixture
def nvme_store(tmp_path):
    s = _C.Store(nvme_dir=tmp_path, direct="fallback")
    yield s
    gc.collect()
    s.close()


def test_host_round_trip_of_tensor_bytes(host_store):
    s = host_store
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(0))
    b = s.alloc("host", x.numel() * x.element_size())
    assert b > 0 and s.tier(b) == "host" and s.size(b) == 37 * 29 * 4
    assert torch.count_nonzero(get(s, b, x)) == 0  # zero-filled
    put(s, b, x)
    assert torch.equal(get(s, b, x), x)
    st = s.stats()
    assert st["bytes"]["host"] == 37 * 29 * 4 and st["blocks"]["host"] == 1
    assert st["nvme_direct"] is None and st["nvme_bytes_written"] == 0
    s.free(b)
    assert s.stats()["bytes"]["host"] == 0 and s.stats()["blocks"]["host"] == 0
    with pytest.raises(FileNotFoundError, match=f"no block {b}"):
        s.size(b)


def test_nvme_round_trip_of_tensor_bytes(nvme_store, tmp_path):
    s = nvme_store
    x = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    nbytes = x.numel() * x.element_size()
    b = s.alloc("host", nbytes)
    put(s, b, x)
    assert s.move([b], "nvme") == 1
    assert s.tier(b) == "nvme" and s.data_ptr(b) is None
    path = s.record_path(b)
    assert os.path.dirname(path) == str(tmp_path)
    assert os.path.getsize(path) >= HEADER + nbytes and os.path.getsize(path) % 4096 == 0
    with open(path, "rb") as f:  # the payload is the tensor's bytes, after the header
        f.seek(HEADER)
        assert f.read(nbytes) == x.numpy().tobytes()
    st = s.stats()
    assert st["bytes"] == {"host": 0, "host_pinned": 0, "device": 0, "uvm": 0, "nvme": nbytes}
    assert st["blocks"]["nvme"] == 1 and st["nvme_writes"] == 1
    assert st["nvme_bytes_written"] >= nbytes and st["nvme_direct"] in (True, False)
    with pytest.raises(_C.AsteriaError) as ei:  # no host memory to view while on NVMe
        s.buffer(b)
    assert ei.value.code == _C.AST_ESTATE and "nvme" in str(ei.value)
    assert s.exports(b) == 0

    assert s.move([b], "host") == 1
    assert s.tier(b) == "host" and s.data_ptr(b) is not None
    assert torch.equal(get(s, b, x), x)
    st = s.stats()
    assert st["bytes"]["nvme"] == 0 and st["bytes"]["host"] == nbytes
    assert st["nvme_reads"] == 1 and st["nvme_bytes_read"] >= nbytes
    with pytest.raises(_C.AsteriaError) as ei:
        s.record_path(b)
    assert ei.value.code == _C.AST_ESTATE


def test_frombuffer_view_shares_the_block_memory(host_store):
    s = host_store
    b = s.alloc("host", 256 * 4)
    buf = s.buffer(b)
    assert (buf.id, buf.nbytes, buf.tier, len(buf)) == (b, 1024, "host", 1024)
    assert buf.ptr == s.data_ptr(b)
    w = torch.frombuffer(buf, dtype=torch.float32)
    r = view(s, b)  # a second, independent export of the same block
    assert s.exports(b) == 2 and s.exports() == 2
    assert w.data_ptr() == r.data_ptr() == s.data_ptr(b)
    w[:] = torch.arange(256, dtype=torch.float32)
    w[17] = -3.5
    assert r[17].item() == -3.5 and r[255].item() == 255.0
    assert float(r.sum()) == sum(range(256)) - 17 - 3.5
    r[0] = 42.0  # and the other way round
    assert w[0].item() == 42.0
    mv = memoryview(s.buffer(b))
    assert not mv.readonly and mv.nbytes == 1024 and mv[0:4].tobytes() == r[0:1].numpy().tobytes()
    assert s.exports(b) == 3
    mv.release()
    del buf, w, r, mv
    gc.collect()
    assert s.exports(b) == 0 and s.exports() == 0


def test_move_free_close_refused_while_a_view_is_alive(nvme_store):
    s = nvme_store
    x = torch.arange(64, dtype=torch.float32)
    b = s.alloc("host", 256)
    other = s.alloc("host", 256)
    put(s, b, x)
    v = view(s, b)
    with pytest.raises(_C.BusyError) as ei:
        s.move([other, b], "nvme")
    e = ei.value
    assert isinstance(e, _C.AsteriaError) and e.code == _C.AST_EBUSY and e.name == "AST_EBUSY"
    assert f"block {b} has 1 exported buffer" in str(e)
    # Refused before anything moved: the other block listed stayed too.
    assert s.tier(other) == "host" and s.tier(b) == "host"
    with pytest.raises(_C.BusyError, match="exported buffer"):
        s.free(b)
    with pytest.raises(_C.BusyError, match="1 buffer"):
        s.close()
    assert not s.closed
    assert torch.equal(v, x)  # still valid memory
    del v
    gc.collect()
    assert s.move([b, other], "nvme") == 2
    assert s.move([b], "host") == 1
    assert torch.equal(get(s, b, x), x)


def test_batched_move_of_50_blocks_and_accounting(nvme_store):
    s = nvme_store
    g = torch.Generator().manual_seed(2)
    sizes = [4 * (100 + 37 * i) for i in range(50)]  # 400 .. 7652 bytes, not 4 KiB aligned
    data, ids = [], []
    for n in sizes:
        b = s.alloc("host", n)
        x = torch.randn(n // 4, generator=g)
        put(s, b, x)
        ids.append(b)
        data.append(x)
    total = sum(sizes)
    st = s.stats()
    assert st["bytes"]["host"] == total and st["blocks"]["host"] == 50

    assert s.move(ids, "nvme") == 50
    st = s.stats()
    assert st["bytes"]["host"] == 0 and st["blocks"]["host"] == 0
    assert st["bytes"]["nvme"] == total and st["blocks"]["nvme"] == 50
    assert st["nvme_writes"] == 50 and st["nvme_bytes_written"] >= total
    assert st["nvme_write_ns"] > 0
    assert all(s.data_ptr(b) is None for b in ids)
    assert len({s.record_path(b) for b in ids}) == 50
    # Blocks already on the target tier count as moved and cost no I/O.
    assert s.move(ids[:10], "nvme") == 10 and s.stats()["nvme_writes"] == 50

    assert s.move(ids, "host") == 50
    st = s.stats()
    assert st["bytes"]["nvme"] == 0 and st["blocks"]["nvme"] == 0
    assert st["bytes"]["host"] == total and st["nvme_reads"] == 50
    assert st["nvme_bytes_read"] >= total and st["nvme_read_ns"] > 0
    for b, x in zip(ids, data):
        assert torch.equal(get(s, b, x), x)
    assert s.move([], "nvme") == 0
    with pytest.raises(ValueError, match="listed twice"):
        s.move([ids[0], ids[0]], "nvme")


def test_flipped_byte_in_record_is_reported_and_data_survives(nvme_store):
    s = nvme_store
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(512, generator=g) for _ in range(3)]
    ids = [s.alloc("host", 2048) for _ in xs]
    for b, x in zip(ids, xs):
        put(s, b, x)
    assert s.move(ids, "nvme") == 3
    bad = ids[1]
    path = s.record_path(bad)
    at = HEADER + 1000
    with open(path, "r+b") as f:
        f.seek(at)
        orig = f.read(1)
        f.seek(at)
        f.write(bytes([orig[0] ^ 0x10]))

    with pytest.raises(_C.AsteriaError) as ei:
        s.move(ids, "host")
    e = ei.value
    assert e.code == _C.AST_ECORRUPT and e.name == "AST_ECORRUPT"
    assert f"block {bad}" in str(e) and path in str(e) and "checksum" in str(e)
    assert e.moved == 2 and "2 of 3 blocks moved" in str(e)
    assert "checksum" in s.last_error()
    # The damaged block stays on NVMe, the others moved; nothing was used silently.
    assert [s.tier(b) for b in ids] == ["host", "nvme", "host"]
    st = s.stats()
    assert st["blocks"]["nvme"] == 1 and st["bytes"]["nvme"] == 2048
    assert st["blocks"]["host"] == 2 and st["bytes"]["host"] == 4096

    with open(path, "r+b") as f:
        f.seek(at)
        f.write(orig)
    assert s.move(ids, "host") == 3
    for b, x in zip(ids, xs):
        assert torch.equal(get(s, b, x), x)


def test_missing_nvme_dir_names_the_path(tmp_path):
    missing = tmp_path / "no" / "such"
    with pytest.raises(FileNotFoundError) as ei:
        _C.Store(nvme_dir=missing)
    assert ei.value.errno == errno.ENOENT and ei.value.code == _C.AST_ENOENT
    assert str(missing) in str(ei.value)
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        _C.Store(nvme_dir=str(tmp_path / "file"))
    with pytest.raises(ValueError, match="'require' or 'fallback'"):
        _C.Store(nvme_dir=tmp_path, direct="maybe")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device behaviour")
@pytest.mark.parametrize("tier", ["device", "host_pinned", "uvm"])
def test_cuda_tiers_raise_without_a_device(host_store, tier):
    s = host_store
    with pytest.raises(_C.AsteriaError) as ei:
        s.alloc(tier, 4096)
    assert ei.value.code == _C.AST_ENODEV and ei.value.name == "AST_ENODEV"
    assert f"tier {tier}" in str(ei.value) and "no CUDA device" in str(ei.value)
    x = torch.arange(16, dtype=torch.int32)
    b = s.alloc("host", 64)
    put(s, b, x)
    with pytest.raises(_C.AsteriaError, match="no CUDA device") as ei:
        s.move([b], tier)
    assert ei.value.code == _C.AST_ENODEV and ei.value.moved == 0
    assert s.tier(b) == "host" and torch.equal(get(s, b, x), x)
    assert s.stats()["bytes"][tier] == 0


def test_bad_arguments_and_closed_store(host_store):
    s = host_store
    with pytest.raises(ValueError, match="allowed: 'host', 'host_pinned'"):
        s.alloc("disk", 16)
    with pytest.raises(ValueError, match="not a valid block size"):
        s.alloc("host", 0)
    with pytest.raises(_C.AsteriaError, match="no NVMe tier") as ei:
        s.alloc("nvme", 16)
    assert ei.value.code == _C.AST_ENOTSUP
    with pytest.raises(TypeError):
        s.move(5, "host")
    with pytest.raises(OverflowError):
        s.free(-1)
    b = s.alloc("host", 16)
    s.free(b)
    with pytest.raises(FileNotFoundError, match=f"no block {b}"):
        s.free(b)
    with pytest.raises(FileNotFoundError):
        s.buffer(b)
    assert s.exports(b) == 0 and s.exports() == 0
    s.close()
    s.close()
    assert s.closed
    with pytest.raises(_C.AsteriaError, match="store is closed") as ei:
        s.alloc("host", 16)
    assert ei.value.code == _C.AST_ESHUTDOWN


def test_context_manager_and_dealloc_remove_record_files(tmp_path):
    with _C.Store(nvme_dir=tmp_path, direct="fallback") as s:
        ids = [s.alloc("nvme", 100) for _ in range(3)]
        assert len(os.listdir(tmp_path)) == 3
        assert all(s.tier(b) == "nvme" for b in ids)
    assert s.closed and os.listdir(tmp_path) == []
    s = _C.Store(nvme_dir=tmp_path, direct="fallback")
    s.alloc("nvme", 100)
    assert len(os.listdir(tmp_path)) == 1
    del s
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_threads_racing_buffers_against_moves(nvme_store):
    """Moves release the GIL; the pin table keeps a buffer from being handed out over a block
    in flight and a move from taking a block someone views. Every view sees the data intact."""
    s = nvme_store
    x = torch.arange(2048, dtype=torch.float32)
    b = s.alloc("host", x.nbytes)
    put(s, b, x)
    counts = {"moved": 0, "viewed": 0, "busy": 0, "nvme": 0}
    lock = threading.Lock()
    errors = []
    done = threading.Event()

    def mover():
        # 100 trips, then on until a trip has gone through and a view has been seen (a loaded
        # machine may starve either side of the race for a while), for at most 30 s
        trips, deadline = 0, time.monotonic() + 30
        while trips < 100 or (min(counts["moved"], counts["viewed"]) < 1
                              and time.monotonic() < deadline):
            trips += 1
            try:
                s.move([b], "nvme")
                s.move([b], "host")
                with lock:
                    counts["moved"] += 1
            except _C.BusyError:
                with lock:
                    counts["busy"] += 1
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
            time.sleep(0.002)  # let the viewers in between trips
        done.set()

    def viewer():
        while not done.is_set():
            try:
                v = view(s, b)
            except _C.BusyError:
                with lock:
                    counts["busy"] += 1
                time.sleep(0.0005)
                continue
            except _C.AsteriaError as e:
                if e.code != _C.AST_ESTATE:  # on NVMe right now: nothing to view
                    errors.append(e)
                with lock:
                    counts["nvme"] += 1
                continue
            if not torch.equal(v, x):
                errors.append(AssertionError("a view saw changed data"))
            with lock:
                counts["viewed"] += 1
            time.sleep(0.0002)  # hold the view a little: the mover must meet it
            del v
            time.sleep(0.001)

    threads = [threading.Thread(target=mover)] + [threading.Thread(target=viewer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert counts["moved"] >= 1 and counts["viewed"] >= 1
    gc.collect()
    assert s.exports() == 0
    assert s.move([b], "host") == 1  # the mover's last trip home may have met a view
    assert s.tier(b) == "host"
    assert torch.equal(get(s, b, x), x)
    st = s.stats()
    assert st["nvme_writes"] == st["nvme_reads"] >= counts["moved"]


BUFFERED_SCRIPT = textwrap.dedent('''
    import os, sys, warnings
    sys.path[:0] = [{tests!r}, {python!r}]
    from asteria import SOAP
    from models import loss_and_grad, make_model
    d = {dir!r}

    def train(nvme_dir):
        model = make_model("mlp")
        opt = SOAP(model.parameters(), precondition_frequency=4,
                   runtime={{"mode": "async", "staleness": 2, "workers": 2,
                             "nvme_dir": nvme_dir, "host_budget_bytes": 1024}})
        for t in range(1, 4):
            loss_and_grad(model, "mlp", t)
            opt.step()
        st = opt.asteria_stats()
        opt.close()
        return st

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        st = train(d)
        again = train(d)  # the same directory again: no second warning
    mine = [w for w in seen if "O_DIRECT" in str(w.message)]
    assert st["nvme_direct"] is False and again["nvme_direct"] is False, st
    assert st["bytes_nvme"] > 0 and st["nvme_writes"] > 0, st  # the tier was really used
    assert len(mine) == 1, [str(w.message) for w in seen]
    assert mine[0].category is RuntimeWarning and repr(d) in str(mine[0].message), mine[0]
    print("OK")
''')


def test_nvme_tier_without_odirect_warns_once(tmp_path):
    """A filesystem that refuses O_DIRECT (ramfs: tmpfs takes it since Linux 6.6) makes the
    NVMe tier fall back to buffered I/O: one RuntimeWarning naming the directory, however many
    optimizers use it. Needs a private mount namespace (`unshare -m`); skipped without it."""
    run_on_private_mount(tmp_path, "ramfs", BUFFERED_SCRIPT)


def test_nvme_tier_with_odirect_does_not_warn(tmp_path, recwarn):
    """The same on pytest's tmp_path, where O_DIRECT works here: no warning."""
    import warnings

    from asteria import SOAP
    from models import loss_and_grad, make_model

    s = _C.Store(nvme_dir=str(tmp_path), direct="fallback")
    direct = s.stats()["nvme_direct"]
    s.close()
    if not direct:
        pytest.skip(f"{tmp_path} has no O_DIRECT on this machine")
    warnings.simplefilter("always")
    model = make_model("mlp")
    opt = SOAP(model.parameters(), precondition_frequency=4,
               runtime={"mode": "async", "staleness": 2, "workers": 2,
                        "nvme_dir": str(tmp_path), "host_budget_bytes": 1024})
    for t in range(1, 3):
        loss_and_grad(model, "mlp", t)
        opt.step()
    opt.close()
    assert not [w for w in recwarn if "O_DIRECT" in str(w.message)]
