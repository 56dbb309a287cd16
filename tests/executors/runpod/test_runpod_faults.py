"""No sequence of API faults leaves a pod obd does not know about.

"Knows about" means: the pod's name was saved (through `save`, which the daemon persists) before
any create call, and after `create` returns or raises, every pod still alive is either the pod
id of the last saved record, or carries the run's name and owner tag so that `reconcile` reports
it as an orphan the moment the daemon looks.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.service.config import RunpodTarget
from executors.base import ExecutorError
from executors.runpod import PodInfo, RunpodDriver
from tests.executors.runpod.conftest import Saves, fast_api
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

KINDS = ["429", "500", "502", "503", "nodata", "drop", "drop_before", "timeout"]
OPS = ["podFindAndDeployOnDemand", "myself", "pod", "gpuTypes", "podTerminate", None]
RTX, A40 = "NVIDIA GeForce RTX 4090", "NVIDIA A40"


def scenario(pod_sshd: SshServer, faults: list[tuple[str, str | None, int]], *, capacity: int = 10,
             ssh_ready: bool = True, run_id: str = "r1") -> tuple[FakeRunpod, Saves, RunpodDriver, Any]:  # fmt: skip
    """Run one create under `faults`; return the fake, the saves, the driver and the outcome."""
    fake = FakeRunpod().start()
    old = {k: os.environ.get(k) for k in ("RUNPOD_API_BASE_URL", "RUNPOD_API_KEY")}
    os.environ["RUNPOD_API_BASE_URL"], os.environ["RUNPOD_API_KEY"] = fake.url, "test-key"
    fake.ssh_endpoint = (pod_sshd.host, pod_sshd.port) if ssh_ready else None
    fake.set_capacity(RTX, capacity)
    for kind, op, times in faults:
        fake.inject(kind, op=op, times=times, delay=0.5)
    state = Path(tempfile.mkdtemp(prefix="obd-faults-"))
    target = RunpodTarget(kind="runpod", gpu_type=[RTX, A40], identity_file=pod_sshd.identity_file,
                          workdir=str(state / "pod"), python=sys.executable, boot_grace=0.4)  # fmt: skip
    driver = RunpodDriver("pods", target, state, api=fast_api(call_timeout=0.25, retries=2), ssh_user=pod_sshd.user,
                          poll_interval=0.05, settle=0.02, create_retries=2, ssh_probe_timeout=1.0)  # fmt: skip
    saves = Saves(fake)

    async def run() -> Any:
        try:
            return await driver.create(run_id, saves)
        except ExecutorError as exc:
            return exc

    try:
        outcome = anyio.run(run)
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return fake, saves, driver, outcome


def check_no_unknown_pod(fake: FakeRunpod, saves: Saves, driver: RunpodDriver, outcome: Any) -> None:
    everything = fake.live_pods() + list(fake.terminated.values())
    if everything:
        assert saves.records, "a pod exists but nothing was saved"
        assert saves.pods_at_save[0] == set(), "the name was saved only after a pod existed"
    for pod in everything:
        assert pod["name"] in saves.names()
        assert f"OBD_OWNER={driver.owner}" in pod["env"]
    live = {p["id"] for p in fake.live_pods()}
    if isinstance(outcome, PodInfo):
        assert live == {outcome.pod_id} and saves.last.pod_id == outcome.pod_id
        return
    last_id = saves.last.pod_id if saves.records else None
    if live <= ({last_id} - {None}):
        return
    # The API failed too hard to tell: the daemon's reconcile (once the API answers) reports them all.
    fake.clear_faults()
    os.environ["RUNPOD_API_BASE_URL"], os.environ["RUNPOD_API_KEY"] = fake.url, "test-key"
    try:
        found = anyio.run(driver.reconcile, {})
    finally:
        os.environ.pop("RUNPOD_API_BASE_URL", None)
    assert {f.pod_id for f in found if f.kind == "orphan"} >= live


fault_lists = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(OPS), st.integers(1, 3)), max_size=4)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(faults=fault_lists, capacity=st.sampled_from([0, 10]), ssh_ready=st.booleans())
def test_no_sequence_of_api_faults_leaves_a_pod_obd_does_not_know_about(
    pod_sshd: SshServer, faults, capacity, ssh_ready
) -> None:
    fake, saves, driver, outcome = scenario(pod_sshd, faults, capacity=capacity, ssh_ready=ssh_ready)
    try:
        check_no_unknown_pod(fake, saves, driver, outcome)
        if not ssh_ready and isinstance(outcome, Exception):
            live = {p["id"] for p in fake.live_pods()}
            assert not live or saves.last.phase in ("terminate_failed", "create_failed")
    finally:
        fake.stop()
        shutil.rmtree(driver.state_dir, ignore_errors=True)


EXPLICIT = {
    "a create that times out, then a list that fails": [
        ("timeout", "podFindAndDeployOnDemand", 1),
        ("503", "myself", 2),
    ],
    "a create dropped after it ran, twice": [("drop", "podFindAndDeployOnDemand", 2)],
    "every list fails after an ambiguous create": [("drop", "podFindAndDeployOnDemand", 1), ("502", "myself", 20)],
    "the terminate of a pod that never booted fails": [("500", "podTerminate", 20)],
    "the pod query fails while booting": [("429", "pod", 3)],
    "the GPU price cannot be read": [("502", "gpuTypes", 20)],
}


@pytest.mark.parametrize("faults", list(EXPLICIT.values()), ids=list(EXPLICIT))
@pytest.mark.parametrize("ssh_ready", [True, False], ids=["ssh ready", "ssh never ready"])
def test_each_listed_fault_sequence_leaves_no_unknown_pod(pod_sshd: SshServer, faults, ssh_ready: bool) -> None:
    fake, saves, driver, outcome = scenario(pod_sshd, faults, ssh_ready=ssh_ready)
    try:
        check_no_unknown_pod(fake, saves, driver, outcome)
        assert len(fake.live_pods()) <= 1
    finally:
        fake.stop()
        shutil.rmtree(driver.state_dir, ignore_errors=True)
