"""Progress from the run's metrics lines: step of max steps, loss, and the ETA."""

from __future__ import annotations

import pytest

from daemon.service.models import RunRecord
from daemon.service.progress import update_progress
from executors.base import JobState, JobStatus, RunProbe

T0 = 1_700_000_000.0


def probe(begin: dict, last_log: dict | None) -> RunProbe:
    return RunProbe(remote_dir="/r", status=JobStatus(state=JobState.running), begin=begin, last_log=last_log)


def test_the_eta_is_the_steps_left_at_the_pace_so_far_less_the_time_since_the_last_line() -> None:
    record = RunRecord(id="20260101-000000-abcdef", target="local", command=["x"])
    # 10 steps in 20 s: 2 s a step; 90 steps left; the last line is 5 s old.
    update_progress(record, probe({"time": T0, "max_steps": 100}, {"time": T0 + 20, "step": 10, "loss": 1.5}), T0 + 25)
    assert (record.progress.step, record.progress.max_steps, record.progress.loss) == (10, 100, 1.5)
    assert record.progress.eta_seconds == pytest.approx(90 * 2.0 - 5)


def test_a_resumed_run_paces_only_the_steps_it_ran_itself() -> None:
    record = RunRecord(id="20260101-000000-abcdef", target="local", command=["x"])
    update_progress(
        record, probe({"time": T0, "max_steps": 100, "start_step": 50}, {"time": T0 + 10, "step": 60}), T0 + 10
    )
    assert record.progress.eta_seconds == pytest.approx(40 * 1.0)


@pytest.mark.parametrize(
    "begin, last_log",
    [
        ({"time": T0, "max_steps": 100}, None),  # no step yet
        ({"time": T0}, {"time": T0 + 5, "step": 3}),  # no max_steps: no ETA
        ({"time": T0, "max_steps": 100}, {"time": T0, "step": 3}),  # no time has passed
        ({"time": float("nan"), "max_steps": 100}, {"time": T0 + 5, "step": 3}),  # a malformed time
    ],
)
def test_no_eta_is_made_up_when_the_lines_cannot_give_one(begin: dict, last_log: dict | None) -> None:
    record = RunRecord(id="20260101-000000-abcdef", target="local", command=["x"])
    update_progress(record, probe(begin, last_log), T0 + 30)
    assert record.progress.eta_seconds is None


@pytest.mark.parametrize(
    ("lines", "ended", "stop_seconds", "phase"),
    [
        ({}, False, 1.0 + 5.0, None),  # training, no save measured yet: a safe point and a usual save
        ({"last_save": {"time": T0, "step": 5, "seconds": 2.5}}, False, 1.0 + 2.5, None),
        (
            {"phase": {"time": T0, "phase": "evaluating", "step": 5}, "last_save": {"seconds": 2.5}},
            False,
            3.5,
            "evaluating",
        ),
        ({"phase": {"time": T0, "phase": "saving", "step": 5}, "last_save": {"seconds": 2.5}}, False, 2.5, "saving"),
        ({"last_save": {"seconds": 2.5}}, True, 0.0, "after_train"),  # training ended: no save, ended at once
    ],
)
def test_what_a_stop_would_take_now_follows_the_job_s_phase_and_its_last_save(
    lines: dict, ended: bool, stop_seconds: float, phase: str | None
) -> None:
    record = RunRecord(id="20260101-000000-abcdef", target="local", command=["x"], snapshots=True)
    begin, log = {"time": T0, "max_steps": 100}, {"time": T0 + 10, "step": 5}
    p = RunProbe(
        remote_dir="/r", status=JobStatus(state=JobState.running), begin=begin, last_log=log, ended=ended, **lines
    )
    update_progress(record, p, T0 + 11)
    assert (record.progress.stop_seconds, record.progress.phase) == (stop_seconds, phase)


def test_a_job_without_the_plugin_has_no_stop_estimate() -> None:
    record = RunRecord(id="20260101-000000-abcdef", target="local", command=["x"])
    update_progress(record, probe({"time": T0}, {"time": T0 + 1, "step": 1}), T0 + 2)
    assert record.progress.stop_seconds is None
