#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU and torch with CUDA preinstalled, and nothing
# to download: every step works offline and copes with missing system packages and tools.
#
#   0. what the machine has, printed and recorded first: python, torch and its CUDA, the GPU,
#      driver and the CUDA it supports (nvidia-smi), nvcc, cmake, ninja, pip, scikit-build-core,
#      glibc, the C compiler, Python.h (asteria._C needs it), dpkg / ar / tar.
#   1. carried dependencies, for a machine without apt or a package index: the Debian packages
#      fetched here with tests/gpu/fetch_debs.sh into .debs (or $ASTERIA_GPU_DEBS), unpacked
#      into build/gpu-deps (dpkg -x, else ar + tar, else python3: tests/gpu/deps_prefix.sh),
#      pkg-config, CMake and the loader pointed there; the build tools the machine lacks
#      (cmake >= 3.25, ninja, scikit-build-core) from the wheels tests/gpu/fetch_wheels.sh
#      fetched into .wheels (or $ASTERIA_GPU_WHEELS), installed offline into build/gpu-tools;
#      pynvml (nvidia-ml-py, stage 7's energy readings) from its wheel there, unpacked into
#      build/gpu-nvml when the machine's python lacks it.
#      From the device tool: carry [".debs", ".wheels"], command `bash tests/gpu/run.sh`.
#   2. dependencies: liburing, hwloc, CMocka, OpenBLAS, LAPACKE (pkg-config + header), nvcc;
#      a missing optional one turns its feature off (-DASTERIA_WITH_URING=OFF, ...) or skips what
#      needs it (no CMocka: no C tests), and says so. OpenBLAS + LAPACKE are required by
#      libasteria: without them nothing of Asteria builds, and only the torch-only parts run.
#      The DLPack header (asteria._C's tensor views): libdlpack-dev's <dlpack/dlpack.h>, or else
#      the copy torch ships (torch/include/ATen/dlpack.h, the same structs) through a shim.
#   3. build libasteria with CUDA and the CUDA C tests (build/gpu), then the Python package:
#      pip install --no-build-isolation --no-deps --no-index --target build/gpu-py .
#      (PYTHONPATH); if pip cannot, a CMake dev build of asteria._C instead.
#   4. GPU present? If not: print "no GPU" and exit 77 (skip), after the build. If so,
#      ASTERIA_REQUIRE_GPU=1 from here on: a test that finds no device fails instead of skipping.
#   5. train-smoke (tests/gpu/train_smoke.py, at most 120 s): does Asteria train at all on the
#      GPU? libasteria reaches the device (a Shadow on the CUDA path), SOAP sync vs async with
#      the default tiers and with host_pinned (the staging ring), a few steps of a small model:
#      parameters finite, async equal to sync within float rounding. JSON: train_smoke.json.
#   6. ctest -L gpu (the CUDA C tests); a skipped or not-run test is a failure here.
#      ASTERIA_GPU_STAGES=first stops after this stage: a first call that answers "does it
#      build, and does it train" in about 4 minutes, so a second call can be planned from it.
#   7. train-f1 (tests/gpu/train_f1.py, at most 90 s): SOAP refreshing every step (f=1) in mode
#      async with S=0, rounds on the host workers and the device executor, against native SOAP
#      (mode sync) at f=1 and f=10 on a small model, 60 steps each: step times, process CPU time
#      and the GPU's energy per step from NVML (energy counter, else sampled power; null with
#      the reason without pynvml); async S=0 checked against sync f=1's trajectory. JSON:
#      train_f1.json.
#  7b. train-drift (tests/gpu/train_drift.py, at most 75 s): SOAP with the per-factor refresh
#      policy (refresh_policy "drift", f=1) against native SOAP (mode sync) at f=10 on the same
#      small model, 60 steps each: budget and d "auto" (the runtime's choice, recorded), and a
#      fixed budget 0.25 with d=1 run twice (its rerun bitwise the same: deterministic
#      installs). Step times, losses, refreshes per 100 steps, mean basis age, skipped share.
#      JSON: train_drift.json.
#   8. benchmarks/gpu_microbench.py (torch only: runs without Asteria's build): torch.linalg.eigh,
#      torch.linalg.qr, a QR power step qr(L Q) and the drift score's GEMMs Q^T L Q in float32
#      "highest" against TF32, n = 1024..8192, batch 1 and 16, within a share of the time left
#      (sizes that would not fit it or the GPU's memory skipped, with the reason); JSON
#      gpu_microbench.json, the device rates the planner reads.
#   9. benchmarks/gpu_bench.py: sync SOAP vs Asteria SOAP (S=5) vs AdamW on a ~150M GPT (step
#      time, memory); JSON gpu_bench.json.
#  10. benchmarks/gpu_bench.py --convergence: the users'-regime comparison on the same GPT
#      (65,536 tokens a step) until AdamW's final loss; JSON gpu_convergence.json.
#  11. tests/gpu/capacity_stage.sh: REFRESH round time host-only vs host + device executor and
#      install waits on the ~150M model.
# Everything runs under one global timeout (ASTERIA_GPU_TOTAL_S, default 470 s < 8 min, build
# included); each stage has its own, and the benchmarks share what is left after stages 7 and 7b. Logs
# go to $OUT/gpu_logs (or build/gpu-logs). The summary, $OUT/gpu_check.json (or build/gpu-logs/), is
# written when the check starts and again after every stage: a stage that fails or times out
# leaves the record of those before it and its own error (its log's tail), and the global
# timeout leaves the stages that finished, the one it interrupted, and itself.
# Exit: 0 everything ran and passed; 1 a stage failed or could not run; 77 no GPU; 124 global
# timeout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
TOTAL_S=${ASTERIA_GPU_TOTAL_S:-470}
STAGES=${ASTERIA_GPU_STAGES:-all}
PY=${PYTHON:-python3}
RESULTS=${OUT:-$ROOT/benchmarks/results}
LOGS=${OUT:+$OUT/gpu_logs}
LOGS=${LOGS:-$ROOT/build/gpu-logs}
CHECK_JSON=${OUT:-$LOGS}/gpu_check.json
SUMMARY=$LOGS/summary.tsv  # step, status, detail, seconds, log file: one row per event
FACTS=$LOGS/machine.tsv    # what the machine has: key, value
if [ -z "${ASTERIA_GPU_T0:-}" ]; then
  ASTERIA_GPU_T0=$(date +%s)
  export ASTERIA_GPU_T0
fi

# write_summary STATE EXIT: the JSON summary from the rows so far (a step's last row wins; a
# step still "running" when the check ended timed out there). Python where it works, else a
# plain shell writer, so a machine whose python is broken still gets its summary.
write_summary() {
  local state=$1 code=${2:-}
  if ! "$PY" - "$SUMMARY" "$FACTS" "$CHECK_JSON" "$state" "$code" "$ASTERIA_GPU_T0" "$STAGES" \
      2>/dev/null <<'EOF'
import json, os, platform, sys, time
summary, facts, out, state, code, t0, stages = sys.argv[1:8]
def rows(path):
    try:
        with open(path) as f:
            return [l.rstrip("\n").split("\t") for l in f if l.strip()]
    except OSError:
        return []
def tail(path, n=25):
    try:
        with open(path, errors="replace") as f:
            return [l.rstrip("\n") for l in f.readlines()[-n:]]
    except OSError:
        return []
steps, order = {}, []
for r in rows(summary):
    r += [""] * (5 - len(r))
    if r[0] not in steps:
        order.append(r[0])
    s = {"step": r[0], "status": r[1], "detail": r[2]}
    if r[3]:
        s["seconds"] = int(r[3])
    if r[4]:
        s["log"] = r[4]
    steps[r[0]] = s
ended = state not in ("started", "running")
for s in steps.values():
    if ended and s["status"] == "running":
        s["status"] = "timed out"
        s["detail"] = "interrupted by the global timeout"
    if s["status"] not in ("ok", "found", "skipped", "running") and s.get("log"):
        s["log_tail"] = tail(s["log"])
    if s["detail"].endswith(".json") and os.path.isfile(s["detail"]):
        try:  # a stage's own JSON (train_smoke.json: its checks, written as it went)
            with open(s["detail"]) as f:
                own = json.load(f)
            s["result"] = {k: own[k] for k in ("state", "checks", "summary", "error")
                           if isinstance(own, dict) and k in own}
        except (OSError, ValueError):
            pass
rec = {"script": "tests/gpu/run.sh", "state": state, "stages": stages,
       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "machine": dict(platform.uname()._asdict(), **{r[0]: r[1] for r in rows(facts)
                                                      if len(r) > 1}),
       "exit_code": int(code) if code else None, "wall_s": int(time.time()) - int(t0),
       "steps": [steps[k] for k in order]}
tmp = out + ".tmp"
with open(tmp, "w") as f:
    json.dump(rec, f, indent=1)
os.replace(tmp, out)
EOF
  then
    {
      printf '{"script": "tests/gpu/run.sh", "state": "%s", "exit_code": %s, "writer": "shell", "steps": [' \
        "$state" "${code:-null}"
      local first=1 step status detail rest
      while IFS=$'\t' read -r step status detail rest; do
        [ $first = 1 ] || printf ','
        first=0
        printf '\n {"step": "%s", "status": "%s", "detail": "%s"}' "$(_json_esc "$step")" \
          "$(_json_esc "$status")" "$(_json_esc "$detail")"
      done <"$SUMMARY"
      printf '\n]}\n'
    } >"$CHECK_JSON" 2>/dev/null || true
  fi
}
_json_esc() { printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g' | tr -d '\000-\037'; }

if [ -z "${ASTERIA_GPU_INNER:-}" ]; then
  export ASTERIA_GPU_INNER=1
  mkdir -p "$RESULTS" "$LOGS" "$ROOT/build"
  : >"$SUMMARY"
  : >"$FACTS"
  write_summary started ""
  timeout -k 10 "$TOTAL_S" bash "$0" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "[gpu] FAILED: global timeout of ${TOTAL_S}s hit"
    printf 'global-timeout\ttimed out\tthe check ran past ASTERIA_GPU_TOTAL_S=%ss\t%s\t\n' \
      "$TOTAL_S" "$(($(date +%s) - ASTERIA_GPU_T0))" >>"$SUMMARY"
    write_summary "timed out" "$rc"
    echo "[gpu] summary so far: $CHECK_JSON"
  fi
  exit "$rc"
fi

JOBS=$(nproc 2>/dev/null || echo 4)
BUILD=$ROOT/build/gpu
PYTARGET=$ROOT/build/gpu-py
mkdir -p "$RESULTS" "$LOGS" "$ROOT/build"

say() { echo "[gpu $(($(date +%s) - ASTERIA_GPU_T0))s] $*"; }
# note STEP STATUS [DETAIL [SECONDS [LOG]]]: one row, and the JSON rewritten (it is cheap)
note() {
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "${3:-}" | tr '\t\n' '  ')" "${4:-}" \
    "${5:-}" >>"$SUMMARY"
  write_summary running ""
}
fact() { printf '%s\t%s\n' "$1" "$(printf '%s' "$2" | tr '\t\n' '  ')" >>"$FACTS"; printf '    %-22s %s\n' "$1" "$2"; }
left() { echo $((TOTAL_S - ($(date +%s) - ASTERIA_GPU_T0))); }
FAILED=0

# stage NAME SECONDS CMD...: runs CMD with its own timeout, output to $LOGS/NAME.log; records
# "running" first, then ok / failed / timed out (the JSON then carries the log's tail), and
# prints the tail on failure. Returns CMD's exit code; STAGE_STATUS and STAGE_S say the rest.
# The stage runs in the background of a `wait`, so that the global timeout's SIGTERM reaches
# on_term at once: timeout(1) puts the stage in a process group of its own, which a signal to
# this script's group would miss, and on_term ends that group too.
STAGE_PID=""
on_term() {
  if [ -n "$STAGE_PID" ]; then
    kill -TERM -- "-$STAGE_PID" 2>/dev/null || kill -TERM "$STAGE_PID" 2>/dev/null
    sleep 2
    kill -KILL -- "-$STAGE_PID" 2>/dev/null
  fi
  exit 143
}
trap on_term TERM INT
stage() {
  local name=$1 secs=$2; shift 2
  local t0 rc log=$LOGS/$name.log
  t0=$(date +%s)
  note "$name" running "started at $((t0 - ASTERIA_GPU_T0))s, limit ${secs}s" "" "$log"
  timeout -k 5 "$secs" "$@" >"$log" 2>&1 &
  STAGE_PID=$!
  wait "$STAGE_PID"
  rc=$?
  STAGE_PID=""
  STAGE_S=$(($(date +%s) - t0))
  if [ "$rc" -eq 0 ]; then
    STAGE_STATUS=ok
    say "$name: ok (${STAGE_S}s)"
    note "$name" ok "" "$STAGE_S" "$log"
  else
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      STAGE_STATUS="timed out"
      say "$name: TIMED OUT after ${secs}s"
      note "$name" "timed out" "its limit of ${secs}s" "$STAGE_S" "$log"
    else
      STAGE_STATUS=failed
      say "$name: FAILED (exit $rc)"
      note "$name" failed "exit $rc" "$STAGE_S" "$log"
    fi
    tail -n 40 "$log" | sed 's/^/    | /'
  fi
  return "$rc"
}

finish() {  # $1: exit code
  write_summary finished "$1"
  say "summary:"
  cut -f1-4 "$SUMMARY" | awk -F'\t' '{a[$1]=$0; if (!($1 in o)) {o[$1]=++n; k[n]=$1}} END {for (i=1;i<=n;i++) print a[k[i]]}' \
    | column -t -s $'\t' 2>/dev/null | sed 's/^/    /' || true
  say "logs in $LOGS; summary $CHECK_JSON; exit $1"
  exit "$1"
}

# ---- 0. what the machine has -------------------------------------------------------------------
say "Asteria GPU check in $ROOT ($(uname -srm), $JOBS CPUs), global timeout ${TOTAL_S}s, stages: $STAGES"
have_tool() { command -v "$1" >/dev/null 2>&1; }
first_line() { "$@" 2>&1 | head -n1; }
fact python "$(command -v "$PY" || echo "MISSING: $PY") $(first_line "$PY" --version)"
TORCH_INFO=$("$PY" -c "import torch; print(torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), 'devices', torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>&1 | tail -n1)
fact torch "$TORCH_INFO"
if have_tool nvidia-smi; then
  fact gpu "$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | head -n1)"
  fact driver "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -n1), supports CUDA $(nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | awk '{print $3}')"
else
  fact gpu "no nvidia-smi"
fi
NVCC=$(command -v nvcc || true)
for c in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -z "$NVCC" ] && [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && NVCC=$c/bin/nvcc
done
fact nvcc "${NVCC:-MISSING} $([ -n "$NVCC" ] && "$NVCC" --version | grep -o 'release [0-9.]*')"
fact cmake "$(have_tool cmake && first_line cmake --version || echo MISSING)"
fact ninja "$(have_tool ninja && ninja --version || echo MISSING)"
fact pip "$(first_line "$PY" -m pip --version)"
fact scikit-build-core "$("$PY" -c 'import scikit_build_core as s; print(s.__version__)' 2>/dev/null || echo MISSING)"
fact glibc "$(getconf GNU_LIBC_VERSION 2>/dev/null || first_line ldd --version) (the carried Debian 12 libraries need >= 2.36)"
CC_BIN=$(command -v cc || command -v gcc || true)
fact cc "${CC_BIN:-MISSING} $([ -n "$CC_BIN" ] && first_line "$CC_BIN" --version)"
PY_INC=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null)
if [ -n "$PY_INC" ] && [ -f "$PY_INC/Python.h" ]; then HAVE_PYH=1; else HAVE_PYH=0; fi
fact Python.h "$([ $HAVE_PYH = 1 ] && echo "$PY_INC/Python.h" || echo "MISSING (in '$PY_INC'): asteria._C cannot build")"
fact python3-config "$(have_tool python3-config && first_line python3-config --includes || echo MISSING)"
fact unpack "dpkg $(have_tool dpkg && echo yes || echo no), ar $(have_tool ar && echo yes || echo no), tar $(have_tool tar && echo yes || echo no)"
fact cpus+memory "$JOBS CPUs, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo 2>/dev/null)"
write_summary running ""
"$PY" -c "import torch" >/dev/null 2>&1 \
  || { say "FAILED: $PY cannot import torch"; note torch failed "import torch: $TORCH_INFO"; finish 1; }

# ---- 1. carried dependencies and tools ---------------------------------------------------------
DEBS=${ASTERIA_GPU_DEBS:-$ROOT/.debs}
WHEELS=${ASTERIA_GPU_WHEELS:-$ROOT/.wheels}
DEPS_PREFIX=""
# shellcheck source=tests/gpu/deps_prefix.sh
. "$ROOT/tests/gpu/deps_prefix.sh"
if asteria_deps_prefix "$DEBS" "$ROOT/build/gpu-deps"; then
  DEPS_PREFIX=$ROOT/build/gpu-deps
  say "dependencies: $(ls "$DEBS"/*.deb "$DEBS"/fallback/*.deb 2>/dev/null | wc -l) packages from $DEBS unpacked into build/gpu-deps ($(asteria_deb_unpacker))"
  note deps-prefix ok "$DEBS -> build/gpu-deps ($(asteria_deb_unpacker))"
elif compgen -G "$DEBS/*.deb" >/dev/null; then
  say "dependencies: the .deb files in $DEBS could not be unpacked; the machine's own packages"
  note deps-prefix failed "could not unpack $DEBS ($(asteria_deb_unpacker))"
else
  note deps-prefix skipped "no .deb files in $DEBS: the machine's own packages"
fi
TOOLS_PYTHONPATH=""
ASTERIA_TOOLS_PYTHONPATH=""
# called directly, not in $(...): its exports (PATH, ASTERIA_TOOLS_PYTHONPATH) must reach here
if asteria_tools_prefix "$WHEELS" "$ROOT/build/gpu-tools" >"$LOGS/tools.out" 2>"$LOGS/tools.log"; then
  TOOLS=$(cat "$LOGS/tools.out")
  TOOLS_PYTHONPATH=$ASTERIA_TOOLS_PYTHONPATH
  say "build tools from $WHEELS: $TOOLS (cmake $(cmake --version | head -n1 | awk '{print $3}'))"
  note tools ok "installed from $WHEELS: $TOOLS" "" "$LOGS/tools.log"
else
  case $? in
    2) say "build tools: installing from $WHEELS FAILED (see $LOGS/tools.log)"
       note tools failed "pip install from $WHEELS" "" "$LOGS/tools.log" ;;
    *) note tools skipped "nothing lacking, or no wheels in $WHEELS" ;;
  esac
fi
NVML_PYTHONPATH=""
ASTERIA_NVML_PYTHONPATH=""
if asteria_nvml_prefix "$WHEELS" "$ROOT/build/gpu-nvml" >"$LOGS/nvml.out" 2>"$LOGS/nvml.log"; then
  NVML_PYTHONPATH=$ASTERIA_NVML_PYTHONPATH
  note nvml-py ok "pynvml from $(cat "$LOGS/nvml.out") -> build/gpu-nvml" "" "$LOGS/nvml.log"
else
  case $? in
    2) note nvml-py failed "could not unpack the nvidia-ml-py wheel in $WHEELS" "" "$LOGS/nvml.log" ;;
    *) if "$PY" -c "import pynvml" >/dev/null 2>&1; then note nvml-py found "the machine's pynvml"
       else note nvml-py skipped "no pynvml and no nvidia_ml_py wheel in $WHEELS: train-f1 records no energy"; fi ;;
  esac
fi

# ---- 2. dependencies ---------------------------------------------------------------------------
# have_lib PC SOURCE: the pkg-config module CMake asks for, and its header through the compiler
have_lib() {
  have_tool pkg-config && pkg-config --exists "$1" || return 1
  [ -n "$CC_BIN" ] || return 1
  # shellcheck disable=SC2046
  printf '%s\n' "$2" | "$CC_BIN" -E -x c - $(pkg-config --cflags "$1") >/dev/null 2>&1
}
declare -A HAVE
check_dep() {  # PC SOURCE
  if have_lib "$1" "$2"; then
    HAVE[$1]=1
    say "dependency $1: found ($(pkg-config --modversion "$1"))"
    note "dep:$1" found "$(pkg-config --modversion "$1")"
  else
    HAVE[$1]=0
    say "dependency $1: MISSING (pkg-config module or header)"
    note "dep:$1" missing
  fi
}
check_dep liburing '#include <liburing.h>'
check_dep hwloc '#include <hwloc.h>'
check_dep cmocka $'#include <stdarg.h>\n#include <stddef.h>\n#include <setjmp.h>\n#include <stdint.h>\n#include <cmocka.h>'
check_dep openblas '#include <cblas.h>'
check_dep lapacke '#include <lapacke.h>'

CAN_BUILD=1
WHY_NOT=""
for t in cmake pkg-config; do
  have_tool "$t" || { CAN_BUILD=0; WHY_NOT+="$t missing; "; }
done
[ -n "$CC_BIN" ] || { CAN_BUILD=0; WHY_NOT+="no C compiler; "; }
if have_tool cmake; then
  CMAKE_V=$(cmake --version | head -n1 | awk '{print $3}')
  if [ "$(printf '%s\n3.25\n' "$CMAKE_V" | sort -V | head -n1)" != "3.25" ]; then
    CAN_BUILD=0; WHY_NOT+="cmake $CMAKE_V < 3.25 (carry .wheels: tests/gpu/fetch_wheels.sh); "
  fi
fi
for lib in openblas lapacke; do
  [ "${HAVE[$lib]}" = 1 ] || { CAN_BUILD=0; WHY_NOT+="$lib MISSING (libasteria requires OpenBLAS and LAPACKE: carry .debs, tests/gpu/fetch_debs.sh); "; }
done

CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DASTERIA_BUILD_EXAMPLES=OFF)
if [ -n "$DEPS_PREFIX" ] && [ -f "$DEPS_PREFIX/usr/include/dlpack/dlpack.h" ]; then
  CMAKE_FLAGS+=("-DDLPACK_INCLUDE_DIR=$DEPS_PREFIX/usr/include")
  say "dependency dlpack: found (libdlpack-dev, carried)"
  note dep:dlpack found "libdlpack-dev from $DEBS"
elif [ -n "$CC_BIN" ] && printf '#include <dlpack/dlpack.h>\n' | "$CC_BIN" -E -x c - >/dev/null 2>&1; then
  say "dependency dlpack: found (libdlpack-dev)"
  note dep:dlpack found "libdlpack-dev"
else
  TORCH_DLPACK=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "dlpack.h"))' 2>/dev/null)
  if [ -n "$TORCH_DLPACK" ] && [ -f "$TORCH_DLPACK" ]; then
    mkdir -p "$ROOT/build/dlpack-shim/dlpack"
    ln -sf "$TORCH_DLPACK" "$ROOT/build/dlpack-shim/dlpack/dlpack.h"
    CMAKE_FLAGS+=("-DDLPACK_INCLUDE_DIR=$ROOT/build/dlpack-shim")
    say "dependency dlpack: no libdlpack-dev; using torch's copy $TORCH_DLPACK"
    note dep:dlpack found "torch's ATen/dlpack.h"
  else
    say "dependency dlpack: MISSING (no libdlpack-dev, no torch/include/ATen/dlpack.h): asteria._C cannot build"
    note dep:dlpack missing
  fi
fi
[ $HAVE_PYH = 1 ] || { say "Python.h MISSING for $PY: asteria._C cannot build (libasteria and the C tests still can)"; note dep:python-headers missing "no Python.h in '$PY_INC'"; }
[ "${HAVE[liburing]}" = 1 ] || { CMAKE_FLAGS+=(-DASTERIA_WITH_URING=OFF); say "skipped: NVMe tier (no liburing): -DASTERIA_WITH_URING=OFF"; note nvme-tier skipped "no liburing"; }
[ "${HAVE[hwloc]}" = 1 ] || { CMAKE_FLAGS+=(-DASTERIA_WITH_HWLOC=OFF); say "skipped: worker pinning (no hwloc): -DASTERIA_WITH_HWLOC=OFF"; note hwloc skipped "no hwloc"; }
WITH_TESTS=1
if [ "${HAVE[cmocka]}" = 0 ]; then
  WITH_TESTS=0
  say "skipped: all C tests, ctest -L gpu included (test_cuda_mem, test_shadow_cuda): they need CMocka"
  note c-tests skipped "no CMocka"
fi
if [ $WITH_TESTS = 1 ]; then CMAKE_FLAGS+=(-DASTERIA_BUILD_TESTS=ON); else CMAKE_FLAGS+=(-DASTERIA_BUILD_TESTS=OFF); fi

if [ -n "$NVCC" ]; then
  CUDA_ROOT=$(dirname "$(dirname "$NVCC")")
  say "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"
  CMAKE_FLAGS+=(-DASTERIA_WITH_CUDA=ON "-DCUDAToolkit_ROOT=$CUDA_ROOT")
else
  CMAKE_FLAGS+=(-DASTERIA_WITH_CUDA=OFF)
  say "no nvcc: building WITHOUT CUDA (with a GPU present that is a failure, stage 4)"
  note cuda-build skipped "no nvcc: libasteria built without CUDA"
fi
GEN=()
have_tool ninja && GEN=(-G Ninja)

# ---- 3. build ----------------------------------------------------------------------------------
PYPATH=""
if [ $CAN_BUILD = 0 ]; then
  say "CANNOT BUILD libasteria: $WHY_NOT"
  say "running only the torch-only parts (GPU check, AdamW in the benchmark)"
  note build-libasteria failed "$WHY_NOT"
  FAILED=1
else
  rm -rf "$BUILD"  # a cache from other flags (generator, features) must not get in the way
  # Only libasteria and the gpu-labelled tests: a CPU test that does not compile (work in
  # progress elsewhere) must not stop the GPU check.
  if stage cmake-configure 120 cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" "${CMAKE_FLAGS[@]}" \
     && stage build-libasteria 240 cmake --build "$BUILD" --target asteria -j"$JOBS"; then
    note build-libasteria ok "$(printf '%s ' "${CMAKE_FLAGS[@]}")" "$STAGE_S" "$LOGS/build-libasteria.log"
  else
    FAILED=1
    CAN_BUILD=0
  fi
fi
GPU_TESTS=()
if [ $CAN_BUILD = 1 ] && [ $WITH_TESTS = 1 ]; then
  mapfile -t GPU_TESTS < <(ctest --test-dir "$BUILD" -L gpu -N | sed -n 's/^ *Test *#[0-9]*: *//p')
  say "CUDA C tests: ${GPU_TESTS[*]:-none}"
  if [ ${#GPU_TESTS[@]} -gt 0 ] && stage build-gpu-tests 240 cmake --build "$BUILD" --target "${GPU_TESTS[@]}" -j"$JOBS"; then
    note build-gpu-tests ok "${GPU_TESTS[*]}" "$STAGE_S" "$LOGS/build-gpu-tests.log"
  else
    [ ${#GPU_TESTS[@]} -gt 0 ] || note build-gpu-tests failed "ctest lists no gpu-labelled test"
    FAILED=1
    WITH_TESTS=0
  fi
fi

if [ $CAN_BUILD = 1 ] && [ $HAVE_PYH = 1 ]; then
  PIP_DEFS=()
  for f in "${CMAKE_FLAGS[@]}"; do
    case $f in -DASTERIA_WITH_*|-DCUDAToolkit_ROOT=*|-DDLPACK_INCLUDE_DIR=*) f=${f#-D}; PIP_DEFS+=("--config-settings=cmake.define.${f%%=*}=${f#*=}");; esac
  done
  rm -rf "$PYTARGET"
  if stage pip-install 240 env ${TOOLS_PYTHONPATH:+PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$TOOLS_PYTHONPATH} \
       "$PY" -m pip install --no-build-isolation --no-deps --no-index \
       --target "$PYTARGET" --config-settings=build-dir="$ROOT/build/gpu-wheel" "${PIP_DEFS[@]}" "$ROOT"; then
    PYPATH=$PYTARGET
    note python-package ok "pip install --target build/gpu-py"
  else
    say "pip install failed (offline, or no scikit-build-core): building asteria._C with CMake instead"
    if stage devpy-configure 120 cmake -S "$ROOT" -B "$ROOT/build/gpu-devpy" "${GEN[@]}" "${CMAKE_FLAGS[@]}" \
         -DASTERIA_BUILD_TESTS=OFF -DASTERIA_BUILD_PYTHON=ON \
       && stage devpy-build 240 cmake --build "$ROOT/build/gpu-devpy" --target _C -j"$JOBS"; then
      PYPATH=$ROOT/python
      note python-package ok "pip failed; CMake dev build of _C, PYTHONPATH=python"
    else
      note python-package failed "pip and the CMake dev build both failed"
      FAILED=1
    fi
  fi
elif [ $CAN_BUILD = 1 ]; then
  note python-package failed "no Python.h for $PY"
  FAILED=1
fi
if [ -n "$PYPATH" ]; then
  export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
  if IMPORT=$(cd /tmp && "$PY" -c "import asteria, asteria._C as C; print('asteria', asteria.__version__, 'from', asteria.__file__, 'HAVE_CUDA', C.HAVE_CUDA)" 2>&1); then
    say "$IMPORT"
    note python-import ok "$IMPORT"
  else
    say "FAILED: the built asteria does not import: $IMPORT"
    note python-import failed "$(printf '%s' "$IMPORT" | tail -n 3)"
    FAILED=1
    PYPATH=""
  fi
fi

# ---- 4. is there a GPU? ------------------------------------------------------------------------
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  say "no GPU: torch sees no CUDA device; skipping the GPU stages"
  note gpu skipped "no GPU"
  [ $FAILED = 0 ] && finish 77
  say "(exit 1, not 77: an earlier step failed)"
  finish 1
fi
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
say "GPU: $GPU_NAME"
note gpu found "$GPU_NAME"
if [ -z "$NVCC" ]; then
  # libasteria without CUDA on a GPU machine: the CUDA tiers, the shadow stream and the CUDA C
  # tests are all missing, and a CUDA parameter's bases stay on the device (tiers/plan.py)
  say "FAILED: a GPU is here but there was no nvcc to build libasteria's CUDA paths"
  note cuda-build failed "no nvcc on a GPU machine: libasteria built without CUDA"
  FAILED=1
fi
# from here on a test that finds no device fails: torch sees one, so libasteria must too
export ASTERIA_REQUIRE_GPU=1

# ---- 5. does it train at all on the GPU? -------------------------------------------------------
if [ -n "$PYPATH" ]; then
  stage train-smoke 120 "$PY" "$ROOT/tests/gpu/train_smoke.py" --out "$RESULTS/train_smoke.json" \
    || FAILED=1
  # its own JSON (each check, written as it went) goes into the summary
  note train-smoke "$STAGE_STATUS" "$RESULTS/train_smoke.json" "$STAGE_S" "$LOGS/train-smoke.log"
  sed -n 's/^\[train-smoke\] /    /p' "$LOGS/train-smoke.log"
else
  say "skipped: train-smoke (Asteria not built)"
  note train-smoke failed "Asteria not built"
  FAILED=1
fi

# ---- 6. CUDA C tests ---------------------------------------------------------------------------
if [ $CAN_BUILD = 1 ] && [ $WITH_TESTS = 1 ]; then
  if stage ctest-gpu 120 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 100 -j2; then
    if grep -qE 'Not Run|\*\*\*Skipped|\(Skipped\)' "$LOGS/ctest-gpu.log"; then
      # a GPU is here: a CUDA test that skipped did not see it (ASTERIA_REQUIRE_GPU makes the
      # tests fail instead; this catches one that skips on its own)
      note ctest-gpu failed "a CUDA test skipped or did not run with a GPU present" "" "$LOGS/ctest-gpu.log"
      FAILED=1
    else
      note ctest-gpu ok "$(grep -E 'tests passed' "$LOGS/ctest-gpu.log" | tr '\n' ' ')" "" "$LOGS/ctest-gpu.log"
    fi
  else
    FAILED=1
  fi
  grep -E "Passed|Failed|Not Run|Skipped|tests passed" "$LOGS/ctest-gpu.log" | sed 's/^/    /'
else
  say "skipped: ctest -L gpu (C tests not built)"
  note ctest-gpu failed "C tests not built"
  FAILED=1
fi

if [ "$STAGES" = first ]; then
  note benchmarks skipped "ASTERIA_GPU_STAGES=first: the benchmarks are for a later call"
  finish $FAILED
fi

# ---- 7. every-step refresh (f=1) at S=0 against native f=1 and f=10, with energy ----------------
# a fixed limit: three timed runs of at most F1_RUN_S each, two short check runs, set-up
F1_S=90
F1_RUN_S=20
if [ -z "$PYPATH" ]; then
  say "skipped: train-f1 (Asteria not built)"
  note train-f1 failed "Asteria not built"
  FAILED=1
elif [ "$(left)" -lt $((F1_S + 45)) ]; then
  say "skipped: train-f1 ($(left)s left of the global ${TOTAL_S}s)"
  note train-f1 skipped "out of time ($(left)s left)"
  FAILED=1
else
  stage train-f1 "$F1_S" env ${NVML_PYTHONPATH:+PYTHONPATH=$PYTHONPATH:$NVML_PYTHONPATH} \
    "$PY" "$ROOT/tests/gpu/train_f1.py" --out "$RESULTS/train_f1.json" --run-budget-s "$F1_RUN_S" \
    || FAILED=1
  note train-f1 "$STAGE_STATUS" "$RESULTS/train_f1.json" "$STAGE_S" "$LOGS/train-f1.log"
  sed -n 's/^\[train-f1\] /    /p' "$LOGS/train-f1.log"
fi

# ---- 7b. the per-factor refresh policy (drift) against native f=10 -----------------------------
# a fixed limit: four runs of at most DRIFT_RUN_S each, set-up
DRIFT_S=75
DRIFT_RUN_S=12
if [ -z "$PYPATH" ]; then
  say "skipped: train-drift (Asteria not built)"
  note train-drift failed "Asteria not built"
  FAILED=1
elif [ "$(left)" -lt $((DRIFT_S + 45)) ]; then
  say "skipped: train-drift ($(left)s left of the global ${TOTAL_S}s)"
  note train-drift skipped "out of time ($(left)s left)"
  FAILED=1
else
  stage train-drift "$DRIFT_S" "$PY" "$ROOT/tests/gpu/train_drift.py" \
    --out "$RESULTS/train_drift.json" --run-budget-s "$DRIFT_RUN_S" || FAILED=1
  note train-drift "$STAGE_STATUS" "$RESULTS/train_drift.json" "$STAGE_S" "$LOGS/train-drift.log"
  sed -n 's/^\[train-drift\] /    /p' "$LOGS/train-drift.log"
fi

# ---- 8. the GPU's REFRESH kernels (the planner's device rates) ---------------------------------
# (the capacity stage (11) keeps CAP_SHARE seconds of its own, from here on)
CAP_SHARE=100
# 20% of what is left (less 45 s for the summary and teardown), at most 60 s of measurements;
# its limit adds 30 s for python's and CUDA's start. The benchmarks share the rest.
MICRO_S=$((($(left) - 45 - CAP_SHARE) * 2 / 10))
[ "$MICRO_S" -gt 60 ] && MICRO_S=60
if [ "$MICRO_S" -lt 15 ]; then
  say "skipped: GPU microbenchmark ($(left)s left of the global ${TOTAL_S}s)"
  note gpu-microbench skipped "out of time ($(left)s left)"
  FAILED=1
else
  say "GPU microbenchmark (eigh, qr, QR power step, score GEMMs; highest vs TF32): ${MICRO_S}s budget"
  stage gpu-microbench $((MICRO_S + 30)) "$PY" "$ROOT/benchmarks/gpu_microbench.py" \
    --out "$RESULTS/gpu_microbench.json" --budget-s "$MICRO_S" || FAILED=1
  note gpu-microbench "$STAGE_STATUS" "$RESULTS/gpu_microbench.json" "$STAGE_S" "$LOGS/gpu-microbench.log"
  tail -n 6 "$LOGS/gpu-microbench.log" | sed 's/^/    /'
fi

# ---- 9. step-time benchmark --------------------------------------------------------------------
# What is left (less 45 s for the summary and teardown) is shared: the convergence stage (10)
# gets 60%, at most 200 s; the step-time benchmark the rest, at most 210 s.
AVAIL=$(($(left) - 45 - CAP_SHARE))
CONV_SHARE=$((AVAIL * 6 / 10))
[ "$CONV_SHARE" -gt 200 ] && CONV_SHARE=200
BENCH_TOTAL=$((AVAIL - CONV_SHARE))
[ "$BENCH_TOTAL" -gt 210 ] && BENCH_TOTAL=210
BENCH_ARGS_COMMON=()
if [ -z "$PYPATH" ]; then
  # no Asteria of this checkout: never let a stale installed one stand in for it
  say "Asteria not built: the benchmarks run AdamW only (torch-only part)"
  BENCH_ARGS_COMMON+=(--runs adamw)
fi
# run_bench NAME SECONDS JSON ARGS...: a benchmark; its JSON path goes into the summary and
# the end of its progress onto the terminal
run_bench() {
  local name=$1 secs=$2 json=$3; shift 3
  stage "$name" $((secs + 30)) "$PY" "$ROOT/benchmarks/gpu_bench.py" "$@" || FAILED=1
  note "$name" "$STAGE_STATUS" "$json" "$STAGE_S" "$LOGS/$name.log"
  [ "$STAGE_STATUS" = ok ] && tail -n 15 "$LOGS/$name.log" | sed 's/^/    /'
  return 0
}
if [ "$BENCH_TOTAL" -lt 60 ]; then
  say "skipped: GPU benchmark ($(left)s left of the global ${TOTAL_S}s)"
  note gpu-bench skipped "out of time ($(left)s left)"
  FAILED=1
else
  say "GPU benchmark: ${BENCH_TOTAL}s budget (progress below)"
  run_bench gpu-bench "$BENCH_TOTAL" "$RESULTS/gpu_bench.json" --total-budget-s "$BENCH_TOTAL" \
    --out "$RESULTS/gpu_bench.json" "${BENCH_ARGS_COMMON[@]}"
fi

# ---- 10. convergence in the users' regime ---------------------------------------------------------
CONV_TOTAL=$(($(left) - 40 - CAP_SHARE))
[ "$CONV_TOTAL" -gt 200 ] && CONV_TOTAL=200
if [ "$CONV_TOTAL" -lt 90 ]; then
  say "skipped: GPU convergence comparison ($(left)s left of the global ${TOTAL_S}s)"
  note gpu-convergence skipped "out of time ($(left)s left)"
  FAILED=1
else
  say "GPU convergence comparison (users' regime, 65,536 tokens a step): ${CONV_TOTAL}s budget"
  run_bench gpu-convergence "$CONV_TOTAL" "$RESULTS/gpu_convergence.json" --convergence \
    --total-budget-s "$CONV_TOTAL" --out "$RESULTS/gpu_convergence.json" "${BENCH_ARGS_COMMON[@]}"
fi

# ---- 11. capacity: REFRESH rounds host-only vs host + device executor ---------------------------
CAP_TOTAL=$(($(left) - 25))
[ "$CAP_TOTAL" -gt 150 ] && CAP_TOTAL=150
if [ -z "$PYPATH" ] || [ "$CAP_TOTAL" -lt 60 ]; then
  say "skipped: capacity stage ($(left)s left of the global ${TOTAL_S}s, or Asteria not built)"
  note capacity-stage skipped "out of time ($(left)s left) or Asteria not built"
else
  say "capacity stage (host-only vs hybrid round time, install waits): ${CAP_TOTAL}s budget"
  stage capacity-stage $((CAP_TOTAL + 20)) env OUT="$RESULTS" ASTERIA_CAPACITY_BUDGET_S="$CAP_TOTAL" \
    bash "$ROOT/tests/gpu/capacity_stage.sh" || FAILED=1
  note capacity-stage "$STAGE_STATUS" "$RESULTS/capacity_stage.json" "$STAGE_S" "$LOGS/capacity-stage.log"
  tail -n 12 "$LOGS/capacity-stage.log" | sed 's/^/    /'
fi

finish $FAILED
