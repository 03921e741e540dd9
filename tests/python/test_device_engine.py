"""The device REFRESH executor's runner thread (asteria.refresh.device.DeviceEngine) on the CPU:
whatever a job raises in that thread reaches the caller's ``wait()`` (as a RuntimeError naming
the job and the exception, which is its cause), ``ready()`` turns true so no caller polls
forever, the thread keeps serving the next jobs, and ``close()`` returns. torch's numerical
failures stay statuses (``inline_torch.run`` turns them into a negative status), so what is
injected here is what ``run`` does not catch: an exception of another type (a bug, an
``AssertionError``, a ``KeyboardInterrupt`` delivered to that thread).

The device executor runs its jobs the same way on a CPU device (``DeviceEngine("cpu")``); the
job function it calls is replaced in its module, torch is left alone."""

import threading

import pytest
import torch

from asteria.refresh import device as device_mod
from asteria.refresh.device import DeviceEngine


def spd(batch, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, n, n, generator=g, dtype=torch.float64)
    return a @ a.transpose(-1, -2) / n + torch.eye(n, dtype=torch.float64)


def wait_bounded(eng, ticket, seconds=20.0):
    """eng.wait(ticket) on another thread: (returned result or raised exception); fails the
    test when wait() is still blocked after ``seconds`` (the runner thread died)."""
    box = {}

    def target():
        try:
            box["result"] = eng.wait(ticket)
        except BaseException as exc:  # noqa: BLE001 - the test inspects what reached wait()
            box["raised"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "wait() still blocked: the runner thread died with the job unset"
    return box


@pytest.mark.parametrize("exc", [TypeError("injected bug"), AssertionError("injected assert"),
                                 KeyboardInterrupt()], ids=["TypeError", "AssertionError",
                                                            "KeyboardInterrupt"])
def test_any_exception_in_the_runner_reaches_wait(monkeypatch, exc):
    real = device_mod.run
    calls = []

    def run(op, *args, **kw):
        calls.append(op)
        if len(calls) == 1:
            raise exc
        return real(op, *args, **kw)

    monkeypatch.setattr(device_mod, "run", run)
    eng = DeviceEngine("cpu")
    try:
        bad = eng.submit("eigh", spd(2, 8), block=1, version=1, deadline=1, snapshot_step=0)
        box = wait_bounded(eng, bad)
        raised = box.get("raised")
        assert isinstance(raised, RuntimeError), box
        assert "eigh" in str(raised) and type(exc).__name__ in str(raised)
        assert raised.__cause__ is exc
        assert eng.stats()["jobs_failed"] == 1
        # the thread survived: the next job runs and its result arrives
        good = eng.submit("eigh", spd(2, 8, seed=1), block=2, version=1, deadline=1,
                          snapshot_step=0)
        res = wait_bounded(eng, good).get("result")
        assert res is not None and res.status == 0 and res.outputs is not None
        with pytest.raises(ValueError, match="unknown or already"):
            eng.wait(bad)  # the failed ticket was handed out once
    finally:
        eng.close()


def test_ready_turns_true_for_a_job_that_raised(monkeypatch):
    def run(*args, **kw):
        raise ValueError("injected")

    monkeypatch.setattr(device_mod, "run", run)
    eng = DeviceEngine("cpu")
    try:
        tk = eng.submit("eigh", spd(1, 4), block=1, version=1, deadline=1, snapshot_step=0)
        done = threading.Event()

        def poll():
            while not eng.ready(tk):
                pass
            done.set()

        threading.Thread(target=poll, daemon=True).start()
        assert done.wait(20.0), "ready() never turned true: the runner thread died"
        with pytest.raises(RuntimeError, match="ValueError: injected") as info:
            eng.wait(tk)
        assert isinstance(info.value.__cause__, ValueError)
    finally:
        eng.close()


def test_close_returns_after_a_job_raised(monkeypatch):
    def run(*args, **kw):
        raise TypeError("injected")

    monkeypatch.setattr(device_mod, "run", run)
    eng = DeviceEngine("cpu")
    eng.submit("eigh", spd(1, 4), block=1, version=1, deadline=1, snapshot_step=0)
    closer = threading.Thread(target=eng.close, daemon=True)
    closer.start()
    closer.join(20.0)
    assert not closer.is_alive(), "close() blocked"


def test_capacity_report_names_tf32_when_a_device_lane_runs():
    """torch's float32 matmul precision is process-wide: under "high" / "medium" the device
    lane's matmuls run in TF32 while the host lane's stay FP32. The report says so."""
    from asteria.refresh.capacity import report_lines

    base = {"lanes": {"host": 2, "device": 1}, "splits_batches": True}
    for prec, named in (("highest", False), ("high", True), ("medium", True)):
        lines = report_lines(dict(base, float32_matmul_precision=prec))
        assert any("TF32" in ln and repr(prec) in ln for ln in lines) == named, lines
    # a host-only run has no device lane to mix in
    lines = report_lines({"lanes": {"host": 2}, "splits_batches": True,
                          "float32_matmul_precision": "high"})
    assert not any("TF32" in ln for ln in lines)
