"""Tests split by speed (issue 35, item 6): the unit tests start no process and serve no socket, so
`bash scripts/test.sh --fast` runs them in a minute or two; the rest (a real daemon, sshd, Slurm, a
browser, a Trainer) run in the full suite.

Which tests are unit tests is one list, `tests/unit_tests.txt`, written by a probe run
(`python -m tests.speed --probe`), and held true: a listed test that starts a process or
listens on a socket fails, saying so; a test leaves the list by being taken out of it (or by the
next probe).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
UNIT_LIST = Path(os.environ.get("OBD_UNIT_TESTS") or HERE / "unit_tests.txt")  # another list: its own tests
# Set by the probe run: every test is watched, and what each did goes to this file (one per worker).
PROBE_ENV = "OBD_SPEED_PROBE"


class NotAUnitTest(RuntimeError):
    """A unit test started a process or a server: it belongs to the full suite (take its file out of the list)."""


def unit_tests() -> set[str]:
    if not UNIT_LIST.exists():
        return set()
    lines = (line.strip() for line in UNIT_LIST.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def mark_unit_tests(items: list[pytest.Item]) -> None:
    """Give the `unit` marker to the listed tests (a test renamed since the probe is simply not listed)."""
    listed = unit_tests()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.unit)


class Watch:
    """Refuses (a unit test) or records (the probe) a process start or a listening socket.

    Installed once for the session, around the whole of each test (its fixtures' set-up included:
    a module's sshd started for its first test counts against that test's file).
    """

    def __init__(self) -> None:
        self.refuse = False
        self.seen: list[str] = []

    def saw(self, what: str) -> None:
        self.seen.append(what)
        if self.refuse:
            self.refuse = False  # once: the clean-up of what failed may start processes
            raise NotAUnitTest(
                f"a unit test {what}: take it out of tests/unit_tests.txt (it belongs to the full suite)"
            )

    def install(self) -> None:
        popen_init = subprocess.Popen.__init__
        listen = socket.socket.listen

        def watched_popen(popen: Any, *args: Any, **kwargs: Any) -> None:
            self.saw("started a process")
            popen_init(popen, *args, **kwargs)

        def watched_listen(sock: socket.socket, *args: Any) -> None:
            self.saw("listened on a socket")
            listen(sock, *args)

        subprocess.Popen.__init__ = watched_popen  # type: ignore[method-assign]
        socket.socket.listen = watched_listen  # type: ignore[method-assign]
        for name in ("fork", "posix_spawn", "posix_spawnp"):
            if hasattr(os, name):
                setattr(os, name, self._watched(getattr(os, name), f"called os.{name}"))

    def _watched(self, original: Any, what: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.saw(what)
            return original(*args, **kwargs)

        return call


WATCH = Watch()


def pytest_sessionstart(session: pytest.Session) -> None:
    WATCH.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    probing = os.environ.get(PROBE_ENV)
    WATCH.seen = []
    # The probe refuses too: a test that starts a process is not a unit test, and failing at once
    # keeps the probe short.
    WATCH.refuse = item.get_closest_marker("unit") is not None or bool(probing)
    try:
        yield
    finally:
        WATCH.refuse = False
        if probing:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with open(probing + f".{worker}", "a") as f:
                f.write(f"{item.nodeid}\t{'process' if WATCH.seen else 'none'}\n")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_unit_tests(items)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """In the probe: each test's outcome (a test skipped or failed at set-up has no call)."""
    records = os.environ.get(PROBE_ENV)
    if not records or (report.when != "call" and report.passed):
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(records + f".outcome.{worker}", "a") as f:
        f.write(f"{report.nodeid}\t{report.when}:{report.outcome}\n")


def unit_list_from(records: Path) -> list[str]:
    """The tests that passed in the probe without starting a process or a server."""
    seen: dict[str, set[str]] = {}
    for path in records.parent.glob(records.name + ".*"):
        for line in path.read_text().splitlines():
            nodeid, what = line.split("\t")
            seen.setdefault(nodeid, set()).add(what)
    return sorted(n for n, whats in seen.items() if whats == {"none", "call:passed"})


def probe(argv: list[str]) -> int:
    """Run the default suite watching every test; write tests/unit_tests.txt from what each did."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="obd-speed-") as tmp:
        records = Path(tmp) / "records"
        env = {**os.environ, PROBE_ENV: str(records)}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *argv]
        ran = subprocess.run(command, env=env, cwd=HERE.parent, check=False)
        if not list(Path(tmp).glob("records.*")):
            print(f"the probe ran no test (pytest exited {ran.returncode}); tests/unit_tests.txt is unchanged")
            return 1
        tests = unit_list_from(records)
    header = "# Unit tests: no process, no server (written by `python -m tests.speed --probe`; tests/speed.py)\n"
    UNIT_LIST.write_text(header + "".join(f"{t}\n" for t in tests))
    print(f"{len(tests)} unit tests written to {UNIT_LIST}")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["--probe"]:
        print("usage: python -m tests.speed --probe [pytest arguments]", file=sys.stderr)
        sys.exit(2)
    sys.exit(probe(sys.argv[2:]))
