"""The queue: runs wait in `queued` until the GPUs they asked for are free, then start.

Order: higher `--priority` first; among equal priority, the run of the user who holds the
fewest GPUs on that target right now (so one user's backlog cannot starve another's first
run); then first come, first served. There is no backfill: a run that waits for two GPUs is
not overtaken by a later run that needs one, so a big run is never starved. A retry waits in
the queue until its backoff is over, without holding up the runs behind it.

A queued run's message says what it waits for now: the end of its backoff, or its GPUs and the
runs that hold them. It is brought up to date on every pass of the queue (a holder that ended is
never named), as the message only: the history keeps the entry the run was queued with, true
when it was written, and gets no new line each time a holder changes.

Runs leave the queue one at a time, each saved `preparing` with its devices before its launch
begins, so a daemon killed at any moment never starts a run twice: a run still `queued` after a
restart is started once, later. What a queued run needs to start (its `--env` values, secrets
and user, and the caller's environment for a target whose jobs start from it) is kept beside its
record in `launch.json`, readable by the daemon's user only, and only while an attempt of its
chain may still start from it: the file is deleted when the chain ends (daemon/recovery.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from daemon.api import StartRequest
from daemon.config import ConfigError
from daemon.models import RunRecord, RunState
from daemon.store import LAUNCH_SETTINGS
from executors.base import RunAs
from trainer_plugin.rundir import atomic_write, read_regular

if TYPE_CHECKING:
    from daemon.service import Daemon

log = structlog.get_logger("obd.queue")
SPEC = LAUNCH_SETTINGS
SAFETY_POLL = 30.0  # the queue is looked at this often even when nothing says it should be


def uses_caller_environment(daemon: Daemon, target: str) -> bool:
    """Whether a job on this target starts from its caller's environment: only a local target's
    (this machine's). SSH, Slurm and pod jobs start from their machine's, so the caller's
    environment is neither kept nor used for them."""
    try:
        return daemon.config.target(target).kind == "local"
    except ConfigError:
        return False  # an unknown target: the start is refused, nothing is kept


def save_spec(daemon: Daemon, run_id: str, req: StartRequest, run_as: RunAs | None) -> None:
    """Keep what a run needs to start later (its request, values included, and its user), in a
    file only the daemon's user can read; the caller's environment only where it is used."""
    if req.environ is not None and (req.env_clear or not uses_caller_environment(daemon, req.target)):
        req = req.model_copy(update={"environ": None})
    data = {"request": req.model_dump(mode="json"), "run_as": run_as.model_dump() if run_as else None}
    directory = daemon.store.run_dir(run_id)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(str(directory / SPEC), json.dumps(data).encode(), 0o600)


def load_spec(daemon: Daemon, run_id: str) -> tuple[StartRequest, RunAs | None] | None:
    raw = read_regular(str(daemon.store.run_dir(run_id) / SPEC), 16 << 20)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        req = StartRequest.model_validate(data["request"])
        run_as = RunAs.model_validate(data["run_as"]) if data.get("run_as") else None
    except (ValueError, KeyError, TypeError):
        return None
    return req, run_as


def drop_spec(daemon: Daemon, run_id: str) -> None:
    """Delete a run's launch.json (its caller's environment, `--env` values and secrets) once
    nothing can start from the run again. Deleted, not emptied: no value of it stays on disk. A
    resume takes the resumer's values, never these."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        os.unlink(daemon.store.run_dir(run_id) / SPEC)


def drop_orphan_specs(daemon: Daemon, keep: Collection[str]) -> None:
    """Delete the launch settings of run directories with no record at all (a start whose record
    could not be saved after its launch.json was, a crash amid the write of one), with any
    temporary copy left behind. The runs in `keep` and those whose record is there but unreadable
    (it may be mended by hand, and its run started) are left alone."""
    try:
        names = os.listdir(daemon.store.runs_dir)
    except FileNotFoundError:
        return
    for name in names:
        directory = daemon.store.runs_dir / name
        if name in keep or os.path.lexists(directory / "run.json"):
            continue
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.listdir(directory):
                if entry == SPEC or entry.startswith(f".{SPEC}.tmp."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(directory / entry)


def queue_message(daemon: Daemon, record: RunRecord, why: str | None = None) -> str:
    """A queued run's message: why it is queued, when that is more than waiting (`why`, else a
    retry's "attempt 3 of 4"), then what it waits for now."""
    waiting = daemon.inventory.waiting_for(record)
    if why is None and record.attempt > 1:
        why = f"attempt {record.attempt} of {record.retries + 1}"
    return f"{why}: {waiting}" if why else waiting


class Scheduler:
    """Starts queued runs when their GPUs are free and their backoff is over."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._kick = anyio.Event()

    def on_change(self, record: RunRecord) -> None:
        """A listener of the daemon's changes: a run that ended frees GPUs; a queued one may start."""
        if record.state.final or record.state == RunState.queued:
            self.kick()

    def kick(self) -> None:
        self._kick.set()

    def queued(self, target: str | None = None) -> list[RunRecord]:
        """The runs waiting to start (not those a scheduler of their target holds), oldest first."""
        runs = [r for r in self.daemon.records.values() if r.in_queue and (target is None or r.target == target)]
        return sorted(runs, key=lambda r: (r.created, r.id))

    async def run(self) -> None:
        while True:
            self._kick = anyio.Event()
            try:
                await self.schedule()
            except Exception:  # a surprise must not end the queue
                log.exception("schedule_failed")
            wait = SAFETY_POLL
            pending = [r.not_before for r in self.queued() if r.not_before]
            if pending:
                wait = max(0.0, min(wait, min(pending) - time.time()) + 0.01)
            with anyio.move_on_after(wait):
                await self._kick.wait()

    async def schedule(self) -> None:
        for target in sorted({r.target for r in self.queued()}):
            await self._schedule_target(target)
            await self._refresh_messages(target)

    async def _refresh_messages(self, target: str) -> None:
        """Bring the message of every run still queued on `target` up to date (see the module's
        docstring); a message that already ends with what the run waits for is left alone, so a
        pass that changes nothing saves nothing."""
        daemon = self.daemon
        now = time.time()
        for record in self.queued(target):
            if record.message.endswith(daemon.inventory.waiting_for(record, now)):
                continue
            async with daemon.editing(record):
                if record.in_queue:  # not started or cancelled meanwhile
                    record.message = queue_message(daemon, record)

    def order(self, target: str, runs: list[RunRecord], held: dict[str, str]) -> list[RunRecord]:
        """The queue's order (see the module's docstring)."""
        per_owner: dict[Any, int] = {}  # GPUs each user holds on the target now
        for rid in held.values():
            owner = self.daemon.records[rid].owner_uid if rid in self.daemon.records else None
            per_owner[owner] = per_owner.get(owner, 0) + 1
        return sorted(runs, key=lambda r: (-r.priority, per_owner.get(r.owner_uid, 0), r.created, r.id))

    async def _schedule_target(self, target: str) -> None:
        inventory = self.daemon.inventory
        while True:
            now = time.time()
            ready = [r for r in self.queued(target) if (r.not_before or 0) <= now]
            if not ready:
                return
            held = inventory.held(target)
            head = self.order(target, ready, held)[0]
            devices = inventory.choose(head, held)
            if devices is None:
                return  # the head waits for its GPUs; no backfill behind it
            await self.daemon.launcher.launch_queued(head, devices)

    def position(self, record: RunRecord) -> int | None:
        """1 for the next run to start on its target."""
        if not record.in_queue:
            return None
        held = self.daemon.inventory.held(record.target)
        ordered = self.order(record.target, self.queued(record.target), held)
        return next((i + 1 for i, r in enumerate(ordered) if r.id == record.id), None)
