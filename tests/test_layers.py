"""The layer contracts of pyproject.toml hold, and `lint-imports` breaks on a violation."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")
PACKAGES = ("daemon", "executors", "trainer_plugin", "runner", "workloads")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is in the test extra (scripts/setup.sh)")


def _copy(tmp: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(REPO / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__", "*.json", "static"))
    shutil.copy(REPO / "pyproject.toml", tmp / "pyproject.toml")
    return tmp


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
    )


def test_the_layer_contracts_hold_and_a_broken_one_is_reported(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    kept = _lint(root)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    contract = root / "trainer_plugin" / "rundir.py"
    contract.write_text(contract.read_text() + "\nfrom daemon import service as _service  # a layer broken\n")
    broken = _lint(root)
    assert broken.returncode != 0
    assert "BROKEN" in broken.stdout and "trainer_plugin.rundir -> daemon.service" in broken.stdout


def test_the_client_importing_the_service_is_reported(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    render = root / "daemon" / "cli" / "render.py"
    render.write_text(render.read_text() + "\nfrom daemon.follow import Follower  # the service in the client\n")
    broken = _lint(root)
    assert broken.returncode != 0 and "daemon.cli.render -> daemon.follow" in broken.stdout
