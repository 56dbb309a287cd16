"""The web view's token stays with its own server (issue 22, item 6).

Browsers keep cookies apart by host and path, not by port: when `obd ui` set its cookie with
`Path=/`, a user who had opened their own view sent its token to every other server on
127.0.0.1, and another user's page on another port could read it and stop their runs. Now each
view serves under a secret path prefix of its own and its cookie's Path is that prefix. The
clients here follow the browsers' rules: `http.cookiejar` (a DefaultCookiePolicy, which follows
Path and ignores the port as browsers do) and Debian's headless Chromium. A catcher, a plain HTTP
server on another port that records every Cookie header it gets, stands for a hostile page.
"""

from __future__ import annotations

import http.cookiejar
import http.server
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests import users
from tests.conftest import REPO, DaemonProc, wait_for
from tests.daemon import test_ui
from tests.daemon.test_ui import PY, Ui, text_of
from tests.users import Box

accounts, box = users.accounts, users.box
browser = test_ui.browser  # headless Chromium, as tests/daemon/test_ui.py drives it
send = test_ui.http  # one request, no cookie jar: (status, body)


class Catcher(http.server.ThreadingHTTPServer):
    """Another user's page on another port of 127.0.0.1: it answers 200 and keeps every Cookie header."""

    daemon_threads = True

    def __init__(self) -> None:
        self.cookies: list[tuple[str, str]] = []
        super().__init__(("127.0.0.1", 0), CatcherHandler)
        self.origin = f"http://127.0.0.1:{self.server_address[1]}"


class CatcherHandler(http.server.BaseHTTPRequestHandler):
    server: Catcher

    def do_GET(self) -> None:
        self.server.cookies.append((self.path, self.headers.get("Cookie", "")))
        body = b"<!doctype html><title>another page</title><p>hello</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet."""


class SentCookies(urllib.request.BaseHandler):
    """Records the Cookie header of every request the opener sends, after the jar has added it."""

    handler_order = 1000  # after HTTPCookieProcessor (500)

    def __init__(self) -> None:
        self.sent: list[tuple[str, str]] = []

    def http_request(self, request: urllib.request.Request) -> urllib.request.Request:
        self.sent.append((request.full_url, str(request.get_header("Cookie") or "")))
        return request


@pytest.fixture
def catcher() -> Iterator[Catcher]:
    server = Catcher()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def start_ui(daemon: DaemonProc) -> Ui:
    """One more `obd ui --port 0` of this daemon's user."""
    proc = subprocess.Popen(
        [PY, "-m", "daemon.cli", "ui", "--port", "0"],
        env=daemon.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return Ui(proc)


def visit(opener: urllib.request.OpenerDirector, url: str) -> int:
    """GET `url` through the cookie-keeping opener; its status (redirects followed)."""
    try:
        with opener.open(url, timeout=10) as reply:
            reply.read()
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code


def assert_token_stays_home(first: Ui, second: Ui, catcher: Catcher) -> None:
    """Log in to both views with one cookie jar; the first's token goes to no other port.

    The requests to the second view's server and to the catcher are those another page could
    make a browser send (any path of their own ports); the second login shows the jar does keep
    and send cookies, so the check cannot pass by the jar sending nothing.
    """
    caught = len(catcher.cookies)
    jar = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy())
    recorder = SentCookies()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar), recorder)
    assert visit(opener, first.url) == 200
    assert [c.value for c in jar] == [first.token]
    assert visit(opener, f"{first.base}/api/runs") == 200  # the cookie alone opens the first view
    assert visit(opener, second.url) == 200
    assert visit(opener, f"{second.base}/api/runs") == 200
    others = [second.origin, catcher.origin]
    for origin in others:
        for path in ("/", "/api/runs", "/api/session", "/static/app.js", "/some/page/"):
            visit(opener, origin + path)

    elsewhere = [(url, cookie) for url, cookie in recorder.sent if not url.startswith(first.origin + "/")]
    assert len(elsewhere) >= 12 and any(second.token in cookie for _, cookie in elsewhere)
    leaked = [url for url, cookie in elsewhere if first.token in cookie]
    assert not leaked, f"the first view's token was sent to {leaked}"
    assert len(catcher.cookies) == caught + 5
    assert not [path for path, cookie in catcher.cookies if first.token in cookie]


def test_a_token_of_one_view_never_reaches_another_views_server(daemon: DaemonProc, catcher: Catcher) -> None:
    first, second = start_ui(daemon), start_ui(daemon)
    try:
        assert first.port != second.port
        assert_token_stays_home(first, second, catcher)
    finally:
        first.close()
        second.close()


@users.needs_root_and_users
def test_a_token_of_one_users_view_never_reaches_another_users_server(box: Box, catcher: Catcher) -> None:
    alices, bobs = Ui(box.popen(box.alice, "ui", "--port", "0")), Ui(box.popen(box.bob, "ui", "--port", "0"))
    try:
        assert_token_stays_home(alices, bobs, catcher)
        assert_token_stays_home(bobs, alices, catcher)
    finally:
        alices.close()
        bobs.close()


def test_a_browser_logged_in_to_one_view_sends_its_cookie_to_no_other_port(
    browser: Any, daemon: DaemonProc, catcher: Catcher
) -> None:
    first, second = start_ui(daemon), start_ui(daemon)
    try:
        for ui in (first, second):
            browser.get(ui.url)
            wait_for(lambda: text_of(browser, "daemon") == "live", 10, 0.05, "the page to follow the daemon")
        for path in ("/", "/api/runs", "/some/page/"):
            browser.get(catcher.origin + path)
        browser.get(f"{second.base}/")
        wait_for(lambda: text_of(browser, "daemon") == "live", 10, 0.05, "the second page again")

        assert [path for path, _ in catcher.cookies if path != "/favicon.ico"] == ["/", "/api/runs", "/some/page/"]
        assert not [path for path, cookie in catcher.cookies if first.token in cookie]

        def sent_to(url: str) -> list[str]:
            """The values of the cookies Chromium would send with a request for `url`."""
            found = browser.execute_cdp_cmd("Network.getCookies", {"urls": [url]})
            return [str(c["value"]) for c in found["cookies"]]

        assert sent_to(f"{first.base}/api/runs") == [first.token]
        assert sent_to(f"{second.base}/api/runs") == [second.token]
        for url in (f"{second.origin}/", f"{second.origin}/api/runs", f"{catcher.origin}/"):
            assert first.token not in sent_to(url), url
    finally:
        first.close()
        second.close()


def test_a_request_with_a_wrong_host_or_a_foreign_origin_is_refused(daemon: DaemonProc) -> None:
    runs = []
    for _ in range(2):
        out = daemon.cli("train", "start", "--", "sleep", "60")
        assert out.returncode == 0, out.stderr
        runs.append(daemon.wait_state(out.stdout.strip(), "running", timeout=30)["id"])
    ui = start_ui(daemon)
    try:
        cookie = ui.login()
        with_cookie = {"Cookie": cookie}
        # Host: a loopback name only (any port: `ssh -L 9999:127.0.0.1:PORT` names the laptop's).
        for host in (f"evil.example:{ui.port}", f"127.0.0.1.evil.example:{ui.port}", "", f"localhost:{ui.port}:1"):
            status, body = send(f"{ui.base}/api/runs", headers={**with_cookie, "Host": host})
            assert status == 403 and "127.0.0.1 or localhost" in body, host
        assert send(f"{ui.base}/api/runs", headers={**with_cookie, "Host": "localhost:9999"})[0] == 200
        # The API (the token is in api/session) answers no page of another site or port.
        for site in ("same-site", "cross-site"):
            status, body = send(f"{ui.base}/api/session", headers={**with_cookie, "Sec-Fetch-Site": site})
            assert status == 403 and ui.token not in body, site
        assert send(f"{ui.base}/api/session", headers={**with_cookie, "Sec-Fetch-Site": "same-origin"})[0] == 200

        # An action: the page's own Origin, or none with Sec-Fetch-Site: same-origin; nothing else.
        act = {**with_cookie, "X-OBD-Token": ui.token}
        cancel = f"{ui.base}/api/runs/{runs[0]}/cancel"
        foreign: list[dict[str, str]] = [
            {"Origin": f"http://127.0.0.1:{ui.port + 1}"},
            {"Origin": "http://evil.example"},
            {"Origin": f"https://127.0.0.1:{ui.port}"},
            {"Origin": "null"},
            {},  # neither Origin nor Sec-Fetch-Site: not the page
            {"Sec-Fetch-Site": "same-site"},
            {"Origin": ui.origin, "Sec-Fetch-Site": "cross-site"},
            {"Origin": ui.origin, "Host": f"evil.example:{ui.port}"},
        ]
        for headers in foreign:
            status, body = send(cancel, "POST", {**act, **headers})
            assert status == 403 and "obd ui" in body, headers
        assert all(daemon.record(rid)["state"] == "running" for rid in runs)

        assert send(cancel, "POST", {**act, "Origin": ui.origin})[0] == 200
        assert send(f"{ui.base}/api/runs/{runs[1]}/cancel", "POST", {**act, "Sec-Fetch-Site": "same-origin"})[0] == 200
        for rid in runs:
            daemon.wait_state(rid, "cancelled", timeout=30)
    finally:
        ui.close()
