"""Slurm targets under the real daemon, against a real cluster (munge, slurmctld, two slurmd).

Every line of issue 16's "Done when" is one of these tests: a 1-node run that succeeds and one
that fails, cancels of a queued and of a running job with no process left, a 2-node torchrun
stopped at one step on every rank and resumed as a 2-node job, a deadline snapshot from Slurm's
time limit that `--retry 1` carries on to max_steps, a daemon killed between submit and record,
and slurmctld restarted while jobs run. The cluster is shared with tests/executors/slurm.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import run_processes, slurm_cluster  # noqa: F401 - the shared fixture

STEPS_JOB = str(REPO / "tests" / "executors" / "slurm" / "steps_job.py")
WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")
VENV = sys.prefix  # the tests' virtual environment, on every "node" of this one-machine cluster


def slurm_config(workdir: Path) -> str:
    common = f'workdir = "{workdir}"\nvenv = "{VENV}"\n'
    return (
        FAST_CONFIG
        + "\n[retry]\nbackoff = 0.5\n"
        + f'\n[targets.hpc]\nkind = "slurm"\n{common}'
        + f'\n[targets.pair]\nkind = "slurm"\n{common}nodes = 2\nlauncher = "torchrun"\nnproc_per_node = 2\ncpus_per_task = 2\n'
        + f'\n[targets.both]\nkind = "slurm"\n{common}nodes = 2\n'
        + f'\n[targets.on_n2]\nkind = "slurm"\n{common}sbatch_options = ["--nodelist=n2"]\n'
        + f'\n[targets.limited]\nkind = "slurm"\n{common}time = "1"\nsignal_margin = 0\n'
        + f'\n[targets.short]\nkind = "slurm"\n{common}time = "2"\nsignal_margin = "60s"\n'
        + f'\n[targets.nowhere]\nkind = "slurm"\n{common}partition = "nowhere"\n'
    )


@pytest.fixture
def hpc(make_daemon, slurm_cluster: Cluster, short_tmp: Path) -> Iterator[DaemonProc]:  # noqa: F811
    workdir = short_tmp / "shared"
    d = make_daemon(slurm_config(workdir))
    d.env.update(slurm_cluster.env)
    d.cluster = slurm_cluster
    d.start()
    yield d
    d.stop()
    slurm_cluster.run("scancel", "--user=root", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the cluster's jobs to end")


def start(d: DaemonProc, target: str, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", "--target", target, *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def jobs_named(cluster: Cluster, run_id: str) -> list[dict[str, str]]:
    return [j for j in cluster.jobs() if j["name"] == f"obd-{run_id}"]


def metrics(record: dict) -> list[dict]:
    path = Path(record["remote_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_steps(record: dict) -> list[int]:
    return [m["step"] for m in metrics(record) if m["event"] == "log"]


# --- one node --------------------------------------------------------------------------------------


def test_a_one_node_run_succeeds_and_a_failing_one_is_failed_with_its_exit_code(hpc: DaemonProc) -> None:
    ok = start(hpc, "hpc", "sh", "-c", 'echo "on node $SLURMD_NODENAME"')
    bad = start(hpc, "hpc", "sh", "-c", "echo about to fail; exit 3")
    record = hpc.wait_state(ok, "succeeded", "failed", "cancelled")
    assert record["state"] == "succeeded", record["message"]
    assert record["exit_code"] == 0
    assert "on node n" in hpc.cli("train", "logs", ok).stdout
    failed = hpc.wait_state(bad, "succeeded", "failed", "cancelled")
    assert failed["state"] == "failed" and failed["exit_code"] == 3
    assert "exit 3" in failed["message"] and f"obd train logs {bad}" in failed["message"]
    # One Slurm job each, named for its run.
    assert [j["state"] for j in jobs_named(hpc.cluster, ok)] == ["COMPLETED"]  # type: ignore[attr-defined]
    assert [j["state"] for j in jobs_named(hpc.cluster, bad)] == ["FAILED"]  # type: ignore[attr-defined]


def test_a_queued_run_waits_with_slurms_reason_and_its_cancel_leaves_no_job_and_no_process(hpc: DaemonProc) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    blocker = cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap=sleep 300"
    ).stdout.strip()
    try:
        wait_for(lambda: any(j["id"] == blocker and j["state"] == "RUNNING" for j in cluster.jobs()), 30)
        rid = start(hpc, "hpc", "sleep", "300")
        record = hpc.wait_state(rid, "queued", timeout=30)
        wait_for(lambda: "Resources" in hpc.record(rid)["message"], 20, what="Slurm's pending reason")
        assert hpc.record(rid)["message"] == "waiting for the scheduler: Resources"
        out = hpc.cli("train", "cancel", rid, "--wait")
        assert out.returncode == 0, out.stderr
        record = hpc.record(rid)
        assert record["state"] == "cancelled" and record["message"] == "cancelled by the user"
        assert [j["state"] for j in jobs_named(cluster, rid)] == ["CANCELLED"]
        assert not (Path(record["remote_dir"]) / "job.pid").exists()  # it never started
        assert run_processes(rid) == []
    finally:
        cluster.run("scancel", blocker, check=False)


def test_a_running_slurm_job_is_cancelled_and_no_process_is_left_on_any_node(hpc: DaemonProc) -> None:
    rid = start(hpc, "hpc", "sh", "-c", "sleep 300 & sleep 300 & echo children started; wait")
    record = hpc.wait_state(rid, "running")
    wait_for(lambda: len(run_processes(rid)) >= 3, 30, what="the job's processes")
    out = hpc.cli("train", "cancel", rid, "--wait")
    assert out.returncode == 0, out.stderr
    record = hpc.record(rid)
    assert record["state"] == "cancelled" and record["message"] == "cancelled by the user"
    wait_for(lambda: run_processes(rid) == [], 15, what="every process of the job to be gone")
    assert [j["state"] for j in jobs_named(hpc.cluster, rid)] == ["CANCELLED"]  # type: ignore[attr-defined]


# --- two nodes ---------------------------------------------------------------------------------------


def test_a_plain_two_node_run_runs_its_command_on_each_node_and_its_cancel_leaves_no_process_on_either(
    hpc: DaemonProc,
) -> None:
    script = 'echo "node $SLURM_NODEID of $SLURM_NNODES on $SLURMD_NODENAME"; sleep 300'
    rid = start(hpc, "both", "sh", "-c", script)
    hpc.wait_state(rid, "running", timeout=60)

    def both_nodes() -> bool:
        log = hpc.cli("train", "logs", rid).stdout
        return "node 0 of 2 on n1" in log and "node 1 of 2 on n2" in log

    wait_for(both_nodes, 30, 0.2, "the command to start on n1 and n2")
    assert len(run_processes(rid)) >= 4  # a shell and a sleep on each node, under srun
    out = hpc.cli("train", "cancel", rid, "--wait")
    assert out.returncode == 0, out.stderr
    assert hpc.record(rid)["state"] == "cancelled"
    wait_for(lambda: run_processes(rid) == [], 15, what="every process of the job, on both nodes, to be gone")


def test_a_two_node_torchrun_stops_every_rank_at_one_step_and_resumes_as_a_two_node_job(hpc: DaemonProc) -> None:
    command = ("python", WORKLOAD, "--tiny", "--batch_size", "2", "--output_dir", "mine")
    rid = start(hpc, "pair", *command, "--max_steps", "100000")
    wait_for(lambda: (hpc.record(rid)["progress"]["step"] or 0) >= 2, 180, 0.5, "the 4 ranks to train")
    assert hpc.record(rid)["slurm"]["nodes"] == "n[1-2]"
    out = hpc.cli("train", "stop", rid, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    record = hpc.record(rid)
    assert record["state"] == "stopped" and record["snapshot"]["reason"] == "requested"
    step = record["snapshot"]["step"]
    run_dir = Path(record["remote_dir"])
    checkpoint = run_dir / "output" / f"checkpoint-{step}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == step
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    assert json.loads((run_dir / "snapshot.json").read_text())["step"] == step
    log = (run_dir / "job.log").read_text()
    assert log.count("obd: snapshot at step") == 1
    # Each of the 4 ranks (2 per node) ended its training at the checkpoint's step (inside train():
    # a snapshot ends the job there, so the workload's code after train() never ran).
    ended = [json.loads(line.split(" ", 1)[1]) for line in log.splitlines() if line.startswith("train_end ")]
    assert sorted(m["rank"] for m in ended) == [0, 1, 2, 3]
    assert {(m["step"], m["epoch"]) for m in ended} == {(step, state["epoch"])}
    assert "train_metrics " not in log
    begin = metrics(record)[0]
    assert begin["event"] == "begin" and begin["world_size"] == 4

    out = hpc.cli("train", "resume", rid, "--", *command, "--max_steps", str(step + 3))
    assert out.returncode == 0, out.stderr
    resumed_id = out.stdout.strip()
    resumed = hpc.wait_state(resumed_id, "succeeded", "failed", "cancelled", "stopped", timeout=240)
    assert resumed["state"] == "succeeded", resumed["message"]
    assert resumed["resumed_from"] == rid
    assert log_steps(resumed) == [step + 1, step + 2, step + 3]
    begin = metrics(resumed)[0]
    assert begin["start_step"] == step and begin["world_size"] == 4
    # 4 ranks at 2 per node: one torchrun agent on each of the 2 nodes srun gave it.
    assert json.loads((Path(resumed["remote_dir"]) / "slurm_launch.json").read_text())["nodes"] == 2


# --- Slurm's time limit ---------------------------------------------------------------------------------


def test_a_job_near_its_time_limit_stops_with_a_deadline_snapshot_and_retry_1_carries_it_to_max_steps(
    hpc: DaemonProc,
) -> None:
    # 1 s steps until the deadline; the attempt that resumes takes fast steps, so it ends before its own.
    rid = start(hpc, "short", "python", STEPS_JOB, "1", "150", "0.05", opts=("--retry", "1"))
    first = hpc.wait_state(rid, "stopped", "failed", "succeeded", "cancelled", timeout=150)
    assert first["state"] == "stopped", first["message"]
    assert first["snapshot"]["reason"] == "deadline"
    assert "TIMEOUT" not in first["message"]
    # Running from a probe that found the job started (after `queued`), or from the submit itself
    # when the first probe already found it running (on a loaded machine).
    began = next(h["time"] for h in first["history"] if h["state"] == "running")
    ended = first["history"][-1]["time"] if first["history"][-1]["state"] == "stopped" else time.time()
    assert ended - began < 120  # before Slurm's time limit of 2 minutes
    step = first["snapshot"]["step"]
    assert 0 < step < 150

    def next_attempt() -> str | None:
        return hpc.record(rid).get("retried_by")

    second_id = wait_for(next_attempt, 30, 0.2, "the retry's attempt")
    second = hpc.wait_state(second_id, "succeeded", "failed", "stopped", "cancelled", timeout=120)
    assert second["state"] == "succeeded", second["message"]
    assert log_steps(second)[0] == step + 1 and log_steps(second)[-1] == 150
    assert metrics(second)[0]["start_step"] == step
    assert len(jobs_named(hpc.cluster, second_id)) == 1  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_job_slurm_ends_at_its_time_limit_fails_saying_timeout_and_what_to_do(hpc: DaemonProc) -> None:
    rid = start(hpc, "limited", "sleep", "600")
    record = hpc.wait_state(rid, "failed", "succeeded", "stopped", "cancelled", timeout=180)
    assert record["state"] == "failed"
    assert "reached its time limit (1 min) and Slurm ended it (TIMEOUT)" in record["message"]
    assert "signal_margin is 0" in record["message"] and f"obd train resume {rid}" in record["message"]


# --- faults ------------------------------------------------------------------------------------------------


def test_a_job_lost_with_its_node_fails_saying_node_fail_and_what_to_do(hpc: DaemonProc) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    rid = start(hpc, "on_n2", "sleep", "600")
    hpc.wait_state(rid, "running")
    wait_for(lambda: run_processes(rid), 30, what="the job on n2")
    try:
        cluster.run("scontrol", "update", "nodename=n2", "state=down", "reason=obd-test")
        record = hpc.wait_state(rid, "failed", "succeeded", "stopped", "cancelled", timeout=60)
    finally:
        cluster.run("scontrol", "update", "nodename=n2", "state=resume", check=False)
    assert record["state"] == "failed", record["message"]
    assert "a node of Slurm job" in record["message"] and "(n2)" in record["message"]
    assert "NODE_FAIL" in record["message"] and f"obd train resume {rid}" in record["message"]
    cluster.wait_nodes_idle()


def slow_sbatch(directory: Path, before: float, after: float) -> Path:
    """A `sbatch` first on PATH that waits before and after the real one (a daemon can be killed meanwhile)."""
    directory.mkdir(parents=True, exist_ok=True)
    real = "/usr/bin/sbatch"
    wrapper = directory / "sbatch"
    wrapper.write_text(f'#!/bin/sh\nsleep {before}\n{real} "$@"\nrc=$?\nsleep {after}\nexit $rc\n')
    wrapper.chmod(0o755)
    return directory


def submit_helpers() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(a.endswith(b"slurm_batch.py") for a in argv) and b"submit" in argv:
                pids.append(int(entry.name))
    return pids


@pytest.mark.parametrize(
    ("moment", "kill_helper"),
    [("before sbatch", False), ("after sbatch", False), ("after sbatch", True)],
    ids=["before-sbatch", "after-sbatch", "after-sbatch-with-its-helper"],
)
def test_a_daemon_killed_between_submit_and_record_leaves_one_job_and_the_run_right(
    hpc: DaemonProc, short_tmp: Path, moment: str, kill_helper: bool
) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    hpc.stop()
    before, after = (4, 0) if moment == "before sbatch" else (0, 4)
    slow = slow_sbatch(short_tmp / "slow-bin", before, after)
    hpc.start(extra_env={"PATH": f"{slow}:{os.environ['PATH']}"})
    rid = start(hpc, "hpc", "python", STEPS_JOB, "0.2", "15")
    run_dir = Path(hpc.record(rid)["remote_dir"])
    if moment == "before sbatch":
        wait_for((run_dir / "slurm.json").exists, 30, 0.05, "the submit's intent")
    else:
        wait_for(lambda: jobs_named(cluster, rid), 30, 0.05, "the job in Slurm")
    assert hpc.record(rid)["job"] is None  # the daemon has not recorded the submit yet
    hpc.signal(signal.SIGKILL)
    if kill_helper:
        for pid in submit_helpers():
            os.kill(pid, signal.SIGKILL)
    hpc.start()
    record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", "stopped", timeout=90)
    assert record["state"] == "succeeded", record["message"]
    assert log_steps(record)[-1] == 15
    assert len(jobs_named(cluster, rid)) == 1


def test_a_slurmctld_restart_while_jobs_run_leaves_one_job_per_run_and_every_record_right(hpc: DaemonProc) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    runs = [start(hpc, "hpc", "python", STEPS_JOB, "0.5", "20") for _ in range(2)]
    for rid in runs:
        hpc.wait_state(rid, "running")
    wait_for(lambda: all(hpc.record(r)["progress"]["step"] for r in runs), 60, 0.2, "both jobs to step")
    cluster.restart_ctld()
    for rid in runs:
        record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", "stopped", timeout=90)
        assert record["state"] == "succeeded", record["message"]
        assert log_steps(record) == list(range(1, 21))
        assert len(jobs_named(cluster, rid)) == 1


# --- targets check ---------------------------------------------------------------------------------------


def test_targets_check_of_a_slurm_target_reaches_sinfo_the_partition_a_shared_workdir_and_torch(
    hpc: DaemonProc,
) -> None:
    out = hpc.cli("targets", "check", "hpc", "--json", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["check"]: c for c in json.loads(out.stdout)}
    for name in ("sinfo answers", "partition exists", "workdir shared", "python found", "torch found"):
        assert checks[name]["ok"], checks[name]
    assert "debug" in checks["partition exists"]["detail"]
    out = hpc.cli("targets", "check", "nowhere", timeout=180)
    assert out.returncode == 1
    line = next(line for line in out.stdout.splitlines() if "partition exists" in line)
    assert line.startswith("FAIL") and "nowhere" in line and "debug" in line


def test_a_job_slurm_refuses_fails_its_run_with_sbatchs_reason_and_the_check_to_run(hpc: DaemonProc) -> None:
    rid = start(hpc, "nowhere", "true")
    record = hpc.wait_state(rid, "failed", "succeeded", "cancelled")
    assert record["state"] == "failed"
    assert "sbatch refused the job" in record["message"] and "nowhere" in record["message"]
    assert "obd targets check nowhere" in record["message"]
    assert jobs_named(hpc.cluster, rid) == []  # type: ignore[attr-defined]


# --- the working directory ------------------------------------------------------------------------


def start_in(d: DaemonProc, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`obd train start ARGS` run from `cwd`, as a user in their project directory would."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", "train", "start", *args],
        env=d.env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


MAKES_A_FILE_HERE = 'echo "node ${SLURM_NODEID:-0} in $(pwd)"; echo made > "made-on-${SLURM_NODEID:-0}"\n'


def test_a_slurm_run_without_cwd_runs_where_obd_train_start_ran_as_sbatch_would_on_every_node(
    hpc: DaemonProc, short_tmp: Path
) -> None:
    project = short_tmp / "project"  # on this one-machine cluster, every directory is shared
    project.mkdir()
    (project / "job.sh").write_text(MAKES_A_FILE_HERE)
    one = start_in(hpc, project, "--target", "hpc", "--", "sh", "job.sh")
    two = start_in(hpc, project, "--target", "both", "--", "sh", "job.sh")
    for out in (one, two):
        assert out.returncode == 0, out.stderr
    for rid, nodes in ((one.stdout.strip(), ["0"]), (two.stdout.strip(), ["0", "1"])):
        record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", timeout=90)
        assert record["state"] == "succeeded", record["message"]
        log = hpc.cli("train", "logs", rid).stdout
        for node in nodes:
            assert f"node {node} in {project}" in log, log
        assert not (Path(record["remote_dir"]) / "src").exists()  # used in place, not uploaded
    assert sorted(p.name for p in project.glob("made-on-*")) == ["made-on-0", "made-on-1"]


def test_a_slurm_run_with_cwd_on_a_target_without_login_runs_in_that_directory_in_place(
    hpc: DaemonProc, short_tmp: Path
) -> None:
    there = short_tmp / "elsewhere"
    there.mkdir()
    (there / "job.sh").write_text(MAKES_A_FILE_HERE)
    out = start_in(hpc, short_tmp, "--target", "hpc", "--cwd", str(there), "--", "sh", "job.sh")
    assert out.returncode == 0, out.stderr
    record = hpc.wait_state(out.stdout.strip(), "succeeded", "failed", "cancelled", timeout=90)
    assert record["state"] == "succeeded", record["message"]
    assert (there / "made-on-0").read_text() == "made\n"
    assert not (Path(record["remote_dir"]) / "src").exists()


def test_a_slurm_target_through_a_login_node_refuses_a_start_without_cwd_naming_cwd_and_saves_nothing(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(
        FAST_CONFIG
        + f'\n[targets.cluster]\nkind = "slurm"\nworkdir = "/scratch/obd"\nvenv = "{VENV}"\n'
        + '\n[targets.cluster.login]\nhost = "login.invalid"\nuser = "me"\n'
    )
    d.start()
    project = short_tmp / "project"
    project.mkdir()
    out = start_in(d, project, "--target", "cluster", "--", "sh", "job.sh")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "submits through its login node login.invalid" in out.stderr
    assert "give --cwd DIR to upload DIR" in out.stderr and "`obd train start --target cluster --cwd . --" in out.stderr
    assert json.loads(d.cli("train", "list", "--all", "--json").stdout) == []
    # With --cwd the run is taken (its sources go up through the login node; this one is unreachable).
    out = start_in(d, project, "--target", "cluster", "--cwd", ".", "--", "sh", "job.sh")
    assert out.returncode == 0, out.stderr
    assert d.record(out.stdout.strip())["cwd"] == str(project)
