"""The control socket: a unix socket, private by default, one JSON object a line each way.

Each connection is served on its own; a caller that is not allowed (checked with SO_PEERCRED
and SO_PEERGROUPS: who connected, as the kernel recorded it on the socket), sends garbage, a message over 1 MiB, or goes quiet halfway gets an error or is dropped, and
nothing it does reaches another caller's request. Callers that hold connections without using
them (silent, or not reading their replies) cannot lock others out: a reply that cannot be
sent within `SEND_TIMEOUT` drops its connection, each uid has a share of the connections, and
when there is no room the caller that has waited on its peer the longest makes way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import grp
import json
import os
import pwd
import socket
import stat
import struct
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import BaseModel, ValidationError

from daemon.common.wire import MAX_MESSAGE
from daemon.service.api import ApiError, Peer, RawJSON
from daemon.service.config import DaemonSection
from daemon.service.turns import Share

log = structlog.get_logger("obd.server")
IDLE_TIMEOUT = 60.0
SEND_TIMEOUT = 5.0  # a reply the caller does not read within this drops the connection
MAX_CONNECTIONS = 512
MAX_PER_UID = 64  # one user's share of MAX_CONNECTIONS
DRAIN_LIMIT = 64 << 20  # what is read (and thrown away) of an over-long message before hanging up
LONG_ANSWER = 100  # items of a result's list past which it is encoded a share of the event loop at a time


class Handler(Protocol):
    """What answers requests: the op table (daemon/service/handlers.py) and its dispatch."""

    def model(self, op: str) -> type[BaseModel] | None: ...

    def __call__(self, request: Any, peer: Peer) -> Awaitable[Any]: ...

    def session_model(self, op: str) -> type[BaseModel] | None:
        """The model of an op that takes its connection over (a session), or None."""
        ...

    def run_session(self, request: Any, peer: Peer, channel: LineChannel) -> Awaitable[None]: ...


class LineChannel:
    """A session's connection, one JSON object a line each way: sends from several tasks are
    taken in turn; a caller that hangs up (or sends garbage past the line limit) reads as None."""

    def __init__(self, stream: SocketStream, reader: BufferedByteReceiveStream) -> None:
        self.stream = stream
        self.reader = reader
        self.lock = anyio.Lock()

    async def send(self, message: dict[str, Any]) -> None:
        async with self.lock:
            await _send(self.stream, message)

    async def receive(self) -> dict[str, Any] | None:
        try:
            line = await self.reader.receive_until(b"\n", MAX_MESSAGE)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return None
        except anyio.DelimiterNotFound:
            return None
        try:
            message = json.loads(line)
        except (ValueError, RecursionError):
            return {}
        return message if isinstance(message, dict) else {}


@dataclass(eq=False)
class Caller:
    """One connection: whose it is, and since when it has been waiting on its peer (None while
    the daemon works on its request)."""

    uid: int
    peer: Peer
    stalled_since: float | None = field(default_factory=time.monotonic)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Callers:
    """The connections being served, and who makes way when there is no room for a new one."""

    def __init__(self, total: int = MAX_CONNECTIONS, per_uid: int = MAX_PER_UID) -> None:
        self.total = total
        self.per_uid = per_uid
        self.callers: set[Caller] = set()

    def count(self, uid: int) -> int:
        return sum(c.uid == uid for c in self.callers)

    def admit(self, caller: Caller) -> bool:
        """Take a new caller, evicting the longest-stalled connection (its own uid's first when
        it is at its share); False when everyone is busy with a request."""
        if self.count(caller.uid) >= self.per_uid and not self._evict({c for c in self.callers if c.uid == caller.uid}):
            return False
        if len(self.callers) >= self.total:
            heaviest = max({c.uid for c in self.callers}, key=self.count)
            if not self._evict({c for c in self.callers if c.uid == heaviest}) and not self._evict(self.callers):
                return False
        self.callers.add(caller)
        return True

    def _evict(self, among: set[Caller]) -> bool:
        stalled = [c for c in among if c.stalled_since is not None and not c.scope.cancel_called]
        if not stalled:
            return False
        victim = min(stalled, key=lambda c: c.stalled_since or 0.0)
        victim.scope.cancel()
        self.callers.discard(victim)
        log.info("caller_evicted", uid=victim.uid, stalled_s=round(time.monotonic() - (victim.stalled_since or 0), 3))
        return True

    def leave(self, caller: Caller) -> None:
        self.callers.discard(caller)


def raise_fd_limit() -> None:
    """Lift the soft limit on open files to the hard one: each caller and job watch holds one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard)
            )


SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13; Python has no name for it
GID = struct.Struct("I")  # gid_t
MAX_GROUPS_BYTES = 65536 * GID.size  # NGROUPS_MAX
PY_GETSOCKOPT_MAX = 1024  # CPython refuses a larger getsockopt buffer


def peer_identity(sock: socket.socket) -> Peer:
    """Who connected: uid, gid and supplementary groups as the kernel recorded them on the socket
    at connect time. Nothing is read from the calling process (its pid may already be another
    process's); the account database is asked only on a kernel without SO_PEERGROUPS."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    _pid, uid, gid = struct.unpack("iII", raw)
    return Peer(uid=uid, gid=gid, groups=peer_groups(sock))


def peer_groups(sock: socket.socket) -> tuple[int, ...] | None:
    """The supplementary groups the caller had when it connected (SO_PEERGROUPS), the buffer
    grown while the kernel says it is too small; None on a kernel without the option."""
    size = 64 * GID.size
    while True:
        try:
            raw = _getsockopt(sock, SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE and size < MAX_GROUPS_BYTES:
                size = min(size * 4, MAX_GROUPS_BYTES)
                continue
            if exc.errno == errno.ENOPROTOOPT:
                return None
            raise
        return tuple(gid for (gid,) in GID.iter_unpack(raw[: len(raw) - len(raw) % GID.size]))


def _getsockopt(sock: socket.socket, option: int, size: int) -> bytes:
    """getsockopt(SOL_SOCKET, option) into a buffer of `size` bytes: Python's own up to the 1 KiB
    it allows (256 groups), libc's beyond (a caller in more groups)."""
    if size <= PY_GETSOCKOPT_MAX:
        return sock.getsockopt(socket.SOL_SOCKET, option, size)
    import ctypes

    buf = ctypes.create_string_buffer(size)
    length = ctypes.c_uint32(size)  # socklen_t
    if _libc().getsockopt(sock.fileno(), socket.SOL_SOCKET, option, buf, ctypes.byref(length)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.raw[: length.value]


@functools.cache
def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def make_socket_dir(directory: Path, gid: int | None) -> None:
    """Make the socket's directory, and each missing one above it, as the socket needs them:
    0700 for a private socket; 0710 with group `gid` when socket_group is set, so its members
    can reach the socket but not list the directory, and no one else can do either. The mode is
    set outright: the daemon's umask (0077) would otherwise close the directory to the group.

    A directory that already exists is the administrator's and is left as it is; one that shuts
    the group out is said in the log."""
    missing: list[Path] = []
    here = directory
    while not here.exists():
        missing.append(here)
        here = here.parent
    mode = 0o700 if gid is None else 0o710
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: theirs
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
    if gid is not None and not missing:
        info = directory.stat()
        if not (info.st_mode & 0o001 or (info.st_gid == gid and info.st_mode & 0o010)):
            log.warning(
                "socket_dir_shuts_out_group",
                directory=str(directory),
                hint=f"the socket_group cannot reach the socket: chgrp it to that group and chmod g+x {directory}",
            )


class ControlServer:
    def __init__(self, config: DaemonSection, handler: Handler) -> None:
        assert config.socket is not None
        self.path = Path(config.socket)
        self.mode = config.socket_mode
        self.group = config.socket_group
        self.handler = handler
        self.callers = Callers()
        self.gid: int | None = None
        if self.group:
            try:
                self.gid = grp.getgrnam(self.group).gr_gid
            except KeyError as exc:
                raise SystemExit(
                    f"obd: socket_group {self.group!r} does not exist (create it or fix the config)"
                ) from exc

    def allowed(self, peer: Peer) -> bool:
        """Root, the daemon's own user, and members of socket_group (as the socket says they
        connected; as the account database says on a kernel without SO_PEERGROUPS)."""
        if peer.uid in (0, os.geteuid()):
            return True
        if self.gid is None:
            return False
        if peer.gid == self.gid:
            return True
        if peer.groups is not None:
            return self.gid in peer.groups
        try:
            name = pwd.getpwuid(peer.uid).pw_name
            return self.gid in os.getgrouplist(name, peer.gid)
        except KeyError:
            return False

    def _prepare_path(self) -> None:
        make_socket_dir(self.path.parent, self.gid)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise SystemExit(f"obd: {self.path} exists and is not a socket; remove it or choose --socket")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(self.path))
            except OSError:
                self.path.unlink()  # a stale socket of a daemon that died
            else:
                raise SystemExit(f"obd: a daemon already listens on {self.path}")
            finally:
                probe.close()

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        self._prepare_path()
        old = os.umask(0o177)  # the socket is private from its first moment
        try:
            listener = await anyio.create_unix_listener(self.path)
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.path, -1, self.gid)
        os.chmod(self.path, self.mode if self.gid is None else (self.mode | 0o060))
        raise_fd_limit()
        task_status.started()
        try:
            async with listener, anyio.create_task_group() as tg:
                await self._accept_loop(listener, tg)
        finally:
            with contextlib.suppress(OSError):
                self.path.unlink()

    async def _accept_loop(self, listener: Any, tg: Any) -> None:
        """Accept callers for ever: running out of descriptors or a flood of callers never ends it."""
        while True:
            try:
                stream = await listener.accept()
            except (OSError, anyio.BrokenResourceError) as exc:
                log.warning("accept_failed", error=str(exc.__cause__ or exc))
                await anyio.sleep(0.1)  # e.g. EMFILE: let connections close, then go on
                continue
            tg.start_soon(self._connection, stream)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            try:
                peer = peer_identity(stream.extra(SocketAttribute.raw_socket))
            except OSError:
                return
            reader = BufferedByteReceiveStream(stream)
            if not self.allowed(peer):
                log.warning("caller_refused", uid=peer.uid)
                await self._refuse(stream, reader, "denied", self.denied_message(peer.uid))
                return
            caller = Caller(peer.uid, peer)
            if not self.callers.admit(caller):
                log.warning("caller_busy", uid=peer.uid, connections=self.callers.count(peer.uid))
                await self._refuse(stream, reader, "busy", "the daemon is busy with other callers")
                return
            try:
                with caller.scope:
                    await self._serve(stream, reader, caller)
            finally:
                self.callers.leave(caller)

    def denied_message(self, uid: int) -> str:
        """Who may use this socket, and how, for a caller who may not."""
        who = "root and the daemon's own user"
        if self.group:
            who += f", and members of the group {self.group!r}"
        return (
            f"uid {uid} may not use this daemon: its socket {self.path} is for {who}. Run the command "
            "as one of them (e.g. with sudo), ask the administrator to add you to the daemon's socket_group, "
            "or run a daemon of your own (`obd daemon`, or `systemctl --user start obd`)"
        )

    async def _serve(self, stream: SocketStream, reader: BufferedByteReceiveStream, caller: Caller) -> None:
        while True:
            caller.stalled_since = time.monotonic()
            try:
                with anyio.fail_after(IDLE_TIMEOUT):
                    line = await reader.receive_until(b"\n", MAX_MESSAGE)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, TimeoutError):
                return
            except anyio.DelimiterNotFound:
                await self._refuse(
                    stream, reader, "too_large", f"the request is over {MAX_MESSAGE >> 20} MiB; it was not read"
                )
                return
            caller.stalled_since = None
            if (session := self._session_of(line)) is not None:  # it has the connection to itself
                await self._session(stream, reader, session, caller.peer)
                return
            reply = await self._answer_unless_gone(stream, reader, line, caller.peer)
            if reply is None:
                return  # the caller hung up while its request was being answered (a long `wait`)
            pieces = await _reply(reply)  # before the send's time starts: a long one takes turns
            caller.stalled_since = time.monotonic()
            try:
                with anyio.fail_after(SEND_TIMEOUT):
                    for piece in pieces:
                        await stream.send(piece)
            except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return

    async def _answer_unless_gone(
        self, stream: SocketStream, reader: BufferedByteReceiveStream, line: bytes, peer: Peer
    ) -> dict[str, Any] | None:
        """Answer a request, but give up (None) if the caller hangs up meanwhile, so a long
        request whose caller went away does not hold its connection. The hang-up is watched by a
        callback of the event loop on the socket, not a task: a ping or a list is answered in the
        connection's own task, with no task started and waited for (a turn of every other
        task's each, on a busy daemon)."""
        if reader.buffer:  # a pipelined request is waiting: the caller is there
            return await self._answer(line, peer)
        raw = stream.extra(SocketAttribute.raw_socket)
        loop = asyncio.get_running_loop()
        with anyio.CancelScope() as scope:

            def readable() -> None:
                loop.remove_reader(raw)  # once: a request sent meanwhile waits for its turn
                with contextlib.suppress(OSError):
                    if raw.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        scope.cancel()

            loop.add_reader(raw, readable)
            try:
                return await self._answer(line, peer)
            finally:
                loop.remove_reader(raw)
        return None

    def _session_of(self, line: bytes) -> tuple[type[BaseModel], dict[str, Any]] | None:
        """The model and message of a request for a session (`exec`), or None for any other."""
        if b'"exec"' not in line:  # the cheap look first: every other request is answered as before
            return None
        try:
            raw = json.loads(line)
        except (ValueError, RecursionError):
            return None
        if not isinstance(raw, dict) or not isinstance(op := raw.get("op"), str):
            return None
        model = self.handler.session_model(op)
        return (model, raw) if model is not None else None

    async def _session(
        self,
        stream: SocketStream,
        reader: BufferedByteReceiveStream,
        session: tuple[type[BaseModel], dict[str, Any]],
        peer: Peer,
    ) -> None:
        """Serve a session until it ends; an error (before it started, or one that ended it) is
        sent as any request's error is."""
        channel = LineChannel(stream, reader)
        model, raw = session
        error: dict[str, Any] | None = None
        try:
            await self.handler.run_session(model.model_validate(raw), peer, channel)
        except ApiError as exc:
            error = {"ok": False, "kind": exc.kind, "error": str(exc)}
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            error = {
                "ok": False,
                "kind": "usage",
                "error": f"bad request: {where + ': ' if where else ''}{first['msg']}",
            }
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return  # the caller went away
        except Exception as exc:  # one session's bug must not take the daemon down
            log.exception("session_failed")
            error = {"ok": False, "kind": "error", "error": f"internal error: {type(exc).__name__}: {exc}"}
        if error is not None:
            with (
                anyio.move_on_after(SEND_TIMEOUT),
                contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError),
            ):
                await channel.send(error)

    @staticmethod
    async def _refuse(stream: SocketStream, reader: BufferedByteReceiveStream, kind: str, error: str) -> None:
        """Answer a caller that is not served, then hang up cleanly: the rest of what it sends is
        read and thrown away first, so it gets the answer and not a reset connection."""
        with anyio.move_on_after(SEND_TIMEOUT):
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                await _send(stream, {"ok": False, "kind": kind, "error": error})
            with contextlib.suppress(OSError):
                stream.extra(SocketAttribute.raw_socket).shutdown(socket.SHUT_WR)
            drained = len(reader.buffer)
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                while drained < DRAIN_LIMIT:
                    drained += len(await reader.receive())

    async def _answer(self, line: bytes, peer: Peer) -> dict:
        try:
            try:
                raw = json.loads(line)
            except RecursionError as exc:
                raise ApiError("bad request: JSON nested too deeply", "usage") from exc
            if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
                raise ApiError('a request is a JSON object with an "op" string', "usage")
            model = self.handler.model(raw["op"])
            if model is None:
                raise ApiError(f"unknown operation {raw['op']!r}", "usage")
            request = model.model_validate(raw)
            return {"ok": True, "result": await self.handler(request, peer)}
        except ApiError as exc:
            return {"ok": False, "kind": exc.kind, "error": str(exc)}
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return {
                "ok": False,
                "kind": "usage",
                "error": f"bad request: {where + ': ' if where else ''}{first['msg']}",
            }
        except ValueError:
            return {"ok": False, "kind": "usage", "error": "bad request: not valid JSON"}
        except Exception as exc:  # one request's bug must not take the daemon down
            log.exception("request_failed")
            return {"ok": False, "kind": "error", "error": f"internal error: {type(exc).__name__}: {exc}"}


async def _send(stream: SocketStream, message: dict) -> None:
    for piece in await _reply(message):
        await stream.send(piece)


async def _reply(message: dict) -> list[bytes]:
    """A reply's bytes, its line's end included; the pieces of a long one are sent as they are."""
    result = message.get("result")
    if isinstance(result, RawJSON):  # encoded once, where it is kept (the run list)
        return [b'{"ok": true, "result": ', result, b"}\n"]
    if _long(result) or (isinstance(result, dict) and any(_long(v) for v in result.values())):
        return [b'{"ok": true, "result": ', await _encoded(result), b"}\n"]
    return [json.dumps(message).encode() + b"\n"]


def _long(value: Any) -> bool:
    return isinstance(value, list) and len(value) > LONG_ANSWER


async def _encoded(value: Any, share: Share | None = None) -> bytes:
    """A result holding a long list (a sweep's 1,000 members made or cancelled, their records:
    megabytes) encoded item by item, a share of the event loop at a time (`Share`): the last
    step of a sweep's cancel is not tens of milliseconds of everyone's wait."""
    share = share or Share()
    if isinstance(value, list):
        items = []
        for item in value:
            await share.turn()
            items.append(json.dumps(item).encode())
        return b"[" + b", ".join(items) + b"]"
    if isinstance(value, dict):
        fields = [json.dumps(str(key)).encode() + b": " + await _encoded(item, share) for key, item in value.items()]
        return b"{" + b", ".join(fields) + b"}"
    return json.dumps(value).encode()
