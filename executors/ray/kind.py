"""A Ray cluster as a kind of target (`kind = "ray"`): each run is one Ray job, submitted, read and
stopped through the cluster's Jobs API; its run directory is on a filesystem the daemon and the Ray
nodes share (docs/ray.md)."""

from __future__ import annotations

from pathlib import Path

from executors.base import Executor
from executors.kinds import Capability, Kind, register
from executors.ray.config import RayTarget


class RayKind(Kind[RayTarget]):
    name = "ray"
    config = RayTarget
    # No EXEC: Ray's Jobs API has no way into a running job (`obd train exec` says so; docs/ray.md).
    capabilities = frozenset({Capability.SHARED_MACHINE, Capability.CARRIES_FILES})

    def make_executor(self, name: str, target: RayTarget, state_dir: Path, remote_poll: float) -> Executor:
        from executors.ray.executor import RayExecutor

        return RayExecutor(name, target)

    def gpus_counted(self, target: RayTarget, held: int) -> int | None:
        return target.gpu_count  # its num_gpus, rounded up


RAY = register(RayKind())
