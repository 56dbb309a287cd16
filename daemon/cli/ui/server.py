"""The HTTP side of `obd ui`: 127.0.0.1 only, a random token, the page's files, its API and its event streams.

Cookies are not kept apart by port, so everything a view serves lives under a random secret
path prefix of its own (`/<prefix>/`, printed with the token and never sent by the server
outside it), and its cookie is set with `Path=/<prefix>/` and a name unique to the instance and
the user: the browser sends it to no other URL of 127.0.0.1, whoever listens on the other ports.

The token is in the URL `obd ui` prints (as Jupyter does); the first visit with it sets the
cookie and redirects to the same page without it. Every request needs the cookie or the token;
a request that changes something (stop, cancel) also needs the token in an `X-OBD-Token` header,
which only the page itself can read (from its api/session), and the page's own Origin (or none,
with `Sec-Fetch-Site: same-origin`), so another site cannot make a browser act. A Host header
other than a loopback name is refused (no DNS rebinding); its port is not checked, so through
`ssh -L LOCAL:127.0.0.1:PORT` the page works as it does here.

Any local user can connect to the port, so connections are bounded: each has a read timeout
(`OBD_UI_IDLE_TIMEOUT`, 30 s: one that sends nothing that long is closed) and at most
`OBD_UI_MAX_CONNECTIONS` (64) are open at once, each with its thread. At the cap a new
connection takes the place of the one idle the longest (waiting for its request: a browser
opens a new one when it needs it); when none is idle it is refused with a 503 that says so.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import json
import os
import pwd
import re
import secrets
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.cli.common import EXIT_UNREACHABLE, EXIT_USAGE
from daemon.cli.ui import DEFAULT_PORT
from daemon.cli.ui.feed import RunFeed
from daemon.cli.ui.hub import Hub

STATIC = Path(__file__).with_name("static")
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "[::1]"})
HOST_HEADER = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?")
MAX_STREAMS = 32  # open event streams at once (each holds a connection to the daemon)
IDLE_TIMEOUT = 30.0  # seconds a connection may send nothing before it is closed
MAX_CONNECTIONS = 64  # open connections at once, each with its thread (streams included)
EVICT_WAIT = 2.0  # seconds to wait for an evicted idle connection's thread to end
HEARTBEAT = 15.0
PORT_TRIES = 20
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
ERRORS = {"usage": 400, "denied": 403, "not_found": 404, "state": 409, "unavailable": 503}
COOKIE_MAX_AGE = 2592000  # 30 days; the cookie is useless once its `obd ui` has stopped anyway
NOT_HERE = (
    "no such page: obd ui serves only under the address it printed "
    "(http://127.0.0.1:PORT/PREFIX/?token=...); open that address, or run `obd ui` again for a new one."
)
NEEDS_TOKEN = (
    "obd ui needs its token: open the address `obd ui` printed (http://127.0.0.1:PORT/PREFIX/?token=...), "
    "or run `obd ui` again for a new one."
)


class Limits:
    """How many connections the view holds at once and how long one may stay silent.

    From `OBD_UI_MAX_CONNECTIONS` and `OBD_UI_IDLE_TIMEOUT` (seconds) when set, else the defaults.
    """

    def __init__(self, connections: int = MAX_CONNECTIONS, idle_timeout: float = IDLE_TIMEOUT) -> None:
        if connections < MAX_STREAMS // 4 or idle_timeout <= 0:
            raise ValueError(f"at least {MAX_STREAMS // 4} connections and a timeout above 0 s")
        self.connections = connections
        self.idle_timeout = idle_timeout

    @classmethod
    def from_environ(cls) -> Limits:
        """The limits this environment asks for; a bad value raises ValueError naming the variable."""
        connections, idle = os.environ.get("OBD_UI_MAX_CONNECTIONS"), os.environ.get("OBD_UI_IDLE_TIMEOUT")
        try:
            return cls(
                int(connections) if connections else MAX_CONNECTIONS,
                float(idle) if idle else IDLE_TIMEOUT,
            )
        except ValueError as exc:
            raise ValueError(
                f"OBD_UI_MAX_CONNECTIONS={connections or ''} OBD_UI_IDLE_TIMEOUT={idle or ''}: "
                f"need a whole number of connections and seconds ({exc}); unset them for the defaults "
                f"({MAX_CONNECTIONS} and {IDLE_TIMEOUT:g})"
            ) from None


class UiServer(http.server.ThreadingHTTPServer):
    """The web view's server: what every request handler shares, and the bound on its connections.

    Every open connection is in `open` (with its thread): the time it began waiting for a
    request, or None while a request is read or answered (an event stream included). At the
    cap the longest idle one is shut, so its thread ends, and the new one takes its place.
    """

    daemon_threads = True
    block_on_close = False  # open event streams never hold up the exit
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], socket_path: Path, token: str, limits: Limits | None = None) -> None:
        self.limits = limits or Limits()
        self.open: dict[socket.socket, float | None] = {}
        self.threads: dict[socket.socket, threading.Thread] = {}
        self.slots = threading.Condition()
        super().__init__(address, Handler)
        self.socket_path = socket_path
        self.token = token
        self.hub = Hub(socket_path)
        self.streams = threading.BoundedSemaphore(MAX_STREAMS)
        # The secret first path segment everything is served under, and the cookie's name:
        # the browser sends the cookie only below `/<prefix>/`, which no other server knows.
        self.prefix = secrets.token_urlsafe(18)
        self.cookie = f"obd_ui_{os.getuid()}_{secrets.token_hex(6)}"
        self.user = _user_name(os.getuid())

    @property
    def root(self) -> str:
        """The path of the page, `/<prefix>/`: also the cookie's Path."""
        return f"/{self.prefix}/"

    def login_url(self) -> str:
        """The address `obd ui` prints: the page, with the token that sets the cookie."""
        return f"http://127.0.0.1:{self.server_address[1]}{self.root}?token={self.token}"

    # --- the bound on connections --------------------------------------------------------

    def process_request(self, request: Any, client_address: Any) -> None:
        """A thread for the new connection when there is room (made by evicting an idle one), else a 503."""
        if not self._admit(request):
            self._turn_away(request)
            return
        thread = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        with self.slots:
            self.threads[request] = thread
        thread.start()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.slots:
                self.open.pop(request, None)
                self.threads.pop(request, None)
                self.slots.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Quiet for a connection the browser (or an eviction) closed; a traceback otherwise."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)

    def waiting(self, connection: socket.socket, idle: bool) -> None:
        """Mark `connection` idle (waiting for a request: it may be evicted) or busy.

        An idle connection keeps the time it became idle (its accept, or its last answer), so the
        longest idle is the one evicted however late its thread started.
        """
        with self.slots:
            if connection not in self.open:
                return
            if not idle:
                self.open[connection] = None
            elif self.open[connection] is None:
                self.open[connection] = time.monotonic()

    def _admit(self, request: socket.socket) -> bool:
        """Room for `request`: at the cap, the longest idle connection is shut and its thread waited for."""
        with self.slots:
            if len(self.open) >= self.limits.connections:
                victim = self._evict()
                if victim is None:
                    return False
            else:
                victim = None
        if victim is not None:
            victim.join(EVICT_WAIT)  # its recv sees EOF at once; its thread ends before a new one starts
        with self.slots:
            if len(self.open) >= self.limits.connections:
                return False
            self.open[request] = time.monotonic()
            return True

    def _evict(self) -> threading.Thread | None:
        """Shut the longest idle connection (the caller holds `slots`); its thread, or None when none is idle."""
        idle = [(since, conn) for conn, since in self.open.items() if since is not None]
        if not idle:
            return None
        _, oldest = min(idle, key=lambda pair: pair[0])
        self.open[oldest] = None  # never chosen twice
        with contextlib.suppress(OSError):
            oldest.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
        return self.threads.get(oldest)

    def _turn_away(self, request: socket.socket) -> None:
        """A 503 that says why, written without waiting (the accepting thread must not block), then close."""
        body = (
            f"obd ui has its {self.limits.connections} connections busy (open pages and their live updates): "
            "close some of its tabs and reload, or raise OBD_UI_MAX_CONNECTIONS for the next `obd ui`\n"
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 5\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            request.setblocking(False)
            request.send(head + body)
        except OSError:
            pass
        self.shutdown_request(request)


class Handler(http.server.BaseHTTPRequestHandler):
    server: UiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: an access log would print the token of the first visit."""

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.idle_timeout)  # a read (or write) that long closes it

    def handle_one_request(self) -> None:
        self.server.waiting(self.connection, idle=True)  # until its request line and headers are in
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.waiting(self.connection, idle=False)
        return ok

    # --- dispatch ------------------------------------------------------------------------

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self._host_ok():
            return self._refuse(HTTPStatus.FORBIDDEN, "obd ui answers only to 127.0.0.1 or localhost")
        path = self._inner_path(url.path)
        if path is None:
            return self._refuse(HTTPStatus.NOT_FOUND, NOT_HERE)
        if not path:
            # `/<prefix>` without its slash: the cookie's Path needs the slash.
            return self._redirect(self.server.root + (f"?{url.query}" if url.query else ""))
        query = parse_qs(url.query)
        given = (query.get("token") or [""])[0]
        if given and self._token_ok(given):
            # Remember the token in a cookie and drop it from the address bar.
            return self._redirect(url.path, self._cookie_header(given))
        if not self._token_ok(self._cookie_token()):
            return self._refuse(HTTPStatus.FORBIDDEN, NEEDS_TOKEN)
        if path.startswith("/api/") and not self._fetch_site_ok():
            return self._refuse(HTTPStatus.FORBIDDEN, "obd ui's API answers only to its own page")
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
        if not self._host_ok():
            return self._refuse(HTTPStatus.FORBIDDEN, "obd ui answers only to 127.0.0.1 or localhost")
        path = self._inner_path(urlsplit(self.path).path)
        if not path:
            return self._refuse(HTTPStatus.NOT_FOUND, NOT_HERE)
        if not self._origin_ok():
            return self._refuse(
                HTTPStatus.FORBIDDEN,
                "obd ui acts only for its own page: use the page's buttons, or `obd train stop` / `obd train cancel`",
            )
        if not self._token_ok(self.headers.get("X-OBD-Token", "")):
            return self._refuse(HTTPStatus.FORBIDDEN, "a request that acts on a run needs the X-OBD-Token header")
        self._drain_body()
        parts = path.split("/")
        if len(parts) == 5 and parts[:3] == ["", "api", "runs"] and parts[4] in ("stop", "cancel"):
            params = {"reason": "requested", "via": "ui"} if parts[4] == "stop" else {}
            return self._call(parts[4], id=parts[3], **params)
        return self._refuse(HTTPStatus.NOT_FOUND, "no such action")

    # --- checks --------------------------------------------------------------------------

    def _host_ok(self) -> bool:
        """A loopback name in Host, so a page of another site reaching us by DNS rebinding is refused.

        The port is not checked: a browser names the port it connected to, which through
        `ssh -L LOCAL:127.0.0.1:PORT` is the laptop's LOCAL, and a browser never sends a request
        for one port to another, so checking it would stop nothing but that tunnel.
        """
        match = HOST_HEADER.fullmatch(self.headers.get("Host", ""))
        return match is not None and match.group(1).lower() in LOOPBACK_HOSTS

    def _inner_path(self, path: str) -> str | None:
        """The path below `/<prefix>` ("" for the prefix alone), or None when it is not this view's."""
        head, slash, rest = path.removeprefix("/").partition("/")
        if not path.startswith("/") or not hmac.compare_digest(head.encode(), self.server.prefix.encode()):
            return None
        return slash + rest

    def _fetch_site_ok(self) -> bool:
        """False for a browser's request made by another site's page (the other ports of 127.0.0.1 too)."""
        return self.headers.get("Sec-Fetch-Site") in (None, "same-origin", "none")

    def _origin_ok(self) -> bool:
        """A request that acts comes from this page: its Origin is ours, or it has none and is same-origin.

        A browser sends Origin with every cross-origin POST and `Sec-Fetch-Site` with every request,
        so a request with neither is refused too: the command line acts on runs, not this server.
        """
        origin = self.headers.get("Origin")
        site = self.headers.get("Sec-Fetch-Site")
        if site is not None and site != "same-origin":
            return False
        if origin is None:
            return site == "same-origin"
        parts = urlsplit(origin)
        return parts.scheme == "http" and parts.netloc.lower() == self.headers.get("Host", "").lower()

    def _token_ok(self, given: str) -> bool:
        return bool(given) and hmac.compare_digest(given.encode(), self.server.token.encode())

    def _cookie_token(self) -> str:
        for part in self.headers.get("Cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == self.server.cookie:
                return value
        return ""

    def _cookie_header(self, token: str) -> str:
        """The cookie that holds the token: sent back only below this view's secret prefix."""
        return (
            f"{self.server.cookie}={token}; Path={self.server.root}; HttpOnly; SameSite=Strict; "
            f"Max-Age={COOKIE_MAX_AGE}"
        )

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

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        """303 to `location` (a path of this view), setting `cookie` when given."""
        self.send_response(HTTPStatus.SEE_OTHER)
        if cookie is not None:
            self.send_header("Set-Cookie", cookie)
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

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


def bind(socket_path: Path, port: int | None, token: str, limits: Limits | None = None) -> UiServer:
    """The server on 127.0.0.1: on `port`, or the first free one from 8765 when none was asked for."""
    if port is not None:
        return UiServer(("127.0.0.1", port), socket_path, token, limits)
    for candidate in range(DEFAULT_PORT, DEFAULT_PORT + PORT_TRIES):
        try:
            return UiServer(("127.0.0.1", candidate), socket_path, token, limits)
        except OSError:
            continue
    return UiServer(("127.0.0.1", 0), socket_path, token, limits)


def serve(socket_path: Path, port: int | None) -> int:
    """`obd ui`: check the daemon answers, serve until Ctrl-C or SIGTERM, print where to look."""
    try:
        limits = Limits.from_environ()
    except ValueError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
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
        server = bind(socket_path, port, token, limits)
    except OSError as exc:
        print(
            f"obd: cannot serve on 127.0.0.1:{port} ({exc.strerror or exc}); pick another port with --port",
            file=sys.stderr,
        )
        return EXIT_USAGE
    bound = server.server_address[1]
    server.hub.start()
    print(f"obd ui: serving the runs of {server.user} on {server.login_url()}")
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
