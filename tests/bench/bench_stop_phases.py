"""How long a stop takes, by where the job's time goes (issue 32): request → proof, with the save apart.

    python tests/bench/bench_stop_phases.py [--reps 2] [--json] [--phase NAME ...]

Each case runs the real Trainer script tests/trainer_plugin/scripts/phases_trainer.py in a run
directory laid out as obd lays it out (the plugin on PYTHONPATH, no daemon), waits for the phase
to begin (the script's own line), writes `snapshot.request`, and times:
- `request_to_proof_s`: from the request's write to `snapshot.json` on disk;
- `save_s`: the Trainer's checkpoint save inside it (the plugin's `save` line);
- `to_safe_point_s`: the rest, what reaching a safe point cost;
- for a stop after train(): request → the plugin's `after_train` line that names what it cuts short.
Phases: `step end` (short steps, the path every stop took before), `evaluating` (an evaluation of
0.3 s a sample), `accumulating` (20 forward passes of 0.2 s each), `stalled fetch` (a sample that never
returns), `after train`, `evaluating, 2 ranks` (torchrun, gloo: rank 0 slow in an evaluation
batch while rank 1 waits in its gather), and `accumulating, 2 ranks` (both ranks 1 s into a step of
20 slow forward passes, where they must agree on one micro-batch). Before this work the last four waited for the whole evaluation, the whole
step, the stall's end, or `proof_timeout`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.trainer_plugin.conftest import RunDir, read_jsonl

SCRIPT = str(REPO / "tests" / "trainer_plugin" / "scripts" / "phases_trainer.py")
BASE = ["--max_steps", "40", "--accumulation", "20", "--eval_steps", "5"]


PHASES = (
    "step end",
    "evaluating",
    "accumulating",
    "stalled fetch",
    "after train",
    "evaluating, 2 ranks",
    "accumulating, 2 ranks",
)


def _case(name: str, root: Path) -> dict[str, Any]:
    run = RunDir(root)
    flag = root / "flag"
    args, line = {
        "step end": ([], "{'loss'"),
        "evaluating": (["--slow-eval", str(flag)], "slow evaluation began"),
        "accumulating": (["--slow-forward", str(flag)], "slow forward passes began"),
        "stalled fetch": (["--stall-fetch", str(20 * 2 * 3 + 7), "--stall-file", str(flag)], "stalled in sample"),
        "after train": (["--max_steps", "3", "--after-train", "600"], "after-train code began"),
        # Two gloo ranks: rank 0 slow in an evaluation batch, rank 1 waiting in its gather (agreement.py).
        "evaluating, 2 ranks": (["--slow-eval", str(flag), "--slow-rank", "0"], "slow evaluation began"),
        # Two gloo ranks inside one step's 20 slow forward passes (slow from step 3: the script makes
        # the flag at step 2's end), where no collective holds them together: they agree on a micro-batch.
        "accumulating, 2 ranks": (
            ["--slow-forward", str(flag), "--slow-from-step", "2", "--say-steps"],
            "step 3 ended",
        ),
    }[name]
    launch = [sys.executable]
    if name.endswith("2 ranks"):
        launch += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    if not name.startswith("accumulating"):
        flag.write_text("")
    with open(run.log, "wb") as log:
        proc = subprocess.Popen(
            [*launch, SCRIPT, *BASE, *args], env=run.env(), cwd=root, stdout=log, stderr=log, start_new_session=True
        )
        try:
            while line not in run.log.read_text(errors="replace"):
                if name == "accumulating" and not flag.exists() and run.log.read_text().count("{'loss'") >= 2:
                    flag.write_text("")
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: the job ended first:\n{run.log.read_text()[-2000:]}")
                time.sleep(0.02)
            if name != "step end":
                time.sleep(1.0)  # well inside the phase
            asked = time.time()
            run.request.write_text("requested")
            if name == "after train":
                while not any(x.get("cut") for x in read_jsonl(run.metrics_path)):
                    time.sleep(0.01)
                said = next(x for x in read_jsonl(run.metrics_path) if x.get("cut"))
                return {"phase": name, "request_to_word_s": round(said["time"] - asked, 3)}
            while not run.proof_path.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: ended with no proof:\n{run.log.read_text()[-2000:]}")
                time.sleep(0.005)
            proved = run.proof_path.stat().st_mtime
            save = next(x for x in reversed(read_jsonl(run.metrics_path)) if x["event"] == "save")
            total = proved - asked
            return {
                "phase": name,
                "request_to_proof_s": round(total, 3),
                "save_s": save["seconds"],
                "to_safe_point_s": round(max(0.0, total - save["seconds"]), 3),
            }
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks too
            proc.wait()


def measure(reps: int, phases: tuple[str, ...] = PHASES) -> list[dict[str, Any]]:
    rows = []
    for name in phases:
        runs = []
        for _ in range(reps):
            with tempfile.TemporaryDirectory(prefix="obd-bench-stop-") as tmp:
                runs.append(_case(name, Path(tmp)))
        row: dict[str, Any] = {"phase": name}
        for key in runs[0]:
            if key != "phase":
                row[key] = statistics.median(r[key] for r in runs)
        rows.append(row)
    return rows


@pytest.mark.bench
def test_bench_stop_by_phase() -> None:
    for row in measure(1):
        print(row)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--json", action="store_true")
    p.add_argument("--phase", action="append", choices=PHASES, help="only this phase (repeatable)")
    opts = p.parse_args()
    rows = measure(opts.reps, tuple(opts.phase or PHASES))
    if opts.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'phase':<20} {'request→proof':>14} {'save':>8} {'to safe point':>14}")
    for r in rows:
        if "request_to_word_s" in r:
            print(
                f"{r['phase']:<20} {'-':>14} {'-':>8} {r['request_to_word_s']:>13.2f}s (request → the after-train word)"
            )
        else:
            print(
                f"{r['phase']:<20} {r['request_to_proof_s']:>13.2f}s {r['save_s']:>7.3f}s {r['to_safe_point_s']:>13.2f}s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
