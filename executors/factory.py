"""The one place that knows the kinds of target: a target's config in, what serves it out.

A machine target (this machine, an SSH host) is served by one `Executor` for all its runs; a
pod target gives each run a machine of its own, made by its driver. Callers ask a capability
(`makes_pods`, `schedules_jobs`, `is_this_machine`, `gpu_inventory`, `pod_cost`, `gpus_counted`,
`has_price`, `run_price`) instead of switching on the kind themselves, and get executors and
drivers from here, never by naming a concrete class.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from executors.base import Executor, ExecutorError, PodCost
from executors.config import AnyTarget, LocalTarget, RunpodTarget, SlurmTarget, SshTarget

if TYPE_CHECKING:
    from executors.gpus import Gpu
    from executors.runpod import RunpodDriver
    from executors.slurm.as_user import Submitter
    from executors.slurm.executor import SlurmExecutor

# What a pod's record (`target_info`, executors/runpod/info.py's PodInfo) says its kind is.
POD_RECORD_KIND = "runpod"


def makes_pods(target: AnyTarget) -> TypeGuard[RunpodTarget]:
    """Whether the target gives each run a machine of its own (a pod) instead of sharing one."""
    return isinstance(target, RunpodTarget)


def schedules_jobs(target: AnyTarget) -> TypeGuard[SlurmTarget]:
    """Whether a scheduler (Slurm) queues the target's jobs and ends them on its own terms
    (time limits, node failures, preemption), which the daemon then explains."""
    return isinstance(target, SlurmTarget)


def is_this_machine(target: AnyTarget) -> bool:
    """Whether the target is the daemon's own machine (nothing remote to wait for; its run
    directories are files here, and its jobs start from their caller's environment)."""
    return isinstance(target, LocalTarget)


def gpu_inventory(target: AnyTarget) -> list[Gpu]:
    """The GPUs the daemon hands out to the target's runs: this machine's, as its config gives
    them or as the vendors' tools find them (which runs them: call once and keep the answer).
    Any other target has none here: its jobs see what their machine gives them."""
    if not isinstance(target, LocalTarget):
        return []
    from executors.gpus import configured, discover

    given = configured(target.gpus, target.gpu_vendor)
    return discover() if given is None else given


def pod_cost(target_info: Mapping[str, Any], at: float) -> PodCost | None:
    """The pod a run's record keeps (its `target_info`) and what it had cost at `at`; None for a
    run with no pod: on a target that makes none, or whose pod was not created (yet)."""
    if target_info.get("kind") != POD_RECORD_KIND:
        return None
    from executors.runpod.info import PodInfo

    info = PodInfo.from_record(dict(target_info))
    if not info.pod_id:
        return None
    return PodCost(
        pod_id=info.pod_id,
        gpu_type=info.gpu_type,
        cost_per_hr=info.cost_per_hr,
        spend_usd=info.spend(at),
        alive=not info.ended and not info.settled,
    )


def gpus_counted(target: AnyTarget, held: int) -> int | None:
    """The GPUs a run counts for its GPU-hours and its price (docs/limits.md): on this machine those
    obd gave it (`held`); a pod's `gpu_count`; Slurm's `gpus_per_node` × `nodes`; an SSH host's
    `gpu_count`. None where the config does not say (SSH without `gpu_count`, Slurm without
    `gpus_per_node`): obd hands out no GPUs there, so it cannot count them."""
    if isinstance(target, LocalTarget):
        return held
    if isinstance(target, RunpodTarget):
        return target.gpu_count
    if isinstance(target, SlurmTarget):
        return None if target.gpus_per_node is None else target.gpus_per_node * target.nodes
    return target.gpu_count


def has_price(target: AnyTarget) -> bool:
    """Whether a run on the target has a price `--max-cost-usd` can count: a pod's rate (its own
    machine), elsewhere the target's `price_per_gpu_hour`."""
    return isinstance(target, RunpodTarget) or target.price_per_gpu_hour is not None


def run_price(
    target: AnyTarget, gpus: int, target_info: Mapping[str, Any], at: float
) -> tuple[float | None, float | None]:
    """What a run costs: (US dollars an hour, dollars its own machine had cost at `at`).

    A pod's rate and its spend from its creation to its end (or `at`): the pod is billed whether or
    not the job runs. Elsewhere `price_per_gpu_hour` × the run's GPUs, and no machine of its own
    (None: the run is priced by its running time). (None, None) where there is no price (yet: a pod
    not created)."""
    if isinstance(target, RunpodTarget):
        from executors.runpod.info import PodInfo

        info = PodInfo.from_record(dict(target_info)) if target_info.get("kind") == POD_RECORD_KIND else None
        if info is None or not info.pod_id or not info.cost_per_hr:
            return None, None
        until = min(at, info.ended_at) if info.ended_at is not None else at
        return float(info.cost_per_hr), info.spend(until)
    if target.price_per_gpu_hour is None:
        return None, None
    return target.price_per_gpu_hour * gpus, None


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


def make_scheduler_executor(name: str, target: SlurmTarget, submitter: Submitter) -> SlurmExecutor:
    """The executor of a scheduler target whose commands run as `submitter` (a user's own account
    under a root daemon, so each user's runs have one of their own)."""
    from executors.slurm import SlurmExecutor

    return SlurmExecutor(name, target, submitter=submitter)
