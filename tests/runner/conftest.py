"""Shared fixtures of the runner tests: the fixture-file directory and the numbers it encodes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy a fixture directory into tmp_path (tests that alter files never touch the originals)."""

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURES / name, target)
        return target

    return copy
