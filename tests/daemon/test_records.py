"""The daemon's runs with the live ones kept apart (daemon/service/records.py): what the queue, the
GPUs' holders and preemption look at many times a second is the runs not ended, however long the
box's history. Looked at by what is touched, never timed."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.service import policy
from daemon.service.api import ApiError, Peer
from daemon.service.config import Config
from daemon.service.daemon import Daemon
from daemon.service.models import RunRecord, RunState
from daemon.service.records import Records


def run(n: int, state: RunState, **fields: Any) -> RunRecord:
    return RunRecord(id=f"20260101-000000-{n:06x}", state=state, command=["true"], created=1000.0 + n, **fields)


def test_the_live_runs_are_those_not_ended_and_an_ended_run_never_comes_back() -> None:
    queued, running, done = run(1, RunState.queued), run(2, RunState.running), run(3, RunState.succeeded)
    records = Records({r.id: r for r in (queued, running, done)})
    assert records.live() == [queued, running]
    assert records.ended_since(0) == [done]
    running.transition(RunState.cancelled, "cancelled")  # in place, as `editing` changes a record
    assert records.live() == [queued]
    assert records.ended_since(1) == [running]  # found ended by that look, after the first
    assert records.ended_since(2) == []
    later = run(4, RunState.queued)
    records[later.id] = later
    assert records.live() == [queued, later]
    assert list(records) == [queued.id, running.id, done.id, later.id]  # still every run, by id


class History(Records):
    """Records whose every look at all runs fails: what a queue pass must not do."""

    def values(self) -> Any:
        raise AssertionError("looked at every run, the ended ones too")

    def items(self) -> Any:
        raise AssertionError("looked at every run, the ended ones too")

    def __iter__(self) -> Iterator[str]:
        raise AssertionError("looked at every run, the ended ones too")


def test_a_queue_pass_and_the_gpus_holders_never_look_at_the_ended_runs(tmp_path: Path) -> None:
    config = Config.model_validate(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")},
            "targets": {"local": {"kind": "local", "gpus": ["0"]}},
        }
    )
    daemon = Daemon(config)
    daemon.store.ensure()
    holder = run(0, RunState.running, gpus=["0"], gpus_wanted=1, job={"pid": 1})
    waiting = [run(n, RunState.queued, gpus_wanted=1, priority=5) for n in range(1, 4)]
    history = [run(n, RunState.succeeded) for n in range(10, 1010)]
    daemon.records = History({r.id: r for r in (holder, *waiting, *history)})
    daemon.inventory._clear.update(r.id for r in history)  # as a first look at them leaves it
    daemon.inventory._ended_seen = (daemon.records, len(history))

    anyio.run(daemon.scheduler.schedule)

    assert daemon.inventory.held("local") == {"0": holder.id}
    assert [r.id for r in daemon.scheduler.queued("local")] == [r.id for r in waiting]
    assert all(r.state == RunState.queued for r in waiting)  # the GPU is the holder's: they wait


def test_the_queued_runs_are_kept_apart_oldest_first_and_a_run_that_moves_is_found_where_it_went() -> None:
    later, older = run(2, RunState.queued), run(1, RunState.queued)
    running = run(3, RunState.running, job={"pid": 1})
    launching = run(4, RunState.preparing)
    records = Records({r.id: r for r in (later, older, running, launching)})
    assert records.queued() == [older, later]  # by creation, not by when they were added
    assert records.active() == [running, launching]

    older.transition(RunState.preparing, "leaving the queue")  # no word to the records: found by a look
    assert records.queued() == [later]
    assert records.active() == [running, launching, older]
    launching.transition(RunState.queued, "back in the queue")
    assert records.active() == [running, older]
    assert records.queued() == [later, launching]
    later.transition(RunState.cancelled, "cancelled while queued")
    running.transition(RunState.succeeded, "exited 0")
    assert records.live() == [older, launching]  # in the order they were added
    assert records.ended_since(0) == [later, running]
    assert records.queued() == [launching] and records.active() == [older]


def test_a_run_that_left_the_queue_is_active_at_once_when_the_daemon_is_told_it_changed(tmp_path: Path) -> None:
    daemon = Daemon(
        Config.model_validate({"daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")}})
    )
    waiting = run(1, RunState.queued, gpus_wanted=1)
    daemon.records[waiting.id] = waiting
    assert daemon.records.active() == []
    waiting.gpus = ["0"]
    waiting.transition(RunState.preparing, "leaving the queue with GPU 0")
    daemon.touch(waiting)  # as every edit ends; no look at the queue in between
    assert daemon.records.active() == [waiting]
    assert daemon.inventory.held("local") == {"0": waiting.id}


SEALED = [False]


class Sealed(RunRecord):
    """A queued run whose target, GPUs and preemption may not be read once sealed: what the GPUs'
    holders, preemption and the follow must never look at."""

    def __getattribute__(self, name: str) -> Any:
        if SEALED[0] and name in ("target", "gpus", "preemption", "priority"):
            raise AssertionError(f"a queued run's {name} was looked at")
        return super().__getattribute__(name)


def test_the_gpus_holders_preemption_and_the_follow_never_look_at_a_queued_run(tmp_path: Path) -> None:
    config = Config.model_validate(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")},
            "targets": {"local": {"kind": "local", "gpus": ["0", "1"]}},
        }
    )
    daemon = Daemon(config)
    holder = run(0, RunState.running, gpus=["0"], gpus_wanted=1, job={"pid": 1})
    daemon.records[holder.id] = holder
    for n in range(1, 1001):
        queued = Sealed(id=f"20260101-000000-{n:06x}", state=RunState.queued, command=["true"], gpus_wanted=2)
        daemon.records[queued.id] = queued
    SEALED[0] = True
    try:
        assert daemon.inventory.held("local") == {"0": holder.id}
        assert daemon.preemptor.pausing("local") == []
        assert [c.run_id for c in daemon.preemptor.candidates("local", None, time.time() + 3600)] == []
        assert daemon.follow._runs("local", RunState.running) == [holder]
    finally:
        SEALED[0] = False
    assert len(daemon.records.queued()) == 1000


def test_each_owner_s_queued_count_follows_runs_that_join_leave_move_and_are_replaced() -> None:
    rng = random.Random(33)
    records = Records()
    states = [RunState.queued, RunState.queued, RunState.running, RunState.preparing, RunState.cancelled]
    for step in range(3000):
        n = rng.randrange(60)
        rid = f"20260101-000000-{n:06x}"
        what = rng.random()
        if rid not in records or what < 0.2:  # a new record, or one put in place of it
            owner = rng.choice([0, 1000, 1001, None])
            records[rid] = run(n, rng.choice(states), owner_uid=owner, job={"pid": 1} if rng.random() < 0.2 else None)
        elif what < 0.7 and not records[rid].state.final:
            record = records[rid]
            record.state = rng.choice(states)  # in place, as an edit changes it
            if rng.random() < 0.7:
                records.touched(record)  # told, as every edit ends; else found by the next look
        elif what < 0.75:
            del records[rid]
        if step % 7 == 0:
            records.queued()
            records.active()
        else:
            continue
        for owner in (0, 1000, 1001, None, 5):
            assert records.queued_count(owner) == sum(1 for r in records.queued() if r.owner_uid == owner)


class Unread(RunRecord):
    """A queued run of another member whose owner may not be read once sealed."""

    def __getattribute__(self, name: str) -> Any:
        if SEALED[0] and name == "owner_uid":
            raise AssertionError("another member's queued run was looked at")
        return super().__getattribute__(name)


def test_a_capped_member_s_start_counts_their_queued_runs_with_no_look_at_anyone_else_s(tmp_path: Path) -> None:
    config = Config.model_validate(
        {
            "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")},
            "policy": {"max_queued_runs_per_user": 3},
        }
    )
    daemon = Daemon(config)
    for n in range(1, 1001):  # alice's
        queued = Unread(id=f"20260101-000000-{n:06x}", state=RunState.queued, command=["true"], owner_uid=1000)
        daemon.records[queued.id] = queued
    bob = Peer(uid=1001, gid=1001)
    for n in range(2000, 2003):
        mine = run(n, RunState.queued, owner_uid=1001)
        daemon.records[mine.id] = mine
    SEALED[0] = True
    try:
        policy.check_queued(daemon, bob, 0, "obd train start")
        with pytest.raises(ApiError, match="has 3 runs queued, and it would make 4, over this daemon's cap of 3"):
            policy.check_queued(daemon, bob, 1, "obd train start")
        daemon.records[mine.id].transition(RunState.cancelled, "cancelled")
        daemon.touch(daemon.records[mine.id])
        policy.check_queued(daemon, bob, 1, "obd train start")  # room again, as soon as the daemon is told
    finally:
        SEALED[0] = False


def test_the_queue_keeps_its_runs_in_age_order_as_they_come_and_go_without_sorting_again() -> None:
    """Each run that joins the queue is put in its place and each that leaves taken out: 5,000
    queued runs are not sorted again at the next look after every start."""
    records = Records()
    rng = random.Random(2)
    for n in range(200):
        record = RunRecord(id=f"20260101-000000-{n:06x}", command=["true"], state=RunState.queued, created=rng.random())
        records[record.id] = record
    ordered = records.queued()
    kept = records._ordered
    for n in range(200):
        record = rng.choice(list(records.values()))
        if rng.random() < 0.5 and record.state == RunState.queued:
            record.transition(RunState.preparing, "launched")
            records.touched(record)
        else:
            fresh = RunRecord(
                id=f"20260102-000000-{n:06x}", command=["true"], state=RunState.queued, created=rng.random()
            )
            records[fresh.id] = fresh
        ordered = records.queued()
        assert [r.id for r in ordered] == [
            r.id for r in sorted(records.values(), key=lambda r: (r.created, r.id)) if r.state == RunState.queued
        ]
    assert records._ordered is kept  # put in place and taken out, never sorted anew
