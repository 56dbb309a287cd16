"""The run store: one `runs/<id>/run.json` per run, each saved whole or not at all.

A save writes a temporary file beside the record, fsyncs it, renames it over the record and
fsyncs the directory, so a SIGKILL or a power cut at any moment leaves the old record or the
new one, never half of one; a full disk leaves the old record and raises `StoreError`.

Saves are made off the event loop (`save_async`): the bytes are taken at once, written and fsynced
by a worker thread, and the caller goes on once they are durable, so a daemon that answers about a
record has it on disk, and others are answered meanwhile. Saves made while a trip they must wait
for is under way are written together on the next; a record saved twice before its trip is
written once, with its newest bytes, and a newer save is never overwritten by an older one (each
save has a sequence number). Two lanes of trips: the saves of operations on many records (a sweep
made or cancelled: `save_later`, `written`) and the files dropped go by the bulk lane, one trip at
a time; single saves (`save_async`: a start, a run's change) by the express lane, whose trips go
on while a bulk trip is under way, so that another user's start never waits seconds behind a
sweep's thousand records, and side by side, each as soon as no trip under way holds its record,
so that a start never waits for the save of another run to end before its own begins (under a
sweep's load a start's save waited so up to 50 ms, its 99th percentile); the bulk lane's threads
run at a lower priority (BULK_NICE), so that the kernel's time of making a sweep's thousand files
goes to others' calls and jobs first, and make no new file while an express trip is writing
(BULK_YIELD_SECONDS at most each), so that a start's fsync commits the disk's journal without a
crowd of the sweep's. A record is written by one trip at a time (a trip holding a record that a
trip under way holds waits for it first), and has at most one save waiting, in one lane. A file a
record no longer needs beside it (a launch.json once its chain ended) is removed by the bulk
lane's trips (`drop_later`), after the saves of its trip, DROPS_PER_TRIP a trip.

What such a kill leaves is cleared when the records are loaded (`load_all`, at the daemon's
start): the temporary files of atomic writes (`.NAME.tmp.*`) made before this process started,
and the directory of a start cut short before its record was first saved (no `run.json`, only
its `launch.json` or such temporary files, or nothing): its `obd train start` never answered,
so no one knows the run, and it would otherwise be listed `unreadable` for ever. A directory
with anything else in it is left as it is and listed `unreadable`, for a person to look at.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, TypeVar

import anyio
import structlog
from pydantic import ValidationError

from daemon.service.models import RunRecord, check_run_id
from trainer_plugin.rundir import fsync_dir, is_run_id

log = structlog.get_logger("obd.store")
RECORD_LIMIT = 16 * 1024 * 1024
WRITERS = 8  # threads of a trip writing its temporary files (creating one blocks on a busy disk: 2 were 2x slower)
FSYNCERS = 32  # threads of a trip waiting on its fsyncs and unlinks (no GIL held: ext4 commits them together)
# Express trips under way at once: a start's save begins while others' are written, and a burst
# (a queue pass, a drain) still goes in a few trips of many, not one worker thread a record.
EXPRESS_TRIPS = 4
BULK_NICE = 10  # the bulk lane's threads' nice value above the daemon's (an operation on many runs yields the CPU)
# How long a bulk thread waits, before each file it would write or remove, while an express trip is
# writing: a single save's fsync commits the disk's journal with whatever the bulk lane made
# meanwhile, so the bulk lane makes nothing new until that commit, or this long at most.
BULK_YIELD_SECONDS = 0.1
DROPS_PER_TRIP = 256  # files a bulk trip removes at most (unlinks of synced files: milliseconds each on a busy disk)
# A run's launch settings (daemon/service/queue.py), written before its first record: alone in a
# directory, they are what a start cut short left.
LAUNCH_SETTINGS = "launch.json"
_IMPORTED_AT = time.time()
_In = TypeVar("_In")
_Out = TypeVar("_Out")


def process_started() -> float:
    """When this process started, in wall-clock seconds (from /proc; where /proc cannot say, when
    this module was imported, which the daemon does as it starts)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # since boot
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])  # to the hundredth (btime is to the second)
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def is_temporary(name: str) -> bool:
    """Whether a name is that of an atomic write's temporary file (`rundir.atomic_write`)."""
    return name.startswith(".") and ".tmp." in name


def _set_event() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


class StoreError(Exception):
    pass


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read; reported, never overwritten, never fatal."""

    run_id: str
    path: Path
    error: str


@dataclass
class Batch:
    """Saves waiting for one trip of the writer thread: each record's newest bytes (and their
    sequence number), in the order of their last save, and the errors of those that failed."""

    lane: _Lane
    items: dict[str, tuple[int, bytes, dict[str, bytes]]] = field(default_factory=dict)
    drops: set[tuple[str, str]] = field(default_factory=set)  # (run id, file name) removed after the saves
    flushing: bool = False  # a flush of it is asked for (`drop_later`)
    failed: dict[str, str] = field(default_factory=dict)
    done: anyio.Event = field(default_factory=anyio.Event)
    rest: Batch | None = None  # the batch its drops over one trip's share went on to (DROPS_PER_TRIP)


@dataclass
class _Lane:
    """Trips of the writer: the saves waiting for the next (`open`) and the trips under way
    (`running`). The bulk lane makes one trip at a time; the express lane (EXPRESS_TRIPS) starts
    a trip as soon as none under way holds one of its records, so that a start never waits for
    another's save to be written before its own begins (their fsyncs share the journal's commits)."""

    name: str
    nice: int = 0  # added to its threads' nice value (`threads`)
    gate: threading.Event | None = None  # its threads take an item only while set (BULK_YIELD_SECONDS at most)
    concurrent: int = 1  # trips at once at most, of different records (more wait, and go together)
    # Set while no trip of its own is writing (for threads): another lane's gate.
    idle: threading.Event = field(default_factory=_set_event)
    open: Batch | None = None
    running: list[Batch] = field(default_factory=list)  # the trips under way, oldest first
    writers: int = 0  # trips under way that are writing now (`idle` is cleared while any is)
    trips: int = 0  # trips made (tests count them)
    # The threads of its trips of many saves, made at the first and kept: a trip started 40
    # threads, an eighth of the daemon's GIL time while a sweep was made. A lane's own, and never
    # waiting for the other lane's.
    _threads: _LaneThreads | None = None
    _threads_made: threading.Lock = field(default_factory=threading.Lock)  # two express trips may ask at once

    def threads(self) -> _LaneThreads:
        """The threads that write a trip's files and that wait on its fsyncs and unlinks."""
        with self._threads_made:
            if self._threads is None:
                self._threads = _LaneThreads(
                    _Threads(
                        ThreadPoolExecutor(WRITERS, f"obd-store-{self.name}", initializer=self._lower_priority),
                        WRITERS,
                        self.gate,
                    ),
                    _Threads(
                        ThreadPoolExecutor(FSYNCERS, f"obd-fsync-{self.name}", initializer=self._lower_priority),
                        FSYNCERS,
                        self.gate,
                    ),
                )
            return self._threads

    def _lower_priority(self) -> None:
        """A new thread of the lane's, at its nice value: the kernel's time of creating a bulk
        trip's thousand files (seconds of it on a busy ext4) goes to whoever else wants a core
        first, the event loop answering others included (Linux keeps a nice value per thread)."""
        if self.nice:
            with contextlib.suppress(OSError):
                os.setpriority(
                    os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + self.nice
                )

    @property
    def writing(self) -> anyio.Event | None:
        """Set when the oldest trip under way ends; None when none is."""
        return self.running[0].done if self.running else None

    def holding(self, records: Iterable[str]) -> list[Batch]:
        """The trips under way that write one of `records`."""
        wanted = set(records)
        return [batch for batch in self.running if not wanted.isdisjoint(batch.items)]

    def busy_for(self, batch: Batch) -> Batch | None:
        """A trip under way that `batch`'s must wait for: any, or (`concurrent`) one of its
        records', or the oldest when `concurrent` trips are under way already."""
        if len(self.running) >= self.concurrent:
            return self.running[0] if self.running else None
        held = self.holding(batch.items)
        return held[0] if held else None

    def began_writing(self) -> None:
        self.writers += 1
        self.idle.clear()

    def ended_writing(self) -> None:
        self.writers -= 1
        if not self.writers:
            self.idle.set()

    def batch(self) -> Batch:
        if self.open is None:
            self.open = Batch(self)
        return self.open


class RunStore:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.runs_dir = state_dir / "runs"
        self._seq = 0  # each save's number: the newest bytes of a record win on disk
        self._on_disk: dict[str, int] = {}  # the number of each record's save on disk
        self._locks: dict[str, threading.Lock] = {}  # one write of a record at a time
        self._locks_lock = threading.Lock()
        self.express = _Lane("express", concurrent=EXPRESS_TRIPS)  # single saves: never behind a bulk trip
        # Many records of one operation, and the files dropped: its threads wait while an express
        # trip is under way (BULK_YIELD_SECONDS at most).
        self.bulk = _Lane("bulk", nice=BULK_NICE, gate=self.express.idle)

    def ensure(self) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / check_run_id(run_id)

    def record_path(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "run.json"

    def save(self, record: RunRecord) -> None:
        """Save a record now, in the caller's thread; durable when it returns."""
        seq = self._number(record.id)
        beside = self._pending(record.id)  # older bytes, never to be written after these
        self._write(record.id, seq, _encode(record), beside)

    async def save_async(self, record: RunRecord, beside: dict[str, bytes] | None = None) -> None:
        """Save a record off the event loop; durable when it returns (the module's docstring). The
        wait is shielded: a caller cancelled meanwhile still has its record on disk. `beside`:
        files written in its directory before it, in the same trip (a new run's launch.json)."""
        batch = self._take(self.express, record, beside)
        with anyio.CancelScope(shield=True):
            await self._until_written(batch)
        if record.id in batch.failed:
            raise StoreError(batch.failed[record.id])

    def save_later(self, record: RunRecord, beside: dict[str, bytes] | None = None) -> Batch:
        """Take a record's bytes now for the bulk lane's next trip, without waiting for it (`written`
        waits for the batch answered, `flush` for every save taken so far)."""
        return self._take(self.bulk, record, beside)

    def _take(self, lane: _Lane, record: RunRecord, beside: dict[str, bytes] | None) -> Batch:
        """A record's bytes in `lane`'s open batch, in place of any save of it still waiting (in
        either lane: the files to write beside it are kept)."""
        seq = self._number(record.id)
        before = self._pending(record.id)
        batch = lane.batch()
        batch.items[record.id] = (seq, _encode(record), {**before, **(beside or {})})
        return batch

    def _pending(self, run_id: str) -> dict[str, bytes]:
        """A save of the record waiting in either lane taken out; the files it had to write beside it."""
        for lane in (self.bulk, self.express):
            if lane.open is not None and run_id in lane.open.items:
                return lane.open.items.pop(run_id)[2]
        return {}

    def drop_later(self, run_id: str, name: str) -> bool:
        """Remove a file beside a record (not the record) on the writer's next trip, after that
        trip's saves; a missing one is no error. True when no flush of that trip is asked for yet:
        the caller asks for one (`flush`), else the file waits for the next save's trip."""
        check_run_id(run_id)
        if name == "run.json" or "/" in name:
            raise ValueError(f"{name!r}: only a file beside a record is dropped, never the record")
        batch = self.bulk.batch()
        batch.drops.add((run_id, name))
        first, batch.flushing = not batch.flushing, True
        return first

    async def flush(self) -> None:
        """Wait until every save taken before the call is on disk (or failed, and said so in the
        log), and every file dropped before it is removed (DROPS_PER_TRIP a trip: one trip
        each). Saves taken meanwhile are not waited for: other callers' starts, one after
        another, never hold up a flush (a sweep being made waits for one)."""
        with anyio.CancelScope(shield=True):
            taken = [b for lane in (self.bulk, self.express) for b in (*lane.running, lane.open) if b is not None]
            for batch in taken:
                follow: Batch | None = batch
                while follow is not None:
                    await self._until_written(follow)
                    follow = follow.rest

    async def written(self, batch: Batch) -> None:
        """Wait until the saves of `batch` (what `save_later` answered) are on disk, or failed."""
        with anyio.CancelScope(shield=True):
            await self._until_written(batch)

    def _number(self, run_id: str) -> int:
        check_run_id(run_id)
        self._seq += 1
        return self._seq

    async def _until_written(self, batch: Batch) -> None:
        """Wait for `batch`'s trip; when no trip of its lane is under way, make it (the first waiter
        writes). A record the other lane's trip under way holds is written after that trip."""
        lane = batch.lane
        other = self.express if lane is self.bulk else self.bulk
        while not batch.done.is_set():
            if batch is not lane.open:  # its trip is under way
                await batch.done.wait()
                continue
            busy = lane.busy_for(batch)
            if busy is not None:
                await busy.done.wait()
                continue
            taken, lane.open = batch, None
            if len(taken.drops) > DROPS_PER_TRIP:  # the rest by the next trip, so that saves never wait long
                rest = sorted(taken.drops)[DROPS_PER_TRIP:]
                taken.drops.difference_update(rest)
                lane.open = taken.rest = Batch(lane, drops=set(rest), flushing=True)
            lane.running.append(taken)
            lane.trips += 1
            began = time.monotonic()
            writing = False
            try:
                # Only the other lane's trips under way now: one it makes after this one began
                # waits for this one (each waiting for the other would never end).
                for held in other.holding(taken.items):
                    await held.done.wait()
                lane.began_writing()  # only now: the trips of the other lane this one waited for have ended
                writing = True
                await anyio.to_thread.run_sync(self._write_batch, taken)
                log.debug(
                    "store_trip",
                    lane=lane.name,
                    records=len(taken.items),
                    dropped=len(taken.drops),
                    s=round(time.monotonic() - began, 4),
                )
            finally:
                if writing:
                    lane.ended_writing()
                lane.running.remove(taken)
                taken.done.set()

    def _write_batch(self, batch: Batch) -> None:
        """The writer thread's trip: every record of the batch, each whole (StoreError kept), then
        the files dropped. Saves in one batch were made concurrently (a caller waits for its save
        before it makes the next), so their order on disk is free. A few saves are written one by
        one (`_write`); more in phases (`_write_many`): their fsyncs made together."""
        items = list(batch.items.items())
        if len(items) < 4:
            for run_id, (seq, data, beside) in items:
                try:
                    self._write(run_id, seq, data, beside)
                except StoreError as exc:
                    batch.failed[run_id] = str(exc)  # the caller says it (a queue message: the next save)
        else:
            self._write_many(batch.lane, items, batch.failed)
        drops = sorted(batch.drops)  # after the saves (a file is never dropped before it is written)
        if len(drops) < 4:
            for drop in drops:
                self._drop(drop)
        else:
            batch.lane.threads().fsyncers.each(self._drop, drops)

    def _drop(self, drop: tuple[str, str]) -> None:
        run_id, name = drop
        try:
            os.unlink(self.run_dir(run_id) / name)
        except (FileNotFoundError, NotADirectoryError):
            pass
        except OSError as exc:  # left for the next start's catch-up, which removes it again
            log.warning("file_not_removed", run_id=run_id, file=name, error=str(exc))

    def _write_many(
        self, lane: _Lane, items: list[tuple[str, tuple[int, bytes, dict[str, bytes]]]], failed: dict[str, str]
    ) -> None:
        """Many records written as `_write` writes one, a phase at a time over all of them: every
        temporary file written (a record's files beside it first) by a few threads (WRITERS: the
        event loop's thread never waits long for the GIL behind dozens of writers), all fsynced
        by many (FSYNCERS, holding no GIL: the fsyncs of a trip of 1,000 new runs are made
        together, ext4 commits them at once), each renamed over its file (`run.json` last, unless
        a newer save of that record is already on disk), then each directory fsynced once, and
        `runs/` once when a directory was made (a new run's directory is durable too). A record
        whose files fail (a full disk) keeps its old record and is said in `failed`; the others
        are written all the same."""
        writers, fsyncers = lane.threads()
        staged = writers.each(self._stage, items)
        for one in staged:
            if one.error is not None:
                failed[one.run_id] = self._failure(one.run_id, one.error)
        ready = [one for one in staged if one.error is None and one.files]
        fds = [(f.fd, one) for one in ready for f in one.files]
        for (_, one), error in zip(fds, fsyncers.each(_fsync_or_error, fds), strict=True):
            if error is not None and one.error is None:
                one.error = error
                failed[one.run_id] = self._failure(one.run_id, error)
        for one in ready:
            if one.error is not None:
                one.discard()
        renamed = writers.each(self._rename, [one for one in ready if one.error is None])
        for one in renamed:
            if one.error is not None:
                failed[one.run_id] = self._failure(one.run_id, one.error)
        directories = {str(one.directory) for one in renamed if one.error is None and one.files}
        if any(one.made_dir for one in staged):
            directories.add(str(self.runs_dir))
        fsyncers.each(fsync_dir, sorted(directories))

    def _stage(self, item: tuple[str, tuple[int, bytes, dict[str, bytes]]]) -> _Staged:
        """A trip's record: its files written under temporary names (see `_staged`)."""
        run_id, (seq, data, beside) = item
        return self._staged(run_id, seq, data, beside)

    def _staged(self, run_id: str, seq: int, data: bytes, beside: dict[str, bytes]) -> _Staged:
        """A record's files written under temporary names (none when a newer save of it is on disk)."""
        one = _Staged(run_id, seq, self.run_dir(run_id))
        if self._on_disk.get(run_id, 0) > seq:
            return one
        try:
            try:
                os.mkdir(one.directory, 0o700)
                one.made_dir = True
            except FileExistsError:
                pass
            except FileNotFoundError:  # no runs/ yet
                one.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                one.made_dir = True
            for name, content in (*beside.items(), ("run.json", data)):
                one.files.append(_write_temporary(one.directory / name, content))
        except OSError as exc:
            one.discard()
            one.error = exc
        return one

    def _rename(self, one: _Staged) -> _Staged:
        """A staged record's files over the old ones, unless a newer save of it is on disk."""
        with self._lock_of(one.run_id):
            if self._on_disk.get(one.run_id, 0) > one.seq:  # written meanwhile by `save`, newer
                one.discard()
                one.files = []
                return one
            try:
                one.rename()
            except OSError as exc:
                one.discard()
                one.error = exc
                return one
            self._on_disk[one.run_id] = one.seq
        return one

    def _lock_of(self, run_id: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(run_id, threading.Lock())

    def _failure(self, run_id: str, exc: OSError) -> str:
        path = self.record_path(run_id)
        return (
            f"could not save the record of run {run_id} ({exc.strerror or exc}); "
            f"the previous record in {path} is intact. Free space in {self.state_dir} and retry"
        )

    def _write(self, run_id: str, seq: int, data: bytes, beside: dict[str, bytes]) -> None:
        """Write a record's bytes atomically, unless a newer save of it is already on disk: as a
        trip writes one (`_staged`, each file fsynced, `_rename`: the files `beside` it first,
        `run.json` last), then its directory fsynced. A new directory's entry in `runs/` is made
        durable by the journal's order (ext4, XFS: the commit of the record's rename holds the
        `mkdir` made before it), with no fsync of `runs/` (a trip of many does one): that fsync
        made a start's save 1.3-2x slower while another member's sweep was written
        (tests/bench/bench_store.py, 2026-12-07)."""
        one = self._staged(run_id, seq, data, beside)
        try:
            if one.error is not None:
                raise one.error
            for written in one.files:
                os.fsync(written.fd)
        except OSError as exc:
            one.discard()
            raise StoreError(self._failure(run_id, exc)) from exc
        if not one.files:
            return  # a newer save of it is on disk
        error = self._rename(one).error
        if error is not None:
            raise StoreError(self._failure(run_id, error)) from error
        if one.files:
            fsync_dir(str(one.directory))

    def load(self, run_id: str) -> RunRecord:
        return parse_record(self.record_path(run_id), run_id)

    def load_all(self, started: float | None = None) -> tuple[dict[str, RunRecord], list[BadRecord]]:
        """Every record, and those that cannot be read; what a crash left before `started` (this
        process's start by default) is cleared first (see the module's docstring)."""
        started = process_started() if started is None else started
        records: dict[str, RunRecord] = {}
        bad: list[BadRecord] = []
        if not self.runs_dir.is_dir():
            return records, bad
        for name in sorted(os.listdir(self.runs_dir)):
            entry = self.runs_dir / name
            if name.startswith(".") or not entry.is_dir():
                continue
            path = entry / "run.json"
            _clear_leftovers(entry, started)
            if _drop_unrecorded_start(entry):
                continue
            try:
                check_run_id(entry.name)
                records[entry.name] = parse_record(path, entry.name)
            except (StoreError, ValueError) as exc:
                bad.append(BadRecord(entry.name, path, str(exc)))
        return records, bad


@dataclass
class _Temporary:
    """A file's new bytes written under a temporary name beside it, still open (to be fsynced)."""

    tmp: Path
    path: Path
    fd: int


@dataclass
class _Staged:
    """One record of a trip (`RunStore._write_many`): its files written under temporary names."""

    run_id: str
    seq: int
    directory: Path
    files: list[_Temporary] = field(default_factory=list)
    made_dir: bool = False  # its directory was made by this trip (`runs/` is fsynced)
    error: OSError | None = None

    def rename(self) -> None:
        """Each file over its old one, in order (`run.json` last); the descriptors closed."""
        for f in self.files:
            os.close(f.fd)
            f.fd = -1
        for f in self.files:
            os.replace(f.tmp, f.path)

    def discard(self) -> None:
        """Close and remove what was written: the old files stay as they are."""
        for f in self.files:
            if f.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(f.fd)
                f.fd = -1
            with contextlib.suppress(OSError):
                os.unlink(f.tmp)


def _write_temporary(path: Path, data: bytes) -> _Temporary:
    """`data` written to a fresh temporary name beside `path` (opened O_EXCL|O_NOFOLLOW: a planted
    link never redirects it), left open and not yet fsynced."""
    tmp, fd = _open_temporary(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return _Temporary(tmp, path, fd)


def _open_temporary(path: Path) -> tuple[Path, int]:
    while True:
        tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}.{os.urandom(6).hex()}")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue


@dataclass
class _Threads:
    """Threads of a lane for one kind of work (`pool`, `width` of them); with a `gate`, each takes
    its next item only once the gate is set, or after BULK_YIELD_SECONDS."""

    pool: ThreadPoolExecutor
    width: int
    gate: threading.Event | None = None

    def each(self, fn: Callable[[_In], _Out], items: Sequence[_In]) -> list[_Out]:
        """`fn` of each item, in order, each thread taking the next item as it is free: one task a
        thread, not a future an item (a trip of 1,000 saves made a future for each item of each
        phase, a fifth of the daemon's GIL time while a sweep was made). The first exception
        raised is raised once every thread stopped."""
        results: list[_Out | None] = [None] * len(items)
        indices = itertools.count()  # next() of a count is atomic: each item is taken once
        gate = self.gate

        def work() -> None:
            while (i := next(indices)) < len(items):
                if gate is not None and not gate.is_set():
                    gate.wait(BULK_YIELD_SECONDS)
                results[i] = fn(items[i])

        tasks = [self.pool.submit(work) for _ in range(min(self.width, len(items)))]
        for task in tasks:
            task.exception()  # every thread stopped before any error is raised
        for task in tasks:
            task.result()
        return results  # type: ignore[return-value]  # every index was filled, or a task raised


class _LaneThreads(NamedTuple):
    writers: _Threads  # WRITERS: a trip's temporary files written, then renamed
    fsyncers: _Threads  # FSYNCERS: its fsyncs and unlinks (no GIL held while they wait)


def _fsync_or_error(item: tuple[int, object]) -> OSError | None:
    try:
        os.fsync(item[0])
    except OSError as exc:
        return exc
    return None


def _encode(record: RunRecord) -> bytes:
    return record.model_dump_json(indent=1).encode() + b"\n"


def _clear_leftovers(directory: Path, started: float) -> None:
    """Remove the temporary files of atomic writes cut short (a SIGKILL between write and rename)
    made before `started`: a newer one may be a write under way, by this daemon."""
    try:
        names = [name for name in os.listdir(directory) if is_temporary(name)]
    except OSError:
        return
    removed = []
    for name in names:
        path = directory / name
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < started:
                path.unlink()
                removed.append(name)
    if removed:
        log.info("leftovers_removed", run_id=directory.name, files=removed, why="atomic writes cut short")


def _drop_unrecorded_start(directory: Path) -> bool:
    """Remove the directory of a start cut short before its record was first saved (its launch
    settings alone, or nothing, and no `run.json`); True when it was removed."""
    if not is_run_id(directory.name) or os.path.lexists(directory / "run.json"):
        return False
    try:
        names = os.listdir(directory)
        if any(name != LAUNCH_SETTINGS for name in names):
            return False  # something more: left for a person, listed unreadable
        if names and not stat.S_ISREG(os.lstat(directory / LAUNCH_SETTINGS).st_mode):
            return False
        for name in names:
            os.unlink(directory / name)
        os.rmdir(directory)
    except OSError as exc:
        log.warning("unrecorded_start_not_removed", run_id=directory.name, error=str(exc))
        return False
    log.warning(
        "unrecorded_start_removed",
        run_id=directory.name,
        files=names,
        why="a start cut short before its record was saved; no one was told its id",
    )
    return True


def parse_record(path: Path, run_id: str) -> RunRecord:
    """Read one record; a malformed one raises StoreError saying where it is broken."""
    try:
        with open(path, "rb") as f:
            # Its size, not the limit: a read of the limit reserves 16 MiB for every record.
            data = f.read(min(os.fstat(f.fileno()).st_size, RECORD_LIMIT) + 1)
    except FileNotFoundError as exc:
        raise StoreError(f"{path}: missing run record") from exc
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read: {exc.strerror}") from exc
    if len(data) > RECORD_LIMIT:
        raise StoreError(f"{path}: larger than {RECORD_LIMIT} bytes, not a run record")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StoreError(f"{path}: not UTF-8 at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise StoreError(
            f"{path}: malformed JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); the record was left as it is"
        ) from exc
    except RecursionError as exc:
        raise StoreError(f"{path}: JSON nested too deeply to be a run record; the record was left as it is") from exc
    try:
        record = RunRecord.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise StoreError(f"{path}: invalid record at {where}: {first['msg']}") from exc
    if record.id != run_id:
        raise StoreError(f"{path}: the record names run {record.id!r}, not {run_id!r}")
    return record
