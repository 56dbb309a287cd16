"""A real, throwaway OpenSSH server on a free loopback port, for tests and benchmarks.

Everything lives in one temporary directory: the host key, a user key pair allowed to log in
as the current user, a known_hosts file that pins the host key, the config and the log.
Nothing on the machine's own sshd or ~/.ssh is touched. Standard library plus asyncssh (for key
generation) only, so any test module can use it:

    from tests.sshd import SshServer, sshd_skip_reason   # or `from sshd import ...` with tests/ on sys.path

    with SshServer() as server:          # or server = SshServer(); server.start(); ...; server.stop()
        server.host, server.port, server.user, server.identity_file, server.known_hosts
        server.host_key_line             # "ssh-ed25519 AAAA..." to pin the key (Runpod)
        server.target_fields()           # the SshTarget fields as a dict
        server.restart()                 # same port and keys; drop_connections=True by default
        server.kill()                    # the listener and every live connection, at once
        server.rotate_host_key()         # a new host key (known_hosts now has the old one)

    with SshServer(bashrc="sleep 1") as server:   # a login whose shell start is slow
        server.shells_started()          # shells that read that ~/.bashrc so far
        server.sessions_started()        # channels sshd started a command or subsystem for

With `bashrc`, the sessions get a home of their own (`server.home`, through sshd's SetEnv HOME):
bash, as Debian builds it, reads ~/.bashrc even for the `bash -c COMMAND` of an exec request
(it sees SSH_CLIENT), so that file stands for a user's slow rc file (pyenv, conda) and counts
the shells started. Without it, sessions see this machine's own home and ~/.bashrc.

The server refuses passwords and allows only `identity_file`. It keeps OpenSSH's default
`MaxSessions 10` (channels per connection) so clients are tested against a stock server.
sshd runs under a small subreaper parent (see _REAPER), so jobs that detach from their SSH
session are reaped at once when they end, as on a real host; `server.pid` is sshd's own pid.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncssh

SSHD = os.environ.get("OBD_TEST_SSHD", "/usr/sbin/sshd")
# The test session's mark (tests/leftovers.py): sessions get it too, so that what a test starts
# over SSH is known as the session's at its end.
SESSION_MARK = "PYTEST_OBD_SESSION"


def sshd_skip_reason() -> str | None:
    """Why a real sshd cannot be started here (None when it can): the binary is missing."""
    if not os.path.exists(SSHD):
        return f"{SSHD} is missing: install it with `apt-get install -y openssh-server` (CI does)"
    return None


def running_sshd() -> Iterator[SshServer]:
    """For a pytest fixture: a started server, stopped after the test; a clear skip without sshd."""
    reason = sshd_skip_reason()
    if reason:
        import pytest

        pytest.skip(reason)
    with SshServer() as server:
        yield server


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def write_key_pair(path: Path, alg: str = "ssh-ed25519") -> str:
    """Write a private key at `path` (mode 0600) and `path.pub`; return the public key line."""
    key = asyncssh.generate_private_key(alg)
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    public = key.export_public_key().decode().strip()
    path.with_name(path.name + ".pub").write_text(public + "\n")
    return public


# sshd runs under this small parent, a child subreaper (PR_SET_CHILD_SUBREAPER): jobs that
# detach (setsid, their launcher exits) are re-parented to it and reaped at once, as init does on
# a real host. Without it they would be re-parented to this machine's PID 1, which may be slow to
# reap, and a dead job's zombie would look like a live process group for a while. It prints
# sshd's pid, forwards TERM/INT/HUP to it, and exits when it has no child left.
_REAPER = r"""
import ctypes, os, signal, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL, stdout=2, stderr=2)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, lambda n, f: child.send_signal(n) if child.returncode is None else None)
print(child.pid, flush=True)
os.close(1)
while True:
    try:
        pid, _ = os.wait()
    except ChildProcessError:
        break
    except InterruptedError:
        continue
    if pid == child.pid:
        child.returncode = 0
"""


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def _children(pid: int) -> list[int]:
    """Every descendant of `pid`, read from /proc (deepest last)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            data = Path(f"/proc/{entry}/stat").read_bytes()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2 :].split()
        try:
            parents.setdefault(int(rest[1]), []).append(int(entry))
        except (IndexError, ValueError):
            continue
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class SshServer:
    """One sshd process on 127.0.0.1:<free port>, with its keys and files in a temp dir."""

    def __init__(
        self,
        directory: Path | None = None,
        *,
        port: int | None = None,
        log_level: str = "VERBOSE",
        bashrc: str | None = None,
    ) -> None:
        self._own_dir = directory is None
        self.dir = Path(directory or tempfile.mkdtemp(prefix="obd-sshd-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.user = getpass.getuser()
        self.log_level = log_level
        self.host_key_path = self.dir / "ssh_host_ed25519_key"
        self.identity_file = self.dir / "id_ed25519"
        self.known_hosts = self.dir / "known_hosts"
        self.authorized_keys = self.dir / "authorized_keys"
        self.config_path = self.dir / "sshd_config"
        self.log_path = self.dir / "sshd.log"
        self.host_key_line = write_key_pair(self.host_key_path)
        self.user_key_line = write_key_pair(self.identity_file)
        self.authorized_keys.write_text(self.user_key_line + "\n")
        self.authorized_keys.chmod(0o600)
        self.write_known_hosts()
        self.home: Path | None = None
        if bashrc is not None:
            self.home = self.dir / "home"
            self.home.mkdir(exist_ok=True)
            self.shells_log = self.home / "shells.log"
            counting = 'echo "$$" >> "$HOME/shells.log"\n'
            (self.home / ".bashrc").write_text(counting + bashrc + "\n")
        self.pid: int | None = None  # sshd's pid
        self.reapers: list[subprocess.Popen[bytes]] = []

    # --- files ------------------------------------------------------------------------

    @property
    def known_hosts_host(self) -> str:
        """The host as known_hosts spells it for a non-standard port: `[127.0.0.1]:PORT`."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def write_known_hosts(self, key_line: str | None = None) -> None:
        """Pin `key_line` (default: the server's current host key) in `known_hosts`."""
        self.known_hosts.write_text(f"{self.known_hosts_host} {key_line or self.host_key_line}\n")

    def rotate_host_key(self) -> str:
        """Give the server a new host key (restart to take effect); known_hosts keeps the old one."""
        self.host_key_line = write_key_pair(self.host_key_path)
        return self.host_key_line

    def target_fields(self) -> dict[str, object]:
        """The `SshTarget` fields that reach this server (add kind, workdir, python...)."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "identity_file": self.identity_file,
            "known_hosts": self.known_hosts,
        }

    def _write_config(self) -> None:
        self.config_path.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    f"ListenAddress {self.host}",
                    f"HostKey {self.host_key_path}",
                    f"PidFile {self.dir / 'sshd.pid'}",
                    f"AuthorizedKeysFile {self.authorized_keys}",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "StrictModes no",
                    "UsePAM no",
                    "PrintMotd no",
                    "UseDNS no",
                    "MaxStartups 100:30:200",
                    "Subsystem sftp internal-sftp",
                    # This machine's ~/.bashrc runs `pyenv rehash`, which waits up to 60 s on a lock
                    # that a session killed by a fault test can leave behind: give up at once instead.
                    "SetEnv PYENV_REHASH_TIMEOUT=0"
                    + (f" HOME={self.home}" if self.home is not None else "")
                    + (f" {SESSION_MARK}={os.environ[SESSION_MARK]}" if os.environ.get(SESSION_MARK) else ""),
                    f"LogLevel {self.log_level}",
                    "",
                ]
            )
        )

    # --- process ----------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> SshServer:
        """Start sshd in the foreground (under a reaper) and wait until it answers with its banner."""
        reason = sshd_skip_reason()
        if reason:
            raise RuntimeError(reason)
        if self.pid is not None and _alive(self.pid):
            return self
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation dir
        self._write_config()
        with open(self.log_path, "ab") as log:  # sshd keeps its own copy of the descriptor
            reaper = subprocess.Popen(
                [sys.executable, "-c", _REAPER, SSHD, "-D", "-e", "-f", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert reaper.stdout is not None
        line = reaper.stdout.readline()
        reaper.stdout.close()
        self.reapers.append(reaper)
        if not line.strip():
            raise RuntimeError(f"sshd did not start: {self.log_tail()}")
        self.pid = int(line)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(self.pid):
                raise RuntimeError(f"sshd exited at once: {self.log_tail()}")
            if self._answers():
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"sshd did not answer on {self.host}:{self.port} in {timeout}s: {self.log_tail()}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1) as sock:
                return sock.recv(8).startswith(b"SSH-")
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the listener and every connection it serves (what a crash or reboot does).

        Jobs started over SSH with setsid/nohup are not descendants once their launcher
        returned, so they survive, as they would on a real host.
        """
        if self.pid is None:
            return
        for pid in [self.pid, *_children(self.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._wait_gone(self.pid)
        self.pid = None

    def stop(self, drop_connections: bool = True) -> None:
        """Stop the server; by default also end the live connections (else they run on)."""
        if self.pid is None:
            return
        if drop_connections:
            self.kill()
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        if not self._wait_gone(self.pid, 5):
            os.kill(self.pid, signal.SIGKILL)
            self._wait_gone(self.pid)
        self.pid = None

    @staticmethod
    def _wait_gone(pid: int, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return True
            time.sleep(0.01)
        return False

    def restart(self, drop_connections: bool = True) -> SshServer:
        """Stop and start again on the same port with the same keys (unless rotated)."""
        self.stop(drop_connections=drop_connections)
        return self.start()

    def close(self) -> None:
        """Stop the server, end what it started, and remove its directory (if this object made it).

        Jobs started over SSH that outlived their session (setsid, nohup: a pod's job and its
        watchdog) are the reapers' children by now; they are KILLed, as the machine going away
        would, and the reapers, left with no child, exit."""
        self.stop()
        self.end_jobs()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def end_jobs(self, timeout: float = 30.0) -> None:
        """KILL every process still running under this server's reapers, and wait for the reapers."""
        deadline = time.monotonic() + timeout
        for reaper in self.reapers:
            while reaper.poll() is None and time.monotonic() < deadline:
                for pid in _children(reaper.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    reaper.wait(0.2)

    def shells_started(self) -> int:
        """How many shells read the `bashrc` given to this server so far."""
        if self.home is None:
            raise RuntimeError("shells are counted only for a server made with bashrc=...")
        try:
            return len(self.shells_log.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def sessions_started(self) -> int:
        """How many sessions (an exec or a subsystem on a channel) sshd started so far, from its log."""
        try:
            return self.log_path.read_text(errors="replace").count("Starting session:")
        except FileNotFoundError:
            return 0

    def log_tail(self, size: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode("utf-8", "replace")
        except OSError:
            return ""

    def __enter__(self) -> SshServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # a manual check: start one, print how to reach it, wait for ^C
    with SshServer() as server:
        print(
            f"ssh -p {server.port} -i {server.identity_file} -o UserKnownHostsFile={server.known_hosts} "
            f"{server.user}@{server.host}"
        )
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
