"""The Slurm executor: sbatch, squeue and scancel on the machine where they work.

That machine is this one (`login` unset) or a login node reached over SSH; either way it is an
executor of its own (local or SSH: its connection, known hosts and quoting), which this one
composes: files move through it, and Slurm's commands run there through obd's helper
(`trainer_plugin/tools/slurm_batch.py`, installed under `<workdir>/.obd/`). The run directory is on
the workdir the compute nodes share, so the job wrapper on a node writes `job.pid`,
`exit_code`, requests and proofs where the daemon reads them.

A run's handle holds the Slurm job id where other targets hold a pid. A probe of every run of
the executor is one helper call, which asks `squeue` once.

Under a root daemon each user's runs have an executor of their own (`as_user.py`): with `login`
unset it runs the helper and Slurm's commands as that user, so the job is submitted, read and
cancelled as them and runs as them; its run directory is theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from executors.base import (
    CommandResult,
    ExecIO,
    ExecSpec,
    Executor,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    LaunchUncertain,
    Reached,
    RunAs,
    RunEvents,
    RunProbe,
    TargetUnreachable,
)
from executors.remote import tools_hash
from executors.slurm import as_user, script
from executors.slurm.config import SlurmTarget
from executors.slurm.events import SlurmEvents
from executors.slurm.states import NOTABLE, SlurmJob, parse_sacct, parse_scontrol
from executors.ssh.config import SshTarget
from trainer_plugin import rundir
from trainer_plugin.tools import contain, jobctl, slurm_batch

log = structlog.get_logger("obd.slurm")

# What the helper needs beside it on the submitting machine.
HELPER_FILES: tuple[Path, ...] = (
    Path(slurm_batch.__file__),
    Path(jobctl.__file__),
    Path(rundir.__file__),
    Path(contain.__file__),  # jobctl imports it
)
_ENDED = frozenset({JobState.lost, JobState.cancelled})


HELPER_HASH = tools_hash(HELPER_FILES)


def slurm_job_id(spec: ExecSpec) -> str:
    """The Slurm job of a run, as its handle names it; refused when it has none (yet)."""
    described = spec.job.host if spec.job is not None else ""
    job_id = described.removeprefix("slurm job ").strip()
    if not described.startswith("slurm job ") or not job_id:
        raise ExecutorError(
            f"run {spec.run_id} has no Slurm job on record yet; `obd train status {spec.run_id}` says where it is"
        )
    return job_id


def host_executor(name: str, target: SlurmTarget) -> Executor:
    """The executor of the machine where sbatch works: this one, or the login node over SSH."""
    if target.login is None:
        from executors.local import LocalExecutor

        return LocalExecutor(name, Path(target.workdir).expanduser(), target.python, target.venv)
    from executors.ssh import SshExecutor

    # Every SSH setting of the login node is one of an SSH target's (a field it lacked would be
    # refused here); the workdir and Python are the cluster's.
    ssh = SshTarget(
        kind="ssh", **target.login.model_dump(), workdir=target.workdir, python=target.python, venv=target.venv
    )
    return SshExecutor(name, ssh)


class SlurmExecutor:
    """Runs jobs on a Slurm cluster; see the module docstring for how."""

    events: RunEvents | None = None

    def __init__(
        self,
        name: str,
        target: SlurmTarget,
        *,
        host: Executor | None = None,
        settle: float = 5.0,
        submitter: as_user.Submitter | None = None,
    ) -> None:
        self.name = name
        self.target = target
        # Whom Slurm's commands run as: the daemon's own user (or the login's), a user of a root
        # daemon, or no one (a refusal every operation raises).
        self.submitter = submitter if submitter is not None else as_user.Submitter()
        if self.account is not None and target.login is not None:
            raise ValueError("a login node's jobs run as its SSH user: they cannot be submitted as another")
        self.host = host if host is not None else host_executor(name, target)
        # A job Slurm ended with no exit code in its run directory is reported ended only after
        # this long: on a shared filesystem the wrapper's last write may reach the login node late.
        self.settle = settle
        self._helper: str | None = None
        self._helper_lock = anyio.Lock()
        self._ended_seen: dict[str, float] = {}
        self.last_seen: dict[str, SlurmJob] = {}  # run directory -> its job as the last probe saw it
        self.last_status: dict[str, JobStatus] = {}  # run directory -> its status in the last probe
        # Run directories whose end their wrapper's end marker settled, with no Slurm command.
        self.settled_by_marker: set[str] = set()
        self.compute_nodes = ComputeNodes(self)
        # Where the daemon sees the shared workdir, it learns of end markers as they are written.
        self.events: RunEvents | None = SlurmEvents() if target.login is None else None

    @property
    def shares_filesystem(self) -> bool:
        """Whether the cluster sees the daemon's files: with sbatch on this machine (no `login`), the
        daemon's filesystem is the cluster's, so a run's working directory (the one `obd train start`
        ran in, or --cwd) is used where it is, as sbatch's submit directory would be, not uploaded.
        Through a login node it is not: a --cwd is uploaded into the run directory (src/)."""
        return self.target.login is None

    # --- whose commands -------------------------------------------------------------------------

    @property
    def account(self) -> RunAs | None:
        """The user this executor submits, reads and cancels as on this machine; None: its own."""
        return self.submitter.account if self.submitter.refusal is None else None

    @property
    def runs_as_caller(self) -> bool:
        """Whether the job of a run's caller runs as them (the launch then names them in the JobSpec)."""
        return self.account is not None

    def _refuse(self) -> None:
        """Raise the refusal, where this executor's runs cannot be acted on as their user."""
        if self.submitter.refusal is not None:
            raise ExecutorError(self.submitter.refusal)

    # --- the machine where sbatch works --------------------------------------------------------

    @property
    def workdir(self) -> str:
        return self.host.workdir

    async def resolve_workdir(self) -> str:
        return await self.host.resolve_workdir()

    async def reach(self) -> Reached:
        reached = await self.host.reach()
        return Reached(where=f"{reached.where} (sbatch there)", trust=reached.trust, workdir=reached.workdir)

    async def python(self) -> str:
        if self.target.login is None and self.target.venv:
            return str(Path(self.target.venv).expanduser() / "bin" / "python")
        return await self.host.python()

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """A command where sbatch works, as this executor's account (a root daemon's user: as them)."""
        self._refuse()
        if self.account is not None:
            return await as_user.run(self.account, argv, stdin=stdin, timeout=timeout)
        return await self.host.run_command(argv, stdin=stdin, timeout=timeout)

    async def aclose(self) -> None:
        await self.host.aclose()

    async def install_helper(self) -> str:
        """The helper's path there, installed under `<workdir>/.obd/` once per executor (same content, same place)."""
        async with self._helper_lock:
            if self._helper is None:
                workdir = (await self.resolve_workdir()).rstrip("/")
                where = f"{workdir}/.obd/slurm-{HELPER_HASH}"
                files = {f"{where}/{path.name}": path.read_bytes() for path in HELPER_FILES}
                if self.target.login is None:
                    # As the daemon, readable by the users whose commands run it, and checked.
                    await anyio.to_thread.run_sync(install_locally, workdir, where, files)
                else:
                    for path, data in files.items():
                        await self.host.put_file(path, data)
                self._helper = f"{where}/{Path(slurm_batch.__file__).name}"
            return self._helper

    async def _call(self, what: str, args: list[str], stdin: bytes = b"", *, timeout: float = 60.0) -> Any:
        """Run the helper with these arguments; its JSON answer. ExecutorError says what failed."""
        self._refuse()
        helper = await self.install_helper()
        python = await self.python()
        result = await self.run_command([python, helper, *args], stdin=stdin, timeout=timeout)
        if result.returncode == 2 and b"can't open file" in result.stderr:
            # Someone removed obd's files under the workdir: install them again, once.
            self._helper = None
            helper = await self.install_helper()
            result = await self.run_command([python, helper, *args], stdin=stdin, timeout=timeout)
        if result.returncode != 0:
            lines = result.stderr.decode(errors="replace").strip().splitlines() or [f"exit {result.returncode}"]
            raise ExecutorError(f"{what} on target {self.name} failed: {' | '.join(lines[-3:])}")
        try:
            return json.loads(result.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError) as exc:
            raise ExecutorError(f"{what} on target {self.name} printed no answer: {result.stdout[-300:]!r}") from exc

    # --- jobs ------------------------------------------------------------------------------------

    async def spawn(self, job: JobSpec) -> JobHandle:
        """Write the run's job files and batch script, give the run directory to the job's user,
        then submit it once, as them; the handle names the Slurm job."""
        self._refuse()
        self._check_run_as(job)
        rd = job.remote_dir.rstrip("/")
        paths = rundir.RunPaths(rd)
        python = await self.python()
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [paths.plugin],
            "path_prepend": [str(Path(python).parent)] if self.target.venv else [],
            "umask": job.umask,
            "output_to": job.output_to,
        }
        await self.host.put_file(paths.job_spec, json.dumps(spec).encode())
        plan = script.launch_plan(self.target, python, job.time_limit)
        await self.host.put_file(paths.slurm_launch, json.dumps(plan).encode())
        await self.host.put_file(paths.slurm_script, script.batch_script(python, rd, job.run_id).encode())
        if self.account is not None:
            # The job (on the nodes) and the helper (here) write in it as the user.
            await anyio.to_thread.run_sync(reachable_workdir, os.path.dirname(rd))
            await anyio.to_thread.run_sync(give_run_dir, rd, self.account)
        request = {
            "sbatch": script.sbatch_arguments(self.target, job.run_id, rd, job.time_limit, job.stop_lead),
            "script": paths.slurm_script,
            # The job's values reach sbatch's environment on the helper's stdin, never a command line.
            "env": {**job.env, **job.secrets},
        }
        try:
            answer = await self._call(
                f"the submit of run {job.run_id}", ["submit", rd], json.dumps(request).encode(), timeout=180
            )
        except (TargetUnreachable, TimeoutError) as exc:
            # The submit may have gone through: never submitted again; the probe finds the job by name.
            raise LaunchUncertain(
                f"{exc or 'the submit did not answer in time'}; whether Slurm took the job is not known yet"
            ) from exc
        except ExecutorError as exc:
            raise ExecutorError(f"{exc}; `obd targets check {self.name}` checks the target's Slurm settings") from exc
        job_id = str(answer["job_id"])
        user = self.account.user if self.account is not None else None
        log.info(
            "slurm.submitted",
            target=self.name,
            run_id=job.run_id,
            job_id=job_id,
            user=user,
            reused=answer.get("reused"),
        )
        return JobHandle.model_validate(slurm_batch.slurm_handle(job_id))

    def _check_run_as(self, job: JobSpec) -> None:
        """A job is submitted only as the user the launch named: never someone else's account."""
        if job.run_as is None or (self.account is not None and job.run_as.uid == self.account.uid):
            return
        submits_as = self.account.user if self.account is not None else "the daemon's own user"
        raise ExecutorError(
            f"run {job.run_id} is {job.run_as.user}'s, but target {self.name}'s executor for it submits as "
            f"{submits_as}: nothing was submitted; start the run again (a daemon restart clears this)"
        )

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        return (await self.probe([(handle, remote_dir)]))[0].status

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        """A command in the run's Slurm job, as a step beside it (`srun --jobid J --overlap`, with
        `--pty` for a shell), run where sbatch works as the job's user: its allocation (nodes,
        GPUs as Slurm gives them) and its run directory."""
        self._refuse()
        job_id = slurm_job_id(spec)
        command = spec.command or ["/bin/sh", "-c", 'exec "${SHELL:-/bin/sh}" -l']
        step = ["srun", f"--jobid={job_id}", "--overlap", "--nodes=1", "--ntasks=1", "--quiet"]
        if spec.tty is not None:
            step.append("--pty")
        there = spec.model_copy(update={"command": [*step, *command], "run_as": self.account})
        return await self.host.exec_in_run(there, io)

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        """Every run directory and one `squeue` for all their jobs, in one helper call; where the
        daemon sees the shared workdir, a run whose end marker settles its end is read here first,
        with no Slurm command (docs/slurm.md, "How a run's end is recorded")."""
        if not runs:
            return []
        known: dict[str, RunProbe] = {}
        if self.shares_filesystem:
            known = await self._probe_settled([d for _, d in runs])
        rest = [(h, d) for h, d in runs if d not in known]
        for probe in known.values():
            self.settled_by_marker.add(probe.remote_dir)
            self.last_status[probe.remote_dir] = probe.status
        if not rest:
            return [known[d] for _, d in runs]
        items = [{"dir": d, "job_id": str(h.pid) if h is not None and h.pid > 0 else None} for h, d in rest]
        answer = await self._call("a probe", ["probe"], json.dumps({"runs": items}).encode())
        if answer.get("squeue_error"):
            raise TargetUnreachable(
                f"Slurm's controller did not answer squeue on target {self.name}: {answer['squeue_error']}; "
                "jobs keep running, and obd reads them again on the next poll"
            )
        now = time.monotonic()
        for raw in answer["probes"]:
            seen = SlurmJob.model_validate({**(raw.pop("slurm", None) or {}), "source": "squeue"})
            probe = RunProbe.model_validate(raw)
            if seen.job_id:
                self.last_seen[probe.remote_dir] = seen
            probe = self._settled(probe, now)
            self.last_status[probe.remote_dir] = probe.status
            known[probe.remote_dir] = probe
        return [known[d] for _, d in runs]

    async def _probe_settled(self, dirs: list[str]) -> dict[str, RunProbe]:
        """The runs whose files alone settle their end (`slurm_batch.probe_settled`), read on this machine."""

        def read() -> list[dict | None]:
            return [slurm_batch.probe_settled(d) for d in dirs]

        # abandon_on_cancel: a read stuck in a network filesystem is left behind, not waited for.
        found = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        return {d: RunProbe.model_validate(p) for d, p in zip(dirs, found, strict=True) if p is not None}

    def _settled(self, probe: RunProbe, now: float) -> RunProbe:
        """A job Slurm ended with no exit code written stays `running` for `settle` seconds first."""
        key = probe.remote_dir
        ended_by_slurm = probe.status.state in _ENDED and probe.status.exit_code is None
        if not ended_by_slurm or self.settle <= 0:
            self._ended_seen.pop(key, None)
            return probe
        first = self._ended_seen.setdefault(key, now)
        if now - first >= self.settle:
            self._ended_seen.pop(key, None)
            return probe
        detail = f"ended in Slurm ({probe.status.detail}); waiting for its exit code"
        return probe.model_copy(update={"status": JobStatus(state=JobState.running, detail=detail)})

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        """scancel the job (Slurm's TERM, KILL after `grace`), then mark the run cancelled; one helper call."""
        args = ["cancel", remote_dir, "--grace", repr(float(grace))]
        if handle.pid > 0:
            args += ["--job-id", str(handle.pid)]
        answer = await self._call(f"the cancel of {remote_dir}", args, timeout=grace + 180)
        return JobStatus.model_validate(answer)

    # --- what Slurm says of one job (the end of a run, `obd targets check`) -----------------------

    async def slurm_job(self, remote_dir: str, *, wait: float = 0.0) -> SlurmJob | None:
        """The run's job from `scontrol show job` (or sacct once Slurm's controller forgot it),
        waiting up to `wait` seconds for Slurm to finish ending it; else what the last probe saw."""
        seen = self.last_seen.get(remote_dir)
        if seen is None or not seen.job_id:
            return seen
        deadline = time.monotonic() + wait
        while True:
            found = await self._scontrol(seen.job_id) or await self._sacct(seen.job_id)
            state = (found.state if found else "") or ""
            ending = state in slurm_batch.ACTIVE_STATES or state in slurm_batch.PENDING_STATES
            if found is not None and (not ending or time.monotonic() >= deadline):
                return found
            if found is None or time.monotonic() >= deadline:
                return found or seen
            await anyio.sleep(0.3)

    async def _scontrol(self, job_id: str) -> SlurmJob | None:
        with anyio.move_on_after(30):
            result = await self.run_command(["scontrol", "show", "job", "--oneliner", job_id], timeout=30)
            if result.returncode == 0:
                return parse_scontrol(result.stdout.decode(errors="replace"))
        return None

    async def _sacct(self, job_id: str) -> SlurmJob | None:
        argv = ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id]
        with anyio.move_on_after(30):
            result = await self.run_command([*argv, "--format=JobID,State,ExitCode,NodeList,Reason"], timeout=30)
            if result.returncode == 0:
                return parse_sacct(result.stdout.decode(errors="replace"))
        return None

    async def obd_jobs(self) -> list[SlurmJob]:
        """The submitting user's jobs that obd made (named `obd-<run id>`) and Slurm still runs or queues."""
        argv = ["squeue", "--me", "--noheader", "--states=PENDING,RUNNING,SUSPENDED,CONFIGURING", "--format=%i|%j|%T"]
        result = await self.run_command(argv, timeout=60)
        if result.returncode != 0:
            raise TargetUnreachable(f"squeue on target {self.name}: {result.stderr.decode(errors='replace').strip()}")
        jobs = []
        for line in result.stdout.decode(errors="replace").splitlines():
            parts = line.split("|")
            if len(parts) == 3 and parts[1].startswith("obd-"):
                jobs.append(SlurmJob(job_id=parts[0], name=parts[1], state=parts[2], source="squeue"))
        return jobs

    async def scancel(self, job_id: str) -> None:
        """End one job that no run owns any more (a second submit that got through), as its user."""
        await self.run_command(["scancel", job_id], timeout=60)

    @staticmethod
    def notable(job: SlurmJob | None) -> bool:
        """Whether Slurm's end state says more than the exit code does (a time limit, a node, memory)."""
        return job is not None and (job.state or "").split("+")[0] in NOTABLE

    # --- files ------------------------------------------------------------------------------------

    # Files move through the submitting machine's executor, which (on this machine, under a root
    # daemon) acts in a run directory with its owner's rights.

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        self._refuse()
        return await self.host.read_from(path, offset, limit)

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        self._refuse()
        return await self.host.checkpoint_sizes(remote_dir)

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        """Through the submitting machine's executor, as its run directories go (on this machine
        with the run directory's owner's rights, over SSH as the login's user)."""
        self._refuse()
        return await self.host.remove_checkpoint(remote_dir, name)

    async def put_file(self, path: str, data: bytes) -> None:
        """Write a file there; in a directory that is a user's (their run directory, once given to
        them), through the helper running as them, so the file is theirs and their job reads it."""
        self._refuse()
        if self.account is not None and await anyio.to_thread.run_sync(owned_by, path, self.account.uid):
            await self._call(f"the write of {path}", ["put", path], data)
            return
        await self.host.put_file(path, data)

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        """The run directory on the shared workdir, made by the submitting machine's executor and
        given to the user the job is submitted as (a login node's: its SSH user's, as made there)."""
        self._refuse()
        if owner is not None and self.account is not None and owner.uid != self.account.uid:
            raise ExecutorError(f"{remote_dir} is for {owner.user}, but this executor submits as {self.account.user}")
        maker = getattr(self.host, "make_run_dir", None)
        if maker is not None:
            await maker(remote_dir, self.account)
        elif self.target.login is None:
            # The daemon's and private until the spawn gives it, with what obd put in it, to the user.
            await anyio.to_thread.run_sync(private_run_dir, remote_dir)
        if self.account is not None:
            await anyio.to_thread.run_sync(reachable_workdir, os.path.dirname(remote_dir.rstrip("/")))

    async def upload(self, local: Path, remote: str) -> None:
        self._refuse()
        await self.host.upload(local, remote)

    async def download(self, remote: str, local: Path) -> None:
        self._refuse()
        await self.host.download(remote, local)


class ComputeNodes:
    """A capability for `obd targets check`: the cluster's partitions, and a command on a compute node."""

    def __init__(self, executor: SlurmExecutor) -> None:
        self._executor = executor

    @property
    def partition(self) -> str | None:
        """The partition jobs go to (None: the cluster's default)."""
        return self._executor.target.partition

    def sinfo_argv(self) -> list[str]:
        """Lists the partitions: `name|availability|nodes|node states`, the default one marked `*`."""
        return ["sinfo", "--noheader", "--format=%P|%a|%D|%t"]

    def on_a_node(self, argv: list[str], *, seconds: int = 120) -> list[str]:
        """`srun` of this command on one compute node, with the target's partition, account and qos."""
        target = self._executor.target
        options = [
            f"--{k}={v}"
            for k, v in (("partition", target.partition), ("account", target.account), ("qos", target.qos))
            if v
        ]
        minutes = max(1, seconds // 60)
        return [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            "--job-name=obd-check",
            f"--time={minutes}",
            "--quiet",
            *options,
            *argv,
        ]


# --- obd's files on this machine ------------------------------------------------------------------


def install_locally(workdir: str, where: str, files: dict[str, bytes]) -> None:
    """Install the helper at `where` (under `<workdir>/.obd/`) as the daemon: readable by every
    user whose Slurm commands run it, writable by the daemon alone, and checked to be so (a
    helper someone else could rewrite would run their code as the daemon and as every user)."""
    os.makedirs(workdir, mode=0o711, exist_ok=True)
    _check_workdir(workdir)
    reachable_workdir(workdir)
    for directory in (os.path.dirname(where), where):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
        _own_directory(directory)
        os.chmod(directory, 0o755)  # whatever the daemon's umask (systemd's 0022, or 0077)
    for path, data in files.items():
        rundir.atomic_write(path, data)
        os.chmod(path, 0o644)  # just renamed into a directory only the daemon can write


def _check_workdir(workdir: str) -> None:
    """A root daemon's workdir must not let others replace obd's helper or a run directory."""
    if os.geteuid() != 0:
        return  # a user's own daemon: the workdir is that user's to choose
    st = os.stat(workdir)
    open_to_others = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
    if st.st_uid != 0 or open_to_others:
        raise ExecutorError(
            f"workdir {workdir} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}: under a root "
            "daemon others could replace obd's helper or a run directory there; make it root's and not writable "
            f"by others (`chown root {workdir}; chmod 711 {workdir}`)"
        )


def reachable_workdir(workdir: str) -> None:
    """Under a root daemon, let users through the workdir (a+x, not listable): their Slurm commands
    run obd's helper there and their jobs write their run directories. The daemon's umask (0077)
    made a workdir it created 0700; one of someone else's is left as it is."""
    st = os.lstat(workdir)
    if os.geteuid() == 0 and stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and st.st_mode & 0o011 != 0o011:
        os.chmod(workdir, stat.S_IMODE(st.st_mode) | 0o711)


def _own_directory(path: str) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise ExecutorError(
            f"{path} is not a directory of the daemon's user (uid {st.st_uid}): obd's helper there could be "
            f"someone else's code; remove it (`rm -r {path}`), obd installs it again"
        )


def owned_by(path: str, uid: int) -> bool:
    """Whether the nearest existing directory above `path` belongs to `uid` (links not followed)."""
    here = os.path.dirname(path.rstrip("/"))
    while here and here != "/":
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            here = os.path.dirname(here)
            continue
        return stat.S_ISDIR(st.st_mode) and st.st_uid == uid
    return False


def private_run_dir(remote_dir: str) -> None:
    """A run directory of the daemon's only (0700), made now or by an earlier try of the launch."""
    os.makedirs(os.path.dirname(remote_dir.rstrip("/")), mode=0o711, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(remote_dir, 0o700)


def give_run_dir(remote_dir: str, account: RunAs) -> None:
    """Give a run directory to the user its job runs as, with everything obd put in it.

    One already theirs (made for them) is left as it is. Otherwise it must be the daemon's, with
    no directory in it anyone else could write: then only the daemon put anything there, and
    each entry is handed over without following a link, the run directory itself last.
    """
    st = os.lstat(remote_dir)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == account.uid:
        return
    me = os.geteuid()
    for root, _dirs, _files in os.walk(remote_dir):  # first, check: nothing is handed over yet
        here = os.lstat(root)
        if not stat.S_ISDIR(here.st_mode) or here.st_uid != me or here.st_mode & 0o022:
            raise ExecutorError(
                f"{root} is not a directory only the daemon could write (uid {here.st_uid}, mode "
                f"{stat.S_IMODE(here.st_mode):o}): it is not given to {account.user}, and nothing was submitted; "
                "start the run again"
            )
    for root, dirs, files in os.walk(remote_dir, topdown=False):  # then each directory after what is in it
        for name in dirs + files:
            os.lchown(os.path.join(root, name), account.uid, account.gid)
    os.lchown(remote_dir, account.uid, account.gid)
