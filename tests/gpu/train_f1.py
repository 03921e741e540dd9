"""A stage of the GPU check (tests/gpu/run.sh): SOAP refreshing its eigenbases every step
(precondition_frequency f=1) in mode "async" with staleness S=0 on CUDA parameters, its rounds
divided among the host workers and the device executor (runtime key refresh_device, the
default), timed against native SOAP (mode "sync", torch.linalg inline) at f=1 and at f=10, with
the GPU's energy per step.

Three timed runs train the same small model in float32 on the same batches for STEPS steps
each (at most RUN_BUDGET_S each; a run that spends it stops there and says so):

  native-f10     mode "sync", f=10: native SOAP at the usual frequency
  native-f1      mode "sync", f=1: native SOAP refreshing every step, the reference
  asteria-f1-s0  mode "async", S=0, f=1, deterministic installs, host workers + device executor

and, before them, two short untimed ones, native-f1-f64 and asteria-f1-s0-f64: the last two in
float64 for train_smoke.STEPS steps, for the trajectory check.

Recorded per step: loss, wall time (the device synchronised before and after), process CPU time
(every thread of the process: the training thread and libasteria's workers). Per run: the
median step after the first WARMUP steps (first eigendecompositions, CUDA and cuSOLVER set-up)
and the energy the GPU board drew over those same steps, from NVML (module pynvml, package
nvidia-ml-py): the total-energy counter (nvmlDeviceGetTotalEnergyConsumption, mJ, Volta and
newer) where the GPU has it, else the integral of power samples (nvmlDeviceGetPowerUsage, mW)
taken every POWER_PERIOD_S by a thread; the JSON says which. It is the board's energy only:
the host CPUs' share (the workers' refreshes) is not in it, which is why process CPU seconds
per step are recorded beside it. Without pynvml, NVML or a GPU, energy is null with the reason.

Checked, with train_smoke.py's tolerances for async S=0 against sync: every run finite; in
float64, asteria-f1-s0-f64's parameters within train_smoke.TOL of native-f1-f64's relative to
the size of its whole update; in float32, asteria-f1-s0's losses within
train_smoke.TOL_F32_LOSS of native-f1's over the first train_smoke.STEPS steps, the horizon
train_smoke.py judges float32 over. Past it the float32 difference is recorded, not judged:
every step's eigendecompositions round differently on the two paths (LAPACK on the workers,
cuSOLVER on the device or torch.linalg inline) and the trajectory amplifies that rounding (on
a CPU: 6e-5 at step 10, 4e-3 at step 60, while float64 stays within 1e-12 over 55 steps).
On a GPU, both the host workers and the device executor took part of the rounds
(split_entries_host and split_entries_device > 0). The step times and the energy are recorded,
not judged: the model is small so that the stage fits the check's time, and what f=1 S=0 costs
at a real model's size is a question for a larger run.

    python3 tests/gpu/train_f1.py --out $OUT/train_f1.json     # run.sh, on the GPU
    python3 tests/gpu/train_f1.py --device cpu --out /tmp/f.json  # the logic, any machine

Exit: 0 every check passed; 1 a check failed (the JSON says which); 77 no GPU (cuda only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback

import torch

import train_smoke
from train_smoke import TOL, TOL_F32_LOSS, Terminated

STEPS = 60
WARMUP = 5          # steps left out of the medians and the energy window
RUN_BUDGET_S = 25.0
POWER_PERIOD_S = 0.01
DTYPE = torch.float32
# (width, layers, tokens): square layers, tokens > width so every factor is full rank (as in
# train_smoke.py); on the GPU 512-wide factors, so a refresh round is real work for the lanes
SIZES = {"cuda": (512, 4, 8192), "cpu": (64, 3, 256)}
SYNC = {"mode": "sync"}
ASYNC_S0 = {"mode": "async", "staleness": 0, "install": "deterministic", "refresh_device": True}
CHECK_STEPS = train_smoke.STEPS
# name: precondition_frequency, runtime, dtype, timed (else CHECK_STEPS steps, no energy)
# (the short check runs first: they also take the device's and the libraries' set-up)
RUNS = {
    "native-f1-f64": (1, SYNC, torch.float64, False),
    "asteria-f1-s0-f64": (1, ASYNC_S0, torch.float64, False),
    "native-f10": (10, SYNC, DTYPE, True),
    "native-f1": (1, SYNC, DTYPE, True),
    "asteria-f1-s0": (1, ASYNC_S0, DTYPE, True),
}
ENERGY_SCOPE = ("the GPU board as NVML counts it; host CPUs (the workers' refreshes) not "
                "included: see cpu_s per step")


class EnergyMeter:
    """The GPU's energy over a window (start() .. stop()), from NVML: the total-energy counter,
    else power samples integrated by a thread. ``method`` is None with ``reason`` when there is
    no way to measure; ``nvml`` is the pynvml module (a stand-in in the tests)."""

    def __init__(self, device: str, nvml=None) -> None:
        self.method = None
        self.reason = None
        self.info: dict = {}
        self._nvml = None
        self._handle = None
        self._samples: list = []
        self._stop = threading.Event()
        self._thread = None
        self._t0 = self._e0 = None
        if device != "cuda":
            self.reason = "no GPU: parameters on the CPU (--device cpu)"
            return
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as exc:
                self.reason = (f"pynvml not importable ({exc}): nvidia-ml-py not installed "
                               "(run.sh installs it from the carried wheels, fetch_wheels.sh)")
                return
        try:
            nvml.nvmlInit()
        except Exception as exc:
            self.reason = f"NVML did not initialise: {type(exc).__name__}: {exc}"
            return
        self._nvml = nvml
        try:
            self._handle, self.info["handle_by"] = self._find_handle(nvml)
            self.info["nvml_device"] = _text(nvml.nvmlDeviceGetName(self._handle))
            self.info["driver"] = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as exc:
            self.reason = f"no NVML handle for the CUDA device: {type(exc).__name__}: {exc}"
            self.close()
            return
        try:
            nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self.method = "total_energy_counter"
        except Exception as exc:
            self.info["counter_unsupported"] = f"{type(exc).__name__}: {exc}"
            try:
                nvml.nvmlDeviceGetPowerUsage(self._handle)
                self.method = "power_samples"
            except Exception as exc2:
                self.reason = (f"neither the energy counter ({exc}) nor power readings "
                               f"({type(exc2).__name__}: {exc2}) are supported")
                self.close()

    @staticmethod
    def _find_handle(nvml):
        """NVML's handle for torch's current device: by PCI bus id (NVML numbers devices
        without CUDA_VISIBLE_DEVICES), else by index when NVML sees one device."""
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        if all(hasattr(p, k) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
            bus = f"{p.pci_domain_id:08X}:{p.pci_bus_id:02X}:{p.pci_device_id:02X}.0"
            try:
                return nvml.nvmlDeviceGetHandleByPciBusId(bus.encode()), f"pci bus id {bus}"
            except Exception:
                pass
        if nvml.nvmlDeviceGetCount() == 1:
            return nvml.nvmlDeviceGetHandleByIndex(0), "index 0 (the only NVML device)"
        raise RuntimeError("the PCI bus id did not match and NVML sees several devices")

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                mw = self._nvml.nvmlDeviceGetPowerUsage(self._handle)
            except Exception:
                mw = None
            if mw is not None:
                self._samples.append((time.perf_counter(), mw / 1000.0))
            self._stop.wait(POWER_PERIOD_S)

    def start(self) -> None:
        if self.method is None:
            return
        self._t0 = time.perf_counter()
        if self.method == "total_energy_counter":
            self._e0 = self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            return
        self._samples = []
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def stop(self, steps: int) -> dict:
        """The window's energy: joules in all and per step, the mean power."""
        if self.method is None or self._t0 is None:
            return {"method": None, "per_step_j": None, "reason": self.reason or "not started"}
        t1 = time.perf_counter()
        window = t1 - self._t0
        self._t0 = None
        out: dict = {"method": self.method, "window_s": round(window, 4), "steps": steps}
        if self.method == "total_energy_counter":
            energy = (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._e0) / 1e3
        else:
            self._stop.set()
            self._thread.join()
            s = self._samples
            out["samples"] = len(s)
            out["period_s"] = POWER_PERIOD_S
            if len(s) < 2:
                return dict(out, per_step_j=None, reason=f"{len(s)} power sample(s) in the window")
            # trapezoids between samples; the window's ends held at the nearest sample
            energy = sum((b[0] - a[0]) * (a[1] + b[1]) / 2 for a, b in zip(s, s[1:]))
            energy += (s[0][0] - (t1 - window)) * s[0][1] + (t1 - s[-1][0]) * s[-1][1]
        out["energy_j"] = round(energy, 4)
        out["per_step_j"] = round(energy / steps, 6) if steps else None
        out["mean_power_w"] = round(energy / window, 3) if window > 0 else None
        return out

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def make_model(device: str, dtype: torch.dtype) -> torch.nn.Module:
    width, layers, _ = SIZES[device]
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods[:-1]).to(device=device, dtype=dtype)


def make_batches(device: str, steps: int, dtype: torch.dtype) -> list:
    width, _, tokens = SIZES[device]
    a = torch.randn(width, width, generator=torch.Generator().manual_seed(7), dtype=dtype)
    a /= width ** 0.5
    out = []
    for step in range(1, steps + 1):
        x = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1000 + step),
                        dtype=dtype)
        out.append((x.to(device), torch.sin(x @ a).to(device)))
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def train(name: str, device: str, batches: list, meter: EnergyMeter, budget_s: float,
          rec: dict, write) -> list:
    """One run; returns its final parameters."""
    import asteria

    freq, runtime, dtype, timed = RUNS[name]
    if not timed:
        batches = batches[:CHECK_STEPS]
    model = make_model(device, dtype)
    start = [p.detach().clone() for p in model.parameters()]
    opt = asteria.SOAP(model.parameters(), lr=3e-3, precondition_frequency=freq,
                       runtime=runtime)
    out = {"precondition_frequency": freq, "runtime": runtime, "dtype": str(dtype),
           "timed": timed, "steps": []}
    rec["runs"][name] = out
    t_run = time.perf_counter()
    try:
        for step, (x, y) in enumerate(batches, 1):
            if timed and step == WARMUP + 1:
                sync(device)
                meter.start()
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync(device)
            t1, c1 = time.perf_counter(), time.process_time()
            finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
            out["steps"].append({"step": step, "loss": loss.item(), "s": round(t1 - t0, 6),
                                 "cpu_s": round(c1 - c0, 6)})
            if not finite:
                raise AssertionError(f"{name}: non-finite parameters after step {step}")
            if time.perf_counter() - t_run > budget_s and step < len(batches):
                out["stopped"] = f"after step {step}: its budget of {budget_s:g} s was spent"
                break
        if timed:
            window = out["steps"][WARMUP:]
            out["energy"] = meter.stop(len(window))
            out["median_step_s"] = statistics.median(s["s"] for s in window) if window else None
            out["median_cpu_s"] = statistics.median(s["cpu_s"] for s in window) if window else None
        st = opt.asteria_stats()
        out["stats"] = {k: v for k, v in st.items() if k.startswith(
            ("split_", "device_jobs", "jobs_done", "installs", "install_wait", "workers"))}
    finally:
        if timed and "energy" not in out:
            out["energy"] = meter.stop(max(0, len(out["steps"]) - WARMUP))
        opt.close()
        out["s"] = round(time.perf_counter() - t_run, 3)
        write()
    final = [p.detach().clone() for p in model.parameters()]
    out["update_norm"] = train_smoke.rel_diff(final, start, 1.0)
    return final


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--run-budget-s", type=float, default=RUN_BUDGET_S)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, train_smoke._on_term)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[train-f1] no GPU: skipped")
        return 77
    width, layers, tokens = SIZES[args.device]
    rec = {"script": "tests/gpu/train_f1.py", "command": " ".join([sys.executable] + sys.argv),
           "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cpus": os.cpu_count(), "dtype": str(DTYPE),
           "model": {"width": width, "layers": layers, "tokens_per_step": tokens,
                     "steps": args.steps, "warmup_steps": WARMUP},
           "tolerance": {"float64_params": TOL, "float32_loss": TOL_F32_LOSS,
                         "float32_loss_steps": CHECK_STEPS},
           "state": "running", "checks": {}, "runs": {}}
    write, check = train_smoke.stage_record(rec, args.out, "train-f1")
    write()
    failed = False
    meter = None
    try:
        meter = EnergyMeter(args.device)
        rec["energy"] = {"method": meter.method, "reason": meter.reason, "scope": ENERGY_SCOPE,
                         **meter.info}
        batches = {dt: make_batches(args.device, args.steps, dt)
                   for dt in {r[2] for r in RUNS.values()}}
        finals = {}
        for name, (_, _, dtype, timed) in RUNS.items():
            try:
                finals[name] = train(name, args.device, batches[dtype], meter,
                                     args.run_budget_s, rec, write)
                r = rec["runs"][name]
                check(name, True, f"{len(r['steps'])} steps, finite" + (
                      f", median step {r['median_step_s']} s, energy/step "
                      f"{r['energy']['per_step_j']} J" if timed else f", {r['s']} s"))
            except Terminated:
                raise
            except Exception as exc:
                rec["runs"].setdefault(name, {})["error"] = traceback.format_exc(limit=8)
                check(name, False, f"{type(exc).__name__}: {exc}")
                failed = True
        runs = rec["runs"]
        a, n = runs.get("asteria-f1-s0", {}), runs.get("native-f1", {})
        if "asteria-f1-s0-f64" in finals and "native-f1-f64" in finals:
            d = train_smoke.rel_diff(finals["asteria-f1-s0-f64"], finals["native-f1-f64"],
                                     runs["native-f1-f64"]["update_norm"])
            runs["asteria-f1-s0-f64"]["rel_diff_to_native_f1"] = d
            check("asteria-f1-s0-f64=native-f1-f64", d <= TOL, f"|asteria - native| / |native "
                  f"update| = {d:.2e} after {CHECK_STEPS} steps (tolerance {TOL:g})")
            failed |= d > TOL
        if a.get("steps") and n.get("steps") and "error" not in a and "error" not in n:
            rel = [abs(p["loss"] - q["loss"]) / abs(q["loss"])
                   for p, q in zip(a["steps"], n["steps"])]
            dl = max(rel[:CHECK_STEPS])
            a["loss_rel_diff_to_native_f1"] = rel
            check("asteria-f1-s0=native-f1", dl <= TOL_F32_LOSS,
                  f"float32 losses within {dl:.2e} of native f=1's over the first "
                  f"{min(len(rel), CHECK_STEPS)} steps (tolerance {TOL_F32_LOSS:g}); "
                  f"{max(rel):.2e} over all {len(rel)}, recorded")
            failed |= dl > TOL_F32_LOSS
        if args.device == "cuda" and "stats" in a:
            h = a["stats"].get("split_entries_host", 0)
            d = a["stats"].get("split_entries_device", 0)
            check("executors", h > 0 and d > 0, f"round entries on the host workers {h}, on "
                  f"the device executor {d}")
            failed |= not (h > 0 and d > 0)
        timed_runs = {k: r for k, r in runs.items() if r.get("timed")}
        med = {k: r.get("median_step_s") for k, r in timed_runs.items()}
        ratio = {}
        for ref in ("native-f1", "native-f10"):
            if med.get("asteria-f1-s0") and med.get(ref):
                ratio[f"asteria-f1-s0/{ref}"] = round(med["asteria-f1-s0"] / med[ref], 4)
        rec["summary"] = {
            "median_step_s": med, "step_time_ratio": ratio,
            "median_cpu_s": {k: r.get("median_cpu_s") for k, r in timed_runs.items()},
            "energy_per_step_j": {k: r.get("energy", {}).get("per_step_j")
                                  for k, r in timed_runs.items()},
            "energy_method": meter.method, "energy_reason": meter.reason}
        print(f"[train-f1] summary: {json.dumps(rec['summary'])}", flush=True)
        rec["state"] = "failed" if failed else "passed"
    except BaseException as exc:
        train_smoke.record_failure(rec, exc, "train-f1")
        failed = True
    finally:
        if meter is not None:
            meter.close()
        if train_smoke.terminated(rec):
            failed = True
        write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
