"""Fixtures for the SSH executor tests: a real sshd on loopback and executors pointed at it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `sshd`

from sshd import SshServer, sshd_skip_reason  # noqa: E402

from daemon.config import SshTarget  # noqa: E402
from executors.ssh import SshExecutor  # noqa: E402

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


def make_target(server: SshServer, workdir: Path | str, **overrides: object) -> SshTarget:
    """An SshTarget for `server` with short timeouts, as a test wants them."""
    fields: dict[str, object] = {
        "kind": "ssh",
        "workdir": str(workdir),
        "connect_timeout": 5,
        "keepalive": 5,
        "python": sys.executable,
        **server.target_fields(),
    }
    fields.update(overrides)
    return SshTarget.model_validate(fields)


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
