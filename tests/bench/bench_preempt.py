"""Preemption's own cost (issue 25); prints the figures.

    python tests/bench/bench_preempt.py [--preemptions 20]

A daemon with one GPU (by config, `min_runtime` 0); each round starts a tiny Trainer run
(tests/trainer_plugin/scripts/plain_trainer.py) and, once it trains, a `--priority 5` run that
needs the GPU. Measured from the records and the proof, for each round:

- total: from the urgent run queued to its job started (its `running` transition);
- the victim's save: from the snapshot request written to the proof written (the proof's own
  `time`, the plugin's clock), which is the job's work, not obd's;
- obd's part: total minus the save: deciding, asking, seeing the proof and the job's end (the
  job's own exit after its proof included), freeing the GPU, launching the urgent job.

Median and p99 over the rounds; the goal is obd's part at or under 0.5 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import FAST_CONFIG, DaemonProc, kill_leftover_jobs, wait_for

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\nmin_runtime = 0\n'


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def when(record: dict, state: str, reason: str = "") -> float:
    return next(h["time"] for h in record["history"] if h["state"] == state and h["reason"].startswith(reason))


def one_round(d: DaemonProc, cwd: Path) -> tuple[float, float, dict[str, float]]:
    """(total, the victim's save, obd's part in stages) of one preemption, in seconds."""
    victim = d.call(
        "start",
        command=[PY, PLAIN, "--output_dir", "mine", "--max_steps", "100000", "--step-sleep", "0.02"],
        cwd=str(cwd),
        gpus="1",
    )["id"]
    wait_for(lambda: (d.record(victim)["progress"]["step"] or 0) >= 2, 120, 0.05, "the victim to train")
    urgent = d.call("start", command=["true"], gpus="1", priority=5)["id"]
    done = d.wait_state(urgent, "succeeded", "failed", timeout=120)
    paused = d.wait_state(victim, "stopped", "cancelled", "failed", timeout=60)
    assert paused["state"] == "stopped", paused["message"]
    proof = json.loads((Path(paused["remote_dir"]) / "snapshot.json").read_text())
    total = when(done, "running", "started") - done["created"]
    save = proof["time"] - paused["stop"]["requested_at"]
    stages = {
        "decided and asked": paused["stop"]["requested_at"] - done["created"],
        "proof to the victim's end": when(paused, "stopped") - proof["time"],
        "its end to the urgent leaving the queue": when(done, "preparing") - when(paused, "stopped"),
        "the urgent's launch": when(done, "running", "started") - when(done, "preparing"),
    }
    if paused.get("retried_by"):
        d.call("cancel", id=paused["retried_by"])
        d.wait_state(paused["retried_by"], "cancelled", "failed", "succeeded", timeout=60)
    return total, save, stages


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preemptions", type=int, default=20)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="obdb-preempt-", dir="/tmp"))
    d = DaemonProc(root, CONFIG)
    d.start(log_level="info")
    totals, saves, parts = [], [], []
    stages: dict[str, list[float]] = {}
    try:
        for _ in range(a.preemptions):
            total, save, parts_of = one_round(d, root)
            totals.append(total)
            saves.append(save)
            parts.append(total - save)
            for name, value in parts_of.items():
                stages.setdefault(name, []).append(value)
            time.sleep(0.2)
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)
    n = len(parts)
    rows = [("queued to running", totals), ("the victim's save", saves), ("obd's part", parts)]
    rows += [(f"  of which {name}", values) for name, values in stages.items()]
    for what, values in rows:
        print(
            f"preemption, {what}: median {statistics.median(values) * 1000:.0f} ms, "
            f"p99 {pct(values, 99) * 1000:.0f} ms over {n} preemptions"
        )


if __name__ == "__main__":
    main()
