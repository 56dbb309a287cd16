"""Progress heartbeats: between Trainer logs, rank 0 writes `log` lines with step, time, epoch and tokens but no loss.

Real jobs (tests/trainer_plugin/scripts/plain_trainer.py) with `logging_steps` larger than one, so the
Trainer leaves steps unlogged, and OBD_PROGRESS_INTERVAL=0 (a heartbeat at every such step), so
no test depends on timing except the one that checks the interval itself.
"""

from __future__ import annotations

import itertools
import math
import subprocess
from collections.abc import Callable
from typing import Any

import pytest

from runner.steps import pace, read_metrics_jsonl
from tests.trainer_plugin.conftest import PY, SCRIPTS, Job, RunDir, assert_exit_zero
from trainer_plugin.plugin import runtime

SCRIPT = SCRIPTS / "plain_trainer.py"
HEARTBEAT_KEYS = {"event", "time", "step", "epoch", "tokens", "heartbeat"}


def train(run: RunDir, start_job: Callable[..., Job], *opts: str, interval: str | None = "0") -> Job:
    env = run.env()
    if interval is not None:
        env["OBD_PROGRESS_INTERVAL"] = interval
    job = start_job(run, [PY, str(SCRIPT), "--output_dir", str(run.root.parent / "mine"), *opts], env)
    assert_exit_zero(job, job.wait())
    return job


def heartbeats(run: RunDir) -> list[dict[str, Any]]:
    return [m for m in run.logs() if m.get("heartbeat") is True]


def test_steps_the_trainer_does_not_log_get_a_log_line_without_loss(
    run_dir: RunDir, start_job: Callable[..., Job]
) -> None:
    train(run_dir, start_job, "--max_steps", "8", "--logging_steps", "4")
    logs = run_dir.logs()
    # One `log` line per step: the Trainer's at its logging steps, a heartbeat at every other step.
    assert [m["step"] for m in logs] == list(range(1, 9))
    for m in logs:
        if m["step"] % 4 == 0:
            assert isinstance(m["loss"], float) and "heartbeat" not in m, m
        else:
            assert set(m) == HEARTBEAT_KEYS, m  # no loss key: the daemon keeps the last known loss
            assert m["heartbeat"] is True and m["epoch"] > 0
    tokens = [m["tokens"] for m in logs]
    assert tokens[0] > 0 and all(b > a for a, b in itertools.pairwise(tokens))
    times = [m["time"] for m in logs]
    assert all(b >= a for a, b in itertools.pairwise(times))
    metrics = run_dir.metrics()
    assert metrics[0]["event"] == "begin" and metrics[-1]["event"] == "end" and metrics[-1]["step"] == 8


@pytest.mark.slow  # ~10 s of imports; the pace itself is tested on lines in tests/runner
def test_the_runners_pace_reads_heartbeats_as_pace_points(run_dir: RunDir, start_job: Callable[..., Job]) -> None:
    # With logging_steps far beyond the run, the heartbeats are the only `log` lines.
    train(run_dir, start_job, "--max_steps", "6", "--logging_steps", "100")
    assert [m["step"] for m in run_dir.logs()] == [1, 2, 3, 4, 5, 6]
    assert all("loss" not in m for m in run_dir.logs())
    result = pace(read_metrics_jsonl(run_dir.metrics_path))
    assert result.steps == 6
    assert result.step_time_s is not None and result.step_time_s > 0
    assert result.tokens_per_sec is not None and result.tokens_per_sec > 0
    assert "between log lines" in result.sources["step_time_s"] and "steps 1 to 6" in result.sources["step_time_s"]
    assert not any("unreadable" in w or "single log line" in w for w in result.warnings), result.warnings


@pytest.mark.slow  # ~10 s of imports; the tiny workload's snapshot tests check the last log line
def test_a_snapshot_still_ends_on_the_trainers_log_line_with_the_loss(
    run_dir: RunDir, start_job: Callable[..., Job]
) -> None:
    train(
        run_dir,
        start_job,
        "--max_steps",
        "8",
        "--logging_steps",
        "100",
        "--write-at",
        "3",
        "--write-file",
        f"{run_dir.request}=deadline",
    )
    assert run_dir.proof() is not None and run_dir.proof()["step"] == 3  # type: ignore[index]
    logs = run_dir.logs()
    assert [m["step"] for m in logs] == [1, 2, 3]
    assert [m.get("heartbeat", False) for m in logs] == [True, True, False]
    assert isinstance(logs[-1]["loss"], float)


@pytest.mark.slow  # ~10 s of imports; the interval parsing is tested in-process below
def test_without_the_variable_a_fast_run_writes_no_heartbeat(run_dir: RunDir, start_job: Callable[..., Job]) -> None:
    # The default interval is 10 s; eight tiny steps take far less.
    train(run_dir, start_job, "--max_steps", "8", "--logging_steps", "4", interval=None)
    assert [m["step"] for m in run_dir.logs()] == [4, 8]
    assert heartbeats(run_dir) == []


def test_heartbeats_come_at_most_once_per_interval(run_dir: RunDir, start_job: Callable[..., Job]) -> None:
    train(run_dir, start_job, "--max_steps", "12", "--logging_steps", "100", "--step-sleep", "0.1", interval="0.35")
    beats = heartbeats(run_dir)
    assert 0 < len(beats) < 12
    begin = run_dir.metrics()[0]
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise([begin, *beats])]
    assert min(gaps) >= 0.3, gaps  # interval measured on the monotonic clock; wall time allows a little slack


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 10.0),
        ("", 10.0),
        ("0", 0.0),
        (" 2.5 ", 2.5),
        ("inf", math.inf),
        ("abc", 10.0),
        ("-1", 10.0),
        ("nan", 10.0),
    ],
)
def test_the_interval_comes_from_obd_progress_interval(
    value: str | None, seconds: float, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runtime.progress_interval(value) == seconds
    environ = {"OBD_RUN_DIR": "/run"} if value is None else {"OBD_RUN_DIR": "/run", "OBD_PROGRESS_INTERVAL": value}
    assert runtime.RunEnv.from_environ(environ).progress_interval == seconds
    said = capsys.readouterr().err
    assert ("OBD_PROGRESS_INTERVAL" in said) == (value in ("abc", "-1", "nan"))


CALLBACK_WITH_A_BROKEN_WRITER = """
import sys
from transformers import TrainerControl, TrainerState, TrainingArguments
from trainer_plugin.plugin.callback import SnapshotCallback
from trainer_plugin.plugin.runtime import RunEnv

run = sys.argv[1]
callback = SnapshotCallback(env=RunEnv.from_environ({"OBD_RUN_DIR": run, "OBD_PROGRESS_INTERVAL": "0"}))
args = TrainingArguments(output_dir=run + "/output", report_to="none", use_cpu=True)
state, control = TrainerState(max_steps=100), TrainerControl()
callback.on_train_begin(args, state, control)
calls = []
def broken(*a, **k):
    calls.append(a)
    raise ValueError("disk on fire")
callback._metrics.write = broken
for step in (1, 2, 3):
    state.global_step = step
    callback.on_step_end(args, state, control)
print("trained on", len(calls), "failed heartbeat")
"""


def test_a_failing_heartbeat_never_stops_training_and_is_said_once(run_dir: RunDir) -> None:
    out = subprocess.run(
        [PY, "-c", CALLBACK_WITH_A_BROKEN_WRITER, str(run_dir.root)],
        env=run_dir.env(obd=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "trained on 1 failed heartbeat" in out.stdout
    assert out.stderr.count("progress heartbeat failed") == 1
