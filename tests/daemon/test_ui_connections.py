"""`obd ui` bounds its connections: another local user's idle sockets cannot pile up threads (issue 34, item 20).

Any local user can connect to the view's port. Each connection used to hold a thread with no
read timeout, so 200 idle sockets meant 199 threads. Now a connection that sends nothing for
`OBD_UI_IDLE_TIMEOUT` seconds is closed, at most `OBD_UI_MAX_CONNECTIONS` are open at once (a new
one takes the place of the longest idle), and when every one is busy a new one gets a 503 that
says why. A real daemon and a real `obd ui` process; the idle clients are raw sockets.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from http.client import HTTPConnection

import pytest

from tests.conftest import REPO, DaemonProc, wait_for
from tests.daemon.test_ui import PY, Ui

CAP = 8


def start_ui(daemon: DaemonProc, connections: int, idle_timeout: float) -> Ui:
    env = {**daemon.env, "OBD_UI_MAX_CONNECTIONS": str(connections), "OBD_UI_IDLE_TIMEOUT": str(idle_timeout)}
    proc = subprocess.Popen(
        [PY, "-m", "daemon.cli", "ui", "--port", "0"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Ui(proc)


@pytest.fixture
def capped(daemon: DaemonProc) -> Iterator[Ui]:
    """A view with room for CAP connections and a timeout far longer than any test waits."""
    ui = start_ui(daemon, CAP, 600)
    yield ui
    ui.close()


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def idle_socket(ui: Ui, stack: ExitStack) -> socket.socket:
    """A connection that never sends a byte; reads wait up to 60 s, the test's bound for any event here."""
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", ui.port), timeout=60))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Wait for the server's end: EOF (or a reset) before this socket's 60 s read timeout."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def get(ui: Ui, path: str, cookie: str) -> tuple[int, bytes]:
    connection = HTTPConnection("127.0.0.1", ui.port, timeout=60)
    try:
        connection.request("GET", f"{ui.base}{path}".removeprefix(ui.origin), headers={"Cookie": cookie})
        reply = connection.getresponse()
        return reply.status, reply.read()
    finally:
        connection.close()


def test_idle_sockets_beyond_the_cap_close_the_longest_idle_and_the_page_is_still_answered(
    capped: Ui,
) -> None:
    cookie = capped.login()
    baseline = threads(capped.proc.pid)
    most = baseline
    with ExitStack() as stack:
        sockets = []
        for _ in range(5 * CAP):
            sockets.append(idle_socket(capped, stack))
            most = max(most, threads(capped.proc.pid))
        # Each connection past the cap took the place of the longest idle: the first ones see EOF.
        evicted = sockets[: 4 * CAP]
        assert all(closed_by_server(sock) for sock in evicted), "the oldest idle connections were never closed"
        most = max(most, threads(capped.proc.pid))
        # While CAP idle sockets are still open, the page's own request is answered.
        status, body = get(capped, "/api/runs", cookie)
        assert status == 200 and b'"runs"' in body, (status, body)
        most = max(most, threads(capped.proc.pid))
    # At most CAP handler threads (one more may be ending just as it is counted).
    assert most <= baseline + CAP + 1, f"{most} threads with {5 * CAP} idle sockets (baseline {baseline}, cap {CAP})"
    assert capped.proc.poll() is None


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_timeout(daemon: DaemonProc) -> None:
    ui = start_ui(daemon, CAP, 1)
    try:
        with ExitStack() as stack:
            silent = idle_socket(ui, stack)
            partial = idle_socket(ui, stack)
            partial.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and the rest never comes
            assert closed_by_server(silent), "a connection that sent nothing was never closed"
            assert closed_by_server(partial), "a connection that stopped half-way through its headers was never closed"
        status, _ = get(ui, "/api/runs", ui.login())
        assert status == 200
    finally:
        ui.close()


def test_when_every_connection_is_busy_a_new_one_is_refused_with_a_503_that_says_why(capped: Ui) -> None:
    cookie = capped.login()
    with ExitStack() as stack:
        # CAP event streams: each a connection in use for as long as its page is open.
        for _ in range(CAP):
            stream = HTTPConnection("127.0.0.1", capped.port, timeout=60)
            stack.callback(stream.close)
            stream.request("GET", f"{capped.base}/api/events".removeprefix(capped.origin), headers={"Cookie": cookie})
            reply = stream.getresponse()
            stack.callback(reply.close)  # the stream's socket lives as long as its reply
            assert reply.status == 200
            assert reply.fp is not None and reply.fp.readline() == b"retry: 2000\n"
        status, body = get(capped, "/api/runs", cookie)
        assert status == 503, (status, body)
        assert b"connections busy" in body and b"OBD_UI_MAX_CONNECTIONS" in body, body
    # Once the pages are closed, the view answers again.
    wait_for(lambda: get(capped, "/api/runs", cookie)[0] == 200, timeout=60, what="an answer once the streams closed")


def test_a_bad_limit_in_the_environment_is_refused_before_serving(daemon: DaemonProc) -> None:
    out = subprocess.run(
        [PY, "-m", "daemon.cli", "ui", "--port", "0"],
        env={**daemon.env, "OBD_UI_MAX_CONNECTIONS": "lots"},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "OBD_UI_MAX_CONNECTIONS=lots" in out.stderr and "unset them for the defaults" in out.stderr, out.stderr
