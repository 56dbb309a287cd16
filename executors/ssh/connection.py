"""One SSH connection per target: opened on demand, host key checked, reopened with backoff.

The connection is opened by the first operation that needs it. Host keys are checked against
known_hosts (or a key pinned by the caller, as for a pod); an unknown key is refused unless the
target accepts unknown hosts, in which case it is recorded (trust on first use), so a later
change is caught. Once open, a setup script resolves the workdir, installs obd's job-control
tools and finds the target's Python, in one round trip. A connection that drops is reopened on
the next call, with capped exponential backoff between failed attempts (executors/retry.py);
callers that arrive together share one attempt.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
import asyncssh
import structlog

from executors import remote
from executors.base import AuthError, ExecutorError, HostKeyError, TargetUnreachable, WorkdirError
from executors.retry import Backoff, FailureGate
from executors.ssh.config import SshTarget

# The ciphers asked for, AES-GCM first: asyncssh's ChaCha20-Poly1305 (its default first choice,
# as OpenSSH's is) moved half the bytes a second that its AES-GCM did on this project's machine
# (128 MB of SFTP over loopback: 3.1 s vs 1.5 s; tests/bench/bench_carry.py measures a carry),
# which a checkpoint's carry and every upload feel. Both are AEAD ciphers OpenSSH offers by
# default; the others stay as fallbacks for a server that offers neither.
CIPHERS = [
    "aes128-gcm@openssh.com",
    "aes256-gcm@openssh.com",
    "chacha20-poly1305@openssh.com",
    "aes256-ctr",
    "aes192-ctr",
    "aes128-ctr",
]

log = structlog.get_logger()
T = TypeVar("T")

# Errors that mean the connection itself is gone (the host, the network or sshd went away).
LOST = (
    asyncssh.DisconnectError,
    asyncssh.sftp.SFTPConnectionLost,
    asyncssh.sftp.SFTPNoConnection,
    ConnectionError,
    EOFError,
)
# Waits between asking again for a channel the server refused (MaxSessions): about 3 s in all.
_CHANNEL_RETRY = Backoff(base=0.05, cap=1.6)
_CHANNEL_RETRIES = 6


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


class HelperMark(Protocol):
    """The connection's helper as the connection sees it: marked closing with its session, so
    its end is not taken for a failure (executors/ssh/helper.py's HelperProcess)."""

    closing: bool


@dataclass
class Session:
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
    real_workdir: str | None = None  # the workdir with every link resolved, once asked for
    helper: HelperMark | None = None  # the connection's `jobctl serve` (executors/ssh/helper.py)
    helper_lock: anyio.Lock = field(default_factory=anyio.Lock)
    no_helper: str | None = None  # why this connection has none (it could not start)

    @property
    def alive(self) -> bool:
        return not self.client.lost and not self.conn.is_closed()


class SshConnection:
    """The connection to one SSH host, and running things on it with the right error for each failure."""

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
        # OpenSSH allows 10 sessions per connection by default (MaxSessions): stay under it.
        self.channels = anyio.Semaphore(max_channels)
        self._lock = anyio.Lock()
        self.session: Session | None = None
        self._gate = FailureGate(Backoff(backoff_base, backoff_cap))
        self._last_error: tuple[type[ExecutorError], str] | None = None

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

    def ssh_hint(self) -> str:
        """The ssh command that tries the same login by hand."""
        t = self.target
        user = f"{t.user}@" if t.user else ""
        key = f" -i {remote.q(str(t.identity_file))}" if t.identity_file else ""
        return f"ssh -p {t.port}{key} {user}{t.host} true"

    # --- opening ------------------------------------------------------------------------

    async def ensure(self) -> Session:
        """A live session: the current one, or a new one unless the backoff says not yet."""
        session = self.session
        if session is not None and session.alive:
            return session
        async with self._lock:
            session = self.session
            if session is not None and session.alive:
                return session
            if session is not None:
                self.drop(session, "connection lost")
            wait = self._gate.wait_left()
            if self._last_error is not None and wait > 0:
                kind, message = self._last_error
                raise self.stamp(kind(f"{message} (next attempt in {wait:.1f}s)"))
            try:
                session = await self._open()
            except ExecutorError as exc:
                delay = self._gate.failed()
                self._last_error = (type(exc), str(exc))
                if self.unreachable_since is None:
                    self.unreachable_since = time.time()
                log.warning(
                    "ssh.connect_failed", target=self.name, address=self.address, error=str(exc), retry_in=delay
                )
                self.stamp(exc)
                raise
            was_down = self.unreachable_since
            self._gate.succeeded()
            self._last_error, self.unreachable_since = None, None
            self.session = session
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

    def stamp(self, exc: ExecutorError) -> ExecutorError:
        """Say since when the target has been unreachable, once it failed more than once."""
        if self.unreachable_since and isinstance(exc, TargetUnreachable) and self._gate.failures > 1:
            since = datetime.fromtimestamp(self.unreachable_since, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
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

    async def _open(self) -> Session:
        """Connect, verify the host key, then run the per-connection setup script."""
        t = self.target
        known_hosts, recorded = self._known_hosts_arg()
        check = _HostKeyCheck(recorded=recorded, accept_unknown=t.accept_unknown_host and self._pinned is None)
        client = _Client(check)
        options: dict[str, Any] = {"encryption_algs": CIPHERS}
        if recorded:  # prefer the algorithms of the recorded keys, as OpenSSH does
            options["server_host_key_algs"] = [a.decode() for k in recorded for a in k.sig_algorithms]
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
            raise TargetUnreachable(f"cannot reach {self.address}: {why(exc)}; try `{self.ssh_hint()}`") from exc
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
                f"and record the new one with `{self.ssh_hint()}`"
            )
        return HostKeyError(
            f"the host key of {self.address} ({seen}) is not in {kh}, so the connection was refused. "
            f"Check the fingerprint, then record it with `{self.ssh_hint()}` (or `ssh-keyscan -p {self.target.port} "
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

    async def _setup(self, conn: asyncssh.SSHClientConnection, client: _Client) -> Session:
        t = self.target
        script = remote.setup_script(t.workdir, t.python, t.venv)
        try:
            with anyio.fail_after(self.op_timeout):
                self.round_trips += 1
                result = await conn.run(script, input=remote.JOBCTL_SOURCE, encoding=None, check=False)
        except TimeoutError as exc:
            # The host answered and took the login: the command itself did not finish.
            raise TargetUnreachable(
                f"{self.address} accepted the login, but obd's setup command there (its workdir and "
                f"job-control tools) did not finish within {self.op_timeout:g} s. The usual cause is a login "
                "script that waits (a ~/.bashrc, ~/.bash_profile or ~/.profile that sleeps, waits on a lock "
                f"or asks for input: bash reads ~/.bashrc for commands run over SSH too); check that "
                f"`{self.ssh_hint()}` returns at once, then `obd targets check {self.name}`"
            ) from exc
        except LOST as exc:
            raise TargetUnreachable(
                f"{self.address} stopped answering while obd set up its workdir: {why(exc)}"
            ) from exc
        err = tail(result.stderr)
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
        info = remote.parse_setup(text(result.stdout))
        if result.returncode != 0 or "workdir" not in info:
            raise ExecutorError(f"setting up {self.address} failed (exit {result.returncode}): {err or 'no output'}")
        workdir = info["workdir"]
        return Session(
            conn=conn,
            client=client,
            workdir=workdir,
            python=info.get("python", t.python),
            python_version=info.get("python-version"),
            jobctl=remote.jobctl_remote_path(workdir),
        )

    def drop(self, session: Session, reason: object) -> None:
        """Forget a connection that failed; the next call reconnects."""
        if self.session is session:
            self.session = None
            log.warning("ssh.connection_lost", target=self.name, address=self.address, reason=str(reason))
        if session.helper is not None:
            session.helper.closing = True
        session.conn.abort()

    async def aclose(self) -> None:
        """Close the connection; a later call would open a new one."""
        session, self.session = self.session, None
        if session is not None:
            if session.helper is not None:
                session.helper.closing = True
            session.conn.close()
            try:
                with anyio.move_on_after(5):
                    await session.conn.wait_closed()
            except Exception:  # closing a broken connection may raise; it is closed either way
                pass

    # --- running things -----------------------------------------------------------------

    async def remote(
        self,
        what: str,
        op: Callable[[Session], Awaitable[T]],
        *,
        timeout: float | None = None,
        retry: bool = True,
        channel: bool = True,
    ) -> T:
        """Run `op` on a live session; a lost connection is reopened once if `retry` (the op is
        idempotent), else reported as TargetUnreachable."""
        limit = timeout or self.op_timeout
        for attempt in (0, 1):
            session = await self.ensure()
            try:
                if channel:
                    async with self.channels:
                        with anyio.fail_after(limit):
                            return await op(session)
                with anyio.fail_after(limit):
                    return await op(session)
            except TimeoutError as exc:
                self.drop(session, f"no answer to {what} in {limit:.0f}s")
                raise self.stamp(
                    TargetUnreachable(f"{self.address} did not answer {what} within {limit:.0f}s")
                ) from exc
            except asyncssh.ChannelOpenError as exc:
                if session.alive:
                    raise ExecutorError(f"{self.address} refused a new SSH channel for {what}: {exc.reason}") from exc
                self.drop(session, exc)
                if not (retry and attempt == 0):
                    raise self.stamp(TargetUnreachable(f"lost the connection to {self.address} during {what}")) from exc
            except LOST as exc:
                self.drop(session, exc)
                if not (retry and attempt == 0):
                    raise self.stamp(
                        TargetUnreachable(f"lost the connection to {self.address} during {what}: {why(exc)}")
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def run(self, session: Session, command: str, stdin: bytes = b"") -> asyncssh.SSHCompletedProcess:
        """One remote command. A channel the server refuses (it may free a finished session's slot
        a moment after closing it, and MaxSessions counts slots) is asked for again, briefly;
        nothing has run when a channel open fails, so this never runs a command twice."""
        refused = 0
        while True:
            try:
                self.round_trips += 1
                return await session.conn.run(command, input=stdin, encoding=None, check=False)
            except asyncssh.ChannelOpenError:
                refused += 1
                if refused > _CHANNEL_RETRIES or not session.alive:
                    raise
                wait = _CHANNEL_RETRY.delay(refused)
                log.debug("ssh.channel_refused", target=self.name, retry_in=wait)
                await anyio.sleep(wait)

    async def require_python(self, session: Session) -> None:
        """Fail clearly when the target's Python was not found; look again first, in case it was
        installed since the connection opened (one round trip)."""
        if session.python_version is not None:
            return
        self.round_trips += 1
        r = await session.conn.run(
            remote.setup_script(self.target.workdir, self.target.python, self.target.venv),
            input=remote.JOBCTL_SOURCE,
            encoding=None,
            check=False,
        )
        session.python_version = remote.parse_setup(text(r.stdout)).get("python-version")
        self.python_version = session.python_version
        if session.python_version is None:
            raise ExecutorError(
                f"the target's Python ({session.python!r}) was not found or does not run on {self.address}; "
                f"set `python` or `venv` in [targets.{self.name}], then `obd targets check {self.name}`"
            )

    async def sftp(self, session: Session) -> asyncssh.SFTPClient:
        """The session's SFTP client, started on first use."""
        if session.sftp is None:
            async with session.sftp_lock:
                if session.sftp is None:
                    async with self.channels:
                        self.round_trips += 1
                        session.sftp = await session.conn.start_sftp_client()
        return session.sftp


# --- small helpers --------------------------------------------------------------------------


def returncode(r: asyncssh.SSHCompletedProcess) -> int:
    """The exit status; 255 (as ssh(1) says) when the command ended without one."""
    code = r.returncode
    return 255 if code is None else code


def as_bytes(value: object) -> bytes:
    if value is None:
        return b""
    return value if isinstance(value, bytes) else str(value).encode()


def text(value: object) -> str:
    return as_bytes(value).decode("utf-8", "replace")


def tail(value: object, lines: int = 5) -> str:
    """The last lines of a command's output, on one line, for an error message."""
    return " | ".join(text(value).strip().splitlines()[-lines:])


def why(exc: BaseException) -> str:
    """What a connection failure means, in words."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (is sshd running there, on that port?)"
    if isinstance(exc, TimeoutError):
        return "no answer in time (host down, or a firewall dropping packets?)"
    if isinstance(exc, asyncssh.DisconnectError):
        return exc.reason or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


async def quietly(aw: Awaitable[object]) -> None:
    """Await a best-effort clean-up step, ignoring its failure."""
    with contextlib.suppress(Exception):
        await aw
