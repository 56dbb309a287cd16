"""What a test session leaves behind: live processes it started and `/tmp/obd-*` directories it made.

conftest.py marks the session at its start (`mark_session`): an environment variable every process
the tests start inherits (named without `OBD_`, which obd strips from a job's environment; the test
sshd hands it to its sessions with `SetEnv`), and `tempfile.mkdtemp` notes every `/tmp/obd-*`
directory it makes in any of the session's pytest processes (an xdist worker hands its list to the
controller when it ends). At the end (`find`), a leftover is a live process carrying the session's
mark, or one whose command line or working directory is inside a directory of the session (a pod's
`watchdog.py` whose directory was deleted), and a directory of the session still there. Nothing
else is looked at: engineers sharing a machine never see, let alone end, each other's processes.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import signal
import tempfile
import time
import uuid
from dataclasses import dataclass, field

MARK = "PYTEST_OBD_SESSION"
GRACE = "PYTEST_OBD_LEFTOVER_GRACE"  # how long the session's processes get to end after its last test (s)


def session_id() -> str:
    """This session's mark (set by `mark_session`), or '' before it."""
    return os.environ.get(MARK, "")


def torch_cache() -> str:
    """torch's default compile cache of this user, `/tmp/torchinductor_<user>`: `import peft` (and
    the Trainer's jobs) make it through `torch._dynamo`, whether anything is compiled or not."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


MADE: set[str] = set()  # the `/tmp/obd-*` directories this process made (and, in the controller, its workers)


def temporary_base() -> str:
    """Where the tests' `obd-*` directories are made: /tmp, or OBD_TEST_TMP where set (another
    disk's: the figures of tests/bench/ depend on the file system the state directory is on)."""
    return os.path.abspath(os.environ.get("OBD_TEST_TMP") or "/tmp")


def mark_session() -> bool:
    """Mark this process (the controller) or join the mark it inherited (an xdist worker); True when
    this process made the mark. Either way, `tempfile.mkdtemp` registers the directories it makes."""
    made = not session_id()
    if made:
        os.environ[MARK] = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    _register_mkdtemp()
    return made


def _register_mkdtemp() -> None:
    original = tempfile.mkdtemp
    if getattr(original, "obd_registers", False):
        return

    def mkdtemp(suffix: str | None = None, prefix: str | None = None, dir: str | None = None) -> str:
        path = original(suffix, prefix, dir)
        base = os.path.dirname(os.path.abspath(path))
        if base in ("/tmp", temporary_base()) and os.path.basename(path).startswith("obd-"):
            MADE.add(os.path.abspath(path))
        return path

    mkdtemp.obd_registers = True  # type: ignore[attr-defined]
    tempfile.mkdtemp = mkdtemp  # type: ignore[assignment]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _environ_mark(pid: int) -> str | None:
    """The session mark in the process's initial environment, if any."""
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        if item.startswith(MARK.encode() + b"="):
            return item[len(MARK) + 1 :].decode("utf-8", "replace")
    return None


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _ancestors(pid: int) -> set[int]:
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        stat = _read(f"/proc/{pid}/stat")
        rest = stat[stat.rfind(b")") + 2 :].split()
        if len(rest) < 2:
            break
        pid = int(rest[1])
    return out


@dataclass
class Leftover:
    """A live process of the session: its pid, age in seconds and command line."""

    pid: int
    age: float
    args: str
    why: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.why}, {self.age:.0f} s old): {self.args[:300]}"


def _age(pid: int) -> float:
    stat = _read(f"/proc/{pid}/stat")
    rest = stat[stat.rfind(b")") + 2 :].split()
    try:
        start = int(rest[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(_read("/proc/uptime").split()[0])
    except (IndexError, ValueError):
        return 0.0
    return uptime - start


def _zombie(pid: int) -> bool:
    stat = _read(f"/proc/{pid}/stat")
    return stat[stat.rfind(b")") + 2 :][:1] in (b"Z", b"X", b"")


def processes(session: str, dirs: set[str], exclude: set[int]) -> list[Leftover]:
    """Live processes that carry the session's mark or run inside one of its directories."""
    out: list[Leftover] = []
    prefixes = [d.rstrip("/") + "/" for d in dirs]
    for pid in _pids():
        if pid in exclude or _zombie(pid):
            continue
        args = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode("utf-8", "replace").strip()
        if not args:
            continue  # a kernel thread, or gone meanwhile
        why = ""
        if session and _environ_mark(pid) == session:
            why = "started by the tests"
        else:
            with contextlib.suppress(OSError):
                cwd = os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)") + "/"
                if any(cwd.startswith(p) for p in prefixes):
                    why = "working in a test directory"
            if not why and any(p in args + " " for p in prefixes):
                why = "running a file of a test directory"
        if why:
            out.append(Leftover(pid, _age(pid), args, why))
    return out


def end_processes_in(directory: str | os.PathLike[str], timeout: float = 10.0) -> list[Leftover]:
    """KILL every live process working in `directory` or running a file of it (a test's jobs, and
    what they detached: a pod's watchdog), before the directory is removed; return those found."""
    exclude = _ancestors(os.getpid())
    found: list[Leftover] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        procs = processes("", {os.fspath(directory)}, exclude)
        if not procs:
            break
        for p in procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGKILL)
        found += [p for p in procs if p.pid not in {f.pid for f in found}]
        time.sleep(0.05)
    return found


@dataclass
class Report:
    """What `find` found: processes (killed since) and directories (removed since)."""

    processes: list[Leftover] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.dirs)

    def lines(self) -> list[str]:
        out = ["the tests left these behind (each test must end what it starts; they are cleaned now):"]
        out += [f"  process {p}" for p in self.processes]
        out += [f"  directory {d}" for d in self.dirs]
        return out


def find(session: str, grace: float | None = None) -> Report:
    """At the session's end: wait up to `grace` s for the session's processes to end, then report
    those still alive and the session's `/tmp/obd-*` directories still there, and clean both up."""
    if grace is None:
        grace = float(os.environ.get(GRACE, "30"))
    exclude = _ancestors(os.getpid())
    deadline = time.monotonic() + grace
    while True:
        procs = processes(session, MADE, exclude)
        if not procs or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in procs:
        with contextlib.suppress(OSError):
            os.kill(p.pid, signal.SIGKILL)
    left = sorted(d for d in MADE if os.path.isdir(d) and not os.path.islink(d))
    for d in left:
        shutil.rmtree(d, ignore_errors=True)
    return Report(procs, left)
