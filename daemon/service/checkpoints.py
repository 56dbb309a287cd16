"""A run's checkpoints and its chain's: which one a run can resume from, read where they are.

A run resumes from its proven snapshot when it has one; otherwise from its newest *complete*
checkpoint: `output/checkpoint-<step>` (a real directory) whose `trainer_state.json` reads as
the Trainer wrote it, at that step, beside the model's weights. A half-written checkpoint (a
job killed while saving) fails that test and is skipped for the one before it. The next attempt
of a `--retry` chain resumes from the newest trusted checkpoint of the whole chain, and of
the run the chain was resumed from, up to the checkpoint it was resumed from
(`chain_resume_point`); a stop or a cancel of any attempt's id acts on the chain's newest
attempt (`latest_attempt`). An attempt that failed to load the checkpoint it resumed from marks it
bad (`failed_at_load`): no attempt resumes from it again.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.to_thread
import structlog

from daemon.service.api import ApiError
from daemon.service.models import BadCheckpoint, RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from executors.base import ExecutorError
from trainer_plugin import rundir

log = structlog.get_logger("obd.recovery")


class ChainHost(Runs, Protocol):
    """What reading a chain's checkpoints needs of the daemon: its records and its targets."""

    @property
    def targets(self) -> Targets: ...


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


# (run, checkpoint) whose trainer_state.json was found unreadable: said once in the log, not at
# every `status` and retention pass that reads it again (a checkpoint is never rewritten).
_said_unreadable: set[tuple[str, str]] = set()


def unreadable_once(run_id: str, name: str, exc: ValueError) -> None:
    """Log that a checkpoint's trainer_state.json does not parse, the first time only."""
    if (run_id, name) in _said_unreadable:
        return
    _said_unreadable.add((run_id, name))
    log.warning("checkpoint_state_unreadable", run_id=run_id, checkpoint=name, error=str(exc)[:200])


class Checkpoints:
    """Reads a run's checkpoints where they are: its target, or the copy obd retrieved."""

    def __init__(self, daemon: ChainHost, record: RunRecord) -> None:
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
            state = await anyio.to_thread.run_sync(rundir.load_json, state_raw)
        except ValueError as exc:  # not JSON, or nested past the limit: a save cut short, or planted
            if state_raw:
                unreadable_once(self.record.id, name, exc)
            return None
        if not isinstance(state, dict) or state.get("global_step") != step:
            return None
        for weights in WEIGHTS:
            if await self.read(f"{rundir.OUTPUT}/{name}/{weights}", 1):
                return f"its trainer_state.json is complete at step {step} and its weights ({weights}) are there"
        return None

    async def newest_complete(self, bad: Collection[tuple[str, str]] = ()) -> Checkpoint | None:
        """The newest complete checkpoint, passing over those marked bad."""
        names = sorted(await self.names(), key=lambda n: rundir.checkpoint_step(n) or -1, reverse=True)
        for name in names:
            if (self.record.id, name) in bad:
                continue
            why = await self.complete(name)
            if why:
                return Checkpoint(name, rundir.checkpoint_step(name), f"the newest complete checkpoint: {why}")
        return None


async def resume_point(daemon: ChainHost, source: RunRecord, which: str | None) -> Checkpoint | None:
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
    bad = bad_checkpoints(daemon.records.values())
    try:
        if which is None and source.snapshot is not None:
            name = rundir.checkpoint_name(source.snapshot.step)
            if (source.id, name) not in bad:
                return Checkpoint(
                    name, source.snapshot.step, f"the proof of its snapshot at step {source.snapshot.step}"
                )
        if which is None or which == "latest":
            return await found.newest_complete(bad)
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


def chain_attempts(daemon: ChainHost, record: RunRecord) -> list[RunRecord]:
    """Every attempt of `record`'s chain, oldest first (a run with no retries: itself alone)."""
    chain = record.chain or record.id
    runs = [r for r in daemon.records.values() if (r.chain or r.id) == chain]
    return sorted(runs, key=lambda r: (r.attempt, r.created, r.id))


def latest_attempt(daemon: ChainHost, record: RunRecord) -> RunRecord:
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


async def _candidates(daemon: ChainHost, attempt: RunRecord) -> list[_Candidate]:
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


async def chain_resume_point(daemon: ChainHost, record: RunRecord) -> Checkpoint | None:
    """Where the next attempt after `record` resumes: the newest trusted checkpoint of any attempt
    of its chain up to `record` (None: none has one, start from the beginning).

    Trusted: an attempt's proven snapshot, or an `output/checkpoint-<step>` that `complete` finds
    whole; never a checkpoint of an attempt whose proof was invalid, nor one marked bad. Newest: the highest step;
    at the same step a proof first, then the later attempt. An attempt whose directory cannot
    be read now (a pod that is gone with nothing retrieved, a target that does not answer) is
    passed over and logged, so one unreachable attempt does not send the chain back to step 0."""
    candidates: list[_Candidate] = []
    for attempt in chain_attempts(daemon, record):
        if attempt.attempt <= record.attempt and attempt.state.final:
            candidates += await _candidates(daemon, attempt)
    candidates += await _parent_candidates(daemon, record)
    bad = bad_checkpoints(daemon.records.values())
    for candidate in sorted(candidates, key=lambda c: c.order, reverse=True):
        name, step = rundir.checkpoint_name(candidate.step), candidate.step
        if (candidate.attempt.id, name) in bad:
            continue  # an attempt failed to load it: never resumed from again
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
        if (source.chain or source.id) != (record.chain or record.id):
            return Checkpoint(name, step, f"{why}, of run {source.id}, which its chain was resumed from", source.id)
        return Checkpoint(name, step, f"{why}, of attempt {source.attempt} ({source.id})", source.id)
    return None


async def _parent_candidates(daemon: ChainHost, record: RunRecord) -> list[_Candidate]:
    """What the run a chain was resumed from (`obd train resume`) offers its retries: its checkpoints
    up to the one the chain's first attempt resumed from, so that a retry after that checkpoint
    proved bad goes back to the parent's next older one, never past what the user resumed from
    to step 0, and never forward past the user's choice. None for a chain that started from the
    beginning or from a path given by hand."""
    first = chain_attempts(daemon, record)[0]
    parent = daemon.records.get(first.resumed_from) if first.resumed_from else None
    if parent is None or (parent.chain or parent.id) == (record.chain or record.id) or not first.resume_checkpoint:
        return []
    upto = rundir.checkpoint_step(first.resume_checkpoint.rstrip("/").rsplit("/", 1)[-1])
    if upto is None:
        return []
    return [c for c in await _candidates(daemon, parent) if c.step <= upto]


def bad_checkpoints(records: Iterable[RunRecord]) -> dict[tuple[str, str], BadCheckpoint]:
    """Every checkpoint an attempt failed to resume from, by (the run holding it, its name)."""
    return {(r.bad_checkpoint.run, r.bad_checkpoint.name): r.bad_checkpoint for r in records if r.bad_checkpoint}


def failed_at_load(record: RunRecord) -> BadCheckpoint | None:
    """The checkpoint an ended attempt may have failed to load, or None: it resumed from a
    checkpoint-<step> (not a path given by hand), its job exited non-zero, and no step after that
    checkpoint was logged (a truncated safetensors, a missing optimizer state, an unreadable
    trainer_state.json all fail there). `load_attempted` then says whether the job got as far as
    the load; a job that fails there for another reason is taken the same: the next attempt then
    resumes from an older checkpoint, redoing steps, never losing any."""
    if record.state != RunState.failed or record.exit_code in (None, 0) or record.stop.invalid_proof:
        return None
    if not record.resumed_from or not record.resume_checkpoint:
        return None
    name = record.resume_checkpoint.rstrip("/").rsplit("/", 1)[-1]
    step = rundir.checkpoint_step(name)
    if step is None or (record.progress.step is not None and record.progress.step > step):
        return None
    return BadCheckpoint(
        run=record.resumed_from,
        name=name,
        why=f"attempt {record.id} failed (exit {record.exit_code}) before its first step after it",
    )


# What the plugin writes in job.log as it hands OBD_RESUME_FROM to the Trainer's train()
# (trainer_plugin/plugin/inject.py `_with_resume`), before the Trainer loads it.
RESUMING = "obd: resuming from "
LOG_HEAD = 4 << 20  # how much of job.log is looked at for it


async def load_attempted(daemon: ChainHost, record: RunRecord) -> bool:
    """Whether the attempt's job got as far as loading the checkpoint it resumed from: the plugin
    said, in its job.log, that it handed that checkpoint to the Trainer. A job that died before
    (a wrong command, a lost node, a job with no plugin) says nothing of its checkpoint."""
    if not record.resume_checkpoint:
        return False
    try:
        head = await Checkpoints(daemon, record).read(rundir.JOB_LOG, LOG_HEAD)
    except (ApiError, ExecutorError, TimeoutError, OSError) as exc:
        log.warning("job_log_unreadable", run_id=record.id, error=str(exc))
        return False
    return f"{RESUMING}{record.resume_checkpoint}".encode() in head


def chain_of(daemon: ChainHost, record: RunRecord) -> list[dict[str, object]]:
    """The attempts of a run's chain, oldest first, for `status`."""
    return [
        {"id": r.id, "attempt": r.attempt, "state": r.state.value, "message": r.message}
        for r in chain_attempts(daemon, record)
    ]
