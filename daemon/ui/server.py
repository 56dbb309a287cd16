"""The HTTP side of `obd ui`: 127.0.0.1 only, a random token, the page's files, its API and its event streams.

The token is in the URL `obd ui` prints (as Jupyter does); the first visit with it sets a
cookie and redirects to the same page without it. Every request needs the cookie or the token;
a request that changes something (stop, cancel) also needs the token in an `X-OBD-Token` header,
which only the page itself can read (from /api/session), so another site cannot make a browser
act. A Host header other than a loopback name is refused (no DNS rebinding). Through
`ssh -L LOCAL:127.0.0.1:PORT` the page works as it does here.
"""

from __future__ import annotations

import hmac
import http.server
import json
import os
import pwd
import secrets
import signal
import socket
import sys
import threading
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from daemon.cli_common import EXIT_UNREACHABLE, EXIT_USAGE
from daemon.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.ui import DEFAULT_PORT
from daemon.ui.feed import RunFeed
from daemon.ui.hub import Hub

STATIC = Path(__file__).with_name("static")
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
MAX_STREAMS = 32  # open event streams at once (each holds a connection to the daemon)
HEARTBEAT = 15.0
PORT_TRIES = 20
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
ERRORS = {"usage": 400, "denied": 403, "not_found": 404, "state": 409, "unavailable": 503}


class UiServer(http.server.ThreadingHTTPServer):
    """The web view's server: what every request handler shares."""

    daemon_threads = True
    block_on_close = False  # open event streams never hold up the exit
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], socket_path: Path, token: str) -> None:
        super().__init__(address, Handler)
        self.socket_path = socket_path
        self.token = token
        self.hub = Hub(socket_path)
        self.streams = threading.BoundedSemaphore(MAX_STREAMS)
        self.cookie = f"obd_ui_{self.server_address[1]}"
        self.user = _user_name(os.getuid())


class Handler(http.server.BaseHTTPRequestHandler):
    server: UiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: an access log would print the token of the first visit."""

    # --- dispatch ------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self._host_ok():
            return self._refuse(HTTPStatus.FORBIDDEN, "obd ui answers only to 127.0.0.1 or localhost")
        query = parse_qs(url.query)
        given = (query.get("token") or [""])[0]
        if given and self._token_ok(given):
            # Remember the token in a cookie and drop it from the address bar.
            self.send_response(HTTPStatus.SEE_OTHER)
            self.send_header(
                "Set-Cookie", f"{self.server.cookie}={given}; Path=/; HttpOnly; SameSite=Strict; Max-Age=2592000"
            )
            self.send_header("Location", url.path or "/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if not self._token_ok(self._cookie_token()):
            return self._refuse(
                HTTPStatus.FORBIDDEN,
                "obd ui needs its token: open the address `obd ui` printed (http://127.0.0.1:PORT/?token=...), "
                "or run `obd ui` again for a new one.",
            )
        path = url.path
        if path in ("/", "/index.html"):
            return self._file("index.html")
        if path.startswith("/static/"):
            return self._file(path.removeprefix("/static/"))
        if path == "/api/session":
            return self._json({"token": self.server.token, "user": self.server.user, "uid": os.getuid()})
        if path == "/api/runs":
            _, runs, error = self.server.hub.snapshot()
            return self._json({"runs": runs, "error": error})
        if path == "/api/events":
            return self._stream(self._list_events)
        parts = path.split("/")
        if len(parts) == 4 and parts[:3] == ["", "api", "runs"]:
            return self._call("status", id=parts[3])
        if len(parts) == 5 and parts[:3] == ["", "api", "runs"] and parts[4] == "events":
            run_id = parts[3]
            metric = (query.get("metric") or ["loss"])[0]
            return self._stream(lambda: self._run_events(run_id, metric))
        return self._refuse(HTTPStatus.NOT_FOUND, f"no such page: {path}")

    def do_POST(self) -> None:
        if not self._host_ok() or not self._origin_ok():
            return self._refuse(HTTPStatus.FORBIDDEN, "obd ui answers only to its own page on 127.0.0.1")
        if not self._token_ok(self.headers.get("X-OBD-Token", "")):
            return self._refuse(HTTPStatus.FORBIDDEN, "a request that acts on a run needs the X-OBD-Token header")
        self._drain_body()
        parts = urlsplit(self.path).path.split("/")
        if len(parts) == 5 and parts[:3] == ["", "api", "runs"] and parts[4] in ("stop", "cancel"):
            params = {"reason": "requested"} if parts[4] == "stop" else {}
            return self._call(parts[4], id=parts[3], **params)
        return self._refuse(HTTPStatus.NOT_FOUND, "no such action")

    # --- checks --------------------------------------------------------------------------

    def _host_ok(self) -> bool:
        host = self.headers.get("Host", "")
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        return name.lower() in LOOPBACK_HOSTS

    def _origin_ok(self) -> bool:
        origin = self.headers.get("Origin")
        if origin is None:
            return True  # not a browser's cross-site request (those always carry Origin on POST)
        return urlsplit(origin).netloc == self.headers.get("Host", "")

    def _token_ok(self, given: str) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.server.token.encode())

    def _cookie_token(self) -> str:
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == self.server.cookie:
                return value
        return ""

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= 65536:
            self.rfile.read(length)

    # --- answers -------------------------------------------------------------------------

    def _headers(self, status: int, content_type: str, length: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self._headers(status, content_type, len(body))
        self.wfile.write(body)

    def _json(self, value: Any, status: int = 200) -> None:
        self._send(status, "application/json", json.dumps(value).encode())

    def _refuse(self, status: int, message: str) -> None:
        self.close_connection = True
        self._send(status, "text/plain; charset=utf-8", (message + "\n").encode())

    def _file(self, name: str) -> None:
        path = STATIC / name
        if "/" in name or name.startswith(".") or path.suffix not in CONTENT_TYPES or not path.is_file():
            return self._refuse(HTTPStatus.NOT_FOUND, f"no such file: {name}")
        self._send(200, CONTENT_TYPES[path.suffix], path.read_bytes())

    def _call(self, op: str, **params: Any) -> None:
        """One call to the daemon as this user; its error, if any, goes back as JSON with a status."""
        client = Client(self.server.socket_path, timeout=60)
        try:
            self._json(client.call(op, **params))
        except RequestFailed as exc:
            self._json({"error": str(exc), "kind": exc.kind}, ERRORS.get(exc.kind, 500))
        except (DaemonUnreachable, DaemonBusy) as exc:
            self._json({"error": str(exc), "kind": "unreachable"}, 503)
        finally:
            client.close()

    # --- event streams -------------------------------------------------------------------

    def _stream(self, events: Any) -> None:
        """Server-sent events from `events()`, with a heartbeat, until the browser goes away."""
        if not self.server.streams.acquire(blocking=False):
            return self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "too many open pages on this obd ui")
        self.close_connection = True
        try:
            self._headers(200, "text/event-stream", None)
            self.wfile.write(b"retry: 2000\n\n")
            self.wfile.flush()
            for item in events():
                if item is None:
                    self.wfile.write(b": heartbeat\n\n")
                else:
                    name, data = item
                    self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the page was closed
        finally:
            self.server.streams.release()

    def _list_events(self) -> Any:
        hub = self.server.hub
        seq, runs, error = hub.snapshot()
        yield "runs", {"runs": runs, "error": error}
        while True:
            new = hub.wait(seq, HEARTBEAT)
            if new == seq:
                yield None
                continue
            seq, changed, error = hub.changes_since(seq)
            yield "changed", {"runs": changed, "error": error}

    def _run_events(self, run_id: str, metric: str) -> Any:
        feed = RunFeed(self.server.socket_path, run_id, self.server.hub, metric)
        try:
            yield from feed.events()
        finally:
            feed.close()


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def bind(socket_path: Path, port: int | None, token: str) -> UiServer:
    """The server on 127.0.0.1: on `port`, or the first free one from 8765 when none was asked for."""
    if port is not None:
        return UiServer(("127.0.0.1", port), socket_path, token)
    for candidate in range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES):
        try:
            return UiServer(("127.0.0.1", candidate), socket_path, token)
        except OSError:
            continue
    return UiServer(("127.0.0.1", 0), socket_path, token)


def serve(socket_path: Path, port: int | None) -> int:
    """`obd ui`: check the daemon answers, serve until Ctrl-C or SIGTERM, print where to look."""
    client = Client(socket_path, timeout=10)
    try:
        client.call("ping")
    except DaemonUnreachable as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    finally:
        client.close()
    token = secrets.token_urlsafe(24)
    try:
        server = bind(socket_path, port, token)
    except OSError as exc:
        print(
            f"obd: cannot serve on 127.0.0.1:{port} ({exc.strerror or exc}); pick another port with --port",
            file=sys.stderr,
        )
        return EXIT_USAGE
    bound = server.server_address[1]
    server.hub.start()
    print(f"obd ui: serving the runs of {server.user} on http://127.0.0.1:{bound}/?token={token}")
    print(
        f"From another machine: ssh -N -L {bound}:127.0.0.1:{bound} {server.user}@{socket.gethostname()}, "
        "then open the same address there. Ctrl-C stops it.",
        flush=True,
    )

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.hub.close()
        server.server_close()
    return 0
