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
import os
import signal
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from daemon.api import ApiError
from daemon.config import Config
from daemon.follow import Follower
from daemon.launch import Launcher
from daemon.models import InvalidRunId, RunRecord, RunState, check_run_id
from daemon.store import RunStore, StoreError
from daemon.systemd import Notifier
from daemon.targets import Targets

log = structlog.get_logger("obd")


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        assert config.daemon.state_dir is not None
        self.state_dir = Path(config.daemon.state_dir)
        self.store = RunStore(self.state_dir)
        self.records: dict[str, RunRecord] = {}
        self.bad_records: dict[str, str] = {}
        self.notifier = Notifier()
        self.targets = Targets(self)
        self.follow = Follower(self)
        self.launcher = Launcher(self)
        self._locks: dict[str, anyio.Lock] = {}
        self._final: dict[str, anyio.Event] = {}
        self._dirty: set[str] = set()  # records whose last save failed (a full disk): retried
        self._tg: TaskGroup | None = None
        self._lock_fd: int | None = None

    # --- records -----------------------------------------------------------------------

    def lock(self, run_id: str) -> anyio.Lock:
        return self._locks.setdefault(run_id, anyio.Lock())

    @contextlib.asynccontextmanager
    async def editing(self, record: RunRecord) -> AsyncIterator[RunRecord]:
        """Change a record under its lock; it is saved when the block ends (kept in memory and
        retried on the next poll if the disk is full), and a final state wakes its waiters."""
        async with self.lock(record.id):
            was_final = record.state.final
            yield record
            self.save_quietly(record)
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

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run a task for the daemon's lifetime (never a stray one: the daemon's task group owns it)."""
        if self._tg is not None:
            self._tg.start_soon(fn, *args)

    # --- life cycle --------------------------------------------------------------------

    def _take_state_lock(self) -> None:
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
        self.records = records
        self.bad_records = {b.run_id: b.error for b in bad}
        for b in bad:
            log.error("record_unreadable", run_id=b.run_id, path=str(b.path), error=b.error)

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        from daemon.handlers import Handlers
        from daemon.server import ControlServer

        self._take_state_lock()
        self.load()
        log.info("daemon_starting", state_dir=str(self.state_dir), runs=len(self.records))
        server = ControlServer(self.config.daemon, Handlers(self))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._signals, tg.cancel_scope)
                await self.follow.reconcile()
                await tg.start(server.serve)
                self.follow.resume_all()
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
