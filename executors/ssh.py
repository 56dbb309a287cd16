"""The SSH executor: jobs on a host reached with asyncssh, one shared connection per target.

Jobs start under `setsid nohup` through `trainer_plugin/jobctl.py`, which the executor installs
once per connection at `<workdir>/.obd/jobctl-<sha256[:12]>.py`; status, cancel and the probe of
every run of the target run that same script on the host, so a poll of N runs is one remote
command. Files move over SFTP. Host keys are checked against known_hosts (or a pinned key).
A connection that drops is reopened on the next call, with capped exponential backoff between
failed attempts; callers that arrive together share one attempt.
"""

from __future__ import annotations

import json
import os
import secrets as _secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import anyio
import asyncssh
import structlog

from daemon.config import SshTarget
from executors import remote
from executors.base import ExecutorError, JobHandle, JobSpec, JobStatus, LaunchUncertain, RunProbe, TargetUnreachable

log = structlog.get_logger()
T = TypeVar("T")

# Errors that mean the connection itself is gone (the host, the network or sshd went away).
_LOST = (
    asyncssh.DisconnectError,
    asyncssh.sftp.SFTPConnectionLost,
    asyncssh.sftp.SFTPNoConnection,
    ConnectionError,
    EOFError,
)


class HostKeyError(ExecutorError):
    """The host's key is unknown, changed, or not the pinned one: the connection was refused."""


class AuthError(ExecutorError):
    """The host answered but refused the login (wrong key or user)."""


class WorkdirError(ExecutorError):
    """The workdir (or obd's files in it) cannot be created on the host."""


@dataclass
class _HostKeyCheck:
    """Decides on a host key asyncssh did not find trusted, and remembers why."""

    recorded: list[asyncssh.SSHKey]
    accept_unknown: bool
    outcome: str = "known"  # known | pinned | accepted | unknown | changed
    seen: asyncssh.SSHKey | None = None

    def decide(self, key: asyncssh.SSHKey) -> bool:
        self.seen = key
        if self.recorded:
            self.outcome = "changed"
            return False
        if self.accept_unknown:
            self.outcome = "accepted"
            return True
        self.outcome = "unknown"
        return False


class _Client(asyncssh.SSHClient):
    """asyncssh callbacks: the host key decision and noticing that the connection died."""

    def __init__(self, check: _HostKeyCheck) -> None:
        self.check = check
        self.lost = False

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        return self.check.decide(key)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


@dataclass
class _Session:
    """One live connection and what was learnt when it opened."""

    conn: asyncssh.SSHClientConnection
    client: _Client
    workdir: str
    python: str
    python_version: str | None
    jobctl: str
    opened: float = field(default_factory=time.monotonic)
    sftp: asyncssh.SFTPClient | None = None
    sftp_lock: anyio.Lock = field(default_factory=anyio.Lock)

    @property
    def alive(self) -> bool:
        return not self.client.lost and not self.conn.is_closed()


class SshExecutor:
    """Runs jobs on one SSH host; see the module docstring for how."""

    shares_filesystem = False
    events = None

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
        self.workdir: str = target.workdir  # the absolute path once connected
        self.python_version: str | None = None
        self.host_key_status: str | None = None
        self.round_trips = 0  # remote commands + SFTP requests awaited, for tests and benchmarks
        self.connects = 0
        self.unreachable_since: float | None = None  # wall-clock time of the first failure
        self.op_timeout = op_timeout
        self._pinned = asyncssh.import_public_key(host_key) if host_key else None
        self._host_key_line = host_key
        # OpenSSH allows 10 sessions per connection by default (MaxSessions): stay under it.
        self._channels = anyio.Semaphore(max_channels)
        self._files = anyio.CapacityLimiter(8)
        self._lock = anyio.Lock()
        self._session: _Session | None = None
        self._failures = 0
        self._next_attempt = 0.0
        self._last_error: tuple[type[ExecutorError], str] | None = None
        self._backoff = (backoff_base, backoff_cap)

    # --- identity -----------------------------------------------------------------------

    @property
    def address(self) -> str:
        """`host:port`, as error messages and logs name the target."""
        return f"{self.target.host}:{self.target.port}"

    @property
    def known_hosts_path(self) -> Path:
        return Path(self.target.known_hosts or "~/.ssh/known_hosts").expanduser()

    @property
    def _known_hosts_name(self) -> str:
        host, port = self.target.host, self.target.port
        return host if port == 22 else f"[{host}]:{port}"

    def _ssh_hint(self) -> str:
        t = self.target
        user = f"{t.user}@" if t.user else ""
        key = f" -i {remote.q(str(t.identity_file))}" if t.identity_file else ""
        return f"ssh -p {t.port}{key} {user}{t.host} true"

    # --- connection ---------------------------------------------------------------------

    async def connect(self) -> None:
        """Open the connection now (else the first operation does), resolving the workdir."""
        await self._ensure()

    async def resolve_workdir(self) -> str:
        """The absolute workdir on the host (`~` expanded there)."""
        return (await self._ensure()).workdir

    async def _ensure(self) -> _Session:
        session = self._session
        if session is not None and session.alive:
            return session
        async with self._lock:
            session = self._session
            if session is not None and session.alive:
                return session
            if session is not None:
                self._drop(session, "connection lost")
            now = time.monotonic()
            if self._last_error is not None and now < self._next_attempt:
                kind, message = self._last_error
                raise self._stamp(kind(f"{message} (next attempt in {self._next_attempt - now:.1f}s)"))
            try:
                session = await self._open()
            except ExecutorError as exc:
                self._failures += 1
                base, cap = self._backoff
                delay = min(cap, base * 2 ** (self._failures - 1))
                self._next_attempt = time.monotonic() + delay
                self._last_error = (type(exc), str(exc))
                if self.unreachable_since is None:
                    self.unreachable_since = time.time()
                log.warning(
                    "ssh.connect_failed", target=self.name, address=self.address, error=str(exc), retry_in=delay
                )
                raise self._stamp(exc)
            was_down = self.unreachable_since
            self._failures, self._last_error, self.unreachable_since = 0, None, None
            self._session = session
            self.workdir, self.python_version = session.workdir, session.python_version
            log.info(
                "ssh.connected",
                target=self.name,
                address=self.address,
                workdir=session.workdir,
                python=session.python_version,
                host_key=self.host_key_status,
                reconnect=self.connects > 1,
                down_seconds=round(time.time() - was_down, 1) if was_down else None,
            )
            return session

    def _stamp(self, exc: ExecutorError) -> ExecutorError:
        """Attach `since` (when the target became unreachable) to an error, for the daemon."""
        exc.since = self.unreachable_since  # type: ignore[attr-defined]
        if self.unreachable_since and isinstance(exc, TargetUnreachable) and self._failures > 1:
            since = datetime.fromtimestamp(self.unreachable_since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            exc.args = (f"{exc.args[0]}; unreachable since {since}",)
        return exc

    def _known_hosts_arg(self) -> tuple[Any, list[asyncssh.SSHKey]]:
        """(known_hosts for asyncssh, keys recorded for this host) from the pin or the file."""
        if self._pinned is not None:
            return ([self._pinned], [], []), [self._pinned]
        path = self.known_hosts_path
        if not path.is_file():
            return ([], [], []), []
        try:
            known = asyncssh.read_known_hosts(str(path))
        except (OSError, ValueError) as exc:
            raise ExecutorError(f"cannot read known_hosts {path}: {exc}; fix or remove the bad line") from exc
        port = self.target.port if self.target.port != 22 else None
        recorded = list(asyncssh.match_known_hosts(known, self.target.host, "", port)[0])
        return str(path), recorded

    def _client_keys(self) -> list[str] | tuple[()]:
        key = self.target.identity_file
        if key is None:
            return ()  # asyncssh's defaults: ~/.ssh/id_* and the agent
        path = Path(key).expanduser()
        if not os.access(path, os.R_OK):
            raise ExecutorError(
                f"identity_file {path} of target {self.name!r} cannot be read; "
                f"fix the path in [targets.{self.name}] or create a key with `ssh-keygen -t ed25519 -f {path}`"
            )
        return [str(path)]

    async def _open(self) -> _Session:
        """Connect, verify the host key, then run the per-connection setup script."""
        t = self.target
        known_hosts, recorded = self._known_hosts_arg()
        check = _HostKeyCheck(recorded=recorded, accept_unknown=t.accept_unknown_host and self._pinned is None)
        client = _Client(check)
        options: dict[str, Any] = {}
        if recorded:  # prefer the algorithms of the recorded keys, as OpenSSH does
            algs = [a.decode() for k in recorded for a in k.sig_algorithms]
            options["server_host_key_algs"] = algs
        self.connects += 1
        try:
            with anyio.fail_after(t.connect_timeout + 1):
                conn = await asyncssh.connect(
                    t.host,
                    t.port,
                    username=t.user or (),
                    client_factory=lambda: client,
                    known_hosts=known_hosts,
                    client_keys=self._client_keys(),
                    connect_timeout=t.connect_timeout,
                    keepalive_interval=t.keepalive,
                    keepalive_count_max=3,
                    **options,
                )
        except asyncssh.HostKeyNotVerifiable as exc:
            raise self._host_key_error(check) from exc
        except asyncssh.PermissionDenied as exc:
            raise AuthError(
                f"{self.address} refused the login of user {t.user or '(default)'} with key "
                f"{t.identity_file or '(default keys)'}: permission denied. Check that the public key is in "
                f"that user's ~/.ssh/authorized_keys there (`ssh-copy-id -i {t.identity_file or '~/.ssh/id_ed25519'}"
                f" -p {t.port} {t.user + '@' if t.user else ''}{t.host}`), then `obd targets check {self.name}`"
            ) from exc
        except asyncssh.KeyImportError as exc:
            raise ExecutorError(
                f"identity_file {t.identity_file} of target {self.name!r} cannot be used: {exc} "
                "(an encrypted key must be loaded into ssh-agent and identity_file left unset)"
            ) from exc
        except (OSError, TimeoutError, asyncssh.DisconnectError) as exc:
            raise TargetUnreachable(f"cannot reach {self.address}: {_why(exc)}; try `{self._ssh_hint()}`") from exc
        self.host_key_status = "pinned" if self._pinned is not None else check.outcome
        if check.outcome == "accepted" and check.seen is not None:
            self._record_host_key(check.seen)
        try:
            return await self._setup(conn, client)
        except BaseException:
            conn.abort()
            raise

    def _host_key_error(self, check: _HostKeyCheck) -> HostKeyError:
        seen = check.seen.get_fingerprint() if check.seen is not None else "unknown"
        kh = self.known_hosts_path
        if self._pinned is not None:
            return HostKeyError(
                f"the host key of {self.address} ({seen}) is not the key pinned for target {self.name!r} "
                f"({self._pinned.get_fingerprint()}); the connection was refused"
            )
        if check.outcome == "changed":
            return HostKeyError(
                f"the host key of {self.address} has CHANGED since it was recorded in {kh} (now {seen}); "
                "the connection was refused, as someone may be intercepting it. If the host was reinstalled, "
                f"remove the old key with `ssh-keygen -R {remote.q(self._known_hosts_name)} -f {remote.q(str(kh))}` "
                f"and record the new one with `{self._ssh_hint()}`"
            )
        return HostKeyError(
            f"the host key of {self.address} ({seen}) is not in {kh}, so the connection was refused. "
            f"Check the fingerprint, then record it with `{self._ssh_hint()}` (or `ssh-keyscan -p {self.target.port} "
            f"{self.target.host} >> {remote.q(str(kh))}`), or set accept_unknown_host = true in [targets.{self.name}]"
        )

    def _record_host_key(self, key: asyncssh.SSHKey) -> None:
        """Trust on first use: append an accepted unknown key to known_hosts, so a later change is caught."""
        path = self.known_hosts_path
        line = f"{self._known_hosts_name} {key.export_public_key().decode().strip()}\n"
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)
            self.host_key_status = "accepted"
            log.warning(
                "ssh.host_key_recorded",
                target=self.name,
                address=self.address,
                known_hosts=str(path),
                fingerprint=key.get_fingerprint(),
            )
        except OSError as exc:
            log.warning("ssh.host_key_not_recorded", target=self.name, known_hosts=str(path), error=str(exc))

    async def _setup(self, conn: asyncssh.SSHClientConnection, client: _Client) -> _Session:
        t = self.target
        script = remote.setup_script(t.workdir, t.python, t.venv)
        try:
            with anyio.fail_after(self.op_timeout):
                self.round_trips += 1
                result = await conn.run(script, input=remote.JOBCTL_SOURCE, encoding=None, check=False)
        except (TimeoutError, *_LOST) as exc:
            raise TargetUnreachable(
                f"{self.address} stopped answering while obd set up its workdir: {_why(exc)}"
            ) from exc
        err = _tail(result.stderr)
        if result.returncode == 3:
            raise WorkdirError(
                f"the workdir {t.workdir!r} of target {self.name!r} cannot be created on {self.address}: {err}. "
                f"Set workdir in [targets.{self.name}] to a directory the user can write"
            )
        if result.returncode == 4:
            raise WorkdirError(
                f"obd could not write its job-control script under {t.workdir!r} on {self.address}: "
                f"{err or 'write failed'} (is the disk full? check `df -h` there)"
            )
        info = remote.parse_setup(_text(result.stdout))
        if result.returncode != 0 or "workdir" not in info:
            raise ExecutorError(f"setting up {self.address} failed (exit {result.returncode}): {err or 'no output'}")
        workdir = info["workdir"]
        return _Session(
            conn=conn,
            client=client,
            workdir=workdir,
            python=info.get("python", t.python),
            python_version=info.get("python-version"),
            jobctl=remote.jobctl_remote_path(workdir),
        )

    def _drop(self, session: _Session, why: object) -> None:
        """Forget a connection that failed; the next call reconnects."""
        if self._session is session:
            self._session = None
            log.warning("ssh.connection_lost", target=self.name, address=self.address, reason=str(why))
        session.conn.abort()

    async def aclose(self) -> None:
        """Close the connection; a later call would open a new one."""
        session, self._session = self._session, None
        if session is not None:
            session.conn.close()
            try:
                with anyio.move_on_after(5):
                    await session.conn.wait_closed()
            except Exception:  # closing a broken connection may raise; it is closed either way
                pass

    # --- running things -----------------------------------------------------------------

    async def _remote(
        self,
        what: str,
        op: Callable[[_Session], Awaitable[T]],
        *,
        timeout: float | None = None,
        retry: bool = True,
        channel: bool = True,
    ) -> T:
        """Run `op` on a live session; a lost connection is reopened once if `retry` (the op is
        idempotent), else reported as TargetUnreachable."""
        for attempt in (0, 1):
            session = await self._ensure()
            try:
                if channel:
                    async with self._channels:
                        with anyio.fail_after(timeout or self.op_timeout):
                            return await op(session)
                with anyio.fail_after(timeout or self.op_timeout):
                    return await op(session)
            except TimeoutError as exc:
                self._drop(session, f"no answer to {what} in {timeout or self.op_timeout:.0f}s")
                raise self._stamp(
                    TargetUnreachable(f"{self.address} did not answer {what} within {timeout or self.op_timeout:.0f}s")
                ) from exc
            except asyncssh.ChannelOpenError as exc:
                if session.alive:
                    raise ExecutorError(f"{self.address} refused a new SSH channel for {what}: {exc.reason}") from exc
                self._drop(session, exc)
                if not (retry and attempt == 0):
                    raise self._stamp(
                        TargetUnreachable(f"lost the connection to {self.address} during {what}")
                    ) from exc
            except _LOST as exc:
                self._drop(session, exc)
                if not (retry and attempt == 0):
                    raise self._stamp(
                        TargetUnreachable(f"lost the connection to {self.address} during {what}: {_why(exc)}")
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _run(self, session: _Session, command: str, stdin: bytes = b"") -> asyncssh.SSHCompletedProcess:
        """One remote command. A channel the server refuses (it may free a finished session's slot
        a moment after closing it, and MaxSessions counts slots) is asked for again, briefly;
        nothing has run when a channel open fails, so this never runs a command twice."""
        for delay in (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, None):
            try:
                self.round_trips += 1
                return await session.conn.run(command, input=stdin, encoding=None, check=False)
            except asyncssh.ChannelOpenError:
                if delay is None or not session.alive:
                    raise
                log.debug("ssh.channel_refused", target=self.name, retry_in=delay)
                await anyio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def run_command(
        self, argv: list[str], stdin: bytes = b"", timeout: float | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run `argv` on the host (every word quoted): (exit status, stdout, stderr)."""

        async def op(s: _Session) -> tuple[int, bytes, bytes]:
            r = await self._run(s, remote.join(argv), stdin)
            return _returncode(r), _bytes(r.stdout), _bytes(r.stderr)

        return await self._remote(f"`{argv[0]}`", op, timeout=timeout)

    async def run_shell(
        self, script: str, stdin: bytes = b"", timeout: float | None = None
    ) -> tuple[int, bytes, bytes]:
        """Run a shell script built by the caller with `remote.q` (for checks): (exit, stdout, stderr)."""

        async def op(s: _Session) -> tuple[int, bytes, bytes]:
            r = await self._run(s, script, stdin)
            return _returncode(r), _bytes(r.stdout), _bytes(r.stderr)

        return await self._remote("a check", op, timeout=timeout)

    async def python_command(self) -> str:
        """The interpreter the target's jobs and jobctl run with (a name or a path there)."""
        return (await self._ensure()).python

    async def python(self) -> str:
        return await self.python_command()

    async def _jobctl(
        self, what: str, args: list[str], stdin: bytes = b"", *, timeout: float | None = None, retry: bool = True
    ) -> bytes:
        async def op(s: _Session) -> bytes:
            await self._require_python(s)
            r = await self._run(s, remote.jobctl_command(s.python, s.jobctl, *args), stdin)
            if r.exit_status is None and r.exit_signal is None:  # the connection went mid-command
                raise asyncssh.ConnectionLost(f"no exit status for {what}")
            if _returncode(r) != 0:
                raise ExecutorError(f"{what} on {self.address} failed (exit {_returncode(r)}): {_tail(r.stderr)}")
            return _bytes(r.stdout)

        return await self._remote(what, op, timeout=timeout, retry=retry)

    async def _require_python(self, s: _Session) -> None:
        if s.python_version is not None:
            return
        # Look again (one round trip): it may have been installed since the connection opened.
        self.round_trips += 1
        r = await s.conn.run(
            remote.setup_script(self.target.workdir, self.target.python, self.target.venv),
            input=remote.JOBCTL_SOURCE,
            encoding=None,
            check=False,
        )
        s.python_version = remote.parse_setup(_text(r.stdout)).get("python-version")
        self.python_version = s.python_version
        if s.python_version is None:
            raise ExecutorError(
                f"the target's Python ({s.python!r}) was not found or does not run on {self.address}; "
                f"set `python` or `venv` in [targets.{self.name}], then `obd targets check {self.name}`"
            )

    # --- the Executor protocol ----------------------------------------------------------

    async def spawn(self, job: JobSpec) -> JobHandle:
        """Write job.json, then start the job detached with its secrets on stdin; return its handle."""
        session = await self._ensure()
        run_dir = job.remote_dir.rstrip("/") or "/"
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "env": job.env,
            "pythonpath": [f"{run_dir}/plugin"],
            "path_prepend": [],
        }
        if self.target.venv:
            spec["path_prepend"] = [str(PurePosixPath(session.python).parent)]
        await self.put_file(f"{run_dir}/job.json", json.dumps(spec).encode())
        secrets_json = json.dumps(job.secrets).encode()

        async def op(s: _Session) -> bytes:
            await self._require_python(s)
            r = await self._run(s, remote.start_command(s.python, s.jobctl, run_dir), secrets_json)
            if r.exit_status is None and r.exit_signal is None:
                # The channel closed with no exit status: the connection went mid-start.
                raise LaunchUncertain(
                    f"the connection to {self.address} closed before the start of run {job.run_id} answered; "
                    "whether the job started is not known yet"
                )
            if _returncode(r) != 0:
                raise ExecutorError(
                    f"starting run {job.run_id} on {self.address} failed (exit {_returncode(r)}): "
                    f"{_tail(r.stderr) or 'no message'}; see {run_dir}/job.log there (`obd train logs {job.run_id}`)"
                )
            return _bytes(r.stdout)

        # Never retried: had the job started before the connection broke, a retry would start it twice.
        try:
            out = await self._remote(f"the start of run {job.run_id}", op, retry=False)
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
        out = await self._jobctl(f"the cancel of {remote_dir}", args, timeout=grace + self.op_timeout)
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

    # --- files over SFTP ----------------------------------------------------------------

    async def _sftp(self, s: _Session) -> asyncssh.SFTPClient:
        if s.sftp is None:
            async with s.sftp_lock:
                if s.sftp is None:
                    async with self._channels:
                        self.round_trips += 1
                        s.sftp = await s.conn.start_sftp_client()
        return s.sftp

    async def _sftp_op(
        self,
        what: str,
        op: Callable[[asyncssh.SFTPClient, _Session], Awaitable[T]],
        *,
        retry: bool = True,
        timeout: float | None = None,
    ) -> T:
        async def run(s: _Session) -> T:
            return await op(await self._sftp(s), s)

        return await self._remote(what, run, channel=False, retry=retry, timeout=timeout)

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        """At most `limit` bytes of a regular file from `offset`; b"" if it is missing or not a file."""

        async def op(sftp: asyncssh.SFTPClient, s: _Session) -> bytes:
            try:
                self.round_trips += 1
                attrs = await sftp.lstat(path)
            except asyncssh.SFTPNoSuchFile:
                return b""
            # Never open a FIFO or device: the server's SFTP process would block on it.
            if attrs.type != asyncssh.FILEXFER_TYPE_REGULAR or (attrs.size is not None and offset >= attrs.size):
                return b""
            try:
                self.round_trips += 3  # open, read, close
                async with sftp.open(path, "rb") as f:
                    return await f.read(limit, offset)
            except asyncssh.SFTPNoSuchFile:
                return b""

        if limit <= 0:
            return b""
        try:
            return await self._sftp_op(f"a read of {path}", op)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(f"could not read {path} on {self.address}: {exc.reason}") from exc

    async def put_file(self, path: str, data: bytes) -> None:
        """Write a file atomically: a temporary file in the same directory, fsync, then rename."""
        parent = str(PurePosixPath(path).parent)

        async def op(sftp: asyncssh.SFTPClient, s: _Session) -> None:
            tmp = f"{parent}/.{PurePosixPath(path).name}.tmp.{_secrets.token_hex(4)}"
            try:
                await self._write_new(sftp, tmp, data)
            except asyncssh.SFTPNoSuchFile:
                await self._mkdir(sftp, s, parent)
                await self._write_new(sftp, tmp, data)
            try:
                self.round_trips += 1
                await sftp.posix_rename(tmp, path)
            except BaseException:
                await _quietly(sftp.remove(tmp))
                raise

        try:
            await self._sftp_op(f"a write of {path}", op)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(
                f"could not write {path} on {self.address}: {exc.reason or type(exc).__name__}; the old file, if any, "
                f"is intact (a full disk? check `df -h {remote.q(parent)}` there)"
            ) from exc

    async def _write_new(self, sftp: asyncssh.SFTPClient, tmp: str, data: bytes) -> None:
        """Create `tmp` with `data` and flush it to disk; remove it again if any step fails."""
        self.round_trips += 1
        f = await sftp.open(tmp, "wb")
        try:
            self.round_trips += 2  # write, fsync
            await f.write(data)
            try:
                await f.fsync()
            except asyncssh.SFTPOpUnsupported:
                pass
        except BaseException:
            await _quietly(f.close())
            await _quietly(sftp.remove(tmp))
            raise
        self.round_trips += 1
        await f.close()

    async def _mkdir(self, sftp: asyncssh.SFTPClient, s: _Session, path: str) -> None:
        """Create a directory whose parent exists with one SFTP request; else `mkdir -p`."""
        try:
            self.round_trips += 1
            await sftp.mkdir(path)
            return
        except asyncssh.SFTPError:
            pass  # missing parent, exists already, or refused: `mkdir -p` sorts it out and says why
        await self._mkdirs(s, [path])

    async def _mkdirs(self, s: _Session, dirs: list[str]) -> None:
        """`mkdir -p` on the host, in as few commands as the line length allows."""
        chunk: list[str] = []
        size = 0
        for d in [*dirs, None]:
            if d is not None and size + len(d) < 60_000:
                chunk.append(d)
                size += len(d) + 3
                continue
            if chunk:
                async with self._channels:
                    r = await self._run(s, remote.mkdirs_command(chunk))
                if _returncode(r) != 0:
                    raise ExecutorError(f"could not create {chunk[0]!r} on {self.address}: {_tail(r.stderr)}")
            chunk, size = ([d], len(d)) if d is not None else ([], 0)

    async def upload(self, local: Path, remote_path: str) -> None:
        """Copy a local file or tree to the host, leaving out VCS, caches and virtual environments."""
        local = Path(local)
        if not local.exists() and not local.is_symlink():
            return
        if local.is_file():
            await self._upload_file(local, remote_path)
            return
        dirs, files, links = await anyio.to_thread.run_sync(remote.walk_upload, local)
        base = remote_path.rstrip("/") or "/"

        def dest(rel: Path) -> str:
            return f"{base}/{rel.as_posix()}"

        async def make_dirs(sftp: asyncssh.SFTPClient, s: _Session) -> None:
            await self._mkdirs(s, [base, *(dest(d) for d in dirs)])

        await self._sftp_op(f"an upload to {base}", make_dirs)

        async def put(rel: Path) -> None:
            async with self._files:

                async def op(sftp: asyncssh.SFTPClient, s: _Session) -> None:
                    self.round_trips += 1
                    await sftp.put(str(local / rel), dest(rel), preserve=True)

                await self._sftp_op(f"an upload of {rel}", op, timeout=max(self.op_timeout, 600))

        async def link(rel: Path) -> None:
            target = os.readlink(local / rel)

            async def op(sftp: asyncssh.SFTPClient, s: _Session) -> None:
                await _quietly(sftp.remove(dest(rel)))
                self.round_trips += 2
                await sftp.symlink(target, dest(rel))

            await self._sftp_op(f"an upload of {rel}", op)

        try:
            async with anyio.create_task_group() as tg:
                for rel in files:
                    tg.start_soon(put, rel)
                for rel in links:
                    tg.start_soon(link, rel)
        except BaseExceptionGroup as group:
            raise self._transfer_error(
                f"upload of {local} to {base} on {self.address}", _leaf(group), _disk_hint(base)
            ) from None

    async def _upload_file(self, local: Path, remote_path: str) -> None:
        parent = str(PurePosixPath(remote_path).parent)

        async def op(sftp: asyncssh.SFTPClient, s: _Session) -> None:
            tmp = f"{parent}/.{PurePosixPath(remote_path).name}.tmp.{_secrets.token_hex(4)}"
            await self._mkdirs(s, [parent])
            try:
                self.round_trips += 2
                await sftp.put(str(local), tmp, preserve=True)
                await sftp.posix_rename(tmp, remote_path)
            except BaseException:
                await _quietly(sftp.remove(tmp))
                raise

        try:
            await self._sftp_op(f"an upload to {remote_path}", op, timeout=max(self.op_timeout, 600))
        except asyncssh.SFTPError as exc:
            hint = _disk_hint(parent) if isinstance(exc, asyncssh.SFTPFailure) else ""
            raise ExecutorError(
                f"upload of {local} to {remote_path} on {self.address} failed: {exc.reason}{hint}"
            ) from exc

    async def download(self, remote_path: str, local: Path) -> None:
        """Copy a file or tree from the host (links stay links); a missing path copies nothing."""
        local = Path(local)

        async def stat(sftp: asyncssh.SFTPClient, s: _Session) -> asyncssh.SFTPAttrs | None:
            try:
                self.round_trips += 1
                return await sftp.lstat(remote_path)
            except asyncssh.SFTPNoSuchFile:
                return None

        try:
            attrs = await self._sftp_op(f"a download of {remote_path}", stat)
            if attrs is None:
                return
            if attrs.type == asyncssh.FILEXFER_TYPE_DIRECTORY:
                await self._download_tree(remote_path.rstrip("/") or "/", local)
            elif attrs.type == asyncssh.FILEXFER_TYPE_SYMLINK:
                await self._download_link(remote_path, local)
            else:
                await self._download_file(remote_path, local)
        except BaseExceptionGroup as group:
            raise self._transfer_error(f"download of {remote_path} from {self.address}", _leaf(group)) from None
        except (asyncssh.SFTPError, OSError) as exc:
            raise self._transfer_error(f"download of {remote_path} from {self.address}", exc) from exc

    @staticmethod
    def _transfer_error(what: str, exc: BaseException, hint: str = "") -> BaseException:
        """The one error to report for a failed transfer of many files; `hint` follows a generic
        SFTP failure (OpenSSH's sftp-server reports a full disk as just "Failure")."""
        if isinstance(exc, ExecutorError):
            return exc
        if isinstance(exc, asyncssh.SFTPError):
            extra = hint if isinstance(exc, asyncssh.SFTPFailure) else ""
            return ExecutorError(f"{what} failed: {exc.reason or type(exc).__name__}{extra}")
        if isinstance(exc, OSError):
            return ExecutorError(f"{what} failed on this machine: {exc}")
        return exc

    async def _download_file(self, remote_path: str, local: Path) -> None:
        """Fetch one file into a temporary name beside `local`, then rename it into place."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp.{_secrets.token_hex(4)}")

        async def op(sftp: asyncssh.SFTPClient, s: _Session) -> None:
            self.round_trips += 1
            await sftp.get(remote_path, str(tmp), preserve=True)

        async with self._files:
            try:
                await self._sftp_op(f"a download of {remote_path}", op, timeout=max(self.op_timeout, 600))
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)

    async def _download_link(self, remote_path: str, local: Path) -> None:
        async def op(sftp: asyncssh.SFTPClient, s: _Session) -> str:
            self.round_trips += 1
            return await sftp.readlink(remote_path)

        target = await self._sftp_op(f"a download of {remote_path}", op)
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.is_symlink() or local.is_file():
            local.unlink()
        os.symlink(target, local)

    async def _download_tree(self, remote_dir: str, local: Path) -> None:
        async def listing(sftp: asyncssh.SFTPClient, s: _Session) -> list[asyncssh.SFTPName]:
            self.round_trips += 1
            return [n for n in await sftp.readdir(remote_dir) if n.filename not in (".", "..")]

        entries = await self._sftp_op(f"a listing of {remote_dir}", listing)
        local.mkdir(parents=True, exist_ok=True)
        async with anyio.create_task_group() as tg:
            for entry in entries:
                name = entry.filename if isinstance(entry.filename, str) else entry.filename.decode()
                src, dst = f"{remote_dir}/{name}", local / name
                kind = entry.attrs.type
                if kind == asyncssh.FILEXFER_TYPE_DIRECTORY:
                    tg.start_soon(self._download_tree, src, dst)
                elif kind == asyncssh.FILEXFER_TYPE_SYMLINK:
                    tg.start_soon(self._download_link, src, dst)
                elif kind == asyncssh.FILEXFER_TYPE_REGULAR:
                    tg.start_soon(self._download_file, src, dst)


# --- small helpers --------------------------------------------------------------------------


def _leaf(group: BaseExceptionGroup) -> BaseException:  # type: ignore[type-arg]
    """The first real exception inside (nested) exception groups."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _disk_hint(path: str) -> str:
    return f" (a full disk? check `df -h {remote.q(path)}` there)"


def _handle_json(handle: JobHandle) -> str:
    return json.dumps({"pid": handle.pid, "start_time": handle.start_time, "boot_id": handle.boot_id})


def _returncode(r: asyncssh.SSHCompletedProcess) -> int:
    code = r.returncode
    return 255 if code is None else code


def _bytes(value: object) -> bytes:
    if value is None:
        return b""
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: object) -> str:
    return _bytes(value).decode("utf-8", "replace")


def _tail(value: object, lines: int = 5) -> str:
    return " | ".join(_text(value).strip().splitlines()[-lines:])


def _why(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is sshd running there, on that port?)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (host down, or a firewall dropping packets?)"
    if isinstance(exc, asyncssh.DisconnectError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


async def _quietly(aw: Awaitable[object]) -> None:
    """Await a best-effort clean-up step, ignoring its failure."""
    try:
        await aw
    except Exception:
        pass
