#!/usr/bin/env bash
# Sets everything up, then runs every test: the C suite (CMocka via ctest) in a normal build, an
# ASan+UBSan build and a TSan build, then the Python suite (pytest, real torch) against the
# installed package. GPU tests report "skip" (exit 77) on machines without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
JOBS=$(nproc)

run_c_suite() {  # name, extra cmake args...
  local dir=build/ci-$1; shift
  cmake -S . -B "$dir" -DASTERIA_WERROR=ON "$@" >/dev/null
  cmake --build "$dir" -j"$JOBS" >/dev/null
  (cd "$dir" && ctest --output-on-failure -j"$JOBS")
}

echo "== C tests (release) =="
run_c_suite release -DCMAKE_BUILD_TYPE=RelWithDebInfo
echo "== C tests (ASan+UBSan) =="
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  run_c_suite asan -DCMAKE_BUILD_TYPE=Debug -DASTERIA_SANITIZE=address,undefined
echo "== C tests (TSan) =="
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$PWD/tests/c/tsan.supp" \
  run_c_suite tsan -DCMAKE_BUILD_TYPE=Debug -DASTERIA_SANITIZE=thread

echo "== Python tests =="
# Run from tests/ so the installed package (not the source tree) is what gets imported.
cd tests && python3 -m pytest python -q -p no:cacheprovider
