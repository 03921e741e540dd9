#!/usr/bin/env bash
# The GPU check, for a machine with one NVIDIA GPU and torch with CUDA preinstalled, and nothing
# to download: every step works offline and copes with missing system packages.
#
#   0. on a machine without apt: the Debian packages fetched elsewhere with
#      tests/gpu/fetch_debs.sh into .debs (or $ASTERIA_GPU_DEBS), carried along, unpacked with
#      dpkg -x into build/gpu-deps (tests/gpu/deps_prefix.sh); pkg-config, CMake and the loader
#      are pointed there. From the device tool: carry [".debs"], command `bash tests/gpu/run.sh`.
#   1. dependencies: liburing, hwloc, CMocka, OpenBLAS, LAPACKE (pkg-config + header), nvcc;
#      a missing optional one turns its feature off (-DASTERIA_WITH_URING=OFF, ...) or skips what
#      needs it (no CMocka: no C tests), and says so. OpenBLAS + LAPACKE are required by
#      libasteria: without them nothing of Asteria builds, and only the torch-only parts run.
#      The DLPack header (asteria._C's tensor views): libdlpack-dev's <dlpack/dlpack.h>, or else
#      the copy torch ships (torch/include/ATen/dlpack.h, the same structs) through a shim
#      directory passed as -DDLPACK_INCLUDE_DIR, so the check stays offline.
#   2. build libasteria with CUDA (build/gpu), then the Python package: pip install
#      --no-build-isolation --no-deps --no-index --target build/gpu-py . (PYTHONPATH); if pip
#      cannot (no scikit-build-core offline), a CMake dev build of asteria._C instead.
#   3. GPU present? If not: print "no GPU" and exit 77 (skip), after the build.
#   4. ctest -L gpu (the CUDA C tests).
#   5. benchmarks/gpu_bench.py: ~2 minutes, sync SOAP vs Asteria SOAP (S=5) vs AdamW on a ~150M
#      GPT (step time, memory); JSON to $OUT/gpu_bench.json (or benchmarks/results/ when OUT is
#      unset).
#   6. benchmarks/gpu_bench.py --convergence: ~3 minutes, the users'-regime comparison of
#      bench_convergence.py on the same ~150M GPT: 128 x 512 = 65,536 tokens a step (16x the
#      MLP's 4096), warm-up + cosine, AdamW first, then Asteria SOAP async and native sync SOAP
#      each until AdamW's final loss; the time ratio to AdamW's. JSON: gpu_convergence.json.
#   7. tests/gpu/capacity_stage.sh: REFRESH round time host-only vs host + device executor and
#      install waits on the ~150M model (the device executor of refresh/device.py).
# Everything runs under one global timeout (ASTERIA_GPU_TOTAL_S, default 470 s < 8 min); each
# step has its own, and the benchmark gets what is left. Logs go to $OUT/gpu_logs (or
# build/gpu-logs); a summary of every step to $OUT/gpu_check.json (or build/gpu-logs/).
# Exit: 0 everything ran and passed; 1 a step failed or could not run; 77 no GPU; 124 global
# timeout.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
TOTAL_S=${ASTERIA_GPU_TOTAL_S:-470}

if [ -z "${ASTERIA_GPU_INNER:-}" ]; then
  export ASTERIA_GPU_INNER=1
  ASTERIA_GPU_T0=$(date +%s)
  export ASTERIA_GPU_T0
  timeout -k 10 "$TOTAL_S" bash "$0" "$@"
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "[gpu] FAILED: global timeout of ${TOTAL_S}s hit"
  fi
  exit "$rc"
fi

PY=${PYTHON:-python3}
JOBS=$(nproc 2>/dev/null || echo 4)
BUILD=$ROOT/build/gpu
PYTARGET=$ROOT/build/gpu-py
RESULTS=${OUT:-$ROOT/benchmarks/results}
LOGS=${OUT:+$OUT/gpu_logs}
LOGS=${LOGS:-$ROOT/build/gpu-logs}
CHECK_JSON=${OUT:-$LOGS}/gpu_check.json
mkdir -p "$RESULTS" "$LOGS" "$ROOT/build"
SUMMARY=$LOGS/summary.tsv
: >"$SUMMARY"

say() { echo "[gpu $(($(date +%s) - ASTERIA_GPU_T0))s] $*"; }
note() { printf '%s\t%s\t%s\n' "$1" "$2" "${3:-}" >>"$SUMMARY"; }  # step, status, detail
left() { echo $((TOTAL_S - ($(date +%s) - ASTERIA_GPU_T0))); }
FAILED=0

# run NAME SECONDS CMD...: output to $LOGS/NAME.log; on failure print its tail
run() {
  local name=$1 secs=$2; shift 2
  local t0 rc
  t0=$(date +%s)
  timeout -k 5 "$secs" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    say "$name: ok ($(($(date +%s) - t0))s)"
  else
    if [ "$rc" -eq 124 ]; then say "$name: TIMED OUT after ${secs}s"; else say "$name: FAILED (exit $rc)"; fi
    tail -n 40 "$LOGS/$name.log" | sed 's/^/    | /'
  fi
  return "$rc"
}

write_summary() {  # $1: exit code
  "$PY" - "$SUMMARY" "$CHECK_JSON" "$1" "$ASTERIA_GPU_T0" <<'EOF' || true
import json, os, platform, sys, time
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
out = {"script": "tests/gpu/run.sh", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
       "machine": platform.uname()._asdict(), "exit_code": int(sys.argv[3]),
       "wall_s": int(time.time()) - int(sys.argv[4]),
       "steps": [{"step": r[0], "status": r[1], "detail": r[2] if len(r) > 2 else ""} for r in rows]}
with open(sys.argv[2], "w") as f:
    json.dump(out, f, indent=1)
EOF
}

finish() {  # $1: exit code
  write_summary "$1"
  say "summary:"
  column -t -s $'\t' "$SUMMARY" 2>/dev/null | sed 's/^/    /' || sed 's/^/    /' "$SUMMARY"
  say "logs in $LOGS; summary $CHECK_JSON; exit $1"
  exit "$1"
}

say "Asteria GPU check in $ROOT ($(uname -srm), $JOBS CPUs), global timeout ${TOTAL_S}s"
command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | sed 's/^/    /'
"$PY" -c "import torch; print('    torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())" \
  || { say "FAILED: $PY cannot import torch"; note torch failed "import torch"; finish 1; }

# ---- 0. dependencies carried as .deb files -----------------------------------------------------
# A machine without apt (the lent GPU machine): tests/gpu/fetch_debs.sh fetched the packages
# elsewhere into .debs (carried along); unpacked into build/gpu-deps, with pkg-config, CMake and
# the loader pointed there. Without .debs the machine's own packages are used.
DEBS=${ASTERIA_GPU_DEBS:-$ROOT/.debs}
DEPS_PREFIX=""
# shellcheck source=tests/gpu/deps_prefix.sh
. "$ROOT/tests/gpu/deps_prefix.sh"
if asteria_deps_prefix "$DEBS" "$ROOT/build/gpu-deps"; then
  DEPS_PREFIX=$ROOT/build/gpu-deps
  say "dependencies: $(ls "$DEBS"/*.deb "$DEBS"/fallback/*.deb 2>/dev/null | wc -l) packages from $DEBS unpacked into build/gpu-deps"
  note deps-prefix ok "$DEBS -> build/gpu-deps"
else
  note deps-prefix skipped "no .deb files in $DEBS: the machine's own packages"
fi

# ---- 1. dependencies ---------------------------------------------------------------------------
have_tool() { command -v "$1" >/dev/null 2>&1; }
CC_BIN=$(command -v cc || command -v gcc || true)
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
    CAN_BUILD=0; WHY_NOT+="cmake $CMAKE_V < 3.25; "
  fi
fi
for lib in openblas lapacke; do
  [ "${HAVE[$lib]}" = 1 ] || { CAN_BUILD=0; WHY_NOT+="$lib MISSING (libasteria requires OpenBLAS and LAPACKE: apt libopenblas-dev liblapacke-dev); "; }
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
[ "${HAVE[liburing]}" = 1 ] || { CMAKE_FLAGS+=(-DASTERIA_WITH_URING=OFF); say "skipped: NVMe tier (no liburing): -DASTERIA_WITH_URING=OFF"; note nvme-tier skipped "no liburing"; }
[ "${HAVE[hwloc]}" = 1 ] || { CMAKE_FLAGS+=(-DASTERIA_WITH_HWLOC=OFF); say "skipped: worker pinning (no hwloc): -DASTERIA_WITH_HWLOC=OFF"; note hwloc skipped "no hwloc"; }
WITH_TESTS=1
if [ "${HAVE[cmocka]}" = 0 ]; then
  WITH_TESTS=0
  say "skipped: all C tests, ctest -L gpu included (test_cuda_mem, test_shadow_cuda): they need CMocka"
  note c-tests skipped "no CMocka"
fi
if [ $WITH_TESTS = 1 ]; then CMAKE_FLAGS+=(-DASTERIA_BUILD_TESTS=ON); else CMAKE_FLAGS+=(-DASTERIA_BUILD_TESTS=OFF); fi

NVCC=$(command -v nvcc || true)
for c in "${CUDA_HOME:-}" /usr/local/cuda; do
  [ -z "$NVCC" ] && [ -n "$c" ] && [ -x "$c/bin/nvcc" ] && NVCC=$c/bin/nvcc
done
if [ -n "$NVCC" ]; then
  CUDA_ROOT=$(dirname "$(dirname "$NVCC")")
  say "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"
  CMAKE_FLAGS+=(-DASTERIA_WITH_CUDA=ON "-DCUDAToolkit_ROOT=$CUDA_ROOT")
else
  CMAKE_FLAGS+=(-DASTERIA_WITH_CUDA=OFF)
  say "no nvcc: building WITHOUT CUDA; the CUDA C tests will skip"
  note cuda-build skipped "no nvcc"
fi
GEN=()
have_tool ninja && GEN=(-G Ninja)

# ---- 2. build ----------------------------------------------------------------------------------
PYPATH=""
if [ $CAN_BUILD = 0 ]; then
  say "CANNOT BUILD libasteria: $WHY_NOT"
  say "running only the torch-only parts (GPU check, AdamW in the benchmark)"
  note build failed "$WHY_NOT"
  FAILED=1
else
  rm -rf "$BUILD"  # a cache from other flags (generator, features) must not get in the way
  # Only libasteria and the gpu-labelled tests: a CPU test that does not compile (work in
  # progress elsewhere) must not stop the GPU check.
  if run cmake-configure 120 cmake -S "$ROOT" -B "$BUILD" "${GEN[@]}" "${CMAKE_FLAGS[@]}" \
     && run build-libasteria 240 cmake --build "$BUILD" --target asteria -j"$JOBS"; then
    note build-libasteria ok "$(printf '%s ' "${CMAKE_FLAGS[@]}")"
  else
    note build-libasteria failed "see $LOGS/cmake-configure.log, build-libasteria.log"
    FAILED=1
    CAN_BUILD=0
  fi
fi
GPU_TESTS=()
if [ $CAN_BUILD = 1 ] && [ $WITH_TESTS = 1 ]; then
  mapfile -t GPU_TESTS < <(ctest --test-dir "$BUILD" -L gpu -N | sed -n 's/^ *Test *#[0-9]*: *//p')
  say "CUDA C tests: ${GPU_TESTS[*]:-none}"
  if [ ${#GPU_TESTS[@]} -gt 0 ] && run build-gpu-tests 240 cmake --build "$BUILD" --target "${GPU_TESTS[@]}" -j"$JOBS"; then
    note build-gpu-tests ok "${GPU_TESTS[*]}"
  else
    note build-gpu-tests failed "see $LOGS/build-gpu-tests.log"
    FAILED=1
    WITH_TESTS=0
  fi
fi

if [ $CAN_BUILD = 1 ]; then
  PIP_DEFS=()
  for f in "${CMAKE_FLAGS[@]}"; do
    case $f in -DASTERIA_WITH_*|-DCUDAToolkit_ROOT=*|-DDLPACK_INCLUDE_DIR=*) f=${f#-D}; PIP_DEFS+=("--config-settings=cmake.define.${f%%=*}=${f#*=}");; esac
  done
  rm -rf "$PYTARGET"
  if run pip-install 240 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
       --target "$PYTARGET" --config-settings=build-dir="$ROOT/build/gpu-wheel" "${PIP_DEFS[@]}" "$ROOT"; then
    PYPATH=$PYTARGET
    note python-package ok "pip install --target build/gpu-py"
  else
    say "pip install failed (offline, or no scikit-build-core): building asteria._C with CMake instead"
    if run devpy-configure 120 cmake -S "$ROOT" -B "$ROOT/build/gpu-devpy" "${GEN[@]}" "${CMAKE_FLAGS[@]}" \
         -DASTERIA_BUILD_TESTS=OFF -DASTERIA_BUILD_PYTHON=ON \
       && run devpy-build 240 cmake --build "$ROOT/build/gpu-devpy" --target _C -j"$JOBS"; then
      PYPATH=$ROOT/python
      note python-package ok "pip failed; CMake dev build of _C, PYTHONPATH=python"
    else
      note python-package failed "pip and the CMake dev build both failed"
      FAILED=1
    fi
  fi
fi
if [ -n "$PYPATH" ]; then
  export PYTHONPATH=$PYPATH${PYTHONPATH:+:$PYTHONPATH}
  (cd /tmp && "$PY" -c "import asteria, asteria._C; print('    asteria', asteria.__version__, 'from', asteria.__file__)") \
    || { say "FAILED: the built asteria does not import"; note python-import failed ""; FAILED=1; }
fi

# ---- 3. is there a GPU? ------------------------------------------------------------------------
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() and torch.cuda.device_count() > 0 else 1)"; then
  say "no GPU: torch sees no CUDA device; skipping ctest -L gpu and the GPU benchmark"
  note gpu skipped "no GPU"
  [ $FAILED = 0 ] && finish 77
  say "(exit 1, not 77: an earlier step failed)"
  finish 1
fi
GPU_NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0))")
say "GPU: $GPU_NAME"
note gpu found "$GPU_NAME"

# ---- 4. CUDA C tests ---------------------------------------------------------------------------
if [ $CAN_BUILD = 1 ] && [ $WITH_TESTS = 1 ]; then
  if run ctest-gpu 180 ctest --test-dir "$BUILD" -L gpu --output-on-failure --timeout 150 -j2; then
    note ctest-gpu ok "$(grep -E 'tests passed|Not Run|Skipped' "$LOGS/ctest-gpu.log" | tr '\n' ' ')"
  else
    note ctest-gpu failed "see $LOGS/ctest-gpu.log"
    FAILED=1
  fi
  grep -E "Passed|Failed|Not Run|Skipped|tests passed" "$LOGS/ctest-gpu.log" | sed 's/^/    /'
else
  say "skipped: ctest -L gpu (C tests not built)"
  note ctest-gpu skipped "not built"
fi

# ---- 5. step-time benchmark --------------------------------------------------------------------
# What is left (less 45 s for the summary and teardown) is shared: the convergence stage (6)
# gets 60%, at most 200 s; the step-time benchmark the rest, at most 210 s.
# (the capacity stage (7) keeps CAP_SHARE seconds of its own)
CAP_SHARE=100
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
if [ "$BENCH_TOTAL" -lt 60 ]; then
  say "skipped: GPU benchmark ($(left)s left of the global ${TOTAL_S}s)"
  note gpu-bench skipped "out of time"
  FAILED=1
else
  say "GPU benchmark: ${BENCH_TOTAL}s budget (progress below)"
  BENCH_ARGS=(--total-budget-s "$BENCH_TOTAL" --out "$RESULTS/gpu_bench.json" "${BENCH_ARGS_COMMON[@]}")
  timeout -k 5 $((BENCH_TOTAL + 30)) "$PY" "$ROOT/benchmarks/gpu_bench.py" "${BENCH_ARGS[@]}" 2>&1 \
    | tee "$LOGS/gpu-bench.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    note gpu-bench ok "$RESULTS/gpu_bench.json"
  else
    say "GPU benchmark: FAILED (exit $rc)"
    note gpu-bench failed "exit $rc"
    FAILED=1
  fi
fi

# ---- 6. convergence in the users' regime ---------------------------------------------------------
CONV_TOTAL=$(($(left) - 40 - CAP_SHARE))
[ "$CONV_TOTAL" -gt 200 ] && CONV_TOTAL=200
if [ "$CONV_TOTAL" -lt 90 ]; then
  say "skipped: GPU convergence comparison ($(left)s left of the global ${TOTAL_S}s)"
  note gpu-convergence skipped "out of time"
  FAILED=1
else
  say "GPU convergence comparison (users' regime, 65,536 tokens a step): ${CONV_TOTAL}s budget"
  CONV_ARGS=(--convergence --total-budget-s "$CONV_TOTAL" --out "$RESULTS/gpu_convergence.json"
             "${BENCH_ARGS_COMMON[@]}")
  timeout -k 5 $((CONV_TOTAL + 30)) "$PY" "$ROOT/benchmarks/gpu_bench.py" "${CONV_ARGS[@]}" 2>&1 \
    | tee "$LOGS/gpu-convergence.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    note gpu-convergence ok "$RESULTS/gpu_convergence.json"
  else
    say "GPU convergence comparison: FAILED (exit $rc)"
    note gpu-convergence failed "exit $rc"
    FAILED=1
  fi
fi

# ---- 7. capacity: REFRESH rounds host-only vs host + device executor ---------------------------
CAP_TOTAL=$(($(left) - 25))
[ "$CAP_TOTAL" -gt 150 ] && CAP_TOTAL=150
if [ -z "$PYPATH" ] || [ "$CAP_TOTAL" -lt 60 ]; then
  say "skipped: capacity stage ($(left)s left of the global ${TOTAL_S}s, or Asteria not built)"
  note capacity-stage skipped "out of time or not built"
else
  say "capacity stage (host-only vs hybrid round time, install waits): ${CAP_TOTAL}s budget"
  OUT=$RESULTS ASTERIA_CAPACITY_BUDGET_S=$CAP_TOTAL timeout -k 5 $((CAP_TOTAL + 20)) \
    bash "$ROOT/tests/gpu/capacity_stage.sh" 2>&1 | tee "$LOGS/capacity-stage.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    note capacity-stage ok "$RESULTS/capacity_stage.json"
  else
    say "capacity stage: FAILED (exit $rc)"
    note capacity-stage failed "exit $rc"
    FAILED=1
  fi
fi

finish $FAILED
