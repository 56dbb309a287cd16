"""How the daemon serves a Slurm target: one executor for every run, plus what Slurm says of a job's end.

The follow, the stop fallback and the final state are the same as on every target (the run
directory is on the shared workdir). What only a scheduler adds is said here: a run whose job
Slurm ended without the wrapper's exit code (its time limit, a node failure, a preemption, its
memory) gets a message that says so and what to do; `status` shows the Slurm job; and a job
named for a run that has ended (a submit that went through after its run was given up) is
cancelled, at start and every few minutes, so no run ever has a second job.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
import structlog

from daemon.models import RunRecord
from daemon.targets import Supervision
from executors.base import ExecutorError, JobState, JobStatus
from executors.slurm.states import SlurmJob, end_message, lost_message

if TYPE_CHECKING:
    from executors.config import SlurmTarget

log = structlog.get_logger("obd.slurm")
ORPHAN_CHECK_INTERVAL = 300.0  # how often jobs of ended runs are looked for
ORPHAN_AGE = 60.0  # a run ended this long ago has no business with a job still in Slurm


class SlurmJobs(Protocol):
    """What a Slurm target's executor tells of its jobs, beyond the `Executor` protocol."""

    last_seen: dict[str, SlurmJob]  # run directory -> its job as the last probe saw it
    last_status: dict[str, JobStatus]

    async def slurm_job(self, remote_dir: str, *, wait: float = 0.0) -> SlurmJob | None: ...

    async def obd_jobs(self) -> list[SlurmJob]: ...

    async def scancel(self, job_id: str) -> None: ...

    def notable(self, job: SlurmJob | None) -> bool: ...


class SlurmSupervision(Supervision):
    """A Slurm target: the shared-executor supervision, with Slurm's word on how jobs ended."""

    config: SlurmTarget

    def __init__(self, daemon: Any, name: str, config: Any) -> None:
        super().__init__(daemon, name, config)
        self._explained: set[str] = set()  # runs whose lost job's message already says what Slurm did

    def slurm(self, record: RunRecord) -> SlurmJobs:
        return cast("SlurmJobs", self.executor(record))

    def _job(self, record: RunRecord) -> SlurmJob | None:
        return self.slurm(record).last_seen.get(record.remote_dir)

    # --- the end of a run ---------------------------------------------------------------------

    def explain_lost(self, record: RunRecord, message: str) -> str:
        """A job with no exit code: what Slurm said of it (TIMEOUT, NODE_FAIL, ...) and what to do."""
        self._explained.add(record.id)
        return lost_message(
            self._job(record), record.id, time_limit=self.config.time, signal_margin=self.config.signal_margin
        )

    async def on_end(self, record: RunRecord) -> str:
        """Slurm's end state, cross-checked with `scontrol show job` (or sacct), when it says more than the exit code."""
        try:
            return await self._end_note(record)
        finally:  # the run is over: what the probes kept of it goes
            executor = self.slurm(record)
            executor.last_seen.pop(record.remote_dir, None)
            executor.last_status.pop(record.remote_dir, None)

    async def _end_note(self, record: RunRecord) -> str:
        if record.id in self._explained:
            self._explained.discard(record.id)
            return ""
        if not record.job or self._job(record) is None:
            return ""  # never submitted (a failed launch): nothing in Slurm to ask about
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
        records = [r for r in self.daemon.records.values() if r.target == self.name]
        if not records:
            return
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout * 3):
                jobs = await self.slurm(records[0]).obd_jobs()
        except (ExecutorError, TimeoutError, OSError) as exc:
            log.warning("slurm_orphan_check_deferred", target=self.name, error=str(exc))
            return
        now = time.time()
        for job in jobs:
            record = self.daemon.records.get((job.name or "")[len("obd-") :])
            if record is None or record.target != self.name or not record.state.final or not job.job_id:
                continue  # not this daemon's, or its run still has it
            ended = record.history[-1].time if record.history else record.created
            if now - ended < ORPHAN_AGE:
                continue  # the job of a run that just ended is still being torn down
            log.warning("slurm_orphan_cancelled", target=self.name, run_id=record.id, job_id=job.job_id)
            await self.slurm(record).scancel(job.job_id)
            async with self.daemon.editing(record):
                record.note(f"Slurm job {job.job_id} of this run was still {job.state} after the run ended: cancelled")
