"""A Slurm job of a user is submitted as that user (issue 22, item 4).

Before, a root daemon submitting on its own machine ran every user's Slurm job as root: the job,
its files, its submit, probes and cancel. Now the job runs as its user (Slurm says so, and so do
the job's own processes and files), and `obd train cancel` and `obd train stop --wait` still end
it. A target whose login node is not the user's refuses the run and says what to do.

Root only: throwaway users (tests/users.py) and the real test cluster (munge, slurmctld, two
slurmd) of tests/executors/slurm, which find the users in the system's account database.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, REPO, wait_for
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import run_processes, slurm_cluster  # noqa: F401 - the shared fixture
from tests.users import Box, User

pytestmark = users.needs_root_and_users
accounts = users.accounts  # the module's throwaway users, shared with tests/users.py's box

STEPS_JOB = str(REPO / "tests" / "executors" / "slurm" / "steps_job.py")


def slurm_config(workdir: Path, venv: Path, group: str) -> str:
    common = f'kind = "slurm"\nworkdir = "{workdir}"\nvenv = "{venv}"\n'
    return (
        FAST_CONFIG.replace("[daemon]", f'[daemon]\nsocket_group = "{group}"')
        + f"\n[targets.hpc]\n{common}"
        + f'\n[targets.via_login]\n{common}\n[targets.via_login.login]\nhost = "login.example.org"\nuser = "svc-obd"\n'
    )


@pytest.fixture
def box(make_daemon, slurm_cluster: Cluster, short_tmp: Path, accounts) -> Iterator[Box]:  # noqa: F811
    """A root daemon with a Slurm target on this machine, shared by two throwaway users."""
    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)  # the socket's and the workdir's directory: reachable, not listable
    d = make_daemon(slurm_config(short_tmp / "shared", venv, group))
    d.env.update(slurm_cluster.env)
    d.start()
    yield Box(d, alice, bob, group, client, venv)
    d.stop()
    for user in (alice.name, bob.name, "root"):  # root's too: the code before submitted as root
        slurm_cluster.run("scancel", "--full", f"--user={user}", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the users' Slurm jobs to end")


def start(box: Box, user: User, *command: str) -> str:
    out = box.obd(user, "train", "start", "--target", "hpc", "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def slurm_user_of(cluster: Cluster, run_id: str) -> list[str]:
    """The numeric user id Slurm holds each job named for this run under (`squeue -o %U`)."""
    out = cluster.run("squeue", "--noheader", "--states=all", f"--name=obd-{run_id}", "--format=%U").stdout
    return out.split()


def process_uids(pids: list[int]) -> set[int]:
    uids = set()
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uids.add(int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1]))
    return uids


def test_a_users_slurm_job_runs_as_them_and_its_run_directory_is_theirs(
    box: Box,
    slurm_cluster: Cluster,  # noqa: F811
) -> None:
    alice = box.alice
    script = 'echo "id=$(id -u):$(id -g) home=$HOME"; touch "$OBD_RUN_DIR/made-by-the-job"; sleep 4'
    rid = start(box, alice, "sh", "-c", script)
    box.daemon.wait_state(rid, "running", timeout=60)
    assert slurm_user_of(slurm_cluster, rid) == [str(alice.uid)]
    job_id = str(box.daemon.record(rid)["job"]["pid"])  # a Slurm run's handle holds its job id
    job = slurm_cluster.run("scontrol", "show", "job", "--oneliner", job_id)
    assert f"UserId={alice.name}({alice.uid})" in job.stdout
    record = box.daemon.wait_state(rid, "succeeded", "failed", "cancelled", timeout=60)
    assert record["state"] == "succeeded", record["message"]
    log = box.obd(alice, "train", "logs", rid)
    assert log.returncode == 0, log.stderr
    assert f"id={alice.uid}:{alice.gid} home={alice.home}" in log.stdout
    rd = Path(record["remote_dir"])
    assert oct(rd.stat().st_mode & 0o777) == oct(0o700)
    for name in ("", "job.log", "job.pid", "exit_code", "slurm.json", "job.json", "plugin", "made-by-the-job"):
        assert (rd / name).lstat().st_uid == alice.uid, rd / name
    assert json.loads((rd / "slurm.json").read_text())["job_id"] == job_id


def test_obd_train_cancel_ends_a_users_running_slurm_job_as_them(box: Box, slurm_cluster: Cluster) -> None:  # noqa: F811
    alice = box.alice
    rid = start(box, alice, "sh", "-c", "sleep 300 & sleep 300 & wait")
    box.daemon.wait_state(rid, "running", timeout=60)
    wait_for(lambda: len(run_processes(rid)) >= 3, 30, 0.2, "the job's processes")
    assert process_uids(run_processes(rid)) == {alice.uid}
    out = box.obd(alice, "train", "cancel", rid, "--wait", timeout=120)
    assert out.returncode == 0, out.stderr
    record = box.daemon.record(rid)
    assert record["state"] == "cancelled" and record["message"] == "cancelled by the user"
    wait_for(lambda: run_processes(rid) == [], 15, 0.2, "every process of the job to be gone")
    assert [j["state"] for j in slurm_cluster.jobs() if j["name"] == f"obd-{rid}"] == ["CANCELLED"]
    rd = Path(record["remote_dir"])
    for name in ("cancelling", "cancelled"):  # written by obd's helper, as alice
        assert (rd / name).lstat().st_uid == alice.uid, name


def test_obd_train_stop_wait_ends_a_users_slurm_job_stopped_with_their_snapshot(box: Box) -> None:
    alice = box.alice
    # The job reads its script as alice: a copy of hers, since the checkout may be root's alone.
    script = alice.home / "steps_job.py"
    shutil.copyfile(STEPS_JOB, script)
    os.chown(script, alice.uid, alice.gid)
    rid = start(box, alice, "python", str(script), "0.3", "100000")
    wait_for(lambda: (box.daemon.record(rid)["progress"]["step"] or 0) >= 2, 90, 0.2, "the job to step")
    out = box.obd(alice, "train", "stop", rid, "--wait", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    record = box.daemon.record(rid)
    assert record["state"] == "stopped", record["message"]
    assert record["snapshot"]["reason"] == "requested"
    rd = Path(record["remote_dir"])
    checkpoint = rd / record["snapshot"]["checkpoint"]
    for path in (rd / "snapshot.json", checkpoint, checkpoint / "state.txt", rd / "metrics.jsonl"):
        assert path.lstat().st_uid == alice.uid, path
    assert (checkpoint / "state.txt").read_text() == f"{record['snapshot']['step']}\n"


def test_a_slurm_target_whose_login_node_is_not_the_users_refuses_their_run_saying_what_to_do(box: Box) -> None:
    alice = box.alice
    out = box.obd(alice, "train", "start", "--target", "via_login", "--", "true")
    assert out.returncode == 77, (out.returncode, out.stderr)
    assert "submits through its login node as svc-obd@login.example.org" in out.stderr
    assert f"not as you ({alice.name})" in out.stderr
    assert "a Slurm target without `login`" in out.stderr and "`obd daemon`" in out.stderr
    mine = json.loads(box.obd(alice, "train", "list", "--all", "--json").stdout)
    assert [r for r in mine if r["target"] == "via_login"] == []
