"""The daemon's side of Runpod targets: one pod per run, created, watched, capped, emptied, ended.

`RunpodDriver` (executors/runpod.py) knows the pods; this module decides when the daemon calls it,
so the service's follow loop stays the same for every kind of target: a pod run is followed
through an SSH executor to its pod, with a lease renewed and the caps checked on every poll.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from daemon.config import Config, RunpodTarget
from daemon.models import RunRecord
from executors.base import Executor

log = structlog.get_logger("obd.pods")
Save = Callable[[dict[str, Any]], Awaitable[None]]


class PodSupervisor:
    def __init__(self, config: Config, state_dir: Path) -> None:
        self.config = config
        self.state_dir = state_dir
        self._drivers: dict[str, Any] = {}
        self._checked: dict[str, float] = {}

    def is_pod(self, record: RunRecord) -> bool:
        try:
            return isinstance(self.config.target(record.target), RunpodTarget)
        except Exception:
            return False

    def driver(self, target_name: str) -> Any:
        if target_name not in self._drivers:
            from executors.runpod import RunpodDriver

            t = self.config.target(target_name)
            assert isinstance(t, RunpodTarget)
            self._drivers[target_name] = RunpodDriver(
                target_name,
                t,
                self.state_dir,
                ssh_user=t.ssh_user,
                poll_interval=t.api_poll_interval,
                settle=min(2.0, t.api_poll_interval),
                cap_margin=t.snapshot_margin,
                watchdog_interval=t.watchdog_interval,
            )
        return self._drivers[target_name]

    def executor(self, record: RunRecord) -> Executor:
        return self.driver(record.target).executor(record.target_info)

    def lease_ttl(self, record: RunRecord) -> float:
        t = self.config.target(record.target)
        assert isinstance(t, RunpodTarget)
        return max(t.lease_ttl, 5 * self.config.daemon.remote_poll_interval)

    async def prepare(self, record: RunRecord, save: Save) -> Executor:
        """Create the run's pod (its record saved before the create call), lease it, start its watchdog."""
        driver = self.driver(record.target)
        info = await driver.create(record.id, save)
        executor = driver.executor(info)
        workdir = await executor.resolve_workdir()  # type: ignore[attr-defined]
        remote_dir = f"{workdir.rstrip('/')}/{record.id}"
        await driver.renew_lease(executor, remote_dir, self.lease_ttl(record))
        await driver.start_watchdog(executor, remote_dir, info)
        return executor

    async def tick(self, record: RunRecord, executor: Executor) -> tuple[str | None, str | None]:
        """Renew the lease and check the caps: (reason to request a snapshot, reason to cancel now)."""
        driver = self.driver(record.target)
        await driver.renew_lease(executor, record.remote_dir, self.lease_ttl(record))
        now = time.time()
        reached = await driver.cap_reached(record.target_info, now)
        if reached:
            return reached, f"the {reached} cap of pod {record.target_info.get('pod_id')} was reached"
        return await driver.check_caps(record.target_info, now), None

    async def due_for_check(self, record: RunRecord) -> bool:
        """Whether to ask the API if the pod still exists (at most every api_poll_interval, 30 s tops)."""
        t = self.config.target(record.target)
        assert isinstance(t, RunpodTarget)
        now = time.monotonic()
        if now - self._checked.get(record.id, 0.0) < min(30.0, t.api_poll_interval):
            return False
        self._checked[record.id] = now
        return True

    async def state(self, record: RunRecord) -> str:
        """The pod's state as the API tells it: `gone`, `EXITED` (stopped), `RUNNING`, or `unknown`."""
        return str((await self.driver(record.target).describe(record.target_info)).get("state") or "unknown")

    async def restart_stopped(self, record: RunRecord, save: Save) -> dict[str, Any]:
        """Start the run's stopped pod again (its volume holds the run directory); the new target_info."""
        return await self.driver(record.target).restart_stopped(record.target_info, save)

    async def cap_reached(self, record: RunRecord) -> str | None:
        """`deadline` or `cost` once the pod's cap has passed (needs only the clock and the rate)."""
        return await self.driver(record.target).cap_reached(record.target_info, time.time())

    async def terminate(self, record: RunRecord) -> None:
        await self.driver(record.target).terminate(record.target_info["pod_id"], record.id)

    def retrieved_at(self, record: RunRecord) -> float | None:
        """When the run's outputs were retrieved and verified (the driver's book), if they were."""
        entry = self.driver(record.target).book.get(record.id) or {}
        return entry.get("retrieved")

    async def describe(self, record: RunRecord) -> dict[str, Any]:
        return await self.driver(record.target).describe(record.target_info)

    async def finish(self, record: RunRecord, local_dir: Path) -> str:
        """Retrieve and verify the outputs, then terminate the pod; the message says what happened."""
        if not record.target_info.get("pod_id"):
            return "no pod was created"
        ok, message = await self.driver(record.target).finish(record.id, record.remote_dir, record.target_info, local_dir)
        log.info("pod_finished", run_id=record.id, outputs_safe=ok, message=message)
        return message

    async def reconcile(self, target_name: str, known: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        return await self.driver(target_name).reconcile(known)

    async def resume(self, record: RunRecord, save: Save) -> dict[str, Any]:
        return await self.driver(record.target).resume(record.target_info, save)
