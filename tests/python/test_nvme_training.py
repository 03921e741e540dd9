"""The NVMe tier in real training runs (asteria.tiers.residency over _C.Store's io_uring records).

 - with nvme_dir and a host budget too small for all eigenbases / roots, training is BITWISE
   the all-host run (deterministic install), with and without asteria.attach; host-resident
   bytes stay within the budget between steps; bytes moved, record counts and bandwidth are
   reported;
 - faults: a flipped byte in a record (checksum mismatch), a missing record file, ENOSPC (the
   store's byte cap, and a real full tmpfs in a private mount namespace): the step raises a
   TieredStateError naming the block, the file and the cause; the parameters, the step
   counter and the optimizer state are exactly as before the step; once the fault is gone
   (file restored, space freed, or the checkpoint loaded into a fresh optimizer) training
   continues on the fault-free trajectory.
"""

import os
import shutil
import textwrap

import pytest
import torch

from asteria.tiers.residency import Residency, TieredStateError
from models import deterministic_runtime as rt
from models import (loss_and_grad, make_model, optimizer_makers, params_of,
                    require_c_extension, run_on_private_mount, train_hooked)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

MAKERS = optimizer_makers(4)
STEPS = 10
BLOCK = 8 * 8 * 8  # one 8x8 float64 eigenbasis / root
HOST_BUDGET = 2 * BLOCK  # 2 of the mlp's 6 blocks in host memory, 4 on NVMe
HEADER = 64


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def train(name, runtime, steps=STEPS, attached=False, check=None):
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), runtime)
    traj, stats, _ = train_hooked(model, opt, steps, attached, check)
    return traj, stats, opt


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name, attached", [("soap", False), ("soap", True),
                                            ("shampoo", True), ("kl_shampoo", False)])
def test_nvme_run_is_the_all_host_run(tmp_path, name, attached):
    ref, _, _ = train(name, rt())

    def within_budget(opt):
        st = opt.asteria_stats()
        assert st["bytes_host"] <= HOST_BUDGET
        assert st["bytes_host"] + st["bytes_nvme"] == BLOCK * len(opt.placement._residency.keys())

    nv, st, opt = train(name, rt(nvme_dir=str(tmp_path), host_budget_bytes=HOST_BUDGET),
                        attached=attached, check=within_budget)
    for t, (a, b) in enumerate(zip(nv, ref), 1):
        assert same(a, b), f"step {t}"
    assert any("spilled to NVMe" in d for d in opt.asteria_plan())
    assert st["bytes_nvme"] == 4 * BLOCK and st["bytes_host"] == 2 * BLOCK
    assert st["bytes_nvme_read"] > 0 and st["bytes_nvme_written"] > 0
    assert st["nvme_read_MBps"] > 0 and st["nvme_write_MBps"] > 0
    assert st["nvme_reads"] > 0 and st["nvme_writes"] > st["nvme_reads"] - 4
    assert st["nvme_direct"] in (True, False) and st["nvme_window_bytes"] == 4 * BLOCK
    if attached and name == "soap":
        assert st["nvme_fetches_early"] > 0  # the forward hooks read NVMe ahead of step()
    assert os.listdir(tmp_path) == []  # close removed the store's record files


def setup_faulty(tmp_path, name="soap", steps=5):
    """An optimizer with NVMe blocks after `steps` steps, the next step's gradients computed,
    and what is needed to check that a failed step changed nothing."""
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), rt(nvme_dir=str(tmp_path),
                                               host_budget_bytes=HOST_BUDGET))
    for t in range(1, steps + 1):
        loss_and_grad(model, "mlp", t)
        opt.step()
    loss_and_grad(model, "mlp", steps + 1)
    before = {"params": params_of(model), "t": opt.run.t, "sd": opt.state_dict(),
              "counters": dict(opt.run.counters)}
    return model, opt, before


def assert_unchanged(model, opt, before, with_state=True):
    assert same(params_of(model), before["params"])
    assert opt.run.t == before["t"] and opt.run.counters == before["counters"]
    if with_state:
        sd = opt.state_dict()
        assert sd["state"].keys() == before["sd"]["state"].keys()
        for i, st in sd["state"].items():
            ref = before["sd"]["state"][i]
            assert st.keys() == ref.keys()
            for k, v in st.items():
                assert (torch.equal(v, ref[k]) if torch.is_tensor(v) else v == ref[k]), (i, k)


def finish(model, opt, first, steps=STEPS):
    for t in range(first, steps + 1):
        if t > first:
            loss_and_grad(model, "mlp", t)
        opt.step()
    final = params_of(model)
    opt.close()
    return final


def test_checksum_mismatch_raises_and_changes_nothing(tmp_path):
    ref, _, _ = train("soap", rt())
    model, opt, before = setup_faulty(tmp_path)
    key = sorted(opt.placement._residency.on_nvme())[0]
    path = opt.placement._residency.record_path(key)
    with open(path, "r+b") as f:
        f.seek(HEADER + 100)
        orig = f.read(1)
        f.seek(HEADER + 100)
        f.write(bytes([orig[0] ^ 0x01]))
    with pytest.raises(TieredStateError) as ei:
        opt.step()
    msg = str(ei.value)
    assert "checksum mismatch" in msg and path in msg
    assert f"eigenbasis block {key[1]!r} of parameter {key[0]}" in msg
    assert "parameters and optimizer state are unchanged" in msg
    assert ei.value.blocks == [key] and ei.value.files == [path]
    assert ei.value.code == -12 or "AST_ECORRUPT" in msg
    assert_unchanged(model, opt, before, with_state=False)  # the record is still damaged
    with pytest.raises(TieredStateError, match="checksum"):  # and stays detected
        opt.step()
    with open(path, "r+b") as f:  # repair: the same record as before
        f.seek(HEADER + 100)
        f.write(orig)
    assert_unchanged(model, opt, before)
    assert same(finish(model, opt, 6), ref[-1])


def test_missing_record_file_raises_and_changes_nothing(tmp_path):
    ref, _, _ = train("soap", rt())
    model, opt, before = setup_faulty(tmp_path)
    key = sorted(opt.placement._residency.on_nvme())[-1]
    path = opt.placement._residency.record_path(key)
    saved = tmp_path.parent / "saved.rec"
    shutil.move(path, saved)
    with pytest.raises(TieredStateError) as ei:
        opt.step()
    msg = str(ei.value)
    assert path in msg and "No such file or directory" in msg and "cannot open" in msg
    assert isinstance(ei.value.cause, FileNotFoundError)
    assert_unchanged(model, opt, before, with_state=False)
    shutil.move(saved, path)
    assert_unchanged(model, opt, before)
    assert same(finish(model, opt, 6), ref[-1])


def test_enospc_under_the_nvme_byte_cap(tmp_path, monkeypatch):
    """The store's cap (nvme_budget_bytes) holds 2 of the 4 blocks that must go to NVMe: the
    step after the first eigenbases were installed raises; the checkpoint still has the
    whole state, and a fresh optimizer with room continues on the same trajectory."""
    ref, _, _ = train("soap", rt())
    monkeypatch.setattr(Residency, "nvme_budget_bytes", 2 * BLOCK)
    model = make_model("mlp")
    (tmp_path / "a").mkdir()
    opt = MAKERS["soap"](model.parameters(), rt(nvme_dir=str(tmp_path / "a"),
                                                 host_budget_bytes=HOST_BUDGET))
    loss_and_grad(model, "mlp", 1)
    opt.step()  # installs the first eigenbases; their spill is deferred (logged)
    assert opt.asteria_stats()["nvme_spill_deferred"] == 1
    loss_and_grad(model, "mlp", 2)
    before = {"params": params_of(model), "t": opt.run.t, "sd": opt.state_dict(),
              "counters": dict(opt.run.counters)}
    with pytest.raises(TieredStateError) as ei:
        opt.step()
    msg = str(ei.value)
    assert "no space left under nvme_budget_bytes" in msg and "writing" in msg
    assert isinstance(ei.value.cause, OSError) and ei.value.cause.errno == 28
    assert_unchanged(model, opt, before)
    sd = opt.state_dict()
    opt.close()
    monkeypatch.setattr(Residency, "nvme_budget_bytes", 0)
    (tmp_path / "b").mkdir()
    opt2 = MAKERS["soap"](model.parameters(), rt(nvme_dir=str(tmp_path / "b"),
                                                  host_budget_bytes=HOST_BUDGET))
    opt2.load_state_dict(sd)
    assert same(finish(model, opt2, 2), ref[-1])


TMPFS_SCRIPT = textwrap.dedent('''
    import errno, os, sys
    sys.path[:0] = [{tests!r}, {python!r}]
    import torch
    from asteria import SOAP
    from asteria.tiers.residency import TieredStateError
    from models import loss_and_grad, make_model, params_of
    d = {dir!r}
    rt = {{"mode": "async", "staleness": 2, "workers": 2}}
    def make(m, **kw):
        return SOAP(m.parameters(), precondition_frequency=4, runtime=dict(rt, **kw))
    ref = make_model("mlp"); o = make(ref)
    for t in range(1, 7):
        loss_and_grad(ref, "mlp", t); o.step()
    o.close()
    filler = os.path.join(d, "filler")
    m = make_model("mlp")
    o = make(m, nvme_dir=os.path.join(d, "nvme"), host_budget_bytes={budget})
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)  # fill the tmpfs
    try:
        while True:
            os.write(fd, b"x" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    os.close(fd)
    loss_and_grad(m, "mlp", 1); o.step()  # the eigenbases' first spill fails: deferred
    loss_and_grad(m, "mlp", 2)
    before = params_of(m); t0 = o.run.t
    try:
        o.step()
        raise SystemExit("step 2 did not raise")
    except TieredStateError as e:
        assert e.cause.errno == errno.ENOSPC and "No space left" in str(e), str(e)
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), before)) and o.run.t == t0
    os.unlink(filler)  # space again: the same step now succeeds
    o.step()
    for t in range(3, 7):
        loss_and_grad(m, "mlp", t); o.step()
    assert o.asteria_stats()["bytes_nvme"] > 0
    o.close()
    assert all(torch.equal(a, b) for a, b in zip(params_of(m), params_of(ref)))
    print("OK")
''')


def test_enospc_on_a_full_tmpfs(tmp_path):
    """A real ENOSPC from the filesystem: a 256 KiB tmpfs mounted in a private mount namespace
    (needs `unshare -m` and mount rights; skipped without them)."""
    run_on_private_mount(tmp_path, "tmpfs", TMPFS_SCRIPT, options="size=256k",
                         then=f"mkdir {tmp_path / 'mnt'}/nvme", budget=HOST_BUDGET)
