"""Throwaway users sharing a root daemon, for the tests of obd as the GPU box's shared service.

Root only: the fixtures create two users (and a group for the socket) and delete them after.
Those users cannot run this repository's Python (it may live under root's private home), so
they get a venv made from Debian's /usr/bin/python3 and a copy of the client's modules (the
`obd` command, `obd train plot` and `obd ui` with its page). A test module takes them with
`accounts, box = users.accounts, users.box` and marks itself with `users.needs_root_and_users`.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc

needs_root_and_users = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("useradd") or not Path("/usr/bin/python3").exists(),
    reason="needs root, useradd and /usr/bin/python3 (it creates throwaway users)",
)
# A user's `obd` is the whole `daemon` package (and the trainer_plugin contract it reads), as an
# install gives it; their venv has none of the daemon's dependencies, so a client module that
# imported one would fail here.


@dataclass
class User:
    name: str
    uid: int
    gid: int
    home: Path


@dataclass
class Box:
    """A root daemon shared by two throwaway users, and what they need to use it."""

    daemon: DaemonProc
    alice: User
    bob: User
    group: str
    client_dir: Path
    venv: Path

    def env(self, user: User, **extra: str) -> dict[str, str]:
        return {
            "HOME": str(user.home),
            "USER": user.name,
            "LOGNAME": user.name,
            "PATH": f"{self.venv}/bin:/usr/bin:/bin",
            "OBD_SOCKET": str(self.daemon.socket),
            "PYTHONPATH": str(self.client_dir),
            **extra,
        }

    def _as(self, user: User) -> dict[str, object]:
        return {"user": user.uid, "group": user.gid, "extra_groups": [grp.getgrnam(self.group).gr_gid]}

    def obd(
        self,
        user: User,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """`obd ARGS` run by `user`, with the client's modules copied where they can read them."""
        return subprocess.run(
            [f"{self.venv}/bin/python", "-m", "daemon.cli", *args],
            check=False,
            env=env or self.env(user),
            cwd=cwd or user.home,
            capture_output=True,
            text=True,
            timeout=timeout,
            **self._as(user),  # type: ignore[call-overload]
        )

    def start(
        self,
        user: User,
        *command: str,
        opts: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> str:
        """`obd train start OPTS -- COMMAND` run by `user`; the new run's id."""
        out = self.obd(user, "train", "start", *opts, "--", *command, env=env, cwd=cwd)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    def popen(self, user: User, *args: str) -> subprocess.Popen[str]:
        """`obd ARGS` started by `user` and left running (`obd ui`); its stdout is a pipe."""
        return subprocess.Popen(  # type: ignore[call-overload]
            [f"{self.venv}/bin/python", "-m", "daemon.cli", *args],
            env=self.env(user),
            cwd=user.home,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **self._as(user),
        )


def training_python(base: Path) -> Path:
    """A Python the throwaway users can run, with torch and transformers: a venv of Debian's
    /usr/bin/python3 (the same 3.11 ABI) that sees this repository's site-packages, directly when
    every directory above them is open to others, else through a tree of hard links (no copy of
    the bytes) in `base`."""
    site = Path(next(p for p in sys.path if p.endswith("site-packages") and (Path(p) / "torch").is_dir()))
    venv = base / "train-venv"
    if (venv / "bin" / "python").exists():
        return venv / "bin" / "python"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
    reachable = all(p.stat().st_mode & 0o005 == 0o005 for p in (site, *site.parents))
    if not reachable:
        linked = base / "site-packages"
        made = subprocess.run(["cp", "-al", str(site), str(linked)], check=False, capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"this repository's site-packages cannot be shared with test users: {made.stderr!r}")
        site = linked
        for root, dirs, _ in os.walk(site):
            for d in dirs:
                (Path(root) / d).chmod(0o755)
        site.chmod(0o755)
    (next((venv / "lib").glob("python3*")) / "site-packages" / "obd-test-site.pth").write_text(f"{site}\n")
    for path in (venv, *venv.rglob("*")):
        if not path.is_symlink():
            path.chmod(path.stat().st_mode | 0o055)
    return venv / "bin" / "python"


def _add_user(name: str, group: str, base: Path) -> User:
    home = base / name
    subprocess.run(["useradd", "-m", "-d", str(home), "-s", "/bin/sh", "-G", group, name], check=True)
    pw = pwd.getpwnam(name)
    return User(name, pw.pw_uid, pw.pw_gid, home)


def _copy_client(client: Path) -> None:
    """What an install gives the `obd` command: the daemon package and the run directory's
    contract it reads (trainer_plugin, standard library only), and the Python API's module."""
    client.mkdir(parents=True)
    for package in ("daemon", "trainer_plugin"):
        shutil.copytree(REPO / package, client / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "obd.py", client / "obd.py")


def _remove_tmp_of(name: str) -> None:
    """What a throwaway user's processes left in /tmp (torch's `torchinductor_<user>` cache, made
    when their jobs import torch), as `userdel -r` removes their home: nothing of them stays."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    for entry in os.scandir("/tmp"):
        with contextlib.suppress(OSError):
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                os.unlink(entry.path)


@pytest.fixture(scope="module")
def accounts() -> Iterator[tuple[User, User, str, Path, Path]]:
    tag = uuid.uuid4().hex[:6]
    group = f"obdg{tag}"
    base = Path(tempfile.mkdtemp(prefix="obd-users-", dir="/tmp"))
    os.chmod(base, 0o755)
    subprocess.run(["groupadd", group], check=True)
    made: list[str] = []
    try:
        alice = _add_user(f"obda{tag}", group, base)
        made.append(alice.name)
        bob = _add_user(f"obdb{tag}", group, base)
        made.append(bob.name)
        venv = base / "venv"
        subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", str(venv)], check=True)
        client = base / "client"
        _copy_client(client)
        for path in (venv, client):
            for root, dirs, files in os.walk(path):
                for n in dirs + files:
                    p = Path(root) / n
                    if not p.is_symlink():
                        p.chmod(p.stat().st_mode | 0o055)
            path.chmod(0o755)
        yield alice, bob, group, client, venv
    finally:
        for name in made:
            subprocess.run(["pkill", "-KILL", "-u", name], check=False)
            _remove_tmp_of(name)
            subprocess.run(["userdel", "-r", name], check=False, capture_output=True)
        subprocess.run(["groupdel", group], check=False)
        shutil.rmtree(base, ignore_errors=True)


def shared_daemon(  # type: ignore[no-untyped-def]
    make_daemon, short_tmp: Path, accounts, config: str, own_python: bool = False, env: dict[str, str] | None = None
) -> Box:
    """A root daemon of `config` whose socket the throwaway users' group may use, started (with
    `env` added to its environment). With `own_python`, the users' venv runs obd's wrappers as
    them (the daemon's own Python may be under root's private home)."""
    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)  # the socket's directory: reachable, not listable
    config = config.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"')
    d = make_daemon(config + (f'python = "{venv}/bin/python"\n' if own_python else ""))
    d.start(extra_env=env)
    return Box(d, alice, bob, group, client, venv)


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)  # the socket's directory: reachable, not listable
    d = make_daemon(FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"'))
    d.env["DAEMON_ONLY_SECRET"] = "daemon-secret-value-" + uuid.uuid4().hex
    d.start()
    yield Box(d, alice, bob, group, client, venv)
