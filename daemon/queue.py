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

import time
from typing import Any, Protocol

import anyio
import structlog

from daemon.gpus import Inventory, queue_message
from daemon.launch import Launcher
from daemon.models import RunRecord, RunState
from daemon.ports import Runs
from daemon.preempt import Preemptor
from daemon.store import LAUNCH_SETTINGS

log = structlog.get_logger("obd.queue")


class QueueHost(Runs, Protocol):
    """What the queue uses of the daemon beyond the records: the GPU inventory and the launcher."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def launcher(self) -> Launcher: ...

    @property
    def preemptor(self) -> Preemptor: ...


SPEC = LAUNCH_SETTINGS
SAFETY_POLL = 30.0  # the queue is looked at this often even when nothing says it should be


class Scheduler:
    """Starts queued runs when their GPUs are free and their backoff is over."""

    def __init__(self, daemon: QueueHost) -> None:
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
                    record.message = queue_message(daemon.inventory, record)

    def order(self, target: str, runs: list[RunRecord], held: dict[str, str]) -> list[RunRecord]:
        """The queue's order (see the module's docstring)."""
        per_owner: dict[Any, int] = {}  # GPUs each user holds on the target now
        for rid in held.values():
            owner = self.daemon.records[rid].owner_uid if rid in self.daemon.records else None
            per_owner[owner] = per_owner.get(owner, 0) + 1
        # A run paused by a preemption keeps its place: its chain's first queueing, not its attempt's.
        return sorted(
            runs, key=lambda r: (-r.priority, per_owner.get(r.owner_uid, 0), r.queue_since or r.created, r.id)
        )

    async def _schedule_target(self, target: str) -> None:
        inventory = self.daemon.inventory
        if target in self.daemon.preemptor.drains.targets:
            return  # drained for maintenance: nothing starts until `obd targets undrain`
        while True:
            now = time.time()
            ready = [r for r in self.queued(target) if (r.not_before or 0) <= now]
            if not ready:
                return
            held = inventory.held(target)
            head = self.order(target, ready, held)[0]
            devices = inventory.choose(head, held)
            if devices is None:
                # The head waits for its GPUs (no backfill behind it); runs of lower priority may
                # be paused for it, their GPUs handed over once their jobs exited.
                await self.daemon.preemptor.consider(head, held)
                return
            await self.daemon.launcher.launch_queued(head, devices)

    def position(self, record: RunRecord) -> int | None:
        """1 for the next run to start on its target."""
        if not record.in_queue:
            return None
        held = self.daemon.inventory.held(record.target)
        ordered = self.order(record.target, self.queued(record.target), held)
        return next((i + 1 for i, r in enumerate(ordered) if r.id == record.id), None)
