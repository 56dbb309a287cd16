#!/usr/bin/env bash
# Sets everything up, then checks the code (ruff lint and format, mypy) and runs the test suite
# (slow, GPU and benchmark checks are skipped; run them with: .venv/bin/python -m pytest -m slow,
# or tests/bench/run.sh), three test files at a time (pytest-xdist).
#
# --fast: the unit tests only (tests/unit_tests.txt: no process, no server; tests/speed.py), two
# workers, no lint: the inner loop while changing code. The full command is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [[ "${1:-}" == "--fast" ]]; then
    shift
    exec .venv/bin/python -m pytest -q -n "${OBD_TEST_WORKERS:-2}" -m "unit and not slow and not gpu and not bench" "$@"
fi
echo "test: ruff check, ruff format --check, mypy, lint-imports (the layer contracts in pyproject.toml)"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/lint-imports --no-cache
# Three workers, each test file on one of them (its module fixtures, a Slurm cluster or an sshd,
# stay in one process): most tests wait on real processes, so three keep two cores busy.
# OBD_TEST_WORKERS=0 runs the suite in this process. The 20 slowest tests are named at the end:
# where the suite's time goes.
exec .venv/bin/python -m pytest -q -n "${OBD_TEST_WORKERS:-3}" --dist loadfile --durations=20 "$@"
