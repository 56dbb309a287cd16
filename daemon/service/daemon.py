"""The daemon: holds the run records and wires the parts that act on them.

`launch.py` starts runs, `follow.py` follows them (one loop per target, the stop fallback, the
end of a run), `handlers.py` answers the control socket, `targets.py` and `pods.py` serve each
kind of target. Every change of a record goes through `Daemon.editing`, which takes the run's
lock and saves the record before anything acts on it, so a daemon killed at any moment finds,
on restart, what it needs to carry on: the records and the run directories.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import pwd
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from daemon.service.api import ApiError, Peer
from daemon.service.config import Config
from daemon.service.follow import Follower
from daemon.service.gpus import Inventory
from daemon.service.launch import Launcher
from daemon.service.models import InvalidRunId, RunRecord, RunState, check_run_id
from daemon.service.preempt import Preemptor
from daemon.service.queue import Scheduler
from daemon.service.records import Records
from daemon.service.recovery import Recovery
from daemon.service.retention import Retention
from daemon.service.stop import write_recorded_requests
from daemon.service.store import RunStore, StoreError, process_started
from daemon.service.systemd import Notifier
from daemon.service.targets import Targets

log = structlog.get_logger("obd")
GC_YOUNG = 20_000  # allocations between two collections of young objects (CPython's default: 700)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        assert config.daemon.state_dir is not None
        self.state_dir = Path(config.daemon.state_dir)
        self.store = RunStore(self.state_dir)
        self.records = Records()  # every run; the live ones kept apart (daemon/service/records.py)
        self.bad_records: dict[str, str] = {}
        self.notifier = Notifier()
        self.targets = Targets(self)  # each kind's supervision from the registry (executors/kinds.py)
        self.follow = Follower(self)
        self.launcher = Launcher(self)
        self.inventory = Inventory(self)
        self.scheduler = Scheduler(self)
        self.inventory.wake = self.scheduler.kick  # a device freed by an ended run's last process
        self.recovery = Recovery(self)
        self.retention = Retention(self)
        self.preemptor = Preemptor(self)
        self._locks: dict[str, anyio.Lock] = {}
        self._final: dict[str, anyio.Event] = {}
        self._dirty: set[str] = set()  # records whose last save failed (a full disk): retried
        # Every change of a run bumps `version`; watchers (`watch` op, notifications, the web
        # view) wait on `_changed` and ask which runs changed since the version they saw.
        self.version = 0
        self.changed_at: dict[str, int] = {}
        self._changed = anyio.Event()
        self.listeners: list[Callable[[RunRecord], None]] = []
        self._summaries: dict[str, bytes] = {}  # each run's `list` entry, encoded once per change
        self._tg: TaskGroup | None = None
        self._lock_fd: int | None = None

    # --- records -----------------------------------------------------------------------

    def lock(self, run_id: str) -> anyio.Lock:
        lock = self._locks.get(run_id)
        if lock is None:  # made once: setdefault made a Lock at each call (~3 µs, a queued run's each look)
            lock = self._locks[run_id] = anyio.Lock()
        return lock

    @contextlib.asynccontextmanager
    async def editing(self, record: RunRecord) -> AsyncIterator[RunRecord]:
        """Change a record under its lock; it is saved when the block ends, off the event loop and
        durable before the block returns (kept in memory and retried on the next poll if the disk
        is full), and a final state wakes its waiters."""
        async with self.lock(record.id):
            was_final = record.state.final
            yield record
            await self.save_async_quietly(record)
        self.touch(record)
        if record.state.final:
            self.final_event(record.id).set()
            if not was_final:  # every way a run ends is logged the same, once
                log.info(
                    "run_finished",
                    run_id=record.id,
                    state=record.state.value,
                    exit_code=record.exit_code,
                    message=record.message,
                )

    def touch(self, record: RunRecord) -> None:
        """Tell whoever watches that a run changed (saved or not: progress is not always saved)."""
        self.version += 1
        self.records.touched(record)
        self.changed_at[record.id] = self.version
        self._summaries.pop(record.id, None)
        self._changed.set()
        self._changed = anyio.Event()
        for listener in self.listeners:
            try:
                listener(record)
            except Exception:  # a listener's bug must never cost a record its change
                log.exception("listener_failed", run_id=record.id)

    def summary_json(self, record: RunRecord) -> bytes:
        """The run's `list` entry as JSON, encoded again only after the run changed."""
        data = self._summaries.get(record.id)
        if data is None:
            data = self._summaries[record.id] = json.dumps(record.summary()).encode()
        return data

    def summaries_json(self, records: list[RunRecord]) -> list[bytes]:
        """`summary_json` of each (a list of 5,000: one call, not 5,000)."""
        kept = self._summaries
        return [kept.get(r.id) or self.summary_json(r) for r in records]

    def unencoded(self, records: list[RunRecord]) -> list[RunRecord]:
        """Those whose `list` entry is not encoded as they are now (changed since)."""
        kept = self._summaries
        return [r for r in records if r.id not in kept]

    async def wait_change(self, since: int, timeout: float) -> int:
        """Wait until something changed after version `since` (or `timeout`); the version now."""
        if self.version <= since:
            with anyio.move_on_after(timeout):
                await self._changed.wait()
        return self.version

    def save(self, record: RunRecord) -> None:
        """Save a record; on failure (a full disk) keep it in memory, retry later, and raise."""
        try:
            self.store.save(record)
            self._dirty.discard(record.id)
        except StoreError as exc:
            self._dirty.add(record.id)
            log.error("record_save_failed", run_id=record.id, error=str(exc))
            raise

    def save_quietly(self, record: RunRecord) -> None:
        with contextlib.suppress(StoreError):
            self.save(record)

    async def save_async_quietly(self, record: RunRecord) -> None:
        """`save_quietly` off the event loop (daemon/service/store.py: saves made meanwhile share a trip)."""
        try:
            await self.store.save_async(record)
            self._dirty.discard(record.id)
        except StoreError as exc:
            self._dirty.add(record.id)
            log.error("record_save_failed", run_id=record.id, error=str(exc))

    @property
    def unsaved(self) -> set[str]:
        """Records whose last save failed (a full disk): kept in memory, saved again later."""
        return self._dirty

    def retry_failed_saves(self) -> None:
        for rid in list(self._dirty):
            if rid in self.records:
                self.save_quietly(self.records[rid])

    def get(self, run_id: str) -> RunRecord:
        try:
            check_run_id(run_id)
        except InvalidRunId as exc:
            raise ApiError(str(exc), "usage") from exc
        if run_id in self.records:
            return self.records[run_id]
        if run_id in self.bad_records:
            raise ApiError(f"the record of run {run_id} is unreadable: {self.bad_records[run_id]}")
        raise ApiError(f"no run {run_id!r}; `obd train list` shows the runs there are", "not_found")

    def visible(self, peer: Peer) -> list[RunRecord]:
        """The runs a caller may see in full: their own (root: everyone's), oldest first."""
        runs = [r for r in self.records.values() if peer.is_root or r.owner_uid == peer.uid]
        return sorted(runs, key=lambda r: (r.created, r.id))

    def find(self, ref: str, peer: Peer) -> RunRecord:
        """The run a reference names, for this caller: an id, a unique id prefix, a run name (its
        newest run), or `last` (the caller's newest run). Only the owner or root may use a run."""
        if not isinstance(ref, str) or not ref or len(ref) > 200 or "/" in ref or ref in (".", ".."):
            raise ApiError(
                f"invalid run id {ref!r}: a run is named by its id, a unique prefix of it, its name, or `last`; "
                "see `obd train list`",
                "usage",
            )
        if ref in self.records:
            return self.allowed(self.records[ref], peer)
        if ref in self.bad_records:
            raise ApiError(f"the record of run {ref} is unreadable: {self.bad_records[ref]}")
        mine = self.visible(peer)
        if ref == "last":
            if not mine:
                raise ApiError("you have no runs yet; start one with `obd train start -- COMMAND`", "not_found")
            return mine[-1]
        prefixed = [r for r in mine if r.id.startswith(ref)]
        if len(prefixed) == 1:
            return prefixed[0]
        if len(prefixed) > 1:
            ids = ", ".join(r.id for r in prefixed[-5:])
            raise ApiError(f"{ref!r} is the start of {len(prefixed)} run ids ({ids}); give more of the id", "usage")
        named = [r for r in mine if r.name == ref]
        if named:
            return named[-1]  # the newest run of that name
        theirs = [r for r in self.records.values() if r.id.startswith(ref) or r.name == ref]
        if theirs:
            raise ApiError(f"run {ref!r} is not yours: only its owner and root may use it", "denied")
        raise ApiError(f"no run {ref!r}; `obd train list` shows your runs", "not_found")

    @staticmethod
    def allowed(record: RunRecord, peer: Peer) -> RunRecord:
        if peer.is_root or record.owner_uid == peer.uid:
            return record
        raise ApiError(f"run {record.id} is not yours: only its owner ({record.owner}) and root may use it", "denied")

    def final_event(self, run_id: str) -> anyio.Event:
        return self._final.setdefault(run_id, anyio.Event())

    async def fail(self, record: RunRecord, why: str) -> bool:
        """Record a run `failed` unless it already ended; True when this call ended it."""
        async with self.editing(record):
            if record.state.final:
                return False
            record.transition(RunState.failed, why)
        await self.targets.of(record).forget(record)
        return True

    @property
    def started(self) -> bool:
        """Whether the daemon's task group runs (`start_soon` starts nothing before)."""
        return self._tg is not None

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run a task for the daemon's lifetime (never a stray one: the daemon's task group owns it)."""
        if self._tg is not None:
            self._tg.start_soon(fn, *args)

    # --- life cycle --------------------------------------------------------------------

    def _prepare_state_dir(self) -> None:
        """The state directory's layout and modes: records private to the daemon's user, each run
        directory private to its owner, and their parents not listable by others."""
        os.umask(0o077)  # whatever the daemon writes is private unless it says otherwise
        for path, mode in ((self.state_dir, 0o711), (self.store.runs_dir, 0o700), (self.state_dir / "jobs", 0o711)):
            path.mkdir(parents=True, exist_ok=True, mode=mode)
            with contextlib.suppress(OSError):
                if path.stat().st_uid == os.geteuid():
                    path.chmod(mode)
        with contextlib.suppress(OSError):
            for run_dir in (self.state_dir / "jobs").iterdir():
                if run_dir.is_dir() and not run_dir.is_symlink() and run_dir.stat().st_mode & 0o077:
                    run_dir.chmod(0o700)  # a run directory made before they were private

    def _take_state_lock(self) -> None:
        self._prepare_state_dir()
        self.store.ensure()
        fd = os.open(self.state_dir / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise SystemExit(f"obd: another daemon already uses {self.state_dir}; stop it first") from exc
        self._lock_fd = fd

    def load(self) -> None:
        records, bad = self.store.load_all()
        for record in records.values():
            if record.owner_uid is None:  # a record from before runs had owners: the daemon's user's
                record.owner_uid, record.owner = os.geteuid(), user_name(os.geteuid())
        self.records = Records(records)
        self.bad_records = {b.run_id: b.error for b in bad}
        for b in bad:
            log.error("record_unreadable", run_id=b.run_id, path=str(b.path), error=b.error)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        from daemon.service.handlers import Handlers
        from daemon.service.notify import Notifications
        from daemon.service.prometheus import MetricsExporter
        from daemon.service.server import ControlServer

        self._take_state_lock()
        self.load()
        # Thousands of records live as long as the daemon: the collector's full passes over them
        # paused every answer for 0.1 s and more (issue 33). Those loaded are set aside (never
        # garbage), and young objects are collected in larger, rarer batches.
        gc.freeze()
        gc.set_threshold(GC_YOUNG, 20, 20)
        notifications = Notifications(self, self.config.notify) if self.config.notify else None
        if notifications is not None:  # from before the reconcile: the runs it ends are events too
            self.listeners.append(notifications.listener)
        log.info("daemon_starting", state_dir=str(self.state_dir), runs=len(self.records))
        handlers = Handlers(self)
        server = ControlServer(self.config.daemon, handlers)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._signals, tg.cancel_scope)
                if notifications is not None:
                    tg.start_soon(notifications.serve)
                if self.config.daemon.metrics_listen:
                    await tg.start(MetricsExporter(self, notifications).serve)
                self.launcher.clear_staging_leftovers(process_started())  # a crash while staging the plugin
                await self.follow.reconcile()
                await tg.start(server.serve)
                self.follow.resume_all()
                # The queue and recovery act on changes from now on, and on what an earlier
                # daemon left undone (runs queued, attempts ended but not retried).
                self.listeners += [self.scheduler.on_change, self.recovery.on_change, self.retention.on_change]
                self.listeners.append(handlers.moves.on_change)  # `obd train move` (daemon/service/move.py)
                tg.start_soon(self.scheduler.run)
                self.recovery.catch_up()
                self.retention.catch_up()
                self.preemptor.catch_up()
                self.start_soon(write_recorded_requests, self)  # one an earlier daemon recorded, not written
                handlers.moves.catch_up()
                tg.start_soon(self.notifier.watchdog_loop)
                for supervision in self.targets.configured():
                    tg.start_soon(supervision.periodically)
                active = sum(r.state == RunState.running for r in self.records.values())
                self.notifier.ready(f"following {active} running runs")
                log.info("daemon_ready", socket=str(self.config.daemon.socket), running=active)
                task_status.started()
        finally:
            with anyio.move_on_after(5, shield=True):
                await self.targets.aclose()
        self.notifier.stopping()
        log.info("daemon_stopped", note="jobs keep running")

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("daemon_stopping", signal=signal.Signals(signum).name)
                self.notifier.stopping()
                scope.cancel()
                return
