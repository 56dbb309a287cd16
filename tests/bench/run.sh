#!/usr/bin/env bash
# Runs every benchmark and prints its figures (one command; takes a few minutes).
set -uo pipefail
cd "$(dirname "$0")/../.."
bash scripts/setup.sh
PY=.venv/bin/python
for b in tests/bench/bench_*.py; do
    echo "== $b"
    if grep -q "^pytestmark" "$b"; then  # a benchmark that is a pytest test (its fixtures: a daemon, users)
        "$PY" -m pytest -m bench -s -q -p no:cacheprovider "$b" || echo "(benchmark $b failed with exit $?)"
    else
        "$PY" "$b" || echo "(benchmark $b failed with exit $?)"
    fi
done
