"""The local executor: jobs on the daemon's own machine, detached so they outlive it.

The job is started by `trainer_plugin/jobctl.py` (the same wrapper used on SSH hosts and
pods) in its own session and process group; the daemon is not its parent, so a restart of
the daemon never touches it. Under systemd the wrapper is launched in its own transient
scope (`systemd-run --scope`), outside the service's cgroup, so `systemctl restart obd`
kills no job.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import anyio
import anyio.to_thread

from executors.base import ExecutorError, JobHandle, JobSpec, JobState, JobStatus, RunProbe
from trainer_plugin import jobctl

JOBCTL = Path(jobctl.__file__).resolve()


def systemd_scope_prefix(run_id: str) -> list[str]:
    """`systemd-run --scope` when the daemon runs as a systemd service and the tool exists."""
    if not os.environ.get("INVOCATION_ID") or os.environ.get("OBD_NO_SCOPE"):
        return []
    tool = shutil.which("systemd-run")
    if not tool:
        return []
    scope = ["--user"] if os.geteuid() != 0 else []
    return [tool, *scope, "--scope", "--quiet", "--collect", f"--unit=obd-run-{run_id}"]


class LocalExecutor:
    """Runs jobs on this machine; reads and writes the run directory directly."""

    def __init__(self, name: str, workdir: Path, python: str | None = None) -> None:
        self.name = name
        self.workdir = str(workdir)
        self.python = python or sys.executable

    async def spawn(self, job: JobSpec) -> JobHandle:
        run_dir = Path(job.remote_dir)
        await anyio.to_thread.run_sync(lambda: run_dir.mkdir(parents=True, exist_ok=True))
        spec = {
            "command": job.command,
            "cwd": job.cwd,
            "env": job.env,
            "pythonpath": [str(run_dir / "plugin")],
        }
        await self.put_file(str(run_dir / "job.json"), json.dumps(spec).encode())
        argv = [*systemd_scope_prefix(job.run_id), self.python, str(JOBCTL), "start", str(run_dir), "--secrets-stdin"]
        try:
            result = await anyio.run_process(
                argv, input=json.dumps(job.secrets).encode(), check=False, stderr=None
            )
        except OSError as exc:
            raise ExecutorError(f"could not launch the job wrapper ({argv[0]}): {exc}") from exc
        if result.returncode != 0:
            raise ExecutorError(
                f"the job wrapper failed (exit {result.returncode}): "
                f"{result.stderr.decode(errors='replace').strip() if result.stderr else ''}"
            )
        try:
            return JobHandle.model_validate_json(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(f"the job wrapper printed no handle; see {run_dir}/job.log") from exc

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
