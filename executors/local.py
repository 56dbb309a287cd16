"""The local executor: jobs on the daemon's own machine, detached so they outlive it.

The job is started by the job wrapper (`trainer_plugin/tools/supervisor.py`, through `jobctl.py
start`, the same wrapper used on SSH hosts and pods) in its own session and process group; the
daemon is not its parent, so a restart of the daemon never touches it. Under systemd the
wrapper is launched in its own transient scope (`systemd-run --scope`), outside the service's
cgroup, so `systemctl restart obd` kills no job.

Under a root daemon a run directory is its owner's, and everything in it is as hostile as its
owner: every read, write, copy and listing in it is done with the owner's filesystem rights
(`trainer_plugin/tools/creds.py`, in the worker thread doing it), so no link or file planted there
makes root read, copy or write anything the owner could not. Whether a job runs, how it ended
and which processes are its come from the wrapper, which stays root, and its facts directory
(`STATE_DIR/facts/<run id>/`, the daemon's own): never from a file in the run directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from executors import exec_process, python_shim
from executors.base import (
    CommandResult,
    ExecIO,
    ExecSpec,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Reached,
    RunAs,
    RunProbe,
)
from executors.containment import Containment, find_base
from trainer_plugin import rundir
from trainer_plugin.tools import creds, jobctl, supervisor

log = structlog.get_logger("obd.local")

SUPERVISOR = Path(supervisor.__file__).resolve()  # the job wrapper, run by path


class DirWatch:
    """inotify on run directories, so a request, a proof or an exit written by anyone is seen at
    once, and on each run's metrics.jsonl, so its progress is seen as it grows.

    Events are reported as paths (`<run dir>/<name>`). Where inotify cannot be had, `available`
    is False and the follow's polling still sees everything.
    """

    IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE = 0x2, 0x8, 0x80, 0x100
    IN_IGNORED, IN_Q_OVERFLOW = 0x8000, 0x4000
    IN_ONLYDIR, IN_DONT_FOLLOW = 0x01000000, 0x02000000  # a link planted for a watched name is never followed
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
        wd = self._add(
            directory, self.IN_CLOSE_WRITE | self.IN_MOVED_TO | self.IN_CREATE | self.IN_ONLYDIR | self.IN_DONT_FOLLOW
        )
        if wd is not None:
            self._wds[directory] = wd
            self._watch_metrics(directory)

    def _watch_metrics(self, directory: str) -> None:
        path = rundir.RunPaths(directory).metrics
        if path not in self._files and rundir.non_regular(path) is None and os.path.lexists(path):
            wd = self._add(path, self.IN_MODIFY | self.IN_DONT_FOLLOW)
            if wd is not None:
                self._files[path] = wd

    def remove(self, directory: str) -> None:
        for table, key in ((self._wds, directory), (self._files, rundir.RunPaths(directory).metrics)):
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
    """Runs jobs on this machine; reads and writes the run directory directly, with its owner's rights."""

    shares_filesystem = True

    def __init__(
        self,
        name: str,
        workdir: Path,
        python: str | None = None,
        venv: str | None = None,
        facts: Path | None = None,
    ) -> None:
        self.name = name
        self.workdir = str(workdir)
        self.interpreter = python or sys.executable
        self.configured_python = python  # also the `python` of its jobs' PATH (executors/python_shim.py)
        self.venv = venv  # its bin/ leads the job's PATH
        # Where each run's wrapper records its handle and end (None: in the run directory, as
        # for a host that is not the daemon's: only for a workdir used without a state directory).
        self.facts_root = str(facts) if facts is not None else None
        self.events: LocalEvents | None = LocalEvents()
        self._containment: Containment | None = None

    @property
    def containment(self) -> Containment:
        """Its runs' cgroups (docs/security.md), found on first use."""
        if self._containment is None:
            self._containment = Containment(find_base())
        return self._containment

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

    # --- whose rights -------------------------------------------------------------------------

    def _workdirs(self) -> tuple[str, ...]:
        given = os.path.normpath(os.path.expanduser(self.workdir))
        return given, os.path.realpath(given)

    def owner(self, path: str) -> creds.Account | None:
        """Whose filesystem rights an operation on `path` takes: the owner of the run directory it
        is in (root made it and gave it to them, and only root can give it to anyone else), or
        the daemon's own for a path outside the workdir (its state directory, the plugin stage)."""
        parts = path.split("/")
        if ".." in parts:
            raise ExecutorError(f"{path}: a path with '..' is never used in a run directory")
        path = os.path.normpath(path)
        for root in self._workdirs():
            rel = os.path.relpath(path, root)
            if rel != "." and not rel.startswith(".."):
                return creds.owner_of(os.path.join(root, rel.split(os.sep)[0]))
        return None

    def in_workdir(self, path: str) -> bool:
        """Whether `path` is in a run directory (not the workdir itself)."""
        path = os.path.normpath(path)
        return any(not os.path.relpath(path, root).startswith(".") for root in self._workdirs())

    def facts(self, remote_dir: str) -> str | None:
        """A run's facts directory, or None for a run started before obd kept them (its run
        directory says how it ended, as it did then)."""
        if self.facts_root is None:
            return None
        path = os.path.join(self.facts_root, os.path.basename(remote_dir.rstrip("/")))
        return path if os.path.isdir(path) else None

    async def _as_owner(self, path: str, fn: Any, *args: Any, abandon: bool = False) -> Any:
        who = self.owner(path)
        return await anyio.to_thread.run_sync(creds.call_as, who, fn, *args, abandon_on_cancel=abandon)

    # --- the job ------------------------------------------------------------------------------

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        """Make the run directory, private, and give it to the user the job runs as; and the
        run's facts directory, the daemon's own."""

        def make() -> None:
            run_dir = Path(remote_dir)
            private_dir(run_dir)
            st = os.lstat(run_dir)
            if not stat.S_ISDIR(st.st_mode):
                raise ExecutorError(f"{run_dir} exists and is not a directory")
            if owner is not None and os.geteuid() == 0 and st.st_uid != owner.uid:
                os.lchown(run_dir, owner.uid, owner.gid)
            if self.facts_root is not None:
                Path(self.facts_root).mkdir(mode=0o700, parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    (Path(self.facts_root) / run_dir.name).mkdir(mode=0o700)

        await anyio.to_thread.run_sync(make)

    async def spawn(self, job: JobSpec) -> JobHandle:
        run_dir = Path(job.remote_dir)
        paths = rundir.RunPaths(run_dir)
        await self.make_run_dir(job.remote_dir, job.run_as)
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [paths.plugin],
            "umask": job.umask,
            "output_to": job.output_to,
        }
        if self.venv:
            spec["path_prepend"] = [str(Path(self.venv) / "bin")]
        elif self.configured_python and (found := shutil.which(self.configured_python)):
            bin_dir = python_shim.bin_dir(paths.run_dir)  # as the wrapper finds it: through the daemon's PATH
            await self._as_owner(bin_dir, python_shim.write_local, bin_dir, os.path.abspath(found))
            spec["path_prepend"] = [bin_dir]
        if job.run_as is not None:
            spec["run_as"] = job.run_as.model_dump()
        # Every process of the run is its: its cgroup where one can be made, else its identity.
        spec["run_id"] = job.run_id
        if (cgroup := await anyio.to_thread.run_sync(self.containment.make, job.run_id)) is not None:
            spec["cgroup"] = cgroup
        # -S -E: the wrapper needs only the standard library, and starts faster without site-packages
        # and the daemon's PYTHON* variables. The spec comes on stdin with the values: job.json is
        # a file the user could rewrite before a root wrapper read it.
        wrapper = [self.interpreter, "-S", "-E", str(SUPERVISOR), "start", str(run_dir), "--spec-stdin"]
        facts = self.facts(job.remote_dir)
        if facts is not None:
            wrapper += ["--facts", facts]
        values = {**(job.base_env or {}), **job.env, **job.secrets}
        if job.base_env is not None:
            wrapper.append("--clean-env")  # the job's whole environment is on stdin, not the daemon's
        payload = json.dumps({"spec": spec, "values": values}).encode()
        scope = systemd_scope_prefix(job.run_id)
        result = await self._run_wrapper([*scope, *wrapper], payload)
        if scope and result.returncode != 0 and not self._wrapper_ran(job.remote_dir):
            # No scope could be made (no user manager for a `User=` service, no bus): the wrapper
            # never ran, so run it in the service's cgroup, which KillMode=process keeps on restart.
            log.warning(
                "systemd_scope_failed", run_id=job.run_id, error=_text(result.stderr) or f"exit {result.returncode}"
            )
            result = await self._run_wrapper(wrapper, payload)
        if result.returncode != 0:
            raise ExecutorError(
                f"the job wrapper failed (exit {result.returncode}): {_text(result.stderr)}; see {paths.job_log}"
            )
        try:
            return JobHandle.model_validate_json(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(f"the job wrapper printed no handle; see {paths.job_log}") from exc

    def _wrapper_ran(self, remote_dir: str) -> bool:
        facts = self.facts(remote_dir)
        if facts is not None:
            return jobctl.read_handle(remote_dir, facts) is not None
        return creds.call_as(self.owner(remote_dir), jobctl.read_handle, remote_dir) is not None

    @staticmethod
    async def _run_wrapper(argv: list[str], secrets: bytes) -> subprocess.CompletedProcess[bytes]:
        """Run the wrapper with the secrets on its stdin, in a worker thread: a process's start
        holds its caller until the child has exec'd (vfork), which on a busy box is tens of
        milliseconds the event loop, and every caller, would wait (issue 33). One that exits
        unread (a systemd-run that could not make the scope) is a failed exit, not a broken pipe."""

        def run() -> subprocess.CompletedProcess[bytes]:
            return subprocess.run(argv, input=secrets, capture_output=True, check=False)

        try:
            return await anyio.to_thread.run_sync(run)
        except OSError as exc:
            raise ExecutorError(f"could not launch the job wrapper ({argv[0]}): {exc}") from exc

    def _status(self, remote_dir: str, handle: dict | None) -> dict:
        """The job's status: from the wrapper and its facts (as the daemon), or, for a run started
        before obd kept facts, from its run directory (with its owner's rights)."""
        facts = self.facts(remote_dir)
        if facts is not None:
            return jobctl.job_status(remote_dir, handle, facts)
        return creds.call_as(self.owner(remote_dir), jobctl.job_status, remote_dir, handle)

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        raw = await anyio.to_thread.run_sync(self._status, remote_dir, handle.model_dump(), abandon_on_cancel=True)
        return JobStatus.model_validate(raw)

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        def cancel() -> dict:
            facts, who = self.facts(remote_dir), self.owner(remote_dir)
            if facts is None:
                return creds.call_as(who, jobctl.cancel, remote_dir, grace, handle.model_dump())
            marks, paths = rundir.FactPaths(facts), rundir.RunPaths(remote_dir)
            if jobctl.job_status(remote_dir, handle.model_dump(), facts)["state"] == "running":
                self._copy_mark(marks.cancelling, paths.cancelling, who, f"{time.time()}\n".encode())
            result = jobctl.cancel(remote_dir, grace, handle.model_dump(), facts)
            self._copy_mark(marks.cancelled, paths.cancelled, who)
            return result

        # jobctl.cancel sleeps through the grace; in a worker thread it holds up nothing else.
        return JobStatus.model_validate(await anyio.to_thread.run_sync(cancel))

    @staticmethod
    def _copy_mark(fact: str, copy: str, who: creds.Account | None, data: bytes = b"") -> None:
        """The run directory's copy (`copy`) of a cancel mark of the facts directory (`fact`), for
        people (the contract's `cancelling`, `cancelled`), written with its owner's rights; the
        facts directory's is the one obd reads."""
        data = data or jobctl.read_regular(fact, rundir.JOB_PID_LIMIT) or b""
        with creds.acting_as(who), contextlib.suppress(OSError):
            jobctl.atomic_write(copy, data)

    def _probe(self, handle: dict | None, remote_dir: str) -> dict:
        facts = self.facts(remote_dir)
        who = self.owner(remote_dir)
        if facts is None:
            return creds.call_as(who, jobctl.probe_dir, remote_dir, handle)
        status = jobctl.job_status(remote_dir, handle, facts)
        with creds.acting_as(who):
            result = jobctl.probe_dir(remote_dir, handle, with_job=False)
            found = jobctl.planted(remote_dir)
        marks = rundir.FactPaths(facts)
        result["planted"] = [n for n in found if not os.path.lexists(marks.file(n))]
        result["status"] = status
        result["handle"] = jobctl.read_handle(remote_dir, facts)
        result["python"] = jobctl.python_seen(result, result["handle"])
        return result

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        def probe_all() -> list[dict]:
            return [self._probe(h.model_dump() if h else None, d) for h, d in runs]

        # abandon_on_cancel: a read stuck in the kernel (NFS, FUSE) is left behind, not waited for.
        return [RunProbe.model_validate(p) for p in await anyio.to_thread.run_sync(probe_all, abandon_on_cancel=True)]

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        data = await self._as_owner(path, jobctl.read_regular, path, limit, offset, abandon=True)
        return data or b""

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        sizes: dict[str, int] = await self._as_owner(remote_dir, jobctl.checkpoint_sizes, remote_dir, abandon=True)
        return sizes

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        """Removed with the run directory's owner's rights (a root daemon's runs are their users'),
        so a link or a permission the job set up cannot make root delete anything else."""
        if not self.in_workdir(remote_dir):
            raise ExecutorError(f"{remote_dir} is not a run directory of target {self.name}: nothing removed")
        try:
            done = await self._as_owner(remote_dir, jobctl.remove_checkpoint, remote_dir, name)
        except (OSError, jobctl.CheckpointRefused) as exc:
            raise ExecutorError(f"could not remove {remote_dir}/{rundir.OUTPUT}/{name}: {exc}") from exc
        return int(done["freed"])

    async def put_file(self, path: str, data: bytes) -> None:
        def write() -> None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            jobctl.atomic_write(path, data)

        try:
            await self._as_owner(path, write)
        except OSError as exc:
            raise ExecutorError(f"could not write {path}: {exc.strerror or exc}") from exc

    async def upload(self, local: Path, remote: str) -> None:
        await anyio.to_thread.run_sync(self._copy, str(local), remote)

    async def download(self, remote: str, local: Path) -> None:
        await anyio.to_thread.run_sync(self._copy, remote, str(local))

    def _copy(self, src: str, dst: str) -> None:
        """Copy with the rights of whoever owns each side; links are kept only inside a run
        directory (the job's own space), never recreated in a place of the daemon's."""
        read_as, write_as = self.owner(src), self.owner(dst)
        with creds.acting_as(write_as):
            if not os.path.isdir(os.path.dirname(dst)):
                private_dir(Path(dst).parent)
        creds.copy_tree(src, dst, read_as=read_as, write_as=write_as, keep_links=self.in_workdir(dst), skip=_skip)

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        """A command in the run directory, as the run's user (`spec.run_as`, under a root daemon), in
        the run's cgroup where it has one, so it ends with the run."""
        cgroup = self.containment.live(spec.run_id)
        return await exec_process.run_here(spec, io, spec.run_as, self._exec_path(spec.remote_dir), cgroup)

    def lingering(self, runs: dict[str, int | None]) -> set[str]:
        """Which of these ended runs (run id -> its user's uid) still have a process here."""
        return self.containment.lingering(runs)

    def _exec_path(self, remote_dir: str) -> tuple[str, ...]:
        """What leads a command's PATH, as it leads the run's job's: the target's venv, or the
        run's `python` (executors/python_shim.py) where the target names one."""
        if self.venv:
            return (str(Path(self.venv).expanduser() / "bin"),)
        return (python_shim.bin_dir(remote_dir),) if self.configured_python else ()

    async def aclose(self) -> None:
        return None


def private_dir(path: Path) -> None:
    """Make a run directory readable by its owner only, and the parents it lacks passable (not
    listable) by everyone: a job run as its user must reach its own directory."""
    missing = [p for p in reversed(path.parents) if not p.exists()]
    for parent in missing:
        with contextlib.suppress(FileExistsError):
            parent.mkdir()
            # Set, not asked of mkdir: its mode is masked by the daemon's umask (077), which made
            # a second local target's workdir 0700 and its users' runs fail, permission denied.
            parent.chmod(0o711)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


def _skip(directory: str, name: str) -> bool:
    """Entries never copied: caches, version control, virtual environments."""
    if name in {".git", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules", ".venv", "venv"}:
        return True
    return os.path.exists(os.path.join(directory, name, "pyvenv.cfg"))


__all__ = ["JobState", "LocalExecutor"]
