"""An SSH host as a kind of target (`kind = "ssh"`): one executor for every run, over one connection."""

from __future__ import annotations

from pathlib import Path

from executors.base import Executor
from executors.kinds import Capability, Kind, register
from executors.ssh.config import SshTarget


class SshKind(Kind[SshTarget]):
    name = "ssh"
    config = SshTarget
    capabilities = frozenset({Capability.SHARED_MACHINE, Capability.EXEC, Capability.CARRIES_FILES})

    def make_executor(self, name: str, target: SshTarget, state_dir: Path, remote_poll: float) -> Executor:
        from executors.ssh.executor import SshExecutor

        # An SSH target whose helper cannot push events has every run read every `remote_poll`.
        return SshExecutor(name, target, helper=target.helper, events_poll=remote_poll)

    def gpus_counted(self, target: SshTarget, held: int) -> int | None:
        return target.gpu_count  # as the config says: obd hands out none there


SSH = register(SshKind())
