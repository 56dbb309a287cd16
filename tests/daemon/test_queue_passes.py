"""How often the queue looks at its runs (issue 33, item 1): with thousands queued, a pass looks at
each of them, and every start or end of anyone's run kicks the queue; the kicks that come closer
than `PASS_GAP` make one pass. With a few queued, every kick makes its own. Counted, never timed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.service import queue
from daemon.service.config import Config
from daemon.service.models import RunRecord, RunState
from daemon.service.queue import MANY, Scheduler
from daemon.service.records import Records


class Host:
    """What the queue's loop reads of the daemon between two passes: its config."""

    def __init__(self, state_dir: Path) -> None:
        self.config = Config.model_validate(
            {"daemon": {"state_dir": str(state_dir)}, "targets": {"local": {"kind": "local", "gpus": ["0"]}}}
        )
        self.records = Records()


def passes_after_kicks(tmp_path: Path, queued: int, kicks: int) -> int:
    """The passes the queue made by the time `kicks` kicks, each after every task waited, are taken."""
    scheduler = Scheduler(Host(tmp_path))  # type: ignore[arg-type]
    waiting = [RunRecord(id=f"20260101-000000-{n:06x}", state=RunState.queued) for n in range(queued)]
    passes = 0

    async def schedule(*_: Any) -> None:
        nonlocal passes
        passes += 1
        scheduler._left = list(waiting)  # what a pass leaves queued

    scheduler.schedule = schedule  # type: ignore[method-assign]

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(scheduler.run)
            await anyio.wait_all_tasks_blocked()
            for _ in range(kicks):
                scheduler.kick()  # a run started or ended
                await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()

    anyio.run(main)
    return passes


def test_with_thousands_queued_the_kicks_that_come_close_together_make_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(queue, "PASS_GAP", 600.0)  # far longer than the test: no kick is let through
    assert passes_after_kicks(tmp_path, 5000, kicks=20) == 1  # the first; the next waits for the gap


def test_with_a_few_queued_every_kick_makes_its_own_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(queue, "PASS_GAP", 600.0)
    assert passes_after_kicks(tmp_path, MANY, kicks=20) == 21
