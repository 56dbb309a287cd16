"""What obd gives sbatch and what Slurm's answers mean, checked without a cluster."""

from __future__ import annotations

import shlex

import pytest
from pydantic import ValidationError

from executors.config import SlurmTarget, slurm_time_seconds
from executors.slurm.script import batch_script, launch_plan, sbatch_arguments
from executors.slurm.states import SlurmJob, end_message, lost_message, parse_sacct, parse_scontrol
from trainer_plugin.tools.slurm_batch import combine, node_command


def target(**keys: object) -> SlurmTarget:
    return SlurmTarget.model_validate({"kind": "slurm", **keys})


def test_sbatch_gets_the_run_s_name_comment_log_nodes_and_the_deadline_signal_then_the_target_s_options() -> None:
    t = target(
        partition="gpu", account="ml", qos="high", time="2", nodes=2, gpus_per_node=4, cpus_per_task=8,
        mem="64G", constraint="h100", signal_margin="60s", sbatch_options=["--exclusive"],
    )  # fmt: skip
    args = sbatch_arguments(t, "20260101-000000-abcdef", "/shared/obd/20260101-000000-abcdef")
    assert args[:2] == ["--job-name=obd-20260101-000000-abcdef", "--comment=20260101-000000-abcdef"]
    for expected in (
        "--output=/shared/obd/20260101-000000-abcdef/job.log",
        "--chdir=/shared/obd/20260101-000000-abcdef",
        "--nodes=2",
        "--partition=gpu",
        "--account=ml",
        "--qos=high",
        "--time=2",
        "--gpus-per-node=4",
        "--cpus-per-task=8",
        "--mem=64G",
        "--constraint=h100",
        "--signal=B:USR1@60",
        "--no-requeue",
    ):
        assert expected in args
    assert args[-1] == "--exclusive"


def test_no_signal_is_asked_for_with_a_zero_margin() -> None:
    assert not any(a.startswith("--signal") for a in sbatch_arguments(target(signal_margin=0), "r", "/w/r"))


def test_the_batch_script_execs_the_wrapper_with_every_word_quoted() -> None:
    text = batch_script("/opt/my venv/bin/python", "/shared/it's here/r1", "r1")
    last = text.strip().splitlines()[-1]
    assert last.startswith("exec ")
    assert shlex.split(last[len("exec ") :]) == [
        "/opt/my venv/bin/python",
        "/shared/it's here/r1/plugin/trainer_plugin/tools/slurm_batch.py",
        "batch",
        "/shared/it's here/r1",
    ]


def test_the_launch_plan_takes_ranks_per_node_from_nproc_per_node_or_gpus() -> None:
    assert launch_plan(target(launcher="torchrun", nodes=2, gpus_per_node=8), "py")["nproc_per_node"] == 8
    assert launch_plan(target(launcher="torchrun", nproc_per_node=2), "py")["nproc_per_node"] == 2
    assert launch_plan(target(time="1-00:00:00"), "py")["time_limit"] == 86400


def test_torchrun_mode_sets_nnodes_nproc_and_the_c10d_rendezvous_on_the_first_node() -> None:
    plan = {"launcher": "torchrun", "nodes": 2, "nproc_per_node": 2, "python": "/venv/bin/python"}
    env = {"OBD_SLURM_RDZV": "10.0.0.1:29400", "SLURM_JOB_ID": "42", "SLURM_NODEID": "1"}
    argv = node_command({"command": ["python", "train.py", "--lr", "1e-4"]}, plan, env, "/shared/r1")
    assert argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400"} <= set(argv)
    assert "--rdzv-conf=is_host=0" in argv and "--rdzv-id=obd-42" in argv
    assert "--log-dir=/shared/r1/torchrun/node-1" in argv  # not a /tmp/torchelastic_* left on the node
    assert argv[-5:] == ["--no-python", "python", "train.py", "--lr", "1e-4"]
    plain = node_command({"command": ["python", "train.py"]}, {**plan, "launcher": "srun"}, env, "/shared/r1")
    assert plain == ["python", "train.py"]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2", 120), ("90:30", 5430), ("01:00:00", 3600), ("1-12", 129600), ("2-00:30", 174600), ("INFINITE", None)],
)
def test_slurm_time_limits_read_as_slurm_reads_them(text: str, seconds: int | None) -> None:
    assert slurm_time_seconds(text) == seconds


def test_a_margin_not_shorter_than_the_time_limit_is_refused_saying_what_to_change() -> None:
    with pytest.raises(ValidationError, match=r"signal_margin \(60s\) is not shorter than the time limit"):
        target(time="1", signal_margin="60s")


def test_sbatch_options_obd_sets_itself_are_refused_naming_the_key_to_use() -> None:
    with pytest.raises(ValidationError, match="--job-name is set by obd"):
        target(sbatch_options=["--job-name=mine"])
    with pytest.raises(ValidationError, match="not a Slurm time limit"):
        target(time="two hours")


@pytest.mark.parametrize("option", ["--uid", "--uid=0", "--gid", "--gid=1000", "--ui=0", "--gi"])
def test_sbatch_options_that_submit_as_another_user_are_refused_saying_obd_submits_as_the_user(option: str) -> None:
    with pytest.raises(ValidationError, match="obd submits each user's job as that user") as caught:
        target(sbatch_options=["--exclusive", option])
    assert "is not allowed" in str(caught.value) and "remove it" in str(caught.value)


def test_sbatch_options_that_only_look_like_uid_or_gid_are_kept() -> None:
    kept = ["--gres=gpu:1", "--gpus=2", "--usage", "--gpu-bind=closest"]
    assert target(sbatch_options=kept).sbatch_options == kept


FACTS = {"exit_code": None, "cancelled": False, "cancelling": False}


def job(state: str, reason: str = "None") -> dict:
    return {"job_id": "7", "name": "obd-r", "state": state, "nodes": "n1", "reason": reason}


def test_a_pending_job_is_pending_with_slurms_reason() -> None:
    assert combine(FACTS, job("PENDING", "Priority"), {}, 0) == {
        "state": "pending",
        "exit_code": None,
        "detail": "Priority",
    }
    assert combine(FACTS, job("PENDING"), {}, 0)["detail"] == "submitted, not scheduled yet"


def test_the_wrappers_exit_code_decides_over_slurms_state() -> None:
    assert combine({**FACTS, "exit_code": 3}, job("RUNNING"), {}, 0)["state"] == "exited"
    assert combine({**FACTS, "exit_code": 0}, job("TIMEOUT"), {}, 0) == {
        "state": "exited",
        "exit_code": 0,
        "detail": None,
    }
    assert combine({**FACTS, "exit_code": 143, "cancelling": True}, job("CANCELLED"), {}, 0)["state"] == "cancelled"


def test_a_job_slurm_ended_without_an_exit_code_is_lost_with_slurms_word_for_it() -> None:
    assert combine(FACTS, job("TIMEOUT"), {}, 0) == {"state": "lost", "exit_code": None, "detail": "TIMEOUT"}
    assert combine(FACTS, job("RUNNING"), {}, 0)["state"] == "running"
    assert combine(FACTS, job("CANCELLED"), {}, 0)["state"] == "cancelled"


def test_a_submit_under_way_is_pending_and_a_forgotten_job_is_lost() -> None:
    assert combine(FACTS, None, {"submitting": 100.0, "job_id": None}, 130.0)["detail"] == "being submitted to Slurm"
    assert combine(FACTS, None, {"submitting": 100.0, "job_id": None}, 1000.0)["state"] == "lost"
    lost = combine(FACTS, None, {"job_id": "9"}, 0)
    assert lost["state"] == "lost" and "Slurm no longer knows job 9" in lost["detail"]


def test_scontrol_and_sacct_answers_are_read() -> None:
    text = "JobId=12 JobName=obd-r UserId=root(0) JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15 NodeList=n[1-2]"
    assert parse_scontrol(text) == SlurmJob(
        job_id="12", state="TIMEOUT", reason="TimeLimit", nodes="n[1-2]", exit_code="0:15", source="scontrol"
    )
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified") is None
    found = parse_sacct("12|CANCELLED by 0|0:15|n1|None\n")
    assert found is not None and found.state == "CANCELLED" and found.nodes == "n1"


def test_slurms_end_states_say_what_happened_and_what_to_do() -> None:
    timeout = end_message(SlurmJob(job_id="5", state="TIMEOUT"), "r1", time_limit="2", signal_margin=60)
    assert "time limit (2 min)" in timeout and "signal_margin (60s)" in timeout and "obd train resume r1" in timeout
    node = end_message(SlurmJob(job_id="5", state="NODE_FAIL", nodes="n2"), "r1", time_limit=None, signal_margin=60)
    assert "(n2)" in node and "--retry N" in node
    oom = end_message(SlurmJob(job_id="5", state="OUT_OF_MEMORY"), "r1", time_limit=None, signal_margin=60)
    assert "`mem`" in oom and "obd train logs r1" in oom
    preempted = end_message(SlurmJob(job_id="5", state="PREEMPTED"), "r1", time_limit=None, signal_margin=60)
    assert "--snapshot-on-sigterm" in preempted
    assert end_message(SlurmJob(job_id="5", state="COMPLETED"), "r1", time_limit=None, signal_margin=60) == ""
    assert lost_message(None, "r1", time_limit=None, signal_margin=60).startswith("lost: Slurm no longer knows")
