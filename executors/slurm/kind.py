"""A Slurm cluster as a kind of target (`kind = "slurm"`): a scheduler queues the jobs and ends
them on its own terms (time limits, node failures, preemption), which the daemon then explains."""

from __future__ import annotations

from pathlib import Path

from executors.base import Executor
from executors.kinds import Capability, Kind, register
from executors.slurm.config import SlurmTarget


class SlurmKind(Kind[SlurmTarget]):
    name = "slurm"
    config = SlurmTarget
    capabilities = frozenset(
        {Capability.SCHEDULES_JOBS, Capability.SHARED_MACHINE, Capability.EXEC, Capability.CARRIES_FILES}
    )
    supervision = "daemon.service.slurm:SlurmSupervision"

    def make_executor(self, name: str, target: SlurmTarget, state_dir: Path, remote_poll: float) -> Executor:
        from executors.slurm.executor import SlurmExecutor

        return SlurmExecutor(name, target)

    def gpus_counted(self, target: SlurmTarget, held: int) -> int | None:
        return None if target.gpus_per_node is None else target.gpus_per_node * target.nodes


SLURM = register(SlurmKind())
