"""What serves a target, asked of the registry of kinds (executors/kinds.py): a target's config in,
its capabilities, executor and prices out.

A machine target (this machine, an SSH host, a cluster) is served by one `Executor` for all its
runs; a pod target gives each run a machine of its own, made by its driver. Callers ask a
capability (`makes_pods`, `schedules_jobs`, `is_this_machine`, `gpu_inventory`, `pod_cost`,
`gpus_counted`, `has_price`, `run_price`) instead of switching on the kind themselves; each is a
lookup of the target's kind, never a test of its class.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from executors.base import Executor, PodCost
from executors.config import AnyTarget
from executors.kinds import Capability, kind_of, kinds
from executors.runpod.config import RunpodTarget
from executors.slurm.config import SlurmTarget

if TYPE_CHECKING:
    from executors.gpus import Gpu
    from executors.runpod import RunpodDriver
    from executors.slurm.as_user import Submitter
    from executors.slurm.executor import SlurmExecutor


def makes_pods(target: AnyTarget) -> TypeGuard[RunpodTarget]:
    """Whether the target gives each run a machine of its own (a pod) instead of sharing one."""
    return kind_of(target).has(Capability.MAKES_PODS)


def schedules_jobs(target: AnyTarget) -> TypeGuard[SlurmTarget]:
    """Whether a scheduler queues the target's jobs and ends them on its own terms (time limits,
    node failures, preemption), which the daemon then explains."""
    return kind_of(target).has(Capability.SCHEDULES_JOBS)


def is_this_machine(target: AnyTarget) -> bool:
    """Whether the target is the daemon's own machine (nothing remote to wait for; its run
    directories are files here, and its jobs start from their caller's environment)."""
    return kind_of(target).has(Capability.THIS_MACHINE)


def gpu_inventory(target: AnyTarget) -> list[Gpu]:
    """The GPUs the daemon hands out to the target's runs (this machine's, as its config gives them
    or as the vendors' tools find them: call once and keep the answer). Any other target has none
    here: its jobs see what their machine gives them."""
    return kind_of(target).gpu_inventory(target)


def pod_cost(target_info: Mapping[str, Any], at: float) -> PodCost | None:
    """The pod a run's record keeps (its `target_info`) and what it had cost at `at`; None for a
    run with no pod: on a target that makes none, or whose pod was not created (yet)."""
    kind = kinds().get(str(target_info.get("kind") or ""))
    return kind.pod_cost(target_info, at) if kind is not None else None


def gpus_counted(target: AnyTarget, held: int) -> int | None:
    """The GPUs a run counts for its GPU-hours and its price (docs/limits.md): on this machine those
    obd gave it (`held`); a pod's `gpu_count`; Slurm's `gpus_per_node` × `nodes`; an SSH host's
    `gpu_count`. None where the config does not say: obd hands out no GPUs there."""
    return kind_of(target).gpus_counted(target, held)


def has_price(target: AnyTarget) -> bool:
    """Whether a run on the target has a price `--max-cost-usd` can count: a pod's rate (its own
    machine), elsewhere the target's `price_per_gpu_hour`."""
    return kind_of(target).has_price(target)


def run_price(
    target: AnyTarget, gpus: int, target_info: Mapping[str, Any], at: float
) -> tuple[float | None, float | None]:
    """What a run costs: (US dollars an hour, dollars its own machine had cost at `at`); a pod's rate
    and spend, elsewhere `price_per_gpu_hour` × the run's GPUs; (None, None) without a price."""
    return kind_of(target).run_price(target, gpus, target_info, at)


def preemption(target: AnyTarget) -> tuple[bool, float]:
    """The target's default `preemptible` and its `min_runtime` (only this machine's runs are preempted)."""
    return kind_of(target).preemption(target)


def job_env_names(target: AnyTarget) -> list[str]:
    """Names passed from the daemon's own environment to every job of the target."""
    return kind_of(target).job_env_names(target)


def make_executor(name: str, target: AnyTarget, state_dir: Path, remote_poll: float = 3.0) -> Executor:
    """The executor of a machine target; `remote_poll` is how often the daemon polls a remote one."""
    return kind_of(target).make_executor(name, target, state_dir, remote_poll)


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
