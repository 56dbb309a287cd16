"""Checkpoint retention: a chain keeps its newest N complete checkpoints, and what may still be
resumed; obd deletes the rest on the target (`--keep-checkpoints N`, docs/checkpoints.md).

The rule (`plan`) is pure: given every `output/checkpoint-<step>` of a chain's attempts, it keeps
the newest N complete ones (newest: the highest step, then the later attempt), every checkpoint
something may still resume (an attempt resuming from it, the proven snapshot of the chain's
newest attempt, one whose outputs are being brought home), and any checkpoint newer than the
newest complete one (it may still be being written); it deletes the rest, and only once a newer
complete checkpoint exists. A checkpoint marked bad (daemon/service/checkpoints.py) never counts as
complete. Nothing that is not a `checkpoint-<step>` of one of the chain's own run directories
is ever named for deletion.

`Retention` applies it: when the follow sees a run's newest checkpoint change, when an attempt
ends, and by hand (`obd train prune RUN [--keep N]`), one chain at a time, through the
executor's `remove_checkpoint` (with the run directory owner's rights, never through a link).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import structlog

from daemon.service.api import ApiError
from daemon.service.checkpoints import Checkpoints, bad_checkpoints, chain_attempts, latest_attempt
from daemon.service.models import RunRecord
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from executors.base import ExecutorError
from executors.factory import makes_pods
from trainer_plugin import rundir

# At start, chains that ended this recently get a pass too (one a killed daemon cut short); older
# ones wait for `obd train prune`, so a restart does not reach every target of a long history.
CATCH_UP_WINDOW = 24 * 3600.0

log = structlog.get_logger("obd.retention")

Key = tuple[str, str]  # (the run whose directory holds it, checkpoint-<step>)


@dataclass(frozen=True)
class Held:
    """One checkpoint directory of a chain, as the rule judges it."""

    run: str  # the attempt whose run directory holds it
    attempt: int
    name: str  # checkpoint-<step>
    complete: bool  # whole (trainer_state.json at its step, weights), and not marked bad
    size: int = 0  # bytes

    @property
    def key(self) -> Key:
        return self.run, self.name

    @property
    def order(self) -> tuple[int, int]:
        """Newer: the higher step, then the later attempt."""
        return rundir.checkpoint_step(self.name) or 0, self.attempt


@dataclass
class Plan:
    """What the rule decided: what is deleted, and why each other checkpoint is kept."""

    remove: list[Held] = field(default_factory=list)
    kept: dict[Key, str] = field(default_factory=dict)


def plan(held: Sequence[Held], keep: int, protected: Mapping[Key, str], chain_runs: Collection[str]) -> Plan:
    """The retention rule (see the module docstring); `protected` says why a checkpoint may still
    be resumed, `chain_runs` are the chain's attempts (nothing of another run is ever deleted)."""
    out = Plan()
    ours = [h for h in held if h.run in chain_runs and rundir.checkpoint_step(h.name) is not None]
    complete = sorted((h for h in ours if h.complete), key=lambda h: h.order, reverse=True)
    for h in complete[: max(keep, 1)]:
        out.kept[h.key] = f"one of the newest {keep} complete"
    for h in ours:
        if h.key in protected and h.key not in out.kept:
            out.kept[h.key] = protected[h.key]
    if not complete:
        return out  # nothing newer and complete exists: nothing is deleted
    newest = complete[0].order
    for h in ours:
        if h.key in out.kept:
            continue
        if h.order >= newest:
            out.kept[h.key] = "newer than the newest complete checkpoint (it may still be being written)"
        else:
            out.remove.append(h)
    out.remove.sort(key=lambda h: h.order)  # the oldest first
    return out


def set_keep(record: RunRecord, keep: int | None) -> None:
    """A new attempt's keep setting (saved by the caller): its `--keep-checkpoints`, its target's
    default, or for a chain's next attempt, the one its chain had; None keeps every checkpoint."""
    record.retention.keep_checkpoints = keep


# Runs whose outputs are being brought home (`obd train outputs`, a pod's end): nothing of theirs
# is deleted meanwhile. Per daemon process; counted, as two retrievals may overlap.
_reading: Counter[str] = Counter()


@contextlib.contextmanager
def holding(run_id: str) -> Iterator[None]:
    """Keep every checkpoint of `run_id` while its outputs are read."""
    _reading[run_id] += 1
    try:
        yield
    finally:
        _reading[run_id] -= 1
        if _reading[run_id] <= 0:
            del _reading[run_id]


def protections(records: Collection[RunRecord], chain: Sequence[RunRecord]) -> dict[Key, str]:
    """Why a checkpoint of the chain may still be resumed: a run (of any chain) that is not over
    resumes from it; it is the proven snapshot of the chain's newest attempt (what the next
    attempt or `obd train resume` continues). Those whose outputs are being read: `holding`."""
    ids = {r.id for r in chain}
    out: dict[Key, str] = {}
    for r in records:
        if not r.state.final and r.resumed_from in ids and r.resume_checkpoint:
            out[(r.resumed_from or "", os.path.basename(r.resume_checkpoint.rstrip("/")))] = (
                f"run {r.id} resumes from it"
            )
    newest = max(chain, key=lambda r: r.attempt) if chain else None
    if newest is not None and newest.snapshot is not None:
        out.setdefault(
            (newest.id, rundir.checkpoint_name(newest.snapshot.step)), "the proven snapshot a resume continues"
        )
    return out


def is_run_dir(record: RunRecord) -> bool:
    """Whether the record's directory is a run directory obd made for it (`<workdir>/<id>`)."""
    d = record.remote_dir.rstrip("/")
    return bool(d) and d.startswith("/") and d.rsplit("/", 1)[-1] == record.id and ".." not in d.split("/")


class RetentionHost(Runs, Protocol):
    """What retention needs of the daemon: its records and its targets."""

    @property
    def targets(self) -> Targets: ...


@dataclass
class Pruned:
    """What one pass deleted and kept, as `obd train prune` says it."""

    keep: int
    removed: list[dict[str, Any]] = field(default_factory=list)
    kept: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def freed(self) -> int:
        return sum(int(r["bytes"]) for r in self.removed)

    def answer(self, run_id: str) -> dict[str, Any]:
        return {
            "id": run_id,
            "keep": self.keep,
            "removed": self.removed,
            "kept": self.kept,
            "freed": self.freed,
            "errors": self.errors,
        }


class Retention:
    """Applies the rule to a chain when its checkpoints change, when an attempt ends, and by hand."""

    def __init__(self, daemon: RetentionHost) -> None:
        self.daemon = daemon
        self._seen: dict[str, tuple[str | None, bool]] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._queued: set[str] = set()
        self._complete: set[Key] = set()  # found whole once: a checkpoint is never rewritten

    def on_change(self, record: RunRecord) -> None:
        """A listener: a chain with a keep setting is pruned when one of its runs shows a new
        newest checkpoint, or ends."""
        if record.retention.keep_checkpoints is None:
            return
        mark = (record.progress.last_checkpoint, record.state.final)
        if self._seen.get(record.id) == mark:
            return
        self._seen[record.id] = mark
        if mark[0] is None and not mark[1]:
            return
        chain = record.chain or record.id
        if chain not in self._queued:
            self._queued.add(chain)
            self.daemon.start_soon(self._auto, chain, record.id)

    def catch_up(self, now: float | None = None) -> None:
        """At the daemon's start: a pass for every chain with a keep setting that still runs or
        ended within CATCH_UP_WINDOW, so a pass a killed daemon cut short (or a checkpoint saved
        while none ran) is done without waiting for the chain's next change."""
        now = time.time() if now is None else now
        for record in list(self.daemon.records.values()):
            if record.retention.keep_checkpoints is None or latest_attempt(self.daemon, record) is not record:
                continue
            if record.state.final and record.history and now - record.history[-1].time > CATCH_UP_WINDOW:
                continue
            chain = record.chain or record.id
            if chain not in self._queued:
                self._queued.add(chain)
                self.daemon.start_soon(self._auto, chain, record.id)

    async def _auto(self, chain: str, run_id: str) -> None:
        try:
            async with self._lock(chain):
                self._queued.discard(chain)
                record = self.daemon.records.get(run_id)
                if record is None:
                    return
                newest = latest_attempt(self.daemon, record)
                if newest.retention.keep_checkpoints is None:
                    return
                done = await self._prune(newest, newest.retention.keep_checkpoints)
                if done.removed:
                    log.info("checkpoints_pruned", chain=chain, removed=done.removed, freed=done.freed)
        except Exception:  # retention must never end the daemon: the next change tries again
            log.exception("prune_failed", chain=chain)

    def _lock(self, chain: str) -> anyio.Lock:
        return self._locks.setdefault(chain, anyio.Lock())

    async def prune(self, record: RunRecord, keep: int | None) -> Pruned:
        """`obd train prune`: the rule applied now, with `keep` or the run's own setting."""
        newest = latest_attempt(self.daemon, record)
        keep = keep if keep is not None else newest.retention.keep_checkpoints
        if keep is None:
            raise ApiError(
                f"run {record.id} keeps every checkpoint (no --keep-checkpoints): say how many to keep, "
                f"`obd train prune {record.id} --keep N`",
                "usage",
            )
        async with self._lock(newest.chain or newest.id):
            return await self._prune(newest, keep)

    async def held(self, chain: Sequence[RunRecord]) -> tuple[list[Held], list[str]]:
        """Every checkpoint of the chain's run directories that can be read now, and what could not."""
        bad = bad_checkpoints(self.daemon.records.values())
        out: list[Held] = []
        errors: list[str] = []
        timeout = self.daemon.config.daemon.probe_timeout
        for attempt in chain:
            if not is_run_dir(attempt) or (attempt.job is None and not attempt.state.final):
                continue
            try:
                if attempt.state.final and makes_pods(self.daemon.targets.of(attempt).config):
                    continue  # its pod ended with it; the copy brought home is the user's, never pruned
                executor = self.daemon.targets.executor(attempt)
                with anyio.fail_after(timeout):
                    sizes = await executor.checkpoint_sizes(attempt.remote_dir)
                found = Checkpoints(self.daemon, attempt)
                for name, size in sorted(sizes.items()):
                    key = (attempt.id, name)
                    if key not in self._complete and key not in bad and await found.complete(name):
                        self._complete.add(key)
                    complete = key in self._complete and key not in bad
                    out.append(Held(attempt.id, attempt.attempt, name, complete, size))
            except (ApiError, ExecutorError, TimeoutError, OSError, KeyError) as exc:
                errors.append(f"{attempt.id}: {exc}")
                log.warning("retention_unreadable", run_id=attempt.id, error=str(exc))
        return out, errors

    async def _prune(self, newest: RunRecord, keep: int) -> Pruned:
        daemon = self.daemon
        chain = chain_attempts(daemon, newest)
        held, errors = await self.held(chain)
        protected = protections(list(daemon.records.values()), chain)
        for h in held:
            if _reading.get(h.run):
                protected.setdefault(h.key, "its outputs are being read")
        decided = plan(held, keep, protected, {r.id for r in chain})
        done = Pruned(keep=keep, errors=errors)
        by_id = {r.id: r for r in chain}
        timeout = daemon.config.daemon.probe_timeout * 4
        for h in held:
            if h.key in decided.kept:
                done.kept.append({"run": h.run, "name": h.name, "bytes": h.size, "why": decided.kept[h.key]})
        for h in decided.remove:
            owner = by_id[h.run]
            try:
                with anyio.fail_after(timeout):
                    freed = await daemon.targets.executor(owner).remove_checkpoint(owner.remote_dir, h.name)
            except (ExecutorError, TimeoutError, OSError) as exc:
                if not await self._gone(owner, h.name):
                    # What could not be removed is said, and stays on the record as it is on disk
                    # (a removal cut short leaves it incomplete: judged again, never trusted).
                    self._complete.discard(h.key)
                    done.errors.append(f"{h.run}/{rundir.OUTPUT}/{h.name}: {exc or 'timed out'}")
                    log.warning("prune_refused", run_id=h.run, checkpoint=h.name, error=str(exc))
                    continue
                freed = h.size  # the answer was lost (a timeout, a dropped connection), not the removal
            self._complete.discard(h.key)
            done.removed.append({"run": h.run, "name": h.name, "bytes": freed})
            async with daemon.editing(owner):
                if h.name not in owner.retention.pruned:
                    owner.retention.pruned.append(h.name)
                owner.retention.pruned_bytes += freed
        return done

    async def _gone(self, owner: RunRecord, name: str) -> bool:
        """Whether a checkpoint whose removal answered with an error is gone all the same."""
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                sizes = await self.daemon.targets.executor(owner).checkpoint_sizes(owner.remote_dir)
        except (ExecutorError, TimeoutError, OSError):
            return False
        return name not in sizes

    async def usage(self, record: RunRecord) -> dict[str, Any]:
        """For `status`: the disk the chain's checkpoints use, each one, and the keep setting."""
        newest = latest_attempt(self.daemon, record)
        chain = chain_attempts(self.daemon, newest)
        held, errors = await self.held(chain)
        bad = bad_checkpoints(self.daemon.records.values())
        return {
            "keep": newest.retention.keep_checkpoints,
            "bytes": sum(h.size for h in held),
            "checkpoints": [
                {"run": h.run, "name": h.name, "bytes": h.size, "complete": h.complete, "bad": h.key in bad}
                for h in sorted(held, key=lambda h: h.order)
            ],
            "pruned": sum(len(r.retention.pruned) for r in chain),
            "pruned_bytes": sum(r.retention.pruned_bytes for r in chain),
            "unreadable": errors,
        }


__all__ = ["Held", "Plan", "Retention", "holding", "is_run_dir", "plan", "protections"]
