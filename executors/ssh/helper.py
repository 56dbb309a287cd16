"""The persistent helper of an SSH connection: one `jobctl.py serve` on one channel.

Probes, starts, cancels, reads and writes go to it as requests, one JSON object a line, matched
to their answers by id so that many are in flight at once, instead of each opening a channel
and starting the user's shell (which reads ~/.bashrc: bash does even for `bash -c` under sshd).
It pushes what is written in the run directories it watches (executors/ssh/events.py).

It is started on first use after a connection opens, with `exec PY -S jobctl.py serve`: the
shell still reads its rc file once, for that channel, and never again per poll. It dies with
its channel; the next connection starts a new one. When it cannot start (no Python there, an
interpreter that cannot run it) the connection uses the remote commands instead (`NoHelper`),
and when it keeps dying the target uses them for a while; `obd targets check` says which.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import asyncssh
import structlog

from executors import remote
from executors.base import TargetUnreachable

if TYPE_CHECKING:
    from collections.abc import Callable

    from executors.ssh.connection import Session, SshConnection
    from executors.ssh.events import SshEvents

log = structlog.get_logger()

HELLO_TIMEOUT = 15.0  # from opening the channel to the helper's first line (the shell's rc file included)
MAX_LINE = 64 << 20  # an answer longer than this is a broken helper
CRASH_WINDOW = 600.0  # a helper that dies this many times in this many seconds is given a rest
CRASHES_BEFORE_REST = 3
REST = 600.0  # how long the target then uses the remote commands instead


class NoHelper(Exception):
    """This connection has no helper (it could not start, or is turned off): use the commands.

    `lasting` is False for a refusal that says nothing of the next attempt (the server had no
    channel free)."""

    def __init__(self, why: str, *, lasting: bool = True) -> None:
        super().__init__(why)
        self.lasting = lasting


class HelperGone(Exception):
    """The helper's channel closed while its connection lived: the helper exited or was killed."""


class HelperFailed(Exception):
    """The helper answered a request with an error (the operation failed on the target)."""

    def __init__(self, error: str, errno_name: str | None) -> None:
        super().__init__(error)
        self.error = error
        self.errno = errno_name


@dataclass
class _Pending:
    """A request waiting for its answer: an event to wake its caller, or a callback (a request
    sent from synchronous code, whose answer nobody awaits)."""

    event: anyio.Event | None = None
    callback: Callable[[dict[str, Any]], None] | None = None
    answer: dict[str, Any] | None = None
    error: BaseException | None = None


class _Channel(asyncssh.SSHClientSession[bytes]):
    """asyncssh's callbacks for the helper's channel: stdout cut into lines, stderr kept for
    the message when the helper dies, and the channel's end."""

    def __init__(self, helper: HelperProcess) -> None:
        self.helper = helper
        self._buffer = bytearray()

    def connection_made(self, chan: asyncssh.SSHClientChannel[bytes]) -> None:
        self.helper.chan = chan

    def data_received(self, data: bytes, datatype: asyncssh.DataType) -> None:
        if datatype == asyncssh.EXTENDED_DATA_STDERR:
            self.helper.stderr = (self.helper.stderr + data)[-4096:]
            return
        self._buffer += data
        while (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            self.helper.line(line)
        if len(self._buffer) > MAX_LINE:
            self.helper.broken(f"a line of more than {MAX_LINE} bytes")

    def connection_lost(self, exc: Exception | None) -> None:
        self.helper.lost(exc)


class HelperProcess:
    """One running helper on one channel: requests sent, answers matched by id, pushes passed on."""

    def __init__(
        self,
        address: str,
        on_push: Callable[[dict[str, Any]], None],
        on_end: Callable[[HelperProcess], None],
    ) -> None:
        self.address = address
        self.on_push = on_push
        self.on_end = on_end
        self.chan: asyncssh.SSHClientChannel[bytes] | None = None
        self.hello: dict[str, Any] | None = None
        self.stderr = b""
        self.closed = False
        self.closing = False  # obd itself is closing the connection: its end is no crash
        self.ended: BaseException | None = None
        self._hello = anyio.Event()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}

    @property
    def alive(self) -> bool:
        return not self.closed and self.hello is not None

    @property
    def pid(self) -> int | None:
        return (self.hello or {}).get("pid")

    # --- starting ---------------------------------------------------------------------------

    async def start(self, conn: asyncssh.SSHClientConnection, command: str, timeout: float) -> None:
        """Open the channel and wait for the helper's hello; NoHelper with the reason if none comes."""
        try:
            await conn.create_session(lambda: _Channel(self), command, encoding=None)
        except asyncssh.ChannelOpenError as exc:
            raise NoHelper(f"the server refused a channel for it ({exc.reason})", lasting=False) from exc
        with anyio.move_on_after(timeout):
            await self._hello.wait()
        if self.hello is not None and not self.closed:
            return
        if not self.closed:
            self.close()
            raise NoHelper(f"it did not answer within {timeout:g}s (a slow or interactive ~/.bashrc?)")
        if isinstance(self.ended, asyncssh.Error | ConnectionError):
            raise self.ended  # the connection went: the caller's reconnect handles it
        raise NoHelper(self.why_ended())

    def why_ended(self) -> str:
        """How the helper's process ended, in words, with the last of what it said on stderr."""
        chan = self.chan
        status = chan.get_exit_status() if chan is not None else None
        signal = chan.get_exit_signal() if chan is not None else None
        said = " | ".join(self.stderr.decode("utf-8", "replace").strip().splitlines()[-3:])
        how = (
            f"killed by SIG{signal[0]}" if signal else f"exit {status}" if status is not None else "its channel closed"
        )
        return f"{how}{': ' + said if said else ''}"

    # --- requests ---------------------------------------------------------------------------

    def _send(self, op: str, fields: dict[str, Any], pending: _Pending) -> int:
        chan = self.chan
        if chan is None or chan.is_closing():
            raise self.ended or HelperGone("its channel is closing")
        line = json.dumps({"id": (rid := next(self._ids)), "op": op, **fields}, separators=(",", ":")).encode()
        self._pending[rid] = pending
        try:
            chan.write(line + b"\n")
        except (OSError, asyncssh.Error) as exc:  # closed between the check and the write
            self._pending.pop(rid, None)
            raise HelperGone(f"its channel closed: {exc}") from exc
        return rid

    async def request(self, op: str, fields: dict[str, Any]) -> Any:
        """Send one request and wait for its answer's result; HelperFailed when the helper says
        it failed, HelperGone or a connection error when the channel closes first."""
        if self.closed:
            raise self.ended or HelperGone(self.why_ended())
        pending = _Pending(event=anyio.Event())
        rid = self._send(op, fields, pending)
        try:
            await pending.event.wait()  # type: ignore[union-attr]
        finally:
            self._pending.pop(rid, None)
        if pending.error is not None:
            raise pending.error
        answer = pending.answer or {}
        if not answer.get("ok"):
            raise HelperFailed(str(answer.get("error") or "no message"), answer.get("errno"))
        return answer.get("result")

    def notify(
        self, op: str, fields: dict[str, Any], on_answer: Callable[[dict[str, Any]], None] | None = None
    ) -> None:
        """Send a request from synchronous code; `on_answer` gets its answer, if it comes."""
        if not self.closed:
            with contextlib.suppress(HelperGone):  # its end tells the events; the next helper is told again
                self._send(op, fields, _Pending(callback=on_answer))

    def close(self) -> None:
        self.closing = True
        if self.chan is not None:
            self.chan.close()

    # --- the channel's callbacks ------------------------------------------------------------

    def line(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            log.warning("ssh.helper_said_garbage", address=self.address, line=raw[:200].decode("utf-8", "replace"))
            return
        if not isinstance(message, dict):
            return
        rid = message.get("id")
        if rid is not None:
            pending = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if pending is None:
                return  # its caller gave up (a timeout)
            pending.answer = message
            if pending.event is not None:
                pending.event.set()
            elif pending.callback is not None:
                pending.callback(message)
        elif message.get("event") == "hello":
            self.hello = message
            self._hello.set()
        else:
            self.on_push(message)

    def broken(self, why: str) -> None:
        log.warning("ssh.helper_broken", address=self.address, why=why)
        self.ended = HelperGone(f"it broke its protocol ({why})")
        self.close()

    def lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.ended is None:
            if exc is not None or self.closing:
                # The connection went (or obd is closing it): what the caller's reconnect handles.
                self.ended = asyncssh.ConnectionLost(f"the connection closed under the helper: {exc or 'closed'}")
            else:
                self.ended = HelperGone(self.why_ended())
        for pending in self._pending.values():
            pending.error = self.ended
            if pending.event is not None:
                pending.event.set()
        self._pending.clear()
        self._hello.set()
        if self.hello is not None:
            self.on_end(self)


@dataclass
class _Crashes:
    """When the helpers of a target died on their own, to give them a rest when they keep dying."""

    times: list[float] = field(default_factory=list)
    rest_until: float = 0.0
    why: str | None = None

    def add(self, why: str) -> bool:
        """Count one; True when the target should now rest from helpers."""
        now = time.monotonic()
        self.times = [t for t in self.times if now - t < CRASH_WINDOW] + [now]
        self.why = why
        if len(self.times) >= CRASHES_BEFORE_REST:
            self.rest_until = now + REST
            self.times.clear()
            return True
        return False

    def resting(self) -> bool:
        return time.monotonic() < self.rest_until


class SshHelper:
    """The helper of whichever connection to one target is open: started on first use, started
    again on the next connection, and set aside for the remote commands when it cannot run."""

    def __init__(
        self,
        connection: SshConnection,
        events: SshEvents | None,
        *,
        enabled: bool = True,
        hello_timeout: float = HELLO_TIMEOUT,
    ) -> None:
        self.connection = connection
        self.events = events
        self.enabled = enabled
        self.hello_timeout = hello_timeout
        self.started = 0  # helpers started so far, for tests and benchmarks
        self._crashes = _Crashes()

    @property
    def address(self) -> str:
        return self.connection.address

    def command(self, session: Session) -> str:
        return remote.helper_command(session.python, session.jobctl)

    async def for_session(self, session: Session) -> HelperProcess:
        """The session's live helper, started if need be; NoHelper when it has none."""
        try:
            return await self._for_session(session)
        except NoHelper as exc:
            if exc.lasting and self.events is not None:
                self.events.unavailable()
            raise

    async def _for_session(self, session: Session) -> HelperProcess:
        helper = process_of(session)
        if helper is not None and helper.alive:
            return helper
        self._refuse_early(session)
        async with session.helper_lock:
            helper = process_of(session)
            if helper is not None and helper.alive:
                return helper
            self._refuse_early(session)
            return await self._start(session)

    def _refuse_early(self, session: Session) -> None:
        if not self.enabled:
            raise NoHelper("turned off for this target")
        if session.no_helper is not None:
            raise NoHelper(session.no_helper)
        if self._crashes.resting():
            raise NoHelper(self._crashes.why or "it kept ending")
        if session.python_version is None:
            raise NoHelper(f"the target's Python ({session.python!r}) was not found")

    async def _start(self, session: Session) -> HelperProcess:
        helper = HelperProcess(self.address, self.events.push if self.events is not None else _ignore, self._ended)
        session.helper = helper
        self.connection.round_trips += 1
        try:
            await helper.start(
                session.conn, self.command(session), min(self.hello_timeout, self.connection.op_timeout / 2)
            )
        except NoHelper as exc:
            session.helper = None
            if exc.lasting:
                session.no_helper = str(exc)
            log.warning("ssh.helper_unavailable", target=self.connection.name, address=self.address, why=str(exc))
            raise
        except BaseException:
            session.helper = None
            helper.close()
            raise
        self.started += 1
        if self.events is not None:
            self.events.attach(helper)
        hello = helper.hello or {}
        log.info(
            "ssh.helper_started",
            target=self.connection.name,
            address=self.address,
            pid=hello.get("pid"),
            python=hello.get("python"),
            inotify=hello.get("inotify"),
        )
        return helper

    def _ended(self, helper: HelperProcess) -> None:
        """A helper that had started ended: no more pushes from it; when it died on its own while
        its connection lived, count it, and give the target a rest from helpers when they keep dying."""
        if self.events is not None:
            self.events.detach(helper)
        if not isinstance(helper.ended, HelperGone):
            return  # the connection went, or obd closed it
        rest = self._crashes.add(f"the helper ended ({helper.ended})")
        log.warning(
            "ssh.helper_ended", target=self.connection.name, address=self.address, why=str(helper.ended), rest=rest
        )
        if rest:
            self._crashes.why = f"it ended {CRASHES_BEFORE_REST} times within {CRASH_WINDOW:g}s, last: {helper.ended}"
            if self.events is not None:
                self.events.unavailable()

    async def call(
        self, what: str, op: str, fields: dict[str, Any], *, timeout: float | None = None, retry: bool = True
    ) -> Any:
        """One request through the connection's helper (reconnecting as `SshConnection.remote` does).

        NoHelper when there is none (the caller then runs the remote command instead). A helper
        that dies during the request is started again for a retry if `retry` (the operation is
        idempotent), else the request fails with TargetUnreachable, as a command would.
        """

        async def run(session: Session) -> Any:
            for attempt in (0, 1):
                helper = await self.for_session(session)
                try:
                    self.connection.round_trips += 1
                    return await helper.request(op, fields)
                except HelperGone as exc:
                    if session.helper is helper:
                        session.helper = None
                    if not retry or attempt:
                        raise TargetUnreachable(f"the obd helper on {self.address} ended during {what}: {exc}") from exc
            raise AssertionError("unreachable")  # pragma: no cover

        return await self.connection.remote(what, run, timeout=timeout, retry=retry, channel=False)

    async def check(self) -> tuple[bool, str]:
        """For `obd targets check`: (usable, what serves the target's polls and why)."""
        if not self.enabled:
            return True, "off for this target: every poll runs a remote command"
        try:
            await self.call("a check of the helper", "ping", {})
        except NoHelper as exc:
            return True, (
                f"fallback: {exc}; every poll runs a remote command (a shell on the target), "
                "and exits are seen at the next poll"
            )
        session = self.connection.session
        helper = process_of(session) if session is not None else None
        hello = (helper.hello if helper is not None else None) or {}
        watch = "inotify" if hello.get("inotify") else "a stat every 0.5 s (no inotify)"
        return True, (
            f"ok: jobctl serve (pid {hello.get('pid')}, Python {hello.get('python')}) answers probes, starts, "
            f"cancels, reads and writes on one channel; exits, requests and proofs are pushed ({watch})"
        )


def process_of(session: Session) -> HelperProcess | None:
    """The helper a session holds (the connection keeps it as a mark it can close, not by type)."""
    helper = session.helper
    return helper if isinstance(helper, HelperProcess) else None


def _ignore(message: dict[str, Any]) -> None:
    return None
