"""Shared fixtures: a real `obd daemon` process in a throwaway state directory, and its client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import contextlib

from daemon.cli.client import Client, DaemonUnreachable
from tests import leftovers

# Tests split by speed: the `unit` marker and what holds it true (tests/speed.py).
pytest_plugins = ["tests.speed"]

# Every process the tests start inherits this session's mark (see tests/leftovers.py).
_MARKED_HERE = leftovers.mark_session()
# torch's compile cache in /tmp, made by the session's torch imports: removed at its end unless it was there before.
_TORCH_CACHE_BEFORE = os.path.exists(leftovers.torch_cache())

FAST_CONFIG = """
[daemon]
poll_interval = 0.2
remote_poll_interval = 0.5
probe_timeout = 5

[stop]
proof_timeout = "60s"
end_timeout = "30s"
request_poll = 1
cancel_grace = 2
"""


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1, what: str = "") -> Any:
    """Poll until `predicate()` is truthy; fail the test with `what` when it never is."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


class DaemonProc:
    """One `obd daemon` subprocess; can be killed with any signal and started again."""

    def __init__(self, root: Path, config: str = FAST_CONFIG) -> None:
        self.root = root
        self.state_dir = root / "state"
        self.socket = root / "obd.sock"
        self.config_path = root / "config.toml"
        self.config_path.write_text(config)
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        # The terminal's size is the test's to give (pytest-xdist's workers inherit COLUMNS).
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.env = {
            **inherited,
            "OBD_STATE_DIR": str(self.state_dir),
            "OBD_SOCKET": str(self.socket),
            "OBD_CONFIG": str(self.config_path),
            "OBD_NO_SCOPE": "1",
            "PYTHONPATH": str(REPO),
        }

    def write_config(self, text: str) -> None:
        self.config_path.write_text(text)

    def start(
        self,
        extra_env: dict[str, str] | None = None,
        wait: bool = True,
        preexec_fn: Callable[[], None] | None = None,
        log_level: str = "debug",
    ) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "daemon.cli", "daemon", "--log-level", log_level],
                env={**self.env, **(extra_env or {})},
                stdout=log,
                stderr=log,
                cwd=REPO,
                preexec_fn=preexec_fn,  # noqa: PLW1509 - a test's own resource limits, set before exec
            )
        if wait:
            wait_for(self.ready, 20, 0.05, "the daemon to answer")

    def ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
        try:
            c = Client(self.socket, timeout=2)
            c.call("ping")
            c.close()
            return True
        except DaemonUnreachable:
            return False

    def signal(self, sig: int = signal.SIGTERM, wait: bool = True) -> int | None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        if wait:
            return self.proc.wait(15)
        return None

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    def client(self) -> Client:
        return Client(self.socket, timeout=30)

    def call(self, op: str, **params: Any) -> Any:
        c = self.client()
        try:
            return c.call(op, **params)
        finally:
            c.close()

    def cli(
        self, *args: str, timeout: float = 120, input: bytes | None = None, env: dict | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli", *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    def record(self, run_id: str) -> dict[str, Any]:
        return self.call("status", id=run_id)

    def wait_state(self, run_id: str, *states: str, timeout: float = 60) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            r = self.record(run_id)
            return r if r["state"] in states else None

        try:
            return wait_for(check, timeout, 0.1, f"run {run_id} to be {states}")
        except AssertionError:
            raise AssertionError(
                f"run {run_id} is {self.record(run_id)['state']}, not {states}:\n"
                f"{json.dumps(self.record(run_id), indent=1)[-3000:]}\n--- daemon log ---\n{self.log_path.read_text()[-3000:]}"
            ) from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def kill_job_groups(pidfiles: Iterable[Path]) -> None:
    """Tests end with no job left behind: KILL the group of every job.pid whose job still lives."""
    from trainer_plugin.tools import jobctl

    for pidfile in pidfiles:
        handle = jobctl.read_handle(str(pidfile.parent))
        if handle and (jobctl.handle_alive(handle) or jobctl.group_alive(handle)):
            with contextlib.suppress(OSError):
                os.killpg(int(handle["pid"]), signal.SIGKILL)


def kill_leftover_jobs(state_dir: Path) -> None:
    kill_job_groups(state_dir.glob("jobs/*/job.pid"))


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short temporary directory (unix socket paths are limited to 107 bytes), under /tmp or
    OBD_TEST_TMP (a benchmark measured on the disk a state directory will live on)."""
    path = Path(tempfile.mkdtemp(prefix="obd-", dir=leftovers.temporary_base()))
    yield path
    leftovers.end_processes_in(path)  # nothing of the test's runs on from a deleted directory
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon(short_tmp: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(short_tmp)
    d.start()
    yield d
    d.stop()
    kill_leftover_jobs(d.state_dir)


@pytest.fixture
def make_daemon(short_tmp: Path) -> Iterator[Callable[..., DaemonProc]]:
    """A daemon with a config of the test's own, not yet started."""
    made: list[DaemonProc] = []

    def make(config: str = FAST_CONFIG) -> DaemonProc:
        d = DaemonProc(short_tmp, config)
        made.append(d)
        return d

    yield make
    for d in made:
        d.stop()
        kill_leftover_jobs(d.state_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """The controller takes the `/tmp/obd-*` directories an xdist worker made (tests/leftovers.py)."""
    leftovers.MADE.update(getattr(node, "workeroutput", {}).get("obd_tmp_dirs", []))


@pytest.hookimpl(trylast=True)  # in the controller, after pytest-xdist has ended its workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    """Fail the run when its tests left a process running or a `/tmp/obd-*` directory behind
    (both are cleaned up then); an xdist worker hands the directories it made to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["obd_tmp_dirs"] = sorted(leftovers.MADE)
        return
    if not _MARKED_HERE:
        return
    if not _TORCH_CACHE_BEFORE:
        shutil.rmtree(leftovers.torch_cache(), ignore_errors=True)
    report = leftovers.find(leftovers.session_id())
    if report:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        for line in report.lines():
            if reporter is not None:
                reporter.write_line(line, red=True)
            else:
                print(line, file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
