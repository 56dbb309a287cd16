"""Recovery: which checkpoint a run can resume from, and the automatic retries of `--retry N`.

A run resumes from its proven snapshot when it has one; otherwise from its newest *complete*
checkpoint: `output/checkpoint-<step>` (a real directory) whose `trainer_state.json` reads as
the Trainer wrote it, at that step, beside the model's weights. A half-written checkpoint (a
job killed while saving) fails that test and is skipped for the one before it.

A run started with `--retry N` that ends for a reason a retry can help with (`[retry] on`: a
non-zero exit, a lost job, a failed launch, a preemption, a `deadline` snapshot; never a cancel
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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import structlog

from daemon.api import ApiError
from daemon.models import RunRecord, RunState
from daemon.queue import drop_orphan_specs, drop_spec, load_spec
from executors.base import ExecutorError
from trainer_plugin import rundir

if TYPE_CHECKING:
    from daemon.service import Daemon

log = structlog.get_logger("obd.recovery")
WEIGHTS = (
    "adapter_model.safetensors",
    "adapter_model.bin",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint a run can resume from, on its source run's target (or a path given)."""

    name: str  # checkpoint-<step>, or the path given
    step: int | None
    reason: str  # why it is trusted, for the new run's record
    # The run whose directory holds it, when that is not the run being resumed (an earlier
    # attempt of a chain); None: the run being resumed.
    source: str | None = None


class Checkpoints:
    """Reads a run's checkpoints where they are: its target, or the copy obd retrieved."""

    def __init__(self, daemon: Daemon, record: RunRecord) -> None:
        self.daemon = daemon
        self.record = record
        retrieved = daemon.store.run_dir(record.id) / "retrieved"
        self.local = retrieved if record.state.final and (retrieved / rundir.OUTPUT).is_dir() else None

    async def names(self) -> list[str]:
        if self.local is not None:
            return rundir.real_checkpoints(str(self.local))
        executor = self.daemon.targets.executor(self.record)
        with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
            [probe] = await executor.probe([(None, self.record.remote_dir)])
        return probe.checkpoints

    async def read(self, rel: str, limit: int) -> bytes:
        if self.local is not None:
            return rundir.read_regular(str(self.local / rel), limit) or b""
        executor = self.daemon.targets.executor(self.record)
        with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
            return await executor.read_from(f"{self.record.remote_dir}/{rel}", 0, limit)

    async def complete(self, name: str) -> str | None:
        """Why the checkpoint is trusted, or None when it is not complete."""
        step = rundir.checkpoint_step(name)
        state_raw = await self.read(f"{rundir.OUTPUT}/{name}/trainer_state.json", 16 << 20)
        try:
            state = json.loads(state_raw)
        except ValueError:
            return None
        if not isinstance(state, dict) or state.get("global_step") != step:
            return None
        for weights in WEIGHTS:
            if await self.read(f"{rundir.OUTPUT}/{name}/{weights}", 1):
                return f"its trainer_state.json is complete at step {step} and its weights ({weights}) are there"
        return None

    async def newest_complete(self) -> Checkpoint | None:
        names = sorted(await self.names(), key=lambda n: rundir.checkpoint_step(n) or -1, reverse=True)
        for name in names:
            why = await self.complete(name)
            if why:
                return Checkpoint(name, rundir.checkpoint_step(name), f"the newest complete checkpoint: {why}")
        return None


async def resume_point(daemon: Daemon, source: RunRecord, which: str | None) -> Checkpoint | None:
    """The checkpoint a new run resumes `source` from (None: there is none)."""
    if source.state in (RunState.queued, RunState.preparing):
        raise ApiError(f"run {source.id} has not run yet ({source.state.value}): nothing to resume from", "state")
    if not source.state.final and which is None:
        raise ApiError(
            f"run {source.id} is still {source.state.value}: stop it first (`obd train stop {source.id}`), "
            "or name a checkpoint with --checkpoint",
            "state",
        )
    if which and "/" in which:
        return Checkpoint(which, None, "the path given with --checkpoint")
    found = Checkpoints(daemon, source)
    try:
        if which is None and source.snapshot is not None:
            name = rundir.checkpoint_name(source.snapshot.step)
            return Checkpoint(name, source.snapshot.step, f"the proof of its snapshot at step {source.snapshot.step}")
        if which is None or which == "latest":
            return await found.newest_complete()
        if which.isdigit():
            name = rundir.checkpoint_name(int(which))
            if name not in await found.names():
                raise ApiError(f"run {source.id} has no {rundir.OUTPUT}/{name}", "usage")
            why = await found.complete(name)
            if why is None:
                raise ApiError(
                    f"{rundir.OUTPUT}/{name} of run {source.id} is not complete (a save cut short?)", "usage"
                )
            return Checkpoint(name, int(which), f"asked for: {why}")
    except (ExecutorError, TimeoutError, OSError) as exc:
        raise ApiError(
            f"could not read the checkpoints of run {source.id} on target {source.target}: {exc}; retry once it answers",
            "unavailable",
        ) from exc
    raise ApiError(f"--checkpoint {which!r}: use latest, a step number, or a path", "usage")


def chain_attempts(daemon: Daemon, record: RunRecord) -> list[RunRecord]:
    """Every attempt of `record`'s chain, oldest first (a run with no retries: itself alone)."""
    chain = record.chain or record.id
    runs = [r for r in daemon.records.values() if (r.chain or r.id) == chain]
    return sorted(runs, key=lambda r: (r.attempt, r.created, r.id))


def latest_attempt(daemon: Daemon, record: RunRecord) -> RunRecord:
    """The attempt a stop, a cancel or a wait given any attempt's id acts on: the chain's newest,
    followed through `retried_by` (the id `start` printed names the first attempt, which has
    ended once a retry waits in the queue)."""
    seen = {record.id}
    while record.retried_by and record.retried_by in daemon.records and record.retried_by not in seen:
        record = daemon.records[record.retried_by]
        seen.add(record.id)
    return record


@dataclass(frozen=True)
class _Candidate:
    """A checkpoint of one attempt that the next attempt may resume from, not yet judged."""

    step: int
    proven: bool  # the attempt's snapshot proof names it: trusted as the proof rule judged it
    attempt: RunRecord
    checkpoints: Checkpoints  # where it is read, to judge it complete

    @property
    def order(self) -> tuple[int, bool, int]:
        """Newest first: the highest step; at the same step a proof, then the later attempt."""
        return self.step, self.proven, self.attempt.attempt


async def _candidates(daemon: Daemon, attempt: RunRecord) -> list[_Candidate]:
    """What one ended attempt offers: its proven snapshot, and its real `output/checkpoint-<step>`
    directories (none of an attempt whose proof was invalid: nothing of such a job is trusted).
    Raises what reading its directory raises; the proof is kept even when it cannot be read."""
    found = Checkpoints(daemon, attempt)
    out = []
    if attempt.snapshot is not None:
        out.append(_Candidate(attempt.snapshot.step, True, attempt, found))
    if attempt.stop.invalid_proof:
        return out
    try:
        names = await found.names()
    except (ApiError, ExecutorError, TimeoutError, OSError) as exc:
        log.warning("retry_attempt_unreadable", attempt_id=attempt.id, error=str(exc))
        return out
    steps = (rundir.checkpoint_step(name) for name in names)
    return out + [_Candidate(step, False, attempt, found) for step in steps if step is not None]


async def chain_resume_point(daemon: Daemon, record: RunRecord) -> Checkpoint | None:
    """Where the next attempt after `record` resumes: the newest trusted checkpoint of any attempt
    of its chain up to `record` (None: none has one, start from the beginning).

    Trusted: an attempt's proven snapshot, or an `output/checkpoint-<step>` that `complete` finds
    whole; never a checkpoint of an attempt whose proof was invalid. Newest: the highest step;
    at the same step a proof first, then the later attempt. An attempt whose directory cannot
    be read now (a pod that is gone with nothing retrieved, a target that does not answer) is
    passed over and logged, so one unreachable attempt does not send the chain back to step 0."""
    candidates: list[_Candidate] = []
    for attempt in chain_attempts(daemon, record):
        if attempt.attempt <= record.attempt and attempt.state.final:
            candidates += await _candidates(daemon, attempt)
    for candidate in sorted(candidates, key=lambda c: c.order, reverse=True):
        name, step = rundir.checkpoint_name(candidate.step), candidate.step
        if candidate.proven:
            why = f"the proof of its snapshot at step {step}"
        else:
            try:
                complete = await candidate.checkpoints.complete(name)
            except (ApiError, ExecutorError, TimeoutError, OSError) as exc:
                log.warning(
                    "retry_checkpoint_unreadable", attempt_id=candidate.attempt.id, checkpoint=name, error=str(exc)
                )
                continue
            if complete is None:
                continue  # a save cut short: the one before it
            why = f"the newest complete checkpoint: {complete}"
        if candidate.attempt.id == record.id:
            return Checkpoint(name, step, why)
        source = candidate.attempt
        return Checkpoint(name, step, f"{why}, of attempt {source.attempt} ({source.id})", source.id)
    return None


def retry_cause(record: RunRecord) -> str | None:
    """Why a run ended, as `[retry] on` names it; None when a retry cannot help."""
    if record.state == RunState.stopped and record.snapshot is not None:
        return record.snapshot.reason if record.snapshot.reason in ("deadline", "preempted") else None
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


class Recovery:
    """Starts the next attempt of a chain when an attempt ends for a reason a retry can help with."""

    def __init__(self, daemon: Daemon) -> None:
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
            if record.retried_by is None and self.retry_due(record):
                self.on_change(record)
            else:
                self._settle(record)
        drop_orphan_specs(daemon, daemon.records.keys())

    def attempts_left(self, record: RunRecord) -> int:
        return record.retries - (record.attempt - 1)

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
            cause = self.retry_due(record)
            if cause and (record.chain or record.id) not in self._ended_chains:
                await self._next_attempt(record, cause)
            else:
                self._settle(record)
        except Exception:  # a retry that cannot be made is said in the record, never fatal
            log.exception("retry_failed", run_id=record.id)
        finally:
            self._pending.discard(record.id)

    async def _next_attempt(self, record: RunRecord, cause: str) -> None:
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
        cfg = daemon.config.retry
        delay = min(cfg.backoff * 2 ** (record.attempt - 1), cfg.max_backoff)
        new = await daemon.launcher.next_attempt(record, req, run_as, point, time.time() + delay, cause)
        async with daemon.editing(record):
            record.retried_by = new.id
            if point is None:
                start = "from the start (no attempt of its chain has a complete checkpoint)"
            else:
                start = f"from {point.name}" + (f" of {point.source}" if point.source else "")
            record.note(
                f"retrying ({cause}): attempt {new.attempt} of {record.retries + 1} is {new.id}, {start}, in {delay:g} s"
            )
        self._settle(record)  # the next attempt keeps its own copy of the settings
        log.info("run_retried", run_id=record.id, next_run=new.id, cause=cause, attempt=new.attempt, delay_s=delay)


def chain_of(daemon: Daemon, record: RunRecord) -> list[dict[str, object]]:
    """The attempts of a run's chain, oldest first, for `status`."""
    return [
        {"id": r.id, "attempt": r.attempt, "state": r.state.value, "message": r.message}
        for r in chain_attempts(daemon, record)
    ]


__all__ = [
    "Checkpoint",
    "Recovery",
    "chain_attempts",
    "chain_of",
    "chain_resume_point",
    "latest_attempt",
    "resume_point",
    "retry_cause",
]
