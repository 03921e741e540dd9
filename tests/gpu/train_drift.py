"""A stage of the GPU check (tests/gpu/run.sh, stage 7b): SOAP with the per-factor refresh
policy (runtime key refresh_policy "drift", docs/capacity.md "Refresh per factor") on CUDA
parameters, every factor a candidate at every step (precondition_frequency f=1), timed against
native SOAP (mode "sync", torch.linalg inline) at its usual f=10.

Four runs train train_f1.py's small model (train_f1.SIZES, float32) on the same batches for
STEPS steps each (at most RUN_BUDGET_S each; a run that spends it stops there and says so):

  native-f10            mode "sync", f=10
  drift-auto            mode "async", f=1, refresh_budget and install_delay "auto" (chosen once
                        by the runtime from its measured round and step times), the host
                        workers and the device executor (refresh_device, the default)
  drift-b0.25-d1        mode "async", f=1, refresh_budget 0.25 (a quarter of a full round's
                        FLOPs started a step), install_delay d=1, the host workers alone
  drift-b0.25-d1-rerun  the same again, on the steps drift-b0.25-d1 made

All async runs install deterministically (runtime key install "deterministic"). The fixed-budget
pair leaves the device executor out (refresh_device False) because the split between the host
workers and the device follows measured rates, and cuSOLVER rounds differently from LAPACK: with
it, a rerun is bitwise the same only where the split is (docs/capacity.md, "Device executor and
the split"). The budget's decisions read no clock, so without the device lane the rerun must
repeat the run bit for bit. CUBLAS_WORKSPACE_CONFIG is set to ":4096:8" (unless already set)
before CUDA starts, which cuBLAS needs for run-to-run equal results with several streams.

Recorded per step: loss, wall time (the device synchronised before and after), process CPU time
(every thread: the training thread and libasteria's workers), and from
optimizer.asteria_stats() after the step (outside the timing): the refreshes started so far
(drift: refresh_started; native: refreshes_submitted, its rounds) and the mean basis age (drift:
refresh_age_mean, the age of every factor's basis after that step end; native: the steps since
its last round, every factor being refreshed in each).

JSON (--out), rewritten after every run and check (a stage killed at any point leaves its last
whole record):

  schema            "asteria.train_drift/1"
  script, command, device ("cuda" | "cpu"), gpu (name | null), torch, torch_cuda, cpus,
  cublas_workspace_config, dtype
  model             {width, layers, tokens_per_step, steps, warmup_steps}
  fixed             {refresh_budget, install_delay}: the fixed-budget runs' values
  state             "running" | "passed" | "failed" | "timed out"; error (a traceback) if not
  checks            {name: {ok, detail}}, one per run (it ran, parameters finite), then
                    "drift-auto chosen" (the runtime chose budget and d: both flagged chosen,
                    budget in (0, 1], d an integer >= 0, max_age an integer >= 1),
                    "drift-b0.25-d1 as given" (budget 0.25, d 1, neither chosen) and
                    "drift-b0.25-d1 rerun bitwise" (equal losses at every step both made, and
                    equal final parameters where both made every step)
  runs              {name: {precondition_frequency, runtime, steps: [{step, loss, s, cpu_s,
                    refreshes, age_mean}], stopped (if its budget stopped it), median_step_s,
                    median_cpu_s, stats (asteria_stats()'s refresh_*, install*, split_*,
                    jobs_done, workers, staleness entries), figures, s, error (if it failed)}}
  figures (a run's, over the steps after the first WARMUP, or all where it made no more):
                    factors (the model's factors: the drift runs' count of bases),
                    refreshes_per_100_steps (factor refreshes started, all factors),
                    refreshes_per_factor_per_100_steps, mean_basis_age (the mean of age_mean),
                    skipped_share (drift: refresh_skipped_share; no skip_threshold is set, so 0
                    unless the runtime's default changes), refresh_budget, install_delay,
                    max_age, budget_auto_chosen, delay_auto_chosen (native: null)
  summary           {median_step_s, step_time_ratio ({drift run}/native-f10), final_loss (the
                    mean of the last FINAL_LOSS_STEPS losses), refreshes_per_100_steps,
                    refreshes_per_factor_per_100_steps, mean_basis_age, skipped_share,
                    refresh_budget, install_delay, max_age: {run: value}}; the figures the
                    planner's drift answer states for the same budget and d
                    (docs/capacity.md, "Refresh per factor: the planner's answer"), here measured
  wall_s            seconds since the start

Judged: every run finite, drift-auto's choice made and recorded, the fixed-budget rerun
bitwise. Recorded, not judged: the step times, losses and the refresh figures (the model is
small so that the stage fits the check's time).

    python3 tests/gpu/train_drift.py --out $OUT/train_drift.json     # run.sh, on the GPU
    python3 tests/gpu/train_drift.py --device cpu --steps 10 --out /tmp/d.json  # the logic

Exit: 0 every check passed; 1 a check failed (the JSON says which); 77 no GPU (cuda only).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
import traceback

# before torch starts CUDA: cuBLAS's run-to-run equality with several streams needs it
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import train_f1  # noqa: E402
import train_smoke  # noqa: E402
from train_smoke import Terminated  # noqa: E402

SCHEMA = "asteria.train_drift/1"
STEPS = train_f1.STEPS
WARMUP = train_f1.WARMUP
RUN_BUDGET_S = 12.0
FINAL_LOSS_STEPS = 10
DTYPE = train_f1.DTYPE
FIXED_BUDGET = 0.25
FIXED_DELAY = 1
DRIFT = {"mode": "async", "refresh_policy": "drift", "install": "deterministic"}
FIXED = "drift-b0.25-d1"
RERUN = FIXED + "-rerun"
# name: precondition_frequency, runtime
RUNS = {
    "native-f10": (10, {"mode": "sync"}),
    "drift-auto": (1, dict(DRIFT, refresh_budget="auto", install_delay="auto")),
    FIXED: (1, dict(DRIFT, refresh_budget=FIXED_BUDGET, install_delay=FIXED_DELAY,
                    refresh_device=False)),
    RERUN: (1, dict(DRIFT, refresh_budget=FIXED_BUDGET, install_delay=FIXED_DELAY,
                    refresh_device=False)),
}
STATS_PREFIXES = ("refresh_", "install", "split_", "jobs_done", "workers", "staleness")


def train(name: str, device: str, batches: list, budget_s: float, rec: dict, write) -> list:
    """One run; returns its final parameters."""
    import asteria

    freq, runtime = RUNS[name]
    drift = runtime.get("refresh_policy") == "drift"
    model = train_f1.make_model(device, DTYPE)
    opt = asteria.SOAP(model.parameters(), lr=3e-3, precondition_frequency=freq,
                       runtime=runtime)
    out = {"precondition_frequency": freq, "runtime": runtime, "steps": []}
    rec["runs"][name] = out
    t_run = time.perf_counter()
    last_round = 0
    try:
        for step, (x, y) in enumerate(batches, 1):
            train_f1.sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            train_f1.sync(device)
            t1, c1 = time.perf_counter(), time.process_time()
            st = opt.asteria_stats()
            if drift:
                refreshes, age = st["refresh_started"], st["refresh_age_mean"]
            else:  # sync: a round refreshes every factor; its count is the rounds so far
                refreshes = st["refreshes_submitted"]
                prev = out["steps"][-1]["refreshes"] if out["steps"] else 0
                if refreshes > prev:
                    last_round = step
                age = step - last_round if last_round else None
            out["steps"].append({"step": step, "loss": loss.item(), "s": round(t1 - t0, 6),
                                 "cpu_s": round(c1 - c0, 6), "refreshes": refreshes,
                                 "age_mean": age})
            if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
                raise AssertionError(f"{name}: non-finite parameters after step {step}")
            if time.perf_counter() - t_run > budget_s and step < len(batches):
                out["stopped"] = f"after step {step}: its budget of {budget_s:g} s was spent"
                break
        window = _window(out["steps"])
        out["median_step_s"] = statistics.median(s["s"] for s in window)
        out["median_cpu_s"] = statistics.median(s["cpu_s"] for s in window)
        out["stats"] = {k: v for k, v in opt.asteria_stats().items()
                        if k.startswith(STATS_PREFIXES)}
    finally:
        opt.close()
        out["s"] = round(time.perf_counter() - t_run, 3)
        write()
    return [p.detach().clone() for p in model.parameters()]


def _window(steps: list) -> list:
    """The steps after the first WARMUP (first eigendecompositions, the auto choice, CUDA's
    set-up), or all of them where the run made no more."""
    return steps[WARMUP:] if len(steps) > WARMUP else steps


def figures(run: dict, factors) -> dict:
    """A run's refresh figures over its window (module doc, "figures")."""
    steps = run["steps"]
    window = _window(steps)
    before = steps[len(steps) - len(window) - 1]["refreshes"] if len(window) < len(steps) else 0
    started = window[-1]["refreshes"] - before
    st = run.get("stats", {})
    drift = run["runtime"].get("refresh_policy") == "drift"
    if not drift:  # rounds: each refreshes every factor
        started = started * factors if factors else None
    per100 = 100.0 * started / len(window) if started is not None else None
    ages = [s["age_mean"] for s in window if s["age_mean"] is not None]
    return {
        "factors": factors,
        "refreshes_per_100_steps": per100,
        "refreshes_per_factor_per_100_steps": per100 / factors if per100 is not None
        and factors else None,
        "mean_basis_age": sum(ages) / len(ages) if ages else None,
        "skipped_share": st.get("refresh_skipped_share") if drift else None,
        "refresh_budget": st.get("refresh_budget") if drift else None,
        "install_delay": st.get("install_delay") if drift else None,
        "max_age": st.get("refresh_max_age") if drift else None,
        "budget_auto_chosen": st.get("refresh_budget_auto_chosen") if drift else None,
        "delay_auto_chosen": st.get("install_delay_auto_chosen") if drift else None,
    }


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--run-budget-s", type=float, default=RUN_BUDGET_S)
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps {args.steps}: need an integer >= 1")
    if not args.run_budget_s > 0:
        ap.error(f"--run-budget-s {args.run_budget_s}: need a number of seconds > 0")
    signal.signal(signal.SIGTERM, train_smoke._on_term)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("[train-drift] no GPU: skipped")
        return 77
    width, layers, tokens = train_f1.SIZES[args.device]
    rec = {"schema": SCHEMA, "script": "tests/gpu/train_drift.py",
           "command": " ".join([sys.executable] + sys.argv), "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
           "cpus": os.cpu_count(),
           "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
           "dtype": str(DTYPE),
           "model": {"width": width, "layers": layers, "tokens_per_step": tokens,
                     "steps": args.steps, "warmup_steps": WARMUP},
           "fixed": {"refresh_budget": FIXED_BUDGET, "install_delay": FIXED_DELAY},
           "state": "running", "checks": {}, "runs": {}}
    write, check = train_smoke.stage_record(rec, args.out, "train-drift")
    write()
    failed = False
    try:
        batches = train_f1.make_batches(args.device, args.steps, DTYPE)
        finals = {}
        runs = rec["runs"]
        for name in RUNS:
            todo = batches
            if name == RERUN:
                if FIXED not in finals:
                    check(name, False, f"not run: {FIXED} did not finish")
                    failed = True
                    continue
                todo = batches[:len(runs[FIXED]["steps"])]
            try:
                finals[name] = train(name, args.device, todo, args.run_budget_s, rec, write)
                r = runs[name]
                check(name, True, f"{len(r['steps'])} steps, finite, median step "
                      f"{r['median_step_s']} s, final loss {r['steps'][-1]['loss']:.6g}")
            except Terminated:
                raise
            except Exception as exc:
                runs.setdefault(name, {})["error"] = traceback.format_exc(limit=8)
                check(name, False, f"{type(exc).__name__}: {exc}")
                failed = True
        # the model's factors: the bases the drift runs report ages of
        factors = None
        for name in (FIXED, "drift-auto", RERUN):
            hist = runs.get(name, {}).get("stats", {}).get("refresh_age_hist")
            if hist:
                factors = sum(hist.values())
                break
        for name, r in runs.items():
            if "stats" in r:
                r["figures"] = figures(r, factors)
        a = runs.get("drift-auto", {}).get("figures")
        if a is not None:
            b, d, m = a["refresh_budget"], a["install_delay"], a["max_age"]
            ok = (a["budget_auto_chosen"] is True and a["delay_auto_chosen"] is True
                  and isinstance(b, (int, float)) and 0 < b <= 1 and _is_int(d) and d >= 0
                  and _is_int(m) and m >= 1)
            check("drift-auto chosen", ok, f"refresh_budget {b} (chosen: "
                  f"{a['budget_auto_chosen']}), install_delay {d} (chosen: "
                  f"{a['delay_auto_chosen']}), max_age {m}")
            failed |= not ok
        fx = runs.get(FIXED, {}).get("figures")
        if fx is not None:
            ok = (fx["refresh_budget"] == FIXED_BUDGET and fx["install_delay"] == FIXED_DELAY
                  and fx["budget_auto_chosen"] is False and fx["delay_auto_chosen"] is False
                  and _is_int(fx["max_age"]) and fx["max_age"] >= 1)
            check(f"{FIXED} as given", ok, f"refresh_budget {fx['refresh_budget']}, "
                  f"install_delay {fx['install_delay']}, max_age {fx['max_age']}")
            failed |= not ok
        if FIXED in finals and RERUN in finals:
            p, q = runs[FIXED]["steps"], runs[RERUN]["steps"]
            n = min(len(p), len(q))
            diff = [s["step"] for s, t in zip(p, q) if s["loss"] != t["loss"]]
            same_params = len(q) == len(p) and all(
                torch.equal(u, v) for u, v in zip(finals[FIXED], finals[RERUN]))
            ok = not diff and n > 0 and (same_params or len(q) < len(p))
            check(f"{FIXED} rerun bitwise", ok, (
                f"losses equal at all {n} steps both made" if not diff else
                f"losses differ from step {diff[0]} ({len(diff)} of {n} steps)") + (
                f"; final parameters {'equal' if same_params else 'DIFFER'}"
                if len(q) == len(p) else
                f"; the rerun stopped at step {len(q)} of {len(p)}: parameters not compared"))
            failed |= not ok
        med = {k: r.get("median_step_s") for k, r in runs.items() if "median_step_s" in r}
        ratio = {f"{k}/native-f10": round(v / med["native-f10"], 4) for k, v in med.items()
                 if k != "native-f10" and v and med.get("native-f10")}
        fig = {k: r["figures"] for k, r in runs.items() if "figures" in r}
        rec["summary"] = {
            "median_step_s": med, "step_time_ratio": ratio,
            "final_loss": {k: statistics.fmean(s["loss"] for s in
                                               r["steps"][-FINAL_LOSS_STEPS:])
                           for k, r in runs.items() if r.get("steps")},
            **{key: {k: f[key] for k, f in fig.items()} for key in (
                "refreshes_per_100_steps", "refreshes_per_factor_per_100_steps",
                "mean_basis_age", "skipped_share", "refresh_budget", "install_delay",
                "max_age")}}
        print(f"[train-drift] summary: {json.dumps(rec['summary'])}", flush=True)
        rec["state"] = "failed" if failed else "passed"
    except BaseException as exc:
        train_smoke.record_failure(rec, exc, "train-drift")
        failed = True
    finally:
        if train_smoke.terminated(rec):
            failed = True
        write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
