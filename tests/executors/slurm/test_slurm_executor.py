"""The Slurm executor on its own, against the real test cluster: one squeue per probe, one job per
run however often it is submitted, an idempotent cancel, and a login node reached over SSH."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from executors.base import JobSpec, JobState
from executors.config import SlurmTarget
from executors.slurm import SlurmExecutor
from tests.conftest import REPO
from tests.executors.slurm.cluster import Cluster
from tests.sshd import SshServer, sshd_skip_reason

PLUGIN = REPO / "trainer_plugin"


@pytest.fixture
def cluster_env(slurm_cluster: Cluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """SLURM_CONF for the executor's commands, and a squeue first on PATH that counts its calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "squeue.calls"
    squeue = bin_dir / "squeue"
    squeue.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {shutil.which("squeue")} "$@"\n')
    squeue.chmod(0o755)
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    yield calls
    slurm_cluster.run("scancel", "--user=root", check=False)


def make(workdir: Path, **keys: object) -> SlurmExecutor:
    target = SlurmTarget.model_validate({"kind": "slurm", "workdir": str(workdir), "venv": sys.prefix, **keys})
    return SlurmExecutor("hpc", target, settle=0)


async def spec(executor: SlurmExecutor, run_id: str, *command: str) -> JobSpec:
    rd = f"{(await executor.resolve_workdir()).rstrip('/')}/{run_id}"
    await executor.upload(PLUGIN, f"{rd}/plugin/trainer_plugin")
    return JobSpec(run_id=run_id, remote_dir=rd, command=list(command), env={"OBD_RUN_ID": run_id})


async def wait_state(executor: SlurmExecutor, job: JobSpec, handle: object, *states: JobState) -> JobState:
    with anyio.fail_after(60):
        while True:
            state = (await executor.status(handle, job.remote_dir)).state  # type: ignore[arg-type]
            if state in states:
                return state
            await anyio.sleep(0.2)


async def test_a_probe_of_many_runs_asks_squeue_once(cluster_env: Path, tmp_path: Path) -> None:
    executor = make(tmp_path / "work")
    jobs = [await spec(executor, f"run-{i}", "sleep", "30") for i in range(4)]
    handles = [await executor.spawn(j) for j in jobs]
    cluster_env.unlink()  # the submits' own look-ups are not a poll
    probes = await executor.probe([(h, j.remote_dir) for h, j in zip(handles, jobs, strict=True)])
    assert len(cluster_env.read_text().splitlines()) == 1
    assert {p.status.state for p in probes} <= {JobState.pending, JobState.running}
    assert [p.handle["pid"] for p in probes if p.handle] == [h.pid for h in handles]
    await executor.aclose()


async def test_a_second_submit_of_a_run_finds_its_job_instead_of_making_another(
    cluster_env: Path, slurm_cluster: Cluster, tmp_path: Path
) -> None:
    executor = make(tmp_path / "work")
    job = await spec(executor, "twice", "sleep", "30")
    first = await executor.spawn(job)
    assert (await executor.spawn(job)).pid == first.pid
    # A submit whose helper died before it wrote the job id: the job is found by its name.
    record = Path(job.remote_dir) / "slurm.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "job_id": None}))
    assert (await executor.spawn(job)).pid == first.pid
    assert [j["id"] for j in slurm_cluster.jobs() if j["name"] == "obd-twice"] == [str(first.pid)]
    await executor.aclose()


async def test_a_cancel_ends_the_job_once_and_a_second_cancel_only_reports(cluster_env: Path, tmp_path: Path) -> None:
    executor = make(tmp_path / "work")
    job = await spec(executor, "cancel-me", "sleep", "60")
    handle = await executor.spawn(job)
    await wait_state(executor, job, handle, JobState.running)
    assert (await executor.cancel(handle, job.remote_dir, 2)).state == JobState.cancelled
    assert (Path(job.remote_dir) / "cancelled").exists()
    assert (await executor.cancel(handle, job.remote_dir, 2)).state == JobState.cancelled
    assert (await executor.status(handle, job.remote_dir)).state == JobState.cancelled
    await executor.aclose()


class LoginNode(SshServer):
    """The test sshd as a login node: its sessions know the test cluster (as /etc/slurm would)."""

    def __init__(self, slurm_conf: Path) -> None:
        super().__init__()
        self.slurm_conf = slurm_conf

    def _write_config(self) -> None:
        super()._write_config()
        # sshd takes the first SetEnv line only: the variable joins it.
        text = self.config_path.read_text()
        assert "\nSetEnv " in text
        self.config_path.write_text(text.replace("\nSetEnv ", f"\nSetEnv SLURM_CONF={self.slurm_conf} ", 1))


@pytest.mark.skipif(sshd_skip_reason() is not None, reason=sshd_skip_reason() or "")
async def test_through_a_login_node_over_ssh_a_job_is_submitted_read_and_ends(
    cluster_env: Path, slurm_cluster: Cluster, tmp_path: Path
) -> None:
    with LoginNode(slurm_cluster.conf) as login:
        fields = login.target_fields()
        login_keys = {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()}
        executor = make(tmp_path / "work", login=login_keys)
        reached = await executor.reach()
        assert "(sbatch there)" in reached.where and reached.trust == "matches known_hosts"
        job = await spec(executor, "over-ssh", "sh", "-c", "echo on $SLURMD_NODENAME; exit 5")
        handle = await executor.spawn(job)
        state = await wait_state(executor, job, handle, JobState.exited)
        assert state == JobState.exited
        assert (await executor.status(handle, job.remote_dir)).exit_code == 5
        log = await executor.read_from(f"{job.remote_dir}/job.log", 0, 4096)
        assert b"on n" in log
        await executor.aclose()
