"""`obd ui` in a real headless Chromium (Debian's, driven with selenium) against a real daemon.

The page must open with the token and nothing without it (nor outside its secret path prefix),
show a run started from the command
line as it starts, draw its loss as it trains, and stop it with a snapshot from the button once
the confirmation is accepted. The root-only test checks that one user's page never shows
another user's runs. Skipped, saying why, where chromium or chromedriver is absent
(`bash scripts/setup_browser.sh` as root installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from tests import users
from tests.conftest import REPO, DaemonProc, wait_for
from tests.users import Box

PY = sys.executable
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if Path("/usr/bin/chromedriver").exists() else None)
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,1100",
)
accounts, box = users.accounts, users.box

# A custom training loop under obd's plugin (trainer_plugin.plugin.loop): a known loss each step,
# a step every DT seconds, a checkpoint and a proof when a snapshot is asked for.
LOOP_JOB = """
import math, os, re, sys, time
from trainer_plugin import loop

max_steps, dt = int(sys.argv[1]), float(sys.argv[2])
start = int(re.search(r"checkpoint-(\\d+)", loop.resume_from()).group(1)) if loop.resume_from() else 0
loop.begin(max_steps=max_steps, start_step=start)
step = start
for step in range(start + 1, max_steps + 1):
    time.sleep(dt)
    loss = 2.0 * math.exp(-step / 60) + 0.4 + 0.05 * math.sin(step / 2)
    loop.log_metrics(step, loss=loss, learning_rate=1e-3, grad_norm=1.0 / step)
    print(f"step {step} loss {loss:.4f}", flush=True)
    reason = loop.snapshot_requested()
    if reason and step < max_steps:
        path = loop.checkpoint_dir(step)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.txt"), "w") as f:
            f.write(str(step))
        loop.write_proof(step, path, reason=reason)
        break
loop.end(step)
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM or not DRIVER:
        pytest.skip("needs Debian's chromium and chromium-driver: run `bash scripts/setup_browser.sh` as root")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="obd-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*CHROME_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(DRIVER))
    driver.implicitly_wait(0)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Ui:
    """One `obd ui` process and the address it printed.

    `url` is that address (it sets the cookie), `origin` the server's `http://127.0.0.1:PORT`, and
    `base` the page's address without its final slash (the origin and the view's secret prefix),
    so `f"{ui.base}/api/runs"` names a path of this view.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+/\S*\?token=\S+", line)
        assert match, f"obd ui printed {line!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"
        self.url = match.group(0)
        parts = urlsplit(self.url)
        assert parts.port is not None, self.url
        self.port, self.token = parts.port, parse_qs(parts.query)["token"][0]
        self.origin = f"http://127.0.0.1:{self.port}"
        self.base = self.origin + parts.path.rstrip("/")

    def login(self) -> str:
        """Visit the printed address as a browser would and return its cookie as `name=value`."""
        parts = urlsplit(self.url)
        connection = HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", f"{parts.path}?{parts.query}")
            reply = connection.getresponse()
            reply.read()
            cookie = reply.getheader("Set-Cookie") or ""
        finally:
            connection.close()
        assert reply.status == 303 and cookie, f"the token address answered {reply.status} {cookie!r}"
        return cookie.split(";", 1)[0]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def ui(daemon: DaemonProc) -> Iterator[Ui]:
    proc = subprocess.Popen(
        [PY, "-m", "daemon.cli", "ui", "--port", "0"],
        env=daemon.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = Ui(proc)
    yield server
    server.close()


def start_loop(d: DaemonProc, steps: int = 2000, dt: float = 0.05, opts: tuple[str, ...] = ()) -> str:
    job = d.root / "loop_job.py"
    job.write_text(LOOP_JOB)
    out = d.cli("train", "start", *opts, "--", PY, str(job), str(steps), str(dt))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def http(url: str, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def by_css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def fresh(read: Any, tries: int = 20) -> Any:
    """`read()` again when the page redrew the element between finding and reading it."""
    from selenium.common.exceptions import StaleElementReferenceException

    for _ in range(tries - 1):
        try:
            return read()
        except StaleElementReferenceException:
            time.sleep(0.02)
    return read()


def text_of(driver: Any, element_id: str) -> str:
    def read() -> str:
        found = by_css(driver, f"#{element_id}")
        return str(found[0].text) if found else ""

    return str(fresh(read))


def enabled(driver: Any, selector: str) -> bool:
    return bool(fresh(lambda: any(b.is_enabled() for b in by_css(driver, selector))))


def click(driver: Any, selector: str) -> None:
    fresh(lambda: by_css(driver, selector)[0].click())


def open_page(driver: Any, ui: Ui, fragment: str = "") -> None:
    """The token address first (it sets the cookie), then the page wanted."""
    driver.get(ui.url)
    wait_for(lambda: text_of(driver, "daemon") == "live", 10, 0.05, "the page to follow the daemon")
    if fragment:
        driver.get(f"{ui.base}/{fragment}")


def curve_points(driver: Any) -> int:
    def read() -> int:
        lines = by_css(driver, "#chart polyline.curve")
        return int(lines[0].get_attribute("data-count") or 0) if lines else 0

    return int(fresh(read))


def screenshot(driver: Any, path: Path) -> Path:
    driver.save_screenshot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("OBD_UI_SCREENSHOT_DIR")  # to look at it, or to refresh docs/ui.png
    if keep:
        shutil.copy(path, Path(keep) / path.name)
    return path


# --- the tests -----------------------------------------------------------------------------


def test_the_page_opens_with_its_token_and_nothing_is_served_without_it(browser: Any, ui: Ui) -> None:
    status, body = http(f"{ui.base}/")
    assert status == 403 and "needs its token" in body and "obd ui" in body
    assert http(f"{ui.base}/api/runs")[0] == 403
    assert http(f"{ui.base}/?token=not-the-token")[0] == 403
    name, _, value = ui.login().partition("=")
    assert value == ui.token
    assert http(f"{ui.base}/static/app.js", headers={"Cookie": f"{name}=guess"})[0] == 403
    # A page of another site that names 127.0.0.1 through its own host name (DNS rebinding).
    assert http(f"{ui.url}", headers={"Host": f"evil.example:{ui.port}"})[0] == 403
    # Outside its secret prefix the server serves nothing, even with the token, and never names it.
    prefix = urlsplit(ui.base).path.strip("/")
    for outside in ("/", f"/?token={ui.token}", "/api/runs", "/static/app.js", f"/{prefix[:-1]}/"):
        status, body = http(f"{ui.origin}{outside}", headers={"Cookie": f"{name}={ui.token}"})
        assert status == 404 and prefix not in body, (outside, status, body)
    # An action needs the token in a header that only the page can read, not only the cookie.
    cookie = {"Cookie": f"{name}={ui.token}"}
    assert http(f"{ui.base}/api/runs/last/stop", "POST", cookie)[0] == 403
    # Through `ssh -L 9999:127.0.0.1:PORT` the browser names localhost and its own port.
    status, body = http(f"{ui.base}/api/runs", headers={**cookie, "Host": "localhost:9999"})
    assert status == 200 and json.loads(body)["error"] is None

    browser.get(f"{ui.base}/")
    assert "needs its token" in browser.find_element("tag name", "body").text
    browser.get(ui.url)
    wait_for(lambda: text_of(browser, "daemon") == "live", 10, 0.05, "the page to follow the daemon")
    assert browser.current_url == f"{ui.base}/"  # the cookie holds the token now
    assert by_css(browser, "#list-view h1")[0].text == "Runs"


def test_a_run_started_from_the_command_line_appears_within_a_second_and_its_curve_grows(
    browser: Any, ui: Ui, daemon: DaemonProc
) -> None:
    open_page(browser, ui)
    rid = start_loop(daemon)
    started = time.monotonic()
    wait_for(lambda: by_css(browser, f'tr[data-run="{rid}"]'), 1.0, 0.02, "the new run's row")
    assert time.monotonic() - started < 1.0

    click(browser, f'tr[data-run="{rid}"]')
    wait_for(lambda: text_of(browser, "run-state") == "running", 10, 0.05, "the run's page")
    first = wait_for(lambda: curve_points(browser), 20, 0.05, "the first points of the curve")
    wait_for(lambda: curve_points(browser) >= first + 10, 20, 0.1, "the curve to grow")
    wait_for(lambda: re.search(r"step \d+ loss", text_of(browser, "log")), 10, 0.1, "the log to follow")
    # The page drew no more than the job logged.
    drawn = curve_points(browser)
    metrics = (Path(daemon.record(rid)["remote_dir"]) / "metrics.jsonl").read_text().splitlines()
    assert drawn <= sum(json.loads(line)["event"] == "log" for line in metrics)
    row_progress = re.search(r"step (\d+)", text_of(browser, "run-progress"))
    assert row_progress and int(row_progress.group(1)) > 0
    daemon.call("cancel", id=rid)


def test_the_stop_button_after_its_confirmation_gives_a_stopped_run_with_a_snapshot(
    browser: Any, ui: Ui, daemon: DaemonProc, tmp_path: Path
) -> None:
    rid = start_loop(daemon, opts=("--name", "sft-demo"))
    open_page(browser, ui, f"#run/{rid}")
    wait_for(lambda: enabled(browser, "#stop-button"), 20, 0.05, "the stop button")
    wait_for(lambda: curve_points(browser) >= 20, 20, 0.1, "some of the curve")

    click(browser, "#stop-button")
    alert = browser.switch_to.alert
    assert "snapshot" in alert.text
    alert.dismiss()  # the confirmation said no: nothing is asked of the run
    assert daemon.record(rid)["stop"]["requested_at"] is None

    click(browser, "#stop-button")
    browser.switch_to.alert.accept()
    record = daemon.wait_state(rid, "stopped", "cancelled", "failed", timeout=30)
    assert record["state"] == "stopped" and record["snapshot"]["checkpoint"].startswith("output/checkpoint-")
    wait_for(lambda: text_of(browser, "run-state") == "stopped", 10, 0.05, "the page to show the stop")
    assert f"at step {record['snapshot']['step']}" in text_of(browser, "run-snapshot")
    wait_for(lambda: by_css(browser, "#chart rect.snapshot"), 5, 0.05, "the snapshot mark on the curve")
    assert "snapshot requested" in text_of(browser, "history") or "snapshot" in text_of(browser, "history")
    assert not enabled(browser, "#stop-button")
    screenshot(browser, tmp_path / "ui-run.png")

    # The run resumed from it continues the same curve, with the resume marked.
    resumed = start_loop(daemon, steps=record["snapshot"]["step"] + 20, dt=0.02, opts=("--resume-from", rid))
    daemon.wait_state(resumed, "succeeded", timeout=60)
    browser.get(f"{ui.base}/#run/{resumed}")
    wait_for(lambda: by_css(browser, "#chart polygon.resume"), 10, 0.05, "the resume mark")
    assert rid in text_of(browser, "chart-note")
    assert curve_points(browser) == record["snapshot"]["step"] + 20
    screenshot(browser, tmp_path / "ui-resumed.png")

    browser.get(f"{ui.base}/")
    wait_for(lambda: by_css(browser, f'tr[data-run="{resumed}"]'), 10, 0.05, "the list")
    screenshot(browser, tmp_path / "ui-list.png")


def test_the_cancel_button_after_its_confirmation_cancels_the_run(browser: Any, ui: Ui, daemon: DaemonProc) -> None:
    rid = start_loop(daemon)
    open_page(browser, ui, f"#run/{rid}")
    wait_for(lambda: enabled(browser, "#cancel-button"), 20, 0.05, "the cancel button")
    click(browser, "#cancel-button")
    alert = browser.switch_to.alert
    assert "without a snapshot" in alert.text
    alert.accept()
    assert daemon.wait_state(rid, "cancelled", timeout=30)["state"] == "cancelled"
    wait_for(lambda: text_of(browser, "run-state") == "cancelled", 10, 0.05, "the page to show the cancel")


@users.needs_root_and_users
def test_a_users_page_never_shows_another_users_runs(browser: Any, box: Box) -> None:
    theirs = box.obd(box.bob, "train", "start", "--name", "bobs-run", "--", "sh", "-c", "echo bob; sleep 60")
    mine = box.obd(box.alice, "train", "start", "--name", "alices-run", "--", "sh", "-c", "echo alice; sleep 60")
    assert theirs.returncode == 0 and mine.returncode == 0, theirs.stderr + mine.stderr
    bob_run, alice_run = theirs.stdout.strip(), mine.stdout.strip()
    ui = Ui(box.popen(box.alice, "ui", "--port", "0"))
    try:
        open_page(browser, ui)
        wait_for(lambda: by_css(browser, f'tr[data-run="{alice_run}"]'), 10, 0.05, "alice's run")
        assert bob_run not in browser.page_source and "bobs-run" not in browser.page_source
        browser.get(f"{ui.base}/#run/{bob_run}")
        wait_for(lambda: "not yours" in text_of(browser, "run-message"), 10, 0.05, "the refusal")
        assert "bob" not in text_of(browser, "log")
        status, body = http(
            f"{ui.base}/api/runs/{bob_run}/stop",
            "POST",
            {"Cookie": ui.login(), "X-OBD-Token": ui.token, "Origin": ui.origin},
        )
        assert status == 403 and "not yours" in body
        assert box.daemon.record(bob_run)["stop"]["requested_at"] is None
    finally:
        ui.close()
        for rid in (bob_run, alice_run):
            box.daemon.call("cancel", id=rid)


EVALUATING_JOB = """
import json, os, time
from trainer_plugin import loop

loop.begin(max_steps=100, start_step=0)
for step in range(1, 6):
    loop.log_metrics(step, loss=1.0 / step, learning_rate=1e-3)
# The contract's phase line (docs/contract.md), as the plugin writes it when an evaluation begins.
with open(os.environ["OBD_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"event": "phase", "time": time.time(), "phase": "evaluating", "step": 5}) + "\\n")
print("evaluating", flush=True)
time.sleep(600)
"""


def test_a_run_s_page_says_where_its_time_goes_and_what_a_stop_costs_now(
    browser: Any, ui: Ui, daemon: DaemonProc
) -> None:
    job = daemon.root / "evaluating_job.py"
    job.write_text(EVALUATING_JOB)
    out = daemon.cli("train", "start", "--", PY, str(job))
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    wait_for(lambda: daemon.record(rid)["progress"].get("phase") == "evaluating", 60, 0.1, "the daemon to see it")
    open_page(browser, ui, f"#run/{rid}")

    def shown() -> str | None:
        text = text_of(browser, "run-progress")
        return text if "evaluating" in text else None

    text = wait_for(shown, 20, 0.05, "the phase on the page")
    assert re.search(r"step \d+/100.*, evaluating, stop ~\d+s", text), text
    daemon.call("cancel", id=rid)
