"""Fixtures for the Runpod tests: the loopback fake of the API, a real sshd as the pod, drivers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.service.config import RunpodTarget
from executors.runpod import PodInfo, RunpodDriver
from executors.runpod.api import RunpodApi
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer, running_sshd

API_KEY = "test-key"


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeRunpod]:
    """The fake API, with the SDK pointed at it and the key in RUNPOD_API_KEY."""
    import runpod

    server = FakeRunpod(api_keys=(API_KEY,)).start()
    monkeypatch.setenv("RUNPOD_API_BASE_URL", server.url)
    monkeypatch.setenv("RUNPOD_API_KEY", API_KEY)
    saved = runpod.api_key
    yield server
    server.stop()
    runpod.api_key = saved


@pytest.fixture(scope="session")
def pod_sshd() -> Iterator[SshServer]:
    """One real sshd on loopback standing in for every pod's public port 22."""
    yield from running_sshd()


def fast_api(**kwargs: Any) -> RunpodApi:
    settings = {"call_timeout": 2.0, "retries": 3, "backoff": 0.01, "backoff_max": 0.05}
    settings.update(kwargs)
    return RunpodApi(**settings)


@pytest.fixture
def make_driver(tmp_path: Path, pod_sshd: SshServer, fake: FakeRunpod) -> Iterator[Callable[..., RunpodDriver]]:
    """A driver with short intervals whose pods' SSH is the loopback sshd; kills leftover jobs after."""
    workdir = tmp_path / "pod"
    workdir.mkdir()
    fake.ssh_endpoint = (pod_sshd.host, pod_sshd.port)
    # Each pod's container environment (its /proc/1/environ on Runpod), with the pod's own key.
    fake.container_env_dir = tmp_path / "containers"

    def make(
        *, api: RunpodApi | None = None, state_dir: Path | None = None, name: str = "pods", **target: Any
    ) -> RunpodDriver:
        fields: dict[str, Any] = {
            "kind": "runpod",
            "gpu_type": "NVIDIA GeForce RTX 4090",
            "identity_file": pod_sshd.identity_file,
            "workdir": str(workdir),
            "python": sys.executable,
            "boot_grace": 5.0,
        }
        fields.update(target)
        return RunpodDriver(
            name,
            RunpodTarget(**fields),
            state_dir or tmp_path / "state",
            api=api or fast_api(),
            ssh_user=pod_sshd.user,
            poll_interval=0.05,
            settle=0.05,
            ssh_probe_timeout=2.0,
            watchdog_interval=0.1,
            container_environ=str(fake.container_env_dir / "{pod_id}.environ"),
        )

    yield make
    kill_jobs(workdir)


def kill_jobs(workdir: Path) -> None:
    """KILL every job group (jobs and watchdogs) a test left running under the pod's workdir."""
    from tests.conftest import kill_job_groups

    kill_job_groups(list(workdir.glob("*/job.pid")) + list(workdir.glob("*/watchdog/job.pid")))


class Saves:
    """The `save` callback the daemon passes to `create`: keeps every record, and what the fake
    held at the moment of each save."""

    def __init__(self, fake: FakeRunpod) -> None:
        self.fake = fake
        self.records: list[PodInfo] = []
        self.pods_at_save: list[set[str]] = []

    async def __call__(self, record: PodInfo) -> None:
        self.records.append(record.model_copy())
        self.pods_at_save.append({p["id"] for p in self.fake.live_pods()})

    @property
    def last(self) -> PodInfo:
        return self.records[-1]

    def names(self) -> set[str]:
        return {r.pod_name for r in self.records}

    def ids(self) -> set[str]:
        return {r.pod_id for r in self.records if r.pod_id}


@pytest.fixture
def saves(fake: FakeRunpod) -> Saves:
    return Saves(fake)
