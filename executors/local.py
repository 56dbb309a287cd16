"""The local executor: jobs on the daemon's own machine, detached so they outlive it.

The job is started by `trainer_plugin/jobctl.py` (the same wrapper used on SSH hosts and
pods) in its own session and process group; the daemon is not its parent, so a restart of
the daemon never touches it. Under systemd the wrapper is launched in its own transient
scope (`systemd-run --scope`), outside the service's cgroup, so `systemctl restart obd`
kills no job.
"""

from __future__ import annotations

import contextlib
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

from executors.base import (
    CommandResult,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Reached,
    RunProbe,
)
from trainer_plugin import jobctl, rundir

log = structlog.get_logger("obd.local")

JOBCTL = Path(jobctl.__file__).resolve()


class DirWatch:
    """inotify on run directories, so a request, a proof or an exit written by anyone is seen at
    once, and on each run's metrics.jsonl, so its progress is seen as it grows.

    Events are reported as paths (`<run dir>/<name>`). Where inotify cannot be had, `available`
    is False and the follow's polling still sees everything.
    """

    IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
    IN_IGNORED, IN_Q_OVERFLOW = 0x8000, 0x4000
    _HEADER = struct.Struct("iIII")

    def __init__(self) -> None:
        self._wds: dict[str, int] = {}  # run dir -> its watch
        self._files: dict[str, int] = {}  # a run's metrics.jsonl -> its watch
        self._paths: dict[int, str] = {}  # watch -> what it watches
        self._fd = -1
        try:
            self._libc = ctypes.CDLL(None, use_errno=True)
            self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            self._fd = -1

    @property
    def available(self) -> bool:
        return self._fd >= 0

    def _add(self, path: str, mask: int) -> int | None:
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(path), mask)
        if wd < 0:
            return None
        self._paths[wd] = path
        return int(wd)

    def add(self, directory: str) -> None:
        if not self.available or directory in self._wds:
            return
        wd = self._add(directory, self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE)
        if wd is not None:
            self._wds[directory] = wd
            self._watch_metrics(directory)

    def _watch_metrics(self, directory: str) -> None:
        path = os.path.join(directory, rundir.METRICS)
        if path not in self._files and os.path.isfile(path):
            wd = self._add(path, self.IN_MODIFY)
            if wd is not None:
                self._files[path] = wd

    def remove(self, directory: str) -> None:
        for table, key in ((self._wds, directory), (self._files, os.path.join(directory, rundir.METRICS))):
            wd = table.pop(key, None)
            if wd is not None and self.available:
                self._paths.pop(wd, None)
                self._libc.inotify_rm_watch(self._fd, wd)

    async def paths(self) -> set[str]:
        """Wait for events; the paths of the files they were about."""
        await anyio.wait_readable(self._fd)
        paths: set[str] = set()
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return paths
        pos = 0
        while pos + self._HEADER.size <= len(data):
            wd, mask, _cookie, length = self._HEADER.unpack_from(data, pos)
            pos += self._HEADER.size
            name = data[pos : pos + length].rstrip(b"\0").decode(errors="replace")
            pos += length
            if mask & self.IN_Q_OVERFLOW:
                paths.add("")  # events were lost: the follow reads every run
                continue
            where = self._paths.get(wd)
            if where is None or mask & self.IN_IGNORED:
                continue
            if name:  # an event in a run directory
                paths.add(f"{where}/{name}")
                if name == rundir.METRICS:
                    self._watch_metrics(where)
            else:  # an event on a watched file itself (metrics.jsonl grew)
                paths.add(where)
        return paths


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
        """Paths of files just written in watched run directories (blocks until there are some)."""
        if not self.dir_watch.available:
            await anyio.sleep_forever()
        return await self.dir_watch.paths()

    async def wait_exit(self, handle: JobHandle) -> None:
        """Return when the job's wrapper has exited (pidfd: woken by the kernel, no polling)."""
        if not jobctl.handle_alive(handle.model_dump()):
            return
        try:
            fd = os.pidfd_open(handle.pid)
        except OSError:
            return  # gone already, or no pidfd here: the follow's polling still sees the exit
        try:
            # The pid may have been reused between the check and the open: check again.
            if jobctl.handle_alive(handle.model_dump()):
                await anyio.wait_readable(fd)
        finally:
            os.close(fd)


class LocalExecutor:
    """Runs jobs on this machine; reads and writes the run directory directly."""

    shares_filesystem = True

    def __init__(self, name: str, workdir: Path, python: str | None = None, venv: str | None = None) -> None:
        self.name = name
        self.workdir = str(workdir)
        self.interpreter = python or sys.executable
        self.venv = venv  # its bin/ leads the job's PATH
        self.events: LocalEvents | None = LocalEvents()

    async def resolve_workdir(self) -> str:
        return str(Path(self.workdir).expanduser().resolve())

    async def reach(self) -> Reached:
        """Nothing to connect to: this machine, trusted as it is."""
        return Reached(where="this machine", trust="not applicable", workdir=await self.resolve_workdir())

    async def python(self) -> str:
        return self.interpreter

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        try:
            with anyio.fail_after(timeout):
                r = await anyio.run_process(argv, input=stdin, check=False)
        except OSError as exc:
            return CommandResult(returncode=127, stderr=str(exc).encode())
        return CommandResult(returncode=r.returncode, stdout=r.stdout, stderr=r.stderr)

    async def spawn(self, job: JobSpec) -> JobHandle:
        run_dir = Path(job.remote_dir)
        await anyio.to_thread.run_sync(private_dir, run_dir)
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [str(run_dir / rundir.PLUGIN)],
            "umask": job.umask,
            "output_to": job.output_to,
        }
        if self.venv:
            spec["path_prepend"] = [str(Path(self.venv) / "bin")]
        if job.run_as is not None:
            spec["run_as"] = job.run_as.model_dump()
        await self.put_file(str(run_dir / rundir.JOB_SPEC), json.dumps(spec).encode())
        if job.run_as is not None:
            # Made by the daemon in a directory only it could enter so far: now the user's.
            await anyio.to_thread.run_sync(hand_over, run_dir, job.run_as.uid, job.run_as.gid)
        # -S -E: the wrapper needs only the standard library, and starts faster without site-packages
        # and the daemon's PYTHON* variables.
        wrapper = [self.interpreter, "-S", "-E", str(JOBCTL), "start", str(run_dir), "--secrets-stdin"]
        values = {**(job.base_env or {}), **job.env, **job.secrets}
        if job.base_env is not None:
            wrapper.append("--clean-env")  # the job's whole environment is on stdin, not the daemon's
        secrets = json.dumps(values).encode()
        scope = systemd_scope_prefix(job.run_id)
        result = await self._run_wrapper([*scope, *wrapper], secrets)
        if scope and result.returncode != 0 and jobctl.read_handle(str(run_dir)) is None:
            # No scope could be made (no user manager for a `User=` service, no bus): the wrapper
            # never ran, so run it in the service's cgroup, which KillMode=process keeps on restart.
            log.warning(
                "systemd_scope_failed", run_id=job.run_id, error=_text(result.stderr) or f"exit {result.returncode}"
            )
            result = await self._run_wrapper(wrapper, secrets)
        if result.returncode != 0:
            raise ExecutorError(
                f"the job wrapper failed (exit {result.returncode}): {_text(result.stderr)}; see {run_dir}/job.log"
            )
        try:
            return JobHandle.model_validate_json(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(f"the job wrapper printed no handle; see {run_dir}/job.log") from exc

    @staticmethod
    async def _run_wrapper(argv: list[str], secrets: bytes) -> subprocess.CompletedProcess[bytes]:
        """Run the wrapper with the secrets on its stdin; one that exits unread (a systemd-run
        that could not make the scope) is a failed exit, not a broken pipe."""
        try:
            proc = await anyio.open_process(argv)
        except OSError as exc:
            raise ExecutorError(f"could not launch the job wrapper ({argv[0]}): {exc}") from exc
        out, err = bytearray(), bytearray()

        async def drain(stream: Any, buf: bytearray) -> None:
            async for chunk in stream:
                buf.extend(chunk)

        async with proc:
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain, proc.stdout, out)
                tg.start_soon(drain, proc.stderr, err)
                assert proc.stdin is not None  # opened with a pipe
                # It may exit without reading: its exit status and stderr say why.
                with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    await proc.stdin.send(secrets)
                await proc.stdin.aclose()
            code = await proc.wait()
        return subprocess.CompletedProcess(argv, code, bytes(out), bytes(err))

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        raw = await anyio.to_thread.run_sync(jobctl.job_status, remote_dir, handle.model_dump(), abandon_on_cancel=True)
        return JobStatus.model_validate(raw)

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        # jobctl.cancel sleeps through the grace; in a worker thread it holds up nothing else.
        raw = await anyio.to_thread.run_sync(jobctl.cancel, remote_dir, grace, handle.model_dump())
        return JobStatus.model_validate(raw)

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        def probe_all() -> list[dict]:
            return [jobctl.probe_dir(d, h.model_dump() if h else None) for h, d in runs]

        # abandon_on_cancel: a read stuck in the kernel (NFS, FUSE) is left behind, not waited for.
        return [RunProbe.model_validate(p) for p in await anyio.to_thread.run_sync(probe_all, abandon_on_cancel=True)]

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        data = await anyio.to_thread.run_sync(jobctl.read_regular, path, limit, offset, abandon_on_cancel=True)
        return data or b""

    async def put_file(self, path: str, data: bytes) -> None:
        def write() -> None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            jobctl.atomic_write(path, data)

        try:
            await anyio.to_thread.run_sync(write)
        except OSError as exc:
            raise ExecutorError(f"could not write {path}: {exc.strerror or exc}") from exc

    async def upload(self, local: Path, remote: str) -> None:
        await anyio.to_thread.run_sync(_copy, local, Path(remote))

    async def download(self, remote: str, local: Path) -> None:
        await anyio.to_thread.run_sync(_copy, Path(remote), local)

    async def aclose(self) -> None:
        return None


def private_dir(path: Path) -> None:
    """Make a run directory (and missing parents) readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o711)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


def hand_over(run_dir: Path, uid: int, gid: int) -> None:
    """Give a run directory the daemon made to the user its job runs as (links not followed)."""
    for root, dirs, files in os.walk(run_dir):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
    os.lchown(run_dir, uid, gid)


def _copy(src: Path, dst: Path) -> None:
    if not src.exists():
        return
    if not dst.parent.exists():
        private_dir(dst.parent)
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


__all__ = ["JobState", "LocalExecutor"]
