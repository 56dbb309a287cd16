"""The `list` op's answers: which runs a caller is shown, oldest first, as one JSON array.

Root's list is asked most and is the largest: every active run and the latest ends, among the
thousands one member may have queued. Its queued runs and their entries are kept while the queue
is as it was (`QueuedPiece`): a start or an end elsewhere changes the answer, but not those 5,000
entries, so the answer is them with the few other runs put in their places, not 5,000 entries
looked up, filtered and encoded again (issue 33: 19 ms of the event loop for each root's list
after any change, with 5,000 queued)."""

from __future__ import annotations

import bisect
import itertools
import json
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from daemon.service.api import ListRunsRequest, Peer, RawJSON
from daemon.service.models import FINAL_STATES, RunRecord
from daemon.service.records import BY_AGE, FoldKey, Records, fold_key, place, waits
from daemon.service.turns import Share

# The final states as a tuple: a run's state is found in it by identity (a frozenset of them hashes
# each state through Enum's __hash__, a call of Python's: a list of 5,000 looks at each).
_ENDED = tuple(FINAL_STATES)
# Root's default list puts up to this many active runs and ends in place among the queued ones
# (each a bisection); more are sorted with them.
PLACED_AT_MOST = 256


class ListHost(Protocol):
    """What the list needs of the daemon: the records, their version, and their encoded entries."""

    records: Records
    bad_records: dict[str, str]
    version: int  # bumped by every change of a run (`touch`)

    def summary_json(self, record: RunRecord) -> bytes: ...

    def summaries_json(self, records: list[RunRecord]) -> list[bytes]: ...

    def unencoded(self, records: list[RunRecord]) -> list[RunRecord]: ...


def json_array(parts: Sequence[bytes | memoryview]) -> bytes:
    """Encoded JSON values as one array, copied once."""
    if not parts:
        return b"[]"
    pieces: list[bytes | memoryview] = [b"["]
    for part in parts:
        pieces += (part, b",")
    pieces[-1] = b"]"
    return b"".join(pieces)


class Folded(NamedTuple):
    """A sweep's queued members shown as one entry (`fold`), oldest first; `version`: the queue's
    when they last changed (`Records.fold_version`), where it is known."""

    members: list[RunRecord]
    version: int | None = None

    def entry(self, full: bool) -> bytes:
        """Its `list` entry: its oldest member's, named for the sweep and its members' indexes,
        with `folded` (how many) and `indexes` ("5-7,9"). `obd train list --sweep ID` shows each."""
        first = self.members[0]
        tag = first.sweep
        assert tag is not None  # a member of a sweep, or it was not folded
        indexes = index_ranges([r.sweep.index for r in self.members if r.sweep is not None])
        entry = first.summary(full)
        entry.update(id=tag.id, name=f"{tag.name}-[{indexes}]", folded=len(self.members), indexes=indexes)
        return json.dumps(entry).encode()


def index_ranges(indexes: list[int], most: int = 4) -> str:
    """Indexes as ranges, as squeue writes a job array's ("5-7,9,11-12"); past `most` ranges, the
    first few, an ellipsis and the last."""
    ranges: list[list[int]] = []
    for index in sorted(indexes):
        if ranges and index == ranges[-1][1] + 1:
            ranges[-1][1] = index
        else:
            ranges.append([index, index])
    texts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
    if len(texts) > most:
        texts = [*texts[: most - 1], "…", texts[-1]]
    return ",".join(texts)


def fold(runs: Sequence[RunRecord]) -> list[RunRecord | Folded]:
    """`runs` (oldest first) with each sweep's queued members that never ran (`fold_key`), two or
    more on one target, as one `Folded` in its oldest member's place: root's table of 5,000 queued
    runs in five sweeps is five lines and a few kilobytes, not 5,000 lines and 3 MB (issue 33)."""
    keys = [fold_key(r) if waits(r) else None for r in runs]
    groups: dict[FoldKey, list[RunRecord]] = {}
    for record, key in zip(runs, keys, strict=True):
        if key is not None:
            groups.setdefault(key, []).append(record)
    items: list[RunRecord | Folded] = []
    for record, key in zip(runs, keys, strict=True):
        if key is None or len(groups[key]) == 1:
            items.append(record)
        elif groups[key][0] is record:
            items.append(Folded(groups[key]))
    return items


def _unfolded(items: Sequence[RunRecord | Folded]) -> list[RunRecord]:
    return [item for item in items if not isinstance(item, Folded)]


def _age(item: RunRecord | Folded) -> tuple[float, str]:
    return BY_AGE(item.members[0] if isinstance(item, Folded) else item)


class QueuedPiece:
    """The queued runs root's list shows (the latest attempts, oldest first) and their entries
    joined with commas, kept while the queue did not change (`Records.queue_version`: a run
    added to it, gone from it, or changed in it). An answer is that piece cut where the few other
    runs go (found by bisection) and joined with them: a few large copies, not 5,000 entries
    joined again; a change of the queue costs one join and one C-speed pass over the entries'
    lengths (a list of keys and offsets made in Python cost 8 of the 12 ms of root's list after a
    run was queued)."""

    def __init__(self) -> None:
        self._version: tuple[int, int] | None = None
        self.runs: list[RunRecord] = []
        self._joined = memoryview(b"")
        self._ends: list[int] = []  # the entries' lengths added up: where each ends, but for the commas

    def current(self, records: Records) -> bool:
        """Whether `runs` are the queue's as it is now (they are found again if not)."""
        queued = records.queued()  # first: it finds a run that left the queue untold
        version = (id(records), records.queue_version)
        if version == self._version:
            return True
        self.runs = [r for r in queued if r.retried_by is None]
        self._version = version
        return False

    def forget(self) -> None:
        """Find the runs again at the next look (the event loop turned while they were encoded)."""
        self._version = None

    def take(self, parts: list[bytes]) -> None:
        """The entries of `runs`, in their order."""
        self._joined = memoryview(b",".join(parts))
        self._ends = list(itertools.accumulate(map(len, parts)))

    def with_others(self, others: list[tuple[RunRecord, bytes]], tail: list[bytes]) -> bytes:
        """The answer: the queued entries with `others` (oldest first) in their places, then `tail`."""
        parts: list[bytes | memoryview] = []
        start = 0
        for record, part in others:
            at = bisect.bisect_left(self.runs, BY_AGE(record), lo=start, key=BY_AGE)
            if at > start:
                parts.append(self._segment(start, at))
            parts.append(part)
            start = at
        if start < len(self.runs):
            parts.append(self._segment(start, len(self.runs)))
        parts += tail
        return json_array(parts)

    def _segment(self, first: int, end: int) -> memoryview:
        """Entries `first` to `end` (not included), without the commas around them."""
        begins = self._ends[first - 1] + first if first else 0  # entry i begins after i commas
        return self._joined[begins : self._ends[end - 1] + end - 1]


class RunLists:
    """The `list` op for every caller: the answer for a question asked again with nothing changed
    (a script polling `obd train list --json`) is sent as it was, not sorted, filtered and joined
    again for every run; root's default list keeps its queued runs joined (`QueuedPiece`)."""

    def __init__(self, daemon: ListHost) -> None:
        self.daemon = daemon
        self._answers: dict[tuple[Any, ...], tuple[tuple[int, int, int], RawJSON]] = {}
        self._order: tuple[tuple[int, int], list[RunRecord]] = ((0, -1), [])  # `ordered`
        self._owned: dict[int | None, list[RunRecord]] = {}  # `ordered_of(owner)`, made with `_order`
        self._queued = QueuedPiece()
        self._fold_entries: dict[tuple[FoldKey | None, bool], tuple[int, bytes]] = {}

    async def answer(self, req: ListRunsRequest, peer: Peer) -> RawJSON:
        d = self.daemon
        key = (
            peer.is_root,
            peer.uid,
            req.all,
            tuple(req.states),
            req.target,
            req.name,
            req.since,
            req.limit,
            req.recent,
            req.fold,
        )
        stamp = (d.version, len(d.records), len(d.bad_records))
        kept = self._answers.get(key)
        if kept is not None and kept[0] == stamp:
            return kept[1]
        if len(self._answers) >= 64:  # many callers or questions (each --since differs): start afresh
            self._answers.clear()
        plain = not (req.all or req.states or req.target or req.name or req.since is not None or req.limit)
        if peer.is_root and plain:
            answer = await (self._root_folded(req.recent, peer) if req.fold else self._root_default(req.recent, peer))
        else:
            answer = await self._filtered_answer(req, peer)
        self._answers[key] = (stamp, answer)
        return answer

    def ordered(self) -> list[RunRecord]:
        """Every run, oldest first (not to be changed by the caller). A run is never removed from
        the records, and its id, owner and creation time never change once it is there: the runs
        added since the last look (the last of the records, a dict) are put in their places, most
        often at the end; the whole is sorted only when the records were loaded anew."""
        records = self.daemon.records
        (known, count), runs = self._order
        if known != id(records) or len(records) < count:
            runs = sorted(records.values(), key=BY_AGE)
            self._owned = {}
            for record in runs:
                self._owned.setdefault(record.owner_uid, []).append(record)
        elif len(records) > count:
            added = list(itertools.islice(reversed(records.values()), len(records) - count))
            for record in reversed(added):
                place(runs, record)
                place(self._owned.setdefault(record.owner_uid, []), record)
        self._order = ((id(records), len(records)), runs)
        return runs

    def ordered_of(self, peer: Peer) -> list[RunRecord]:
        """`ordered`, the caller's runs only (all of them for root): a member's list looks at their
        own, however many runs another member queued."""
        runs = self.ordered()
        return runs if peer.is_root else self._owned.get(peer.uid, [])

    async def _encode_summaries(self, runs: list[RunRecord], peer: Peer) -> bool:
        """Encode the `list` entries of the caller's runs among `runs` that changed since they were
        last encoded, letting others in at each share of the event loop (`Share`): after a sweep of 1,000
        was made (or 5,000 queued runs' messages changed), root's list is not one encoding of them
        all while everyone else waits. Whether it let others in: the answer is then made at once,
        from the runs as they are then, so it is one moment's (a run changed meanwhile is encoded
        again there)."""
        d = self.daemon
        mine = runs if peer.is_root else [r for r in runs if r.owner_uid == peer.uid]  # others' are not kept
        share = Share()
        for record in d.unencoded(mine):
            await share.turn()
            d.summary_json(record)
        return share.turns > 0

    def _root_rest(self, recent: int) -> list[RunRecord]:
        """Root's default list beside its queued runs: the active runs and the `recent` latest ends,
        chains by their latest attempt, oldest first; found from the live runs and the newest end
        back, never by a look at the whole history."""
        rest = [r for r in self.daemon.records.active() if r.retried_by is None]
        ended = 0
        if recent:
            for record in reversed(self.ordered()):
                if record.state in _ENDED and record.retried_by is None:
                    rest.append(record)
                    ended += 1
                    if ended == recent:
                        break
        return sorted(rest, key=BY_AGE)

    async def _root_default(self, recent: int, peer: Peer) -> RawJSON:
        """Root's list as asked most (no filter): every active run and the `recent` latest ends,
        with every queued run, oldest first."""
        d, piece = self.daemon, self._queued
        d.records.active()  # a run waiting again goes back to the queue first
        if not piece.current(d.records):
            if await self._encode_summaries(piece.runs, peer):
                piece.forget()  # others were answered meanwhile: the runs as they are now
                piece.current(d.records)
            piece.take(d.summaries_json(piece.runs))
        rest = self._root_rest(recent)
        if len(rest) > PLACED_AT_MOST:
            return RawJSON(json_array([*d.summaries_json(sorted(piece.runs + rest, key=BY_AGE)), *self._unreadable()]))
        return RawJSON(piece.with_others(list(zip(rest, d.summaries_json(rest), strict=True)), self._unreadable()))

    async def _root_folded(self, recent: int, peer: Peer) -> RawJSON:
        """Root's default list with each sweep's queued members folded (`fold`): the queue as the
        records keep it folded (`Records.queue_folds`: no look at each queued run), with the
        active runs and latest ends, by age."""
        items, rest = self._root_queue_folded(), self._root_rest(recent)
        if await self._encode_summaries(_unfolded(items) + rest, peer):
            items, rest = self._root_queue_folded(), self._root_rest(recent)  # the runs as they are now
        items += rest
        return RawJSON(json_array([*self._entries(sorted(items, key=_age), peer), *self._unreadable()]))

    def _root_queue_folded(self) -> list[RunRecord | Folded]:
        records = self.daemon.records
        records.active()  # a run waiting again goes back to the queue first
        loose, folds = records.queue_folds()
        items: list[RunRecord | Folded] = [r for r in loose if r.retried_by is None]  # a chain's latest attempt
        for key, members in folds.items():
            items.append(Folded(members, records.fold_version(key)) if len(members) > 1 else members[0])
        return items

    def _entries(self, items: Sequence[RunRecord | Folded], peer: Peer) -> list[bytes]:
        """The `list` entries of runs and folded sweeps, as `peer` may see them (all of another
        member's run but its message and snapshot)."""
        d = self.daemon
        parts = []
        for item in items:
            if isinstance(item, Folded):
                parts.append(self._folded_entry(item, full=peer.is_root or item.members[0].owner_uid == peer.uid))
            elif peer.is_root or item.owner_uid == peer.uid:
                parts.append(d.summary_json(item))
            else:
                parts.append(json.dumps(item.summary(full=False)).encode())
        return parts

    def _folded_entry(self, folded: Folded, full: bool) -> bytes:
        """`Folded.entry`, made again only after the fold changed (a sweep of 1,000 being cancelled
        changes one fold, not the others)."""
        if folded.version is None:
            return folded.entry(full)
        key = (fold_key(folded.members[0]), full)
        kept = self._fold_entries.get(key)
        if kept is None or kept[0] != folded.version:
            if len(self._fold_entries) >= 256:
                self._fold_entries.clear()
            kept = self._fold_entries[key] = (folded.version, folded.entry(full))
        return kept[1]

    def _unreadable(self) -> list[bytes]:
        """Root's entries for the records that could not be read."""
        return [
            json.dumps({"id": rid, "state": "unreadable", "message": err}).encode()
            for rid, err in sorted(self.daemon.bad_records.items())
        ]

    async def _filtered_answer(self, req: ListRunsRequest, peer: Peer) -> RawJSON:
        runs = self._filtered(req, peer)
        items: Sequence[RunRecord | Folded] = fold(runs) if req.fold else runs
        if await self._encode_summaries(_unfolded(items) if req.fold else runs, peer):
            runs = self._filtered(req, peer)  # others were answered meanwhile: the runs as they are now
            items = fold(runs) if req.fold else runs
        parts = self.daemon.summaries_json(runs) if peer.is_root and not req.fold else self._entries(items, peer)
        if peer.is_root and (req.all or not req.states):
            parts += self._unreadable()
        return RawJSON(json_array(parts))

    def _filtered(self, req: ListRunsRequest, peer: Peer) -> list[RunRecord]:
        """The runs a `list` with a filter, or a member's, answers with (see ListRunsRequest),
        oldest first: a look at each of the runs it may show."""
        runs = self.ordered() if req.all else self.ordered_of(peer)  # as `visible`
        if req.states:
            runs = [r for r in runs if r.state.value in req.states]
        if req.target:
            runs = [r for r in runs if r.target == req.target]
        if req.name:
            runs = [r for r in runs if r.name == req.name]
        if req.since is not None:
            runs = [r for r in runs if r.created >= req.since]
        if not req.all:
            runs = [r for r in runs if r.retried_by is None]  # a chain shows its latest attempt
        if not (req.all or req.states or req.limit):
            # By default: every active run, and the most recent ends (a look at each state once).
            ended = [i for i, r in enumerate(runs) if r.state in _ENDED]
            hidden = set(ended[: max(0, len(ended) - req.recent)])
            runs = [r for i, r in enumerate(runs) if i not in hidden]
        if req.limit:
            runs = runs[-req.limit :]
        return runs
