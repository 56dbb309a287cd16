"""The local executor: jobs on the daemon's own machine, detached so they outlive it.

The job is started by `trainer_plugin/jobctl.py` (the same wrapper used on SSH hosts and
pods) in its own session and process group; the daemon is not its parent, so a restart of
the daemon never touches it. Under systemd the wrapper is launched in its own transient
scope (`systemd-run --scope`), outside the service's cgroup, so `systemctl restart obd`
kills no job.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from executors.base import CommandResult, ExecutorError, JobHandle, JobSpec, JobState, JobStatus, RunProbe
from trainer_plugin import jobctl

log = structlog.get_logger("obd.local")

JOBCTL = Path(jobctl.__file__).resolve()


class DirWatch:
    """inotify on run directories, so a request or proof written by anyone is seen at once.

    Where inotify cannot be had, `available` is False and the follow's polling still sees it.
    """

    IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x8, 0x80, 0x100
    _HEADER = struct.Struct("iIII")

    def __init__(self) -> None:
        self._wds: dict[str, int] = {}
        self._fd = -1
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            self._fd = -1

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def add(self, directory: str) -> None:
        if not self.available or directory in self._wds:
            return
        mask = self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(directory), mask)
        if wd >= 0:
            self._wds[directory] = wd

    def remove(self, directory: str) -> None:
        wd = self._wds.pop(directory, None)
        if wd is not None and self.available:
            self._libc.inotify_rm_watch(self._fd, wd)

    async def names(self) -> set[str]:
        """Wait for events; the names of the files they were about."""
        await anyio.wait_readable(self._fd)
        names: set[str] = set()
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return names
        pos = 0
        while pos + self._HEADER.size <= len(data):
            _wd, _mask, _cookie, length = self._HEADER.unpack_from(data, pos)
            pos += self._HEADER.size
            names.add(data[pos : pos + length].rstrip(b"\0").decode(errors="replace"))
            pos += length
        return names


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode(errors="replace").strip()[-2000:]


def systemd_scope_prefix(run_id: str) -> list[str]:
    """`systemd-run --scope` when the daemon runs as a systemd service and the tool exists."""
    if not os.environ.get("INVOCATION_ID") or os.environ.get("OBD_NO_SCOPE"):
        return []
    tool = shutil.which("systemd-run")
    if not tool:
        return []
    scope = ["--user"] if os.geteuid() != 0 else []
    return [tool, *scope, "--scope", "--quiet", "--collect", f"--unit=obd-run-{run_id}"]


class LocalEvents:
    """The local target's events: a pidfd per job for its exit, inotify on run directories."""

    def __init__(self) -> None:
        self.dir_watch = DirWatch()

    def watch(self, remote_dir: str) -> None:
        self.dir_watch.add(remote_dir)

    def unwatch(self, remote_dir: str) -> None:
        self.dir_watch.remove(remote_dir)

    async def changed_files(self) -> set[str]:
        """Names of files just written in a watched run directory (blocks until there are some)."""
        if not self.dir_watch.available:
            await anyio.sleep_forever()
        return await self.dir_watch.names()

    async def aclose(self) -> None:
        return None


def _copy(src: Path, dst: Path) -> None:
    if not src.exists():
        return
    if src.is_dir():
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True, ignore=_ignore)
    else:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)


def _ignore(directory: str, names: list[str]) -> set[str]:
    skip = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules", ".venv", "venv"}
    out = {n for n in names if n in skip}
    out |= {n for n in names if (Path(directory) / n / "pyvenv.cfg").exists()}
    return out


__all__ = ["LocalExecutor", "JobState"]
