"""Recovery: the automatic retries of `--retry N` (which checkpoint each resumes from is
`daemon/service/checkpoints.py`).

A run started with `--retry N` that ends for a reason a retry can help with (`[retry] on`: a
non-zero exit, a lost job, a failed launch, a preemption, a `deadline` or a pod's `cost` snapshot; never a cancel
by a user nor an invalid proof) is started again as the next attempt of its chain, after a
backoff that doubles each time, from the newest trusted checkpoint of the whole chain (or from
the start when no attempt has one): recovery never goes backwards because an attempt died
before it saved anything. Each attempt is a run of its own; `list` shows a chain's latest
attempt, `status` the chain, and a stop or a cancel of any attempt's id acts on the chain's
live attempt (`latest_attempt`); a cancel of an ended attempt ends its chain (`end_chain`).

An attempt's launch settings (launch.json: the caller's environment, `--env` values, secrets)
are deleted as soon as nothing can start from it again: when its next attempt is made (which
keeps its own copy), or when it ended with no retry to come (no attempt left, a cause retries do
not help with, a cancel). A daemon that starts deletes those an earlier one left behind.

An attempt that failed before its first step after the checkpoint it resumed from, once its job
had handed that checkpoint to the Trainer, marks that checkpoint bad first (`failed_at_load`,
`load_attempted`, daemon/service/checkpoints.py), so its retry resumes from the next older trusted one
and no attempt loops on it.
"""

from __future__ import annotations

import time
from typing import Protocol

import structlog

from daemon.service.checkpoints import chain_resume_point, failed_at_load, load_attempted
from daemon.service.hints import signal_name
from daemon.service.launch import Launcher
from daemon.service.limits import spent_of
from daemon.service.models import Paused, RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.specs import drop_orphan_specs, drop_spec, load_spec
from daemon.service.targets import Targets

log = structlog.get_logger("obd.recovery")


class RecoveryHost(Runs, Protocol):
    """What recovery uses of the daemon beyond the records: the launcher (the next attempt) and
    the targets (the chain's checkpoints)."""

    @property
    def launcher(self) -> Launcher: ...

    @property
    def targets(self) -> Targets: ...


def retry_cause(record: RunRecord) -> str | None:
    """Why a run ended, as `[retry] on` names it; None when a retry cannot help (a run obd stopped at
    its chain's limit, which a retry would only overrun)."""
    if record.limits is not None and record.limits.reached is not None:
        return None
    if record.state == RunState.stopped and record.snapshot is not None:
        # A machine's cap (a pod's max_hours or max_cost_usd, Slurm's time limit): a new machine
        # continues it (the chain's own limits were taken above).
        return record.snapshot.reason if record.snapshot.reason in ("deadline", "cost", "preempted") else None
    if record.state != RunState.failed or record.stop.invalid_proof:
        return None
    if record.message.startswith("launch failed") or "launch was cut short" in record.message:
        return "launch"
    if "stopped outside obd" in record.message:
        return "preempted"
    if record.message.startswith("lost") or "no longer exists" in record.message:
        return "lost"
    if record.exit_code not in (None, 0):
        return "exit"
    return "lost"


def cause_words(record: RunRecord, cause: str) -> str:
    """A retry's cause as its messages say it: `exit 1`, `exit 137, killed by SIGKILL`, `lost`..."""
    if cause != "exit" or record.exit_code is None:
        return cause
    name = signal_name(record.exit_code)
    return f"exit {record.exit_code}" + (f", killed by {name}" if name else "")


class Recovery:
    """Starts the next attempt of a chain when an attempt ends for a reason a retry can help with."""

    def __init__(self, daemon: RecoveryHost) -> None:
        self.daemon = daemon
        self._pending: set[str] = set()
        # Ended runs nothing starts from again, their launch settings deleted: later edits
        # (notes, collected metrics, mirrored outputs) have nothing to decide.
        self._settled: set[str] = set()
        # Chains a user ended while their next attempt was being made: it is not made.
        self._ended_chains: set[str] = set()

    def on_change(self, record: RunRecord) -> None:
        if (
            record.state.final
            and record.retried_by is None
            and record.id not in self._pending
            and record.id not in self._settled
        ):
            self._pending.add(record.id)
            self.daemon.start_soon(self._after_end, record)

    def catch_up(self) -> None:
        """At start: retry the attempts an earlier daemon saw end but did not act on, and delete
        the launch settings of every ended run nothing can start from any more (one that ended
        while no daemon ran, or whose deletion a crash cut short), and of runs with no record."""
        daemon = self.daemon
        for record in list(daemon.records.values()):
            if not record.state.final:
                continue
            unmarked = failed_at_load(record) is not None and record.bad_checkpoint is None
            if record.retried_by is None and (self.retry_due(record) or self.resumes_paused(record) or unmarked):
                self.on_change(record)
            else:
                self._settle(record)
        drop_orphan_specs(daemon, daemon.records.keys())

    def attempts_left(self, record: RunRecord) -> int:
        """Retries left to the chain (the attempts that resumed a paused run used none)."""
        return record.retries - (record.attempt - 1 - record.preemption.preemptions)

    @staticmethod
    def resumes_paused(record: RunRecord) -> bool:
        """Whether an ended attempt was paused by obd (a preemption, a drain) and comes back on its
        own: stopped on its `preempted` proof, or cancelled by the stop fallback when none came (from
        its chain's newest complete checkpoint then, its lost steps counted). Never a run a user
        cancelled or one that failed, and no retry is used."""
        if record.preemption.preempt is None:
            return False
        if record.state == RunState.stopped:
            return record.snapshot is not None
        return record.state == RunState.cancelled and record.stop.cancel_by == "fallback"

    def attempt_to_come(self, record: RunRecord) -> bool:
        """Whether another attempt of an ended attempt's chain is made, or still to be made (a retry
        due, a paused run's way back), so its chain has not ended (a run waiting for it with
        `--after`, daemon/service/after.py, waits on). Not once the chain was ended by a user, nor once
        nothing can start from the attempt (its settings gone)."""
        if not record.state.final:
            return False
        if record.retried_by is not None:
            return True
        if record.id in self._settled or (record.chain or record.id) in self._ended_chains:
            return False
        return bool(self.retry_due(record)) or self.resumes_paused(record)

    def retry_due(self, record: RunRecord) -> str | None:
        """Why an ended attempt is started again (its cause), or None when its chain ends here."""
        cause = retry_cause(record)
        if cause and cause in self.daemon.config.retry.on and self.attempts_left(record) > 0:
            return cause
        return None

    async def end_chain(self, record: RunRecord, why: str) -> bool:
        """End the chain of an attempt that has ended (a cancel of the id `start` printed, once
        that attempt failed): no next attempt is made, and its launch settings go. For a cancel
        that comes while the next attempt is still being made (its checkpoint being looked for);
        once made, that attempt is queued and the cancel acts on it (`latest_attempt`). True when
        a retry was still to come and will not."""
        if not record.state.final or record.retried_by is not None or record.id in self._settled:
            return False
        if not self.retry_due(record):
            return False  # its chain ends here anyway
        self._ended_chains.add(record.chain or record.id)
        async with self.daemon.editing(record):
            record.note(f"no retry: {why}")
        if record.id not in self._pending:
            self._settle(record)
        log.info("chain_ended", run_id=record.id, why=why)
        return True

    def _settle(self, record: RunRecord) -> None:
        """Nothing starts from this run again: its launch settings go, and later edits of it
        (notes, collected metrics, mirrored outputs) have nothing to decide."""
        drop_spec(self.daemon, record.id)
        self._settled.add(record.id)

    async def _after_end(self, record: RunRecord) -> None:
        try:
            await self._mark_bad(record)
            cause = self.retry_due(record)
            if (cause or self.resumes_paused(record)) and await self._limit_spent(record):
                self._settle(record)
            elif self.resumes_paused(record) and (record.chain or record.id) not in self._ended_chains:
                await self._next_attempt(record, "paused", paused=True)
            elif cause and (record.chain or record.id) not in self._ended_chains:
                await self._next_attempt(record, cause)
            else:
                self._settle(record)
        except Exception:  # a retry that cannot be made is said in the record, never fatal
            log.exception("retry_failed", run_id=record.id)
        finally:
            self._pending.discard(record.id)

    async def _mark_bad(self, record: RunRecord) -> None:
        """An attempt that failed to load the checkpoint it resumed from marks it bad, on its record
        and in its history (what notifications say): no attempt resumes from it again."""
        bad = failed_at_load(record)
        if bad is None or record.bad_checkpoint is not None or not await load_attempted(self.daemon, record):
            return
        async with self.daemon.editing(record):
            record.bad_checkpoint = bad
            record.note(
                f"checkpoint {bad.name} of run {bad.run} is bad: {bad.why} (it could not be loaded?); "
                "no attempt resumes from it again"
            )
        log.warning("checkpoint_bad", run_id=record.id, source=bad.run, checkpoint=bad.name)

    async def _limit_spent(self, record: RunRecord) -> bool:
        """Whether the chain's limits (daemon/service/limits.py) leave no room for another attempt, which
        would be asked to stop as soon as it ran: then none is made, and its history says why."""
        limit = spent_of(self.daemon, record, time.time())
        if limit is None:
            return False
        said = f"no further attempt: its {limit.limit} is spent; `obd train resume {record.id}` continues it"
        if not record.history or record.history[-1].reason != said:  # once, whatever the restarts
            async with self.daemon.editing(record):
                record.note(said)
        log.info("chain_limit_spent", run_id=record.id, limit=limit.limit)
        return True

    async def _next_attempt(self, record: RunRecord, cause: str, paused: bool = False) -> None:
        daemon = self.daemon
        chain = record.chain or record.id
        existing = [r for r in daemon.records.values() if r.chain == chain and r.attempt == record.attempt + 1]
        if existing:  # made before a restart, its link not yet saved
            async with daemon.editing(record):
                record.retried_by = existing[0].id
            self._settle(record)
            return
        spec = load_spec(daemon, record.id)
        if spec is None:
            self._settled.add(record.id)  # said once: nothing can start from it
            async with daemon.editing(record):
                record.note("no retry: the settings it was started with are gone (launch.json); resume it by hand")
            return
        req, run_as = spec
        point = await chain_resume_point(daemon, record)
        if chain in self._ended_chains:  # cancelled while its checkpoint was looked for
            self._settle(record)
            return
        if paused and record.preemption.preempt is not None:
            lost = (
                0
                if record.snapshot is not None
                else max(0, (record.progress.step or 0) - (point.step or 0 if point else 0))
            )
            asked = record.preemption.preempt
            pause = Paused(by=asked.for_run, since=asked.asked_at, why=asked.why)
            new = await daemon.launcher.next_attempt(record, req, run_as, point, time.time(), cause, pause, lost)
            async with daemon.editing(record):
                record.retried_by = new.id
                from_what = f"from {point.name}" if point is not None else "from the start"
                steps = f", {lost} steps lost (no snapshot came)" if lost else ""
                record.note(f"paused: back in the queue as {new.id}, {from_what}{steps}")
            self._settle(record)
            log.info("run_paused", run_id=record.id, next_run=new.id, lost_steps=lost)
            return
        cfg = daemon.config.retry
        delay = min(cfg.backoff * 2 ** (record.attempt - 1 - record.preemption.preemptions), cfg.max_backoff)
        said = cause_words(record, cause)
        new = await daemon.launcher.next_attempt(record, req, run_as, point, time.time() + delay, said)
        async with daemon.editing(record):
            record.retried_by = new.id
            if point is None:
                start = "from the start (no attempt of its chain has a complete checkpoint)"
            else:
                start = f"from {point.name}" + (f" of {point.source}" if point.source else "")
            record.note(
                f"retrying ({said}): attempt {new.attempt} of {new.retries + 1 + new.preemption.preemptions} is {new.id}, {start}, in {delay:g} s"
            )
        self._settle(record)  # the next attempt keeps its own copy of the settings
        log.info("run_retried", run_id=record.id, next_run=new.id, cause=cause, attempt=new.attempt, delay_s=delay)


__all__ = ["Recovery", "retry_cause"]
