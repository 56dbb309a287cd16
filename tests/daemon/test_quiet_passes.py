"""Quiet passes of the queue (daemon/service/queue.py, `Scheduler._quiet`): with thousands queued,
most passes follow a change that cannot start any of them (another user's run with no GPU began
or ended); such a pass looks at no queued run, and considers preemption only. Every change that
can start one (a GPU freed, a run queued or changed, a drain, the configuration) makes a full pass.
Looked at by what is read and started, never timed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from daemon.service import queue, turns
from daemon.service.config import Config
from daemon.service.daemon import Daemon
from daemon.service.models import RunRecord, RunState

SEALED = [False]


class Sealed(RunRecord):
    """A queued run that may not be looked at once sealed."""

    def __getattribute__(self, name: str) -> Any:
        if SEALED[0] and name in ("target", "priority", "gpus_wanted", "sweep", "limits", "created"):
            raise AssertionError(f"a queued run's {name} was looked at")
        return super().__getattribute__(name)


class Box:
    """A daemon object (no server, no jobs) whose queue's launches are noted, not made."""

    def __init__(self, tmp_path: Path, gpus: list[str], queued: int, wants: int) -> None:
        config = {
            "daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")},
            "targets": {"local": {"kind": "local", "gpus": gpus}},
        }
        self.daemon = Daemon(Config.model_validate(config))
        self.daemon.store.ensure()
        self.holder = self.add(
            RunRecord, 0, RunState.running, gpus=["0"], gpus_wanted=1, job={"pid": 1}, owner_uid=1001
        )
        self.queued = [  # the head is looked at (preemption is considered for it): the rest may not be
            self.add(RunRecord if n == 1 else Sealed, n, RunState.queued, gpus_wanted=wants, owner_uid=1001)
            for n in range(1, queued + 1)
        ]
        self.launched: list[tuple[str, list[str]]] = []
        self.considered: list[str] = []

        async def launch_queued(record: RunRecord, devices: list[str]) -> None:
            self.launched.append((record.id, devices))
            async with self.daemon.editing(record):
                record.gpus = devices
                record.transition(RunState.preparing, "leaving the queue")

        real_consider = self.daemon.preemptor.consider

        async def consider(head: RunRecord, held: dict[str, str]) -> list[str]:
            self.considered.append(head.id)
            return await real_consider(head, held)

        self.daemon.launcher.launch_queued = launch_queued  # type: ignore[method-assign]
        self.daemon.preemptor.consider = consider  # type: ignore[method-assign]

    def add(self, kind: type[RunRecord], n: int, state: RunState, **fields: Any) -> RunRecord:
        record = kind(id=f"20260101-000000-{n:06x}", command=["sleep"], state=state, created=1000.0 + n, **fields)
        self.daemon.records[record.id] = record
        return record

    def passes(self, count: int = 1) -> None:
        async def main() -> None:
            for _ in range(count):
                await self.daemon.scheduler.schedule()

        anyio.run(main)

    def change(self, record: RunRecord, state: RunState, why: str) -> None:
        record.transition(state, why)
        self.daemon.touch(record)  # as every edit ends

    def cpu_run_ended(self, n: int) -> None:
        """Another user's run with no GPU, started and ended."""
        record = self.add(RunRecord, 10_000 + n, RunState.preparing, owner_uid=1002)
        self.change(record, RunState.running, "launched")
        self.change(record, RunState.succeeded, "exited 0")


@pytest.fixture(autouse=True)
def unsealed(monkeypatch: pytest.MonkeyPatch) -> Any:
    # However slow the box: the messages put off by a pass and the last full pass stay good for
    # the whole test (a test that means otherwise says so).
    monkeypatch.setattr(queue, "MESSAGES_EVERY", 3600.0)
    monkeypatch.setattr(queue, "MEMO_FOR", 3600.0)
    yield
    SEALED[0] = False


def test_a_pass_after_another_users_run_with_no_gpu_ended_looks_at_no_queued_run(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(2)  # the first looks at every run
    SEALED[0] = True
    for n in range(5):
        box.cpu_run_ended(n)
        box.passes()
    SEALED[0] = False
    assert box.launched == []
    assert all(r.state == RunState.queued for r in box.queued)
    assert box.considered[-5:] == [box.queued[0].id] * 5  # preemption is considered by each quiet pass


def test_the_head_starts_at_the_first_pass_after_its_gpu_is_freed(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(3)
    box.change(box.holder, RunState.succeeded, "exited 0")
    box.passes()
    assert box.launched == [(box.queued[0].id, ["0"])]


def test_a_run_queued_by_a_user_who_holds_no_gpu_starts_ahead_of_thousands_at_the_next_pass(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0", "1"], queued=1000, wants=2)  # GPU 1 free, but each of those wants two
    box.passes(3)
    assert box.launched == []
    bob = box.add(RunRecord, 5000, RunState.queued, gpus_wanted=1, owner_uid=1002)
    box.daemon.touch(bob)
    box.passes()
    assert box.launched == [(bob.id, ["1"])]


def test_a_queued_run_changed_makes_a_full_pass_that_sees_the_change(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(3)
    last = box.queued[-1]
    last.priority = 10  # `obd train edit` of a queued run ends with a touch
    box.daemon.touch(last)
    box.passes()
    assert box.considered[-1] == last.id  # the head now


def test_a_drain_ends_the_quiet_passes(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(3)
    box.daemon.preemptor.drains.set("local", True)
    box.change(box.holder, RunState.succeeded, "exited 0")
    box.passes()
    assert box.launched == []  # drained: nothing starts
    box.daemon.preemptor.drains.set("local", False)
    box.passes()
    assert box.launched == [(box.queued[0].id, ["0"])]


def test_a_change_made_without_a_word_to_the_daemon_is_found_once_the_last_full_pass_is_too_old(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(3)
    last = box.queued[-1]
    last.priority = 10  # no touch
    box.passes()
    assert box.considered[-1] == box.queued[0].id  # the change was never told
    monkeypatch.setattr(queue, "MEMO_FOR", 0.0)
    box.passes()
    assert box.considered[-1] == last.id


def test_a_holder_that_ended_without_a_word_to_the_daemon_frees_its_gpu_at_the_next_pass(tmp_path: Path) -> None:
    box = Box(tmp_path, ["0"], queued=1000, wants=1)
    box.passes(3)
    box.holder.transition(RunState.succeeded, "exited 0")  # no touch: the holders' look finds it
    box.passes()
    assert box.launched == [(box.queued[0].id, ["0"])]


def test_a_run_queued_while_a_full_pass_runs_is_looked_at_by_the_next_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(turns, "SHARE", 0.0)  # the pass lets others in after each run it looks at
    box = Box(tmp_path, ["0", "1"], queued=1000, wants=2)
    box.passes(3)
    box.daemon.touch(box.queued[-1])  # a change: the next pass is a full one, which starts nothing

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(box.daemon.scheduler.schedule)
            await anyio.lowlevel.checkpoint()  # the pass has begun; it lets others in after each run
            bob = box.add(RunRecord, 5000, RunState.queued, gpus_wanted=1, owner_uid=1002)
            box.daemon.touch(bob)
        assert box.launched == []  # the pass had begun without it
        await box.daemon.scheduler.schedule()
        assert box.launched == [(bob.id, ["1"])]

    anyio.run(main)
