"""An upgrade across the two rooms of trainer_plugin/ (issue 35 item 4), on SSH and Slurm targets.

The release before it ran the job-side tools flat in `<workdir>/.obd/tools-<hash>/` with the
wrapper started as `jobctl.py start`; this one starts it as `supervisor.py start` from a tools
directory of its own. Records name no tool path (a run is its run directory and its handle), so
this release follows, stops and cancels the earlier one's runs with its own tools, while their
wrappers go on from the earlier directory, which it leaves in place. The earlier obd is the tree of
commit `PREVIOUS` (taken with `git archive`), run from its own directory, as in test_upgrade.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProc, kill_job_groups, wait_for
from tests.daemon.test_slurm_target import jobs_named, slurm_config
from tests.daemon.test_ssh_target import ssh_config
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import run_processes, slurm_cluster  # noqa: F401 - the shared fixture
from tests.sshd import SshServer, running_sshd
from trainer_plugin.tools import jobctl

PREVIOUS = "d9622ab"  # the last commit before the tools had a folder of their own
PY = sys.executable
# A custom loop on the plugin its run got (the earlier version's, copied into the run's plugin/).
SNAPSHOT_LOOP = """
import os, time
from trainer_plugin import begin, checkpoint_dir, end, log_metrics, snapshot_requested, write_proof
begin(max_steps=100000)
for step in range(1, 100001):
    time.sleep(0.1)
    log_metrics(step, loss=1.0 / step)
    reason = snapshot_requested()
    if reason:
        path = checkpoint_dir(step)
        os.makedirs(path)
        with open(os.path.join(path, "weights.txt"), "w") as f:
            f.write(str(step))
        write_proof(step, path, reason=reason)
        break
end(step)
"""


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The earlier version's tree, from git (nothing in this checkout is touched)."""
    archive = subprocess.run(["git", "archive", PREVIOUS], cwd=REPO, capture_output=True, timeout=120)
    if archive.returncode != 0:
        pytest.skip(f"commit {PREVIOUS} is not in this clone: {archive.stderr.decode()[-200:]}")
    root = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    yield root


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def _previous_cli(tree: Path, d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**d.env, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [PY, "-m", "daemon.cli", *args], env=env, cwd=tree, capture_output=True, text=True, timeout=60
    )


def _start_previous_daemon(tree: Path, d: DaemonProc) -> None:
    env = {**d.env, "PYTHONPATH": str(tree)}
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([PY, "-m", "daemon.cli", "daemon"], env=env, cwd=tree, stdout=log, stderr=log)
    wait_for(d.ready, 30, 0.1, "the earlier version's daemon")


def _wrapper_argv(run_dir: Path) -> list[str]:
    """The command line of the run's job wrapper (its pid is in job.pid), as the target runs it."""
    handle = jobctl.read_handle(str(run_dir))
    assert handle is not None, f"no job.pid in {run_dir}"
    return Path(f"/proc/{handle['pid']}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_ssh_runs_started_by_the_release_before_the_two_rooms_are_followed_stopped_and_cancelled(
    previous: Path, make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir))
    try:
        _start_previous_daemon(previous, d)
        loop = short_tmp / "loop.py"
        loop.write_text(SNAPSHOT_LOOP)

        def start(*command: str, name: str) -> str:
            out = _previous_cli(previous, d, "train", "start", "--target", "box", "--name", name, "--", *command)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        snapshot = start(PY, str(loop), name="snapshot")
        sleeper = start("sleep", "600", name="sleeper")
        logs = start("sh", "-c", "for i in $(seq 1 30); do echo line $i; sleep 0.2; done", name="logs")
        wait_for(lambda: d.record(snapshot)["snapshots"] and d.record(snapshot)["progress"]["step"], 60, 0.1, "a step")
        sleeper_dir = Path(d.wait_state(sleeper, "running")["remote_dir"])

        # The earlier layout: one flat tools directory, the wrapper run from it as `jobctl.py start`.
        (old_tools,) = (workdir / ".obd").glob("tools-*")
        argv = _wrapper_argv(sleeper_dir)
        assert argv[1:3] == [str(old_tools / "jobctl.py"), "start"], argv
        assert (sleeper_dir / "plugin" / "trainer_plugin" / "jobctl.py").is_file()  # the run's copy, flat

        d.stop()  # SIGTERM, as `systemctl restart obd`: the earlier daemon goes, its jobs run on
        d.start()  # this version, on the same state directory and the same target

        listed = {r["id"]: r for r in json.loads(d.cli("train", "list", "--all", "--json").stdout)}
        assert listed[snapshot]["state"] == listed[sleeper]["state"] == "running"
        follow = d.cli("train", "logs", logs, "--follow")
        assert follow.returncode == 0, follow.stderr
        assert follow.stdout.splitlines() == [f"line {i}" for i in range(1, 31)]
        assert d.wait_state(logs, "succeeded", "failed")["state"] == "succeeded"

        stop = d.cli("train", "stop", "snapshot", "--wait", "--json")
        assert stop.returncode == 0, stop.stderr
        record = json.loads(stop.stdout)
        assert record["state"] == "stopped"
        assert (Path(record["remote_dir"]) / record["snapshot"]["checkpoint"] / "weights.txt").exists()

        wrapper = jobctl.read_handle(str(sleeper_dir))
        cancel = d.cli("train", "cancel", sleeper, "--wait")
        assert cancel.returncode == 0, cancel.stderr
        assert d.record(sleeper)["state"] == "cancelled"
        assert not jobctl.handle_alive(wrapper) and not jobctl.group_alive(wrapper)  # the earlier wrapper, ended

        # This release's tools came beside the earlier ones, which it left to their runs.
        tools = sorted((workdir / ".obd").glob("tools-*"))
        assert old_tools in tools and len(tools) == 2
        (new_tools,) = (t for t in tools if t != old_tools)
        assert (new_tools / "supervisor.py").is_file() and (new_tools / "jobserve.py").is_file()
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


def test_slurm_jobs_submitted_by_the_release_before_the_two_rooms_run_their_own_copy_and_are_followed_and_cancelled(
    previous: Path,
    make_daemon,
    slurm_cluster: Cluster,  # noqa: F811 - the shared fixture, imported above
    short_tmp: Path,
) -> None:
    """A job still queued in Slurm at the upgrade starts afterwards with the batch helper of its own
    run directory (the earlier, flat layout); this release follows it to its end and cancels another."""
    cluster = slurm_cluster
    d = make_daemon(slurm_config(short_tmp / "shared"))
    d.env.update(cluster.env)
    blocker = cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap=sleep 300"
    ).stdout.strip()
    try:
        wait_for(lambda: any(j["id"] == blocker and j["state"] == "RUNNING" for j in cluster.jobs()), 30)
        _start_previous_daemon(previous, d)

        def start(*command: str, name: str) -> str:
            out = _previous_cli(previous, d, "train", "start", "--target", "hpc", "--name", name, "--", *command)
            assert out.returncode == 0, out.stderr
            return out.stdout.strip()

        finishes = start("sh", "-c", "echo ran after the upgrade", name="finishes")
        cancelled = start("sleep", "300", name="cancelled")
        for rid in (finishes, cancelled):
            d.wait_state(rid, "queued", timeout=30)
            wait_for(lambda rid=rid: jobs_named(cluster, rid), 30, 0.2, "the run's Slurm job")
        (job,) = jobs_named(cluster, finishes)
        script = cluster.run("scontrol", "write", "batch_script", job["id"], "-").stdout
        run_dir = Path(d.record(finishes)["remote_dir"])
        assert f"{run_dir}/plugin/trainer_plugin/slurm_batch.py" in script  # the earlier layout, flat
        assert not (run_dir / "plugin" / "trainer_plugin" / "tools").exists()

        d.stop()  # the earlier daemon goes while its jobs wait in Slurm
        d.start()  # this version
        cluster.run("scancel", blocker, check=False)  # the queued jobs start now, under this daemon

        record = d.wait_state(finishes, "succeeded", "failed", "cancelled", timeout=120)
        assert record["state"] == "succeeded", record["message"]
        assert d.cli("train", "logs", finishes).stdout.strip() == "ran after the upgrade"
        d.wait_state(cancelled, "running", timeout=60)
        out = d.cli("train", "cancel", cancelled, "--wait")
        assert out.returncode == 0, out.stderr
        assert d.record(cancelled)["state"] == "cancelled"
        assert run_processes(cancelled) == []
    finally:
        d.stop()
        cluster.run("scancel", blocker, check=False)
        cluster.run("scancel", "--user=root", check=False)
        wait_for(lambda: not cluster.stepds(), 30, 0.2, "the cluster's jobs to end")
