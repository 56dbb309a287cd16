"""What the factory makes of each kind of target, with the daemon's settings passed down, and what it says each kind can do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from executors.base import PodCost
from executors.config import AnyTarget, LocalTarget, RunpodTarget, SlurmTarget, SshTarget
from executors.factory import (
    gpu_inventory,
    is_this_machine,
    make_executor,
    make_scheduler_executor,
    makes_pods,
    pod_cost,
    schedules_jobs,
)
from executors.local import LocalExecutor
from executors.slurm.as_user import Submitter
from executors.ssh import SshExecutor


def test_an_ssh_target_without_pushed_events_is_read_at_the_daemons_remote_poll_interval(tmp_path: Path) -> None:
    target = SshTarget(kind="ssh", host="gpu-box")
    executor = make_executor("box", target, tmp_path, remote_poll=1.5)
    assert isinstance(executor, SshExecutor)
    assert executor.events is not None and executor.events.poll_hint == 1.5
    quiet = make_executor("box", SshTarget(kind="ssh", host="gpu-box", helper=False), tmp_path, remote_poll=1.5)
    assert isinstance(quiet, SshExecutor) and quiet.events is None


def test_a_local_target_without_a_workdir_keeps_its_runs_under_the_state_directory(tmp_path: Path) -> None:
    executor = make_executor("local", LocalTarget(kind="local"), tmp_path)
    assert isinstance(executor, LocalExecutor)
    assert Path(executor.workdir) == tmp_path / "jobs"


# --- what differs by kind, asked of the factory -----------------------------------------------------

SSH = SshTarget(kind="ssh", host="gpu-box")
SLURM = SlurmTarget(kind="slurm", workdir="/scratch/obd")
PODS = RunpodTarget(kind="runpod")
KINDS = [
    # target, this machine, makes pods, schedules jobs
    pytest.param(LocalTarget(kind="local"), True, False, False, id="local"),
    pytest.param(SSH, False, False, False, id="ssh"),
    pytest.param(SLURM, False, False, True, id="slurm"),
    pytest.param(PODS, False, True, False, id="runpod"),
]


@pytest.mark.parametrize(("target", "here", "pods", "scheduled"), KINDS)
def test_each_kind_says_what_it_can_do(target: AnyTarget, here: bool, pods: bool, scheduled: bool) -> None:
    assert (is_this_machine(target), makes_pods(target), schedules_jobs(target)) == (here, pods, scheduled)


@pytest.mark.parametrize("target", [SSH, SLURM, PODS], ids=["ssh", "slurm", "runpod"])
def test_only_this_machine_has_gpus_the_daemon_hands_out(target: AnyTarget) -> None:
    assert gpu_inventory(target) == []


def test_this_machines_gpus_are_the_ones_its_config_gives_when_it_gives_them() -> None:
    given = gpu_inventory(LocalTarget(kind="local", gpus=["0", "2"], gpu_vendor="nvidia"))
    assert [(g.id, g.vendor) for g in given] == [("0", "nvidia"), ("2", "nvidia")]
    assert gpu_inventory(LocalTarget(kind="local", gpus=0)) == []


POD = {"kind": "runpod", "pod_id": "p1", "gpu_type": "H100", "cost_per_hr": 3.6, "started_at": 1000.0}
POD_COSTS = [
    pytest.param(POD, PodCost("p1", "H100", 3.6, 3.6, True), id="a-live-pod-an-hour-in"),
    pytest.param({**POD, "ended": True}, PodCost("p1", "H100", 3.6, 3.6, False), id="an-ended-pod"),
    pytest.param({**POD, "phase": "terminated"}, PodCost("p1", "H100", 3.6, 3.6, False), id="a-pod-that-never-ran"),
    pytest.param({**POD, "cost_per_hr": None}, PodCost("p1", "H100", None, None, True), id="no-rate-yet"),
    pytest.param({**POD, "pod_id": None}, None, id="not-created-yet"),
    pytest.param({}, None, id="a-machine-targets-run"),
    pytest.param({"kind": "somewhere", "pod_id": "p1"}, None, id="another-kinds-record"),
]


@pytest.mark.parametrize(("target_info", "cost"), POD_COSTS)
def test_a_runs_pod_and_its_cost_come_from_its_record(target_info: dict[str, Any], cost: PodCost | None) -> None:
    assert pod_cost(target_info, at=1000.0 + 3600) == cost


def test_a_scheduler_target_gets_an_executor_per_account_from_the_factory(tmp_path: Path) -> None:
    refused = Submitter(refusal="no such user")
    executor = make_scheduler_executor("hpc", SLURM.model_copy(update={"workdir": str(tmp_path)}), refused)
    assert executor.submitter is refused and executor.name == "hpc"
