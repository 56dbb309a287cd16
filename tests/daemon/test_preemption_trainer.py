"""A real Trainer script paused for an urgent run and brought back on its own (issue 25): every
step after the pause trains exactly as an uninterrupted run of the same seed (bitwise on CPU),
none trained twice or skipped. GPUs are given by config; the training is on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\nmin_runtime = "1s"\n'
STEPS = "40"


def start(d: DaemonProc, cwd: Path, *opts: str, hold_at: int = 0) -> str:
    """A run of the Trainer script; with `hold_at`, it trains past that step only once obd asked it
    for a snapshot (numerically the same run: the wait is between two steps)."""
    command = [PY, PLAIN, "--output_dir", "mine", "--max_steps", STEPS, "--step-sleep", "0.3"]
    command += ["--hold-at", str(hold_at)] if hold_at else []
    out = d.cli("train", "start", "--cwd", str(cwd), "--gpus", "1", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def steps(record: dict) -> dict[int, tuple[float, float]]:
    lines = [json.loads(x) for x in (Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: (x["loss"], x.get("grad_norm")) for x in lines if x.get("event") == "log" and "loss" in x}


def test_a_paused_trainer_run_resumes_on_its_own_and_trains_every_later_step_as_if_never_paused(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(CONFIG)
    d.start()
    whole = d.wait_state(start(d, short_tmp), "succeeded", "failed", timeout=240)
    assert whole["state"] == "succeeded", whole["message"]

    # Neither ends before the urgent run comes, however loaded the machine: each waits at its third
    # step for a request (the one never paused is cancelled at the end).
    other = start(d, short_tmp, hold_at=3)
    wait_for(lambda: d.record(other)["snapshots"], 120, 0.1, "the first run's plugin")
    victim = start(d, short_tmp, hold_at=3)
    wait_for(lambda: (d.record(victim)["progress"]["step"] or 0) >= 3, 120, 0.1, "the second run's third step")
    urgent = d.cli("train", "start", "--gpus", "1", "--priority", "5", "--", "sh", "-c", "sleep 2")
    assert urgent.returncode == 0, urgent.stderr

    paused = d.wait_state(victim, "stopped", "failed", "cancelled", timeout=120)
    assert paused["state"] == "stopped" and paused["snapshot"]["reason"] == "preempted", paused["message"]
    assert d.record(other)["state"] == "running"  # exactly one victim: the most recently started
    again = wait_for(lambda: d.record(victim)["retried_by"], 30, 0.1, "the victim's way back")
    back = d.wait_state(again, "succeeded", "failed", timeout=240)
    assert back["state"] == "succeeded", back["message"]
    before, after, reference = steps(paused), steps(back), steps(whole)
    pause = paused["snapshot"]["step"]
    assert max(before) == pause and min(after) == pause + 1 and max(after) == int(STEPS)  # none twice, none skipped
    assert {s: after[s] for s in after} == {s: reference[s] for s in after}  # bitwise: losses and grad norms
    pauses = d.record(back["id"])["pauses"]
    assert pauses["preemptions"] == 1 and pauses["lost_steps"] == 0 and pauses["paused_seconds"] > 0
    d.call("cancel", id=other)
