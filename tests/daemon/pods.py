"""A Runpod target for daemon tests: a loopback fake of the API whose pods are a real sshd.

`pod_sshd` and `fake` are fixtures (import them into a test module); `make_pods_daemon` starts
a daemon with a `pods` target on them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, DaemonProc
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer, running_sshd

PY = sys.executable
KEY = "pod-test-key"


@pytest.fixture
def pod_sshd() -> Iterator[SshServer]:
    yield from running_sshd()


@pytest.fixture
def fake(pod_sshd: SshServer) -> Iterator[FakeRunpod]:
    server = FakeRunpod(api_keys=(KEY,)).start()
    server.ssh_endpoint = (pod_sshd.host, pod_sshd.port)
    yield server
    server.stop()


def make_pods_daemon(
    make_daemon,
    fake: FakeRunpod,
    sshd: SshServer,
    root: Path,
    extra: str = "",
    boot_grace: float = 20,
    api_poll_interval: float = 0.2,
    workdir: Path | None = None,
) -> DaemonProc:
    if workdir is None:
        workdir = root / "pod"
        workdir.mkdir(exist_ok=True)
    config = FAST_CONFIG + (
        f'\n[targets.pods]\nkind = "runpod"\ngpu_type = ["NVIDIA GeForce RTX 4090"]\n'
        f'identity_file = "{sshd.identity_file}"\nssh_user = "{sshd.user}"\nworkdir = "{workdir}"\n'
        f'python = "{PY}"\nboot_grace = {boot_grace}\napi_poll_interval = {api_poll_interval}\n'
        f"watchdog_interval = 0.5\n{extra}"
    )
    d = make_daemon(config)
    d.env.update(RUNPOD_API_BASE_URL=fake.url, RUNPOD_API_KEY=KEY)
    d.start()
    return d
