#!/usr/bin/env bash
# Sets everything up, then runs the main job (examples/main_job.py): three answers, each a part,
# printing a table per part and writing examples/out/main.json and main.png (one panel per part).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 examples/main_job.py "$@"
