"""An SSH host as a kind of target (`kind = "ssh"`): one executor for every run, over one connection."""

from __future__ import annotations

from pathlib import Path

from executors.base import Executor
from executors.config import SshTarget
from executors.kinds import Capability, Kind, register


class SshKind(Kind):
    name = "ssh"
    config = SshTarget
    capabilities = frozenset({Capability.SHARED_MACHINE, Capability.EXEC, Capability.CARRIES_FILES})

    def make_executor(self, name: str, target: SshTarget, state_dir: Path, remote_poll: float) -> Executor:
        from executors.ssh.executor import SshExecutor

        # An SSH target whose helper cannot push events has every run read every `remote_poll`.
        return SshExecutor(name, target, helper=target.helper, events_poll=remote_poll)


SSH = register(SshKind())
