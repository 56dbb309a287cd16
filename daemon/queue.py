"""The queue: runs wait in `queued` until the GPUs they asked for are free, then start.

Order: higher `--priority` first; among equal priority, the run of the user who holds the
fewest GPUs on that target right now (so one user's backlog cannot starve another's first
run); then first come, first served. There is no backfill: a run that waits for two GPUs is
not overtaken by a later run that needs one, so a big run is never starved. A retry waits in
the queue until its backoff is over, without holding up the runs behind it.

Runs leave the queue one at a time, each saved `preparing` with its devices before its launch
begins, so a daemon killed at any moment never starts a run twice: a run still `queued` after a
restart is started once, later. What a queued run needs to start (its environment and secrets,
its user) is kept beside its record in `launch.json`, readable by the daemon's user only.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from daemon.api import StartRequest
from daemon.models import RunRecord, RunState
from executors.base import RunAs
from trainer_plugin.rundir import atomic_write, read_regular

if TYPE_CHECKING:
    from daemon.service import Daemon

log = structlog.get_logger("obd.queue")
SPEC = "launch.json"
SAFETY_POLL = 30.0  # the queue is looked at this often even when nothing says it should be


def save_spec(daemon: Daemon, run_id: str, req: StartRequest, run_as: RunAs | None) -> None:
    """Keep what a run needs to start later (its request, values included, and its user)."""
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


def forget_secrets(daemon: Daemon, run_id: str) -> None:
    """Once nothing will start from a run again, its secrets are not kept (its other values are,
    for `obd train resume`)."""
    spec = load_spec(daemon, run_id)
    if spec is None or not spec[0].secrets:
        return
    req, run_as = spec
    req.secrets = {}
    save_spec(daemon, run_id, req, run_as)


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
