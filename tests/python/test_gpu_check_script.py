"""The GPU check writes as it goes (tests/gpu/run.sh, tests/gpu/train_smoke.py), checked on
the CPU with a stage forced to fail or to hang:

 - run.sh writes $OUT/gpu_check.json when it starts and after every stage, with what the
   machine has: a build stage that fails leaves the stages before it, its own error (its log's
   tail) and the stages after it; the global timeout (ASTERIA_GPU_TOTAL_S) interrupting a stage
   that hangs leaves the stages before it, that stage marked timed out with its log, and the
   timeout itself, and ends the hanging stage's processes;
 - train_smoke.py (stage 5) runs its logic on the CPU, and a SIGTERM (its stage's timeout)
   leaves its JSON with the checks done so far and the state "timed out";
 - train_f1.py (stage 7) runs its logic on the CPU: f=1 S=0 on the host workers against native
   f=1 and f=10, its trajectory checks, energy null with the reason; without --device cpu and
   no GPU it exits 77; its NVML meter reads the energy counter, else integrates power samples,
   else says why not (a stand-in NVML).

The stage is forced with a stand-in `cmake` first on PATH (it answers --version, then fails or
hangs), in a copy of tests/gpu: nothing of this checkout's build is touched."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

# the GPU check's scripts: tested once, in the main environment (scripts/run_tests.sh)
pytestmark = pytest.mark.main_env_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FAKE_CMAKE = """#!/bin/sh
case "$1" in --version) echo "cmake version 3.30.0"; exit 0;; esac
echo $$ >> "{pids}"
case "{mode}" in
  fail) case "$*" in *--build*) echo "stand-in cmake: boom, the build broke"; exit 3;; esac
        mkdir -p "$3"; exit 0;;
  hang) echo "stand-in cmake: hanging"; exec sleep 600;;
esac
"""


def _pkg(mod):
    return shutil.which("pkg-config") and subprocess.run(
        ["pkg-config", "--exists", mod]).returncode == 0


def _tree(tmp_path, mode):
    if not (_pkg("openblas") and _pkg("lapacke")):
        pytest.skip("needs OpenBLAS and LAPACKE (else run.sh never reaches its build stages)")
    try:
        import torch  # noqa: F401
        if torch.cuda.is_available():
            pytest.skip("a GPU is here: run.sh would go on to its GPU stages")
    except ImportError:
        pytest.skip("needs torch")
    work = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "tests", "gpu"), work / "tests" / "gpu")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pids = tmp_path / "cmake.pids"
    fake = bin_dir / "cmake"
    fake.write_text(FAKE_CMAKE.format(pids=pids, mode=mode))
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PATH=f"{bin_dir}:{os.environ['PATH']}",
               ASTERIA_GPU_DEBS=str(tmp_path / "no-debs"),
               ASTERIA_GPU_WHEELS=str(tmp_path / "no-wheels"))
    env.pop("ASTERIA_GPU_INNER", None)
    env.pop("ASTERIA_GPU_T0", None)
    return work, out, env, pids


def _steps(out):
    rec = json.loads((out / "gpu_check.json").read_text())
    return rec, {s["step"]: s for s in rec["steps"]}


@pytest.mark.timeout(300)
def test_a_failing_stage_leaves_the_ones_before_it_and_its_error(tmp_path):
    work, out, env, _ = _tree(tmp_path, "fail")
    r = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=280)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    rec, steps = _steps(out)
    assert rec["state"] == "finished" and rec["exit_code"] == 1
    # what the machine has, recorded first
    assert rec["machine"]["cmake"] == "cmake version 3.30.0"
    for key in ("python", "torch", "nvcc", "glibc", "Python.h", "ninja", "pip"):
        assert key in rec["machine"], key
    order = [s["step"] for s in rec["steps"]]
    assert order.index("dep:openblas") < order.index("cmake-configure") < \
        order.index("build-libasteria") < order.index("gpu")
    assert steps["cmake-configure"]["status"] == "ok"
    bad = steps["build-libasteria"]
    assert bad["status"] == "failed" and bad["detail"] == "exit 3"
    assert any("boom, the build broke" in line for line in bad["log_tail"])
    assert steps["gpu"]["status"] == "skipped"  # the stages after it still ran


@pytest.mark.timeout(300)
def test_the_global_timeout_leaves_the_stages_before_it_and_ends_the_hung_one(tmp_path):
    work, out, env, pids = _tree(tmp_path, "hang")
    env["ASTERIA_GPU_TOTAL_S"] = "45"
    t0 = time.monotonic()
    r = subprocess.run(["bash", "tests/gpu/run.sh"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=280)
    took = time.monotonic() - t0
    assert r.returncode == 124, r.stdout[-3000:] + r.stderr[-2000:]
    assert took < 45 + 30, took
    rec, steps = _steps(out)
    assert rec["state"] == "timed out" and rec["exit_code"] == 124
    if "cmake-configure" not in steps:
        pytest.skip(f"the machine was too slow to reach the build in 45 s: {list(steps)}")
    assert steps["dep:openblas"]["status"] == "found"
    hung = steps["cmake-configure"]
    assert hung["status"] == "timed out" and "global timeout" in hung["detail"]
    assert any("stand-in cmake: hanging" in line for line in hung["log_tail"])
    assert steps["global-timeout"]["status"] == "timed out"
    # the hung stage's processes were ended with it
    time.sleep(1)
    for pid in (int(p) for p in pids.read_text().split()):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the hung stage's process {pid} outlived the check")


# train_smoke.py run as a stage that hangs after its "sync" check (its check records, then
# sleeps), so the stage's timeout lands mid-way wherever the machine's speed puts the polling.
HANG_AFTER_SYNC = """
import sys, time
sys.path.insert(0, sys.argv.pop(1))
import train_smoke
record = train_smoke.stage_record
def hanging(rec, out, tag):
    write, check = record(rec, out, tag)
    def check_then_hang(name, ok, detail):
        check(name, ok, detail)
        if name == "sync":
            time.sleep(600)
    return write, check_then_hang
train_smoke.stage_record = hanging
sys.exit(train_smoke.main(sys.argv[1:]))
"""


def _smoke(tmp_path, *, timeout_s=None):
    out = tmp_path / "smoke.json"
    import asteria  # the package under test (installed, or a dev build), not the source tree

    pkg_root = os.path.dirname(os.path.dirname(asteria.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, os.path.join(ROOT, "tests", "gpu", "train_smoke.py"), "--device",
           "cpu", "--out", str(out)]
    if timeout_s is not None:  # the stage hangs once "sync" is recorded, until its SIGTERM
        cmd[1:2] = ["-c", HANG_AFTER_SYNC, os.path.join(ROOT, "tests", "gpu")]
    if timeout_s is None:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    else:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        deadline = time.monotonic() + 120
        # SIGTERM once the first training run has been recorded (the stage hangs there)
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if "sync" in json.loads(out.read_text()).get("checks", {}):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, _ = proc.communicate(timeout=60)
        r = subprocess.CompletedProcess(cmd, proc.returncode, stdout, "")
    return r, json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_train_smoke_logic_on_the_cpu(tmp_path):
    pytest.importorskip("asteria._C")
    r, rec = _smoke(tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rec["state"] == "passed"
    checks = rec["checks"]
    for name in ("libasteria", "sync", "async", "async-pinned", "async=sync",
                 "async-pinned=sync", "sync-f32", "async-f32", "async-f32=sync-f32",
                 "ring-used"):
        assert checks[name]["ok"], (name, checks[name])


@pytest.mark.timeout(300)
def test_train_smoke_terminated_leaves_its_json(tmp_path):
    pytest.importorskip("asteria._C")
    r, rec = _smoke(tmp_path, timeout_s=True)
    assert r.returncode == 1, r.stdout[-3000:]
    assert rec["state"] == "timed out" and "signal 15" in rec["error"]
    assert rec["checks"]["libasteria"]["ok"] and rec["checks"]["sync"]["ok"]
    assert "ring-used" not in rec["checks"]


def _f1(tmp_path, *args):
    out = tmp_path / "f1.json"
    import asteria

    pkg_root = os.path.dirname(os.path.dirname(asteria.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "gpu", "train_f1.py"),
                        "--out", str(out), *args], env=env, capture_output=True, text=True,
                       timeout=560)
    return r, out


@pytest.mark.timeout(600)
def test_train_f1_logic_on_the_cpu(tmp_path):
    pytest.importorskip("asteria._C")
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        import train_f1
        from train_smoke import STEPS as CHECK_STEPS, TOL, TOL_F32_LOSS
    finally:
        sys.path.pop(0)
    # a budget per run no loaded 2-core machine spends: every run makes its 60 steps
    r, out = _f1(tmp_path, "--device", "cpu", "--run-budget-s", "400")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["state"] == "passed" and rec["device"] == "cpu"
    for name in ("native-f10", "native-f1", "asteria-f1-s0", "native-f1-f64",
                 "asteria-f1-s0-f64", "asteria-f1-s0-f64=native-f1-f64",
                 "asteria-f1-s0=native-f1"):
        assert rec["checks"][name]["ok"], (name, rec["checks"][name])
    runs = rec["runs"]
    assert runs["native-f10"]["precondition_frequency"] == 10
    assert runs["native-f1"]["runtime"] == {"mode": "sync"}
    assert runs["asteria-f1-s0"]["precondition_frequency"] == 1
    assert runs["asteria-f1-s0"]["runtime"]["mode"] == "async"
    assert runs["asteria-f1-s0"]["runtime"]["staleness"] == 0
    for name in ("native-f10", "native-f1", "asteria-f1-s0"):
        steps = runs[name]["steps"]
        assert [s["step"] for s in steps] == list(range(1, train_f1.STEPS + 1)), name
        assert all(s["s"] > 0 and s["cpu_s"] >= 0 for s in steps), name
        assert runs[name]["median_step_s"] > 0
        # no GPU: no energy, and why
        assert runs[name]["energy"]["per_step_j"] is None
        assert "no GPU" in runs[name]["energy"]["reason"]
    for name in ("native-f1-f64", "asteria-f1-s0-f64"):
        assert len(runs[name]["steps"]) == CHECK_STEPS
    # the host workers ran asteria's refreshes, one round a step
    assert runs["asteria-f1-s0"]["stats"]["jobs_done"] > 0
    # the trajectory, from the recorded losses and parameters, to train_smoke's tolerances
    a, n = runs["asteria-f1-s0"]["steps"], runs["native-f1"]["steps"]
    rel = [abs(p["loss"] - q["loss"]) / abs(q["loss"]) for p, q in zip(a, n)]
    assert max(rel[:CHECK_STEPS]) <= TOL_F32_LOSS
    assert rel == runs["asteria-f1-s0"]["loss_rel_diff_to_native_f1"]
    assert runs["asteria-f1-s0-f64"]["rel_diff_to_native_f1"] <= TOL
    a64, n64 = runs["asteria-f1-s0-f64"]["steps"], runs["native-f1-f64"]["steps"]
    assert max(abs(p["loss"] - q["loss"]) / abs(q["loss"]) for p, q in zip(a64, n64)) <= TOL
    summary = rec["summary"]
    assert set(summary["median_step_s"]) == {"native-f10", "native-f1", "asteria-f1-s0"}
    assert set(summary["step_time_ratio"]) == {"asteria-f1-s0/native-f1",
                                               "asteria-f1-s0/native-f10"}
    assert summary["step_time_ratio"]["asteria-f1-s0/native-f1"] == pytest.approx(
        summary["median_step_s"]["asteria-f1-s0"] / summary["median_step_s"]["native-f1"],
        rel=1e-3)
    assert summary["energy_method"] is None and "no GPU" in summary["energy_reason"]
    assert set(summary["energy_per_step_j"].values()) == {None}
    assert rec["energy"]["method"] is None and rec["energy"]["reason"]


def test_train_f1_without_a_gpu_exits_77(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r, out = _f1(tmp_path)
    assert r.returncode == 77, r.stdout + r.stderr
    assert "[train-f1] no GPU: skipped" in r.stdout


class _Clock:
    """``perf_counter()`` as train_f1 reads it (and the stand-in's energy counter), held by the
    test: it moves only by ``now +=``."""

    def __init__(self):
        self.now = 1000.0

    def perf_counter(self):
        return self.now


class _FakeNVML:
    """pynvml's calls the meter makes; power in W, the counter in mJ from ``clock``."""

    class NVMLError(Exception):
        pass

    def __init__(self, watts, counter=True, init=True, clock=time):
        self.watts, self.counter, self.init, self.clock = watts, counter, init, clock
        self.bus = None
        self.shut = False

    def nvmlInit(self):
        if not self.init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetHandleByPciBusId(self, bus):
        self.bus = bus
        return "handle"

    def nvmlDeviceGetName(self, handle):
        return b"Stand-in GPU"

    def nvmlSystemGetDriverVersion(self):
        return "999.1"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        if not self.counter:
            raise self.NVMLError("Not Supported")
        return int(self.clock.perf_counter() * self.watts * 1e3)

    def nvmlDeviceGetPowerUsage(self, handle):
        return int(self.watts * 1e3)


@pytest.mark.parametrize("counter", [True, False])
def test_train_f1_energy_meter(monkeypatch, counter):
    import types

    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        import train_f1
    finally:
        sys.path.pop(0)
    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    # the meter's clock and the counter's are one clock the test holds: a window of exactly
    # 0.3 s, whatever the machine's load puts between the meter's reads
    clock = _Clock()
    monkeypatch.setattr(train_f1, "time", clock)
    nvml = _FakeNVML(250.0, counter=counter, clock=clock)
    meter = train_f1.EnergyMeter("cuda", nvml=nvml)
    assert nvml.bus == b"00000000:3B:00.0"
    assert meter.method == ("total_energy_counter" if counter else "power_samples")
    assert meter.reason is None and meter.info["nvml_device"] == "Stand-in GPU"
    assert ("counter_unsupported" in meter.info) != counter
    meter.start()
    if not counter:  # the sampling thread's first two readings, however long they take
        deadline = time.monotonic() + 30
        while len(meter._samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    clock.now += 0.3
    e = meter.stop(10)
    meter.close()
    assert nvml.shut
    assert e["method"] == meter.method and e["steps"] == 10 and e["window_s"] == 0.3
    # 250 W over the window, counted or integrated
    assert e["energy_j"] == pytest.approx(250.0 * e["window_s"], rel=0.05)
    assert e["per_step_j"] == pytest.approx(e["energy_j"] / 10, rel=1e-3)
    assert e["mean_power_w"] == pytest.approx(250.0, rel=0.05)
    if not counter:
        assert e["samples"] >= 2


def test_train_f1_energy_meter_says_why_not(monkeypatch):
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        import train_f1
    finally:
        sys.path.pop(0)
    meter = train_f1.EnergyMeter("cuda", nvml=_FakeNVML(100.0, init=False))
    assert meter.method is None and "Driver Not Loaded" in meter.reason
    meter.start()
    assert meter.stop(5) == {"method": None, "per_step_j": None, "reason": meter.reason}
    cpu = train_f1.EnergyMeter("cpu")
    assert cpu.method is None and "no GPU" in cpu.reason
