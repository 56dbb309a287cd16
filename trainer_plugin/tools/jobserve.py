"""The persistent helper of an SSH connection: `python3 -S jobserve.py` (standard library only).

Kept apart from jobctl.py, which starts, watches and cancels jobs on every target; this file
only answers and pushes over one SSH channel, calling jobctl's functions for the work.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import BinaryIO

try:  # imported as trainer_plugin.tools.jobserve
    from .. import rundir
    from . import jobctl
except ImportError:  # run by path (`python3 -S jobserve.py`) beside jobctl.py, which finds rundir.py
    import jobctl  # type: ignore[no-redef, import-not-found]

    rundir = jobctl.rundir


# --- serve: the persistent helper of an SSH connection -------------------------------------
#
# `python3 -S jobserve.py` lives as long as its SSH channel: it reads requests, one JSON object
# a line, on stdin and answers each with one line on stdout carrying the request's id, so many can
# be in flight at once; anything that may block (a slow disk, a cancel's grace) runs in a thread of
# its own. It also pushes, unasked, what is written in the run directories it was told to watch
# (inotify where the host has it, else a stat every half second), so the daemon learns of an exit,
# a request or a proof without polling. Values (a job's environment and secrets) come inside
# requests, never on a command line.
#
#   first line: {"event": "hello", "protocol": 1, "pid": ..., "python": "3.11.7", "inotify": true}
#   request:    {"id": 7, "op": "probe", "runs": [{"dir": ..., "handle": ...}, ...]}
#   answer:     {"id": 7, "ok": true, "result": ...}
#               {"id": 7, "ok": false, "error": "No space left on device", "errno": "ENOSPC"}
#   push:       {"event": "files", "dir": ..., "names": ["exit_code"], "job": [pid, start_time]}
#               {"event": "overflow"}   (events were lost: read every run)
#
# ops: ping, probe (runs), status (dir, handle), start (dir, values, clean_env, python), cancel (dir,
# grace, handle), read (path, offset, limit; data in base64), write (path, data in base64;
# atomic, parents made), watch (dir; answers the job's [pid, start_time] from job.pid), unwatch (dir).

SERVE_PROTOCOL = 1
SERVE_READ_LIMIT = 4 << 20  # the most one `read` answers; the caller asks again from where it got to
_PROGRESS_EVERY = 1.0  # metrics.jsonl growth is pushed at most this often per run directory
_POLL_EVERY = 0.5  # how often a directory that inotify cannot watch is looked at
# Requests that are seen through even when the channel closes under them (the helper waits for
# them before it exits); reads and probes are simply dropped.
_FINISH_ON_EXIT = frozenset({"start", "cancel", "write"})


def _stat_signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class _Watcher:
    """The run directories a helper watches, and the pushes of what is written in them.

    Exits, cancels, requests and proofs are pushed at once; metrics.jsonl growth at most once
    per `_PROGRESS_EVERY` per directory (progress can wait, and a busy log must not flood the
    channel). A directory inotify cannot watch (no inotify, no watch left) is looked at by stat.
    """

    IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
    IN_Q_OVERFLOW, IN_IGNORED, IN_DONT_FOLLOW = 0x4000, 0x8000, 0x02000000
    _EVENT = struct.Struct("iIII")

    def __init__(self, send: Callable[[dict], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._dirs: dict[str, int] = {}  # run dir -> its inotify watch, -1 when looked at by stat
        self._metrics: dict[str, int] = {}  # run dir -> the watch on its metrics.jsonl
        self._where: dict[int, tuple[str, bool]] = {}  # watch -> (run dir, whether it is metrics.jsonl)
        self._stats: dict[str, dict[str, tuple[int, int, int] | None]] = {}  # dirs looked at by stat
        self._progress: set[str] = set()  # run dirs whose metrics.jsonl grew since the last push
        self._libc = None
        self._fd = -1
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            if fd >= 0:
                self._libc, self._fd = libc, fd
        except (OSError, AttributeError):  # not Linux, or no inotify: look by stat
            pass
        self._wake_r, self._wake_w = os.pipe()
        threading.Thread(target=self._run, name="watch", daemon=True).start()

    @property
    def inotify(self) -> bool:
        return self._fd >= 0

    def add(self, run_dir: str) -> bool:
        """Watch a run directory; whether inotify watches it (else it is looked at by stat)."""
        with self._lock:
            if run_dir not in self._dirs:
                mask = self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE | self.IN_DONT_FOLLOW
                wd = self._add_watch(run_dir, mask, (run_dir, False))
                self._dirs[run_dir] = wd
                if wd < 0:
                    self._stats[run_dir] = self._signature(run_dir)
                else:
                    self._watch_metrics(run_dir)
            inotify = self._dirs[run_dir] >= 0
        os.write(self._wake_w, b".")
        return inotify

    def remove(self, run_dir: str) -> None:
        with self._lock:
            self._stats.pop(run_dir, None)
            self._progress.discard(run_dir)
            for wd in (self._dirs.pop(run_dir, -1), self._metrics.pop(run_dir, -1)):
                if wd >= 0 and self._libc is not None:
                    self._where.pop(wd, None)
                    self._libc.inotify_rm_watch(self._fd, wd)

    def push(self, run_dir: str, names: list[str]) -> None:
        """Tell the daemon these files were written in `run_dir`; an ended job's ids come along,
        so the daemon can wake whoever waits for that job's exit."""
        message: dict = {"event": "files", "dir": run_dir, "names": sorted(names)}
        if rundir.EXIT_CODE in names or rundir.CANCELLED in names:
            handle = jobctl.read_handle(run_dir) or {}
            try:
                message["job"] = [int(handle["pid"]), int(handle["start_time"])]
            except (KeyError, TypeError, ValueError):
                message["job"] = None
        self._send(message)

    def present(self, run_dir: str) -> list[str]:
        """The urgent files that exist already (pushed when a watch starts, so nothing written
        while no helper watched is missed)."""
        paths = rundir.RunPaths(run_dir)
        return [n for n in rundir.URGENT_FILES if os.path.lexists(paths.file(n))]

    # -- inside the lock --

    def _add_watch(self, path: str, mask: int, what: tuple[str, bool]) -> int:
        if self._libc is None:
            return -1
        wd = int(self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask))
        if wd >= 0:
            self._where[wd] = what
        return wd

    def _watch_metrics(self, run_dir: str) -> None:
        metrics = rundir.RunPaths(run_dir).metrics
        if run_dir not in self._metrics and os.path.isfile(metrics):
            wd = self._add_watch(metrics, self.IN_MODIFY | self.IN_DONT_FOLLOW, (run_dir, True))
            if wd >= 0:
                self._metrics[run_dir] = wd

    @staticmethod
    def _signature(run_dir: str) -> dict[str, tuple[int, int, int] | None]:
        paths = rundir.RunPaths(run_dir)
        return {n: _stat_signature(paths.file(n)) for n in (*rundir.URGENT_FILES, rundir.METRICS)}

    # -- the watcher's thread --

    def _run(self) -> None:
        next_progress = 0.0
        while True:
            with self._lock:
                busy = bool(self._stats or self._progress)
            fds = [self._wake_r] + ([self._fd] if self._fd >= 0 else [])
            try:
                ready, _, _ = select.select(fds, [], [], _POLL_EVERY if busy else None)
            except (OSError, ValueError):
                return
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            if self._fd in ready:
                self._read_events()
            self._poll()
            now = time.monotonic()
            if now >= next_progress:
                self._flush_progress()
                next_progress = now + _PROGRESS_EVERY

    def _read_events(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except OSError:
            return
        urgent: dict[str, set[str]] = {}
        overflow = False
        with self._lock:
            pos = 0
            while pos + self._EVENT.size <= len(data):
                wd, mask, _cookie, length = self._EVENT.unpack_from(data, pos)
                pos += self._EVENT.size
                name = data[pos : pos + length].rstrip(b"\0").decode("utf-8", "replace")
                pos += length
                if mask & self.IN_Q_OVERFLOW:
                    overflow = True
                    continue
                what = self._where.get(wd)
                if what is None:
                    continue
                run_dir, is_metrics = what
                if mask & self.IN_IGNORED:  # the file was replaced or the directory removed
                    self._where.pop(wd, None)
                    if is_metrics and self._metrics.get(run_dir) == wd:
                        del self._metrics[run_dir]
                        self._watch_metrics(run_dir)
                    continue
                if is_metrics:
                    self._progress.add(run_dir)
                elif name == rundir.METRICS:
                    self._watch_metrics(run_dir)
                    self._progress.add(run_dir)
                elif name in rundir.URGENT_FILES and mask & (self.IN_CLOSE_WRITE | self.IN_MOVED_TO):
                    urgent.setdefault(run_dir, set()).add(name)
        if overflow:
            self._send({"event": "overflow"})
        for run_dir, names in urgent.items():
            self.push(run_dir, sorted(names))

    def _poll(self) -> None:
        with self._lock:
            polled = list(self._stats)
        for run_dir in polled:
            now = self._signature(run_dir)
            with self._lock:
                before = self._stats.get(run_dir)
                if before is None:
                    continue  # unwatched meanwhile
                self._stats[run_dir] = now
                changed = [n for n, sig in now.items() if sig is not None and sig != before.get(n)]
                if rundir.METRICS in changed:
                    self._progress.add(run_dir)
            urgent = [n for n in changed if n in rundir.URGENT_FILES]
            if urgent:
                self.push(run_dir, urgent)

    def _flush_progress(self) -> None:
        with self._lock:
            grown, self._progress = self._progress, set()
        for run_dir in sorted(grown):
            self._send({"event": "files", "dir": run_dir, "names": [rundir.METRICS]})


def _read_at(path: str, offset: int, limit: int) -> bytes:
    """At most `limit` bytes of a regular file from `offset`; b"" when it is missing, a link or
    not a regular file (looked at with lstat first: a FIFO or a device is never opened)."""
    if limit <= 0:
        return b""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return b""
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return b""
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else meanwhile
            return b""
        chunks = []
        while limit > 0:
            chunk = os.pread(fd, min(limit, 1 << 20), offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            limit -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _serve_start(run_dir: str, values: dict, clean_env: bool, python: str | None) -> dict:
    """`PYTHON supervisor.py start` (the wrapper, beside this file) as its own process in a new
    session, the values on its stdin, as the remote command did under `setsid nohup` (SIGHUP is
    ignored here): the target's `python` as configured runs it, and the helper never forks from
    its threads."""
    wrapper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "supervisor.py")
    argv = [python or sys.executable, wrapper, "start", run_dir, "--secrets-stdin"]
    if clean_env:
        argv.append("--clean-env")
    proc = subprocess.run(
        argv,
        input=json.dumps(values).encode(),
        capture_output=True,
        start_new_session=True,
        check=False,
    )
    return {
        "returncode": proc.returncode,
        "stdout": proc.stdout.decode("utf-8", "replace")[-8000:],
        "stderr": proc.stderr.decode("utf-8", "replace")[-8000:],
    }


def _serve_write(path: str, data: bytes) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    jobctl.atomic_write(path, data)


class _Server:
    """One helper: the only writer of its stdout, its watcher, and the requests it answers."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._lock = threading.Lock()
        self.watcher = _Watcher(self.send)

    def send(self, message: dict) -> None:
        line = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            try:
                self._out.write(line)
                self._out.flush()
            except (OSError, ValueError):  # the channel is gone; nobody is left to tell
                pass

    def handle(self, raw: bytes) -> None:
        """Answer one request line: in turn when it is quick, else in a thread of its own."""
        try:
            request = json.loads(raw)
            rid, op = request["id"], request["op"]
        except (ValueError, TypeError, KeyError) as exc:
            self.send({"event": "bad_request", "error": f"{type(exc).__name__}: {exc}"})
            return
        if op in ("ping", "watch", "unwatch"):
            self._answer(rid, op, request)
            return
        worker = threading.Thread(target=self._answer, args=(rid, op, request), daemon=op not in _FINISH_ON_EXIT)
        worker.start()

    def _answer(self, rid: object, op: str, request: dict) -> None:
        try:
            result = self._run(op, request)
        except Exception as exc:
            code = getattr(exc, "errno", None)
            error = (exc.strerror or str(exc)) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
            self.send({"id": rid, "ok": False, "error": error, "errno": errno.errorcode.get(code or 0)})
            return
        self.send({"id": rid, "ok": True, "result": result})

    def _run(self, op: str, r: dict) -> object:
        if op == "ping":
            return {"pid": os.getpid(), "threads": threading.active_count()}
        if op == "probe":
            return [jobctl.probe_dir(str(i["dir"]), i.get("handle")) for i in r["runs"]]
        if op == "status":
            return jobctl.job_status(str(r["dir"]), r.get("handle"))
        if op == "start":
            values = dict(r.get("values") or {})
            return _serve_start(str(r["dir"]), values, bool(r.get("clean_env")), r.get("python"))
        if op == "cancel":
            return jobctl.cancel(str(r["dir"]), float(r.get("grace", 10.0)), r.get("handle"))
        if op == "read":
            limit = min(int(r["limit"]), SERVE_READ_LIMIT)
            return {"data": base64.b64encode(_read_at(str(r["path"]), int(r.get("offset", 0)), limit)).decode()}
        if op == "write":
            _serve_write(str(r["path"]), base64.b64decode(r["data"]))
            return None
        if op == "watch":
            run_dir = str(r["dir"])
            inotify = self.watcher.add(run_dir)
            present = self.watcher.present(run_dir)
            if present:
                self.watcher.push(run_dir, present)
            handle = jobctl.read_handle(run_dir) or {}
            job = [handle.get("pid"), handle.get("start_time")]
            return {"inotify": inotify, "job": job if all(isinstance(n, int) for n in job) else None}
        if op == "unwatch":
            self.watcher.remove(str(r["dir"]))
            return None
        raise ValueError(f"unknown request {op!r}")


def serve(stdin: BinaryIO, stdout: BinaryIO) -> int:
    """Answer requests from `stdin` on `stdout` until `stdin` closes (the channel went); a start,
    a cancel or a write under way is finished first. See the comment above for the protocol."""
    # A channel that closes must not cut a cancel short between its TERM and its KILL.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    server = _Server(stdout)
    server.send(
        {
            "event": "hello",
            "protocol": SERVE_PROTOCOL,
            "pid": os.getpid(),
            "python": ".".join(str(n) for n in sys.version_info[:3]),
            "inotify": server.watcher.inotify,
        }
    )
    for raw in stdin:
        if raw.strip():
            server.handle(raw)
    return 0


def main(argv: list[str]) -> int:
    """Serve the channel on stdin and stdout (no arguments; `serve`, the previous release's word, is taken too)."""
    if argv not in ([], ["serve"]):
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but answers may reach the channel
    return serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
