"""The daemon: holds the run records, launches jobs, follows every running run, stops them.

Each target (or pod) has one follow loop that reads all its running runs in one probe per
poll, folds what it sees into the records (daemon/supervise.py decides) and applies the stop
fallback. Every change of a record is saved before it is acted on, so a daemon killed at any
moment finds, on restart, what it needs to carry on: the records and the run directories.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import secrets as pysecrets
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup

from daemon.api import ApiError, IdRequest, ReadRequest, StartRequest, StopRequest
from daemon.config import Config, LocalTarget
from daemon.hints import hint, last_lines
from daemon.pods import PodSupervisor
from daemon.models import InvalidRunId, RunRecord, RunState, check_run_id, normalise_reason
from daemon.store import RunStore, StoreError
from daemon.supervise import apply_probe, final_state
from daemon.systemd import Notifier
from executors.base import Executor, ExecutorError, JobHandle, JobSpec, JobState, JobStatus, LaunchUncertain, RunProbe
from executors.local import LocalExecutor
from trainer_plugin import jobctl

log = structlog.get_logger("obd")
PLUGIN_SRC = Path(__file__).resolve().parent.parent / "trainer_plugin"
SETTLED_POD_PHASES = frozenset({"terminated", "terminate_failed", "create_failed"})
POD_RECONCILE_INTERVAL = 300.0  # how often pods are matched with runs while the daemon runs


def target_secrets(target: str, names: list[str], given: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The job's secrets: the client's `--secret`s, plus the target's `secrets` from the daemon's environment.

    A name the target lists that neither has is refused at start, not left for the job to
    trip over hours later on a remote host.
    """
    missing = [n for n in names if n not in given and n not in environ]
    if missing:
        raise ApiError(
            f"target {target} lists secrets the daemon's environment lacks: {', '.join(missing)}; set them "
            "where the daemon starts (under systemd: an EnvironmentFile= line added with `systemctl edit obd`), "
            "or pass them with `obd train start --secret NAME` from a shell that has them",
            "usage",
        )
    return {**{n: environ[n] for n in names if n not in given}, **given}


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + pysecrets.token_hex(3)


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        assert config.daemon.state_dir is not None
        self.state_dir = Path(config.daemon.state_dir)
        self.store = RunStore(self.state_dir)
        self.records: dict[str, RunRecord] = {}
        self.bad_records: dict[str, str] = {}
        self.notifier = Notifier()
        self.pods = PodSupervisor(config, self.state_dir)
        self._executors: dict[str, Executor] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._wake: dict[str, anyio.Event] = {}
        self._loops: set[str] = set()
        self._cancelling: set[str] = set()
        self._launching: set[str] = set()  # runs this daemon is launching right now
        # A cancel while a run prepares (a pod booting, an upload) ends the preparation at once.
        self._preparing: dict[str, anyio.CancelScope] = {}
        self._finishing: set[str] = set()  # runs whose end is being recorded (outputs, metrics)
        self._dir_watchers: set[str] = set()
        self._dirty: set[str] = set()
        self._final: dict[str, anyio.Event] = {}
        self._unreachable_noted: dict[str, set[str]] = {}  # kinds of failure noted while a run's target is away
        self._tg: TaskGroup | None = None
        self._lock_fd: int | None = None

    # --- records -----------------------------------------------------------------------

    def lock(self, run_id: str) -> anyio.Lock:
        return self._locks.setdefault(run_id, anyio.Lock())

    def save(self, record: RunRecord) -> None:
        """Save a record; on failure (a full disk) keep it in memory and retry on the next poll."""
        try:
            self.store.save(record)
            self._dirty.discard(record.id)
        except StoreError as exc:
            self._dirty.add(record.id)
            log.error("record_save_failed", run_id=record.id, error=str(exc))
            raise

    def _save_quietly(self, record: RunRecord) -> None:
        with contextlib.suppress(StoreError):
            self.save(record)

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

    # --- executors ---------------------------------------------------------------------

    def executor_key(self, record: RunRecord) -> str:
        # A pod is one run's own machine: each pod run is followed on its own.
        return f"{record.target}/{record.id}" if self.pods.is_pod(record) else record.target

    def executor_for(self, record: RunRecord) -> Executor:
        key = self.executor_key(record)
        if key not in self._executors:
            if self.pods.is_pod(record):
                self._executors[key] = self.pods.executor(record)
            else:
                self._executors[key] = self._make_executor(record.target)
        return self._executors[key]

    async def _drop_executor(self, record: RunRecord) -> None:
        if self.pods.is_pod(record):
            executor = self._executors.pop(self.executor_key(record), None)
            if executor is not None:
                with contextlib.suppress(Exception):
                    await executor.aclose()

    def _make_executor(self, target_name: str) -> Executor:
        cfg = self.config.target(target_name)
        if isinstance(cfg, LocalTarget):
            workdir = cfg.workdir or self.state_dir / "jobs"
            return LocalExecutor(target_name, Path(workdir), cfg.python)
        if cfg.kind == "ssh":
            from executors.ssh import SshExecutor

            return SshExecutor(target_name, cfg)
        raise ApiError(f"target {target_name!r} of kind {cfg.kind!r} is not supported by this daemon yet")

    def poll_interval(self, record: RunRecord) -> float:
        cfg = self.config.target(record.target)
        d = self.config.daemon
        return d.poll_interval if isinstance(cfg, LocalTarget) else min(d.remote_poll_interval, self.config.stop.request_poll)

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
        from daemon.server import ControlServer

        self._take_state_lock()
        self.load()
        log.info("daemon_starting", state_dir=str(self.state_dir), runs=len(self.records))
        server = ControlServer(self.config.daemon, self.handle)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self._signals, tg.cancel_scope)
            await self.reconcile()
            await tg.start(server.serve)
            for record in list(self.records.values()):
                if record.state == RunState.running:
                    self._ensure_loop(record)
                    self._watch_exit(record)
                elif record.state == RunState.preparing:
                    self._ensure_loop(record)  # its target did not answer yet: the follow decides
            tg.start_soon(self.notifier.watchdog_loop)
            if any(t.kind == "runpod" for t in self.config.targets.values()):
                tg.start_soon(self._pods_periodically)
            active = sum(r.state == RunState.running for r in self.records.values())
            self.notifier.ready(f"following {active} running runs")
            log.info("daemon_ready", socket=str(self.config.daemon.socket), running=active)
            task_status.started()
        self.notifier.stopping()
        log.info("daemon_stopped", note="jobs keep running")

    async def _signals(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("daemon_stopping", signal=signal.Signals(signum).name)
                self.notifier.stopping()
                scope.cancel()
                return

    async def reconcile(self) -> None:
        """Re-attach to every run left preparing or running; finish those whose job ended."""
        await self._reconcile_pods()
        for record in [r for r in self.records.values() if r.state == RunState.preparing and not r.remote_dir]:
            record.transition(
                RunState.failed,
                "the daemon stopped while launching this run and its job never started; "
                "start it again with `obd train start`",
            )
            self._save_quietly(record)
        pending = [r for r in self.records.values() if r.state in (RunState.preparing, RunState.running)]
        groups: dict[str, list[RunRecord]] = {}
        for record in pending:
            groups.setdefault(self.executor_key(record), []).append(record)
        async with anyio.create_task_group() as tg:
            for runs in groups.values():
                tg.start_soon(self._reconcile_group, runs)

    async def _reconcile_pods(self) -> None:
        """Match the pods obd created with the runs; fail runs whose pod is gone, empty orphan pods."""
        targets = sorted({n for n, t in self.config.targets.items() if t.kind == "runpod"})
        for name in targets:
            live = {
                r.id: r.target_info
                for r in self.records.values()
                if r.target == name and r.state in (RunState.preparing, RunState.running) and r.id not in self._launching
            }
            try:
                with anyio.fail_after(self.config.daemon.probe_timeout * 3):
                    findings = await self.pods.reconcile(name, live)
            except Exception as exc:  # the API is down: decide nothing now, the follow retries
                log.warning("pod_reconcile_deferred", target=name, error=str(exc))
                continue
            for item in findings:
                await self._apply_pod_finding(item)

    async def _reconcile_pods_soon(self, delay: float = 20.0) -> None:
        await anyio.sleep(delay)
        try:
            await self._reconcile_pods()
        except Exception:
            log.exception("pod_reconcile_failed")

    async def _pods_periodically(self) -> None:
        """Match pods with runs now and then: a pod whose create looked failed is found and ended."""
        while True:
            await anyio.sleep(POD_RECONCILE_INTERVAL)
            try:
                await self._reconcile_pods()
            except Exception:
                log.exception("pod_reconcile_failed")

    async def _apply_pod_finding(self, item: dict[str, Any]) -> None:
        record = self.records.get(item.get("run_id") or "")
        kind = item["kind"]
        if record is not None and record.id in self._launching:
            return  # its launch is under way and decides
        if kind == "orphan" and record is not None and not record.state.final:
            return  # a live run's pod, not yet in its record
        if kind == "gone" and record is not None and record.state == RunState.running and self.pods.retrieved_at(record):
            # Its outputs were retrieved and verified before the pod went: finish from the local copy.
            local = self.store.run_dir(record.id) / "retrieved"
            raw = await anyio.to_thread.run_sync(jobctl.probe_dir, str(local), None)
            await self._apply(record, RunProbe.model_validate(raw))
            return
        if kind == "orphan":
            log.warning("pod_orphan", pod_id=item["pod_id"], run_id=item.get("run_id"))
            assert self._tg is not None
            self._tg.start_soon(self._empty_orphan, item)
            return
        if record is None:
            return
        async with self.lock(record.id):
            if kind in ("gone", "not_created"):
                record.transition(RunState.failed, item["reason"])
                self._save_quietly(record)
                self.final_event(record.id).set()
            elif kind == "adopted":
                record.target_info = item["target_info"]
                record.note(f"pod {item['pod_id']} found by its tag and adopted")
                self._save_quietly(record)

    async def _empty_orphan(self, item: dict[str, Any]) -> None:
        """A pod obd created that no run knows: wait for its SSH, retrieve its outputs, terminate it.

        A pod that never answers within its boot grace is terminated by `resume`, and a stopped one
        is started again; one whose retrieval fails is left up and reported (its outputs come first).
        """
        info = item["target_info"]
        driver = self.pods.driver(info.get("target") or "")
        run_id = item.get("run_id") or f"orphan-{item['pod_id']}"

        async def keep(_info: dict[str, Any]) -> None:
            return None

        record = self.records.get(run_id)
        try:
            info = await driver.resume(info, keep)
            # A run that ended without its outputs (its pod was stopped, say) gets them in its own directory.
            local = self.store.run_dir(run_id) / "retrieved" if record else self.state_dir / "orphans" / str(item["pod_id"])
            ok, message = await driver.finish(run_id, item.get("remote_dir") or "", info, local)
        except Exception as exc:
            ok, message = False, str(exc)
        log.warning("pod_orphan_finished", run_id=item.get("run_id"), pod_id=item["pod_id"], outputs_safe=ok, message=message)
        if record is not None:
            async with self.lock(record.id):
                record.note(f"after the run ended, its pod {item['pod_id']}: {message}")
                self._save_quietly(record)

    async def _reconcile_group(self, runs: list[RunRecord]) -> None:
        try:
            await self._reconcile_runs(runs)
        except Exception:  # one target's surprise must not stop the daemon; the follow retries
            log.exception("reconcile_failed", target=runs[0].target if runs else None)

    async def _reconcile_runs(self, runs: list[RunRecord]) -> None:
        runs = [r for r in runs if r.state in (RunState.preparing, RunState.running)]
        if not runs:
            return
        if self.pods.is_pod(runs[0]) and not await self._pod_ready(runs[0]):
            return
        try:
            executor = self.executor_for(runs[0])
            with anyio.fail_after(self.config.daemon.probe_timeout):
                probes = await executor.probe([(self._handle(r), r.remote_dir) for r in runs])
        except (ExecutorError, TimeoutError, ApiError, OSError) as exc:
            log.warning("reconcile_deferred", target=runs[0].target, error=f"{type(exc).__name__}: {exc}")
            now = time.time()
            for record in runs:
                if record.state == RunState.preparing:
                    continue  # decided once the target answers (the follow adopts it then)
                record.unreachable_since = record.unreachable_since or now
            return
        for record, probe in zip(runs, probes):
            if record.state == RunState.preparing:
                async with self.lock(record.id):
                    failed = self._adopt_or_fail(record, probe)
                if failed:
                    await self._end_pod_quietly(record)
                continue
            await self._apply(record, probe)

    async def _pod_ready(self, record: RunRecord) -> bool:
        """Make sure a pod run left by an earlier daemon has a ready, pinned pod; fail it if it cannot."""
        info = record.target_info
        if info.get("phase") in SETTLED_POD_PHASES:
            await self._fail_pod_run(record, f"its pod was never ready ({info.get('phase')}: {info.get('error') or 'no detail'})")
            return False
        if info.get("phase") == "ready" and info.get("host_key"):
            return True
        if not info.get("pod_id"):
            return False  # reconcile adopts it by its tag, or fails it as never created
        try:
            record.target_info = await self.pods.resume(record, self._pod_saver(record))
            return True
        except Exception as exc:
            if record.target_info.get("phase") in SETTLED_POD_PHASES:  # `resume` ended the pod
                await self._fail_pod_run(record, f"its pod never became ready: {exc}")
            else:
                log.warning("pod_resume_deferred", run_id=record.id, error=str(exc))
            return False

    async def _fail_pod_run(self, record: RunRecord, why: str) -> None:
        async with self.lock(record.id):
            if record.state.final:
                return
            record.transition(RunState.failed, why)
            self._save_quietly(record)
        self.final_event(record.id).set()
        await self._drop_executor(record)

    def _adopt_or_fail(self, record: RunRecord, probe: RunProbe) -> bool:
        """Re-attach a run whose launch an earlier daemon began; True when it is failed instead."""
        if probe.handle and probe.status.state != JobState.lost or probe.status.state in (
            JobState.exited,
            JobState.cancelled,
        ):
            record.job = record.job or probe.handle
            record.transition(RunState.running, "launched; re-attached after a daemon restart")
            self._save_quietly(record)
            self._ensure_loop(record)
            self._watch_exit(record)
            return False
        record.transition(
            RunState.failed,
            "its launch was cut short (the daemon stopped, or the connection went) and its job never "
            "started; start it again with `obd train start`",
        )
        self._save_quietly(record)
        self.final_event(record.id).set()
        return True

    async def _end_pod(self, record: RunRecord) -> str:
        """Retrieve a pod run's outputs and terminate its pod, once; the message says how it went."""
        if not self.pods.is_pod(record) or not record.target_info.get("pod_id"):
            return ""
        if record.target_info.get("ended"):
            return ""
        local = self.store.run_dir(record.id) / "retrieved"
        try:
            if self.pods.retrieved_at(record):
                with contextlib.suppress(Exception):
                    await self.pods.terminate(record)
                message = f"outputs retrieved and verified into {local}; pod {record.target_info['pod_id']} ended"
            else:
                message = await self.pods.finish(record, local)
        except Exception as exc:  # the record's final state must not wait on the pod
            message = f"the pod could not be emptied and ended: {exc} (see `obd pods list`)"
        record.target_info["ended"] = True
        await self._drop_executor(record)
        return message

    async def _end_pod_quietly(self, record: RunRecord) -> None:
        message = await self._end_pod(record)
        if message:
            async with self.lock(record.id):
                record.note(message)
                self._save_quietly(record)

    # --- the follow --------------------------------------------------------------------

    @staticmethod
    def _handle(record: RunRecord) -> JobHandle | None:
        return JobHandle.model_validate(record.job) if record.job else None

    def _ensure_loop(self, record: RunRecord) -> None:
        key = self.executor_key(record)
        self.wake(key)
        if key in self._loops or self._tg is None:
            return
        self._loops.add(key)
        self._tg.start_soon(self._follow, key, self.poll_interval(record))

    def _watch_exit(self, record: RunRecord) -> None:
        """On a local target, wake the follow the moment the job exits, or anyone writes a
        request or a proof (inotify), instead of at the next poll."""
        executor = self.executor_for(record)
        handle = self._handle(record)
        if self._tg is None or handle is None or not hasattr(executor, "wait_exit"):
            return
        key = self.executor_key(record)
        executor.watch_dir(record.remote_dir)  # type: ignore[attr-defined]
        if key not in self._dir_watchers:
            self._dir_watchers.add(key)
            self._tg.start_soon(self._watch_dirs, key, executor)

        async def watch() -> None:
            with contextlib.suppress(Exception):  # the follow's polling sees the exit anyway
                await executor.wait_exit(handle)
            self.wake(self.executor_key(record))

        self._tg.start_soon(watch)

    async def _watch_dirs(self, key: str, executor: Any) -> None:
        wanted = {"snapshot.request", "snapshot.json", "exit_code", "cancelled"}
        while True:
            try:
                names = await executor.changed_files()
            except OSError as exc:
                log.warning("dir_watch_failed", target=key, error=str(exc))
                return  # polling still sees everything
            if names & wanted:
                self.wake(key)

    def final_event(self, run_id: str) -> anyio.Event:
        return self._final.setdefault(run_id, anyio.Event())

    def wake(self, key: str) -> None:
        event = self._wake.get(key)
        if event is not None:
            event.set()

    async def _follow(self, key: str, interval: float) -> None:
        bound = log.bind(target=key)
        bound.info("follow_started")
        try:
            while True:
                self._wake[key] = anyio.Event()
                try:
                    await self._follow_once(key)
                except Exception:  # a surprise in one poll must not end the follow, or the daemon
                    bound.exception("follow_poll_failed")
                with anyio.move_on_after(interval):
                    await self._wake[key].wait()
        finally:
            self._loops.discard(key)

    async def _follow_once(self, key: str) -> None:
        runs = [r for r in self.records.values() if r.state == RunState.running and self.executor_key(r) == key]
        if runs:
            await self._poll(key, runs)
        # Runs left `preparing` by an earlier daemon whose target did not answer at start.
        stranded = [
            r
            for r in self.records.values()
            if r.state == RunState.preparing and r.id not in self._launching and self.executor_key(r) == key
        ]
        if stranded:
            await self._reconcile_group(stranded)
        for rid in list(self._dirty):
            if rid in self.records:
                self._save_quietly(self.records[rid])

    async def _poll(self, key: str, runs: list[RunRecord]) -> None:
        try:
            executor = self.executor_for(runs[0])
            if self.pods.is_pod(runs[0]):
                await self._pod_tick(runs[0], executor)
            with anyio.fail_after(self.config.daemon.probe_timeout):
                probes = await executor.probe([(self._handle(r), r.remote_dir) for r in runs])
        except (ExecutorError, TimeoutError, OSError) as exc:
            if self.pods.is_pod(runs[0]) and (await self._pod_ended_outside(runs[0]) or await self._cap_on_unreachable_pod(runs[0])):
                return
            now = time.time()
            kind = type(exc).__name__
            for record in runs:
                noted = self._unreachable_noted.setdefault(record.id, set())
                # The first failure, and each new kind of failure after it (a host that comes back
                # with a changed key), is noted, so `status` says why and what fixes it.
                if record.unreachable_since is None or kind not in noted:
                    noted.add(kind)
                    record.unreachable_since = record.unreachable_since or now
                    record.note(f"target unreachable: {exc}", now)
                    log.warning("target_unreachable", run_id=record.id, target=key, error=str(exc))
                    self._save_quietly(record)
            return
        for record, probe in zip(runs, probes):
            self._unreachable_noted.pop(record.id, None)
            await self._apply(record, probe)

    async def _pod_tick(self, record: RunRecord, executor: Executor) -> None:
        """Renew the pod's lease; enforce its caps from this side too (snapshot, then cancel)."""
        with anyio.fail_after(self.config.daemon.probe_timeout):
            request, cancel = await self.pods.tick(record, executor)
        if await self.pods.due_for_check(record) and await self._pod_ended_outside(record):
            return
        if request and record.stop.requested_at is None and record.snapshots:
            await self._request_snapshot(record, request, "the pod's cap")
        if cancel and record.id not in self._cancelling and not record.stop.fallback:
            async with self.lock(record.id):
                record.stop.fallback = cancel
                record.stop.cancel_by = "fallback"
                record.note(f"cancelling: {cancel}")
                self._save_quietly(record)
            self._start_cancel(record)

    async def _cap_on_unreachable_pod(self, record: RunRecord) -> bool:
        """A pod past its cap that cannot be reached for a lease's time is terminated: the cap holds
        even with the pod's SSH and watchdog gone (its outputs are then lost, and the run says so)."""
        try:
            reason = await self.pods.cap_reached(record)
        except Exception:
            return False
        since = record.unreachable_since
        if not reason or since is None or time.time() - since < self.pods.lease_ttl(record):
            return False
        try:
            with anyio.fail_after(self.config.daemon.probe_timeout):
                await self.pods.terminate(record)
        except Exception as exc:
            log.error("pod_cap_terminate_failed", run_id=record.id, error=str(exc))
            return False
        record.target_info["ended"] = True
        await self._fail_pod_run(
            record,
            f"the {reason} cap of pod {record.target_info.get('pod_id')} passed while the pod could not be reached; "
            "the pod was terminated and the outputs on it are lost",
        )
        log.error("pod_cap_terminated_unreachable", run_id=record.id, reason=reason)
        return True

    async def _pod_ended_outside(self, record: RunRecord) -> bool:
        """Whether the run's pod was terminated or stopped outside obd (the run is failed, or its
        stopped pod started again to recover its outputs), rather than merely slow to answer."""
        if record.id in self._finishing:
            return False  # its finish retrieves the outputs and then ends the pod itself
        try:
            with anyio.fail_after(self.config.daemon.probe_timeout):
                state = await self.pods.state(record)
        except Exception:
            return False
        if state == "EXITED":
            await self._restart_stopped_pod(record)
            return True
        if state != "gone":
            return False
        why = f"pod {record.target_info.get('pod_id')} no longer exists (terminated outside obd, or reclaimed)"
        async with self.lock(record.id):
            if record.state.final:
                return True
            record.transition(RunState.failed, why)
            self._save_quietly(record)
        self.final_event(record.id).set()
        await self._drop_executor(record)
        log.error("pod_gone", run_id=record.id, reason=why)
        return True

    async def _restart_stopped_pod(self, record: RunRecord) -> None:
        """A pod stopped outside obd ended its job, but its volume holds the run directory: start it
        again so the follow finds the job ended and retrieves the outputs, then ends the pod."""
        pod_id = record.target_info.get("pod_id")
        async with self.lock(record.id):
            if record.state.final:
                return
            if not record.target_info.get("stopped_outside"):
                record.target_info["stopped_outside"] = time.time()
                record.note(
                    f"pod {pod_id} was stopped outside obd (EXITED), which ended its job; "
                    "starting it again to recover the outputs on its volume"
                )
                self._save_quietly(record)
        await self._drop_executor(record)
        t = self.config.target(record.target)
        grace = float(getattr(t, "boot_grace", 600.0))
        try:
            with anyio.fail_after(grace + 4 * self.config.daemon.probe_timeout):
                await self.pods.restart_stopped(record, self._pod_saver(record))
        except Exception as exc:
            log.error("pod_restart_failed", run_id=record.id, pod_id=pod_id, error=str(exc))
            await self._fail_pod_run(
                record,
                f"pod {pod_id} was stopped outside obd (EXITED), which ended the job, and could not be started "
                f"again to copy the outputs on its volume: {exc}. obd tries again every few minutes and ends "
                f"the pod once its outputs are in the run's directory; `obd pods rm {pod_id}` removes it now, "
                "outputs and all",
            )
            return
        async with self.lock(record.id):
            record.note(f"pod {pod_id} started again; its job ended with the stop")
            self._save_quietly(record)

    def _pod_saver(self, record: RunRecord):  # type: ignore[no-untyped-def]
        async def save(info: dict[str, Any]) -> None:
            # Raises on a failed save: a pod is never created without a record of it on disk.
            async with self.lock(record.id):
                record.target_info = dict(info)
                self.save(record)

        return save

    async def _apply(self, record: RunRecord, probe: RunProbe) -> None:
        async with self.lock(record.id):
            if record.state != RunState.running:
                return
            now = time.time()
            verdict = apply_probe(record, probe, now, self.config.stop)
            if verdict.changed:
                self._save_quietly(record)
        if verdict.final is not None:
            if record.id in self._cancelling or record.id in self._finishing:
                return  # the cancel under way writes `cancelled` last; finish after it
            # Collecting metrics or a pod's outputs can take minutes: never in the follow's way.
            self._finishing.add(record.id)
            assert self._tg is not None
            self._tg.start_soon(self._finish_task, record, verdict.final, probe)
        elif record.stop.cancel_by and not verdict.cancel and record.id not in self._cancelling:
            # A cancel asked for earlier (by the user or the fallback) that did not complete,
            # e.g. the daemon was killed during the grace: cancel is idempotent, so do it again.
            self._start_cancel(record)
        elif verdict.cancel and record.id not in self._cancelling:
            async with self.lock(record.id):
                record.stop.fallback = verdict.cancel
                record.stop.cancel_by = "fallback"
                record.note(f"stop fallback: cancelling ({verdict.cancel})")
                self._save_quietly(record)
            log.warning("stop_fallback_cancel", run_id=record.id, reason=verdict.cancel)
            self._start_cancel(record)

    async def _finish_task(self, record: RunRecord, status: JobStatus, probe: RunProbe) -> None:
        try:
            await self._finish(record, status, probe)
        except Exception:  # the next poll tries again
            log.exception("finish_failed", run_id=record.id)
        finally:
            self._finishing.discard(record.id)
            self.wake(self.executor_key(record))

    async def _finish(self, record: RunRecord, status: JobStatus, probe: RunProbe) -> None:
        executor = self.executor_for(record)
        state, message = final_state(record, status)
        if status.state == JobState.lost and record.target_info.get("stopped_outside"):
            message = f"pod {record.target_info.get('pod_id')} was stopped outside obd (EXITED), which killed the job; {message}"
        if state == RunState.failed and status.state == JobState.exited:
            tail = b""
            with contextlib.suppress(ExecutorError, TimeoutError, OSError), anyio.fail_after(10):
                size = probe.log_size
                tail = await executor.read_from(f"{record.remote_dir}/job.log", max(0, size - 8192), 8192)
            lines = last_lines(tail)
            extra = hint(status.exit_code, "\n".join(lines))
            if extra:
                message += f"; {extra}"
            if lines:
                message += "; last lines: " + " | ".join(lines[-3:])
        if record.snapshot is not None and state == RunState.stopped:
            present = probe.checkpoints
            name = record.snapshot.checkpoint.split("/", 1)[1]
            if name not in present:
                state, message = RunState.failed, (
                    f"the snapshot proof names {record.snapshot.checkpoint}, which is not in the run "
                    f"directory; see `obd train logs {record.id}`"
                )
        if record.profile:
            await self._collect_metrics(record, executor)
        pod_message = await self._end_pod(record)
        if pod_message:
            message += "; " + pod_message
        async with self.lock(record.id):
            if record.state != RunState.running:
                return
            record.exit_code = status.exit_code
            record.progress.eta_seconds = None
            if hasattr(executor, "unwatch_dir"):
                executor.unwatch_dir(record.remote_dir)
            record.transition(state, message)
            self._save_quietly(record)
        self.final_event(record.id).set()
        log.info("run_finished", run_id=record.id, state=state.value, exit_code=status.exit_code, message=message)

    async def _collect_metrics(self, record: RunRecord, executor: Executor) -> None:
        try:
            from runner.collect import collect_metrics

            local = self.store.run_dir(record.id) / "retrieved"
            with anyio.fail_after(300):
                record.metrics = await collect_metrics(executor, record.remote_dir, local)
        except Exception as exc:  # profiling must never cost the run its final state
            log.warning("metrics_collect_failed", run_id=record.id, error=str(exc))
            record.metrics = {"runner_kind": "live", "warnings": [f"profile could not be collected: {exc}"]}

    def _start_cancel(self, record: RunRecord) -> None:
        if record.id in self._cancelling or self._tg is None:
            return
        self._cancelling.add(record.id)
        self._tg.start_soon(self._cancel_job, record)

    async def _cancel_job(self, record: RunRecord) -> None:
        try:
            handle = self._handle(record)
            if handle is None:
                return
            executor = self.executor_for(record)
            await executor.cancel(handle, record.remote_dir, self.config.stop.cancel_grace)
        except Exception as exc:  # retried on the next poll (cancel_by stays set); never fatal
            log.error("cancel_failed", run_id=record.id, error=str(exc))
            async with self.lock(record.id):
                record.note(f"cancel failed, will retry: {exc}")
                self._save_quietly(record)
        finally:
            self._cancelling.discard(record.id)
            self.wake(self.executor_key(record))

    # --- operations --------------------------------------------------------------------

    async def handle(self, request: Any, peer_uid: int) -> Any:
        op = request.op
        if op == "ping":
            return {"pid": os.getpid(), "runs": len(self.records)}
        if op == "list":
            return [r.public() for r in sorted(self.records.values(), key=lambda r: (r.created, r.id))] + [
                {"id": rid, "state": "unreadable", "message": err} for rid, err in sorted(self.bad_records.items())
            ]
        if op == "targets":
            names = sorted({"local", *self.config.targets})
            return [{"name": n, "kind": self.config.target(n).kind} for n in names]
        if op == "start":
            return (await self.start(request)).public()
        if op == "stop":
            return (await self.stop(request)).public()
        if op == "cancel":
            return (await self.cancel(request)).public()
        if op == "status":
            record = self.get(request.id)
            out = record.public()
            if self.pods.is_pod(record) and record.target_info.get("pod_id") and not record.state.final:
                with anyio.move_on_after(10):
                    out["pod"] = await self.pods.describe(record)
            return out
        if op == "wait":
            record = self.get(request.id)
            if not record.state.final:
                with anyio.move_on_after(request.timeout):
                    await self.final_event(record.id).wait()
            return record.public()
        if op == "metrics":
            record = self.get(request.id)
            return {"id": record.id, "state": record.state.value, "metrics": record.metrics, "profile": record.profile}
        if op == "read":
            return await self.read(request)
        raise ApiError(f"unknown operation {op!r}", "usage")

    async def start(self, req: StartRequest) -> RunRecord:
        try:
            target_cfg = self.config.target(req.target)
        except Exception as exc:
            raise ApiError(str(exc), "usage") from exc
        for key in req.env:
            if not key or "=" in key or "\0" in key or key.startswith("OBD_"):
                raise ApiError(f"invalid environment variable name {key!r} (OBD_* names are obd's own)", "usage")
        req.secrets = target_secrets(req.target, getattr(target_cfg, "secrets", []), req.secrets, os.environ)
        source = None
        if req.resume_from:
            source = self.get(req.resume_from)
            if source.state != RunState.stopped or source.snapshot is None:
                raise ApiError(
                    f"run {source.id} is {source.state.value}, not stopped with a snapshot: "
                    "only a stopped run can be resumed",
                    "usage",
                )
        if req.cwd and not Path(req.cwd).is_dir():
            # On a local target it is where the job runs; elsewhere the directory uploaded as the job's src/.
            raise ApiError(f"--cwd {req.cwd}: no such directory on the daemon's machine", "usage")
        run_id = new_run_id()
        while run_id in self.records:
            run_id = new_run_id()
        record = RunRecord(
            id=run_id,
            name=req.name,
            target=req.target,
            command=req.command,
            cwd=req.cwd or (req.client_cwd if isinstance(target_cfg, LocalTarget) else None),
            env=req.env,
            secret_names=sorted(req.secrets),
            resumed_from=source.id if source else None,
            profile=req.profile,
            snapshot_on_sigterm=req.snapshot_on_sigterm,
        )
        record.transition(RunState.preparing, "created")
        workdir = str(target_cfg.workdir) if self.pods.is_pod(record) else self.executor_for(record).workdir
        # An SSH workdir like ~/obd is resolved on the target when the launch connects.
        if workdir.startswith("/"):
            record.remote_dir = f"{workdir.rstrip('/')}/{run_id}"
        try:
            self.save(record)
        except StoreError as exc:
            raise ApiError(str(exc)) from exc
        self.records[run_id] = record
        log.info("run_created", run_id=run_id, target=record.target, command=record.command[:1])
        assert self._tg is not None
        self._launching.add(run_id)
        self._tg.start_soon(self._launch, record, req, source)
        return record

    async def _launch(self, record: RunRecord, req: StartRequest, source: RunRecord | None) -> None:
        try:
            await self._launch_job(record, req, source)
        finally:
            self._launching.discard(record.id)

    async def _launch_job(self, record: RunRecord, req: StartRequest, source: RunRecord | None) -> None:
        try:
            with anyio.CancelScope() as preparation:
                self._preparing[record.id] = preparation
                try:
                    executor, spec = await self._prepare_launch(record, req, source)
                finally:
                    self._preparing.pop(record.id, None)
            if preparation.cancelled_caught or record.stop.cancel_by == "user":
                await self._cancelled_before_start(record)
                return
            handle = await executor.spawn(spec)
        except LaunchUncertain as exc:
            # The job may be running: stay `preparing` and let the follow look in the run's
            # directory once the target answers (adopted if it started, failed if not).
            async with self.lock(record.id):
                record.note(f"the answer to the start was lost: {exc}; obd looks on the target once it answers")
                self._save_quietly(record)
            log.warning("launch_uncertain", run_id=record.id, error=str(exc))
            self._ensure_loop(record)
            return
        except Exception as exc:  # whatever broke, the run must not stay `preparing`
            if not isinstance(exc, (ExecutorError, OSError, ApiError, TimeoutError, StoreError)):
                log.exception("launch_crashed", run_id=record.id)
            why = str(exc) or "the target did not answer in time"
            async with self.lock(record.id):
                record.transition(RunState.failed, f"launch failed: {why}")
                self._save_quietly(record)
                self.final_event(record.id).set()
            await self._end_pod_quietly(record)
            log.error("launch_failed", run_id=record.id, error=str(exc))
            if self.pods.is_pod(record) and not record.target_info.get("pod_id") and self._tg is not None:
                # The create may have made a pod after all (an ambiguous answer): look for it soon.
                self._tg.start_soon(self._reconcile_pods_soon)
            return
        async with self.lock(record.id):
            record.job = handle.model_dump()
            record.transition(RunState.running, f"started (pid {handle.pid})")
            self._save_quietly(record)
        log.info("run_started", run_id=record.id, pid=handle.pid)
        self._ensure_loop(record)
        self._watch_exit(record)
        if record.stop.cancel_by == "user":
            self._start_cancel(record)

    async def _prepare_launch(
        self, record: RunRecord, req: StartRequest, source: RunRecord | None
    ) -> tuple[Executor, JobSpec]:
        """Everything before the job starts: the pod, the run directory, the plugin, the sources."""
        if self.pods.is_pod(record):
            executor = await self.pods.prepare(record, self._pod_saver(record))
            self._executors[self.executor_key(record)] = executor
        executor = self.executor_for(record)
        if not record.remote_dir:
            with anyio.fail_after(self.config.daemon.probe_timeout * 3):
                workdir = await executor.resolve_workdir()  # type: ignore[attr-defined]
            async with self.lock(record.id):
                record.remote_dir = f"{workdir.rstrip('/')}/{record.id}"
                self._save_quietly(record)
        rd = record.remote_dir
        await self._upload_plugin(executor, rd)
        cwd = req.cwd
        if cwd is None and isinstance(executor, LocalExecutor) and req.client_cwd and Path(req.client_cwd).is_dir():
            cwd = req.client_cwd
        if cwd and not isinstance(executor, LocalExecutor):
            await executor.upload(Path(cwd), f"{rd}/src")
            cwd = f"{rd}/src"
        env = self._job_env(record, rd)
        if source is not None:
            env["OBD_RESUME_FROM"] = await self._resume_path(record, source, executor)
            record.resume_checkpoint = env["OBD_RESUME_FROM"]
        command = list(req.command)
        if req.profile:
            from runner import wrap_command

            command = wrap_command(command, f"{rd}/plugin", rd, await self._wrapper_python(executor))
            env["OBD_PROFILE_DIR"] = f"{rd}/profile"
        return executor, JobSpec(run_id=record.id, remote_dir=rd, command=command, cwd=cwd, env=env, secrets=req.secrets)

    async def _cancelled_before_start(self, record: RunRecord) -> None:
        async with self.lock(record.id):
            record.transition(RunState.cancelled, "cancelled by the user before the job started")
            self._save_quietly(record)
        log.info("run_finished", run_id=record.id, state=RunState.cancelled.value, message=record.message)
        self.final_event(record.id).set()
        await self._end_pod_quietly(record)

    def _job_env(self, record: RunRecord, rd: str) -> dict[str, str]:
        env = dict(record.env)
        env.update(
            OBD_RUN_ID=record.id,
            OBD_RUN_DIR=rd,
            OBD_OUTPUT_DIR=f"{rd}/output",
            OBD_SNAPSHOT_REQUEST=f"{rd}/snapshot.request",
            OBD_SNAPSHOT_FILE=f"{rd}/snapshot.json",
            OBD_METRICS_FILE=f"{rd}/metrics.jsonl",
        )
        if record.snapshot_on_sigterm:
            env["OBD_SNAPSHOT_ON_SIGTERM"] = "1"
        return env

    @staticmethod
    async def _wrapper_python(executor: Executor) -> str:
        """The interpreter that runs the profiling wrapper: the one the target runs jobctl with
        (the target's `python`, or this daemon's own on the local target), not whatever `python3` is."""
        if isinstance(executor, LocalExecutor):
            return executor.python
        if hasattr(executor, "python_command"):
            return await executor.python_command()
        return "python3"

    async def _resume_path(self, record: RunRecord, source: RunRecord, executor: Executor) -> str:
        assert source.snapshot is not None
        name = source.snapshot.checkpoint.split("/", 1)[1]  # validated: checkpoint-<step>
        if self.executor_key(source) == self.executor_key(record):
            return f"{source.remote_dir}/output/{name}"
        # Another target: bring the checkpoint here, then send it to the new run's directory.
        local = self.store.run_dir(source.id) / "retrieved" / "output" / name
        if not local.exists():
            await self.executor_for(source).download(f"{source.remote_dir}/output/{name}", local)
        dest = f"{record.remote_dir}/resume/{name}"
        await executor.upload(local, dest)
        return dest

    async def _upload_plugin(self, executor: Executor, remote_dir: str) -> None:
        stage = self._plugin_stage()
        await executor.upload(stage, f"{remote_dir}/plugin")

    def _plugin_stage(self) -> Path:
        """The plugin/ directory every run gets, staged once per content."""
        files: dict[str, Path] = {f"trainer_plugin/{p.name}": p for p in sorted(PLUGIN_SRC.glob("*.py"))}
        if (PLUGIN_SRC / "sitecustomize.py").exists():
            files["sitecustomize.py"] = PLUGIN_SRC / "sitecustomize.py"
        with contextlib.suppress(ImportError):
            from runner import TARGET_FILES

            files.update({p.name: Path(p) for p in TARGET_FILES})
        digest = hashlib.sha256()
        for rel, path in sorted(files.items()):
            digest.update(rel.encode() + b"\0" + path.read_bytes())
        stage = self.state_dir / "plugin-stage" / digest.hexdigest()[:16]
        if not stage.exists():
            tmp = stage.with_name(stage.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            for rel, path in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, tmp / rel)
            os.replace(tmp, stage)
        return stage

    async def stop(self, req: StopRequest) -> RunRecord:
        record = self.get(req.id)
        reason = normalise_reason(req.reason) or "requested"
        if record.state.final:
            raise ApiError(f"run {record.id} already ended ({record.state.value}): {record.message}", "state")
        if not record.snapshots:
            raise ApiError(
                f"run {record.id} cannot snapshot: its job has not announced obd's snapshot plugin "
                f"(no `begin` line with \"snapshots\": true in metrics.jsonl). "
                f"Use `obd train cancel {record.id}` to end it",
                "state",
            )
        try:
            with anyio.fail_after(self.config.daemon.probe_timeout):
                await self._request_snapshot(record, reason, "`obd train stop`")
        except (ExecutorError, TimeoutError, OSError) as exc:
            raise ApiError(
                f"could not write the snapshot request on target {record.target}: {exc or 'no answer in time'}; "
                f"retry `obd train stop {record.id}`, or `obd train cancel {record.id}`",
                "unavailable",
            ) from exc
        return record

    async def _request_snapshot(self, record: RunRecord, reason: str, by: str) -> None:
        """Write `snapshot.request` in the run directory, then record that it was asked for."""
        executor = self.executor_for(record)
        # Recorded before the file is written, so a daemon killed in between still counts the
        # fallback from the request; undone if the write fails.
        async with self.lock(record.id):
            first = record.stop.requested_at is None
            before = record.stop.model_copy()
            if first:
                record.stop.requested_at = time.time()
            record.stop.reason = reason
            self._save_quietly(record)
        try:
            await executor.put_file(f"{record.remote_dir}/snapshot.request", reason.encode() + b"\n")
        except BaseException:
            with anyio.CancelScope(shield=True):
                async with self.lock(record.id):
                    record.stop = before
                    self._save_quietly(record)
            raise
        async with self.lock(record.id):
            if first:
                record.note(f"snapshot requested ({reason}) by {by}")
            elif before.reason != reason:
                record.note(f"snapshot request reason changed to {reason}")
            self._save_quietly(record)
        log.info("snapshot_requested", run_id=record.id, reason=reason, by=by)
        self.wake(self.executor_key(record))

    async def cancel(self, req: IdRequest) -> RunRecord:
        record = self.get(req.id)
        if record.state.final:
            return record  # idempotent: a run that ended is never signalled
        async with self.lock(record.id):
            if record.stop.cancel_by is None:
                record.stop.cancel_by = "user"
                record.note("cancel requested by the user")
                self._save_quietly(record)
        log.info("cancel_requested", run_id=record.id)
        if record.state == RunState.running:
            self._start_cancel(record)
        elif record.id in self._preparing:
            self._preparing[record.id].cancel()  # the job never starts; a pod made for it is ended
        return record

    async def read(self, req: ReadRequest) -> dict:
        record = self.get(req.id)
        if not record.remote_dir or record.state == RunState.preparing and not record.job:
            return {"data": "", "offset": req.offset, "state": record.state.value}
        executor = self.executor_for(record)
        path = f"{record.remote_dir}/job.log"
        offset = req.offset
        try:
            with anyio.fail_after(self.config.daemon.probe_timeout):
                if req.tail_lines is not None:
                    offset = await self._tail_offset(executor, record, path, req.tail_lines)
                data = await executor.read_from(path, offset, req.limit)
        except (ExecutorError, TimeoutError, OSError) as exc:
            raise ApiError(f"could not read the log of run {record.id}: {exc}", "unavailable") from exc
        return {
            "data": base64.b64encode(data).decode(),
            "offset": offset,
            "next": offset + len(data),
            "state": record.state.value,
            "progress": record.progress.model_dump(),
        }

    async def _tail_offset(self, executor: Executor, record: RunRecord, path: str, lines: int) -> int:
        """The offset where the last `lines` lines of the log start (reading back in blocks)."""
        [probe] = await executor.probe([(self._handle(record), record.remote_dir)])
        end = pos = probe.log_size
        if lines == 0:
            return end
        count, block = 0, 65536
        while pos > 0:
            start = max(0, pos - block)
            chunk = await executor.read_from(path, start, pos - start)
            for i in range(len(chunk) - 1, -1, -1):
                if chunk[i] == 0x0A and start + i != end - 1:
                    count += 1
                    if count >= lines:
                        return start + i + 1
            pos = start
        return 0
