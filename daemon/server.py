"""The control socket: a unix socket, private by default, one JSON object a line each way.

Each connection is served on its own; a caller that is not allowed (checked with SO_PEERCRED),
sends garbage, a message over 1 MiB, or goes quiet halfway gets an error or is dropped, and
nothing it does reaches another caller's request.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import socket
import stat
import struct
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, Protocol

import anyio
import structlog
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import BaseModel, ValidationError

from daemon.api import MAX_MESSAGE, ApiError
from daemon.config import DaemonSection

log = structlog.get_logger("obd.server")
IDLE_TIMEOUT = 60.0
MAX_CONNECTIONS = 256  # beyond this a new caller is told the daemon is busy and dropped


class Handler(Protocol):
    """What answers requests: the op table (daemon/handlers.py) and its dispatch."""

    def model(self, op: str) -> type[BaseModel] | None: ...

    def __call__(self, request: Any, uid: int) -> Awaitable[Any]: ...


def raise_fd_limit() -> None:
    """Lift the soft limit on open files to the hard one: each caller and job watch holds one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard)
            )


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class ControlServer:
    def __init__(self, config: DaemonSection, handler: Handler) -> None:
        assert config.socket is not None
        self.path = Path(config.socket)
        self.mode = config.socket_mode
        self.group = config.socket_group
        self.handler = handler
        self.gid: int | None = None
        if self.group:
            try:
                self.gid = grp.getgrnam(self.group).gr_gid
            except KeyError as exc:
                raise SystemExit(
                    f"obd: socket_group {self.group!r} does not exist (create it or fix the config)"
                ) from exc

    def allowed(self, uid: int, gid: int) -> bool:
        if uid in (0, os.geteuid()):
            return True
        if self.gid is None:
            return False
        if gid == self.gid:
            return True
        try:
            name = pwd.getpwuid(uid).pw_name
            return self.gid in os.getgrouplist(name, gid)
        except KeyError:
            return False

    def _prepare_path(self) -> None:
        parent = self.path.parent
        if not parent.exists():
            parent.mkdir(parents=True, mode=0o700 if self.gid is None else 0o750)
            if self.gid is not None:
                os.chown(parent, -1, self.gid)
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
        active = 0

        async def serve_one(stream: SocketStream) -> None:
            nonlocal active
            try:
                await self._connection(stream)
            finally:
                active -= 1

        while True:
            try:
                stream = await listener.accept()
            except (OSError, anyio.BrokenResourceError) as exc:
                log.warning("accept_failed", error=str(exc.__cause__ or exc))
                await anyio.sleep(0.1)  # e.g. EMFILE: let connections close, then go on
                continue
            if active >= MAX_CONNECTIONS:
                with anyio.move_on_after(1):
                    await _send(stream, {"ok": False, "kind": "busy", "error": "the daemon is busy; retry"})
                await stream.aclose()
                continue
            active += 1
            tg.start_soon(serve_one, stream)

    async def _connection(self, stream: SocketStream) -> None:
        async with stream:
            try:
                _pid, uid, gid = peer_credentials(stream.extra(SocketAttribute.raw_socket))
            except OSError:
                return
            if not self.allowed(uid, gid):
                log.warning("caller_refused", uid=uid)
                await _send(stream, {"ok": False, "kind": "denied", "error": f"uid {uid} may not use this daemon"})
                return
            reader = BufferedByteReceiveStream(stream)
            while True:
                try:
                    with anyio.fail_after(IDLE_TIMEOUT):
                        line = await reader.receive_until(b"\n", MAX_MESSAGE)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, TimeoutError):
                    return
                except anyio.DelimiterNotFound:
                    await _send(stream, {"ok": False, "kind": "usage", "error": "message over 1 MiB; dropped"})
                    return
                reply = await self._answer(line, uid)
                try:
                    await _send(stream, reply)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    return

    async def _answer(self, line: bytes, uid: int) -> dict:
        try:
            raw = json.loads(line)
            if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
                raise ApiError('a request is a JSON object with an "op" string', "usage")
            model = self.handler.model(raw["op"])
            if model is None:
                raise ApiError(f"unknown operation {raw['op']!r}", "usage")
            request = model.model_validate(raw)
            return {"ok": True, "result": await self.handler(request, uid)}
        except ApiError as exc:
            return {"ok": False, "kind": exc.kind, "error": str(exc)}
        except (ValueError, ValidationError) as exc:
            text = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) else "not valid JSON"
            return {"ok": False, "kind": "usage", "error": f"bad request: {text}"}
        except Exception as exc:  # one request's bug must not take the daemon down
            log.exception("request_failed")
            return {"ok": False, "kind": "error", "error": f"internal error: {type(exc).__name__}: {exc}"}


async def _send(stream: SocketStream, message: dict) -> None:
    await stream.send(json.dumps(message).encode() + b"\n")
