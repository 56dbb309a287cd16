"""The caller's identity comes from the socket alone (issue 22, item 7).

A root daemon gives a user's job the uid, gid and supplementary groups the kernel recorded on
the socket when the caller connected (SO_PEERCRED, SO_PEERGROUPS). It never reads them from
/proc/<pid>: by the time the request is read, that pid may be gone or another process's, and
that process's groups are not the caller's. The socket's directory, when the daemon makes it,
lets socket_group's members reach the socket (0710) and no one else.

The tests with throwaway users are root only (tests/users.py).
"""

from __future__ import annotations

import builtins
import grp
import json
import os
import pwd
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.service.api import Peer
from daemon.service.launch import caller_groups
from daemon.service.server import make_socket_dir, peer_groups, peer_identity
from tests import users
from tests.conftest import FAST_CONFIG
from tests.users import Box

accounts = users.accounts  # the throwaway users of this module (root only)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect with other groups")


# --- units: the socket, never the pid -------------------------------------------------------------


def test_a_peer_is_built_from_the_socket_alone_and_carries_no_pid() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        peer = peer_identity(a)
    assert (peer.uid, peer.gid) == (os.geteuid(), os.getegid())
    assert peer.groups is not None and sorted(peer.groups) == sorted(os.getgroups())
    assert not hasattr(peer, "pid")  # nothing in a request can lead back to a process by its pid


def test_a_jobs_groups_are_the_peers_and_nothing_under_proc_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[str] = []
    real_open = builtins.open

    def watching_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", watching_open)
    me = pwd.getpwuid(os.geteuid())
    # Groups this process does not have: only the socket's word counts.
    peer = Peer(uid=me.pw_uid, gid=me.pw_gid, groups=(424242, 434343))
    assert caller_groups(peer, me.pw_name, me.pw_gid) == [424242, 434343]
    assert not [p for p in opened if p.startswith("/proc")]
    # A kernel without SO_PEERGROUPS: the account database, still not /proc.
    login = caller_groups(Peer(uid=me.pw_uid, gid=me.pw_gid, groups=None), me.pw_name, me.pw_gid)
    assert login == os.getgrouplist(me.pw_name, me.pw_gid)
    assert not [p for p in opened if p.startswith("/proc")]


def test_the_socket_directory_is_0700_without_a_group_and_0710_for_the_group_when_made_by_the_daemon(
    tmp_path: Path,
) -> None:
    old = os.umask(0o077)  # the daemon's
    try:
        make_socket_dir(tmp_path / "private" / "obd", None)
        make_socket_dir(tmp_path / "shared" / "obd", os.getegid())
    finally:
        os.umask(old)
    for path in (tmp_path / "private", tmp_path / "private" / "obd"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in (tmp_path / "shared", tmp_path / "shared" / "obd"):
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o710 and info.st_gid == os.getegid(), path
    # A directory that is already there is the administrator's: left as it is.
    (tmp_path / "theirs").mkdir(mode=0o755)
    os.chmod(tmp_path / "theirs", 0o755)
    make_socket_dir(tmp_path / "theirs", os.getegid())
    assert stat.S_IMODE((tmp_path / "theirs").stat().st_mode) == 0o755


@needs_root
def test_the_groups_come_from_the_socket_after_the_caller_exited_even_beyond_what_1_kib_holds(
    short_tmp: Path,
) -> None:
    many = list(range(300000, 300300))  # 300 groups: 1,200 bytes, over CPython's getsockopt buffer
    path = short_tmp / "s.sock"
    os.chmod(short_tmp, 0o711)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(path))
        os.chmod(path, 0o777)
        listener.listen(1)
        code = (
            f"import os, socket, sys; os.setgroups({many}); os.setgid(65534); os.setuid(65534); "
            "socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        conn, _ = listener.accept()  # the caller is gone, reaped, its pid free for anyone
        with conn:
            peer = peer_identity(conn)
            assert peer_groups(conn) == peer.groups
    assert (peer.uid, peer.gid) == (65534, 65534)
    assert peer.groups is not None and sorted(peer.groups) == many


# --- a root daemon shared by throwaway users --------------------------------------------------------


@pytest.fixture
def extra_group(accounts: Any) -> Iterator[str]:
    """A group alice's login has and her `obd` process has dropped."""
    alice = accounts[0]
    name = f"obdx{uuid.uuid4().hex[:6]}"
    subprocess.run(["groupadd", name], check=True)
    try:
        subprocess.run(["gpasswd", "-a", alice.name, name], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["groupdel", name], check=False)


# The caller: a child connects the socket and exits, and is reaped; its parent, with the same
# groups but another pid, then sends the start on that connection. The pid the socket names is
# no process any more (the old code then gave the job the groups of alice's login).
CALLER = r"""
import json, os, socket, sys
path, home = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
child = os.fork()
if child == 0:
    s.connect(path)
    os._exit(0)
_, status = os.waitpid(child, 0)
assert status == 0, status
assert not os.path.exists(f"/proc/{child}")
request = {"op": "start", "command": ["sh", "-c", "id -G"], "client_cwd": home,
           "environ": {"PATH": "/usr/bin:/bin", "HOME": home}}
s.sendall(json.dumps(request).encode() + b"\n")
reply = b""
while not reply.endswith(b"\n"):
    chunk = s.recv(65536)
    if not chunk:
        break
    reply += chunk
print(reply.decode())
"""


@users.needs_root_and_users
def test_a_job_gets_the_groups_its_caller_connected_with_not_those_of_its_login(
    make_daemon: Any, short_tmp: Path, accounts: Any, extra_group: str
) -> None:
    alice, _bob, group, _client, venv = accounts
    os.chmod(short_tmp, 0o711)
    d = make_daemon(FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"'))
    d.start()
    socket_gid, dropped = grp.getgrnam(group).gr_gid, grp.getgrnam(extra_group).gr_gid
    assert dropped in os.getgrouplist(alice.name, alice.gid)  # her login has it; her process does not
    out = subprocess.run(
        [f"{venv}/bin/python", "-c", CALLER, str(d.socket), str(alice.home)],
        user=alice.uid,
        group=alice.gid,
        extra_groups=[socket_gid],
        env={"PATH": "/usr/bin:/bin", "HOME": str(alice.home)},
        cwd=alice.home,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["ok"], reply
    rid = reply["result"]["id"]
    record = d.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    assert record["owner_uid"] == alice.uid
    job_groups = {int(g) for g in (Path(record["remote_dir"]) / "job.log").read_text().split()}
    assert job_groups == {alice.gid, socket_gid}, job_groups


@users.needs_root_and_users
def test_a_group_member_reaches_a_socket_whose_directory_the_daemon_made(
    make_daemon: Any, short_tmp: Path, accounts: Any
) -> None:
    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)
    d = make_daemon(FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"'))
    d.socket = short_tmp / "run" / "obd" / "obd.sock"  # neither directory exists yet
    d.env["OBD_SOCKET"] = str(d.socket)
    d.start()
    gid = grp.getgrnam(group).gr_gid
    for path in (short_tmp / "run", short_tmp / "run" / "obd"):
        info = path.stat()
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o710, 0, gid), path
    box = Box(d, alice, bob, group, client, venv)
    out = box.obd(alice, "train", "list", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    # Someone outside the group cannot even reach it (and no one else may write there).
    code = (
        "import os, socket, sys; os.setgroups([]); os.setgid(65534); os.setuid(65534); "
        "socket.socket(socket.AF_UNIX).connect(sys.argv[1])"
    )
    other = subprocess.run(
        [sys.executable, "-c", code, str(d.socket)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert other.returncode != 0 and "Permission denied" in other.stderr
