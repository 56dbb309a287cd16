"""Readiness that no remote can hold up (issue 23): the socket answers as soon as this machine's runs
are reconciled; a remote target's reconcile goes on in the background, and `status` says so."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.service.config import Config
from daemon.service.daemon import Daemon
from daemon.service.follow import Follower
from daemon.service.models import RunRecord, RunState
from executors import local
from executors.base import JobState, JobStatus, RunProbe
from tests.daemon import pods
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

PY = sys.executable
fake, pod_sshd = pods.fake, pods.pod_sshd  # the fixtures


@pytest.fixture
def silent_api() -> Iterator[str]:
    """An address that accepts connections and never answers: a cloud API that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                held.append(conn)
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_a_daemon_whose_cloud_api_hangs_answers_at_once_and_says_the_run_is_being_reconciled(
    make_daemon,
    fake: FakeRunpod,
    pod_sshd: SshServer,
    short_tmp,
    silent_api: str,
) -> None:
    d = pods.make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    rid = d.call("start", target="pods", command=[PY, "-c", "import time; time.sleep(120)"])["id"]
    d.wait_state(rid, "running", timeout=60)
    d.signal()  # SIGTERM: the daemon goes, the pod and its job stay

    d.env["RUNPOD_API_BASE_URL"] = silent_api
    d.start()  # waits for the socket to answer: it must not wait for the API
    listed = d.call("list", all=True)
    assert [r["id"] for r in listed] == [rid]
    status = d.record(rid)
    assert status.get("reconciling") is True and status["state"] == "running"
    assert "still being matched with its target" in d.cli("train", "status", rid).stdout
    local = d.call("start", command=["sh", "-c", "echo local runs start meanwhile"])["id"]
    assert d.wait_state(local, "succeeded", timeout=30)["state"] == "succeeded"

    d.signal()
    d.env["RUNPOD_API_BASE_URL"] = fake.url
    d.start()
    d.call("cancel", id=rid)
    final = d.wait_state(rid, "cancelled", "failed", timeout=120)
    assert final["state"] == "cancelled"
    assert d.record(rid).get("reconciling") is None


def test_a_run_that_ended_while_the_daemon_was_down_is_final_when_the_reconcile_returns(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its end is recorded by a task of its own (the exit's detail read, metrics collected), slow
    on a busy box: the daemon answers, and tells systemd it is ready, only once it is recorded."""
    config = {"daemon": {"state_dir": str(short_tmp / "state"), "socket": str(short_tmp / "s")}}
    daemon = Daemon(Config.model_validate(config))
    daemon.store.ensure()
    run_dir = short_tmp / "run"
    record = RunRecord(
        id="20260101-000000-000001",
        command=["true"],
        state=RunState.running,
        job={"pid": 1, "start_time": 1},
        remote_dir=str(run_dir),
    )
    daemon.records[record.id] = record
    daemon.store.save(record)

    async def probe(self: Any, runs: list[Any]) -> list[RunProbe]:
        return [RunProbe(remote_dir=d, status=JobStatus(state=JobState.exited, exit_code=0)) for _, d in runs]

    async def slow_finish(self: Follower, record: RunRecord, status: JobStatus, probe: RunProbe) -> None:
        await anyio.sleep(0.3)  # the end's record takes a while
        async with self.daemon.editing(record):
            record.job = None
            record.transition(RunState.succeeded, "exited 0")

    monkeypatch.setattr(local.LocalExecutor, "probe", probe)
    monkeypatch.setattr(Follower, "_finish", slow_finish)

    async def main() -> str:
        async with anyio.create_task_group() as tg:
            daemon._tg = tg
            await daemon.follow.reconcile()
            state = record.state.value
            tg.cancel_scope.cancel()
        return state

    assert anyio.run(main) == "succeeded"
