"""The control socket: private, caller-checked, and unharmed by garbage, huge or half messages."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DaemonProc, wait_for


def _raw(path: Path, payload: bytes, read: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        # The daemon may answer and hang up before taking it all (a huge message).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(payload)
        if not read:
            return b""
        data = b""
        while not data.endswith(b"\n"):
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        return data


def test_the_socket_is_private_by_default(daemon: DaemonProc) -> None:
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode == 0o600


def test_a_caller_with_another_uid_is_refused(daemon: DaemonProc) -> None:
    if os.geteuid() != 0:
        import pytest

        pytest.skip("needs root to connect as another uid")
    os.chmod(daemon.socket.parent, 0o755)
    os.chmod(daemon.socket, 0o666)  # even with the file opened up, SO_PEERCRED refuses
    code = (
        "import os, socket, sys; os.setgid(65534); os.setuid(65534); "
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        "print(s.recv(4096).decode())"
    )
    out = subprocess.run([sys.executable, "-c", code, str(daemon.socket)], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ok"] is False and reply["kind"] == "denied"


def test_garbage_a_huge_message_and_a_half_message_harm_no_one(daemon: DaemonProc) -> None:
    assert json.loads(_raw(daemon.socket, b"\x00\xff not json\n"))["kind"] == "usage"
    assert json.loads(_raw(daemon.socket, b"[1,2,3]\n"))["ok"] is False
    assert json.loads(_raw(daemon.socket, b'{"op": "status", "id": {"$gt": 1}}\n'))["kind"] == "usage"
    assert json.loads(_raw(daemon.socket, b'{"op": "explode"}\n'))["kind"] == "usage"
    huge = _raw(daemon.socket, b'{"op": "list", "pad": "' + b"x" * (2 << 20) + b'"}\n')
    assert huge == b"" or json.loads(huge)["ok"] is False  # refused, or dropped mid-send
    # A client that sends half a request and goes away.
    _raw(daemon.socket, b'{"op": "li', read=False)
    # A client that sends half a request and stays: others are still served meanwhile.
    lingering = socket.socket(socket.AF_UNIX)
    lingering.connect(str(daemon.socket))
    lingering.sendall(b'{"op": "pi')
    try:
        started = time.monotonic()
        assert daemon.call("ping")["runs"] == 0
        assert time.monotonic() - started < 5
    finally:
        lingering.close()
    assert daemon.proc.poll() is None


def test_many_clients_at_once_each_get_their_own_answer(daemon: DaemonProc) -> None:
    errors: list[BaseException] = []
    ids: list[str] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        try:
            c = daemon.client()
            rid = c.call("start", command=["sh", "-c", f"echo client {i}"], name=f"c{i}")["id"]
            for _ in range(5):
                c.call("list")
            record = c.call("status", id=rid)
            assert record["name"] == f"c{i}"
            c.close()
            with lock:
                ids.append(rid)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert len(set(ids)) == 30
    for rid in ids:
        daemon.wait_state(rid, "succeeded")
        assert daemon.cli("train", "logs", rid).stdout.startswith("client ")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payload=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
            lambda children: (
                st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
            ),
            max_leaves=12,
        ).map(lambda v: json.dumps(v).encode()),
        st.fixed_dictionaries(
            {"op": st.sampled_from(["start", "stop", "cancel", "status", "read", "list", "metrics", "ping"])},
            optional={
                "id": st.text(max_size=70),
                "command": st.lists(st.text(max_size=10), max_size=3),
                "offset": st.integers(),
                "reason": st.text(max_size=10),
            },
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzzed_requests_always_get_a_json_answer_and_the_daemon_lives(daemon: DaemonProc, payload: bytes) -> None:
    payload = payload.replace(b"\n", b" ") + b"\n"
    reply = _raw(daemon.socket, payload)
    if reply:
        assert isinstance(json.loads(reply)["ok"], bool)
    assert daemon.call("ping")["pid"] == daemon.proc.pid


def test_members_of_the_configured_group_may_use_the_socket(make_daemon) -> None:
    import grp
    import pwd

    import pytest

    from tests.conftest import FAST_CONFIG

    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    d = make_daemon(FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"'))
    d.start()
    os.chmod(d.socket.parent, 0o755)
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o660
    assert os.stat(d.socket).st_gid == nobody.pw_gid
    code = (
        f"import os, socket, sys; os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid}); "
        "s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
        's.sendall(b\'{"op": "ping"}\\n\'); print(s.recv(4096).decode())'
    )
    out = subprocess.run([sys.executable, "-c", code, str(d.socket)], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ok"] is True


def test_running_out_of_file_descriptors_never_ends_the_daemon(make_daemon) -> None:
    import resource

    d = make_daemon()
    d.start(preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128)))
    held = []
    try:
        for _ in range(200):  # more callers than the daemon can hold open
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.socket))
            held.append(s)
        time.sleep(0.5)
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
    time.sleep(0.5)
    assert d.call("ping")["pid"] == d.proc.pid


def _open_many(path: Path, count: int, payload: bytes = b"") -> list[socket.socket]:
    """`count` connections that send `payload` (as much as the socket takes) and never read."""
    held = []
    for _ in range(count):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        if payload:
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.send(payload)
        held.append(s)
    return held


def test_silent_connections_do_not_lock_a_new_caller_out(daemon: DaemonProc) -> None:
    held = _open_many(daemon.socket, 300)
    try:
        out = daemon.cli("train", "list", timeout=30)
        assert out.returncode == 0, out.stderr
    finally:
        for s in held:
            s.close()
    assert "caller_evicted" in daemon.log_path.read_text()


def test_callers_that_never_read_their_replies_do_not_lock_a_new_caller_out(daemon: DaemonProc) -> None:
    for i in range(20):
        daemon.call("start", command=["true"], name=f"filler-{i}")
    pipelined = b'{"op": "list"}\n' * 2000
    held = _open_many(daemon.socket, 300, pipelined)
    try:
        out = daemon.cli("train", "list", timeout=30)
        assert out.returncode == 0, out.stderr
        assert "filler-19" in out.stdout
    finally:
        for s in held:
            s.close()
    assert daemon.proc.poll() is None


def test_a_busy_answer_is_not_reported_as_an_unreachable_daemon(daemon: DaemonProc) -> None:
    from daemon.cli.client import Client, DaemonBusy

    # Every connection of this uid busy with a request (a long `wait`), none stalled: no room.
    rid = daemon.call("start", command=["sleep", "30"])["id"]
    waiters = []
    try:
        for _ in range(64):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(daemon.socket))
            s.sendall(json.dumps({"op": "wait", "id": rid, "timeout": 60}).encode() + b"\n")
            waiters.append(s)
        time.sleep(1)
        c = Client(daemon.socket, timeout=10)
        try:
            c.call("ping")
            raise AssertionError("a caller over its share was served")
        except DaemonBusy as exc:
            assert "busy" in str(exc)
        finally:
            c.close()
        out = daemon.cli("train", "list", timeout=30)
        assert out.returncode == 75 and "busy" in out.stderr, (out.returncode, out.stderr)
    finally:
        for s in waiters:
            s.close()
    # Callers that hung up during their request gave their connections back at once.
    assert wait_for(lambda: daemon.cli("train", "cancel", rid).returncode == 0, 10, 0.2, "a free connection")


def test_a_request_nested_too_deeply_is_answered_as_bad_input(daemon: DaemonProc) -> None:
    reply = json.loads(_raw(daemon.socket, b"[" * 100000 + b"\n"))
    assert reply["kind"] == "usage" and "nested too deeply" in reply["error"]
    reply = json.loads(_raw(daemon.socket, b'{"op": "list", "x": ' + b"[" * 100000 + b"\n"))
    assert reply["kind"] == "usage"
    assert "request_failed" not in daemon.log_path.read_text()  # no traceback: it is bad input


def test_a_request_over_the_limit_gets_the_too_large_answer_not_a_reset(daemon: DaemonProc) -> None:
    reply = _raw(daemon.socket, b'{"op": "list", "pad": "' + b"x" * (3 << 20) + b'"}\n')
    assert json.loads(reply)["kind"] == "too_large"
    assert daemon.call("ping")["pid"] == daemon.proc.pid


def test_a_start_with_secrets_over_the_limit_is_refused_with_a_usage_error(daemon: DaemonProc) -> None:
    big = {f"BIG_SECRET_{i}": "s" * 120_000 for i in range(10)}
    args = [arg for name in big for arg in ("--secret", name)]
    out = daemon.cli("train", "start", *args, "--", "true", env=big)
    assert out.returncode == 2, out.stderr
    assert "over the daemon's limit" in out.stderr and "secret" in out.stderr
    assert daemon.call("list") == []


def test_requests_are_typed_strictly(daemon: DaemonProc) -> None:
    reply = json.loads(_raw(daemon.socket, b'{"op": "start", "command": ["true"], "profile": "yes"}\n'))
    assert reply["kind"] == "usage" and "profile" in reply["error"]
    reply = json.loads(_raw(daemon.socket, b'{"op": "read", "id": "x", "offset": "12"}\n'))
    assert reply["kind"] == "usage" and "offset" in reply["error"]
    assert daemon.call("list") == []


def test_a_run_name_with_control_characters_is_refused(daemon: DaemonProc) -> None:
    for name in ("evil\x1b[2J", "two\nlines", "tab\there"):
        out = daemon.cli("train", "start", "--name", name, "--", "true")
        assert out.returncode == 2 and "control characters" in out.stderr, out.stderr
    assert daemon.call("list") == []
