"""Whose Slurm job a run's job is, and how a root daemon acts as that user on this machine.

The contract's rule: a Slurm job of a user is submitted as that user. A root daemon whose
target submits on this machine (no `login`) runs Slurm's commands (sbatch, squeue, scancel,
scontrol) and obd's helper as the run's owner: a child process with the owner's uid, gid and
groups (`subprocess`'s `user=`, `group=`, `extra_groups=`), so munge authenticates the owner,
slurmctld records them as the job's user, slurmd starts the job as them, and every file the
helper writes in the run directory is written with their rights.

Why not `sbatch --uid/--gid` (which Slurm 22.05 accepts from root): only sbatch has it (squeue,
scancel and scontrol would still act as root, and a root scancel cancels anyone's job), its man
page says the invoking user's (root's) credentials decide which partitions the job may use,
and the helper that writes the submit's record in the run directory would still be root in a
directory the user owns. Running the commands as the user needs nothing but munge and the
account database every node already shares.

Where it cannot be done the run is refused with what to do: a target that submits through an
SSH login node runs every job as that login's user, so a root daemon accepts there only runs of
root and of the login's own user; a run whose owner has no account here any more is neither
read nor cancelled as anyone else.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
from dataclasses import dataclass

import anyio
import anyio.to_thread

from executors.base import CommandResult, RunAs
from executors.slurm.config import SlurmTarget

# What of the daemon's environment the user's Slurm commands get (the daemon's secrets never):
# where Slurm's config is, the language and time zone; the user's own HOME, USER and LOGNAME.
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "SLURM_CONF", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
USER_UMASK = 0o077  # what the helper writes (and sbatch hands the job as SLURM_UMASK) is the user's alone


@dataclass(frozen=True)
class Submitter:
    """Who a run's Slurm commands run as: `account` (None: the daemon's own user, or the SSH
    login's), or `refusal`, why they cannot run at all and what to do."""

    account: RunAs | None = None
    refusal: str | None = None
    owner_uid: int | None = None

    @property
    def key(self) -> str:
        """A name for it, unique within a target: runs with the same one share an executor (one
        probe per poll); empty for the daemon's own account."""
        if self.account is None and self.refusal is None:
            return ""
        return f"uid {self.owner_uid}"


def submitter(name: str, target: SlurmTarget, owner_uid: int | None, *, daemon_uid: int | None = None) -> Submitter:
    """Whom a run of `owner_uid` on target `name` is submitted as, or why it cannot be.

    A daemon that is not root acts as its own user for every run (the launch already refused
    other callers). A root daemon acts as root for root's runs, and as the owner for anyone
    else's: on this machine as that account, through a login node only when the login is theirs.
    """
    me = os.geteuid() if daemon_uid is None else daemon_uid
    if me != 0 or owner_uid is None or owner_uid in (0, me):
        return Submitter()
    try:
        pw = pwd.getpwuid(owner_uid)
    except KeyError:
        return Submitter(refusal=no_account(name, owner_uid), owner_uid=owner_uid)
    account = RunAs(
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        groups=sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))),
        user=pw.pw_name,
        home=pw.pw_dir,
    )
    if target.login is None:
        return Submitter(account=account, owner_uid=owner_uid)
    if target.login.user == pw.pw_name:
        return Submitter()  # the login is the user's own account: the job runs as them over SSH
    return Submitter(account=account, refusal=login_not_theirs(name, target, pw.pw_name), owner_uid=owner_uid)


def no_account(name: str, uid: int) -> str:
    return (
        f"the owner of this run (uid {uid}) has no account on this machine, and obd submits, reads and "
        f"cancels a Slurm job of target {name} only as its user: restore the account (same uid), or end "
        f"the job as root with `scancel --user={uid}`"
    )


def login_not_theirs(name: str, target: SlurmTarget, user: str) -> str:
    login = target.login
    assert login is not None
    who = f"{login.user}@{login.host}" if login.user else f"the daemon's own user (root) at {login.host}"
    return (
        f"target {name} submits through its login node as {who}, so its Slurm jobs run as that account, "
        f"not as you ({user}), and obd submits a user's Slurm job only as that user: use a Slurm target "
        "without `login` (sbatch on the daemon's machine), ask the admin for a target whose `login.user` "
        "is your own account, or run your own daemon (`obd daemon`) with your own login node"
    )


def user_env(account: RunAs, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a command run as `account`: Slurm's config and the locale from the
    daemon's, the user's own HOME, USER and LOGNAME (sbatch's `--export=ALL` hands the job these)."""
    source = os.environ if environ is None else environ
    env = {k: v for k, v in source.items() if k in KEPT_ENV or k.startswith("LC_")}
    env.setdefault("PATH", DEFAULT_PATH)
    env.update(HOME=account.home, USER=account.user, LOGNAME=account.user)
    return env


async def run(account: RunAs, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
    """Run `argv` on this machine as `account` (uid, gid, groups, umask 077, the user's environment).

    The child is made with the standard library's `subprocess` (its `user=`, `group=` and
    `extra_groups=` are set in the child before exec), not anyio's wrapper of it: some anyio
    releases passed the wrong groups on. It runs in its own session and is killed when the
    timeout passes or the caller is cancelled; TimeoutError then, as for any command.
    """
    try:
        proc = await anyio.to_thread.run_sync(_start, account, argv)
    except (OSError, subprocess.SubprocessError) as exc:
        return CommandResult(returncode=127, stderr=f"{argv[0]} as {account.user}: {exc}".encode())
    try:
        with anyio.fail_after(timeout):
            out, err = await anyio.to_thread.run_sync(proc.communicate, stdin, abandon_on_cancel=True)
    finally:
        if proc.poll() is None:  # timed out or cancelled: the thread's communicate() then returns
            with contextlib.suppress(OSError):
                proc.kill()
    return CommandResult(returncode=proc.returncode, stdout=out, stderr=err)


def _start(account: RunAs, argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=user_env(account),
        cwd="/",
        user=account.uid,
        group=account.gid,
        extra_groups=account.groups or [account.gid],
        umask=USER_UMASK,
        start_new_session=True,
    )
