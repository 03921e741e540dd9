#!/usr/bin/env bash
# Capacity stage of the GPU check: REFRESH round time host-only vs hybrid (host pool + device
# executor), and installs that wait at the bounded barrier, on a ~150M-parameter GPT in the
# users' regime (tokens per step >= 16x the widest layer).
#
# For tests/gpu/run.sh to call after its build (PYTHONPATH set to the built asteria):
#     bash tests/gpu/capacity_stage.sh            # writes $OUT/capacity_stage.json
# Environment: OUT (default benchmarks/results), PYTHON (python3), ASTERIA_CAPACITY_BUDGET_S
# (default 150: the whole stage; each of the two runs gets about half, in its own process),
# ASTERIA_CAPACITY_SMOKE=1 (a tiny model on any device: checks this script, exits 0).
# Each run trains Asteria SOAP (async, deterministic, S=5, f=10, max_precond_dim 1024 and
# block_size 1024: every factor 1024 wide) for as many steps as its budget allows and records
# per step: wall time (device synchronised), install waits, C barrier waits; at the end the
# capacity report (asteria_plan()), asteria_stats()'s capacity_* figures and the split counts.
#   host-only: runtime key refresh_device=False (rounds divided among the host workers only)
#   hybrid:    the device executor takes the share the cost model gives it
# Each run's JSON is rewritten after every step, and written again when the run ends however it
# ends (its SIGTERM from timeout(1) becomes SystemExit, so the writes in `finally` run; a close()
# that raises is recorded, not lost): a run cut short keeps the steps it made.
# Exit: 0 both ran; 1 a run failed; 77 no GPU (and not smoke).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
PY=${PYTHON:-python3}
RESULTS=${OUT:-$ROOT/benchmarks/results}
BUDGET=${ASTERIA_CAPACITY_BUDGET_S:-150}
SMOKE=${ASTERIA_CAPACITY_SMOKE:-0}
mkdir -p "$RESULTS"
export PYTHONPATH=${PYTHONPATH:-$ROOT/python}

if [ "$SMOKE" != 1 ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "[capacity] no GPU: skipped"
  exit 77
fi

HALF=$((BUDGET / 2 - 10))
[ "$HALF" -lt 20 ] && HALF=20
rc_all=0
for mode in host hybrid; do
  timeout -k 5 $((HALF + 20)) "$PY" - "$mode" "$HALF" "$SMOKE" \
      "$RESULTS/capacity_stage.$mode.json" "$ROOT" <<'EOF'
import json, os, signal, sys, time, traceback
import torch
mode, budget, smoke, out, root = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4], sys.argv[5]
signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # timeout(1): run the finally below

def write(rec):
    with open(out + ".tmp", "w") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(out + ".tmp", out)

sys.path.insert(0, os.path.join(root, "examples"))
from tinygpt import CharData, GPTConfig, TinyGPT, n_params
import asteria

dev = "cuda" if torch.cuda.is_available() else "cpu"
if smoke:
    d, layers, heads, ctx, batch, dim = 64, 1, 2, 32, 8, 64
else:
    d, layers, heads, ctx, batch, dim = 1024, 12, 16, 512, 128, 1024  # 65,536 tokens = 16 x 4096
data = CharData(block=ctx)
cfg = GPTConfig(vocab=data.vocab, block=ctx, d=d, layers=layers, heads=heads)
torch.manual_seed(0)
model = TinyGPT(cfg).to(dev)
opt = asteria.SOAP(model.parameters(), lr=3e-3, precondition_frequency=10,
                   max_precond_dim=dim, block_size=dim,
                   runtime={"mode": "async", "staleness": 5, "install": "deterministic",
                            "refresh_device": mode != "host"})
gen = torch.Generator().manual_seed(0)
rec = {"mode": mode, "device": dev, "smoke": smoke,
       "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None,
       "model": {"d": d, "layers": layers, "context": ctx, "batch": batch,
                 "tokens_per_step": batch * ctx, "params": n_params(model),
                 "max_precond_dim": dim, "block_size": dim},
       "refresh_device": mode != "host",
       "budget_s": budget, "steps": [], "ok": False}
write(rec)
t_start = time.perf_counter()
step = 0
try:
    while time.perf_counter() - t_start < budget and step < (30 if smoke else 10_000):
        x, y = (t.to(dev) for t in data.batch("train", batch, gen))
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        st = opt.asteria_stats()
        step += 1
        rec["steps"].append({"step": step, "s": time.perf_counter() - t0, "loss": loss.item(),
                             "install_waits": st["install_waits"],
                             "barrier_waits": st["barrier_waits"],
                             "measured_round_s": st["capacity_measured_round_s"]})
        write(rec)
    st = opt.asteria_stats()
    rec["capacity_plan"] = opt.asteria_plan()
    rec["stats"] = {k: v for k, v in st.items() if k.startswith(("capacity_", "split_", "device_",
                    "install_wait", "barrier_wait", "staleness", "workers", "jobs_"))}
    rec["ok"] = True
except BaseException as exc:
    rec["error"] = "".join(traceback.format_exception_only(type(exc), exc)).strip() \
        if not isinstance(exc, SystemExit) else f"terminated (exit {exc.code}: the stage's timeout)"
    raise
finally:
    try:
        opt.close()
    except Exception as exc:
        rec["ok"] = False
        rec["close_error"] = f"{type(exc).__name__}: {exc}"
    write(rec)
print(f"[capacity] {mode}: {step} steps, round measured {st['capacity_measured_round_s']}, "
      f"predicted {st['capacity_predicted_round_s']}, install waits {st['install_waits']}, "
      f"split host {st.get('split_entries_host')} device {st.get('split_entries_device')}")
EOF
  rc=$?
  [ "$rc" -ne 0 ] && { echo "[capacity] $mode: FAILED (exit $rc)"; rc_all=1; }
done

"$PY" - "$RESULTS" <<'EOF'
import json, os, sys
d = sys.argv[1]
runs = {}
for m in ("host", "hybrid"):
    p = os.path.join(d, f"capacity_stage.{m}.json")
    if os.path.exists(p):
        runs[m] = json.load(open(p))
        os.remove(p)
def after_first_rounds(r):
    s = r["steps"]
    k = min(len(s), 32)  # the first three rounds (f=10, S=5) and the first-step eigh
    if not s:
        return None
    base = s[k - 1]["install_waits"] if k else 0
    return s[-1]["install_waits"] - base
out = {"script": "tests/gpu/capacity_stage.sh", "runs": runs,
       "summary": {m: {"steps": len(r["steps"]),
                       "measured_round_s": r.get("stats", {}).get("capacity_measured_round_s"),
                       "predicted_round_s": r.get("stats", {}).get("capacity_predicted_round_s"),
                       "install_waits_after_step_32": after_first_rounds(r),
                       "median_step_s": sorted(x["s"] for x in r["steps"])[len(r["steps"]) // 2]
                       if r["steps"] else None}
                   for m, r in runs.items()}}
json.dump(out, open(os.path.join(d, "capacity_stage.json"), "w"), indent=1)
print(json.dumps(out["summary"], indent=1))
EOF
exit $rc_all
