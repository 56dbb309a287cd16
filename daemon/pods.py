"""Pod targets as the daemon serves them: one pod per run, created, watched, capped, emptied, ended.

`RunpodDriver` (executors/runpod) knows the pods; `PodSupervision` decides when the daemon
calls it. It overrides the hooks of `daemon/targets.Supervision`, so the launch and the follow
treat a pod run like any other: it is followed through an SSH executor to its pod, with a lease
renewed and the caps checked before every probe; when its job ends, the outputs are retrieved
and verified before the pod is terminated. Everything Runpod-specific that the daemon does is
here.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import structlog

from daemon.models import RunRecord, RunState
from daemon.targets import Supervision
from executors.base import Executor, RunProbe
from executors.factory import make_pod_driver
from trainer_plugin import jobctl

if TYPE_CHECKING:
    from daemon.service import Daemon
    from executors.runpod import RunpodDriver

log = structlog.get_logger("obd.pods")
Save = Callable[[dict[str, Any]], Awaitable[None]]
SETTLED_POD_PHASES = frozenset({"terminated", "terminate_failed", "create_failed"})
POD_RECONCILE_INTERVAL = 300.0  # how often pods are matched with runs while the daemon runs


class PodSupervision(Supervision):
    """A Runpod target: each run gets a pod of its own, followed on its own."""

    def __init__(self, daemon: Daemon, name: str, config: Any) -> None:
        super().__init__(daemon, name, config)
        self.driver: RunpodDriver = make_pod_driver(name, config, daemon.state_dir)
        self._executors: dict[str, Executor] = {}
        self._checked: dict[str, float] = {}

    # --- executors -----------------------------------------------------------------------

    def executor_key(self, record: RunRecord) -> str:
        return f"{record.target}/{record.id}"  # a pod is one run's own machine

    def executor(self, record: RunRecord) -> Executor:
        if record.id not in self._executors:
            self._executors[record.id] = self.driver.executor(record.target_info)
        return self._executors[record.id]

    def workdir(self, record: RunRecord) -> str:
        return str(self.config.workdir)

    def shares_filesystem(self, record: RunRecord) -> bool:
        return False

    def lease_ttl(self) -> float:
        return max(self.config.lease_ttl, 5 * self.daemon.config.daemon.remote_poll_interval)

    async def forget(self, record: RunRecord) -> None:
        executor = self._executors.pop(record.id, None)
        if executor is not None:
            with contextlib.suppress(Exception):
                await executor.aclose()

    async def aclose(self) -> None:
        for run_id in list(self._executors):
            executor = self._executors.pop(run_id)
            with contextlib.suppress(Exception):
                await executor.aclose()

    def _saver(self, record: RunRecord) -> Save:
        async def save(info: dict[str, Any]) -> None:
            # Raises on a failed save: a pod is never created without a record of it on disk.
            async with self.daemon.lock(record.id):
                record.target_info = dict(info)
                self.daemon.save(record)

        return save

    # --- launch --------------------------------------------------------------------------

    async def prepare(self, record: RunRecord) -> Executor:
        """Create the run's pod (its record saved before the create call), lease it, start its watchdog."""
        info = await self.driver.create(record.id, self._saver(record))
        executor = self.driver.executor(info)
        self._executors[record.id] = executor
        workdir = await executor.resolve_workdir()
        remote_dir = f"{workdir.rstrip('/')}/{record.id}"
        await self.driver.renew_lease(executor, remote_dir, self.lease_ttl())
        await self.driver.start_watchdog(executor, remote_dir, info)
        return executor

    async def on_launch_failed(self, record: RunRecord) -> None:
        if not record.target_info.get("pod_id"):
            # The create may have made a pod after all (an ambiguous answer): look for it soon.
            self.daemon.start_soon(self._reconcile_soon)

    # --- the follow ----------------------------------------------------------------------

    async def ready(self, record: RunRecord) -> bool:
        """Make sure a pod run left by an earlier daemon has a ready, pinned pod; fail it if it cannot."""
        info = record.target_info
        if info.get("phase") in SETTLED_POD_PHASES:
            await self.daemon.fail(
                record, f"its pod was never ready ({info.get('phase')}: {info.get('error') or 'no detail'})"
            )
            return False
        if info.get("phase") == "ready" and info.get("host_key"):
            return True
        if not info.get("pod_id"):
            return False  # reconcile adopts it by its tag, or fails it as never created
        try:
            record.target_info = await self.driver.resume(record.target_info, self._saver(record))
            return True
        except Exception as exc:
            if record.target_info.get("phase") in SETTLED_POD_PHASES:  # `resume` ended the pod
                await self.daemon.fail(record, f"its pod never became ready: {exc}")
            else:
                log.warning("pod_resume_deferred", run_id=record.id, error=str(exc))
            return False

    async def before_poll(self, record: RunRecord, executor: Executor) -> None:
        """Renew the pod's lease; enforce its caps from this side too (snapshot, then cancel)."""
        from daemon.handlers import request_snapshot

        with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
            request, cancel = await self._tick(record, executor)
        if self._due_for_check(record) and await self._ended_outside(record):
            return
        if request and record.stop.requested_at is None and record.snapshots:
            await request_snapshot(self.daemon, record, request, "the pod's cap")
        if cancel and record.id not in self.daemon.follow.cancelling and not record.stop.fallback:
            await self.daemon.follow.fallback_cancel(record, cancel, f"cancelling: {cancel}")

    async def _tick(self, record: RunRecord, executor: Executor) -> tuple[str | None, str | None]:
        """Renew the lease and check the caps: (reason to request a snapshot, reason to cancel now)."""
        await self.driver.renew_lease(executor, record.remote_dir, self.lease_ttl())
        now = time.time()
        reached = await self.driver.cap_reached(record.target_info, now)
        if reached:
            return reached, f"the {reached} cap of pod {record.target_info.get('pod_id')} was reached"
        return await self.driver.check_caps(record.target_info, now), None

    def _due_for_check(self, record: RunRecord) -> bool:
        """Whether to ask the API if the pod still exists (at most every api_poll_interval, 30 s tops)."""
        now = time.monotonic()
        if now - self._checked.get(record.id, 0.0) < min(30.0, self.config.api_poll_interval):
            return False
        self._checked[record.id] = now
        return True

    async def on_unreachable(self, record: RunRecord) -> bool:
        return await self._ended_outside(record) or await self._cap_on_unreachable(record)

    async def _cap_on_unreachable(self, record: RunRecord) -> bool:
        """A pod past its cap that cannot be reached for a lease's time is terminated: the cap holds
        even with the pod's SSH and watchdog gone (its outputs are then lost, and the run says so)."""
        try:
            reason = await self.driver.cap_reached(record.target_info, time.time())
        except Exception:
            return False
        since = record.unreachable_since
        if not reason or since is None or time.time() - since < self.lease_ttl():
            return False
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                await self.driver.terminate(record.target_info["pod_id"], record.id)
        except Exception as exc:
            log.error("pod_cap_terminate_failed", run_id=record.id, error=str(exc))
            return False
        record.target_info["ended"] = True
        await self.daemon.fail(
            record,
            f"the {reason} cap of pod {record.target_info.get('pod_id')} passed while the pod could not be reached; "
            "the pod was terminated and the outputs on it are lost",
        )
        log.error("pod_cap_terminated_unreachable", run_id=record.id, reason=reason)
        return True

    async def _ended_outside(self, record: RunRecord) -> bool:
        """Whether the run's pod was terminated or stopped outside obd (the run is failed, or its
        stopped pod started again to recover its outputs), rather than merely slow to answer."""
        if record.id in self.daemon.follow.finishing:
            return False  # its finish retrieves the outputs and then ends the pod itself
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                described = await self.driver.describe(record.target_info)
        except Exception:
            return False
        state = str(described.get("state") or "unknown")
        if state == "EXITED":
            await self._restart_stopped(record)
            return True
        if state != "gone":
            return False
        why = f"pod {record.target_info.get('pod_id')} no longer exists (terminated outside obd, or reclaimed)"
        if await self.daemon.fail(record, why):
            log.error("pod_gone", run_id=record.id, reason=why)
        return True

    async def _restart_stopped(self, record: RunRecord) -> None:
        """A pod stopped outside obd ended its job, but its volume holds the run directory: start it
        again so the follow finds the job ended and retrieves the outputs, then ends the pod."""
        pod_id = record.target_info.get("pod_id")
        async with self.daemon.editing(record):
            if record.state.final:
                return
            if not record.target_info.get("stopped_outside"):
                record.target_info["stopped_outside"] = time.time()
                record.note(
                    f"pod {pod_id} was stopped outside obd (EXITED), which ended its job; "
                    "starting it again to recover the outputs on its volume"
                )
        await self.forget(record)
        grace = float(self.config.boot_grace)
        try:
            with anyio.fail_after(grace + 4 * self.daemon.config.daemon.probe_timeout):
                await self.driver.restart_stopped(record.target_info, self._saver(record))
        except Exception as exc:
            log.error("pod_restart_failed", run_id=record.id, pod_id=pod_id, error=str(exc))
            await self.daemon.fail(
                record,
                f"pod {pod_id} was stopped outside obd (EXITED), which ended the job, and could not be started "
                f"again to copy the outputs on its volume: {exc}. obd tries again every few minutes and ends "
                f"the pod once its outputs are in the run's directory; `obd pods rm {pod_id}` removes it now, "
                "outputs and all",
            )
            return
        async with self.daemon.editing(record):
            record.note(f"pod {pod_id} started again; its job ended with the stop")

    def explain_lost(self, record: RunRecord, message: str) -> str:
        if record.target_info.get("stopped_outside"):
            return (
                f"pod {record.target_info.get('pod_id')} was stopped outside obd (EXITED), which killed the job; "
                + message
            )
        return message

    async def describe(self, record: RunRecord) -> dict[str, Any]:
        if not record.target_info.get("pod_id"):
            return {}
        return {"pod": await self.driver.describe(record.target_info)}

    # --- the end -------------------------------------------------------------------------

    def _retrieved_at(self, record: RunRecord) -> float | None:
        """When the run's outputs were retrieved and verified (the driver's book), if they were."""
        entry = self.driver.book.get(record.id) or {}
        retrieved = entry.get("retrieved")
        return float(retrieved) if isinstance(retrieved, (int, float)) else None

    async def on_end(self, record: RunRecord) -> str:
        """Retrieve a pod run's outputs and terminate its pod, once; the message says how it went."""
        if not record.target_info.get("pod_id") or record.target_info.get("ended"):
            return ""
        local = self.daemon.store.run_dir(record.id) / "retrieved"
        try:
            if self._retrieved_at(record):
                with contextlib.suppress(Exception):
                    await self.driver.terminate(record.target_info["pod_id"], record.id)
                message = f"outputs retrieved and verified into {local}; pod {record.target_info['pod_id']} ended"
            else:
                ok, message = await self.driver.finish(record.id, record.remote_dir, record.target_info, local)
                log.info("pod_finished", run_id=record.id, outputs_safe=ok, message=message)
        except Exception as exc:  # the record's final state must not wait on the pod
            message = f"the pod could not be emptied and ended: {exc} (see `obd pods list`)"
        record.target_info["ended"] = True
        await self.forget(record)
        return message

    # --- reconcile -----------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Match the pods obd created with the runs; fail runs whose pod is gone, empty orphan pods."""
        launching = self.daemon.launcher.launching
        live = {
            r.id: r.target_info
            for r in self.daemon.records.values()
            if r.target == self.name and r.state in (RunState.preparing, RunState.running) and r.id not in launching
        }
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout * 3):
                findings = await self.driver.reconcile(live)
        except Exception as exc:  # the API is down: decide nothing now, the follow retries
            log.warning("pod_reconcile_deferred", target=self.name, error=str(exc))
            return
        for item in findings:
            await self._apply_finding(item)

    async def _reconcile_soon(self, delay: float = 20.0) -> None:
        await anyio.sleep(delay)
        try:
            await self.reconcile()
        except Exception:
            log.exception("pod_reconcile_failed", target=self.name)

    async def periodically(self) -> None:
        """Match pods with runs now and then: a pod whose create looked failed is found and ended."""
        while True:
            await anyio.sleep(POD_RECONCILE_INTERVAL)
            try:
                await self.reconcile()
            except Exception:
                log.exception("pod_reconcile_failed", target=self.name)

    async def _apply_finding(self, item: dict[str, Any]) -> None:
        daemon = self.daemon
        record = daemon.records.get(item.get("run_id") or "")
        kind = item["kind"]
        if record is not None and record.id in daemon.launcher.launching:
            return  # its launch is under way and decides
        if kind == "orphan" and record is not None and not record.state.final:
            return  # a live run's pod, not yet in its record
        if kind == "gone" and record is not None and record.state == RunState.running and self._retrieved_at(record):
            # Its outputs were retrieved and verified before the pod went: finish from the local copy.
            local = daemon.store.run_dir(record.id) / "retrieved"
            raw = await anyio.to_thread.run_sync(jobctl.probe_dir, str(local), None)
            await daemon.follow.apply(record, RunProbe.model_validate(raw))
            return
        if kind == "orphan":
            log.warning("pod_orphan", pod_id=item["pod_id"], run_id=item.get("run_id"))
            daemon.start_soon(self._empty_orphan, item)
            return
        if record is None:
            return
        if kind in ("gone", "not_created"):
            await daemon.fail(record, item["reason"])
        elif kind == "adopted":
            async with daemon.editing(record):
                record.target_info = item["target_info"]
                record.note(f"pod {item['pod_id']} found by its tag and adopted")

    async def _empty_orphan(self, item: dict[str, Any]) -> None:
        """A pod obd created that no run knows: wait for its SSH, retrieve its outputs, terminate it.

        A pod that never answers within its boot grace is terminated by `resume`, and a stopped one
        is started again; one whose retrieval fails is left up and reported (its outputs come first).
        """
        daemon = self.daemon
        info = item["target_info"]
        owner = info.get("target") or self.name
        driver = self.driver
        if owner != self.name and owner in daemon.config.targets:
            supervision = daemon.targets.get(owner)
            driver = supervision.driver if isinstance(supervision, PodSupervision) else driver
        run_id = item.get("run_id") or f"orphan-{item['pod_id']}"

        async def keep(_info: dict[str, Any]) -> None:
            return None

        record = daemon.records.get(run_id)
        try:
            info = await driver.resume(info, keep)
            # A run that ended without its outputs (its pod was stopped, say) gets them in its own directory.
            if record:
                local = daemon.store.run_dir(run_id) / "retrieved"
            else:
                local = daemon.state_dir / "orphans" / str(item["pod_id"])
            ok, message = await driver.finish(run_id, item.get("remote_dir") or "", info, local)
        except Exception as exc:
            ok, message = False, str(exc)
        log.warning(
            "pod_orphan_finished", run_id=item.get("run_id"), pod_id=item["pod_id"], outputs_safe=ok, message=message
        )
        if record is not None:
            async with daemon.editing(record):
                record.note(f"after the run ended, its pod {item['pod_id']}: {message}")
