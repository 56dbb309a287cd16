"""Recovery: which checkpoint a run can resume from, and the automatic retries of `--retry N`.

A run resumes from its proven snapshot when it has one; otherwise from its newest *complete*
checkpoint: `output/checkpoint-<step>` (a real directory) whose `trainer_state.json` reads as
the Trainer wrote it, at that step, beside the model's weights. A half-written checkpoint (a
job killed while saving) fails that test and is skipped for the one before it.

A run started with `--retry N` that ends for a reason a retry can help with (`[retry] on`: a
non-zero exit, a lost job, a failed launch, a preemption, a `deadline` snapshot; never a cancel
by a user nor an invalid proof) is started again as the next attempt of its chain, after a
backoff that doubles each time, from its checkpoint (or from the start when it has none).
Each attempt is a run of its own; `list` shows a chain's latest attempt, `status` the chain.

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

    def _settle(self, record: RunRecord) -> None:
        """Nothing starts from this run again: its launch settings go, and later edits of it
        (notes, collected metrics, mirrored outputs) have nothing to decide."""
        drop_spec(self.daemon, record.id)
        self._settled.add(record.id)

    async def _after_end(self, record: RunRecord) -> None:
        try:
            cause = self.retry_due(record)
            if cause:
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
        try:
            point = await resume_point(daemon, record, None)
        except ApiError as exc:
            log.warning("retry_checkpoint_unreadable", run_id=record.id, error=str(exc))
            point = None
        cfg = daemon.config.retry
        delay = min(cfg.backoff * 2 ** (record.attempt - 1), cfg.max_backoff)
        new = await daemon.launcher.next_attempt(record, req, run_as, point, time.time() + delay, cause)
        async with daemon.editing(record):
            record.retried_by = new.id
            start = f"from {point.name}" if point else "from the start (it had no complete checkpoint)"
            record.note(
                f"retrying ({cause}): attempt {new.attempt} of {record.retries + 1} is {new.id}, {start}, in {delay:g} s"
            )
        self._settle(record)  # the next attempt keeps its own copy of the settings
        log.info("run_retried", run_id=record.id, next_run=new.id, cause=cause, attempt=new.attempt, delay_s=delay)


def chain_of(daemon: Daemon, record: RunRecord) -> list[dict[str, object]]:
    """The attempts of a run's chain, oldest first, for `status`."""
    chain = record.chain or record.id
    runs = [r for r in daemon.records.values() if (r.chain or r.id) == chain]
    return [
        {"id": r.id, "attempt": r.attempt, "state": r.state.value, "message": r.message}
        for r in sorted(runs, key=lambda r: (r.attempt, r.created))
    ]


__all__ = ["Checkpoint", "Recovery", "chain_of", "resume_point", "retry_cause"]
