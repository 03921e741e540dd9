#!/usr/bin/env bash
# One-time (idempotent) setup of a fresh Debian 12 machine for Asteria: system libraries from
# Debian's packages, then one Python environment (PYTHON, default python3): a supported torch,
# the Python tools, the optional third-party packages that fit that torch, and the asteria
# package itself (libasteria and asteria._C built by scikit-build-core from the same CMake tree).
#
# torch: one already installed in the supported range (pyproject.toml) is kept as it is; with
# none, or one outside the range, torch $TORCH_DEFAULT is installed (a multi-GB CUDA build from
# PyPI that also runs on the CPU). Nothing after that may change it: every later pip call gets
# it as a constraint.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_DEFAULT=2.11.0
APT_PKGS=(build-essential cmake ninja-build pkg-config libopenblas-dev liblapacke-dev liburing-dev
          libhwloc-dev libcmocka-dev python3-venv libdlpack-dev)
# Optional packages used by some tests, benchmarks and examples, each with the torch range its own
# metadata requires. Where the torch in use is outside it, the package is left out and the tests
# that need it skip, saying why (the oldest-torch run of scripts/run_tests.sh has no OLMo-core).
# The training frameworks of tests/python/test_clients.py: transformers 5.24.0 is the newest
# whose huggingface_hub requirement (>=1.31,<3) admits the <2 of OLMo-core 3.0.0 (through
# cached-path); 5.25.0 needs huggingface_hub>=2.4. All of them are installed in one pip call,
# so pip resolves them together.
OPTIONAL_PKGS=("ai2-olmo-core==3.0.0 >=2.10,<2.14"
               "pytorch-optimizer==4.1.0 >=2.1"
               "heavyball==3.2.1 >=2.2"
               "transformers==5.24.0 >=2.6"
               "accelerate==1.16.0 >=2.6"
               "lightning==2.6.6 >=2.1,<4.0")

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

RANGE=$("$PY" scripts/torch_range.py range)
if ! "$PY" scripts/torch_range.py check; then
  have=$("$PY" scripts/torch_range.py installed || true)
  echo "[setup] torch ${have:-(none)} is not in the supported range $RANGE:" \
       "pip install torch==$TORCH_DEFAULT (large)"
  "$PY" -m pip install -q "torch==$TORCH_DEFAULT"
fi
TORCH=$("$PY" scripts/torch_range.py installed)
echo "[setup] torch $TORCH ($("$PY" -c 'import sys; print(sys.prefix)'))"

pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
echo "torch==$TORCH" >"$pin"
fitting=()
for entry in "${OPTIONAL_PKGS[@]}"; do
  pkg=${entry% *} needs=${entry#* }
  if "$PY" scripts/torch_range.py check "$needs"; then
    fitting+=("$pkg")
  else
    echo "[setup] leaving out $pkg: it needs torch$needs, this environment has torch $TORCH"
  fi
done
"$PY" -m pip install -q -r requirements-dev.txt "${fitting[@]}" -c "$pin"

# A plain install, as a user would run it: pip keeps the supported torch that is there, and builds
# in an isolated environment with scikit-build-core from PyPI.
echo "[setup] pip install . (libasteria + asteria._C)"
"$PY" -m pip install -q .
"$PY" -c "import asteria, asteria._C; print('[setup] asteria', asteria.__version__, 'ready')"
