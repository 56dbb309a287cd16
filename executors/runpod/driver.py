"""`RunpodDriver`: everything obd does with the pods of one `[targets.NAME] kind = "runpod"`.

A pod is made for one run, named `obd-<run id>` and tagged in its env with the run, this obd
install (`OBD_OWNER`, a stable id kept in the state directory), the target and its workdir, so
obd can always tell its pods from anyone else's and whose they are. The job runs through the
SSH executor on the pod's public port 22, with the host key pinned on first contact. This class
is the one the daemon and `obd pods` use; the work is done by its parts: `lifecycle.py` (create,
boot, restart, end), `caps.py` (caps, lease, watchdog), `retrieve.py` (verified retrieval),
`reconcile.py` (pods and runs matched), with the book of pods in `book.py`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from executors.base import Executor, JobHandle
from executors.runpod.api import Pod, RunpodApi
from executors.runpod.book import PodBook
from executors.runpod.caps import CONTAINER_ENVIRON, PodCaps
from executors.runpod.config import RunpodTarget
from executors.runpod.context import PodContext, Save
from executors.runpod.info import PodInfo, PodObservation
from executors.runpod.lifecycle import PodLifecycle
from executors.runpod.reconcile import Finding, Reconciler
from executors.runpod.retrieve import Retrieval
from executors.ssh.config import SshTarget


class RunpodDriver:
    """Makes, watches, empties and ends the pods of one Runpod target."""

    def __init__(
        self,
        name: str,
        target: RunpodTarget,
        state_dir: Path,
        *,
        api: RunpodApi | None = None,
        ssh_user: str = "root",
        poll_interval: float = 5.0,
        cap_margin: float = 900.0,
        create_retries: int = 3,
        settle: float = 2.0,
        ssh_probe_timeout: float = 10.0,
        watchdog_interval: float = 30.0,
        describe_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
        container_environ: str = CONTAINER_ENVIRON,
    ) -> None:
        self.ctx = PodContext(name, target, Path(state_dir), api or RunpodApi(), ssh_user=ssh_user, clock=clock)
        self.lifecycle = PodLifecycle(
            self.ctx,
            poll_interval=poll_interval,
            create_retries=create_retries,
            settle=settle,
            ssh_probe_timeout=ssh_probe_timeout,
            describe_timeout=describe_timeout,
        )
        self.caps = PodCaps(
            self.ctx, cap_margin=cap_margin, watchdog_interval=watchdog_interval, container_environ=container_environ
        )
        self.retrieval = Retrieval(self.ctx, self.lifecycle)
        self.reconciler = Reconciler(self.ctx, create_window=self.lifecycle.create_window)

    # --- what it serves -------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.ctx.name

    @property
    def target(self) -> RunpodTarget:
        return self.ctx.target

    @target.setter
    def target(self, value: RunpodTarget) -> None:
        self.ctx.target = value

    @property
    def state_dir(self) -> Path:
        return self.ctx.state_dir

    @property
    def api(self) -> RunpodApi:
        return self.ctx.api

    @property
    def book(self) -> PodBook:
        return self.ctx.book

    @property
    def ssh_user(self) -> str:
        return self.ctx.ssh_user

    @property
    def owner(self) -> str:
        return self.ctx.owner

    @property
    def describe_timeout(self) -> float:
        return self.lifecycle.describe_timeout

    @describe_timeout.setter
    def describe_timeout(self, value: float) -> None:
        self.lifecycle.describe_timeout = value

    def pod_name(self, run_id: str) -> str:
        return self.ctx.pod_name(run_id)

    def is_ours(self, pod: Pod) -> bool:
        return self.ctx.is_ours(pod)

    def ssh_target(self, info: PodInfo) -> SshTarget:
        return self.ctx.ssh_target(info)

    def executor(self, info: PodInfo) -> Executor:
        """An SSH executor to the pod, with its host key pinned."""
        return self.ctx.executor(info)

    # --- a pod's life ---------------------------------------------------------------------------

    async def create(self, run_id: str, save: Save) -> PodInfo:
        return await self.lifecycle.create(run_id, save)

    async def resume(self, info: PodInfo, save: Save) -> PodInfo:
        return await self.lifecycle.resume(info, save)

    async def restart_stopped(self, info: PodInfo, save: Save) -> PodInfo:
        return await self.lifecycle.restart_stopped(info, save)

    async def pin_host_key(self, info: PodInfo) -> PodInfo:
        return await self.lifecycle.pin_host_key(info)

    async def terminate(self, pod_id: str, run_id: str | None = None) -> None:
        await self.lifecycle.terminate(pod_id, run_id)

    @property
    def create_window(self) -> float:
        """How long after a create call a pod it made may still appear."""
        return self.lifecycle.create_window

    # --- watching it ----------------------------------------------------------------------------

    async def observe(self, info: PodInfo) -> PodObservation:
        """The pod's state from the API now (never raises)."""
        return await self.lifecycle.observe(info)

    def view(self, info: PodInfo, seen: PodObservation, now: float) -> dict[str, Any]:
        """The pod for `obd train status`: state, rate and spend at `now`, from what the API last said."""
        rate = seen.cost_per_hr or info.cost_per_hr
        out: dict[str, Any] = {
            "pod_id": info.pod_id,
            "pod_name": info.pod_name,
            "gpu_type": info.gpu_type,
            "cost_per_hr": rate,
            "started_at": info.started_at,
            "max_hours": info.max_hours if info.pod_id else self.target.max_hours,
            "max_cost_usd": info.max_cost_usd if info.pod_id else self.target.max_cost_usd,
            "ssh": info.ssh_address,
            "state": seen.state,
            "seen_at": seen.at,
            "spend_usd": info.spend(now, rate) if info.pod_id else None,
        }
        if seen.uptime_s is not None:
            out["uptime_s"] = seen.uptime_s
        if seen.error:
            out["error"] = seen.error
        return out

    async def describe(self, info: PodInfo) -> dict[str, Any]:
        """The pod's state, hourly rate and spend so far, asking the API now (never raises)."""
        return self.view(info, await self.observe(info), self.ctx.clock())

    def check_caps(self, info: PodInfo, now: float) -> str | None:
        return self.caps.check_caps(info, now)

    def cap_reached(self, info: PodInfo, now: float) -> str | None:
        return self.caps.cap_reached(info, now)

    def end_by(self, info: PodInfo) -> float | None:
        """When the pod must be gone whatever its job does (its first cap + abandon_grace), if capped."""
        return self.caps.end_by(info)

    async def renew_lease(self, executor: Executor, remote_dir: str, ttl: float) -> None:
        await self.caps.renew_lease(executor, remote_dir, ttl)

    async def start_watchdog(self, executor: Executor, remote_dir: str, info: PodInfo) -> JobHandle:
        return await self.caps.start_watchdog(executor, remote_dir, info)

    # --- its end --------------------------------------------------------------------------------

    async def finish(
        self, run_id: str, remote_dir: str, info: PodInfo, local_dir: Path, *, lease_ttl: float | None = None
    ) -> tuple[bool, str]:
        """Retrieve and verify the outputs, then terminate the pod (unless keep_pod); (safe, message)."""
        return await self.retrieval.finish(run_id, remote_dir, info, local_dir, lease_ttl=lease_ttl)

    async def retrieve(self, remote_dir: str, info: PodInfo, local_dir: Path) -> tuple[int, int, list[str]]:
        """(files, bytes, paths refused as links) retrieved and verified into `local_dir`."""
        return await self.retrieval.retrieve(remote_dir, info, local_dir)

    # --- all its pods ---------------------------------------------------------------------------

    async def list_pods(self) -> list[dict[str, Any]]:
        return await self.reconciler.list_pods()

    async def reconcile(self, known: dict[str, PodInfo], *, take_untagged: bool = True) -> list[Finding]:
        return await self.reconciler.reconcile(known, take_untagged=take_untagged)
