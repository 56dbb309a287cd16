"""Long loops share the event loop by time (daemon/service/turns.py, issue 33): a loop over
thousands of runs lets others in once it has held the loop for its share, and what it makes is
right though others changed runs meanwhile. Counted with a clock of the test's or a share of 0
(a turn after every item), never timed."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.lowlevel
import pytest
from pydantic import BaseModel

from daemon.service import server, turns
from daemon.service.api import ListRunsRequest, Peer
from daemon.service.config import Config, DaemonSection
from daemon.service.daemon import Daemon
from daemon.service.handlers import Handlers
from daemon.service.models import RunRecord, RunState
from daemon.service.server import ControlServer
from daemon.service.turns import Share
from executors import local

ROOT = Peer(uid=0, gid=0)


def test_a_loop_lets_others_in_once_it_has_held_the_event_loop_for_its_share() -> None:
    now = [0]  # the test's clock, in steps: each item takes one
    share = Share(3, clock=lambda: now[0])
    ran_between: list[int] = []  # the items done each time another task ran

    async def main() -> None:
        done = [0]

        async def other() -> None:
            while done[0] < 10:
                ran_between.append(done[0])
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(other)
            await anyio.lowlevel.checkpoint()  # the other task is waiting for its turn
            ran_between.clear()
            for _ in range(10):
                await share.turn()
                now[0] += 1
                done[0] += 1

    anyio.run(main)
    assert share.turns == 3  # after items 3, 6 and 9
    assert ran_between == [3, 6, 9]


def test_roots_list_of_thousands_changed_lets_others_in_and_answers_the_runs_as_they_are_then(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(turns, "SHARE", 0.0)
    daemon = Daemon(
        Config.model_validate({"daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")}})
    )
    runs = []
    for n in range(2000):
        record = RunRecord(id=f"20260101-000000-{n:06x}", command=["true"], state=RunState.queued, created=1000.0 + n)
        daemon.records[record.id] = record
        runs.append(record)
    handlers = Handlers(daemon)
    turned = [0]

    async def main() -> bytes:
        async def others() -> None:  # another caller's edits, at each of the list's turns
            while True:
                await anyio.lowlevel.checkpoint()
                turned[0] += 1
                record = runs[turned[0] % len(runs)]
                record.message = f"changed at turn {turned[0]}"
                daemon.touch(record)

        async with anyio.create_task_group() as tg:
            tg.start_soon(others)
            answer = await handlers.list_runs(ListRunsRequest(op="list"), ROOT)
            tg.cancel_scope.cancel()
        return bytes(answer)

    entries = json.loads(anyio.run(main))
    assert turned[0] > 1000  # others were let in while 2,000 entries were encoded
    assert [e["id"] for e in entries] == [r.id for r in runs]
    assert [e["message"] for e in entries] == [r.message for r in runs]  # each as it is when answered
    assert sum(e["message"].startswith("changed at turn") for e in entries) > 1000


def test_the_job_wrapper_is_started_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a process holds its caller until the child has exec'd: not the event loop's thread."""
    started: list[tuple[list[str], bytes, bool]] = []

    def run(argv: list[str], input: bytes, **kwargs: Any) -> Any:
        started.append((argv, input, threading.current_thread() is threading.main_thread()))
        return local.subprocess.CompletedProcess(argv, 0, b'{"pid": 1}\n', b"")

    monkeypatch.setattr(local.subprocess, "run", run)
    result = anyio.run(local.LocalExecutor._run_wrapper, ["obd-wrapper", "--x"], b"secrets")
    assert started == [(["obd-wrapper", "--x"], b"secrets", False)]
    assert result.returncode == 0 and result.stdout == b'{"pid": 1}\n'


def test_the_job_wrapper_that_exits_without_reading_its_secrets_is_a_failed_exit() -> None:
    result = anyio.run(local.LocalExecutor._run_wrapper, ["sh", "-c", "echo no scope >&2; exit 3"], b"x" * (1 << 20))
    assert result.returncode == 3 and result.stderr == b"no scope\n"


class Ping(BaseModel):
    op: Literal["ping"]


class PingOnly:
    """A handler of one op, answered at once."""

    def model(self, op: str) -> type[BaseModel] | None:
        return Ping if op == "ping" else None

    async def __call__(self, request: Any, peer: Peer) -> str:
        return "pong"

    def session_model(self, op: str) -> None:
        return None

    async def run_session(self, *args: Any) -> None:
        raise AssertionError("no session here")


def test_a_ping_is_answered_in_a_few_turns_of_the_event_loop_however_busy_it_is(short_tmp: Path) -> None:
    """Each turn of a busy daemon's loop is a step of every task that has one to take: a request
    answered in the connection's own task (its caller's hang-up watched by a callback, not a task
    of its own) takes 6 turns here, the client's in this loop included; 11 with two tasks a request."""
    server = ControlServer(DaemonSection(socket=str(short_tmp / "s"), state_dir=str(short_tmp / "state")), PingOnly())
    turns_taken: list[int] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            ticks = [0]

            async def busy() -> None:  # another task with a step to take at every turn
                while True:
                    ticks[0] += 1
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(busy)
            async with await anyio.connect_unix(str(short_tmp / "s")) as stream:
                for _ in range(5):
                    before = ticks[0]
                    await stream.send(b'{"op": "ping"}\n')
                    reply = b""
                    while not reply.endswith(b"\n"):
                        reply += await stream.receive()
                    assert json.loads(reply) == {"ok": True, "result": "pong"}
                    turns_taken.append(ticks[0] - before)
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert max(turns_taken) <= 8, turns_taken


def test_a_long_answer_is_encoded_a_share_at_a_time_and_reads_back_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep's cancel answers its 1,000 members' records (megabytes): encoded member by member,
    others let in between, not in one step of the event loop."""
    monkeypatch.setattr(turns, "SHARE", 0.0)
    runs = [{"id": f"run-{n}", "state": "cancelled", "history": [{"reason": "x" * 50}] * 5} for n in range(500)]
    message = {"ok": True, "result": {"sweep": "sweep-1", "name": "lr", "runs": runs, "notes": ["a note"]}}
    ticks = [0]

    async def main() -> bytes:
        async with anyio.create_task_group() as tg:

            async def others() -> None:
                while True:
                    ticks[0] += 1
                    await anyio.lowlevel.checkpoint()

            tg.start_soon(others)
            pieces = await server._reply(message)
            tg.cancel_scope.cancel()
        return b"".join(pieces)

    line = anyio.run(main)
    assert line.endswith(b"}\n") and line.count(b"\n") == 1
    assert json.loads(line) == message
    assert ticks[0] >= len(runs)
    assert anyio.run(server._reply, {"ok": True, "result": runs[:3]}) == [
        json.dumps({"ok": True, "result": runs[:3]}).encode() + b"\n"
    ]
