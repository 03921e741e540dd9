#!/usr/bin/env bash
# Sets everything up, then runs the main job: the tiny-LM training comparison (AdamW vs the
# Asteria optimizers) on the bundled Tiny Shakespeare corpus, printing a table and writing a PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python3 examples/train_tiny.py "$@"
