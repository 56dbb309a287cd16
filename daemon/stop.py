"""A snapshot request, whoever asks for it: the record first, then the file in the run directory.

`obd train stop` (the CLI, the web view, the Python API), a pod's cap and the daemon's own
limits all ask through `request_snapshot`; the rules that judge what follows (the proof, the
stop fallback, the final state) are in `daemon/stop_rules.py`. A stop may come at any moment:
before the job started (kept in the record, written once the job exists) and before its
plugin announced itself (the plugin takes a request it finds at its first step boundary).
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio
import structlog

from daemon.follow import Follower
from daemon.models import RunRecord
from daemon.ports import Runs
from daemon.targets import Targets
from trainer_plugin import rundir

log = structlog.get_logger("obd")


class StopHost(Runs, Protocol):
    """What a stop request uses of the daemon beyond the records: the run's target (to write the
    request) and the follow (woken to read the run at once)."""

    @property
    def targets(self) -> Targets: ...

    @property
    def follow(self) -> Follower: ...


# Who asked, as the run's history says it, by the way the request came (`StopRequest.via`).
ASKED_VIA = {"cli": "`obd train stop`", "ui": "the web view", "api": "obd's Python API"}


async def request_snapshot(daemon: StopHost, record: RunRecord, reason: str, by: str) -> None:
    """Record a snapshot request, then write `snapshot.request` in the run directory.

    Recorded before the file is written, so a daemon killed in between still counts the
    fallback from the request; undone if the write fails. A run whose job has not started yet
    keeps the request in its record only: the launch writes it as soon as the job exists
    (`write_pending_request`).
    """
    async with daemon.editing(record):
        first = record.stop.requested_at is None
        before = record.stop.model_copy()
        if first:
            record.stop.requested_at = time.time()
        record.stop.reason = reason
        record.stop.asked_by = record.stop.asked_by or by
    if record.has_job:
        try:
            await _write(daemon, record, reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                async with daemon.editing(record):
                    record.stop = before
            raise
    async with daemon.editing(record):
        if first:
            later = "" if record.has_job else "; it reaches the job once it starts"
            record.note(f"snapshot requested ({reason}) by {by}{later}")
        elif before.reason != reason:
            record.note(f"snapshot request reason changed to {reason}")
    log.info("snapshot_requested", run_id=record.id, reason=reason, by=by)
    daemon.follow.wake_run(record)


async def write_pending_request(daemon: StopHost, record: RunRecord) -> None:
    """A request made before the run's job started, written now that it has (the launch's call)."""
    reason = record.stop.reason
    if record.stop.requested_at is None or reason is None or not record.has_job:
        return
    try:
        await _write(daemon, record, reason)
    except Exception as exc:  # the record keeps it: the stop fallback still ends the job in time
        log.warning("pending_request_not_written", run_id=record.id, error=str(exc))
        async with daemon.editing(record):
            record.note(f"the snapshot request could not be written in the run directory: {exc}")


async def _write(daemon: StopHost, record: RunRecord, reason: str) -> None:
    executor = daemon.targets.executor(record)
    await executor.put_file(rundir.RunPaths(record.remote_dir).request, rundir.request_bytes(reason))
