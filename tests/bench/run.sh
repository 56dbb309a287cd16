#!/usr/bin/env bash
# Runs every benchmark and prints its figures (one command; takes a few minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
PY=.venv/bin/python
for b in tests/bench/bench_*.py; do
    echo "== $b"
    "$PY" "$b" || echo "(benchmark $b failed with exit $?)"
done
