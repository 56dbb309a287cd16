"""A limit's lead learned from the Trainer's own periodic saves (issue 26 item 1; docs/limits.md):
the plugin times each checkpoint save (`save` lines in metrics.jsonl), the probe finds the newest
one, and daemon/service/limits.py takes it as the chain's last measured save, so a chain's first stop is
asked ahead of a save as long as its saves really take, not only the floor.

The rules first (pure functions), then the probe's reading of a metrics file, then a real Trainer
script with `save_steps` under a real daemon.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from daemon.service.limits import Rate, carried, lead, learn_save
from daemon.service.models import Limits, RunRecord, RunState, Snapshot, Transition
from executors.base import RunProbe, SaveLine
from tests.conftest import FAST_CONFIG, REPO, DaemonProc
from trainer_plugin.tools.jobctl import _metrics_summary

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")


def attempt(limits: Limits | None) -> RunRecord:
    record = RunRecord(id="r1", limits=limits, history=[Transition(state=RunState.running, time=0.0, reason="")])
    record.state = RunState.running
    return record


@pytest.mark.parametrize(
    ("carried_save", "line", "learned", "expected_lead"),
    [
        # No save measured yet: the floor (60 s) + the margin (30 s).
        (None, None, False, 90.0),
        # A periodic save of 200 s: the lead is that save + the margin.
        (None, SaveLine(step=500, seconds=200.0), True, 230.0),
        # A periodic save newer than the chain's earlier snapshot replaces it, shorter or longer.
        (150.0, SaveLine(step=500, seconds=75.0), True, 105.0),
        (150.0, SaveLine(step=500, seconds=400.0), True, 430.0),
        # A quick save still leaves the floor.
        (None, SaveLine(step=10, seconds=2.5), True, 90.0),
        # The same line seen again changes nothing; a line without a usable duration is ignored.
        (200.0, SaveLine(step=500, seconds=200.0), False, 230.0),
        (120.0, SaveLine(step=500, seconds=None), False, 150.0),
        (120.0, SaveLine(step=500, seconds=-3.0), False, 150.0),
    ],
)
def test_the_lead_is_learned_from_the_newest_periodic_save_of_the_attempt(
    carried_save: float | None, line: SaveLine | None, learned: bool, expected_lead: float
) -> None:
    record = attempt(Limits(time_limit=3600.0, save_seconds=carried_save))
    assert learn_save(record, line) is learned
    assert record.limits is not None
    assert lead(record.limits.save_seconds, 60.0, 30.0) == expected_lead


def test_a_run_without_limits_learns_no_save() -> None:
    record = attempt(None)
    assert learn_save(record, SaveLine(step=5, seconds=12.0)) is False
    assert record.limits is None


def test_the_next_attempt_carries_the_periodic_save_unless_a_snapshot_measured_a_newer_one() -> None:
    first = attempt(Limits(time_limit=3600.0))
    learn_save(first, SaveLine(step=100, seconds=42.0))
    first.history.append(Transition(state=RunState.failed, time=50.0, reason=""))
    second = carried(first, Rate(), 60.0)
    assert second is not None and second.save_seconds == 42.0  # the periodic save goes on to the next attempt

    snapped = attempt(Limits(time_limit=3600.0))
    learn_save(snapped, SaveLine(step=100, seconds=42.0))
    snapped.snapshot = Snapshot(checkpoint="output/checkpoint-120", step=120, reason="preempted")
    snapped.stop.requested_at, snapped.stop.proof_at = 40.0, 49.0
    third = carried(snapped, Rate(), 60.0)
    assert third is not None and third.save_seconds == 9.0  # the snapshot came later: its request to proof


def test_the_probe_finds_the_last_save_line_behind_later_step_logs(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [{"event": "begin", "time": 1.0, "max_steps": 100, "snapshots": True}]
    for step in range(1, 60):
        lines.append({"event": "log", "time": float(step), "step": step, "loss": 1.0 / step})
        if step % 20 == 0:
            lines.append({"event": "save", "time": step + 0.5, "step": step, "seconds": step / 10, "snapshot": False})
    path.write_text("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))
    summary = _metrics_summary(str(path))
    probe = RunProbe.model_validate({"remote_dir": str(tmp_path), "status": {"state": "running"}, **summary})
    assert probe.last_log is not None and probe.last_log.step == 59
    assert probe.last_save is not None and (probe.last_save.step, probe.last_save.seconds) == (40, 4.0)
    assert probe.ended is False

    # A save line whose duration is not a finite number reads as no duration.
    with path.open("a") as f:
        f.write('{"event":"save","time":70.0,"step":60,"seconds":"soon"}\n')
    probe = RunProbe.model_validate(
        {"remote_dir": str(tmp_path), "status": {"state": "running"}, **_metrics_summary(str(path))}
    )
    assert probe.last_save is not None and probe.last_save.step == 60 and probe.last_save.seconds is None


def test_a_trainer_with_save_steps_reports_each_save_s_duration_and_the_daemon_learns_the_lead(
    make_daemon, short_tmp: Path
) -> None:
    d: DaemonProc = make_daemon(FAST_CONFIG)
    d.start()
    out = d.cli(
        "train", "start", "--cwd", str(short_tmp), "--time-limit", "2h", "--",
        PY, PLAIN, "--output_dir", "mine", "--max_steps", "6", "--save_steps", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    record = d.wait_state(rid, "succeeded", "failed", "stopped", "cancelled", timeout=180)
    assert record["state"] == "succeeded", record["message"]
    lines = [json.loads(x) for x in (Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    saves = [x for x in lines if x["event"] == "save"]
    assert [x["step"] for x in saves] == [2, 4, 6]
    for save in saves:
        assert save["checkpoint"] == f"output/checkpoint-{save['step']}"
        assert save["snapshot"] is False
        assert isinstance(save["seconds"], float) and 0.0 <= save["seconds"] < 60.0
        assert (Path(record["remote_dir"]) / save["checkpoint"] / "trainer_state.json").is_file()
    # Each save line follows its step's log line: the file stays in step order.
    order = [(x["event"], x.get("step")) for x in lines if x["event"] in ("log", "save")]
    assert order.index(("save", 2)) > order.index(("log", 2)) and order.index(("save", 2)) < order.index(("log", 3))
    # The daemon took the newest one as the chain's last measured save, and the lead from it.
    assert record["limits"]["save_seconds"] == saves[-1]["seconds"]
    assert d.record(rid)["usage"]["save_seconds"] == saves[-1]["seconds"]
