"""The follow: every running run is read, the stop fallback applied, and its end recorded.

Runs that share an executor share one loop, which reads all of them in one probe per poll
(daemon/service/stop.py decides what a probe means). A target with the events capability (the
local one) wakes its loop the moment a job exits or anyone writes a request or a proof. A
read that hangs or fails never holds up the follow: it is abandoned after `probe_timeout`,
noted, and tried again on the next poll.
"""

from __future__ import annotations

import contextlib
import time
from typing import Protocol

import anyio
import structlog

from daemon.service.api import ApiError
from daemon.service.hints import hint, last_lines, oom_finding, scope_events, signal_name
from daemon.service.limits import Left, check_of
from daemon.service.models import RunRecord, RunState
from daemon.service.ports import Launching, Runs, Wakes
from daemon.service.progress import job_ended
from daemon.service.stop import apply_probe, cancel_by_fallback, final_state, request_snapshot
from daemon.service.store import StoreError
from daemon.service.targets import Supervision, Targets
from executors.base import Executor, ExecutorError, JobHandle, JobState, JobStatus, RunEvents, RunProbe
from trainer_plugin import rundir
from trainer_plugin.tools import jobctl

log = structlog.get_logger("obd")


class FollowHost(Runs, Protocol):
    """What the follow uses of the daemon beyond the records: the targets, the runs being
    launched (a run still launching is not reconciled), itself as a stop request wakes it (a
    limit's request), and the saves to try again."""

    @property
    def targets(self) -> Targets: ...

    @property
    def launcher(self) -> Launching: ...

    @property
    def follow(self) -> Wakes: ...

    def retry_failed_saves(self) -> None: ...


# Files in rundir.URGENT_FILES wake a run's follow at once; metrics.jsonl growing marks the run
# for the next tick (progress can wait a poll interval; an exit or a proof cannot).
PROGRESS_FILES = frozenset({rundir.METRICS})
_TARGET_FAULTS = (ExecutorError, TimeoutError, OSError)
# Seconds the daemon waits at start for the ends of this machine's runs that ended while it was
# down to be recorded, before it answers: a profile's metrics can take longer, and go on after.
FINISH_AT_START = 15.0


def job_handle(record: RunRecord) -> JobHandle | None:
    return JobHandle.model_validate(record.job) if record.job else None


class Follower:
    """The follow loops of every target, the stop fallback, cancels and the end of runs."""

    def __init__(self, daemon: FollowHost) -> None:
        self.daemon = daemon
        self._wake: dict[str, anyio.Event] = {}
        self._loops: set[str] = set()
        self._watched: set[str] = set()  # executor keys whose events are being listened to
        self.cancelling: set[str] = set()
        self.finishing: set[str] = set()  # runs whose end is being recorded (outputs, metrics)
        self._finished: dict[str, anyio.Event] = {}  # set once a run's end is recorded (or failed to be)
        self._unreachable_noted: dict[str, set[str]] = {}  # kinds of failure noted while a target is away
        self.last_read: dict[str, float] = {}  # executor key -> wall time its last probe answered
        # On a target with events, a wake-up reads only the runs something happened to; every run
        # is read again each `sweep_interval`, as a safety net (an event lost, a filesystem
        # without inotify). Targets without events are read whole at every poll.
        self._dirty: dict[str, set[str]] = {}  # executor key -> run directories to read
        self._all_dirty: set[str] = set()  # executor keys to read whole at their next wake
        self._sweep_at: dict[str, float] = {}
        self._every_poll: set[str] = set()  # keys read whole at every poll, events or not
        self._sweep_every: dict[str, float] = {}  # keys read whole each poll interval, not each sweep
        self._dirty_first: set[str] = set()  # of those, keys whose events were just read before a whole read
        self._planted_noted: dict[str, set[str]] = {}  # run id -> planted marks already logged
        self.reconciling: set[str] = set()  # runs whose remote target has not been matched with them yet

    # --- loops ---------------------------------------------------------------------------

    def resume_all(self) -> None:
        """After the reconcile: a loop for every run left running or preparing (those still
        being reconciled in the background get theirs when it is done)."""
        for record in list(self.daemon.records.values()):
            if record.id in self.reconciling:
                continue
            if record.has_job:
                self.ensure_loop(record)
                self.watch(record)
            elif record.state == RunState.preparing:
                self.ensure_loop(record)  # its target did not answer yet: the follow decides

    def ensure_loop(self, record: RunRecord) -> None:
        targets = self.daemon.targets
        key = targets.key(record)
        self.mark(key, record.remote_dir if record.has_job else "")  # without a job: read the whole target
        if key in self._loops or not self.daemon.started:
            return
        self._loops.add(key)
        self.daemon.start_soon(self._loop, key, targets.of(record).poll_interval(record))

    def wake(self, key: str) -> None:
        event = self._wake.get(key)
        if event is not None:
            event.set()

    def wake_run(self, record: RunRecord) -> None:
        self.mark(self.daemon.targets.key(record), record.remote_dir)

    def mark(self, key: str, remote_dir: str, urgent: bool = True) -> None:
        """Something happened to the run in `remote_dir`: read it at the next wake (now, if urgent)."""
        if remote_dir:
            self._dirty.setdefault(key, set()).add(remote_dir)
        else:
            self._all_dirty.add(key)
        if urgent:
            self.wake(key)

    def watch(self, record: RunRecord) -> None:
        """Where the target can tell, wake the follow the moment the job exits or anyone
        writes a request or a proof, instead of at the next poll."""
        executor = self.daemon.targets.executor(record)
        handle = job_handle(record)
        events = executor.events
        if events is None or handle is None:
            return
        key = self.daemon.targets.key(record)
        events.watch(record.remote_dir)
        if key not in self._watched:
            self._watched.add(key)
            supervision = self.daemon.targets.of(record)
            if supervision.reads_every_poll:
                self._every_poll.add(key)
            elif supervision.sweeps_every_poll:
                self._sweep_every[key] = supervision.poll_interval(record)
            self.daemon.start_soon(self._listen, key, events)

        async def exit_watch() -> None:
            with contextlib.suppress(Exception):  # the follow's polling sees the exit anyway
                await events.wait_exit(handle)
            self.mark(key, record.remote_dir)

        self.daemon.start_soon(exit_watch)

    async def _listen(self, key: str, events: RunEvents) -> None:
        while True:
            try:
                paths = await events.changed_files()
            except OSError as exc:
                log.warning("dir_watch_failed", target=key, error=str(exc))
                return  # polling still sees everything
            for path in paths:
                where, _, name = path.rpartition("/")
                if name in rundir.URGENT_FILES or not where:
                    self.mark(key, where)  # a bare name (the target cannot say where): every run
                elif name in PROGRESS_FILES:
                    self.mark(key, where, urgent=False)

    async def _loop(self, key: str, interval: float) -> None:
        bound = log.bind(target=key)
        bound.info("follow_started")
        sweep = self.daemon.config.daemon.sweep_interval
        try:
            while True:
                self._wake[key] = anyio.Event()
                only = self._what_to_read(key, sweep)
                try:
                    await self._once(key, only)
                except Exception:  # a surprise in one poll must not end the follow, or the daemon
                    bound.exception("follow_poll_failed")
                with anyio.move_on_after(interval):
                    await self._wake[key].wait()
        finally:
            self._loops.discard(key)

    def _runs(self, key: str, state: RunState) -> list[RunRecord]:
        """The runs of target `key` in `state` (running: and those pending in a scheduler, `has_job`):
        a look at the active runs each poll (never the queued or the ended: thousands of them)."""
        targets = self.daemon.targets
        records = self.daemon.records.active()
        if state == RunState.running:
            running, queued = RunState.running, RunState.queued
            return [
                r
                for r in records
                if ((s := r.state) == running or (s == queued and r.job is not None)) and targets.key(r) == key
            ]
        return [r for r in records if r.state == state and targets.key(r) == key]

    def _what_to_read(self, key: str, sweep: float) -> set[str] | None:
        """The run directories the next read covers; None: every run of the target."""
        now = time.monotonic()
        evented = key in self._watched and key not in self._every_poll
        due = not evented or key in self._all_dirty or now >= self._sweep_at.get(key, 0.0)
        if due and key in self._sweep_every and self._dirty.get(key) and key not in self._dirty_first:
            # What an event was about (a Slurm job's end marker) first, on its own, and the whole
            # read (a scheduler's queue, slow or not answering at times) right after it.
            self._dirty_first.add(key)
            self._all_dirty.add(key)
            self.wake(key)
            return self._dirty.pop(key)
        if due:
            self._dirty_first.discard(key)
            self._all_dirty.discard(key)
            if key not in self._sweep_every:  # kept there: read again on its own if the whole read fails
                self._dirty.pop(key, None)
            self._sweep_at[key] = now + self._sweep_every.get(key, sweep)
            return None
        return self._dirty.pop(key, set())

    async def _once(self, key: str, only: set[str] | None = None) -> None:
        runs = self._runs(key, RunState.running)
        if only is not None:
            # And those with a clock running (the stop fallback counts from a request or a proof; a
            # chain's limits count while it runs).
            runs = [
                r
                for r in runs
                if r.remote_dir in only or r.stop.requested_at is not None or r.stop.cancel_by or r.limits is not None
            ]
        if runs:
            await self._poll(key, runs)
        if only is not None:
            self.daemon.retry_failed_saves()
            return
        # Runs left `preparing` by an earlier daemon whose target did not answer at start.
        launching = self.daemon.launcher.launching
        stranded = [r for r in self._runs(key, RunState.preparing) if r.id not in launching]
        if stranded:
            await self._reconcile_group(stranded)
        self.daemon.retry_failed_saves()

    async def _poll(self, key: str, runs: list[RunRecord]) -> None:
        supervision = self.daemon.targets.of(runs[0])
        probe_timeout = self.daemon.config.daemon.probe_timeout
        try:
            executor = supervision.executor(runs[0])
            await supervision.before_poll(runs[0], executor)
            with anyio.fail_after(probe_timeout):
                probes = await executor.probe([(job_handle(r), r.remote_dir) for r in runs])
        except _TARGET_FAULTS as exc:
            if await supervision.on_unreachable(runs[0]):
                return
            await self._note_unreachable(key, runs, exc)
            return
        self.last_read[key] = time.time()
        for record, probe in zip(runs, probes, strict=True):
            self._unreachable_noted.pop(record.id, None)
            await self.apply(record, probe)

    async def _note_unreachable(self, key: str, runs: list[RunRecord], exc: BaseException) -> None:
        now = time.time()
        kind = type(exc).__name__
        for record in runs:
            noted = self._unreachable_noted.setdefault(record.id, set())
            # The first failure, and each new kind of failure after it (a host that comes back
            # with a changed key), is noted, so `status` says why and what fixes it.
            if record.unreachable_since is None or kind not in noted:
                noted.add(kind)
                async with self.daemon.editing(record):
                    record.unreachable_since = record.unreachable_since or now
                    record.note(f"target unreachable: {exc}", now)
                log.warning("target_unreachable", run_id=record.id, target=key, error=str(exc))

    # --- what a probe means --------------------------------------------------------------

    async def apply(self, record: RunRecord, probe: RunProbe) -> None:
        """Fold a probe into the record; finish the run, or cancel it, as the rules say."""
        self._note_planted(record, probe)
        async with self.daemon.lock(record.id):
            if not record.has_job:
                return
            before = record.progress.model_copy()
            now = time.time()
            verdict = apply_probe(record, probe, now, self.daemon.config.stop)
            limit = self._limit_reached(record, now, ended=verdict.final is not None)
            if verdict.changed or limit is not None:
                self.daemon.save_quietly(record)
        if verdict.changed or limit is not None or record.progress != before:
            self.daemon.touch(record)
        if limit is not None and verdict.final is None:
            await self._ask_for_limit(record, *limit)
        if verdict.final is not None:
            if record.id in self.cancelling or record.id in self.finishing:
                return  # the cancel under way writes `cancelled` last; finish after it
            # Collecting metrics or a pod's outputs can take minutes: never in the follow's way.
            self.finishing.add(record.id)
            self._finished[record.id] = anyio.Event()
            self.daemon.start_soon(self._finish_task, record, verdict.final, probe)
        elif record.stop.cancel_by and not verdict.cancel and record.id not in self.cancelling:
            # A cancel asked for earlier (by the user or the fallback) that did not complete,
            # e.g. the daemon was killed during the grace: cancel is idempotent, so do it again.
            self.start_cancel(record)
        elif verdict.cancel and record.id not in self.cancelling:
            await self.fallback_cancel(record, verdict.cancel, f"stop fallback: cancelling ({verdict.cancel})")
            log.warning("stop_fallback_cancel", run_id=record.id, reason=verdict.cancel)

    def _limit_reached(self, record: RunRecord, now: float, ended: bool) -> tuple[Left, str] | None:
        """The chain's limit this attempt reached now (daemon/service/limits.py), marked in its record the
        first time (so its end says it stopped at its limit, and no retry starts it again); with who
        asks for the snapshot. None when none was reached, or it was marked already, or the job
        ended on its own before anything was asked of it."""
        if ended and record.stop.requested_at is None:
            return None
        found = check_of(self.daemon, record, now)
        if found is None or record.limits is None or record.limits.reached is not None:
            return None
        record.limits.reached = found[0].limit
        return found

    async def _ask_for_limit(self, record: RunRecord, limit: Left, by: str) -> None:
        """Ask for the limit's snapshot, as every stop is asked (the stop fallback then applies); a
        write that fails is logged and asked again on the next poll."""
        if record.stop.requested_at is not None or record.id in self.cancelling or record.stop.cancel_by:
            return  # already stopping (the scheduler's own signal, or another stop)
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                await request_snapshot(self.daemon, record, limit.reason, by)
        except Exception as exc:  # not asked: unmarked, so the next poll asks again
            log.warning("limit_request_failed", run_id=record.id, limit=limit.limit, error=str(exc))
            async with self.daemon.editing(record):
                if record.limits is not None:
                    record.limits.reached = None
            return
        log.info("limit_reached", run_id=record.id, limit=limit.limit, reason=limit.reason)

    def _note_planted(self, record: RunRecord, probe: RunProbe) -> None:
        """End marks planted in a run directory whose job's end the target records elsewhere
        change nothing; each is logged once, as what it is: tampering by the job's user."""
        new = set(probe.planted) - self._planted_noted.setdefault(record.id, set())
        if new:
            self._planted_noted[record.id] |= new
            log.warning("run_dir_tampering", run_id=record.id, owner=record.owner, planted=sorted(new))

    async def fallback_cancel(self, record: RunRecord, why: str, note: str) -> None:
        """Cancel the job on obd's own decision (the stop fallback, a pod's cap)."""
        async with self.daemon.editing(record):
            cancel_by_fallback(record, why, note)
        self.start_cancel(record)

    async def _finish_task(self, record: RunRecord, status: JobStatus, probe: RunProbe) -> None:
        try:
            await self._finish(record, status, probe)
        except Exception:  # the next poll tries again
            log.exception("finish_failed", run_id=record.id)
        finally:
            self.finishing.discard(record.id)
            if (finished := self._finished.pop(record.id, None)) is not None:
                finished.set()
            self.wake_run(record)

    async def _finish(self, record: RunRecord, status: JobStatus, probe: RunProbe) -> None:
        supervision = self.daemon.targets.of(record)
        executor = supervision.executor(record)
        decision = final_state(record, status, probe.checkpoints)
        state, message = decision.state, decision.message
        if status.state == JobState.lost:
            message = supervision.explain_lost(record, message)
        if status.state == JobState.exited:
            here = supervision.answers_at_once()  # the job ran on this machine: its OOM kills can be looked for
            message += await self._exit_detail(executor, record, status, probe, state == RunState.failed, here)
        if record.profile:
            await self._collect_metrics(record, executor)
        end_message = await supervision.on_end(record)
        if end_message:
            message += "; " + end_message
        async with self.daemon.editing(record):
            if not record.has_job:
                return
            record.exit_code = status.exit_code
            job_ended(record)
            if not decision.snapshot_stands:
                record.snapshot = None  # nothing may resume from a checkpoint that is not there
            if executor.events is not None:
                executor.events.unwatch(record.remote_dir)
            record.transition(state, message)

    @staticmethod
    async def _exit_detail(
        executor: Executor, record: RunRecord, status: JobStatus, probe: RunProbe, failed: bool, here: bool = False
    ) -> str:
        """What the log's end adds to the message: processes the job left behind (which may hold a
        GPU), and for a failed run a hint from the exit code and its last lines; for a job killed by
        SIGKILL on this machine (`here`), what a look for an OOM kill found."""
        tail = b""
        with contextlib.suppress(*_TARGET_FAULTS), anyio.fail_after(10):
            size = probe.log_size
            tail = await executor.read_from(rundir.RunPaths(record.remote_dir).job_log, max(0, size - 8192), 8192)
        text = tail.decode(errors="replace")
        left = [line for line in text.splitlines() if line.startswith(jobctl.LEFT_BEHIND)]
        detail = f"; {left[-1][len('obd: ') :]}" if left else ""
        if not failed:
            return detail
        lines = [line for line in last_lines(tail) if not line.startswith(jobctl.LEFT_BEHIND)]
        oom = None
        if here and signal_name(status.exit_code or 0) == "SIGKILL":
            since = next((h.time for h in record.history if h.state == RunState.running), record.created)
            with contextlib.suppress(Exception):  # a look that fails says "may be"
                oom = await anyio.to_thread.run_sync(oom_finding, since, time.time(), scope_events(record.id))
        extra = hint(status.exit_code, "\n".join(lines), oom)
        if extra:
            detail += f"; {extra}"
        if lines:
            detail += "; last lines: " + " | ".join(lines[-3:])
        return detail

    async def _collect_metrics(self, record: RunRecord, executor: Executor) -> None:
        try:
            from runner.collect import collect_metrics

            local = self.daemon.store.run_dir(record.id) / "retrieved"
            with anyio.fail_after(300):
                record.metrics = await collect_metrics(executor, record.remote_dir, local)
        except Exception as exc:  # profiling must never cost the run its final state
            log.warning("metrics_collect_failed", run_id=record.id, error=str(exc))
            record.metrics = {"runner_kind": "live", "warnings": [f"profile could not be collected: {exc}"]}

    # --- cancel --------------------------------------------------------------------------

    def start_cancel(self, record: RunRecord) -> None:
        if record.id in self.cancelling or not self.daemon.started:
            return
        self.cancelling.add(record.id)
        self.daemon.start_soon(self._cancel_job, record)

    async def _cancel_job(self, record: RunRecord) -> None:
        try:
            handle = job_handle(record)
            if handle is None:
                return
            executor = self.daemon.targets.executor(record)
            await executor.cancel(handle, record.remote_dir, self.daemon.config.stop.cancel_grace)
        except Exception as exc:  # retried on the next poll (cancel_by stays set); never fatal
            log.error("cancel_failed", run_id=record.id, error=str(exc))
            async with self.daemon.editing(record):
                record.note(f"cancel failed, will retry: {exc}")
        finally:
            self.cancelling.discard(record.id)
            self.wake_run(record)

    # --- reconcile -----------------------------------------------------------------------

    async def reconcile(self) -> None:
        """At start: match each target with the records, re-attach to every run left preparing or
        running, and finish those whose job ended while the daemon was down.

        This machine's runs are reconciled before the daemon answers (a local read). A remote
        target (an SSH host, a Slurm cluster, a cloud API) is reconciled in the background, so
        a host or an API that does not answer never holds up the socket: its runs are marked
        `reconciling` meanwhile, and followed once their target answered."""
        records = self.daemon.records.values()
        for record in [r for r in records if r.state == RunState.preparing and not r.remote_dir]:
            async with self.daemon.editing(record):
                record.transition(
                    RunState.failed,
                    "the daemon stopped while launching this run and its job never started; "
                    "start it again with `obd train start`",
                )
        configured = self.daemon.targets.configured()
        names = {s.name for s in configured}
        pending = [r for r in records if r.state == RunState.preparing or r.has_job]
        here: list[RunRecord] = []
        for supervision in configured:
            runs = [r for r in pending if r.target == supervision.name]
            if supervision.answers_at_once():
                await self._reconcile_target(supervision, runs)
                here += runs
            else:
                self.reconciling.update(r.id for r in runs)
                self.daemon.start_soon(self._reconcile_in_background, supervision, runs)
        # Runs of a target no longer in the config: reported as their probe fails.
        await self._reconcile_runs_by_key([r for r in pending if r.target not in names])
        await self._ends_recorded(here)

    async def _ends_recorded(self, runs: list[RunRecord]) -> None:
        """Wait for the ends the reconcile found on this machine to be recorded (their exit's
        detail read, metrics collected: a task each), FINISH_AT_START at most: a run that ended
        while the daemon was down is final by the time it answers and tells systemd it is ready."""
        ends = [event for r in runs if (event := self._finished.get(r.id)) is not None]
        with anyio.move_on_after(FINISH_AT_START):
            for event in ends:
                await event.wait()

    async def _reconcile_target(self, supervision: Supervision, runs: list[RunRecord]) -> None:
        try:
            await supervision.reconcile()
        except Exception:  # one target's surprise must not stop the daemon; the follow retries
            log.exception("reconcile_failed", target=supervision.name)
        await self._reconcile_runs_by_key(runs)

    async def _reconcile_runs_by_key(self, runs: list[RunRecord]) -> None:
        groups: dict[str, list[RunRecord]] = {}
        for record in runs:
            if record.state == RunState.preparing or record.has_job:
                groups.setdefault(self.daemon.targets.key(record), []).append(record)
        async with anyio.create_task_group() as tg:
            for group in groups.values():
                tg.start_soon(self._reconcile_group, group)

    async def _reconcile_in_background(self, supervision: Supervision, runs: list[RunRecord]) -> None:
        """A remote target's reconcile, after which its runs are followed as any others."""
        try:
            await self._reconcile_target(supervision, runs)
        finally:
            self.reconciling.difference_update(r.id for r in runs)
            for record in runs:
                if record.has_job:
                    self.ensure_loop(record)
                    self.watch(record)
                elif record.state == RunState.preparing:
                    self.ensure_loop(record)
            log.info("reconciled", target=supervision.name, runs=len(runs))

    async def _reconcile_group(self, runs: list[RunRecord]) -> None:
        try:
            await self._reconcile_runs(runs)
        except Exception:  # one target's surprise must not stop the daemon; the follow retries
            log.exception("reconcile_failed", target=runs[0].target if runs else None)

    async def _reconcile_runs(self, runs: list[RunRecord]) -> None:
        runs = [r for r in runs if r.state == RunState.preparing or r.has_job]
        if not runs:
            return
        supervision = self.daemon.targets.of(runs[0])
        if not await supervision.ready(runs[0]):
            return
        try:
            executor = supervision.executor(runs[0])
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                probes = await executor.probe([(job_handle(r), r.remote_dir) for r in runs])
        except (*_TARGET_FAULTS, ApiError) as exc:
            log.warning("reconcile_deferred", target=runs[0].target, error=f"{type(exc).__name__}: {exc}")
            now = time.time()
            for record in runs:
                if record.has_job:  # a preparing one is decided once the target answers
                    record.unreachable_since = record.unreachable_since or now
            return
        for record, probe in zip(runs, probes, strict=True):
            if record.state == RunState.preparing:
                await self._adopt_or_fail(record, probe)
            else:
                await self.apply(record, probe)

    async def _adopt_or_fail(self, record: RunRecord, probe: RunProbe) -> None:
        """Re-attach a run whose launch an earlier daemon began, or fail it if its job never started."""
        started = (probe.handle and probe.status.state != JobState.lost) or probe.status.state in (
            JobState.exited,
            JobState.cancelled,
        )
        requeue = not started and bool(record.gpus)
        async with self.daemon.editing(record):
            if record.state != RunState.preparing or record.id in self.daemon.launcher.launching:
                return  # this daemon took it up meanwhile (the queue launched it again): its launch decides
            if started:
                record.job = record.job or probe.handle
                record.transition(RunState.running, "launched; re-attached after a daemon restart")
            elif requeue:
                # It had left the GPU queue: nothing of it ran, so it waits there again for its
                # GPUs (its launch settings are kept until its chain ends) rather than failing.
                record.gpus = []
                record.transition(
                    RunState.queued, "back in the queue: the daemon stopped while launching it, before its job started"
                )
            else:
                record.transition(
                    RunState.failed,
                    "its launch was cut short (the daemon stopped, or the connection went) and its job never "
                    "started; start it again with `obd train start`",
                )
        if started:
            self.ensure_loop(record)
            self.watch(record)
        elif not requeue:
            await self.end_quietly(record)

    async def end_quietly(self, record: RunRecord) -> None:
        """Let the target end what served a run that ended without the follow (a failed launch)."""
        message = await self.daemon.targets.of(record).on_end(record)
        if message:
            with contextlib.suppress(StoreError):
                async with self.daemon.editing(record):
                    record.note(message)
