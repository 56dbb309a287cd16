"""The client side of the control socket (standard library only, so `obd` starts fast)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

MAX_REPLY = 64 << 20


class DaemonUnreachable(Exception):
    pass


class RequestFailed(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Client:
    """One connection to the daemon, reused for every call (a `logs --follow` makes many)."""

    def __init__(self, path: Path, timeout: float = 120.0) -> None:
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
                raise DaemonUnreachable(
                    f"obd: the daemon is not reachable at {self.path} ({exc.strerror or exc}).\n"
                    "Start it with `obd daemon` (or `systemctl start obd`), or point to it with "
                    "--socket / OBD_SOCKET."
                ) from exc
            self._sock = sock
        return self._sock

    def call(self, op: str, **params: Any) -> Any:
        sock = self._connect()
        try:
            sock.sendall(json.dumps({"op": op, **params}).encode() + b"\n")
            while b"\n" not in self._buf:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise DaemonUnreachable("obd: the daemon closed the connection; check its log")
                self._buf += chunk
                if len(self._buf) > MAX_REPLY:
                    raise DaemonUnreachable("obd: the daemon's reply is too large")
        except OSError as exc:
            self.close()
            raise DaemonUnreachable(f"obd: lost the daemon at {self.path}: {exc}") from exc
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if not reply.get("ok"):
            raise RequestFailed(reply.get("error", "unknown error"), reply.get("kind", "error"))
        return reply.get("result")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._buf = b""
