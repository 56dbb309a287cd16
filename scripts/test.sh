#!/usr/bin/env bash
# Sets everything up, then checks the code (ruff lint and format, mypy) and runs the test suite
# (slow, GPU and benchmark checks are skipped; run them with: .venv/bin/python -m pytest -m slow,
# or tests/bench/run.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "test: ruff check, ruff format --check, mypy"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -q "$@"
