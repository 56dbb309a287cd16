"""The one place that knows the kinds of target: a target's config in, what serves it out.

A machine target (this machine, an SSH host) is served by one `Executor` for all its runs; a
pod target gives each run a machine of its own, made by its driver. Callers ask `makes_pods`
instead of switching on the kind themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from executors.base import Executor, ExecutorError

if TYPE_CHECKING:
    from executors.runpod import RunpodDriver


def makes_pods(target: Any) -> bool:
    """Whether the target gives each run a machine of its own (a pod) instead of sharing one."""
    return getattr(target, "kind", None) == "runpod"


def make_executor(name: str, target: Any, state_dir: Path) -> Executor:
    """The executor of a machine target; local run directories default to STATE_DIR/jobs."""
    kind = getattr(target, "kind", None)
    if kind == "local":
        from executors.local import LocalExecutor

        return LocalExecutor(name, Path(target.workdir or state_dir / "jobs"), target.python)
    if kind == "ssh":
        from executors.ssh import SshExecutor

        return SshExecutor(name, target)
    raise ExecutorError(f"target {name!r} of kind {kind!r} has no machine of its own; each run gets one")


def make_pod_driver(name: str, target: Any, state_dir: Path) -> RunpodDriver:
    """The driver that makes, watches and ends the pods of a pod target."""
    from executors.runpod import RunpodDriver

    return RunpodDriver(
        name,
        target,
        state_dir,
        ssh_user=target.ssh_user,
        poll_interval=target.api_poll_interval,
        settle=min(2.0, target.api_poll_interval),
        cap_margin=target.snapshot_margin,
        watchdog_interval=target.watchdog_interval,
    )
