"""Whom a root daemon submits a user's Slurm job as, without a cluster: the account it acts as,
the refusals that say what to do, the environment and rights its commands get, and how a run
directory is given to the user (never through a link, never one someone else could write).

The end-to-end proof, against the real test cluster, is tests/security/test_slurm_as_user.py.
"""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path

import pytest

from executors.base import ExecutorError, JobHandle, JobSpec, RunAs
from executors.config import SlurmTarget
from executors.slurm import SlurmExecutor, as_user
from executors.slurm.executor import give_run_dir, owned_by

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acts as another user: needs root")
NOBODY = pwd.getpwnam("nobody")


def target(**keys: object) -> SlurmTarget:
    return SlurmTarget.model_validate({"kind": "slurm", "workdir": "/scratch/obd", **keys})


def no_such_uid() -> int:
    uid = 4_242_424
    while True:
        try:
            pwd.getpwuid(uid)
        except KeyError:
            return uid
        uid += 1


def nobody() -> RunAs:
    return RunAs(uid=NOBODY.pw_uid, gid=NOBODY.pw_gid, groups=[NOBODY.pw_gid], user="nobody", home=NOBODY.pw_dir)


# --- whom -------------------------------------------------------------------------------------------


def test_a_root_daemon_submits_a_users_run_as_that_user_with_their_groups_and_home() -> None:
    chosen = as_user.submitter("hpc", target(), NOBODY.pw_uid, daemon_uid=0)
    assert chosen.refusal is None and chosen.account is not None
    assert (chosen.account.uid, chosen.account.gid, chosen.account.user) == (NOBODY.pw_uid, NOBODY.pw_gid, "nobody")
    assert chosen.account.home == NOBODY.pw_dir and NOBODY.pw_gid in chosen.account.groups
    assert chosen.key == f"uid {NOBODY.pw_uid}"


def test_roots_runs_and_every_run_of_a_users_own_daemon_are_submitted_as_the_daemons_user() -> None:
    assert as_user.submitter("hpc", target(), 0, daemon_uid=0) == as_user.Submitter()
    assert as_user.submitter("hpc", target(), None, daemon_uid=0) == as_user.Submitter()
    assert as_user.submitter("hpc", target(), NOBODY.pw_uid, daemon_uid=1000) == as_user.Submitter()
    assert as_user.Submitter().key == ""


def test_a_run_whose_owner_has_no_account_is_refused_saying_what_to_do() -> None:
    uid = no_such_uid()
    chosen = as_user.submitter("hpc", target(), uid, daemon_uid=0)
    assert chosen.account is None and chosen.refusal is not None
    assert f"uid {uid}) has no account on this machine" in chosen.refusal
    assert f"`scancel --user={uid}`" in chosen.refusal and "restore the account" in chosen.refusal


def test_a_login_node_that_is_not_the_users_refuses_their_runs_and_one_that_is_theirs_serves_them() -> None:
    via_service = target(login={"host": "login.example.org", "user": "svc"})
    chosen = as_user.submitter("hpc", via_service, NOBODY.pw_uid, daemon_uid=0)
    assert chosen.refusal is not None
    assert "submits through its login node as svc@login.example.org" in chosen.refusal
    assert "not as you (nobody)" in chosen.refusal and "`obd daemon`" in chosen.refusal
    via_default = target(login={"host": "login.example.org"})
    refusal = as_user.submitter("hpc", via_default, NOBODY.pw_uid, daemon_uid=0).refusal or ""
    assert "the daemon's own user (root) at login.example.org" in refusal
    theirs = target(login={"host": "login.example.org", "user": "nobody"})
    assert as_user.submitter("hpc", theirs, NOBODY.pw_uid, daemon_uid=0) == as_user.Submitter()


def test_a_users_slurm_commands_get_slurms_config_and_their_own_home_never_the_daemons_secrets() -> None:
    daemon_env = {
        "SLURM_CONF": "/etc/slurm/x.conf",
        "PATH": "/opt/bin:/usr/bin",
        "LC_ALL": "C.UTF-8",
        "HOME": "/root",
        "USER": "root",
        "RUNPOD_API_KEY": "secret",
        "HF_TOKEN": "secret",
        "PYTHONPATH": "/opt/obd",
    }
    env = as_user.user_env(nobody(), daemon_env)
    assert env == {
        "SLURM_CONF": "/etc/slurm/x.conf",
        "PATH": "/opt/bin:/usr/bin",
        "LC_ALL": "C.UTF-8",
        "HOME": NOBODY.pw_dir,
        "USER": "nobody",
        "LOGNAME": "nobody",
    }


@needs_root
async def test_a_command_run_as_a_user_has_their_uid_gid_groups_and_umask() -> None:
    result = await as_user.run(nobody(), ["sh", "-c", 'echo "$(id -u) $(id -g) $(id -G) $(umask) $HOME"'])
    assert result.returncode == 0, result.stderr
    expected = f"{NOBODY.pw_uid} {NOBODY.pw_gid} {NOBODY.pw_gid} 0077 {NOBODY.pw_dir}"
    assert result.stdout.decode().split() == expected.split()


@needs_root
async def test_a_command_run_as_a_user_past_its_timeout_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await as_user.run(nobody(), ["sleep", "30"], timeout=0.5)
    assert time.monotonic() - started < 5


# --- the executor of a refused run acts as no one ----------------------------------------------------------


async def test_an_executor_whose_run_is_refused_runs_no_command_and_touches_no_file(tmp_path: Path) -> None:
    refused = as_user.Submitter(refusal="not as root: do this instead", owner_uid=no_such_uid())
    executor = SlurmExecutor("hpc", target(workdir=str(tmp_path)), submitter=refused, settle=0)
    rd = str(tmp_path / "run")
    handle = JobHandle(pid=7, start_time=0)
    attempts = [
        executor.spawn(JobSpec(run_id="run", remote_dir=rd, command=["true"])),
        executor.probe([(handle, rd)]),
        executor.cancel(handle, rd, 1),
        executor.run_command(["true"]),
        executor.put_file(f"{rd}/snapshot.request", b"requested\n"),
        executor.read_from(f"{rd}/job.log", 0, 10),
        executor.make_run_dir(rd, None),
        executor.obd_jobs(),
    ]
    for attempt in attempts:
        with pytest.raises(ExecutorError, match="not as root: do this instead"):
            await attempt
    assert list(tmp_path.iterdir()) == []


def test_an_executor_cannot_submit_as_a_user_through_a_login_node() -> None:
    with pytest.raises(ValueError, match="login node"):
        SlurmExecutor(
            "hpc",
            target(login={"host": "login.example.org"}),
            submitter=as_user.Submitter(account=nobody(), owner_uid=NOBODY.pw_uid),
        )


async def test_a_job_is_never_submitted_for_one_user_by_the_executor_of_another(tmp_path: Path) -> None:
    executor = SlurmExecutor("hpc", target(workdir=str(tmp_path)), settle=0)  # the daemon's own user
    job = JobSpec(run_id="run", remote_dir=str(tmp_path / "run"), command=["true"], run_as=nobody())
    with pytest.raises(ExecutorError, match="is nobody's, but target hpc's executor for it submits as"):
        await executor.spawn(job)
    assert list(tmp_path.iterdir()) == []


# --- the run directory -------------------------------------------------------------------------------------


@needs_root
def test_a_run_directory_is_given_to_its_user_whole_without_following_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "roots-file"
    outside.write_text("root's")
    rd = tmp_path / "run"
    (rd / "plugin" / "trainer_plugin").mkdir(parents=True, mode=0o755)
    rd.chmod(0o700)
    (rd / "plugin" / "trainer_plugin" / "jobctl.py").write_text("")
    (rd / "job.json").write_text("{}")
    (rd / "link").symlink_to(outside)
    give_run_dir(str(rd), nobody())
    for path in (rd, rd / "plugin", rd / "plugin" / "trainer_plugin" / "jobctl.py", rd / "job.json", rd / "link"):
        assert path.lstat().st_uid == NOBODY.pw_uid, path
    assert outside.stat().st_uid == 0  # the link was handed over, not what it points at
    assert owned_by(str(rd / "snapshot.request"), NOBODY.pw_uid)
    assert owned_by(str(rd / "not-yet" / "deeper" / "file"), NOBODY.pw_uid)  # the nearest existing directory
    assert not owned_by(str(tmp_path / "elsewhere"), NOBODY.pw_uid)


@needs_root
def test_a_run_directory_someone_else_could_write_is_not_given_and_nothing_in_it_changes_hands(
    tmp_path: Path,
) -> None:
    rd = tmp_path / "run"
    (rd / "open").mkdir(parents=True)
    (rd / "open").chmod(0o777)  # anyone could have put something here
    (rd / "job.json").write_text("{}")
    with pytest.raises(ExecutorError, match="not a directory only the daemon could write"):
        give_run_dir(str(rd), nobody())
    assert {p.lstat().st_uid for p in (rd, rd / "open", rd / "job.json")} == {0}
