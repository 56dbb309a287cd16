"""The one place that knows the kinds of target: a target's config in, what serves it out.

A machine target (this machine, an SSH host) is served by one `Executor` for all its runs; a
pod target gives each run a machine of its own, made by its driver. Callers ask `makes_pods`
instead of switching on the kind themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeGuard

from executors.base import Executor, ExecutorError
from executors.config import AnyTarget, LocalTarget, RunpodTarget, SlurmTarget, SshTarget

if TYPE_CHECKING:
    from executors.runpod import RunpodDriver


def makes_pods(target: AnyTarget) -> TypeGuard[RunpodTarget]:
    """Whether the target gives each run a machine of its own (a pod) instead of sharing one."""
    return isinstance(target, RunpodTarget)


def schedules_jobs(target: AnyTarget) -> TypeGuard[SlurmTarget]:
    """Whether a scheduler (Slurm) queues the target's jobs and ends them on its own terms
    (time limits, node failures, preemption), which the daemon then explains."""
    return isinstance(target, SlurmTarget)


def is_this_machine(target: AnyTarget) -> bool:
    """Whether the target is the daemon's own machine (nothing remote to wait for)."""
    return isinstance(target, LocalTarget)


def make_executor(name: str, target: AnyTarget, state_dir: Path, remote_poll: float = 3.0) -> Executor:
    """The executor of a machine target; local run directories default to STATE_DIR/jobs.

    `remote_poll` is how often the daemon polls a remote target: an SSH target whose helper
    cannot push events has every run read that often.
    """
    if isinstance(target, LocalTarget):
        from executors.local import LocalExecutor

        return LocalExecutor(
            name, Path(target.workdir or state_dir / "jobs"), target.python, target.venv, facts=state_dir / "facts"
        )
    if isinstance(target, SshTarget):
        from executors.ssh import SshExecutor

        return SshExecutor(name, target, helper=target.helper, events_poll=remote_poll)
    if isinstance(target, SlurmTarget):
        from executors.slurm import SlurmExecutor

        return SlurmExecutor(name, target)
    raise ExecutorError(
        f"target {name!r} of kind {target.kind!r} has no machine of its own; each run gets one "
        "(`obd pods list` shows the pods)"
    )


def make_pod_driver(name: str, target: RunpodTarget, state_dir: Path) -> RunpodDriver:
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
