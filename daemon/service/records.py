"""The daemon's runs by id, with those not yet ended kept apart, and among them those waiting in
the queue apart from the rest.

A record is never removed, so a box's history only grows; the queue, the GPUs' holders and
preemption look at the runs many times a second, and need only those that can still hold a GPU or
wait for one. A final state is never left (daemon/service/run_states.py), so a run found ended
leaves the live ones for good: a look at them costs what the live runs cost, not the history
(20,000 ended runs made each queue pass look at all 20,000, 46 ms of the event loop).

The live runs are split in two: those waiting in obd's queue (`queued()`, thousands when one
member queued sweeps) and the rest (`active()`: running, being launched, pending in a
scheduler; a few per GPU). The GPUs' holders, preemption and the follow look at the active ones
only, so 5,000 queued runs cost them nothing. A record changes in place; its place in the split
is found again when the daemon is told it changed (`touched`, by `Daemon.touch`, which every edit
calls), and, should a change come untold, by every look at the part it was in: a run that left
the queue by the next `queued()` (each queue pass begins with one), one that came back to it by
the next `active()`, an ended one by either. A new record is placed when it is added.

The queue is also kept as `obd train list`'s table folds it (daemon/service/run_list.py): each
sweep's members that never ran, by sweep and target, apart from the other queued runs
(`queue_folds`), so root's table of 5,000 queued runs in five sweeps is found without a look at
each of them (three looks at 5,000 runs cost the event loop 17 ms).
"""

from __future__ import annotations

import bisect
from operator import attrgetter

from daemon.service.models import FINAL_STATES, RunRecord, RunState

_QUEUED = RunState.queued
BY_AGE = attrgetter("created", "id")  # oldest first: the queue's, and a list's, order


def place(runs: list[RunRecord], record: RunRecord) -> None:
    """Put a run into a list of runs oldest first, in its place (at the end, most often)."""
    if not runs or BY_AGE(record) >= BY_AGE(runs[-1]):
        runs.append(record)
    else:
        bisect.insort(runs, record, key=BY_AGE)


FoldKey = tuple[str, str]  # a sweep's id and a target


def fold_key(record: RunRecord) -> FoldKey | None:
    """The fold a queued run is shown in (its sweep and target), if it is a sweep's member that never
    ran: a retry, a resume or a paused run's next attempt has a story of its own to show."""
    if (
        record.sweep is None
        or record.attempt != 1
        or record.resumed_from is not None
        or record.preemption.paused is not None
        or record.retried_by is not None
    ):
        return None
    return (record.sweep.id, record.target)


def _remove(runs: list[RunRecord], record: RunRecord) -> bool:
    """Take a run out of a list of runs oldest first; False if it was not in its place."""
    at = bisect.bisect_left(runs, BY_AGE(record), key=BY_AGE)
    if at < len(runs) and runs[at] is record:
        del runs[at]
        return True
    return False


def waits(record: RunRecord) -> bool:
    """`RunRecord.in_queue` without a property's call (a look at thousands of runs a pass)."""
    return record.state is _QUEUED and record.job is None


class Records(dict[str, RunRecord]):
    """Every run the daemon knows, by id (a dict); `live()`: those not found ended yet, split into
    `queued()` and `active()`. `ended_since(n)`: the runs found ended, in the order they were
    found, from the n-th on, for a part that must look once at each run that ended (the GPUs a
    run's process may still hold)."""

    def __init__(self, records: dict[str, RunRecord] | None = None) -> None:
        super().__init__()
        self._live: dict[str, RunRecord] = {}
        self._queue: dict[str, RunRecord] = {}  # live and, when last looked at, waiting in the queue
        self._queued_by: dict[int | None, int] = {}  # `_queue`'s runs of each owner (`queued_count`)
        self._active: dict[str, RunRecord] = {}  # live and not waiting in the queue
        self._ordered: list[RunRecord] | None = []  # `_queue`, oldest first (None: to sort again)
        self._ended: list[RunRecord] = []
        self._folds: dict[FoldKey, list[RunRecord]] = {}  # `_queue`'s runs of each fold, oldest first
        self._fold_of: dict[str, FoldKey] = {}
        self._loose: dict[str, RunRecord] = {}  # `_queue`'s runs in no fold
        self._fold_versions: dict[FoldKey, int] = {}  # the queue's version at a fold's last change
        # Counts every change of the queued runs: one added, one leaving, one changed (`touched`).
        self.queue_version = 0
        for record in (records or {}).values():
            self[record.id] = record

    def __setitem__(self, run_id: str, record: RunRecord) -> None:
        before = self.get(run_id)
        super().__setitem__(run_id, record)
        self._dequeue(run_id)
        self._active.pop(run_id, None)
        if record.state in FINAL_STATES:
            self._live.pop(run_id, None)
            if before is None or before.state not in FINAL_STATES:  # found ended once
                self._ended.append(record)
            return
        self._live[run_id] = record
        if waits(record):
            self._enqueue(record)
        else:
            self._active[run_id] = record

    def __delitem__(self, run_id: str) -> None:
        super().__delitem__(run_id)
        self._live.pop(run_id, None)
        self._dequeue(run_id)
        self._active.pop(run_id, None)

    def live(self) -> list[RunRecord]:
        """The runs not ended, in the order they were added (those that ended since the last look
        are moved to the ended ones here)."""
        self.queued()
        self.active()
        return list(self._live.values())

    def touched(self, record: RunRecord) -> None:
        """A run changed: put it where it is now (a look at it alone)."""
        if self._live.get(record.id) is record:
            if record.id in self._queue:
                self.queue_version += 1  # changed while queued (its message, its priority), or left
                key = self._fold_of.get(record.id)
                if key is not None:
                    self._fold_versions[key] = self.queue_version
                if key != fold_key(record) and waits(record):  # filed again where it belongs now
                    self._dequeue(record.id)
                    self._enqueue(record)
            self._move(record)

    def queued(self) -> list[RunRecord]:
        """The runs waiting in obd's queue (`in_queue`), oldest first (`created`, then id)."""
        # `waits` written out: a function's call for each of 5,000 queued runs cost a list 1 ms.
        for record in [r for r in self._queue.values() if r.state is not _QUEUED or r.job is not None]:
            self._move(record)
        if self._ordered is None:
            self._ordered = sorted(self._queue.values(), key=BY_AGE)
        return list(self._ordered)

    def active(self) -> list[RunRecord]:
        """The runs not ended and not waiting in obd's queue: running, being launched, paused on
        their way out, pending in a target's scheduler (`has_job`); in the order they were added."""
        moved = [r for r in self._active.values() if r.state in FINAL_STATES or waits(r)]
        for record in moved:
            self._move(record)
        return list(self._active.values())

    def _move(self, record: RunRecord) -> None:
        """Put a live run where it is now: ended, in the queue, or active."""
        run_id = record.id
        if waits(record):
            if run_id not in self._queue:
                self._active.pop(run_id, None)
                self._enqueue(record)
            return
        self._dequeue(run_id)
        if record.state in FINAL_STATES:
            self._active.pop(run_id, None)
            del self._live[run_id]
            self._ended.append(record)
        else:
            self._active[run_id] = record

    def _enqueue(self, record: RunRecord) -> None:
        self._queue[record.id] = record
        self._queued_by[record.owner_uid] = self._queued_by.get(record.owner_uid, 0) + 1
        if self._ordered is not None:  # in its place: 5,000 are not sorted again
            place(self._ordered, record)
        self.queue_version += 1
        key = fold_key(record)
        if key is None:
            self._loose[record.id] = record
        else:
            self._fold_of[record.id] = key
            place(self._folds.setdefault(key, []), record)
            self._fold_versions[key] = self.queue_version

    def _dequeue(self, run_id: str) -> None:
        """Take a run out of `_queue`, if it is there."""
        record = self._queue.pop(run_id, None)
        if record is None:
            return
        left = self._queued_by[record.owner_uid] - 1
        if left:
            self._queued_by[record.owner_uid] = left
        else:
            del self._queued_by[record.owner_uid]
        if self._ordered is not None and not _remove(self._ordered, record):
            self._ordered = None  # not where it should be: sorted again at the next look
        self.queue_version += 1
        self._loose.pop(run_id, None)
        key = self._fold_of.pop(run_id, None)
        if key is not None:
            members = self._folds[key]
            if not _remove(members, record):  # not in its place: found by identity
                members[:] = [m for m in members if m is not record]
            if members:
                self._fold_versions[key] = self.queue_version
            else:
                del self._folds[key], self._fold_versions[key]

    def queue_folds(self) -> tuple[list[RunRecord], dict[FoldKey, list[RunRecord]]]:
        """The queue as `obd train list`'s table folds it: the runs in no fold (in the order they
        joined), and each fold's runs oldest first (not to be changed by the caller)."""
        self.queued()  # first: it finds a run that left the queue untold
        return list(self._loose.values()), self._folds

    def fold_version(self, key: FoldKey) -> int:
        """The queue's version when the fold last changed (a member came, left or changed)."""
        return self._fold_versions[key]

    def queued_count(self, owner_uid: int | None) -> int:
        """How many of `owner_uid`'s runs wait in the queue, with no look at any run (a capped
        user's every start asks it, with 5,000 queued by another). A run that left the queue
        with no word to the daemon (`touched`) counts until the next `queued()` or `active()`."""
        return self._queued_by.get(owner_uid, 0)

    def ended_since(self, seen: int) -> list[RunRecord]:
        """The runs found ended after the first `seen` of them (call `live()` first to find those
        that ended since)."""
        return self._ended[seen:]
