"""Fixtures for the SSH executor tests: a real sshd on loopback and executors pointed at it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from executors.ssh import SshExecutor
from tests.executors.ssh.helpers import make_target
from tests.sshd import SshServer, sshd_skip_reason

SKIP = sshd_skip_reason()


@pytest.fixture(scope="session")
def shared_sshd() -> Iterator[SshServer]:
    """One sshd for every test that does not stop, restart or re-key it."""
    if SKIP:
        pytest.skip(SKIP)
    with SshServer() as server:
        yield server


@pytest.fixture
def own_sshd() -> Iterator[SshServer]:
    """An sshd of this test's own, which it may kill, restart or re-key."""
    if SKIP:
        pytest.skip(SKIP)
    with SshServer() as server:
        yield server


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path / "wd"


@pytest.fixture
async def executor(shared_sshd: SshServer, workdir: Path) -> AsyncIterator[SshExecutor]:
    ex = SshExecutor("box", make_target(shared_sshd, workdir))
    try:
        yield ex
    finally:
        await ex.aclose()


@pytest.fixture
async def own_executor(own_sshd: SshServer, workdir: Path) -> AsyncIterator[SshExecutor]:
    ex = SshExecutor("box", make_target(own_sshd, workdir), backoff_base=0.1, backoff_cap=0.5)
    try:
        yield ex
    finally:
        await ex.aclose()
