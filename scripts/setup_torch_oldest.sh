#!/usr/bin/env bash
# The environment for the Python suite against the oldest supported torch (the lower bound of the
# range in pyproject.toml): a fresh virtual environment, .venv-torch-oldest (gitignored; or
# $ASTERIA_OLDEST_VENV), without the system's site-packages, with exactly that torch, then set up
# by scripts/setup.sh like the main one: the tools, the optional packages that fit that torch, and
# asteria by a plain `pip install .`. Kept between runs in the same checkout (then about 15 s);
# a fresh one costs the download and unpacking of torch and its nvidia-* CUDA libraries (6.6 GB
# installed; 2.5-4 minutes on the 2-core development VM, where pip's cache kept none of them).
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
