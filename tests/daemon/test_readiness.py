"""Readiness that no remote can hold up (issue 23): the socket answers as soon as this machine's runs
are reconciled; a remote target's reconcile goes on in the background, and `status` says so."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator

import pytest

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
