"""The control socket: private, caller-checked, and unharmed by garbage, huge or half messages."""

from __future__ import annotations

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

from tests.conftest import DaemonProc


def _raw(path: Path, payload: bytes, read: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        try:
            s.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and hung up before taking it all (a huge message)
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
        except BaseException as exc:  # noqa: BLE001 - reported below
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
            lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
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
        "s.sendall(b'{\"op\": \"ping\"}\\n'); print(s.recv(4096).decode())"
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
