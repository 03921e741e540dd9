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
   else says why not (a stand-in NVML);
 - train_drift.py (stage 7b) runs its logic on the CPU: refresh_policy "drift" (budget and d
   auto, and a fixed budget run twice, bitwise) against native f=10, its figures recomputed
   from the recorded steps; without a GPU it exits 77, a SIGTERM leaves its JSON.

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


# ---- stage 8: benchmarks/gpu_microbench.py, its logic on the CPU -------------------------------

MICROBENCH = os.path.join(ROOT, "benchmarks", "gpu_microbench.py")


def _microbench(*args, timeout=120):
    return subprocess.run([sys.executable, MICROBENCH, *args], capture_output=True, text=True,
                          timeout=timeout)


def _stage_args(results, budget):
    """The arguments run.sh's gpu-microbench stage gives the script, its variables set."""
    import re
    import shlex

    text = open(os.path.join(ROOT, "tests", "gpu", "run.sh")).read()
    m = re.search(r'stage gpu-microbench [^\n]*"\$ROOT/benchmarks/gpu_microbench\.py" \\\n'
                  r'\s*(.*?) \|\| FAILED=1', text)
    assert m, "run.sh has no gpu-microbench stage running benchmarks/gpu_microbench.py"
    return [a.replace("$RESULTS", str(results)).replace("$MICRO_S", str(budget))
            for a in shlex.split(m.group(1))]


@pytest.mark.timeout(300)
def test_gpu_microbench_logic_on_the_cpu(tmp_path):
    """run.sh's stage arguments, on the CPU at tiny sizes: every op, size, batch and precision
    measured (a budget no tiny size spends), the JSON the header documents."""
    args = _stage_args(tmp_path, 120)
    r = _microbench(*args, "--device", "cpu", "--sizes", "16,24", "--batches", "1,2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((tmp_path / "gpu_microbench.json").read_text())
    assert rec["schema"] == "asteria.gpu_microbench/1" and rec["state"] == "passed"
    assert rec["device"] == "cpu" and rec["device_name"] and rec["torch"] and rec["date"]
    assert rec["dtype"] == "float32" and rec["budget_s"] == 120 and rec["memory"] is None
    assert rec["ops"] == ["linalg_eigh", "linalg_qr", "qr_power_step", "score_gemm"]
    assert rec["precisions"] == ["highest", "tf32"]
    want = {(op, n, b, p) for op in rec["ops"] for n in (16, 24) for b in (1, 2)
            for p in rec["precisions"]}
    got = [(e["op"], e["n"], e["batch"], e["precision"]) for e in rec["results"]]
    assert sorted(got) == sorted(want) and rec["skipped"] == []
    assert all(e["ms"] > 0 and 0 < e["ms_min"] <= e["ms"] and e["reps"] >= 1
               for e in rec["results"])
    # one factor at every size before the batches
    assert [e["batch"] for e in rec["results"]] == sorted(e["batch"] for e in rec["results"])


def test_gpu_microbench_skips_what_does_not_fit_its_budget(tmp_path):
    out = tmp_path / "m.json"
    r = _microbench("--device", "cpu", "--sizes", "16", "--batches", "1", "--ops", "linalg_eigh,linalg_qr",
                    "--budget-s", "1e-9", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["state"] == "passed" and rec["results"] == []
    assert [(s["op"], s["precision"]) for s in rec["skipped"]] == [
        ("linalg_eigh", "highest"), ("linalg_qr", "highest"), ("linalg_eigh", "tf32"), ("linalg_qr", "tf32")]
    assert all(s["reason"].startswith("would not fit the budget") for s in rec["skipped"])


def test_gpu_microbench_bad_arguments_and_no_gpu(tmp_path):
    for bad in (["--sizes", "0"], ["--ops", "eig"], ["--precisions", "fp16"],
                ["--budget-s", "0"]):
        r = _microbench("--device", "cpu", "--out", str(tmp_path / "x.json"), *bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert bad[0] in r.stderr and ("allowed" in r.stderr or "need" in r.stderr), r.stderr
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = _microbench("--out", str(tmp_path / "m.json"))
    assert r.returncode == 77, r.stdout + r.stderr
    assert "[gpu-microbench] no GPU: skipped" in r.stdout


@pytest.mark.timeout(300)
def _terminate_once(proc, out, done, guard_s: float) -> str:
    """SIGTERM to a stage's process once its JSON ``out`` says ``done`` (polled; ``guard_s``: a
    hang guard), then its stdout once it ended."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if done(json.loads(out.read_text())):
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    return proc.communicate(timeout=120)[0]


def test_gpu_microbench_terminated_leaves_what_it_measured(tmp_path):
    """The stage's timeout (SIGTERM) during a long measurement: the JSON keeps the ones before
    it and says "timed out"."""
    out = tmp_path / "m.json"
    proc = subprocess.Popen([sys.executable, MICROBENCH, "--device", "cpu", "--sizes",
                             "16,1024", "--batches", "1", "--ops", "linalg_eigh", "--precisions",
                             "highest", "--budget-s", "600", "--rep-s", "60", "--max-reps",
                             "100", "--out", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    # n=16 done: n=1024 takes a minute
    stdout = _terminate_once(proc, out, lambda rec: rec["results"], 120)
    assert proc.returncode == 1, stdout[-3000:]
    rec = json.loads(out.read_text())
    assert rec["state"] == "timed out" and "signal 15" in rec["error"]
    assert [e["n"] for e in rec["results"]] == [16]


# ---- stage 7b: tests/gpu/train_drift.py, its logic on the CPU ----------------------------------

TRAIN_DRIFT = os.path.join(ROOT, "tests", "gpu", "train_drift.py")
DRIFT_STEPS = 12  # with WARMUP 5: native f=10's round at step 11 falls in the window


def _gpu_module(name):
    sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _drift_env():
    import asteria  # the package under test (installed, or a dev build), not the source tree

    pkg_root = os.path.dirname(os.path.dirname(asteria.__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (pkg_root, os.environ.get("PYTHONPATH")) if p))


def _drift_stage():
    """run.sh's train-drift stage: (its limit's and run budget's values, the arguments it
    gives the script with $RESULTS left in, the JSON path its summary note reads)."""
    import re
    import shlex

    text = open(os.path.join(ROOT, "tests", "gpu", "run.sh")).read()
    m = re.search(r'stage train-drift "\$DRIFT_S" "\$PY" "\$ROOT/tests/gpu/train_drift\.py" \\\n'
                  r'\s*(.*?) \|\| FAILED=1\n\s*note train-drift "\$STAGE_STATUS" "([^"]+)"', text)
    assert m, "run.sh has no train-drift stage running tests/gpu/train_drift.py, noted"
    limits = {k: int(re.search(rf"^{k}=(\d+)$", text, re.M).group(1))
              for k in ("DRIFT_S", "DRIFT_RUN_S", "F1_S")}
    # after the other training stage, before the benchmarks that share what is left
    assert text.index("stage train-f1 ") < m.start() < text.index("stage gpu-microbench ")
    return limits, shlex.split(m.group(1)), m.group(2)


def test_train_drift_is_a_stage_of_run_sh():
    train_drift = _gpu_module("train_drift")
    limits, args, noted = _drift_stage()
    assert args[:2] == ["--out", "$RESULTS/train_drift.json"] and noted == args[1]
    assert args[2:] == ["--run-budget-s", "$DRIFT_RUN_S"]
    # its four runs at their budget and the set-up fit the stage's limit
    assert len(train_drift.RUNS) * limits["DRIFT_RUN_S"] + 20 <= limits["DRIFT_S"]


@pytest.mark.timeout(400)
def test_train_drift_logic_on_the_cpu(tmp_path):
    """run.sh's stage arguments (a run budget no loaded 2-core machine spends), on the CPU
    with train_f1's CPU model for DRIFT_STEPS steps: every check, the JSON the header
    documents, its figures recomputed from the steps it recorded."""
    import statistics

    pytest.importorskip("asteria._C")
    train_drift, train_f1 = _gpu_module("train_drift"), _gpu_module("train_f1")
    _, args, _ = _drift_stage()
    args = [a.replace("$RESULTS", str(tmp_path)).replace("$DRIFT_RUN_S", "300") for a in args]
    r = subprocess.run([sys.executable, TRAIN_DRIFT, *args, "--device", "cpu", "--steps",
                        str(DRIFT_STEPS)], env=_drift_env(), capture_output=True, text=True,
                       timeout=380)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rec = json.loads((tmp_path / "train_drift.json").read_text())
    assert rec["schema"] == "asteria.train_drift/1" and rec["state"] == "passed"
    assert rec["device"] == "cpu" and rec["gpu"] is None and rec["torch"]
    assert rec["fixed"] == {"refresh_budget": 0.25, "install_delay": 1}
    assert rec["model"]["steps"] == DRIFT_STEPS and rec["model"]["warmup_steps"] == 5
    fixed, rerun = "drift-b0.25-d1", "drift-b0.25-d1-rerun"
    names = ["native-f10", "drift-auto", fixed, rerun]
    assert list(rec["runs"]) == names
    for name in names + ["drift-auto chosen", f"{fixed} as given", f"{fixed} rerun bitwise"]:
        assert rec["checks"][name]["ok"], (name, rec["checks"][name])
    runs = rec["runs"]
    assert runs["native-f10"]["precondition_frequency"] == 10
    assert runs["native-f10"]["runtime"] == {"mode": "sync"}
    for name in names[1:]:
        rt = runs[name]["runtime"]
        assert runs[name]["precondition_frequency"] == 1
        assert (rt["mode"], rt["refresh_policy"], rt["install"]) == (
            "async", "drift", "deterministic")
    assert runs["drift-auto"]["runtime"]["refresh_budget"] == "auto"
    assert runs["drift-auto"]["runtime"]["install_delay"] == "auto"
    assert runs[fixed]["runtime"] == runs[rerun]["runtime"]
    assert runs[fixed]["runtime"]["refresh_device"] is False
    factors = 2 * train_f1.SIZES["cpu"][1]  # square weights: two factors each
    for name in names:
        steps = runs[name]["steps"]
        assert [s["step"] for s in steps] == list(range(1, DRIFT_STEPS + 1)), name
        assert all(s["s"] > 0 and s["cpu_s"] >= 0 and s["loss"] > 0 for s in steps), name
        refreshes = [s["refreshes"] for s in steps]
        assert refreshes == sorted(refreshes), name
        window = steps[train_drift.WARMUP:]
        fig = runs[name]["figures"]
        assert fig["factors"] == factors
        assert runs[name]["median_step_s"] == statistics.median(s["s"] for s in window)
        rate = window[-1]["refreshes"] - steps[train_drift.WARMUP - 1]["refreshes"]
        if name == "native-f10":  # rounds, each every factor; their age steps since
            assert refreshes[0] == 1 and refreshes[-1] == 2  # steps 1 and 11
            assert [s["age_mean"] for s in window] == [5, 6, 7, 8, 9, 0, 1]
            rate *= factors
        assert fig["refreshes_per_100_steps"] == pytest.approx(100 * rate / len(window))
        assert fig["refreshes_per_factor_per_100_steps"] == pytest.approx(
            100 * rate / len(window) / factors)
        assert fig["mean_basis_age"] == pytest.approx(
            statistics.fmean(s["age_mean"] for s in window))
        st = runs[name]["stats"]
        if name == "native-f10":
            assert st["refresh_policy"] == "round" and fig["refresh_budget"] is None
            continue
        assert st["refresh_policy"] == "drift" and fig["skipped_share"] == 0.0
        assert st["refresh_skip_threshold"] is None
        assert st["refresh_age_max_seen"] <= fig["max_age"] == st["refresh_max_age"]
        assert sum(st["refresh_age_hist"].values()) == factors
    auto = runs["drift-auto"]["figures"]
    assert auto["budget_auto_chosen"] is True and auto["delay_auto_chosen"] is True
    assert 0 < auto["refresh_budget"] <= 1 and auto["install_delay"] >= 0
    fx = runs[fixed]["figures"]
    assert (fx["refresh_budget"], fx["install_delay"]) == (0.25, 1)
    assert fx["budget_auto_chosen"] is False and fx["delay_auto_chosen"] is False
    # a quarter of a round a step: fewer than every factor every step; d=1: no basis younger
    assert 0 < fx["refreshes_per_factor_per_100_steps"] < 100
    assert min(s["age_mean"] for s in runs[fixed]["steps"][train_drift.WARMUP:]) >= 1
    # the rerun, bit for bit
    assert [s["loss"] for s in runs[fixed]["steps"]] == [s["loss"] for s in runs[rerun]["steps"]]
    assert runs[fixed]["figures"] == runs[rerun]["figures"]
    summary = rec["summary"]
    assert set(summary["median_step_s"]) == set(names)
    assert set(summary["step_time_ratio"]) == {f"{n}/native-f10" for n in names[1:]}
    assert summary["step_time_ratio"][f"{fixed}/native-f10"] == pytest.approx(
        summary["median_step_s"][fixed] / summary["median_step_s"]["native-f10"], rel=1e-3)
    for key in ("refreshes_per_100_steps", "refreshes_per_factor_per_100_steps",
                "mean_basis_age", "skipped_share", "refresh_budget", "install_delay",
                "max_age"):
        assert summary[key] == {n: runs[n]["figures"][key] for n in names}, key
    assert summary["final_loss"]["native-f10"] == pytest.approx(statistics.fmean(
        s["loss"] for s in runs["native-f10"]["steps"][-train_drift.FINAL_LOSS_STEPS:]))
    assert "[train-drift] summary: " in r.stdout


def test_train_drift_without_a_gpu_exits_77_and_refuses_bad_arguments(tmp_path):
    import torch

    out = str(tmp_path / "d.json")
    for bad in (["--steps", "0"], ["--run-budget-s", "0"]):
        r = subprocess.run([sys.executable, TRAIN_DRIFT, "--device", "cpu", "--out", out, *bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and bad[0] in r.stderr, (bad, r.stderr)
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    r = subprocess.run([sys.executable, TRAIN_DRIFT, "--out", out], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 77, r.stdout + r.stderr
    assert "[train-drift] no GPU: skipped" in r.stdout


@pytest.mark.timeout(300)
def test_train_drift_terminated_leaves_its_json(tmp_path):
    """The stage's timeout (SIGTERM) once its first run is recorded: the JSON keeps that run
    and its check, and says "timed out"."""
    pytest.importorskip("asteria._C")
    out = tmp_path / "d.json"
    proc = subprocess.Popen([sys.executable, TRAIN_DRIFT, "--device", "cpu", "--steps", "400",
                             "--run-budget-s", "0.5", "--out", str(out)], env=_drift_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stdout = _terminate_once(proc, out, lambda rec: "native-f10" in rec["checks"], 200)
    assert proc.returncode == 1, stdout[-3000:]
    rec = json.loads(out.read_text())
    assert rec["state"] == "timed out" and "signal 15" in rec["error"], rec.get("error")
    assert rec["checks"]["native-f10"]["ok"]
    assert "stopped" in rec["runs"]["native-f10"]  # its budget stopped it, and said so
    # how far past native-f10's record the SIGTERM lands is the scheduler's to say: a later
    # run's check recorded before it is a passed one (the stage's order is the code's)
    bitwise = rec["checks"].get("drift-b0.25-d1 rerun bitwise")
    assert bitwise is None or bitwise["ok"], bitwise
