#!/usr/bin/env bash
# The GPU check (issue 28, docs/gpu-check.md) in one command: set up on a bare GPU machine, run the
# GPU tests and the GPU benchmarks, print a summary table.
#
#   bash scripts/gpu_check.sh                  # on the GPU machine (commands run as root there)
#   bash scripts/gpu_check.sh --fetch-wheels   # beforehand, on a machine with a package index: the
#                                              # wheels of obd's own dependencies for the GPU machine
#
# The GPU machine's python3 brings torch, transformers, peft and pytest; nothing is downloaded
# there (it reaches no network) and no model is: the workload builds a Qwen2 from a config. obd's
# daemon needs pydantic, anyio and structlog beside them: found, else installed into $OBD_GPU_SITE
# (default /tmp/obd-gpu-site, put on PYTHONPATH) from tests/gpu/wheels/, else from a package index.
#
# With $OUT set (the device tool's folder of files that come back), the whole output is also written
# to $OUT/gpu-check.log, the summary to $OUT/gpu-check.md, every figure and outcome to
# $OUT/gpu-check.json and the profiled run's RunMetrics to $OUT/run-metrics.json.
#
# Environment: OBD_GPU_PYTHON (the Python to use; default: the first of python3 and .venv/bin/python
# that imports torch), OBD_GPU_SITE, OBD_GPU_CHECK_LIMIT (seconds the tests may take, default 420),
# OBD_GPU_BENCH_PAIRS / OBD_GPU_BENCH_STEPS (the plugin benchmark's runs), OBD_GPU_CHECK_DRY_RUN=1
# (run every check on the CPU with a tiny model: a test of the harness, not of a GPU).
#
# Exit status:
#   0   every check passed (a check that cannot apply here, DDP on one GPU, is skipped and says why)
#   1   a check failed (the summary says which and why)
#   3   setup failed: no Python 3.11+ with pytest, or obd's dependencies could not be installed
#   77  no CUDA/ROCm device here: setup done, nothing to check (77 is the usual "skipped" code)
#   124 the checks ran past OBD_GPU_CHECK_LIMIT (the summary shows what finished)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
REPO=$(pwd)
export PYTHONUNBUFFERED=1

NO_DEVICE=77
SETUP_FAILED=3

say() { printf 'gpu_check: %s\n' "$*"; }

# The Python that runs obd, the tests and the jobs: one that imports torch if there is one.
pick_python() {
    local candidate
    local -a candidates=("${OBD_GPU_PYTHON:-}" python3 "$REPO/.venv/bin/python")
    for candidate in "${candidates[@]}"; do
        [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 || continue
        "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || continue
        if "$candidate" -c 'import torch' >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    # None imports torch: the first that runs, so the probe can say what is missing.
    for candidate in "${candidates[@]}"; do
        if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null 2>&1 \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

summary() {  # summary RESULTS NOTE [summary.py options]
    "$PY" tests/gpu/summary.py "$1" --machine "$MACHINE" --note "$2" "${@:3}" \
        --markdown "$REPORT_DIR/gpu-check.md" --json "$REPORT_DIR/gpu-check.json"
}

main() {
    local started=$SECONDS
    if [[ "${1:-}" == "--fetch-wheels" ]]; then
        local py="$REPO/.venv/bin/python"
        [[ -x "$py" ]] || py=python3
        exec "$py" tests/gpu/prepare.py fetch-wheels "${@:2}"
    fi
    WORK=$(mktemp -d /tmp/obd-gpu-check.XXXXXX) || exit "$SETUP_FAILED"
    REPORT_DIR=${OUT:-$WORK}
    mkdir -p "$REPORT_DIR"
    RESULTS="$WORK/results.jsonl"
    : >"$RESULTS"
    MACHINE="(machine not probed)"
    say "repository $REPO at $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); work folder $WORK; $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    say "host: $(uname -srm), $(nproc) cores, user $(id -un)"

    # --- setup ---------------------------------------------------------------------------
    if ! PY=$(pick_python); then
        say "setup FAILED: no Python 3.11 or newer found (tried \$OBD_GPU_PYTHON, python3, .venv/bin/python)"
        return "$SETUP_FAILED"
    fi
    say "python: $PY ($("$PY" -c 'import sys; print(sys.version.split()[0])'))"
    if ! "$PY" -c 'import pytest' 2>/dev/null; then
        say "setup FAILED: $PY cannot import pytest (the GPU machine's python3 has it; elsewhere: scripts/setup.sh)"
        return "$SETUP_FAILED"
    fi
    local site=${OBD_GPU_SITE:-/tmp/obd-gpu-site}
    "$PY" tests/gpu/prepare.py deps --python "$PY" --site "$site" || return "$SETUP_FAILED"
    export PYTHONPATH="$REPO:$site${PYTHONPATH:+:$PYTHONPATH}"
    export OBD_GPU_PYTHON="$PY" OBD_GPU_RESULTS="$RESULTS" OBD_GPU_ARTIFACTS="$REPORT_DIR"
    if ! "$PY" -c 'import daemon.service, runner.assemble, tests.gpu.harness' 2>"$WORK/import.err"; then
        say "setup FAILED: obd does not import with PYTHONPATH=$PYTHONPATH:"
        cat "$WORK/import.err"
        return "$SETUP_FAILED"
    fi
    say "obd imports: $("$PY" -m daemon.cli --version 2>&1 | head -1)"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 | sed 's/^/gpu_check: nvidia-smi: /'
    fi
    "$PY" tests/gpu/prepare.py probe --json "$WORK/probe.json"
    local probed=$?
    MACHINE=$("$PY" - "$WORK/probe.json" <<'EOF'
import json, subprocess, sys
try:
    t = json.load(open(sys.argv[1]))["torch"]
except Exception:
    t = {}
names = ", ".join(t.get("names") or []) or "no GPU"
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=20).stdout.split()[0]
except Exception:
    driver = None
print(f"GPUs: {names}" + (f" (driver {driver})" if driver else "") + f"; Python {t.get('python')}, torch "
      f"{t.get('torch')} (CUDA {t.get('cuda')}, HIP {t.get('hip')}), transformers {t.get('transformers')}, peft {t.get('peft')}.")
EOF
)
    say "setup done in $((SECONDS - started)) s; $MACHINE"
    if [[ $probed -eq $NO_DEVICE && "${OBD_GPU_CHECK_DRY_RUN:-}" != 1 ]]; then
        say "no GPU present: no CUDA/ROCm device here (see the probe above), so nothing was checked."
        say "on a GPU machine this runs the checks; exit $NO_DEVICE means: set up, no device, nothing to check"
        summary "$RESULTS" "No CUDA/ROCm device on this machine: setup ran, no check did." \
            --not-run "no CUDA/ROCm device on this machine"
        return "$NO_DEVICE"
    elif [[ $probed -ne 0 && $probed -ne $NO_DEVICE ]]; then
        say "setup FAILED: the device probe failed (exit $probed)"
        return "$SETUP_FAILED"
    fi

    # --- the checks ----------------------------------------------------------------------
    local limit=${OBD_GPU_CHECK_LIMIT:-420}
    say "running the GPU tests and benchmarks (at most $limit s)"
    # Most telling first: if the limit cuts the run short, what is lost is the end.
    local -a files=(
        tests/gpu/test_discovery.py
        tests/gpu/test_stop_resume.py
        tests/gpu/test_profile.py
        tests/bench/bench_gpu_plugin.py
        tests/gpu/test_ddp.py
    )
    timeout -k 20 "$limit" "$PY" -m pytest -m gpu -p tests.gpu.report -p no:cacheprovider \
        -W ignore::pytest.PytestConfigWarning -rA --durations=0 -q "${files[@]}"
    local tested=$?
    say "the checks took $((SECONDS - started)) s in all (pytest exit $tested)"

    # --- the summary ---------------------------------------------------------------------
    local note=""
    if [[ $tested -eq 124 || $tested -eq 137 ]]; then
        note="The checks ran past their limit of $limit s and were stopped: a check marked 'not run' did not finish."
    fi
    [[ "${OBD_GPU_CHECK_DRY_RUN:-}" == 1 ]] && note="DRY RUN on the CPU with a tiny model: these are no GPU figures. $note"
    echo
    summary "$RESULTS" "$note"
    local summarised=$?
    say "summary written to $REPORT_DIR/gpu-check.md (figures and outcomes: $REPORT_DIR/gpu-check.json)"
    if [[ $tested -eq 124 || $tested -eq 137 ]]; then
        return 124
    fi
    if [[ $tested -ne 0 || $summarised -ne 0 ]]; then
        return 1
    fi
    return 0
}

if [[ -n "${OUT:-}" && "${1:-}" != "--fetch-wheels" ]]; then
    mkdir -p "$OUT"
    main "$@" 2>&1 | tee -a "$OUT/gpu-check.log"
    exit "${PIPESTATUS[0]}"
fi
main "$@"
