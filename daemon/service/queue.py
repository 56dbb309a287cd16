"""The queue: runs wait in `queued` until the GPUs they asked for are free, then start.

Order: higher `--priority` first; among equal priority, the run of the user who holds the
fewest GPUs on that target right now (so one user's backlog cannot starve another's first
run); then first come, first served. There is no backfill: a run that waits for two GPUs is
not overtaken by a later run that needs one, so a big run is never starved. A retry waits in
the queue until its backoff is over, without holding up the runs behind it.

A queued run's message says what it waits for now: the end of its backoff, or its GPUs and the
runs that hold them. It is brought up to date on every pass of the queue (a holder that ended is
never named), as the message only: the history keeps the entry the run was queued with, true
when it was written, and gets no new line each time a holder changes. Such a message is not
saved: it is said again by every pass (the first after a restart included) from the records
alone, and goes to disk with the run's next save; a sweep of 1,000 made is not 1,000 more saves.

A pass costs a look at each queued run, never a look at every run for each (the GPUs' holders
and how much of each sweep is made are looked up once a pass), and an operation on many runs (a
sweep made, cancelled or stopped) holds the queue (`holding`) so that it gets one pass when it
ends, not one per run: 5,000 runs queued never hold the daemon up. Most passes of a busy box
follow a change that cannot start a queued run (another user's run with no GPU began or ended):
while the queued runs, the GPUs and their holders, the drains and the configuration are those of
the last full pass, and every queued run waits for GPUs only (nothing to gate, no backoff, no
deadline, no placement), a pass is quiet (`_quiet`): it looks at no queued run and considers
preemption for each head again (time may make a victim of a running run). It trusts the last
full pass for MEMO_FOR at most.

A run of several targets (`--target a,b,c`, a pool) or of a target with an `overflow` is placed by
each pass before the targets' queues are looked at (`_place`, daemon/service/placement.py): on the first of
its targets that can start it now, else it waits on the first; preemption is considered for it
there only, once no other target of its can start it.

A run may also wait for other runs (`--after`, daemon/service/after.py) or for the rest of its sweep to
be made (daemon/service/sweeps.py): `gate` says so on every pass, from the records alone, and such a run
holds up no run behind it; one that never will start (a run it waits for ended otherwise) is
cancelled, its message saying why.

Runs leave the queue one at a time, each saved `preparing` with its devices before its launch
begins, so a daemon killed at any moment never starts a run twice: a run still `queued` after a
restart is started once, later. What a queued run needs to start (its `--env` values, secrets
and user, and the caller's environment for a target whose jobs start from it) is kept beside its
record in `launch.json`, readable by the daemon's user only, and only while an attempt of its
chain may still start from it: the file is deleted when the chain ends (daemon/service/recovery.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import structlog

from daemon.service import after, limits, placement, sweeps
from daemon.service.after import Continues, Verdict
from daemon.service.api import ApiError
from daemon.service.gpus import GpuWords, Inventory, queue_message
from daemon.service.launch import Launcher
from daemon.service.models import Placement, RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.preempt import Preemptor
from daemon.service.records import waits
from daemon.service.specs import load_spec
from daemon.service.store import LAUNCH_SETTINGS, process_started
from daemon.service.targets import Targets
from daemon.service.turns import Share

log = structlog.get_logger("obd.queue")


class QueueHost(Runs, Protocol):
    """What the queue uses of the daemon beyond the records: the GPU inventory and the launcher."""

    @property
    def inventory(self) -> Inventory: ...

    @property
    def version(self) -> int: ...  # bumped by every change of a run (`touch`)

    @property
    def launcher(self) -> Launcher: ...

    @property
    def preemptor(self) -> Preemptor: ...

    @property
    def recovery(self) -> Continues: ...

    @property
    def targets(self) -> Targets: ...


SPEC = LAUNCH_SETTINGS
SAFETY_POLL = 30.0  # the queue is looked at this often even when nothing says it should be
SOON = 1.0  # ... and this often while a run it waits for is between two attempts (no record changes then)
MANY = 100  # queued runs past which the two limits below apply (a pass's loops share the event loop: turns.py)
# A target with more than MANY queued runs has their messages said again at most this often: a
# refresh looks at every one of them (5,000: a tenth of a second of the event loop), and every start
# or end of any run is a pass.
MESSAGES_EVERY = 1.0
# With more than MANY runs queued, a pass begins at most this long after the last began: the kicks
# that come closer make one pass (every start or end of anyone's run kicks, and a pass looks at
# every queued run), as Slurm's `sched_min_interval` does. A GPU freed waits that long at most.
PASS_GAP = 0.25


# A quiet pass (`Scheduler._quiet`) trusts the last full pass at most this long: a change that
# came without `Daemon.touch` is found by the next full one.
MEMO_FOR = 5.0


@dataclass
class _Memo:
    """A full pass that left the queue plain, for the quiet passes after it (`Scheduler._quiet`)."""

    stamp: tuple[Any, ...]
    at: float  # time.monotonic()
    targets: list[str]
    heads: dict[str, str]  # target -> its head, waiting for GPUs
    many: bool  # more than MANY runs queued (`PASS_GAP`)
    messages_due: float | None  # a refresh of the messages it put off (MESSAGES_EVERY): a full pass then


def queued_why(record: RunRecord) -> str | None:
    """Why a queued run is queued, when that is more than waiting: a paused run's pause, or a
    retry's attempt among all its chain may make (a pause's attempt uses no retry)."""
    paused = record.preemption.paused
    if paused is not None:
        since = time.strftime("%H:%M:%S", time.localtime(paused.since))
        return f"paused ({paused.why}) since {since}"
    if record.attempt > 1:
        return f"attempt {record.attempt} of {record.retries + 1 + record.preemption.preemptions}"
    return None


class Scheduler:
    """Starts queued runs when their GPUs are free and their backoff is over."""

    def __init__(self, daemon: QueueHost) -> None:
        self.daemon = daemon
        self._kick = anyio.Event()
        self._started = process_started()  # a sweep member made before it, its sweep not whole: cut short
        self._whole: set[str] = set()  # sweeps every member of which is saved
        self._made: dict[str, int] | None = None  # during a pass: how many members of each sweep are saved
        self._holders: dict[str, dict[str, str]] | None = None  # during a pass: each target's GPU holders
        self._waiting: list[RunRecord] | None = None  # during a pass: the runs queued when it began, oldest first
        # During a pass: `queued(target)` as of a daemon version (a pass asks it several times,
        # and between two changes of a run the answer is the same: a look at every queued run each).
        self._looked: dict[str | None, tuple[int, list[RunRecord]]] = {}
        self._share = Share()  # a pass's share of the event loop (turns.py), made as the pass begins
        self._left: list[RunRecord] = []  # those still queued when the last pass ended
        self._memo: _Memo | None = None  # the last pass, while the next may be quiet (`_quiet`)
        self._plain = True  # during a pass: no run of it needs more than its GPUs
        self._heads: dict[str, str] = {}  # during a pass: each target's head that waits for GPUs
        self._soon = False
        self._holds = 0  # operations on many runs under way (`holding`)
        self._messages_at: dict[str, float] = {}  # each target's last refresh of its queued runs' messages
        self._messages_due: float | None = None  # a refresh put off (MESSAGES_EVERY): the pass that makes it
        self._kicked_while_held = False

    def on_change(self, record: RunRecord) -> None:
        """A listener of the daemon's changes: a run that ended frees GPUs; a queued one may start."""
        if record.state.final or record.state == RunState.queued:
            self.kick()

    def kick(self) -> None:
        if self._holds:
            self._kicked_while_held = True  # one pass when the operation ends
            return
        self._kick.set()

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the queue's passes while an operation changes many runs (a sweep made, cancelled or
        stopped): the changes are taken by one pass when it ends, not by one pass per run."""
        self._holds += 1
        try:
            yield
        finally:
            self._holds -= 1
            if not self._holds and self._kicked_while_held:
                self._kicked_while_held = False
                self.kick()

    def queued(self, target: str | None = None) -> list[RunRecord]:
        """The runs waiting to start (not those a scheduler of their target holds), oldest first."""
        if self._waiting is not None:  # during a pass: its look at every record, those that left taken out
            version = self.daemon.version
            looked = self._looked.get(target)
            if looked is not None and looked[0] == version:
                return list(looked[1])
            runs = [r for r in self._waiting if waits(r) and (target is None or r.target == target)]
            self._looked[target] = (version, runs)
            return list(runs)
        runs = self.daemon.records.queued()
        return runs if target is None else [r for r in runs if r.target == target]

    async def run(self) -> None:
        while True:
            self._kick = anyio.Event()
            began = time.monotonic()
            try:
                await self.schedule()
            except Exception:  # a surprise must not end the queue
                log.exception("schedule_failed")
            wait = SOON if self._soon else SAFETY_POLL
            waiting, self._left = self._left, []
            gap = PASS_GAP if len(waiting) > MANY or (self._memo is not None and self._memo.many) else 0.0
            pending = self._due_times(waiting)
            if self._messages_due is not None:
                pending.append(self._messages_due)
            if pending:
                wait = max(0.0, min(wait, min(pending) - time.time()) + 0.01)
            with anyio.move_on_after(wait):
                await self._kick.wait()
            await anyio.sleep(max(0.0, began + gap - time.monotonic()))  # kicks meanwhile: this one pass

    def _due_times(self, waiting: list[RunRecord]) -> list[float]:
        """When a run still queued must be looked at again though nothing changes: its backoff's
        end, its deadline, an overflow's wait (none for a quiet pass's runs: see `_quiet`)."""
        pending = [r.not_before for r in waiting if r.not_before]
        limited = [r for r in waiting if r.limits is not None]
        pending += [at for r in limited if (at := limits.too_late_at_of(self.daemon, r)) is not None]
        config = self.daemon.config
        watched = placement.watched_runs(config, waiting)
        pending += [at for r in watched for _, _, at in placement.overflow_due(config, r) if at > time.time()]
        return pending

    def _stamp(self, targets: Iterable[str]) -> tuple[Any, ...]:
        """What a pass's outcome depends on beyond time: the queued runs (each addition, removal or
        change of one counts: `Records.queue_version`), the configuration, the drains, and each
        target's GPUs and their holders."""
        daemon = self.daemon
        inventory = daemon.inventory
        held = tuple(
            (t, tuple(g.id for g in inventory.of(t)), tuple(sorted(inventory.held(t).items()))) for t in targets
        )
        drains = frozenset(daemon.preemptor.drains.targets)
        return (id(daemon.records), daemon.records.queue_version, id(daemon.config), drains, held)

    async def _quiet(self) -> bool:
        """A pass that nothing can change from the last full one (its `_Memo`, as that pass
        began): the same queued runs, all of them plain (nothing to gate, no backoff, no deadline,
        no placement; their messages said, or put off to a time that has not come), the same
        holders of the same GPUs, no drain begun or ended. Its heads still wait; only preemption,
        which time changes (a victim's `min_runtime`), is considered again for each. Trusted for
        MEMO_FOR at most, should a change come untold (a look at everything then)."""
        memo = self._memo
        if memo is None or time.monotonic() - memo.at > MEMO_FOR or self._stamp(memo.targets) != memo.stamp:
            return False
        if memo.messages_due is not None and time.time() >= memo.messages_due:
            return False  # the messages it put off are due: said by a full pass
        for target, run_id in memo.heads.items():
            head = self.daemon.records.get(run_id)
            if head is None or not waits(head):
                return False
            await self.daemon.preemptor.consider(head, self.daemon.inventory.held(target))
        self._soon = False
        self._messages_due = memo.messages_due
        return True

    async def schedule(self) -> None:
        if await self._quiet():
            return
        self._memo = None
        self._plain = True  # until a run of this pass needs more than its GPUs (`_quiet`)
        self._heads = {}
        self._soon = False
        self._messages_due = None
        self._made = None  # looked up by the pass's first gate of a sweep not known whole
        self._holders = {}
        self._looked = {}
        self._share = Share()  # the whole pass's: its looks before each loop count too
        self._waiting = self.queued()  # a run queued meanwhile kicks the queue: the next pass has it
        # What this pass looks at, as it begins (no await before): a change while it runs, its own
        # launches and messages included, makes the next pass a full one too.
        began = sorted({r.target for r in self._waiting})
        stamp = self._stamp(began)
        try:
            await self._share.turn()
            await self._place()
            await self._share.turn()
            targets = sorted({r.target for r in self.queued()})
            for target in targets:
                await self._share.turn()
                await self._schedule_target(target)
                await self._share.turn()
                await self._refresh_messages(target)
            self._left = self.queued()  # what `run` looks at for the time of the next pass
            if self._plain and not self._soon and targets == began:
                many = len(self._left) > MANY
                self._memo = _Memo(stamp, time.monotonic(), began, dict(self._heads), many, self._messages_due)
        finally:
            self._made = None
            self._holders = None
            self._waiting = None
            self._looked = {}

    def _sweeps_made(self) -> dict[str, int]:
        """How many members of each sweep are saved (a member may start once all are)."""
        indices: dict[str, set[int]] = {}
        for r in self.daemon.records.values():
            if r.sweep is not None and r.sweep.id not in self._whole:
                indices.setdefault(r.sweep.id, set()).add(r.sweep.index)
        return {sweep: len(made) for sweep, made in indices.items()}

    async def _refresh_messages(self, target: str) -> None:
        """Bring the message of every run still queued on `target` up to date (see the module's
        docstring); a message that already ends with what the run waits for is left alone, so a
        pass that changes nothing saves nothing."""
        daemon = self.daemon
        now = time.time()
        queued = self.queued(target)
        if len(queued) > MANY:
            due = self._messages_at.get(target, 0.0) + MESSAGES_EVERY
            if now < due:  # said by a pass then (`run` wakes for it)
                self._messages_due = min(due, self._messages_due or due)
                return
            self._messages_at[target] = now
        held, version = daemon.inventory.held(target), daemon.version
        said: GpuWords = {}  # the GPUs' words with these holders
        changed = []
        share = self._share
        for record in queued:
            turned = await share.turn()
            if turned and daemon.version != version:  # as it is now (a look at every record: not for nothing)
                held, version, said = daemon.inventory.held(target), daemon.version, {}
            if not record.in_queue or daemon.lock(record.id).locked():
                continue  # an edit of it is under way (a cancel, its start): the next pass looks
            waiting = self.waiting_for(record, now, held, said)
            if record.message.endswith(waiting):
                continue
            # No await between the look and the change: no edit of it comes in between.
            record.message = queue_message(daemon.inventory, record, queued_why(record), waiting)
            changed.append(record)
        for record in changed:
            await share.turn()
            daemon.touch(record)  # watchers see it; not saved (see the module's docstring)

    def gate(self, record: RunRecord) -> Verdict | None:
        """Whether a queued run may leave the queue as far as the runs it waits for and its sweep go
        (None: it may; else wait or cancel, and why); and a run whose deadline came while it
        waited never starts."""
        late = limits.too_late_of(self.daemon, record, time.time())
        if late is not None:
            return Verdict("cancel", late)
        if record.sweep is not None and record.sweep.id not in self._whole:
            if self._made is None or self._waiting is None:  # once a pass (every time outside one)
                self._made = self._sweeps_made()
            made = self._made.get(record.sweep.id, 0)
            held = sweeps.gate(record, made, self._started)
            if held is not None:
                return held
            self._whole.add(record.sweep.id)
        if not record.dependencies.after:
            return None
        verdict = after.verdict(self.daemon, record)
        if verdict.action == "wait" and after.in_between(self.daemon, record):
            self._soon = True
        return verdict

    def waiting_for(
        self,
        record: RunRecord,
        now: float | None = None,
        held: dict[str, str] | None = None,
        memo: GpuWords | None = None,
    ) -> str:
        """What a queued run waits for now, in words: the runs it waits for, else why none of its
        targets can take it (a run of several), else its target's drain, else its backoff or GPUs
        (`memo`: see Inventory.waiting_for); then the overflows still to come (daemon/service/placement.py)."""
        verdict = self.gate(record)
        if verdict is not None and verdict.action == "wait":
            return verdict.why
        now = time.time() if now is None else now
        later = placement.waiting_words(self.daemon.config, record, now)  # its overflows to come
        prefs = placement.preferences(record)
        if len(prefs) > 1 and (record.not_before or 0) <= now:
            holders = {record.target: held} if held is not None else {}
            why = [self._unfit_now(record, t, holders.get(t)) for t in prefs]
            given = record.placement.given if record.placement is not None else record.target
            return f"waiting for one of {given}: {'; '.join(w for w in why if w) or 'placed at the next pass'}" + later
        if record.target in self.daemon.preemptor.drains.targets:
            return (
                f"waiting: target {record.target} is drained, nothing starts on it until "
                f"`obd targets undrain {record.target}`"
            ) + later
        return self.daemon.inventory.waiting_for(record, now, held, memo) + later

    async def _held_back(self, target: str) -> set[str]:
        """The queued runs of `target` that may not start yet (`gate`); those that never will are
        cancelled now, their message saying why."""
        held: set[str] = set()
        whole = self._whole
        share = self._share
        for record in self.queued(target):
            await share.turn()
            if (
                record.limits is None
                and record.not_before is None
                and not record.dependencies.after
                and (record.sweep is None or record.sweep.id in whole)
            ):
                continue  # nothing to gate (most of thousands queued): `gate` would say None
            self._plain = False
            if not waits(record):
                continue  # started or cancelled while others were answered
            verdict = self.gate(record)
            if verdict is None or verdict.action == "start":
                continue
            if verdict.action == "wait":
                held.add(record.id)
                continue
            async with self.daemon.editing(record):
                if record.in_queue:
                    record.transition(RunState.cancelled, verdict.why)
            log.info("queued_run_cancelled", run_id=record.id, why=verdict.why)
        return held

    def order(self, target: str, runs: list[RunRecord], held: dict[str, str]) -> list[RunRecord]:
        """The queue's order (see the module's docstring)."""
        return sorted(runs, key=self._sort_key(held))

    def _sort_key(self, held: dict[str, str]) -> Callable[[RunRecord], tuple[Any, ...]]:
        """A run's place in a target's queue, given the holders of that target's GPUs now."""
        per_owner: dict[Any, int] = {}  # GPUs each user holds on the target now
        for rid in held.values():
            owner = self.daemon.records[rid].owner_uid if rid in self.daemon.records else None
            per_owner[owner] = per_owner.get(owner, 0) + 1
        # A run paused by a preemption keeps its place: its chain's first queueing, not its attempt's.
        return lambda r: (-r.priority, per_owner.get(r.owner_uid, 0), r.preemption.queue_since or r.created, r.id)

    # --- placement over several targets, and overflow (daemon/service/placement.py) ----------------------

    def _unfit(self, record: RunRecord, target: str, held: dict[str, str], head: RunRecord | None) -> str:
        """Why a queued run cannot start on `target` now, in words ("" when it can)."""
        if target in self.daemon.preemptor.drains.targets:
            return f"{target} is drained"
        inventory = self.daemon.inventory
        if inventory.choose(record, held, target) is None:
            gpus = inventory.of(target)
            wanted = inventory.wanted(record, target)
            holders = sorted({rid for d, rid in held.items() if d in {g.id for g in gpus}})
            by = f" (by {', '.join(holders)})" if holders else ""
            free = len(gpus) - len([g for g in gpus if g.id in held])
            if isinstance(wanted, list):
                missing = [w for w in wanted if w not in {g.id for g in gpus}]
                if missing:
                    return f"{target} has no GPU {', '.join(missing)}"
                return f"{target}'s GPUs {','.join(wanted)} are held{by}"
            if wanted > len(gpus):
                return f"{target} has {len(gpus)} GPUs, it asks for {wanted}"
            if free == 0:
                return f"{target}'s {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} all held{by}"
            return f"{target} has {free} of {len(gpus)} GPUs free, it asks for {wanted}{by}"
        if head is not None and head.id != record.id:
            key = self._sort_key(held)
            if key(head) < key(record):
                return f"{target}'s free GPUs go to {head.id} first (ahead of it there)"
        return ""

    async def _place(self) -> None:
        """Place every queued run of several targets, or with an overflow due, on the first of its
        targets that can start it now (daemon/service/placement.py); the runs of higher priority (then the
        longest waiting) first, each taking the devices it will be given, so two never count on the
        same free GPU."""
        daemon = self.daemon
        config = daemon.config
        now = time.time()
        runs = placement.watched_runs(config, self.queued())
        if not runs:
            return
        self._plain = False
        held: dict[str, dict[str, str]] = {}
        heads: dict[str, RunRecord | None] = {}

        def held_on(target: str) -> dict[str, str]:
            if target not in held:
                held[target] = dict(daemon.inventory.held(target))
            return held[target]

        def head_of(target: str) -> RunRecord | None:
            if target not in heads:
                ready = [r for r in self.queued(target) if (r.not_before or 0) <= now and self._may_leave(r)]
                heads[target] = min(ready, key=self._sort_key(held_on(target))) if ready else None
            return heads[target]

        runs.sort(key=lambda r: (-r.priority, r.preemption.queue_since or r.created, r.id))
        share = self._share
        for record in runs:
            await share.turn()
            if not record.in_queue or daemon.lock(record.id).locked() or (record.not_before or 0) > now:
                continue
            if not self._may_leave(record):
                continue
            reasons: list[str] = []
            for target, source in placement.candidates(config, record, now):
                try:
                    why = self._unfit(record, target, held_on(target), head_of(target))
                except ApiError as exc:  # a target its config no longer serves
                    why = f"{target}: {exc}"
                if why:
                    reasons.append(why)
                    continue
                for device in daemon.inventory.choose(record, held_on(target), target) or []:
                    held_on(target)[device] = record.id  # taken: a run after it does not count on it
                if target != record.target or len(placement.preferences(record)) > 1:
                    why = placement.placed_why(record, target, source, config, reasons)
                    await self._place_on(record, target, why)
                break

    def _unfit_now(self, record: RunRecord, target: str, held: dict[str, str] | None) -> str:
        """`_unfit` for a queued run's message: a target gone from the config says so, never breaks the pass."""
        try:
            return self._unfit(record, target, held or self._held_now(target), None)
        except ApiError as exc:
            return f"{target}: {exc}"

    def _held_now(self, target: str) -> dict[str, str]:
        """The holders of a target's GPUs, looked up once a pass (a look at every run)."""
        if self._holders is None:
            return self.daemon.inventory.held(target)
        if target not in self._holders:
            self._holders[target] = self.daemon.inventory.held(target)
        return self._holders[target]

    def _may_leave(self, record: RunRecord) -> bool:
        verdict = self.gate(record)
        return verdict is None or verdict.action == "start"

    async def _place_on(self, record: RunRecord, target: str, why: str) -> None:
        """Put a queued run on `target` (where it starts in this pass), saying where and why."""
        daemon = self.daemon
        if record.target == target and record.placement is not None and record.placement.why == why:
            return
        spec = load_spec(daemon, record.id) if record.target != target else None
        async with daemon.editing(record):
            if not record.in_queue:
                return
            if record.placement is None:  # a run of one target, placed on its overflow
                record.placement = Placement(given=record.target, targets=[record.target])
            if record.target != target:
                try:
                    placement.settle(daemon.targets, record, target, spec[0] if spec is not None else None)
                except ApiError as exc:
                    log.warning("placement_failed", run_id=record.id, target=target, error=str(exc))
                    return
            record.placement.why = why
            record.note(why)
        log.info("run_placed", run_id=record.id, target=target, why=why)

    async def _schedule_target(self, target: str) -> None:
        inventory = self.daemon.inventory
        held_back = await self._held_back(target)  # waiting for runs or its sweep; never holds up others
        if target in self.daemon.preemptor.drains.targets:
            return  # drained for maintenance: nothing starts until `obd targets undrain`
        while True:
            head = await self._head(target, held_back)
            if head is None:
                return
            held = inventory.held(target)
            devices = inventory.choose(head, held)
            if devices is None:
                # The head waits for its GPUs (no backfill behind it); runs of lower priority may
                # be paused for it, their GPUs handed over once their jobs exited.
                self._heads[target] = head.id
                await self.daemon.preemptor.consider(head, held)
                return
            verdict = self.gate(head)
            if verdict is not None and head.dependencies.after:
                async with self.daemon.editing(head):
                    head.note(verdict.why)  # which runs it waited for ended how
            await self.daemon.launcher.launch_queued(head, devices)

    async def _head(self, target: str, held_back: set[str]) -> RunRecord | None:
        """The first in `target`'s queue of its runs that may start now (`order`'s first), looked
        for a share of the event loop at a time (a look at each of thousands); found again if it left
        the queue meanwhile."""
        now = time.time()
        key = self._sort_key(self.daemon.inventory.held(target))
        head, first = None, None
        share = self._share
        for record in self.queued(target):
            await share.turn()
            if (record.not_before or 0) > now or record.id in held_back:
                continue
            mine = key(record)
            if first is None or mine < first:
                head, first = record, mine
        if head is not None and not waits(head):  # left the queue at the last turns
            return await self._head(target, held_back)
        return head

    def position(self, record: RunRecord) -> int | None:
        """1 for the next run to start on its target."""
        if not record.in_queue:
            return None
        held = self.daemon.inventory.held(record.target)
        ordered = self.order(record.target, self.queued(record.target), held)
        return next((i + 1 for i, r in enumerate(ordered) if r.id == record.id), None)
