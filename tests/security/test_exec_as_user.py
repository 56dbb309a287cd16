"""`obd train exec` and `obd train shell` under the root service (issue 27, item 3): the command
runs as the run's user, never as root, whoever asks (its owner, or root); anyone else is refused.

Root only: a root daemon shared by two throwaway users (tests/users.py).
"""

from __future__ import annotations

import grp
import os
import pty
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, wait_for
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture
from tests.ptys import converse
from tests.users import Box, User

pytestmark = users.needs_root_and_users
accounts = users.accounts

CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'
PROBE = "id -un; id -u; id -G; pwd; echo $CUDA_VISIBLE_DEVICES; echo $HOME"


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield users.shared_daemon(make_daemon, short_tmp, accounts, CONFIG, own_python=True)


def running(box: Box, user: User, *opts: str) -> dict:
    run_id = box.start(user, "sleep", "120", opts=opts)
    return box.daemon.wait_state(run_id, "running")


def test_a_users_exec_runs_as_them_in_their_run_directory_with_their_gpu(box: Box) -> None:
    record = running(box, box.alice, "--gpus", "1")
    out = box.obd(box.alice, "train", "exec", record["id"], "--", "sh", "-c", PROBE)
    assert out.returncode == 0, out.stderr
    name, uid, groups, cwd, gpus, home = out.stdout.splitlines()
    assert (name, int(uid)) == (box.alice.name, box.alice.uid)
    assert "0" not in groups.split()  # not root's groups either
    assert cwd == record["remote_dir"]
    assert gpus == record["gpus"][0]
    assert home == str(box.alice.home)


def test_root_running_a_command_in_a_users_run_runs_it_as_that_user_not_as_root(box: Box) -> None:
    record = running(box, box.alice)
    out = box.daemon.cli("train", "exec", record["id"], "--", "sh", "-c", "id -un; id -u")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [box.alice.name, str(box.alice.uid)]


def test_another_user_is_refused_and_nothing_runs(box: Box) -> None:
    record = running(box, box.alice)
    marker = Path(record["remote_dir"]) / "bob-was-here"
    out = box.obd(box.bob, "train", "exec", record["id"], "--", "touch", str(marker))
    assert out.returncode == 77, out.stderr
    assert "is not yours" in out.stderr
    assert not marker.exists()
    shell = box.obd(box.bob, "train", "shell", record["id"])
    assert shell.returncode == 77
    assert "is not yours" in shell.stderr


def test_a_users_shell_on_a_terminal_is_theirs_and_its_exit_status_is_obds(box: Box) -> None:
    record = running(box, box.alice)
    code, shown = shell_as(box, box.alice, record["id"], b"echo I-am-$(id -un); exit 3\n")
    assert code == 3, shown
    assert f"I-am-{box.alice.name}".encode() in shown


def shell_as(box: Box, user: User, run_id: str, typed: bytes, timeout: float = 30) -> tuple[int, bytes]:
    """`obd train shell RUN` run by `user` on a pseudo-terminal; its exit status and what it showed."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.setgroups([grp.getgrnam(box.group).gr_gid])
            os.setgid(user.gid)
            os.setuid(user.uid)
            os.chdir(user.home)
            python = f"{box.venv}/bin/python"
            os.execve(python, [python, "-m", "daemon.cli", "train", "shell", run_id], box.env(user, TERM="dumb"))
        finally:
            os._exit(127)
    return converse(pid, fd, typed, timeout)


# --- a user's Slurm job: the step runs as them (srun --jobid --overlap, as the job's user) -------


@pytest.fixture
def slurm_box(make_daemon, slurm_cluster, short_tmp: Path, accounts) -> Iterator[Box]:  # noqa: F811
    from tests.security.test_slurm_as_user import slurm_config

    alice, bob, group, client, venv = accounts
    os.chmod(short_tmp, 0o711)
    d = make_daemon(slurm_config(short_tmp / "shared", venv, group))
    d.env.update(slurm_cluster.env)
    d.start()
    yield Box(d, alice, bob, group, client, venv)
    d.stop()
    for user in (alice.name, bob.name):
        slurm_cluster.run("scancel", "--full", f"--user={user}", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the users' Slurm jobs to end")


def test_a_users_exec_on_slurm_is_a_step_of_their_job_run_as_them(slurm_box: Box) -> None:
    box, alice = slurm_box, slurm_box.alice
    run_id = box.start(alice, "sh", "-c", 'touch "$OBD_RUN_DIR/started"; exec sleep 120', opts=("--target", "hpc"))
    record = box.daemon.wait_state(run_id, "running", "queued", timeout=60)
    wait_for(lambda: (Path(record["remote_dir"]) / "started").exists(), 60, 0.2, "the Slurm job to start")
    box.daemon.wait_state(run_id, "running")  # as the daemon's next poll of Slurm sees it
    out = box.obd(alice, "train", "exec", run_id, "--", "sh", "-c", "id -un; id -u; pwd; echo $SLURM_JOB_ID")
    assert out.returncode == 0, out.stderr
    name, uid, cwd, job_id = out.stdout.splitlines()
    assert (name, int(uid)) == (alice.name, alice.uid)
    assert cwd == record["remote_dir"]
    assert job_id == str(record["job"]["pid"])
    refused = box.obd(box.bob, "train", "exec", run_id, "--", "true")
    assert refused.returncode == 77 and "is not yours" in refused.stderr
