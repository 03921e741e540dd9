#!/usr/bin/env bash
# Fetch, here, the build tools the GPU check installs on a machine that lacks them and has no
# package index (the lent GPU machine): cmake >= 3.25 (CMakeLists.txt's minimum), ninja and
# scikit-build-core with what it imports, as wheels for every CPython the package supports
# (pyproject.toml: >= 3.10), since the machine's python is not known here. tests/gpu/run.sh
# installs the ones the machine lacks from them, offline (deps_prefix.sh:
# asteria_tools_prefix: pip install --no-index --find-links DIR --target build/gpu-tools).
# Also nvidia-ml-py (pure Python, module pynvml) for the train-f1 stage's GPU energy readings
# (deps_prefix.sh: asteria_nvml_prefix, into build/gpu-nvml).
#
#   bash tests/gpu/fetch_wheels.sh [DIR]     # default DIR: .wheels in the repository root
#
# .wheels is in .gitignore: it travels to the GPU machine only when named in the device tool's
# `carry` (with .debs: tests/gpu/fetch_debs.sh). Needs pip and the package index; about 30 MB
# (the cmake wheel is most of it; the others are pure Python or one binary).
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-.wheels}
PY=${PYTHON:-python3}
TOOLS=("cmake>=3.25" ninja "scikit-build-core>=0.10")

mkdir -p "$DIR"
rm -f "$DIR"/*.whl
for v in 3.10 3.11 3.12 3.13 3.14; do
  # scikit-build-core's requirements for python < 3.11, named: pip evaluates the markers of a
  # download against the python it runs on, not --python-version
  extra=()
  [ "$v" = 3.10 ] && extra=(exceptiongroup tomli typing-extensions)
  # binary wheels only, for the manylinux x86_64 tag any glibc >= 2.17 machine takes
  "$PY" -m pip download --quiet --dest "$DIR" --only-binary=:all: --implementation cp \
    --python-version "$v" --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "${TOOLS[@]}" "${extra[@]}"
done
# one py3-none-any wheel serves every python
"$PY" -m pip download --quiet --dest "$DIR" --only-binary=:all: --no-deps nvidia-ml-py
echo "fetched $(ls "$DIR"/*.whl | wc -l) wheels into $DIR ($(du -sh "$DIR" | cut -f1)):"
ls "$DIR" | sed 's/^/    /'
