"""The SSH executor: jobs on a host reached with asyncssh, one shared connection per target.

Jobs start under their own session through `trainer_plugin/tools/jobctl.py`, which the connection
installs once under `<workdir>/.obd/` (executors/remote.py). Probes, starts, cancels, reads and
writes go to the connection's persistent helper (`jobctl.py serve` on one channel,
`helper.py`), which also pushes exits, requests and proofs (the `events` capability,
`events.py`); where it cannot run, the same operations run as one remote command each (a poll
of N runs is still one command). The connection and its reconnects are `connection.py`'s,
uploads and downloads over SFTP `files.py`'s.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import asyncssh
import structlog

from executors import python_shim, remote
from executors.base import (
    CommandResult,
    ExecIO,
    ExecSpec,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobStatus,
    LaunchUncertain,
    Reached,
    RunAs,
    RunProbe,
    TargetUnreachable,
)
from executors.ssh import exec_remote
from executors.ssh.config import SshTarget
from executors.ssh.connection import Session, SshConnection, as_bytes, returncode, tail
from executors.ssh.events import SshEvents
from executors.ssh.files import SftpFiles
from executors.ssh.helper import HelperFailed, NoHelper, SshHelper
from trainer_plugin import rundir
from trainer_plugin.tools import jobserve

log = structlog.get_logger()


# The most one helper request carries; a larger write goes over SFTP, a larger read is asked in parts.
HELPER_WRITE_LIMIT = 8 << 20
HELPER_READ_LIMIT = jobserve.SERVE_READ_LIMIT


class SshExecutor:
    """Runs jobs on one SSH host; see the module docstring for how.

    `helper=False` keeps to one remote command per operation (and no `events`); `events_poll` is
    how often the follow is asked to read every run while no helper pushes (its poll interval).
    """

    shares_filesystem = False

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
        helper: bool = True,
        events_poll: float = 3.0,
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
        self.events: SshEvents | None = SshEvents(poll_hint=events_poll) if helper else None
        self.remote_helper = SshHelper(self.connection, self.events, enabled=helper)
        self.open_commands = 0  # `obd train exec` and `shell` sessions running now

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

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        """A command in the run directory over this connection, as its login (executors/ssh/exec_remote.py).
        At most `exec_remote.MAX_OPEN` at once: each holds a channel for its life, and the
        server's MaxSessions is shared with obd's own work on the connection."""
        if self.open_commands >= exec_remote.MAX_OPEN:
            raise ExecutorError(
                f"{exec_remote.MAX_OPEN} commands or shells are already open on target {self.name} through obd "
                "(each holds one of the SSH connection's channels, which obd's own work needs too); end one, "
                "and try again"
            )
        self.open_commands += 1
        try:
            return await exec_remote.run_there(self.connection, spec, io)
        finally:
            self.open_commands -= 1

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

    async def _helped(
        self,
        what: str,
        op: str,
        fields: dict[str, Any],
        command: list[str],
        stdin: bytes = b"",
        *,
        timeout: float | None = None,
    ) -> Any:
        """The helper's answer to one request or, where the connection has no helper, the JSON
        that jobctl prints for `command` run as a remote command (the same value either way)."""
        try:
            return await self.remote_helper.call(what, op, fields, timeout=timeout)
        except NoHelper:
            out = await self._jobctl(what, command, stdin, timeout=timeout)
        except HelperFailed as exc:
            raise ExecutorError(f"{what} on {self.address} failed: {exc.error}") from exc
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(f"{what} on {self.address} printed something that is not its JSON: {exc}") from exc

    async def spawn(self, job: JobSpec) -> JobHandle:
        """Write job.json, then start the job detached with its environment sent apart; return its handle."""
        session = await self.connection.ensure()
        run_dir = job.remote_dir.rstrip("/") or "/"
        paths = rundir.RunPaths(run_dir)
        # The environment's values go to the wrapper on its stdin with the secrets, never into job.json.
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [paths.plugin],
            "path_prepend": [],
            "umask": job.umask,
        }
        if self.target.venv:
            spec["path_prepend"] = [str(PurePosixPath(session.python).parent)]
        elif "python" in self.target.model_fields_set:  # the configured python is the job's too
            spec["path_prepend"] = [await self._python_shims(job, run_dir, session.python)]
        await self.put_file(paths.job_spec, json.dumps(spec).encode())
        values = {**job.env, **job.secrets}
        what = f"the start of run {job.run_id}"
        # Never retried: had the job started before the connection broke, a retry would start it twice.
        try:
            try:
                fields = {"dir": run_dir, "values": values, "python": session.python}
                started = await self.remote_helper.call(what, "start", fields, retry=False)
            except NoHelper:
                out = await self._start_by_command(job, run_dir, json.dumps(values).encode())
            except HelperFailed as exc:
                raise ExecutorError(
                    f"starting run {job.run_id} on {self.address} failed: {exc.error}; "
                    f"see {paths.job_log} there (`obd train logs {job.run_id}`)"
                ) from exc
            else:
                out = self._started(job, run_dir, started)
        except LaunchUncertain:
            raise
        except TargetUnreachable as exc:
            raise LaunchUncertain(f"{exc}; whether the job started is not known yet") from exc
        try:
            handle = JobHandle.model_validate_json(out.strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(
                f"the job wrapper on {self.address} printed no handle; see {paths.job_log} there"
            ) from exc
        handle.host = self.address
        log.info("ssh.spawned", target=self.name, run_id=job.run_id, pid=handle.pid, remote_dir=run_dir)
        return handle

    async def _python_shims(self, job: JobSpec, run_dir: str, python: str) -> str:
        """Write the run's `plugin/bin/python` and `python3` for the target's `python` (the path the
        connection's setup resolved it to, or a name the scripts look up), executable; their
        directory. Over SFTP, each made executable before it is renamed into place: no shell."""
        bin_dir = python_shim.bin_dir(run_dir)
        script = python_shim.shim(python) if python.startswith("/") else python_shim.looking_up(python, bin_dir)

        async def write(s: Session) -> None:
            sftp = await self.connection.sftp(s)
            self.connection.round_trips += 1
            await sftp.makedirs(bin_dir, exist_ok=True)
            for name in python_shim.NAMES:
                tmp = f"{bin_dir}/.{name}.tmp.{os.urandom(4).hex()}"
                self.connection.round_trips += 5  # open, write, close, chmod, rename
                async with sftp.open(tmp, "wb") as f:
                    await f.write(script)
                await sftp.chmod(tmp, python_shim.MODE)
                await sftp.posix_rename(tmp, f"{bin_dir}/{name}")

        try:
            await self.connection.remote(f"the python of run {job.run_id}", write, channel=False)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(
                f"could not write {bin_dir}/python on {self.address}: {exc.reason}; "
                f"`obd targets check {self.name}` checks the workdir"
            ) from exc
        return bin_dir

    def _started(self, job: JobSpec, run_dir: str, started: dict[str, Any]) -> bytes:
        """The wrapper's stdout from the helper's answer to a start, or why it failed."""
        code = int(started.get("returncode", 255))
        if code != 0:
            raise ExecutorError(
                f"starting run {job.run_id} on {self.address} failed (exit {code}): "
                f"{tail(started.get('stderr')) or 'no message'}; see {rundir.RunPaths(run_dir).job_log} there "
                f"(`obd train logs {job.run_id}`)"
            )
        return as_bytes(started.get("stdout"))

    async def _start_by_command(self, job: JobSpec, run_dir: str, values: bytes) -> bytes:
        """The start as one remote command under `setsid nohup` (no helper on this connection)."""

        async def op(s: Session) -> bytes:
            await self.connection.require_python(s)
            r = await self.connection.run(s, remote.start_command(s.python, s.jobctl, run_dir), values)
            if r.exit_status is None and r.exit_signal is None:
                # The channel closed with no exit status: the connection went mid-start.
                raise LaunchUncertain(
                    f"the connection to {self.address} closed before the start of run {job.run_id} answered; "
                    "whether the job started is not known yet"
                )
            if returncode(r) != 0:
                raise ExecutorError(
                    f"starting run {job.run_id} on {self.address} failed (exit {returncode(r)}): "
                    f"{tail(r.stderr) or 'no message'}; see {rundir.RunPaths(run_dir).job_log} there "
                    f"(`obd train logs {job.run_id}`)"
                )
            return as_bytes(r.stdout)

        return await self.connection.remote(f"the start of run {job.run_id}", op, retry=False)

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        """The job's state, from its directory and the host's process table."""
        item = {"dir": remote_dir, "handle": _handle_dict(handle)}
        raw = await self._helped(f"the status of {remote_dir}", "status", item, ["probe"], _items([item]))
        # Without a helper, it is the probe of that one run (jobctl's status command takes no handle).
        return JobStatus.model_validate(raw[0]["status"] if isinstance(raw, list) else raw)

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        """TERM the job's group, wait `grace`, KILL: done on the host, in one request or command."""
        fields = {"dir": remote_dir, "grace": float(grace), "handle": _handle_dict(handle)}
        command = ["cancel", remote_dir, "--grace", repr(float(grace)), "--handle", json.dumps(fields["handle"])]
        timeout = grace + self.connection.op_timeout
        raw = await self._helped(f"the cancel of {remote_dir}", "cancel", fields, command, timeout=timeout)
        return JobStatus.model_validate(raw)

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        """Everything the follow needs about all these runs, in one request (or one remote command)."""
        if not runs:
            return []
        items = [{"dir": d, "handle": _handle_dict(h) if h else None} for h, d in runs]
        raw = await self._helped("a probe", "probe", {"runs": items}, ["probe"], _items(items))
        try:
            return [RunProbe.model_validate(p) for p in raw]
        except (ValueError, TypeError) as exc:
            raise ExecutorError(f"the probe on {self.address} answered something that is not a probe: {exc}") from exc

    # --- files ------------------------------------------------------------------------------

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        """At most `limit` bytes of a regular file from `offset`; b"" if it is missing or not a file."""
        chunks: list[bytes] = []
        while limit > 0:
            part = min(limit, HELPER_READ_LIMIT)
            try:
                answer = await self.remote_helper.call(
                    f"a read of {path}", "read", {"path": path, "offset": offset, "limit": part}
                )
            except NoHelper:
                chunks.append(await self.files.read_from(path, offset, limit))
                break
            except HelperFailed as exc:
                raise ExecutorError(f"could not read {path} on {self.address}: {exc.error}") from exc
            data = base64.b64decode((answer or {}).get("data") or "")
            chunks.append(data)
            if len(data) < part:
                break
            offset, limit = offset + len(data), limit - len(data)
        return b"".join(chunks)

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        """jobctl's `checkpoints`, run on the host (every word quoted)."""
        out = await self._jobctl(f"the checkpoints of {remote_dir}", ["checkpoints", remote_dir])
        sizes = _json_answer(out, f"the checkpoints of {remote_dir} on {self.address}")
        return {str(k): int(v) for k, v in sizes.items()} if isinstance(sizes, dict) else {}

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        """jobctl's `remove-checkpoint`, run on the host as the login's user (who owns the run
        directory there), every word quoted; never retried (it is done at most once)."""
        what = f"the removal of {remote_dir}/{rundir.OUTPUT}/{name}"
        out = await self._jobctl(what, ["remove-checkpoint", remote_dir, name], retry=False)
        done = _json_answer(out, f"{what} on {self.address}")
        return int(done.get("freed", 0)) if isinstance(done, dict) else 0

    async def put_file(self, path: str, data: bytes) -> None:
        """Write a file atomically (a temporary file in the same directory, then a rename),
        creating its directories."""
        if len(data) > HELPER_WRITE_LIMIT:
            await self.files.put_file(path, data)
            return
        try:
            await self.remote_helper.call(
                f"a write of {path}", "write", {"path": path, "data": base64.b64encode(data).decode()}
            )
        except NoHelper:
            await self.files.put_file(path, data)
        except HelperFailed as exc:
            parent = str(PurePosixPath(path).parent)
            raise ExecutorError(
                f"could not write {path} on {self.address}: {exc.error}; the old file, if any, is intact "
                f"(a full disk? check `df -h {remote.q(parent)}` there)"
            ) from exc

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        """Nothing to do: the first upload makes it, as the login's user, who runs the job."""
        return None

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


def _json_answer(out: bytes, what: str) -> Any:
    """The JSON a jobctl command printed on its last line."""
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise ExecutorError(f"{what} printed something that is not its JSON: {exc}") from exc


def _items(items: list[dict[str, Any]]) -> bytes:
    """jobctl probe's stdin."""
    return json.dumps(items).encode()


def _handle_dict(handle: JobHandle) -> dict[str, Any]:
    """What jobctl needs of a handle to tell the job from a process that reused its pid."""
    return {"pid": handle.pid, "start_time": handle.start_time, "boot_id": handle.boot_id}
