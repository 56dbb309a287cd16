#!/usr/bin/env bash
# Sets everything up, then runs the test suite (slow, GPU and benchmark checks are skipped;
# run them with: .venv/bin/python -m pytest -m slow, or tests/bench/run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
