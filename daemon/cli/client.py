"""The client side of the control socket (standard library only, so `obd` starts fast)."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import socket
import time

from daemon.common.wire import MAX_MESSAGE

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing or pathlib: `obd` starts faster
if TYPE_CHECKING:
    from pathlib import Path
    from typing import Any

MAX_REPLY = 64 << 20
LARGE_REPLY = 64 << 10  # bytes from which a reply is decoded with the cycle collector paused (`decode`)
BUSY_RETRY_FOR = 3.0  # seconds a busy daemon is retried before the client gives up
# Requests that can be sent again on a fresh connection without doing anything twice.
OK_PREFIX = b'{"ok": true, "result": '  # how the daemon begins every answer that succeeded
IDEMPOTENT = frozenset(
    {"ping", "list", "targets", "status", "wait", "watch", "metrics", "read", "stop", "cancel", "outputs"}
)


def decode(data: bytes | str) -> Any:
    """A reply's JSON decoded; a large one with the cycle collector paused. Decoding root's list of
    5,000 runs makes some 100,000 objects, enough to set off the collector's full passes over
    the caller's whole heap mid-decode: 0.1 s and more in a long-lived SDK process, against
    15-20 ms for the decode itself (issue 33). JSON makes no cycles, so nothing is left for
    the collector; it is left as found (a caller that paused it keeps it paused)."""
    if len(data) < LARGE_REPLY or not gc.isenabled():
        return json.loads(data)
    gc.disable()
    try:
        return json.loads(data)
    finally:
        gc.enable()


class DaemonUnreachable(Exception):
    pass


class DaemonBusy(Exception):
    """The daemon is up but turned this caller away (too many connections); retrying may work."""


class RequestFailed(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Closed(Exception):
    """The connection closed before a reply came."""


class Client:
    """One connection to the daemon, reused for every call (a `logs --follow` makes many)."""

    def __init__(self, path: Path | str, timeout: float = 120.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._buf = b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout)
            try:
                sock.connect(str(self.path))
            except OSError as exc:
                sock.close()
                raise DaemonUnreachable(unreachable_message(self.path, exc)) from exc
            self._sock = sock
        return self._sock

    def call(self, op: str, **params: Any) -> Any:
        return decode(self.call_raw(op, **params))

    def call_raw(self, op: str, **params: Any) -> bytes:
        """The result of a request as the daemon encoded it (JSON bytes)."""
        line = json.dumps({"op": op, **params}).encode() + b"\n"
        if len(line) > MAX_MESSAGE:
            raise RequestFailed(
                f"the request is {len(line) >> 10} KiB, over the daemon's limit of {MAX_MESSAGE >> 10} KiB "
                "(large --env values or --secret values?); pass large values in a file instead",
                "usage",
            )
        deadline = time.monotonic() + BUSY_RETRY_FOR
        reused = self._sock is not None
        while True:
            try:
                reply = self._exchange(line)
            except _Closed as exc:
                # A connection kept between calls may have been closed by the daemon while idle
                # (it makes way for others when full); a request that cannot act twice is sent again.
                if reused and op in IDEMPOTENT:
                    reused = False
                    continue
                raise DaemonUnreachable(f"obd: the daemon closed the connection ({exc}); check its log") from exc
            if reply.startswith(OK_PREFIX) and reply.endswith(b"}"):
                return reply[len(OK_PREFIX) : -1]  # the common case, not decoded here
            decoded = decode(reply)
            if decoded.get("kind") == "busy" and not decoded.get("ok"):
                self.close()
                if time.monotonic() >= deadline:
                    raise DaemonBusy(
                        f"obd: the daemon at {self.path} is busy with other callers: {decoded.get('error')}; "
                        "retry in a moment"
                    )
                time.sleep(0.2)
                continue
            break
        if not decoded.get("ok"):
            raise RequestFailed(decoded.get("error", "unknown error"), decoded.get("kind", "error"))
        return json.dumps(decoded.get("result")).encode()

    def _exchange(self, line: bytes) -> bytes:
        sock = self._connect()
        try:
            # The daemon may have answered already (busy, too large): read what it said.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(line)
            # A reply of megabytes comes in dozens of chunks: each is added in place and only it
            # is searched for the line's end (adding to bytes and searching all of it each time
            # cost root's list of 5,000 runs a few ms).
            buf, end = bytearray(self._buf), self._buf.find(b"\n")
            while end < 0:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    self.close()
                    raise _Closed("no reply")
                end = chunk.find(b"\n")
                if end >= 0:
                    end += len(buf)
                buf += chunk
                if len(buf) > MAX_REPLY:
                    self.close()
                    raise DaemonUnreachable("obd: the daemon's reply is too large")
        except ConnectionResetError as exc:
            self.close()
            raise _Closed(str(exc)) from exc
        except OSError as exc:
            self.close()
            raise DaemonUnreachable(f"obd: lost the daemon at {self.path}: {exc}") from exc
        self._buf = bytes(buf[end + 1 :])
        return bytes(buf[:end])

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf = b""


def unreachable_message(path: Path | str, exc: OSError) -> str:
    """Why the socket could not be reached, and what to do: a permission error is not a daemon to start."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"obd: permission denied on the daemon's socket {path}: it is for root, the daemon's user and, "
            "if the administrator set socket_group, that group's members. Run the command with sudo, ask to be "
            "added to the socket's group, or start a daemon of your own (`obd daemon`, or "
            "`systemctl --user start obd`) and point to it with --socket / OBD_SOCKET."
        )
    return (
        f"obd: the daemon is not reachable at {path} ({exc.strerror or exc}).\n"
        "Start it with `obd daemon` (or `systemctl start obd`), or point to it with --socket / OBD_SOCKET."
    )
