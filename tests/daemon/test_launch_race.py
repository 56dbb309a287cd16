"""A run leaving the queue is this daemon's launch from the moment it is `preparing`: the follow's
look for runs an earlier daemon left `preparing` (at each loop's start) must never take it back to
the queue while that state is being saved, which launched it a second time (two jobs on one GPU)
and, under the guarded state machine, ended the daemon (`running -> running`). No process, no
daemon: the launcher and the follow's decision against a host that records what they see."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from daemon.service import launch
from daemon.service.api import StartRequest
from daemon.service.models import RunRecord, RunState
from daemon.service.records import Records

pytestmark = pytest.mark.anyio


class Host:
    """The little of the daemon `Launcher.launch_queued` uses; each save notes what a follow
    looking at that moment would see."""

    def __init__(self) -> None:
        self.records = Records()
        self.launcher: launch.Launcher | None = None
        self.saved: list[tuple[RunState, bool]] = []  # (state, taken for this daemon's launch)
        self.started: list[Any] = []

    @asynccontextmanager
    async def editing(self, record: RunRecord) -> AsyncIterator[RunRecord]:
        yield record
        assert self.launcher is not None
        self.saved.append((record.state, record.id in self.launcher.launching))

    def start_soon(self, func: Any, *args: Any) -> None:
        self.started.append((func, args))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_run_is_launching_before_its_leaving_the_queue_is_saved(monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host()
    launcher = launch.Launcher(host)  # type: ignore[arg-type]
    host.launcher = launcher
    req = StartRequest(op="start", command=["true"])
    monkeypatch.setattr(launch, "load_spec", lambda daemon, run_id: (req, None))
    record = RunRecord(id="r1")
    record.transition(RunState.queued, "waiting for 1 GPU")
    host.records[record.id] = record
    await launcher.launch_queued(record, ["0"])
    assert record.state == RunState.preparing and record.gpus == ["0"]
    # When `preparing` reached the disk (and the follow could look), the run was already this
    # daemon's launch: the follow leaves it alone.
    assert host.saved == [(RunState.preparing, True)]
    assert len(host.started) == 1


async def test_a_cancelled_run_is_not_left_marked_as_launching(monkeypatch: pytest.MonkeyPatch) -> None:
    host = Host()
    launcher = launch.Launcher(host)  # type: ignore[arg-type]
    host.launcher = launcher
    monkeypatch.setattr(launch, "load_spec", lambda daemon, run_id: (StartRequest(op="start", command=["true"]), None))
    record = RunRecord(id="r2")
    record.transition(RunState.cancelled, "cancelled while queued")
    await launcher.launch_queued(record, ["0"])
    assert record.state == RunState.cancelled and not launcher.launching and not host.started
