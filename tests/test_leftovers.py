"""The test suite's own end check: a session whose tests leave a process or a `/tmp/obd-*`
directory behind fails, names them, and cleans them up (tests/leftovers.py, tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import leftovers
from tests.conftest import REPO, wait_for

LEAKY = """
import subprocess, sys, tempfile
from pathlib import Path

def test_that_leaves_things_behind():
    left = tempfile.mkdtemp(prefix="obd-", dir="/tmp")
    job = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path({out!r}).write_text(f"{{job.pid}} {{left}}")
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["in-process", "xdist-worker"])
def test_a_session_that_leaves_a_process_or_a_tmp_dir_behind_fails_and_names_them(
    short_tmp: Path, workers: list[str]
) -> None:
    out = short_tmp / "left.txt"
    (short_tmp / "test_leaky.py").write_text(LEAKY.format(out=str(out)))
    env = {k: v for k, v in os.environ.items() if k != leftovers.MARK}  # a session of its own
    env[leftovers.GRACE] = "1"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            *workers,
            str(short_tmp),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    pid_text, left = out.read_text().split()
    pid = int(pid_text)
    try:
        assert run.returncode == 1, run.stdout + run.stderr
        assert "1 passed" in run.stdout  # the test itself passed: the session fails for what it left
        assert f"pid {pid} (started by the tests" in run.stdout and "sleep 600" in run.stdout
        assert f"directory {left}" in run.stdout
        assert not _alive(pid) and not os.path.exists(left)  # cleaned up
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.rmdir(left)


def test_a_session_that_ends_what_it_starts_passes(short_tmp: Path) -> None:
    (short_tmp / "test_tidy.py").write_text(
        "import shutil, subprocess, tempfile\n"
        "def test_tidy():\n"
        "    shutil.rmtree(tempfile.mkdtemp(prefix='obd-', dir='/tmp'))\n"
        "    subprocess.run(['true'], check=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != leftovers.MARK}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", str(short_tmp)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "left these behind" not in run.stdout


def test_a_process_detached_from_a_test_directory_is_ended_before_the_directory_goes(short_tmp: Path) -> None:
    script = short_tmp / "watchdog.py"
    script.write_text("import time\nwhile True:\n    time.sleep(1)\n")
    job = subprocess.Popen([sys.executable, str(script)], start_new_session=True, cwd="/")
    try:
        # Once /proc shows it running the file (a loaded machine can be slow to): what is looked at.
        own = leftovers._ancestors(os.getpid())
        wait_for(lambda: leftovers.processes("", {str(short_tmp)}, own), 30, 0.05, "the detached process in /proc")
        ended = leftovers.end_processes_in(short_tmp)
        assert [p.pid for p in ended] == [job.pid] and "running a file of a test directory" in str(ended[0])
        assert job.wait(30) == -signal.SIGKILL
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
