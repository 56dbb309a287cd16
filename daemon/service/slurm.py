"""How the daemon serves a Slurm target: one executor for every run, plus what Slurm says of a job's end.

The follow, the stop fallback and the final state are the same as on every target (the run
directory is on the shared workdir); a job's end marker wakes the follow as a local run's exit
does, and the target's queue is still read whole at every poll (`sweeps_every_poll`). What only a scheduler adds is said here: a run whose job
Slurm ended without the wrapper's exit code (its time limit, a node failure, a preemption, its
memory) gets a message that says so and what to do; `status` shows the Slurm job; and a job
named for a run that has ended (a submit that went through after its run was given up) is
cancelled, at start and every few minutes, so no run ever has a second job.

Under a root daemon a user's job is submitted, read and cancelled as that user
(`executors/slurm/as_user.py`): each user's runs of a target share an executor of their own
(one probe per poll each), and a run that cannot be acted on as its user (a login node that is
not theirs, an account gone) is refused with what to do, never done as root.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from daemon.service.api import ApiError
from daemon.service.models import RunRecord
from daemon.service.targets import Supervision
from executors.base import Executor, ExecutorError, JobState, JobStatus
from executors.factory import make_scheduler_executor
from executors.slurm import as_user
from executors.slurm.states import SlurmJob, end_message, lost_message

if TYPE_CHECKING:
    from executors.config import SlurmTarget
    from executors.slurm.executor import SlurmExecutor

log = structlog.get_logger("obd.slurm")
ORPHAN_CHECK_INTERVAL = 300.0  # how often jobs of ended runs are looked for
ORPHAN_AGE = 60.0  # a run ended this long ago has no business with a job still in Slurm
ACCOUNT_TTL = 60.0  # how long whom a user's runs are submitted as is kept before the account database is asked again


class SlurmJobs(Protocol):
    """What a Slurm target's executor tells of its jobs, beyond the `Executor` protocol."""

    last_seen: dict[str, SlurmJob]  # run directory -> its job as the last probe saw it
    last_status: dict[str, JobStatus]
    settled_by_marker: set[str]  # run directories whose end the wrapper's end marker settled

    async def slurm_job(self, remote_dir: str, *, wait: float = 0.0) -> SlurmJob | None: ...

    async def obd_jobs(self) -> list[SlurmJob]: ...

    async def scancel(self, job_id: str) -> None: ...

    def notable(self, job: SlurmJob | None) -> bool: ...


class SlurmSupervision(Supervision):
    """A Slurm target: the shared-executor supervision, with Slurm's word on how jobs ended."""

    config: SlurmTarget
    # An end marker is read the moment it is written; Slurm's queue still at every poll.
    sweeps_every_poll = True

    def __init__(self, daemon: Any, name: str, config: Any) -> None:
        super().__init__(daemon, name, config)
        self._explained: set[str] = set()  # runs whose lost job's message already says what Slurm did
        self._submitters: dict[int | None, tuple[float, as_user.Submitter]] = {}  # owner uid -> (when, whom)
        self._executors: dict[tuple[str, str | None], SlurmExecutor] = {}

    # --- one executor per account -----------------------------------------------------------------

    def submitter(self, record: RunRecord) -> as_user.Submitter:
        """Whom the run's Slurm commands run as (asked of the account database once a minute per user)."""
        uid = record.owner_uid
        now = time.monotonic()
        known = self._submitters.get(uid)
        if known is None or now - known[0] > ACCOUNT_TTL:
            known = (now, as_user.submitter(self.name, self.config, uid))
            self._submitters[uid] = known
        return known[1]

    def executor_key(self, record: RunRecord) -> str:
        """The target's name, with the user's uid for a user's runs under a root daemon (their own probe)."""
        key = self.submitter(record).key
        return f"{self.name}/{key}" if key else self.name

    def executor(self, record: RunRecord) -> Executor:
        return self._account_executor(record)

    def _account_executor(self, record: RunRecord) -> SlurmExecutor:
        """The executor of the run's account, made by the factory once per account."""
        submitter = self.submitter(record)
        cache = (submitter.key, submitter.refusal)
        if cache not in self._executors:
            self._executors[cache] = make_scheduler_executor(self.name, self.config, submitter)
        return self._executors[cache]

    def workdir(self, record: RunRecord) -> str:
        """The workdir; a run that cannot be submitted as its user, or that has no working directory
        the cluster can see, is refused here, before it is saved."""
        refusal = self.submitter(record).refusal
        if refusal is not None:
            raise ApiError(refusal, "denied")
        self._check_cwd(record)
        return super().workdir(record)

    def _check_cwd(self, record: RunRecord) -> None:
        """A new run through a login node needs --cwd: the directory `obd train start` ran in is on
        the daemon's machine, which the login node and the compute nodes are not assumed to share,
        so it cannot be the job's working directory as sbatch's submit directory would be; --cwd
        uploads it. (Without `login` the cluster shares the daemon's files and that directory is
        the default.) A retry's attempt or a resume keeps what its run had."""
        login = self.config.login
        if login is None or record.cwd or record.attempt > 1 or record.resumed_from:
            return
        raise ApiError(
            f"target {self.name} submits through its login node {login.host}, which does not see this machine's "
            "files, so the job cannot start in the directory you ran `obd train start` in, as sbatch would: "
            "give --cwd DIR to upload DIR into the run's directory on the cluster (src/) and run there "
            f"(`obd train start --target {self.name} --cwd . -- COMMAND` for this one); nothing was started",
            "usage",
        )

    def poll_interval(self, record: RunRecord) -> float:
        """The remote interval even where the cluster shares the daemon's files: every poll asks squeue."""
        d = self.daemon.config.daemon
        return min(d.remote_poll_interval, self.daemon.config.stop.request_poll)

    async def prepare(self, record: RunRecord) -> Executor:
        """The run's executor; a queued run whose user can no longer be acted as fails its launch saying why."""
        refusal = self.submitter(record).refusal
        if refusal is not None:
            raise ExecutorError(refusal)
        return self.executor(record)

    async def aclose(self) -> None:
        await super().aclose()
        for executor in self._executors.values():
            with contextlib.suppress(Exception):
                await executor.aclose()

    def slurm(self, record: RunRecord) -> SlurmJobs:
        """The run's executor as what it tells of its Slurm jobs."""
        return self._account_executor(record)

    def _job(self, record: RunRecord) -> SlurmJob | None:
        return self.slurm(record).last_seen.get(record.remote_dir)

    # --- the end of a run ---------------------------------------------------------------------

    def explain_lost(self, record: RunRecord, message: str) -> str:
        """A job with no exit code: what Slurm said of it (TIMEOUT, NODE_FAIL, ...) and what to do."""
        self._explained.add(record.id)
        status = self.slurm(record).last_status.get(record.remote_dir)
        return lost_message(
            self._job(record),
            record.id,
            time_limit=self.config.time,
            signal_margin=self.config.signal_margin,
            command_exit=status.exit_code if status is not None else None,
        )

    async def on_end(self, record: RunRecord) -> str:
        """Slurm's end state, cross-checked with `scontrol show job` (or sacct), when it says more than the exit code."""
        try:
            return await self._end_note(record)
        finally:  # the run is over: what the probes kept of it goes
            executor = self.slurm(record)
            executor.last_seen.pop(record.remote_dir, None)
            executor.last_status.pop(record.remote_dir, None)
            executor.settled_by_marker.discard(record.remote_dir)

    async def _end_note(self, record: RunRecord) -> str:
        if record.id in self._explained:
            self._explained.discard(record.id)
            return ""
        if not record.job or self._job(record) is None:
            return ""  # never submitted (a failed launch): nothing in Slurm to ask about
        if record.remote_dir in self.slurm(record).settled_by_marker:
            return ""  # the command's own end, with no sign of Slurm's hand: Slurm has nothing to add
        status = self.slurm(record).last_status.get(record.remote_dir)
        clean = status is not None and status.state == JobState.exited and status.exit_code == 0
        try:
            # A clean exit is not waited for (its end is recorded at once); a failure waits a little
            # for Slurm to finish ending the job, so OUT_OF_MEMORY or NODE_FAIL can be told.
            job = await self.slurm(record).slurm_job(record.remote_dir, wait=0.0 if clean else 2.0)
        except ExecutorError as exc:
            log.warning("slurm_end_state_unknown", run_id=record.id, error=str(exc))
            return ""
        if job is None or not self.slurm(record).notable(job):
            return ""
        return end_message(job, record.id, time_limit=self.config.time, signal_margin=self.config.signal_margin)

    async def describe(self, record: RunRecord) -> dict[str, Any]:
        """The run's Slurm job as the last poll saw it: id, state, reason, nodes."""
        job = self._job(record)
        return {"slurm": job.model_dump(exclude_none=True, exclude={"source"})} if job is not None else {}

    # --- jobs no run owns ------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """At start: cancel the jobs of runs that already ended (a submit that outlived its run's launch)."""
        await self._end_orphans()

    async def periodically(self) -> None:
        while True:
            await anyio.sleep(ORPHAN_CHECK_INTERVAL)
            await self._end_orphans()

    async def _end_orphans(self) -> None:
        """For each account with runs on the target: its jobs of runs that ended, listed and cancelled as it."""
        groups: dict[str, list[RunRecord]] = {}
        for record in self.daemon.records.values():
            if record.target == self.name:
                groups.setdefault(self.executor_key(record), []).append(record)
        for key, records in groups.items():
            if self.submitter(records[0]).refusal is None:
                await self._end_orphans_of(key, records)

    async def _end_orphans_of(self, key: str, records: list[RunRecord]) -> None:
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout * 3):
                jobs = await self.slurm(records[0]).obd_jobs()
        except (ExecutorError, TimeoutError, OSError) as exc:
            log.warning("slurm_orphan_check_deferred", target=key, error=str(exc))
            return
        now = time.time()
        runs = {r.id: r for r in records}
        for job in jobs:
            record = runs.get((job.name or "")[len("obd-") :])
            if record is None or not record.state.final or not job.job_id:
                continue  # not this account's run, or its run still has it
            ended = record.history[-1].time if record.history else record.created
            if now - ended < ORPHAN_AGE:
                continue  # the job of a run that just ended is still being torn down
            log.warning("slurm_orphan_cancelled", target=self.name, run_id=record.id, job_id=job.job_id)
            await self.slurm(record).scancel(job.job_id)
            async with self.daemon.editing(record):
                record.note(f"Slurm job {job.job_id} of this run was still {job.state} after the run ended: cancelled")
