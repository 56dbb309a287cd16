"""The persistent helper of an SSH connection (`jobctl.py serve`), against a real sshd.

Sessions and shells are counted where the user would see them: sshd's log ("Starting session")
and a ~/.bashrc that appends a line each time a shell reads it (`SshServer(bashrc=...)`).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import pytest

from executors.base import ExecutorError, JobHandle, JobState, JobStatus, LaunchUncertain, TargetUnreachable
from executors.check import check_target
from executors.ssh import SshExecutor
from executors.ssh.helper import CRASHES_BEFORE_REST, HelperFailed, NoHelper
from tests.executors.ssh.conftest import SKIP
from tests.executors.ssh.helpers import job, make_target, wait_file, wait_state
from tests.sshd import SshServer
from trainer_plugin import rundir
from trainer_plugin.tools import jobserve


@pytest.fixture
def counting_sshd() -> Iterator[SshServer]:
    """An sshd whose sessions read a ~/.bashrc of their own, which counts the shells started."""
    if SKIP:
        pytest.skip(SKIP)
    with SshServer(bashrc="") as server:
        yield server


@pytest.fixture
async def counted(counting_sshd: SshServer, workdir: Path) -> AsyncIterator[SshExecutor]:
    ex = SshExecutor("box", make_target(counting_sshd, workdir), backoff_base=0.1, backoff_cap=0.5)
    try:
        yield ex
    finally:
        await ex.aclose()


def python_that_cannot_serve(tmp_path: Path) -> Path:
    """A target `python` that runs everything but the helper (as an interpreter that cannot would)."""
    script = tmp_path / "python-no-serve"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in */jobserve.py) echo "this python cannot serve" >&2; exit 3;; esac; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


async def changed_until(ex: SshExecutor, wanted: set[str], timeout: float = 10) -> set[str]:
    """Collect what the target's events report until every path in `wanted` was among it."""
    assert ex.events is not None
    seen: set[str] = set()
    with anyio.fail_after(timeout):
        while not wanted <= seen:
            seen |= await ex.events.changed_files()
    return seen


def helper_pid(ex: SshExecutor) -> int:
    session = ex.connection.session
    assert session is not None and session.helper is not None and session.helper.pid is not None
    return session.helper.pid


# --- the requests ----------------------------------------------------------------------------------


async def test_the_helper_answers_each_kind_of_request(executor: SshExecutor, workdir: Path) -> None:
    call = executor.remote_helper.call
    pong = await call("a ping", "ping", {})
    assert pong["pid"] != os.getpid() and pong["threads"] >= 1

    run = workdir / "every-op"
    gate = run / "gate"
    await call("a write", "write", {"path": str(run / rundir.JOB_SPEC), "data": _b64(_spec(gate))})
    assert json.loads((run / rundir.JOB_SPEC).read_text())["command"][0] == "sh"  # parents made
    started = await call("a start", "start", {"dir": str(run), "values": {"GREETING": "hi there"}})
    assert started["returncode"] == 0, started["stderr"]
    handle = JobHandle.model_validate_json(started["stdout"].strip().splitlines()[-1])
    os.killpg(handle.pid, 0)  # the job runs, in a process group of its own

    status = await call("a status", "status", {"dir": str(run), "handle": handle.model_dump()})
    assert status == {"state": "running", "exit_code": None}
    probes = await call("a probe", "probe", {"runs": [{"dir": str(run), "handle": None}, {"dir": str(workdir / "no")}]})
    assert [p["status"]["state"] for p in probes] == ["running", "lost"]
    assert probes[0]["handle"]["pid"] == handle.pid

    await wait_file(run / "job.log")
    with anyio.fail_after(5):
        while b"hi there" not in (run / "job.log").read_bytes():
            await anyio.sleep(0.02)
    read = await call("a read", "read", {"path": str(run / "job.log"), "offset": 3, "limit": 5})
    assert base64.b64decode(read["data"]) == b"there"
    fifo = run / "a-fifo"
    os.mkfifo(fifo)
    for path in (fifo, run / "missing"):  # never opened, never an error: read as empty
        assert (await call("a read", "read", {"path": str(path), "offset": 0, "limit": 10}))["data"] == ""

    watched = await call("a watch", "watch", {"dir": str(run)})
    assert watched == {"inotify": True, "job": [handle.pid, handle.start_time]}
    assert await call("an unwatch", "unwatch", {"dir": str(run)}) is None

    cancelled = await call("a cancel", "cancel", {"dir": str(run), "grace": 0.5, "handle": handle.model_dump()})
    assert cancelled["state"] == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pid, 0)

    with pytest.raises(HelperFailed, match="unknown request 'launch'"):
        await call("nonsense", "launch", {})
    blocker = workdir / "a-file"
    blocker.write_text("x")
    with pytest.raises(HelperFailed) as failed:
        await call("a write", "write", {"path": str(blocker / "under" / "file"), "data": _b64(b"x")})
    assert failed.value.errno == "ENOTDIR"


async def test_many_requests_in_flight_share_the_one_channel(
    counted: SshExecutor, counting_sshd: SshServer, workdir: Path
) -> None:
    ex = counted
    for i in range(40):
        (workdir / f"f{i}").parent.mkdir(parents=True, exist_ok=True)
        (workdir / f"f{i}").write_bytes(f"file {i}".encode() * (i + 1))
    await ex.read_from(str(workdir / "f0"), 0, 10)  # the connection and its helper are up
    sessions = counting_sshd.sessions_started()
    got: dict[int, bytes] = {}

    async def read(i: int) -> None:
        got[i] = await ex.read_from(str(workdir / f"f{i}"), 0, 1 << 20)

    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(read, i)
    assert got == {i: f"file {i}".encode() * (i + 1) for i in range(40)}
    assert counting_sshd.sessions_started() == sessions
    assert ex.remote_helper.started == 1


async def test_a_read_larger_than_one_answer_and_a_write_larger_than_one_request_come_whole(
    executor: SshExecutor, workdir: Path
) -> None:
    big = os.urandom(9 << 20)
    path = workdir / "big" / "blob"
    await executor.put_file(str(path), big)  # over SFTP: more than a request carries
    assert path.read_bytes() == big
    assert await executor.read_from(str(path), 0, len(big) + 10) == big  # in parts
    assert await executor.read_from(str(path), (5 << 20) + 1, 7) == big[(5 << 20) + 1 : (5 << 20) + 8]


# --- pushes ------------------------------------------------------------------------------------------


async def test_a_push_arrives_when_a_job_exits_and_when_a_request_or_a_proof_is_written(
    counted: SshExecutor, counting_sshd: SshServer, workdir: Path
) -> None:
    ex = counted
    assert ex.events is not None
    run = workdir / "pushed"
    gate = run / "gate"
    handle = await ex.spawn(job(run, f"while [ ! -e {gate} ]; do sleep 0.02; done; exit 5"))
    ex.events.watch(str(run))
    await ex.remote_helper.call("a ping", "ping", {})  # answered after the watch: the watch is on
    trips, sessions = ex.round_trips, counting_sshd.sessions_started()

    (run / rundir.SNAPSHOT_REQUEST).write_text("deadline\n")  # as `echo deadline > snapshot.request` would
    await changed_until(ex, {f"{run}/{rundir.SNAPSHOT_REQUEST}"})
    rundir.atomic_write(str(run / rundir.SNAPSHOT_PROOF), rundir.proof_bytes(3, "deadline", 1.0))
    await changed_until(ex, {f"{run}/{rundir.SNAPSHOT_PROOF}"})

    async with anyio.create_task_group() as tg:
        exited = anyio.Event()

        async def wait_exit() -> None:
            await ex.events.wait_exit(handle)  # type: ignore[union-attr]
            exited.set()

        tg.start_soon(wait_exit)
        await anyio.sleep(0.1)
        assert not exited.is_set()
        gate.touch()
        await changed_until(ex, {f"{run}/{rundir.EXIT_CODE}"})
        with anyio.fail_after(5):
            await exited.wait()
    # All of it came unasked: no request, no new channel, no shell.
    assert ex.round_trips == trips
    assert counting_sshd.sessions_started() == sessions
    assert (await ex.status(handle, str(run))) == JobStatus(state=JobState.exited, exit_code=5)


async def test_a_watch_started_after_the_exit_still_reports_it(executor: SshExecutor, workdir: Path) -> None:
    run = workdir / "early"
    handle = await executor.spawn(job(run, "exit 0"))
    await wait_state(executor, handle, str(run))
    assert executor.events is not None
    executor.events.watch(str(run))
    assert f"{run}/{rundir.EXIT_CODE}" in await changed_until(executor, {f"{run}/{rundir.EXIT_CODE}"})
    with anyio.fail_after(5):
        await executor.events.wait_exit(handle)


async def test_metrics_growth_is_pushed_at_most_about_once_a_second(executor: SshExecutor, workdir: Path) -> None:
    run = workdir / "progress"
    run.mkdir(parents=True)
    metrics = run / rundir.METRICS
    metrics.write_text('{"event": "begin"}\n')
    assert executor.events is not None
    executor.events.watch(str(run))
    await executor.remote_helper.call("a ping", "ping", {})  # the helper is up and watching
    with metrics.open("a") as f:
        for step in range(200):
            f.write(json.dumps({"event": "log", "step": step}) + "\n")
            f.flush()
    pushes = 0
    with anyio.move_on_after(1.5):
        while True:
            if f"{run}/{rundir.METRICS}" in await executor.events.changed_files():
                pushes += 1
    # 200 appends in a burst: pushed at least once, and coalesced (one push a second, not one per write).
    assert 1 <= pushes <= 2


def test_without_inotify_the_helper_looks_by_stat_and_still_pushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ctypes

    def no_libc(*args: object, **kwargs: object) -> None:
        raise OSError("no inotify here")

    # As on a host without inotify, from the start: closing the queue of a watcher already made
    # raced its thread's first select() (a closed descriptor there ended the thread).
    monkeypatch.setattr(ctypes, "CDLL", no_libc)
    pushed: queue.Queue[dict[str, object]] = queue.Queue()
    watcher = jobserve._Watcher(pushed.put)
    monkeypatch.undo()
    assert watcher._fd < 0
    run = tmp_path / "run"
    run.mkdir()
    assert watcher.add(str(run)) is False
    rundir.atomic_write(str(run / rundir.JOB_PID), json.dumps({"pid": 123, "start_time": 456}).encode())
    rundir.atomic_write(str(run / rundir.EXIT_CODE), b"0\n")
    message = pushed.get(timeout=15)
    assert message == {"event": "files", "dir": str(run), "names": [rundir.EXIT_CODE], "job": [123, 456]}
    # Written whole, as obd writes it: a file made empty and then filled would be two changes
    # to a poll that falls between them, and the second push would land after `remove` below.
    rundir.atomic_write(str(run / rundir.SNAPSHOT_REQUEST), b"requested\n")
    assert pushed.get(timeout=15)["names"] == [rundir.SNAPSHOT_REQUEST]
    watcher.remove(str(run))
    (run / rundir.SNAPSHOT_REQUEST).write_text("disk\n")
    with pytest.raises(queue.Empty):
        pushed.get(timeout=1.5)


# --- no shell per poll ---------------------------------------------------------------------------------


async def test_no_shell_and_no_channel_is_started_per_poll(
    counting_sshd: SshServer, counted: SshExecutor, workdir: Path
) -> None:
    runs: list[tuple[JobHandle | None, str]] = []
    for i in range(3):
        run = workdir / f"polled-{i}"
        runs.append((await counted.spawn(job(run, "sleep 30")), str(run)))
    shells, sessions = counting_sshd.shells_started(), counting_sshd.sessions_started()
    assert shells == 2  # the connection's setup, then the helper: once each
    for _ in range(20):
        probes = await counted.probe(runs)
        assert [p.status.state for p in probes] == [JobState.running] * 3
    assert (counting_sshd.shells_started(), counting_sshd.sessions_started()) == (shells, sessions)

    # Without the helper, every poll is a command: a channel and a shell each.
    plain = SshExecutor("plain", make_target(counting_sshd, workdir), helper=False)
    try:
        await plain.probe(runs)
        shells, sessions = counting_sshd.shells_started(), counting_sshd.sessions_started()
        for _ in range(5):
            await plain.probe(runs)
        assert counting_sshd.shells_started() - shells == 5
        assert counting_sshd.sessions_started() - sessions == 5
        assert plain.events is None
    finally:
        await plain.aclose()
    for handle, run_dir in runs:
        assert handle is not None
        await counted.cancel(handle, run_dir, 0.2)


# --- connections that go ---------------------------------------------------------------------------------


async def test_after_sshd_is_killed_a_request_in_flight_fails_and_the_next_connection_has_a_new_helper(
    own_executor: SshExecutor, own_sshd: SshServer, workdir: Path
) -> None:
    ex = own_executor
    assert ex.events is not None
    run = workdir / "stubborn"
    ready, gate = run / "ready", run / "gate"
    handle = await ex.spawn(job(run, f"trap '' TERM; touch {ready}; while [ ! -e {gate} ]; do sleep 0.05; done"))
    ex.events.watch(str(run))
    await wait_file(ready)
    first = helper_pid(ex)

    async def cancel() -> None:
        with pytest.raises(TargetUnreachable):
            await ex.cancel(handle, str(run), grace=30)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancel)
        with anyio.fail_after(5):
            while not (run / rundir.CANCELLING).exists():
                await anyio.sleep(0.02)
        own_sshd.kill()  # the connection, its helper and the cancel in flight with them
    os.killpg(handle.pid, 0)  # the job runs on
    own_sshd.start()
    with anyio.fail_after(15):
        while True:
            try:
                status = await ex.status(handle, str(run))
                break
            except TargetUnreachable:
                await anyio.sleep(0.1)
    assert status.state == JobState.running
    assert helper_pid(ex) != first and ex.remote_helper.started == 2
    gate.touch()  # the new helper watches the run again: its exit is pushed
    await changed_until(ex, {f"{run}/{rundir.EXIT_CODE}"})


async def test_a_start_whose_connection_drops_before_it_answers_is_uncertain_and_never_retried(
    own_executor: SshExecutor, own_sshd: SshServer, workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = own_executor
    await ex.read_from(str(workdir / "x"), 0, 1)  # the helper is up
    real_put = SshExecutor.put_file

    async def put_then_freeze(self: SshExecutor, path: str, data: bytes) -> None:
        await real_put(self, path, data)
        os.kill(helper_pid(self), signal.SIGSTOP)  # job.json is there; the start will get no answer

    monkeypatch.setattr(SshExecutor, "put_file", put_then_freeze)
    run = workdir / "uncertain"

    async def drop_soon() -> None:
        await anyio.sleep(0.5)
        own_sshd.kill()

    async with anyio.create_task_group() as tg:
        tg.start_soon(drop_soon)
        with pytest.raises(LaunchUncertain, match="whether the job started is not known"):
            await ex.spawn(job(run, "true"))
    assert not (run / rundir.JOB_PID).exists()  # it never ran, and was not tried again


async def test_a_request_the_helper_does_not_answer_in_time_fails_as_unreachable_and_the_next_one_works(
    own_sshd: SshServer, workdir: Path
) -> None:
    ex = SshExecutor("box", make_target(own_sshd, workdir))
    usual = ex.connection.op_timeout
    try:
        # Connect and start the helper with the usual timeouts: on a loaded machine that takes seconds.
        await ex.read_from(str(workdir / "x"), 0, 1)
        frozen = helper_pid(ex)
        os.kill(frozen, signal.SIGSTOP)
        ex.connection.op_timeout = 4
        with pytest.raises(TargetUnreachable, match="did not answer a probe"):
            await ex.probe([(None, str(workdir / "r"))])
        os.kill(frozen, signal.SIGCONT)
        ex.connection.op_timeout = usual
        probes = await ex.probe([(None, str(workdir / "r"))])
        assert probes[0].status.state == JobState.lost and helper_pid(ex) != frozen
    finally:
        await ex.aclose()


async def test_a_helper_that_dies_is_replaced_and_one_that_keeps_dying_is_given_a_rest(
    counted: SshExecutor, counting_sshd: SshServer, workdir: Path
) -> None:
    ex = counted
    runs: list[tuple[JobHandle | None, str]] = [(None, str(workdir / "r"))]
    await ex.probe(runs)
    for n in range(1, CRASHES_BEFORE_REST + 1):
        pid = helper_pid(ex)
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(5):  # the channel closes once it is gone
            while (
                ex.connection.session is not None
                and ex.connection.session.helper is not None
                and ex.connection.session.helper.alive
            ):
                await anyio.sleep(0.02)
        assert (await ex.probe(runs))[0].status.state == JobState.lost
        assert ex.remote_helper.started == (n + 1 if n < CRASHES_BEFORE_REST else n)
    ok, detail = await ex.remote_helper.check()
    assert ok and detail.startswith("fallback: it ended 3 times") and "SIGKILL" in detail
    shells = counting_sshd.shells_started()
    await ex.probe(runs)  # through a command now
    assert counting_sshd.shells_started() == shells + 1
    assert ex.connects == 1  # the connection itself never went


# --- fallback ---------------------------------------------------------------------------------------


async def test_a_target_whose_python_cannot_run_the_helper_works_through_commands_and_check_says_so(
    counting_sshd: SshServer, workdir: Path, tmp_path: Path
) -> None:
    ex = SshExecutor(
        "old", make_target(counting_sshd, workdir, python=str(python_that_cannot_serve(tmp_path))), events_poll=0.2
    )
    try:
        run = workdir / "r"
        gate = run / "gate"
        handle = await ex.spawn(job(run, f"echo started; while [ ! -e {gate} ]; do sleep 0.02; done; exit 2"))
        assert ex.remote_helper.started == 0
        assert (await ex.status(handle, str(run))).state == JobState.running
        await ex.put_file(str(run / rundir.SNAPSHOT_REQUEST), b"requested\n")
        assert (run / rundir.SNAPSHOT_REQUEST).read_bytes() == b"requested\n"
        shells = counting_sshd.shells_started()
        probes = await ex.probe([(handle, str(run))])
        assert probes[0].request == "requested\n"  # the raw word, as written
        assert counting_sshd.shells_started() == shells + 1  # one command, one shell

        assert ex.events is not None
        ex.events.watch(str(run))
        with anyio.fail_after(2):
            await ex.events.wait_exit(handle)  # nothing can push it: at once, and the polls see it
            assert await ex.events.changed_files() == {""}  # "read every run", at the poll rate
        gate.touch()
        assert await wait_state(ex, handle, str(run)) == JobStatus(state=JobState.exited, exit_code=2)
        assert (await ex.read_from(str(run / "job.log"), 0, 100)) == b"started\n"
        checks = {c["check"]: c for c in await check_target(ex)}
        assert checks["helper"]["ok"]
        assert checks["helper"]["detail"].startswith("fallback: exit 3: this python cannot serve")
    finally:
        await ex.aclose()


async def test_without_a_helper_the_follow_is_asked_to_read_every_run_once_per_poll_however_busy_the_target(
    counting_sshd: SshServer, workdir: Path, tmp_path: Path
) -> None:
    python = str(python_that_cannot_serve(tmp_path))
    ex = SshExecutor("old", make_target(counting_sshd, workdir, python=python), events_poll=0.3)
    assert ex.events is not None
    try:
        ex.events.watch(str(workdir / "r"))
        asked = 0
        async with anyio.create_task_group() as tg:

            async def poll_hard() -> None:
                while True:  # every request finds no helper: none of it may turn into extra reads
                    await ex.probe([(None, str(workdir / "r"))])

            tg.start_soon(poll_hard)
            with anyio.move_on_after(1.5):
                while True:
                    if await ex.events.changed_files() == {""}:
                        asked += 1
            tg.cancel_scope.cancel()
        assert 1 <= asked <= 6  # about 1.5 s / 0.3 s, not once per probe
    finally:
        await ex.aclose()


async def test_a_missing_python_leaves_no_helper_and_check_says_why(shared_sshd: SshServer, workdir: Path) -> None:
    ex = SshExecutor("nopy", make_target(shared_sshd, workdir, python="/nonexistent/python3"))
    try:
        with pytest.raises(NoHelper, match=r"Python \('/nonexistent/python3'\) was not found"):
            await ex.remote_helper.call("a ping", "ping", {})
        with pytest.raises(ExecutorError, match=r"Python .*not found.*set `python` or `venv`"):
            await ex.probe([(None, str(workdir / "r"))])
        checks = {c["check"]: c for c in await check_target(ex)}
        assert checks["helper"]["detail"].startswith("fallback: the target's Python")
        assert not checks["python found"]["ok"]
    finally:
        await ex.aclose()


async def test_targets_check_says_the_helper_is_ok(executor: SshExecutor) -> None:
    checks = {c["check"]: c for c in await check_target(executor)}
    assert checks["helper"]["ok"]
    assert checks["helper"]["detail"].startswith("ok: jobctl serve (pid ")
    assert f"pid {helper_pid(executor)}" in checks["helper"]["detail"]


# --- small helpers -------------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _spec(gate: Path) -> bytes:
    script = f'echo "$GREETING"; while [ ! -e {gate} ]; do sleep 0.05; done'
    return json.dumps({"command": ["sh", "-c", script], "cwd": None, "pythonpath": []}).encode()
