#!/usr/bin/env bash
# The environment for the Python suite against the oldest supported torch (the lower bound of the
# range in pyproject.toml): a fresh virtual environment, .venv-torch-oldest (gitignored; or
# $ASTERIA_OLDEST_VENV), without the system's site-packages, with exactly that torch, then set up
# by scripts/setup.sh like the main one: the tools, the optional packages that fit that torch, and
# asteria by a plain `pip install .`. Kept between runs in the same checkout; a fresh one costs
# the torch download and unpacking (about 3.5 GB with its nvidia-* CUDA libraries, 1-2.5 minutes
# here; pip's cache does not keep them from this registry).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${ASTERIA_OLDEST_VENV:-.venv-torch-oldest}
OLDEST=$("$PY" scripts/torch_range.py oldest)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$("$VENV/bin/python" scripts/torch_range.py installed || true)" != "$OLDEST" ]; then
  echo "[setup] $VENV: pip install torch==$OLDEST (large)"
  "$VENV/bin/python" -m pip install -q "torch==$OLDEST"
fi
PYTHON="$VENV/bin/python" bash scripts/setup.sh
