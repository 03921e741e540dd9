#!/usr/bin/env bash
# One-time (idempotent) setup of a fresh Debian 12 machine for Asteria: system libraries from
# Debian's packages, Python dependencies from PyPI (torch is pinned and large: installed once
# per machine, skipped when already there), then the asteria package itself (libasteria and
# asteria._C built by scikit-build-core from the same CMake tree).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
APT_PKGS=(build-essential cmake ninja-build pkg-config libopenblas-dev liblapacke-dev liburing-dev
          libhwloc-dev libcmocka-dev zlib1g-dev)

missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[setup] apt-get install ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

TORCH_VERSION=2.11.0
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "[setup] pip install torch==$TORCH_VERSION (large, once per machine)"
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
fi
"$PY" -m pip install -q -r requirements-dev.txt

echo "[setup] pip install asteria (libasteria + asteria._C)"
"$PY" -m pip install -q --no-build-isolation --no-deps .
"$PY" -c "import asteria, asteria._C; print('[setup] asteria', asteria.__version__, 'ready')"
