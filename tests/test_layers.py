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
    render.write_text(
        render.read_text() + "\nfrom daemon.service.follow import Follower  # the service in the client\n"
    )
    broken = _lint(root)
    assert broken.returncode != 0 and "daemon.cli.render -> daemon.service.follow" in broken.stdout


def test_the_client_and_the_service_are_apart_by_a_contract_with_no_ignored_import(tmp_path: Path) -> None:
    text = (REPO / "pyproject.toml").read_text()
    apart = text.split('layers = ["cli | service", "common"]', 1)
    assert len(apart) == 2 and 'containers = ["daemon"]' in apart[0].rsplit("[[tool.importlinter.contracts]]", 1)[1]
    assert "ignore_imports" not in apart[1].split("[[tool.importlinter.contracts]]", 1)[0]
    root = _copy(tmp_path)
    wire = root / "daemon" / "common" / "wire.py"
    wire.write_text(
        wire.read_text() + "\nfrom daemon.service import models as _models  # the shared part leaning on one side\n"
    )
    broken = _lint(root)
    assert broken.returncode != 0 and "daemon.common.wire -> daemon.service.models" in broken.stdout


def test_the_client_reaches_the_machinery_only_through_its_one_door() -> None:
    from daemon.cli import machinery

    dynamic = ("import_module(", "__import__(", "importlib.util")
    reaching = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "daemon" / "cli").rglob("*.py"))
        if path.name != "machinery.py" and any(word in path.read_text() for word in dynamic)
    ]
    assert reaching == [], "the client imports obd's machinery through daemon/cli/machinery.py only"
    for name, spec in machinery.ENTRIES.items():
        module = spec.partition(":")[0]
        assert module.startswith(("daemon.service.", "runner.")), name
        assert callable(machinery.entry(name)), name


def test_no_import_circle_is_whitelisted_and_one_brought_back_is_reported(tmp_path: Path) -> None:
    text = (REPO / "pyproject.toml").read_text()
    acyclic = text.split('type = "acyclic_siblings"', 1)[1].split("[[tool.importlinter.contracts]]", 1)[0]
    assert "ignore_imports" not in acyclic
    root = _copy(tmp_path)
    callback = root / "trainer_plugin" / "plugin" / "callback.py"
    callback.write_text(callback.read_text() + "\nfrom . import inject as _inject  # the circle that was\n")
    broken = _lint(root)
    assert broken.returncode != 0 and "No import circle among the modules of a package BROKEN" in broken.stdout


def test_a_tool_importing_the_plugin_is_reported(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    jobctl = root / "trainer_plugin" / "tools" / "jobctl.py"
    jobctl.write_text(jobctl.read_text() + "\nfrom ..plugin import runtime as _runtime  # a room into the other\n")
    broken = _lint(root)
    assert broken.returncode != 0 and "trainer_plugin.tools.jobctl -> trainer_plugin.plugin.runtime" in broken.stdout
