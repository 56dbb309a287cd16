"""The SSH executor: jobs on a host reached with asyncssh, one shared connection per target.

Jobs start under `setsid nohup` through `trainer_plugin/jobctl.py`, which the connection
installs once under `<workdir>/.obd/` (executors/remote.py); status, cancel and the probe of
every run of the target run that same script on the host, so a poll of N runs is one remote
command. The connection and its reconnects are `connection.py`'s, files over SFTP `files.py`'s.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import Any

import asyncssh
import structlog

from executors import remote
from executors.base import (
    CommandResult,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobStatus,
    LaunchUncertain,
    Reached,
    RunEvents,
    RunProbe,
    TargetUnreachable,
)
from executors.config import SshTarget
from executors.ssh.connection import Session, SshConnection, as_bytes, returncode, tail
from executors.ssh.files import SftpFiles
from trainer_plugin import rundir

log = structlog.get_logger()


class SshExecutor:
    """Runs jobs on one SSH host; see the module docstring for how."""

    shares_filesystem = False
    events: RunEvents | None = None

    def __init__(
        self,
        name: str,
        target: SshTarget,
        *,
        host_key: str | None = None,
        max_channels: int = 8,
        op_timeout: float = 60.0,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
    ) -> None:
        self.name = name
        self.target = target
        self.connection = SshConnection(
            name,
            target,
            host_key=host_key,
            max_channels=max_channels,
            op_timeout=op_timeout,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
        )
        self.files = SftpFiles(self.connection)

    # --- what the connection knows ----------------------------------------------------------

    @property
    def workdir(self) -> str:
        """The workdir as configured, or its absolute path once connected."""
        return self.connection.workdir

    @property
    def address(self) -> str:
        """`host:port`, as error messages and logs name the target."""
        return self.connection.address

    @property
    def host_key_status(self) -> str | None:
        """How the host key was trusted: known, pinned, accepted (then recorded), or why not."""
        return self.connection.host_key_status

    @property
    def python_version(self) -> str | None:
        return self.connection.python_version

    @property
    def round_trips(self) -> int:
        """Remote commands and SFTP requests awaited so far (for tests and benchmarks)."""
        return self.connection.round_trips

    @property
    def connects(self) -> int:
        return self.connection.connects

    @property
    def unreachable_since(self) -> float | None:
        """Wall-clock time of the first failed attempt to connect, while the host is unreachable."""
        return self.connection.unreachable_since

    async def connect(self) -> None:
        """Open the connection now (else the first operation does), resolving the workdir."""
        await self.connection.ensure()

    async def resolve_workdir(self) -> str:
        """The absolute workdir on the host (`~` expanded there)."""
        return (await self.connection.ensure()).workdir

    async def reach(self) -> Reached:
        """Connect (host key checked, workdir set up) and say as whom and how the key was trusted."""
        session = await self.connection.ensure()
        user = self.target.user or "(default user)"
        return Reached(where=f"{user}@{self.address}", trust=_trust(self.host_key_status), workdir=session.workdir)

    async def python(self) -> str:
        """The interpreter the target's jobs and jobctl run with (a name or a path there)."""
        return (await self.connection.ensure()).python

    async def aclose(self) -> None:
        await self.connection.aclose()

    # --- commands ---------------------------------------------------------------------------

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run `argv` on the host, every word quoted."""

        async def op(s: Session) -> CommandResult:
            r = await self.connection.run(s, remote.join(argv), stdin)
            return CommandResult(returncode=returncode(r), stdout=as_bytes(r.stdout), stderr=as_bytes(r.stderr))

        return await self.connection.remote(f"`{argv[0]}`", op, timeout=timeout)

    async def _jobctl(
        self, what: str, args: list[str], stdin: bytes = b"", *, timeout: float | None = None, retry: bool = True
    ) -> bytes:
        """Run obd's jobctl on the host with these arguments; its stdout."""

        async def op(s: Session) -> bytes:
            await self.connection.require_python(s)
            r = await self.connection.run(s, remote.jobctl_command(s.python, s.jobctl, *args), stdin)
            if r.exit_status is None and r.exit_signal is None:  # the connection went mid-command
                raise asyncssh.ConnectionLost(f"no exit status for {what}")
            if returncode(r) != 0:
                raise ExecutorError(f"{what} on {self.address} failed (exit {returncode(r)}): {tail(r.stderr)}")
            return as_bytes(r.stdout)

        return await self.connection.remote(what, op, timeout=timeout, retry=retry)

    # --- jobs -------------------------------------------------------------------------------

    async def spawn(self, job: JobSpec) -> JobHandle:
        """Write job.json, then start the job detached with its environment on stdin; return its handle."""
        session = await self.connection.ensure()
        run_dir = job.remote_dir.rstrip("/") or "/"
        # The environment's values go to the wrapper on its stdin with the secrets, never into job.json.
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [f"{run_dir}/{rundir.PLUGIN}"],
            "path_prepend": [],
            "umask": job.umask,
        }
        if self.target.venv:
            spec["path_prepend"] = [str(PurePosixPath(session.python).parent)]
        await self.put_file(f"{run_dir}/{rundir.JOB_SPEC}", json.dumps(spec).encode())
        secrets_json = json.dumps({**job.env, **job.secrets}).encode()

        async def op(s: Session) -> bytes:
            await self.connection.require_python(s)
            r = await self.connection.run(s, remote.start_command(s.python, s.jobctl, run_dir), secrets_json)
            if r.exit_status is None and r.exit_signal is None:
                # The channel closed with no exit status: the connection went mid-start.
                raise LaunchUncertain(
                    f"the connection to {self.address} closed before the start of run {job.run_id} answered; "
                    "whether the job started is not known yet"
                )
            if returncode(r) != 0:
                raise ExecutorError(
                    f"starting run {job.run_id} on {self.address} failed (exit {returncode(r)}): "
                    f"{tail(r.stderr) or 'no message'}; see {run_dir}/job.log there (`obd train logs {job.run_id}`)"
                )
            return as_bytes(r.stdout)

        # Never retried: had the job started before the connection broke, a retry would start it twice.
        try:
            out = await self.connection.remote(f"the start of run {job.run_id}", op, retry=False)
        except LaunchUncertain:
            raise
        except TargetUnreachable as exc:
            raise LaunchUncertain(f"{exc}; whether the job started is not known yet") from exc
        try:
            handle = JobHandle.model_validate_json(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(
                f"the job wrapper on {self.address} printed no handle; see {run_dir}/job.log there"
            ) from exc
        handle.host = self.address
        log.info("ssh.spawned", target=self.name, run_id=job.run_id, pid=handle.pid, remote_dir=run_dir)
        return handle

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        """The job's state, from one probe of its directory."""
        return (await self.probe([(handle, remote_dir)]))[0].status

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        """TERM the job's group, wait `grace`, KILL: done by jobctl on the host, so it is one command."""
        args = ["cancel", remote_dir, "--grace", repr(float(grace)), "--handle", _handle_json(handle)]
        out = await self._jobctl(f"the cancel of {remote_dir}", args, timeout=grace + self.connection.op_timeout)
        return JobStatus.model_validate_json(out.strip().splitlines()[-1])

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        """Everything the follow needs about all these runs, in one remote command."""
        if not runs:
            return []
        items = [{"dir": d, "handle": json.loads(_handle_json(h)) if h else None} for h, d in runs]
        out = await self._jobctl("a probe", ["probe"], json.dumps(items).encode())
        try:
            return [RunProbe.model_validate(p) for p in json.loads(out)]
        except ValueError as exc:
            raise ExecutorError(f"the probe on {self.address} printed something that is not its JSON: {exc}") from exc

    # --- files ------------------------------------------------------------------------------

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        return await self.files.read_from(path, offset, limit)

    async def put_file(self, path: str, data: bytes) -> None:
        await self.files.put_file(path, data)

    async def upload(self, local: Path, remote: str) -> None:
        await self.files.upload(local, remote)

    async def download(self, remote: str, local: Path) -> None:
        await self.files.download(remote, local)


def _trust(status: str | None) -> str:
    return {
        "known": "matches known_hosts",
        "pinned": "matches the pinned key",
        "accepted": "was unknown: accepted (accept_unknown_host) and recorded in known_hosts",
    }.get(status or "", status or "unknown")


def _handle_json(handle: JobHandle) -> str:
    return json.dumps({"pid": handle.pid, "start_time": handle.start_time, "boot_id": handle.boot_id})
