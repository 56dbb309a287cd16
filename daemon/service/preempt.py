"""Preemption and drain: a run of higher priority takes GPUs from lower ones through a verified
snapshot, and the paused runs come back on their own (docs/preemption.md).

When the head of a target's queue cannot start for lack of free GPUs, `Preemptor.consider` looks
at the running runs of strictly lower priority that can be paused: their job announced obd's
plugin (it can snapshot), they are preemptible (`--preemptible`, the target's default), they have
run the target's `min_runtime`, and nothing is stopping them already. If pausing some of them
would let the head start, it chooses them by the rule of `choose_victims` and asks each for a
`preempted` snapshot, the pause recorded in the victim's record before the request is written.
Nothing else is handed over here: a victim's GPUs are free once its record is final, which is
once its job exited (the job wrapper records the end only when every process of it is gone);
the queue then starts the head, the runner of highest priority. Recovery puts each victim back
in the queue as the next attempt of its chain, from its proof (or its chain's newest complete
checkpoint, when the stop fallback had to cancel it), without using a retry.

A drained target (`obd targets drain NAME`) starts nothing, and every run of it that can
snapshot is paused the same way; the drain is kept in `STATE_DIR/drained.json`, so it survives
a restart.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog

from daemon.service.follow import Follower
from daemon.service.gpus import Inventory
from daemon.service.launch import Launcher
from daemon.service.models import Preemption, RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.stop import cancel_asked, request_snapshot
from daemon.service.targets import Targets
from executors.factory import preemption
from trainer_plugin import rundir

log = structlog.get_logger("obd.preempt")
MAX_CANDIDATES = 16  # subsets of more runs than this are not enumerated (a box has a handful)


class PreemptHost(Runs, Protocol):
    """What preemption uses of the daemon beyond the records: the GPU inventory, the targets
    (their settings, and a victim's request goes through them) and the follow (woken)."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def targets(self) -> Targets: ...

    @property
    def follow(self) -> Follower: ...

    @property
    def launcher(self) -> Launcher: ...


# --- the rule ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A running run that may be paused, as the rule weighs it."""

    run_id: str
    devices: tuple[str, ...]
    priority: int
    lost_work: float  # GPU-seconds since its last complete checkpoint: what a failed snapshot would cost
    started: float  # when its job started
    stop_seconds: float = 0.0  # what its stop would take to the proof now (daemon/service/progress.py stop_estimate)


def choose_victims(
    candidates: Sequence[Candidate], free: Iterable[str], wanted: int | Sequence[str]
) -> list[Candidate]:
    """The runs to pause so that a run wanting `wanted` (a count, or device ids) can start, given
    the devices `free` now; [] when pausing every candidate would still not be enough.

    The rule: the fewest GPUs that suffice, never more runs than needed; then the lowest
    priority; then the quickest to stop (the slowest stop among them: the GPUs come when the last
    one is free), to the second; then the least work a failed snapshot would cost; then the most
    recently started.
    """
    free = set(free)
    pool = list(candidates)[:MAX_CANDIDATES]

    def enough(subset: Sequence[Candidate]) -> bool:
        freed = free | {d for c in subset for d in c.devices}
        if isinstance(wanted, int):
            return len(freed) >= wanted
        return set(wanted) <= freed

    def weight(subset: Sequence[Candidate]) -> tuple[int, int, int, int, float, float]:
        return (
            sum(len(c.devices) for c in subset),
            len(subset),
            max(c.priority for c in subset),
            round(max(c.stop_seconds for c in subset)),
            sum(c.lost_work for c in subset),
            -min(c.started for c in subset),
        )

    best: tuple[Candidate, ...] | None = None
    for size in range(1, len(pool) + 1):
        for subset in itertools.combinations(pool, size):
            if enough(subset) and (best is None or weight(subset) < weight(best)):
                best = subset
    return sorted(best, key=lambda c: c.run_id) if best else []


def running_since(record: RunRecord) -> float | None:
    """When the run's job started (its last transition to `running`)."""
    for entry in reversed(record.history):
        if entry.state == RunState.running and entry.reason.startswith(("started", "launched")):
            return entry.time
    return next((e.time for e in reversed(record.history) if e.state == RunState.running), None)


def lost_work(record: RunRecord, now: float) -> float:
    """GPU-seconds since the run's last complete checkpoint (or its start): what pausing it costs
    if its snapshot fails."""
    since = running_since(record) or now
    last = record.progress.last_checkpoint
    step = rundir.checkpoint_step(last.rsplit("/", 1)[-1]) if last else None
    if step is not None and record.progress.step:
        # The share of its time since the start that came after that checkpoint, as steps tell it.
        since = since + (now - since) * min(1.0, step / max(1, record.progress.step))
    return max(0.0, now - since) * max(1, len(record.gpus))


# --- drains --------------------------------------------------------------------------------------


class Drains:
    """The targets drained for maintenance, kept on disk so a drain survives a restart."""

    def __init__(self, state_dir: os.PathLike[str] | str) -> None:
        self.path = os.path.join(os.fspath(state_dir), "drained.json")
        self.targets: set[str] = set()
        data = rundir.read_regular(self.path, 1 << 20)
        if data:
            try:
                loaded = json.loads(data)
            except ValueError:
                loaded = []
            self.targets = {t for t in loaded if isinstance(t, str)} if isinstance(loaded, list) else set()

    def set(self, target: str, drained: bool) -> None:
        (self.targets.add if drained else self.targets.discard)(target)
        rundir.atomic_write(self.path, json.dumps(sorted(self.targets)).encode(), 0o600)


# --- the preemptor -------------------------------------------------------------------------------


class Preemptor:
    """Chooses victims for a queue's head that cannot start, and pauses runs for a drain."""

    def __init__(self, daemon: PreemptHost) -> None:
        self.daemon = daemon
        self.drains = Drains(daemon.state_dir)
        # Runs whose chain's earlier attempt (or the run they resumed) announced obd's plugin: a
        # look at every run, made once a run (those attempts have ended: the answer stays).
        self._announced_before: dict[str, bool] = {}

    def pausing(self, target: str) -> list[RunRecord]:
        """The runs of a target being paused now (asked, their job not ended yet)."""
        return [r for r in self.daemon.records.active() if r.target == target and r.preemption.preempt and r.has_job]

    def settings(self, target: str) -> tuple[bool, float]:
        """The target's default `preemptible` and its `min_runtime`."""
        return preemption(self.daemon.targets.get(target).config)

    def may_snapshot(self, record: RunRecord) -> bool:
        """Whether a run can be paused through a snapshot: its job announced obd's plugin, or has
        not yet (still loading) while an earlier attempt of its chain, or the run it was resumed
        from, did: the plugin takes a request at its first step, as it takes a stop's."""
        if record.snapshots:
            return True
        known = self._announced_before.get(record.id)
        if known is None:
            chain = record.chain or record.id
            known = self._announced_before[record.id] = any(
                r.snapshots and r.id != record.id and ((r.chain or r.id) == chain or r.id == record.resumed_from)
                for r in self.daemon.records.values()
            )
        return known

    def candidates(self, target: str, below: int | None, now: float) -> list[Candidate]:
        """The running runs of `target` that may be paused (of a priority below `below`, when given)."""
        default, min_runtime = self.settings(target)
        out = []
        for r in self.daemon.records.active():
            if r.state != RunState.running or r.target != target or not r.gpus:
                continue  # the cheap looks first
            started = running_since(r)
            if (
                not (r.preemption.preemptible if r.preemption.preemptible is not None else default)
                or (below is not None and r.priority >= below)
                or r.preemption.preempt is not None
                or r.stop.requested_at is not None
                or r.stop.cancel_by is not None
                or started is None
                or now - started < min_runtime
                or not self.may_snapshot(r)  # last: a look at its chain's earlier attempts
            ):
                continue
            stop = r.progress.stop_seconds if r.progress.stop_seconds is not None else 0.0
            out.append(Candidate(r.id, tuple(r.gpus), r.priority, lost_work(r, now), started, stop))
        return out

    async def consider(self, head: RunRecord, held: dict[str, str]) -> list[str]:
        """Pause what the rule chooses so that `head` can start; the runs asked (none while a pause
        on the target is still under way: its GPUs come first)."""
        target = head.target
        if self.pausing(target) or target in self.drains.targets:
            return []
        inventory = self.daemon.inventory
        wanted = inventory.wanted(head)
        free = [g.id for g in inventory.of(target) if g.id not in held]
        victims = choose_victims(self.candidates(target, head.priority, time.time()), free, wanted)
        need = len(wanted) if isinstance(wanted, list) else wanted
        for victim in victims:
            why = f"preempted for run {head.id} (priority {head.priority}), which needed {need} GPU{'s' if need != 1 else ''}"
            await self._pause(
                self.daemon.records[victim.run_id],
                Preemption(for_run=head.id, for_priority=head.priority, needed=need, why=why),
            )
        if victims:
            log.info("preempting", target=target, for_run=head.id, victims=[v.run_id for v in victims])
        return [v.run_id for v in victims]

    async def drain(self, target: str, cancel: bool) -> dict[str, list[str]]:
        """Drain a target: nothing starts on it any more, and every run of it that runs or is being
        started is paused through a snapshot (and requeued). A job that has not announced obd's
        plugin yet (still loading) is asked all the same, as `obd train stop` asks: the plugin takes
        the request at its first step, and the stop fallback ends a job that never announces it
        `proof_timeout` after the drain (it is requeued from its newest checkpoint). `cancel`
        cancels those not announced instead. Runs already being stopped or cancelled are named."""
        self.drains.set(target, True)
        paused: list[str] = []
        unannounced: list[str] = []
        cancelled: list[str] = []
        stopping: list[str] = []
        for r in self.daemon.records.active():
            if r.target != target or not (r.has_job or r.state == RunState.preparing):
                continue
            if r.preemption.preempt is not None:
                paused.append(r.id)  # a pause already under way
            elif r.stop.requested_at is not None or r.stop.cancel_by is not None:
                stopping.append(r.id)  # its own stop or cancel is under way: it ends on its own
            elif cancel and not r.snapshots:
                cancelled.append(r.id)
                await self._cancel(
                    r, f"cancelled: target {target} drained, and it has not announced obd's snapshot plugin"
                )
            else:
                await self._pause(r, Preemption(why=f"target {target} drained"))
                paused.append(r.id)
                if not r.snapshots:
                    unannounced.append(r.id)
        log.info("target_drained", target=target, paused=paused, unannounced=unannounced, cancelled=cancelled)
        return {"paused": paused, "unannounced": unannounced, "cancelled": cancelled, "stopping": stopping}

    async def _cancel(self, record: RunRecord, why: str) -> None:
        async with self.daemon.editing(record):
            cancel_asked(record, why)
        if record.has_job:
            self.daemon.follow.start_cancel(record)
        else:  # still being started: its preparation is ended, and its job never starts
            self.daemon.launcher.cancel_preparation(record)

    def undrain(self, target: str) -> None:
        self.drains.set(target, False)
        log.info("target_undrained", target=target)

    async def _pause(self, record: RunRecord, preemption: Preemption) -> None:
        """Record the pause, then ask the job for a `preempted` snapshot (a daemon killed between the
        two asks at its next start, `catch_up`: the fallback counts from the request)."""
        async with self.daemon.editing(record):
            record.preemption.preempt = preemption
            record.note(preemption.why)
        await self._ask(record)

    async def _ask(self, record: RunRecord) -> None:
        await request_snapshot(self.daemon, record, rundir.PREEMPTED, "obd's preemption")

    def catch_up(self) -> None:
        """At the daemon's start: a pause an earlier daemon recorded but was killed before asking
        for (its request not recorded) is asked for now. Without this the run is never chosen
        again (a pause is under way) nor asked, and what waits for its GPUs waits for ever."""
        for record in list(self.daemon.records.values()):
            if record.preemption.preempt is not None and record.has_job and record.stop.requested_at is None:
                log.info("pause_asked_again", run_id=record.id, for_run=record.preemption.preempt.for_run)
                self.daemon.start_soon(self._ask, record)
