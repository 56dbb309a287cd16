#!/usr/bin/env bash
# Sets everything up, then runs the demo: a daemon in a temporary state directory, a tiny
# Qwen2 LoRA fine-tune started, followed, stopped with a snapshot, resumed and finished, a
# second job cancelled, and the run list.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
