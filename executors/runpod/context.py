"""What every part of the pod driver shares: the target, the API, the book, the owner, the clock.

The parts (lifecycle, caps, retrieval, reconcile) each hold one `PodContext`, so a change of
the target's settings (`obd pods retrieve --keep`) is seen by all of them at once. Its executor
(`PodExecutor`, executors/runpod/pod_executor.py) is the one way obd reaches a pod, and it never
carries the account's API key there; it is an SSH executor, so it and asyncssh are imported when a
pod is first reached, not when the daemon starts with a Runpod target.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from executors.base import ExecutorError
from executors.runpod.api import Pod, RunpodApi
from executors.runpod.book import PodBook, owner_id
from executors.runpod.config import RunpodTarget
from executors.runpod.info import PodInfo
from executors.ssh.config import SshTarget
from trainer_plugin.rundir import is_run_id

if TYPE_CHECKING:
    from executors.runpod.pod_executor import PodExecutor

POD_PREFIX = "obd-"
# The tags every pod obd makes carries in its env, so obd can tell its pods, and whose they are.
TAG_RUN, TAG_OWNER, TAG_TARGET, TAG_WORKDIR = "OBD_RUN_ID", "OBD_OWNER", "OBD_TARGET", "OBD_WORKDIR"

Save = Callable[[PodInfo], Awaitable[None]]


async def keep_in_book(_info: PodInfo) -> None:
    """A Save for callers whose record lives only in the driver's book (which the driver writes)."""


@dataclass
class PodContext:
    """One Runpod target as the driver's parts see it."""

    name: str
    target: RunpodTarget
    state_dir: Path
    api: RunpodApi
    ssh_user: str = "root"
    clock: Callable[[], float] = time.time
    book: PodBook = field(init=False)
    _owner: str | None = field(default=None, init=False)
    _account_key: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.state_dir = Path(self.state_dir)
        self.book = PodBook(self.state_dir)

    @property
    def owner(self) -> str:
        """This obd install's id (made on first use)."""
        if self._owner is None:
            self._owner = owner_id(self.state_dir)
        return self._owner

    def pod_name(self, run_id: str) -> str:
        if not is_run_id(run_id):
            raise ExecutorError(f"invalid run id {run_id!r} for a pod name; see `obd train list`")
        return POD_PREFIX + run_id

    def is_ours(self, pod: Pod) -> bool:
        """Made by this obd install (whichever of its targets)."""
        return pod.name.startswith(POD_PREFIX) and pod.env.get(TAG_OWNER) == self.owner

    def ssh_target(self, info: PodInfo) -> SshTarget:
        """The pod's SSH side, as an SSH target with this target's key, workdir and Python."""
        t = self.target
        if not info.ssh_host or not info.ssh_port:
            raise ExecutorError(f"pod {info.pod_id} has no public SSH port on record; it never became ready")
        return SshTarget(
            kind="ssh",
            host=info.ssh_host,
            port=int(info.ssh_port),
            user=info.ssh_user or self.ssh_user,
            identity_file=t.identity_file,
            workdir=info.workdir or t.workdir,
            python=t.python,
            secrets=list(t.secrets),
        )

    def account_key(self) -> str | None:
        """The account's API key (the one obd's API calls use), kept from the first look."""
        if self._account_key is None:
            self._account_key = self.api.account_key()
        return self._account_key

    def executor(self, info: PodInfo) -> PodExecutor:
        """An SSH executor to the pod, with its host key pinned (never known_hosts, never TOFU again),
        that never sends the account's key to it."""
        if not info.host_key:
            raise ExecutorError(f"pod {info.pod_id} has no pinned host key yet; it never became ready")
        from executors.runpod.pod_executor import PodExecutor  # asyncssh: when a pod is first reached

        return PodExecutor(
            self.name,
            self.ssh_target(info),
            host_key=info.host_key,
            pod_id=info.pod_id or "",
            account_key=self.account_key(),
        )

    def remote_dir(self, info: PodInfo, run_id: str) -> str:
        """The run directory of `run_id` on the pod: under the workdir the pod was made with."""
        return f"{(info.workdir or self.target.workdir).rstrip('/')}/{run_id}"
