"""A pod's caps (`max_hours`, `max_cost_usd`) from the daemon's side, its lease, and its watchdog.

The caps are enforced from both sides: the watchdog on the pod writes a snapshot request ahead of
a cap and deletes a pod that is abandoned; the daemon renews a lease the watchdog honours and
checks the same caps on every poll, so a cap holds with either side gone. Only the daemon's side
holds against a hostile job (root in the pod's container, it can kill or fake the watchdog and
its lease): the daemon never lets a pod outlive its first cap by more than `abandon_grace`
(`end_by`), ending it through the API, which nothing on the pod can touch.

The watchdog gets no credential from obd: the account's key never goes to the pod, where the job
could read it. It ends its own pod with the key Runpod puts in every pod's environment, scoped to
that pod (`trainer_plugin/tools/watchdog.py`, "Credentials").
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import structlog

from executors.base import Executor, JobHandle, JobSpec
from executors.runpod.context import PodContext
from executors.runpod.info import PodInfo
from trainer_plugin import rundir
from trainer_plugin.tools import contain, jobctl

log = structlog.get_logger("obd.runpod")
# The watchdog and the tools it imports, put into the run's copy of the package on the pod
# (`plugin/trainer_plugin/tools/`), with the contract they import in the folder above.
# (watchdog.py is read, never imported, here: the daemon needs none of its code.)
WATCHDOG_FILES: tuple[Path, ...] = (
    Path(jobctl.__file__),
    Path(contain.__file__),
    Path(jobctl.__file__).with_name("watchdog.py"),
)
CONTRACT_FILE = Path(rundir.__file__)
# Where the watchdog reads the pod's own environment (and in it the pod-scoped RUNPOD_API_KEY Runpod
# gives every pod): the container's first process, which Runpod started with it. `{pod_id}` in it
# is the pod's id (the tests' fake API keeps one file per pod).
CONTAINER_ENVIRON = "/proc/1/environ"


def snapshot_margin(margin: float, span: float) -> float:
    """How long ahead of a cap to ask for the snapshot: `margin`, at most a quarter of the span."""
    return max(0.0, min(margin, span / 4.0))


def lease_bytes(now: float, ttl: float) -> bytes:
    """The content of `<remote_dir>/lease`: the unix time until which the daemon is in charge."""
    return f"{now + ttl:.3f}\n".encode()


class PodCaps:
    """The caps as the daemon checks them, the lease it renews, and the watchdog it starts."""

    def __init__(
        self,
        ctx: PodContext,
        *,
        cap_margin: float = 900.0,
        watchdog_interval: float = 30.0,
        container_environ: str = CONTAINER_ENVIRON,
    ) -> None:
        self.ctx = ctx
        self.cap_margin = cap_margin
        self.watchdog_interval = watchdog_interval
        self.container_environ = container_environ

    def cap_points(self, info: PodInfo) -> dict[str, float]:
        """Unix times at which each cap is reached, for the caps that apply."""
        points: dict[str, float] = {}
        if info.started_at is None:
            return points
        started = float(info.started_at)
        if info.max_hours is not None:
            points[rundir.DEADLINE] = started + float(info.max_hours) * 3600.0
        if info.max_cost_usd is not None and info.cost_per_hr:
            points[rundir.COST] = started + float(info.max_cost_usd) / float(info.cost_per_hr) * 3600.0
        return points

    def check_caps(self, info: PodInfo, now: float) -> str | None:
        """`deadline` or `cost` once that cap is less than the snapshot margin away, else None.

        The margin is `cap_margin`, but never more than a quarter of the way from the pod's start
        to the cap, so a short cap does not ask for a snapshot at once.
        """
        started = float(info.started_at or 0)
        for reason, at in sorted(self.cap_points(info).items(), key=lambda kv: kv[1]):
            if now >= at - snapshot_margin(self.cap_margin, at - started):
                return reason
        return None

    def cap_reached(self, info: PodInfo, now: float) -> str | None:
        """`deadline` or `cost` once the cap itself is passed (the job must stop now), else None."""
        for reason, at in sorted(self.cap_points(info).items(), key=lambda kv: kv[1]):
            if now >= at:
                return reason
        return None

    def end_by(self, info: PodInfo) -> float | None:
        """Unix time by which the pod must be gone whatever its job does: its first cap plus
        `abandon_grace` (the time to stop the job and bring its outputs home); None without a cap."""
        points = self.cap_points(info)
        if not points:
            return None
        return min(points.values()) + float(self.ctx.target.abandon_grace)

    async def renew_lease(self, executor: Executor, remote_dir: str, ttl: float) -> None:
        """Tell the watchdog the daemon is in charge for the next `ttl` seconds."""
        await executor.put_file(rundir.RunPaths(remote_dir).lease, lease_bytes(self.ctx.clock(), ttl))

    def watchdog_config(self, remote_dir: str, info: PodInfo) -> dict[str, Any]:
        """The settings written to `<remote_dir>/watchdog.json`: no secret in it, nor anywhere else
        the watchdog gets from obd."""
        t = self.ctx.target
        return {
            "run_dir": remote_dir,
            "pod_id": info.pod_id,
            "started_at": info.started_at,
            "cost_per_hr": info.cost_per_hr,
            "max_hours": t.max_hours,
            "max_cost_usd": t.max_cost_usd,
            "disk_path": remote_dir,
            "disk_min_free_gb": t.disk_min_free_gb,
            "disk_max_used_pct": t.disk_max_used_pct,
            "boot_grace": t.boot_grace,
            "abandon_grace": t.abandon_grace,
            "snapshot_margin": self.cap_margin,
            "interval": self.watchdog_interval,
            "api_base_url": os.environ.get("RUNPOD_API_BASE_URL"),
            "container_environ": self.container_environ.replace("{pod_id}", info.pod_id or ""),
        }

    def watchdog_command(self, remote_dir: str) -> list[str]:
        """argv of the watchdog on the pod (no secret: it is given none)."""
        paths = rundir.RunPaths(remote_dir)
        return [self.ctx.target.python, paths.tool("watchdog.py"), "run", "--config", paths.watchdog_config]

    async def install_tools(self, executor: Executor, remote_dir: str) -> None:
        """Put the watchdog (and what it imports) into the run's plugin dir, idempotently."""
        paths = rundir.RunPaths(remote_dir)
        await executor.put_file(paths.package_file(CONTRACT_FILE.name), CONTRACT_FILE.read_bytes())
        for path in WATCHDOG_FILES:
            await executor.put_file(paths.tool(path.name), path.read_bytes())

    async def start_watchdog(self, executor: Executor, remote_dir: str, info: PodInfo) -> JobHandle:
        """Write the watchdog's config and start it detached (jobctl: setsid), with no secret: the
        account's key stays with the daemon (see the module's docstring)."""
        await self.install_tools(executor, remote_dir)
        config = self.watchdog_config(remote_dir, info)
        paths = rundir.RunPaths(remote_dir)
        await executor.put_file(paths.watchdog_config, json.dumps(config, indent=1).encode())
        env = {"RUNPOD_API_BASE_URL": config["api_base_url"]} if config["api_base_url"] else {}
        job = JobSpec(
            run_id=f"{info.run_id or 'run'}-watchdog",
            remote_dir=paths.watchdog_job,
            command=self.watchdog_command(remote_dir),
            cwd=remote_dir,
            env=env,
        )
        handle = await executor.spawn(job)
        log.info(
            "runpod.watchdog_started",
            run_id=info.run_id,
            pod_id=info.pod_id,
            remote_dir=remote_dir,
            pid=handle.pid,
        )
        return handle
