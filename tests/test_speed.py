"""The fast inner loop's rule (tests/speed.py): a test listed as a unit test that starts a process or
serves a socket fails, saying so, and the unlisted ones run as before."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

TESTS = """
import socket
import subprocess


def test_starts_a_process():
    subprocess.run(["true"], check=True)


def test_serves_a_socket():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()


def test_computes():
    assert sum(range(4)) == 6
"""


def run_listed(tmp_path: Path, listed: list[str]) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    (tmp_path / "unit.txt").write_text("".join(f"test_sample.py::{name}\n" for name in listed))
    env = {**os.environ, "OBD_UNIT_TESTS": str(tmp_path / "unit.txt"), "PYTHONPATH": str(REPO)}
    env.pop("OBD_SPEED_PROBE", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.speed", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_listed_unit_test_that_starts_a_process_or_serves_a_socket_fails_saying_so(tmp_path: Path) -> None:
    result = run_listed(tmp_path, ["test_starts_a_process", "test_serves_a_socket", "test_computes"])
    assert result.returncode == 1, result.stdout
    assert "2 failed, 1 passed" in result.stdout
    assert "a unit test started a process: take it out of tests/unit_tests.txt" in result.stdout
    assert "a unit test listened on a socket" in result.stdout


def test_unlisted_tests_start_processes_as_before(tmp_path: Path) -> None:
    result = run_listed(tmp_path, ["test_computes"])
    assert result.returncode == 0, result.stdout
    assert "3 passed" in result.stdout
