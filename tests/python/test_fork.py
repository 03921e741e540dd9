"""fork() of a training process, with and without the NVMe tier (issue 12, case 1).

Real os.fork(), real io_uring, real worker pool. A child process must never harm its parent,
and a child gets working state:
 (a) a child that takes a checkpoint (``state_dict()``) and ends with ``os._exit``;
 (b) a child that trains on for a few steps (its own io_uring ring, its own records);
 (c) a child that ends through normal interpreter shutdown (``sys.exit``: atexit runs the
     optimizer's finalizer in the child) or is a multiprocessing "fork" Process, in a separate
     interpreter so that the shutdown is a real one;
 (d) a child forked while a REFRESH job is in flight (kept slow by the test-only job delay,
     job_delay.py): the child runs the job again and follows the parent's trajectory bitwise;
 (e) a child forked while another thread waits in Runtime.wait closes the runtime without
     waiting for that thread (which it does not have).
In every case the parent's parameters equal a run with no fork, bitwise, and after close no
record file is left in nvme_dir.
"""

import os
import pickle
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import asteria
from asteria import SOAP, Shampoo
from job_delay import delay_jobs, set_job_delay
from models import loss_and_grad, make_model, params_of, require_c_extension

STEPS = 10
BLOCK = 8 * 8 * 8        # one 8x8 float64 eigenbasis / root
HOST_BUDGET = 2 * BLOCK  # 2 of the mlp's 6 blocks in host memory, the rest on NVMe
MAKERS = {
    "soap": lambda p, rt: SOAP(p, precondition_frequency=4, runtime=rt),
    "shampoo": lambda p, rt: Shampoo(p, lr=3e-3, precondition_frequency=4, runtime=rt),
}


@pytest.fixture(autouse=True)
def _c_extension():
    require_c_extension()


def runtime(nvme_dir=None):
    rt = {"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2}
    if nvme_dir is not None:
        rt.update(nvme_dir=str(nvme_dir), host_budget_bytes=HOST_BUDGET)
    else:  # the host tier (a residency in the child too), which "auto" gives CPU params no more
        rt.update(placement={"roots": "host", "eigenbases": "host"})
    return rt


def train(opt, model, first, last, traj=None):
    for t in range(first, last + 1):
        loss_and_grad(model, "mlp", t)
        opt.step()
        if traj is not None:
            traj.append(params_of(model))


def reference(name):
    """The trajectory with no fork (the C pool, async, no NVMe: the NVMe tier does not change
    it, test_nvme_training.py)."""
    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), runtime())
    traj = []
    try:
        train(opt, model, 1, STEPS, traj)
    finally:
        opt.close()
    return traj


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def in_child(body, out_path):
    """Fork; the child runs body() and sends its return value (pickled) through out_path, then
    ends with os._exit (never back into pytest). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            result = {"ok": body()}
        except BaseException:
            result = {"error": traceback.format_exc()}
            code = 1
        try:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
        finally:
            os._exit(code)
    return pid


def child_result(pid, out_path):
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status), f"the child died: status {status:#x}"
    with open(out_path, "rb") as f:
        result = pickle.load(f)
    assert "error" not in result, f"the child failed:\n{result['error']}"
    assert os.WEXITSTATUS(status) == 0
    return result["ok"]


def records(nvme_dir):
    return sorted(os.listdir(nvme_dir)) if nvme_dir is not None else []


NVME = [pytest.param(False, id="host"), pytest.param(True, id="nvme")]


def new_run(tmp_path, name, nvme):
    """``name``'s no-fork trajectory, and a new run of it (its NVMe tier in tmp_path / "nvme"
    if ``nvme``): (that trajectory, the NVMe directory or None, the model, the optimizer)."""
    ref = reference(name)
    nvme_dir = tmp_path / "nvme" if nvme else None
    if nvme:
        nvme_dir.mkdir()
    model = make_model("mlp")
    return ref, nvme_dir, model, MAKERS[name](model.parameters(), runtime(nvme_dir))


@pytest.mark.parametrize("nvme", NVME)
@pytest.mark.parametrize("name", list(MAKERS))
def test_child_checkpoint_then_os_exit(tmp_path, name, nvme):
    """(a) A background checkpoint in a child: the child's state_dict() holds the state at the
    fork (NVMe blocks read back from the parent's records); the parent trains on, unharmed."""
    ref, nvme_dir, model, opt = new_run(tmp_path, name, nvme)
    train(opt, model, 1, 5)
    assert not nvme or opt.asteria_stats()["bytes_nvme"] > 0
    want = opt.state_dict()
    mine = records(nvme_dir)

    def checkpoint():
        sd = opt.state_dict()
        return {i: {k: v for k, v in st.items()} for i, st in sd["state"].items()}

    pid = in_child(checkpoint, tmp_path / "child.pkl")
    got = child_result(pid, tmp_path / "child.pkl")
    assert records(nvme_dir) == mine  # the child left the parent's records alone, and no file
    for i, st in want["state"].items():
        for k, v in st.items():
            assert (torch.equal(got[i][k], v) if torch.is_tensor(v) else got[i][k] == v), (i, k)
    traj = []
    train(opt, model, 6, STEPS, traj)
    opt.close()
    assert same(traj[-1], ref[-1])
    assert records(nvme_dir) == []


@pytest.mark.parametrize("nvme", NVME)
@pytest.mark.parametrize("name", list(MAKERS))
def test_child_trains_on(tmp_path, name, nvme):
    """(b) The child steps the optimizer (NVMe reads and writes through its own ring and
    records) while the parent waits, then the parent trains on: both follow the no-fork
    trajectory bitwise."""
    ref, nvme_dir, model, opt = new_run(tmp_path, name, nvme)
    train(opt, model, 1, 5)

    def steps():
        traj = []
        train(opt, model, 6, 8, traj)
        st = opt.asteria_stats()
        return {"traj": traj, "failed": st["jobs_failed"],
                "nvme_rw": (st.get("bytes_nvme_read", 0), st.get("bytes_nvme_written", 0))}

    before = opt.asteria_stats()
    pid = in_child(steps, tmp_path / "child.pkl")
    got = child_result(pid, tmp_path / "child.pkl")
    for t, (a, b) in enumerate(zip(got["traj"], ref[5:8]), 6):
        assert same(a, b), f"child, step {t}"
    assert got["failed"] == 0
    if nvme:  # the child really used the NVMe tier
        assert got["nvme_rw"][0] > before["bytes_nvme_read"]
        assert got["nvme_rw"][1] > before["bytes_nvme_written"]
    traj = []
    train(opt, model, 6, STEPS, traj)
    assert opt.asteria_stats()["jobs_failed"] == 0
    opt.close()
    for t, (a, b) in enumerate(zip(traj, ref[5:]), 6):
        assert same(a, b), f"parent, step {t}"
    assert records(nvme_dir) == []


CHILD_EXIT_SCRIPT = textwrap.dedent('''
    import multiprocessing, os, sys
    sys.path[:0] = [{tests!r}, {python!r}]
    import torch
    from asteria import SOAP, Shampoo
    from models import loss_and_grad, make_model, params_of
    MAKERS = {{
        "soap": lambda p, rt: SOAP(p, precondition_frequency=4, runtime=rt),
        "shampoo": lambda p, rt: Shampoo(p, lr=3e-3, precondition_frequency=4, runtime=rt),
    }}
    name, how, nvme_dir = {name!r}, {how!r}, {nvme_dir!r}
    rt = {{"mode": "async", "staleness": 2, "install": "deterministic", "workers": 2}}
    if nvme_dir:
        rt.update(nvme_dir=nvme_dir, host_budget_bytes={budget})

    def train(opt, model, first, last):
        for t in range(first, last + 1):
            loss_and_grad(model, "mlp", t)
            opt.step()

    no_nvme = {{k: v for k, v in rt.items() if k not in ("nvme_dir", "host_budget_bytes")}}
    ref = make_model("mlp"); o = MAKERS[name](ref.parameters(), no_nvme)
    train(o, ref, 1, {steps}); o.close()  # the run with no fork

    model = make_model("mlp")
    opt = MAKERS[name](model.parameters(), rt)
    train(opt, model, 1, 5)
    files = sorted(os.listdir(nvme_dir)) if nvme_dir else []

    def child_work():
        opt.state_dict()
        loss_and_grad(model, "mlp", 6)
        opt.step()

    if how == "sys_exit":
        pid = os.fork()
        if pid == 0:
            child_work()
            sys.exit(0)  # normal interpreter shutdown: atexit runs the optimizer's finalizer
        _, status = os.waitpid(pid, 0)
    else:  # a multiprocessing "fork" Process (a DataLoader worker, a background checkpoint)
        p = multiprocessing.get_context("fork").Process(target=child_work)
        p.start(); p.join()
        status = p.exitcode << 8
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    now = sorted(os.listdir(nvme_dir)) if nvme_dir else []
    assert now == files, ("the child changed the parent's records", files, now)
    train(opt, model, 6, {steps})
    assert opt.asteria_stats()["jobs_failed"] == 0
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(ref)))
    assert not nvme_dir or os.listdir(nvme_dir) == []
    print("OK")
''')


@pytest.mark.parametrize("how", ["sys_exit", "mp_process"])
@pytest.mark.parametrize("nvme", NVME)
@pytest.mark.parametrize("name", list(MAKERS))
def test_child_ends_by_interpreter_shutdown(tmp_path, name, nvme, how):
    """(c) The child ends the way a Python process ends (its finalizers run); the parent's
    records stay, and its next steps work on the no-fork trajectory. Runs in its own
    interpreter, so that the child's shutdown is a real one (not pytest's)."""
    nvme_dir = tmp_path / "nvme" if nvme else None
    if nvme:
        nvme_dir.mkdir()
    here = os.path.dirname(os.path.abspath(__file__))
    python = os.path.dirname(os.path.dirname(asteria.__file__))
    script = tmp_path / "child_exit.py"
    script.write_text(CHILD_EXIT_SCRIPT.format(
        tests=here, python=python, name=name, how=how,
        nvme_dir=str(nvme_dir) if nvme else "", budget=HOST_BUDGET, steps=STEPS))
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout + res.stderr


@pytest.mark.parametrize("nvme", NVME)
@pytest.mark.parametrize("name", list(MAKERS))
def test_fork_with_a_refresh_in_flight(tmp_path, name, nvme):
    """(d) Forked right after the first step that leaves a refresh in flight (every job sleeps
    400 ms on its worker first, so it is certainly queued or running at the fork): the child
    runs it again and installs the same result at the same step, so the child's steps after
    the fork are the parent's bitwise (and the no-fork run's), and no job failed in either."""
    ref, nvme_dir, model, opt = new_run(tmp_path, name, nvme)
    delay_jobs(opt, 400)
    fork_at = 0
    for t in range(1, STEPS - 2):  # up to the first step that leaves a refresh in flight
        train(opt, model, t, t)
        st = opt.asteria_stats()
        if t > 1 and st["jobs_queued"] + st["jobs_running"] > 0:
            fork_at = t
            break
    assert fork_at, "no step left a refresh in flight"

    def rest():
        traj = []
        train(opt, model, fork_at + 1, STEPS, traj)
        return {"traj": traj, "failed": opt.asteria_stats()["jobs_failed"]}

    pid = in_child(rest, tmp_path / "child.pkl")
    traj = []
    train(opt, model, fork_at + 1, STEPS, traj)
    st = opt.asteria_stats()
    opt.close()
    got = child_result(pid, tmp_path / "child.pkl")
    assert st["jobs_failed"] == 0 and got["failed"] == 0
    assert len(traj) == len(got["traj"]) >= 4
    for t, (a, b, r) in enumerate(zip(got["traj"], traj, ref[fork_at:]), fork_at + 1):
        assert same(b, r), f"parent, step {t}"
        assert same(a, b), f"child, step {t}"
    assert records(nvme_dir) == []


def test_child_closes_a_runtime_another_thread_was_waiting_on():
    """Forked while another thread of the parent waits in Runtime.wait (a call in flight on
    the runtime handle, GIL released): that thread does not exist in the child, so the child's
    close() must not wait for it (before: the child hung in close for ever). The parent's
    waiter gets its result as usual."""
    import threading
    import time

    from asteria import _C

    rt = _C.Runtime({"workers": 1})
    set_job_delay(rt, 1500)
    n = 16
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    f = (a @ a.T + n * torch.eye(n, dtype=torch.float64)).contiguous()
    q = torch.zeros(n, n, dtype=torch.float64)
    handles = [rt.register(t.data_ptr(), t.numel() * 8) for t in (f, q)]
    ticket = rt.submit("eigh", "float64", n, 1, f.data_ptr(), None, q.data_ptr(), None,
                       block=1, version=1, deadline=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(rt.wait(ticket)))
    waiter.start()
    time.sleep(0.3)  # the waiter is inside Runtime.wait now
    pid = os.fork()
    if pid == 0:
        try:
            rt.close()
            code = 0
        except BaseException:
            code = 1
        os._exit(code)
    deadline = time.monotonic() + 30
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        waiter.join()
        rt.close()
        pytest.fail("the child hung closing a runtime another thread was using at the fork")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    waiter.join()
    assert got and got[0].status == 0 and got[0].ticket == ticket
    for h in handles:
        rt.unregister(h)
    rt.close()
