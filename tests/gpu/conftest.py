"""The GPU checks: every test here is marked `gpu` and skipped, with the reason, where no CUDA/ROCm device is.

The default suite deselects them (`-m 'not slow and not gpu and not bench'`); `pytest -m gpu
tests/gpu` selects them, and on a machine without a device each one reports SKIPPED with what the
probe found (torch's view and the vendors' tools). `scripts/gpu_check.sh` runs them on a GPU machine.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gpu import harness

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test under tests/gpu `gpu`, so no default run selects one by accident."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session", autouse=True)
def _needs_a_gpu() -> None:
    """Skip every test here, saying why, where there is no device to check on.

    Session-scoped, so it comes before any module's fixture starts a daemon or a training run.
    """
    reason = harness.skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def probe() -> harness.Probe:
    return harness.probe()


@pytest.fixture(scope="module")
def gpu_daemon() -> Iterator[Any]:
    """One daemon on this machine's GPUs for a test module (its runs share it, one after another)."""
    reason = harness.skip_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="obd-gpu-", dir="/tmp"))
    try:
        with harness.gpu_daemon(root) as daemon:
            yield daemon
    finally:
        shutil.rmtree(root, ignore_errors=True)
