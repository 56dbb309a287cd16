"""This machine as a kind of target (`kind = "local"`): its GPUs handed out by obd, jobs started
from their caller's environment, preemption and drain."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from executors.base import Executor
from executors.kinds import Capability, Kind, register
from executors.local_config import LocalTarget

if TYPE_CHECKING:
    from executors.gpus import Gpu


class LocalKind(Kind[LocalTarget]):
    name = "local"
    config = LocalTarget
    capabilities = frozenset(
        {
            Capability.THIS_MACHINE,
            Capability.HANDS_OUT_GPUS,
            Capability.SHARED_MACHINE,
            Capability.EXEC,
            Capability.CARRIES_FILES,
        }
    )

    def make_executor(self, name: str, target: LocalTarget, state_dir: Path, remote_poll: float) -> Executor:
        from executors.local import LocalExecutor

        workdir = Path(target.workdir or state_dir / "jobs")  # local run directories default to STATE_DIR/jobs
        return LocalExecutor(name, workdir, target.python, target.venv, facts=state_dir / "facts")

    def gpu_inventory(self, target: LocalTarget) -> list[Gpu]:
        """As the config gives them, or as the vendors' tools find them (which runs them: call once)."""
        from executors.gpus import configured, discover

        given = configured(target.gpus, target.gpu_vendor)
        return discover() if given is None else given

    def gpus_counted(self, target: LocalTarget, held: int) -> int | None:
        return held  # those obd gave the run

    def preemption(self, target: LocalTarget) -> tuple[bool, float]:
        return target.preemptible, target.min_runtime

    def job_env_names(self, target: LocalTarget) -> list[str]:
        return list(target.env)


LOCAL = register(LocalKind())
