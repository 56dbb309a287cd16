"""A chain's limits (issue 26, items 1 and 2; docs/limits.md): --time-limit, --deadline,
--max-gpu-hours and --max-cost-usd end a run with a `deadline` or `cost` snapshot ahead of the
limit, summed over every attempt of its chain, on every kind of target.

The rules are pure functions of daemon/service/limits.py, table-tested first; then real daemons and real
processes: a user's Trainer script that obd did not write (tests/trainer_plugin/scripts/
plain_trainer.py), the fast fake job (tests/daemon/fake_plugin_job.py `snapshot`: a step every
0.05 s, a proof of the request's reason), a real sshd on loopback and a real Slurm cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.cli.parser import deadline_time, duration_seconds, positive_number
from daemon.cli.render import finish_text, limits_text
from daemon.service.limits import (
    COST_BUDGET,
    DEADLINE_LIMIT,
    GPU_BUDGET,
    TIME_LIMIT,
    Left,
    Rate,
    Use,
    capped_lead,
    carried,
    check,
    due,
    job_time,
    lead,
    refusal,
    report,
    running_seconds,
    spent,
    too_late,
    too_late_at,
)
from daemon.service.models import Limits, RunRecord, RunState, Snapshot, Transition
from executors.config import LocalTarget, RunpodTarget, SlurmTarget, SshTarget
from executors.slurm.script import job_time as slurm_job_time
from executors.slurm.script import sbatch_arguments
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, kill_job_groups, wait_for
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture

PY = sys.executable
FAKE = str(REPO / "tests" / "daemon" / "fake_plugin_job.py")
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
STEPS_JOB = str(REPO / "tests" / "executors" / "slurm" / "steps_job.py")
# A short lead for short limits: a 1 s floor and a 1 s margin (the defaults are 60 s and 30 s).
LIMITS = "\n[limits]\nsave_floor = 1\nmargin = 1\n"


# --- the rules -----------------------------------------------------------------------------------


def history(*entries: tuple[str, float]) -> list[Transition]:
    return [Transition(state=state, time=at, reason="") for state, at in entries]


@pytest.mark.parametrize(
    ("entries", "now", "seconds"),
    [
        ([], 100.0, 0.0),
        # Running up to now.
        ([("preparing", 0.0), ("running", 10.0)], 25.0, 15.0),
        # Notes made while running carry its state: one span, not two.
        ([("running", 10.0), ("running", 12.0), ("running", 14.0)], 20.0, 10.0),
        # Pending in a scheduler (queued) between two spans of running does not count.
        ([("running", 0.0), ("queued", 5.0), ("running", 30.0), ("stopped", 40.0)], 99.0, 15.0),
        # Ended: counted up to its end, whatever the clock says now.
        ([("queued", 0.0), ("preparing", 3.0), ("running", 4.0), ("stopped", 9.0)], 500.0, 5.0),
    ],
)
def test_an_attempt_counts_only_the_time_it_spent_running(
    entries: list[tuple[str, float]], now: float, seconds: float
) -> None:
    assert running_seconds(history(*entries), now) == pytest.approx(seconds)


def L(**given: Any) -> Limits:
    return Limits(**given)


@pytest.mark.parametrize(
    ("limits", "use", "rate", "now", "lead_s", "expected"),
    [
        # The time limit is summed over the chain: 100 s of 120 used, a 30 s lead: ask now.
        (L(time_limit=120), Use(100, 0, 0), Rate(), 0, 30, TIME_LIMIT),
        (L(time_limit=120), Use(80, 0, 0), Rate(), 0, 30, None),
        # The lead is at most half the limit, so a short limit still trains half its time.
        (L(time_limit=20), Use(9, 0, 0), Rate(), 0, 30, None),
        (L(time_limit=20), Use(10, 0, 0), Rate(), 0, 30, TIME_LIMIT),
        # The deadline is a clock time; its span counts from the chain's first queueing (0 here).
        (L(deadline=1000), Use(), Rate(), 980, 30, DEADLINE_LIMIT),
        (L(deadline=1000), Use(), Rate(), 900, 30, None),
        # GPU-hours: 2 GPUs, 0.01 GPU-hours = 36 GPU-seconds = 18 s of wall time; 5 s of it left.
        (L(max_gpu_hours=0.01), Use(0, 26, 0), Rate(gpus=2), 0, 6, GPU_BUDGET),
        (L(max_gpu_hours=0.01), Use(0, 20, 0), Rate(gpus=2), 0, 6, None),
        # No GPUs counted: the budget does not run down.
        (L(max_gpu_hours=0.01), Use(0, 0, 0), Rate(gpus=0), 0, 6, None),
        # Cost: $1 at $36 an hour is 100 s; $0.95 spent leaves 5 s.
        (L(max_cost_usd=1), Use(0, 0, 0.95), Rate(usd_per_hour=36), 0, 10, COST_BUDGET),
        (L(max_cost_usd=1), Use(0, 0, 0.5), Rate(usd_per_hour=36), 0, 10, None),
        # No price yet (a pod not made): nothing to count.
        (L(max_cost_usd=1), Use(0, 0, 0.0), Rate(usd_per_hour=None), 0, 10, None),
        # Several due: the one with the least left.
        (L(time_limit=100, max_gpu_hours=1), Use(95, 3599, 0), Rate(gpus=1), 0, 10, GPU_BUDGET),
        # A limit already overrun is due (the next attempt of a spent chain).
        (L(time_limit=100), Use(150, 0, 0), Rate(), 0, 10, TIME_LIMIT),
    ],
)
def test_a_limit_is_due_when_less_of_it_is_left_than_the_lead_or_half_of_it(
    limits: Limits, use: Use, rate: Rate, now: float, lead_s: float, expected: str | None
) -> None:
    found = due(limits, use, rate, now, 0.0, lead_s)
    assert (found.limit if found else None) == expected
    if found:
        assert found.reason == ("deadline" if expected in (TIME_LIMIT, DEADLINE_LIMIT) else "cost")


@pytest.mark.parametrize(
    ("save", "floor", "margin", "expected"),
    [(None, 60, 30, 90), (20, 60, 30, 90), (200, 60, 30, 230), (None, 1, 1, 2)],
)
def test_the_lead_is_the_last_measured_save_never_below_the_floor_plus_the_margin(
    save: float | None, floor: float, margin: float, expected: float
) -> None:
    assert lead(save, floor, margin) == expected


def attempt(
    *entries: tuple[str, float],
    limits: Limits | None = None,
    gpus: int = 0,
    snapshot_at: tuple[float, float] | None = None,
    created: float = 0.0,
) -> RunRecord:
    record = RunRecord(id="r1", history=history(*entries), limits=limits, gpus=[str(i) for i in range(gpus)])
    record.created = created
    if entries:
        record.state = RunState(entries[-1][0])
    if snapshot_at is not None:
        record.snapshot = Snapshot(checkpoint="output/checkpoint-5", step=5, reason="preempted")
        record.stop.requested_at, record.stop.proof_at = snapshot_at
    return record


def test_the_chain_s_totals_and_its_last_save_go_from_attempt_to_attempt() -> None:
    first = attempt(("running", 0.0), ("stopped", 40.0), limits=L(time_limit=3600, max_gpu_hours=1), gpus=2)
    first.stop.requested_at, first.stop.proof_at = 30.0, 37.5
    first.snapshot = Snapshot(checkpoint="output/checkpoint-9", step=9, reason="preempted")
    second_limits = carried(first, Rate(gpus=2, usd_per_hour=8.0), 100.0)
    assert second_limits is not None
    assert (second_limits.run_seconds, second_limits.gpu_seconds) == (40.0, 80.0)
    assert second_limits.cost_usd == pytest.approx(40 * 8 / 3600)
    assert second_limits.save_seconds == 7.5  # from its request to its proof
    second = attempt(("running", 200.0), ("failed", 210.0), limits=second_limits, gpus=2)
    third_limits = carried(second, Rate(gpus=2), 300.0)
    assert third_limits is not None
    assert (third_limits.run_seconds, third_limits.gpu_seconds) == (50.0, 100.0)
    assert third_limits.save_seconds == 7.5  # no snapshot in the second: the chain's last one stands
    assert third_limits.time_limit == 3600 and third_limits.max_gpu_hours == 1 and third_limits.reached is None


def test_a_pod_attempt_costs_what_its_pod_cost_not_only_its_running_time() -> None:
    pod = attempt(("running", 0.0), ("stopped", 60.0), limits=L(max_cost_usd=5))
    assert carried(pod, Rate(gpus=1, usd_per_hour=3.6, spent_usd=0.25), 70.0).cost_usd == 0.25  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("stop_reason", "asked_by", "used", "expected"),
    [
        # No request yet, and the limit is near: obd asks.
        (None, None, 118, TIME_LIMIT),
        # A `deadline` request from the job's side (Slurm's --signal) up to 90 s beyond the lead: the limit's.
        ("deadline", None, 60, TIME_LIMIT),
        ("deadline", None, 20, None),
        # A user's stop stays the user's, however near the limit.
        ("requested", "`obd train stop`", 119, None),
        ("deadline", "`obd train stop`", 119, None),
    ],
)
def test_a_running_attempt_reaches_its_limit_by_obds_check_or_by_its_schedulers_signal(
    stop_reason: str | None, asked_by: str | None, used: float, expected: str | None
) -> None:
    record = attempt(("running", 1000.0), limits=L(time_limit=120), created=1000.0)
    record.stop.reason, record.stop.asked_by = stop_reason, asked_by
    record.stop.requested_at = 1000.0 + used if stop_reason else None
    found = check(record, Rate(), 1000.0 + used, save_floor=1, margin=1)
    assert (found.limit if found else None) == expected


def test_a_chain_whose_limit_is_spent_gets_no_further_attempt() -> None:
    ended = attempt(("running", 0.0), ("stopped", 95.0), limits=L(time_limit=100, run_seconds=3))
    assert spent(ended, Rate(), 96.0, 1, 1).limit == TIME_LIMIT  # type: ignore[union-attr]
    room = attempt(("running", 0.0), ("stopped", 50.0), limits=L(time_limit=100))
    assert spent(room, Rate(), 51.0, 1, 1) is None


@pytest.mark.parametrize(
    ("limits", "floor", "now", "late", "at"),
    [
        # Queued at 0 with a deadline at 1000 and a 2 s lead (1 s floor, 1 s margin): it may start until 998.
        (L(deadline=1000), 1, 997.0, False, 998.0),
        (L(deadline=1000), 1, 998.0, True, 998.0),
        # A lead longer than half the deadline's span is cut to half, as a running attempt's is: until 10 of 20.
        (L(deadline=20), 30, 9.0, False, 10.0),
        (L(deadline=20), 30, 10.0, True, 10.0),
        # The chain's last measured save is the lead when longer than the floor.
        (L(deadline=1000, save_seconds=50), 1, 948.0, False, 949.0),
        (L(deadline=1000, save_seconds=50), 1, 949.0, True, 949.0),
        # A time limit or a budget does not run down while the run waits.
        (L(time_limit=10, max_gpu_hours=0.001), 1, 10_000.0, False, None),
        (None, 1, 10_000.0, False, None),
    ],
)
def test_a_queued_run_whose_deadline_leaves_it_no_time_never_starts(
    limits: Limits | None, floor: float, now: float, late: bool, at: float | None
) -> None:
    record = attempt(("queued", 0.0), limits=limits, created=0.0)
    why = too_late(record, now, save_floor=floor, margin=1)
    assert (why is not None) == late
    assert too_late_at(record, floor, 1) == at
    if why is not None:
        assert why.startswith("cancelled while queued: its deadline (") and "nothing of it ran" in why
        assert why.endswith("start it again with a later --deadline")
        record.attempt = 2
        assert "`obd train resume r1 --deadline TIME` resumes its chain" in (too_late(record, now, floor, 1) or "")


def test_a_scheduler_is_given_what_the_time_limit_and_the_deadline_leave_never_the_budgets() -> None:
    record = attempt(limits=L(time_limit=600, run_seconds=200, max_gpu_hours=0.01), created=0.0)
    assert job_time(record, Rate(gpus=4), 0.0, 1, 1) == (400.0, 2.0)
    record.limits = L(deadline=1000, time_limit=5000)
    assert job_time(record, Rate(), 700.0, 10, 5) == (300.0, 15.0)
    record.limits = L(max_cost_usd=3)
    assert job_time(record, Rate(usd_per_hour=1), 0.0, 1, 1) is None


@pytest.mark.parametrize(
    ("own_time", "own_margin", "time_limit", "lead_s", "expected"),
    [
        # No limit of the run's: the target's time and signal_margin.
        ("30", 300.0, None, None, ("30", 300.0)),
        # Shorter than the target's: in whole minutes, the signal `lead` before the run's own limit.
        ("30", 300.0, 150.0, 20.0, ("3", 50.0)),
        (None, 300.0, 40.0, 4.0, ("1", 24.0)),
        # Longer than the target's: the target's stands.
        ("2", 60.0, 600.0, 20.0, ("2", 60.0)),
    ],
)
def test_a_slurm_run_s_limit_becomes_its_sbatch_time_and_signal(
    own_time: str | None,
    own_margin: float,
    time_limit: float | None,
    lead_s: float | None,
    expected: tuple[str | None, float],
) -> None:
    target = SlurmTarget(kind="slurm", time=own_time, signal_margin=own_margin)
    assert slurm_job_time(target, time_limit, lead_s) == expected


def test_sbatch_gets_the_run_s_own_time_and_signal() -> None:
    args = sbatch_arguments(SlurmTarget(kind="slurm", time="60"), "r", "/w/r", 40.0, 4.0)
    assert "--time=1" in args and "--signal=B:USR1@24" in args and "--time=60" not in args


@pytest.mark.parametrize(
    ("limits", "target", "gpus", "expected"),
    [
        (L(time_limit=60), SshTarget(kind="ssh", host="h"), 0, None),
        (L(deadline=10), LocalTarget(), 1, "that time has passed"),
        (L(max_gpu_hours=1), LocalTarget(), 0, "this run has no GPUs"),
        (L(max_gpu_hours=1), LocalTarget(), 2, None),
        (L(max_gpu_hours=1), SshTarget(kind="ssh", host="h"), 0, "set `gpu_count` (SSH) or `gpus_per_node`"),
        (L(max_gpu_hours=1), SshTarget(kind="ssh", host="h", gpu_count=8), 0, None),
        (L(max_gpu_hours=1), SlurmTarget(kind="slurm", gpus_per_node=4, nodes=2), 0, None),
        (L(max_cost_usd=5), LocalTarget(gpus=["0"]), 1, "has no price; set `price_per_gpu_hour`"),
        (L(max_cost_usd=5), LocalTarget(price_per_gpu_hour=2.0), 0, "no GPUs counted to price"),
        (L(max_cost_usd=5), LocalTarget(price_per_gpu_hour=2.0), 1, None),
        (L(max_cost_usd=5), RunpodTarget(kind="runpod"), 0, None),  # the pod's own rate
    ],
)
def test_limits_that_cannot_hold_on_the_target_are_refused_at_start_saying_what_to_set(
    limits: Limits, target: Any, gpus: int, expected: str | None
) -> None:
    why = refusal(limits, target, "t", gpus, now=100.0)
    assert (why is None) if expected is None else (why is not None and expected in why)


def test_status_shows_each_limit_used_and_left_and_where_it_stopped() -> None:
    record = attempt(
        ("running", 0.0),
        ("stopped", 30.0),
        limits=L(time_limit=120, max_gpu_hours=0.1, max_cost_usd=2, run_seconds=60, gpu_seconds=120, cost_usd=0.5),
        gpus=2,
    )
    record.limits.reached = TIME_LIMIT  # type: ignore[union-attr]
    usage = report(record, Rate(gpus=2, usd_per_hour=6.0), 100.0, 60, 30)
    assert usage is not None
    assert usage["time_limit"] == {"limit": 120, "used": 90.0, "left": 30.0}
    assert usage["gpu_hours"] == {"limit": 0.1, "used": 0.05, "left": 0.05}
    assert usage["cost_usd"] == {"limit": 2, "used": 0.55, "left": 1.45}
    assert usage["reached"] == TIME_LIMIT and usage["lead_seconds"] == 90
    text = limits_text(usage)
    assert "time 1m30s of 2m00s (30s left)" in text and "GPU-hours 0.05 of 0.1 (0.05 left)" in text
    assert "cost $0.55 of $2.00 ($1.45 left)" in text and "(2 GPUs at $6.00/h)" in text
    assert text.endswith("stopped at its time limit")
    shown = {"id": "r1", "state": "stopped", "snapshot": {"step": 7}, "limits": {"reached": TIME_LIMIT}}
    assert finish_text(shown) == "stopped at its time limit, at step 7; resume with `obd train resume r1`"


def test_the_command_line_takes_durations_clock_times_and_amounts() -> None:
    assert duration_seconds("90s") == 90 and duration_seconds("45m") == 2700 and duration_seconds("1.5h") == 5400
    assert duration_seconds("30") == 30
    for bad in ("0", "2 hours", "-5m"):
        with pytest.raises(argparse.ArgumentTypeError):
            duration_seconds(bad)
    noon = time.mktime((2025, 6, 1, 12, 0, 0, 0, 0, -1))
    assert deadline_time("14:30", noon) == noon + 2.5 * 3600  # later today
    assert deadline_time("11:00", noon) == pytest.approx(noon + 23 * 3600, abs=3600)  # the next one: tomorrow
    assert deadline_time("2025-06-01T13:00", noon) == noon + 3600
    for bad in ("2025-06-01T11:00", "25:00", "soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            deadline_time(bad, noon)
    assert positive_number("$40") == 40 and positive_number("0.002") == 0.002
    with pytest.raises(argparse.ArgumentTypeError):
        positive_number("0")


# --- real daemons ----------------------------------------------------------------------------------


def ran(record: dict[str, Any], now: float | None = None) -> float:
    """The seconds an attempt's record spent running, from its history (up to `now` while it runs)."""
    return running_seconds([Transition(**h) for h in record["history"]], time.time() if now is None else now)


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = (), env: dict | None = None) -> str:
    out = d.cli("train", "start", *opts, "--", *command, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def stopped_at_limit(d: DaemonProc, rid: str, reason: str, limit: str, timeout: float = 120) -> dict[str, Any]:
    record = d.wait_state(rid, "stopped", "failed", "succeeded", "cancelled", timeout=timeout)
    assert record["state"] == "stopped", record["message"]
    assert record["snapshot"]["reason"] == reason
    assert record["limits"]["reached"] == limit
    assert record["message"].startswith(f"stopped at its {limit}; resume with `obd train resume {rid}`")
    return record


@pytest.fixture
def ld(make_daemon) -> DaemonProc:
    d = make_daemon(FAST_CONFIG + LIMITS)
    d.start()
    return d


def test_a_trainer_script_with_a_time_limit_stops_with_a_deadline_snapshot_before_it_and_resume_continues_it(
    ld: DaemonProc, short_tmp: Path
) -> None:
    limit = 35.0  # room for torch and transformers to load on a busy machine
    rid = start(ld, PY, PLAIN, "--output_dir", "mine", "--max_steps", "100000", "--step-sleep", "0.05",
                opts=("--cwd", str(short_tmp), "--time-limit", f"{limit:g}s"))  # fmt: skip
    record = stopped_at_limit(ld, rid, "deadline", "time limit")
    assert ran(record) < limit  # asked ahead of the limit, and the save done before it
    assert any(h["reason"].startswith("snapshot requested (deadline) by its time limit") for h in record["history"])
    status = ld.cli("train", "status", rid).stdout
    assert f"stopped at its time limit; resume with `obd train resume {rid}`" in status
    assert "limits    time " in status and "stopped at its time limit" in status
    usage = ld.record(rid)["usage"]
    assert usage["time_limit"]["limit"] == limit and usage["time_limit"]["used"] < limit
    assert record.get("retried_by") is None

    step = record["snapshot"]["step"]
    out = ld.cli("train", "resume", rid, "--", PY, PLAIN, "--output_dir", "mine", "--max_steps", str(step + 3))
    assert out.returncode == 0, out.stderr
    final = ld.wait_state(out.stdout.strip(), "succeeded", "failed", "stopped", "cancelled", timeout=180)
    assert final["state"] == "succeeded", final["message"]
    lines = [json.loads(x) for x in (Path(final["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["start_step"] == step and lines[-1]["event"] == "end"


@pytest.mark.parametrize(
    ("item", "save", "said"),
    [
        # A 20 s limit, the default 60 s floor and 30 s margin: asked 10 s before it, and why.
        (Left(TIME_LIMIT, "deadline", 10, 20), None, "asked 10s before it, at half the limit: its lead of 1m30s"),
        (Left(TIME_LIMIT, "deadline", 10, 20), None, "(the save floor, 1m00s ([limits] save_floor), plus a margin"),
        (Left(TIME_LIMIT, "deadline", 10, 20), 120.0, "its lead of 2m30s (the chain's last measured save, 2m00s, "),
        (Left(TIME_LIMIT, "deadline", 90, 3600), None, ""),  # a lead that fits: nothing more to say
    ],
)
def test_a_snapshot_asked_at_half_a_short_limit_says_its_lead_was_capped_and_why(
    item: Left, save: float | None, said: str
) -> None:
    text = capped_lead(item, save, 60, 30)
    assert said in text if said else text == ""


def test_a_short_time_limit_s_history_says_the_snapshot_came_at_half_the_limit_and_why(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG)  # the default lead: a 60 s floor plus a 30 s margin, more than the limit
    d.start()
    rid = start(d, PY, FAKE, "snapshot", opts=("--time-limit", "6s"))
    stopped_at_limit(d, rid, "deadline", "time limit", timeout=60)
    status = d.cli("train", "status", rid).stdout
    assert "asked 3s before it, at half the limit: its lead of 1m30s" in status, status
    assert "the lead is capped at half so that a short limit still trains" in status, status


def test_a_run_with_a_deadline_stops_with_a_deadline_snapshot_before_it_even_across_a_daemon_restart(
    ld: DaemonProc,
) -> None:
    deadline = time.time() + 12
    clock = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(deadline))
    rid = start(ld, PY, FAKE, "snapshot", opts=("--deadline", clock))
    ld.wait_state(rid, "running")
    time.sleep(2)
    ld.kill()  # the deadline is in the record: a restarted daemon keeps it
    ld.start()
    record = stopped_at_limit(ld, rid, "deadline", "deadline")
    stopped = record["history"][-1]["time"]
    assert stopped < int(deadline) + 1  # the clock time given, to the second
    out = ld.cli("train", "resume", rid)
    assert out.returncode == 0, out.stderr
    resumed = ld.wait_state(out.stdout.strip(), "running")
    wait_for(lambda: "resumed from step" in (Path(resumed["remote_dir"]) / "job.log").read_text(), 20)
    log = (Path(resumed["remote_dir"]) / "job.log").read_text()
    assert f"resumed from step {record['snapshot']['step']}" in log
    assert resumed["limits"] is None  # a resumed run is a chain of its own: the spent deadline is not carried
    ld.call("cancel", id=resumed["id"])


def test_a_run_whose_deadline_comes_while_it_waits_for_gpus_is_cancelled_and_never_starts(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG + LIMITS + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n')
    d.start()
    holder = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    d.wait_state(holder, "running")
    deadline = time.time() + 8  # its lead (1 s floor + 1 s margin) comes 2 s before: 6 s from now
    clock = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(deadline))
    waiting = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1", "--deadline", clock))
    assert d.record(waiting)["state"] == "queued"
    record = d.wait_state(waiting, "cancelled", "running", "stopped", timeout=30)
    assert record["state"] == "cancelled", record["message"]
    assert (
        record["message"].startswith("cancelled while queued: its deadline (")
        and "nothing of it ran" in record["message"]
    )
    assert "running" not in [h["state"] for h in record["history"]]
    assert record["history"][-1]["time"] < deadline  # by the queue's own wake-up, not its 30 s poll
    assert d.record(holder)["state"] == "running"  # the run holding the GPU is left alone
    d.call("cancel", id=holder)


def test_a_gpu_hour_budget_is_summed_over_a_chain_that_was_preempted_and_retried(make_daemon) -> None:
    """1 GPU given by config; a budget of 0.004 GPU-hours is 14.4 s of it, asked 2 s ahead."""
    d = make_daemon(FAST_CONFIG + LIMITS + '\n[retry]\nbackoff = 0.2\n\n[targets.local]\nkind = "local"\n'
                    'gpus = ["0"]\nmin_runtime = "1s"\n')  # fmt: skip
    d.start()
    budget_s = 0.004 * 3600
    rid = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1", "--max-gpu-hours", "0.004", "--retry", "2"))
    wait_for(lambda: (r := d.record(rid))["state"] == "running" and r["snapshots"], 30, 0.05)
    time.sleep(3)
    urgent = start(d, "sh", "-c", "sleep 1", opts=("--gpus", "1", "--priority", "5"))  # preempts it
    assert d.wait_state(urgent, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    first = d.record(rid)
    assert first["state"] == "stopped" and first["snapshot"]["reason"] == "preempted"
    second = d.wait_state(first["retried_by"], "running", timeout=30)
    wait_for(lambda: d.record(second["id"])["snapshots"], 20, 0.05)
    time.sleep(2)
    os.killpg(second["job"]["pid"], signal.SIGKILL)  # the job lost: its retry comes
    second = d.wait_state(second["id"], "failed", timeout=30)
    third = d.wait_state(wait_for(lambda: d.record(second["id"]).get("retried_by"), 30), "running", timeout=30)
    d.kill()  # the chain's totals are in the records: a restarted daemon counts on
    d.start()
    last = stopped_at_limit(d, third["id"], "cost", "GPU-hour budget", timeout=60)

    attempts = [first, d.record(second["id"]), last]
    total = sum(ran(a) for a in attempts)
    assert total <= budget_s  # the budget, over the whole chain
    assert ran(last) < budget_s - 2 - ran(first) - 1  # not per attempt: the last one ran only what was left
    assert last["retried_by"] is None  # a retry was left, but a limit is never retried
    usage = d.record(rid)["usage"]  # the first attempt's id reaches the chain
    assert usage["gpu_hours"]["used"] <= 0.004 and usage["gpus"] == 1
    assert "GPU-hours" in d.cli("train", "status", rid).stdout
    assert any(h["reason"].startswith("snapshot requested (cost) by its GPU-hour budget") for h in last["history"])


# --- other targets -----------------------------------------------------------------------------------


@pytest.fixture
def sshd() -> Iterator[Any]:
    from tests.sshd import running_sshd

    yield from running_sshd()


def test_an_ssh_run_with_a_time_limit_stops_with_a_deadline_snapshot_before_it(
    make_daemon, sshd: Any, short_tmp: Path
) -> None:
    f = sshd.target_fields()
    workdir = short_tmp / "remote"
    d = make_daemon(
        FAST_CONFIG
        + LIMITS
        + f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
        f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
        f'workdir = "{workdir}"\npython = "{PY}"\nconnect_timeout = 3\nkeepalive = 3\n'
    )
    d.start()
    try:
        rid = start(d, PY, FAKE, "snapshot", opts=("--target", "box", "--time-limit", "10s"))
        record = stopped_at_limit(d, rid, "deadline", "time limit", timeout=60)
        assert ran(record) < 10
        out = d.cli("train", "resume", rid)
        assert out.returncode == 0, out.stderr
        resumed = d.wait_state(out.stdout.strip(), "running")
        log = Path(resumed["remote_dir"]) / "job.log"
        wait_for(lambda: f"resumed from step {record['snapshot']['step']}" in log.read_text(), 30)
        d.call("cancel", id=resumed["id"])
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


@pytest.fixture
def hpc(make_daemon, slurm_cluster: Cluster, short_tmp: Path) -> Iterator[DaemonProc]:  # noqa: F811
    cluster = slurm_cluster
    workdir = short_tmp / "shared"
    d = make_daemon(
        FAST_CONFIG + LIMITS + f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{workdir}"\nvenv = "{sys.prefix}"\n'
    )
    d.env.update(cluster.env)
    d.cluster = cluster  # type: ignore[attr-defined]
    d.start()
    yield d
    d.stop()
    cluster.run("scancel", "--user=root", check=False)
    wait_for(lambda: not cluster.stepds(), 30, 0.2, "the cluster's jobs to end")


def test_a_slurm_run_s_time_limit_is_its_sbatch_time_and_it_stops_with_a_deadline_snapshot_before_it(
    hpc: DaemonProc,
) -> None:
    rid = start(hpc, "python", STEPS_JOB, "0.5", "1000", opts=("--target", "hpc", "--time-limit", "20s"))
    running = hpc.wait_state(rid, "running", timeout=60)
    job_id = str(running["job"]["pid"])
    shown = hpc.cluster.run("scontrol", "show", "job", "--oneliner", job_id).stdout  # type: ignore[attr-defined]
    assert "TimeLimit=00:01:00" in shown  # 20 s, in Slurm's whole minutes
    record = stopped_at_limit(hpc, rid, "deadline", "time limit", timeout=120)
    # Asked before the limit was used up, by the run's own accounting when it was asked; not when
    # the cluster got round to recording the job's end, which a loaded machine may put past it.
    asked = record["stop"]["requested_at"]
    assert ran({"history": [h for h in record["history"] if h["time"] <= asked]}, asked) < 20
    out = hpc.cli("train", "resume", rid, "--", "python", STEPS_JOB, "0.05", str(record["snapshot"]["step"] + 3))
    assert out.returncode == 0, out.stderr
    final = hpc.wait_state(out.stdout.strip(), "succeeded", "failed", "stopped", "cancelled", timeout=120)
    assert final["state"] == "succeeded", final["message"]
