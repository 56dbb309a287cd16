"""What the service's parts may ask of the daemon, as narrow protocols.

`daemon/service/daemon.py` makes the `Daemon` and hands it to each part (launch, follow, the queue,
recovery, the targets, the handlers, the observers); no part imports the module that builds it.
Each part says in a protocol of its own, built on `Runs`, the little it uses beyond the records
(the follow: the targets and the runs being launched; the queue: the inventory and the
launcher; ...), typed with the classes of the parts below it, or with a protocol here for a
part above it, so the parts import each other in one direction only.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol

import anyio

from daemon.service.config import Config
from daemon.service.models import RunRecord
from daemon.service.records import Records
from daemon.service.store import RunStore


class Runs(Protocol):
    """The daemon as every part sees it: its configuration, its records and the one way to change
    one (`editing`: under the run's lock, saved, watchers told), and its task group."""

    config: Config
    state_dir: Path
    store: RunStore
    records: Records

    def lock(self, run_id: str) -> anyio.Lock: ...

    def editing(self, record: RunRecord) -> AbstractAsyncContextManager[RunRecord]: ...

    def save(self, record: RunRecord) -> None: ...

    def save_quietly(self, record: RunRecord) -> None: ...

    def touch(self, record: RunRecord) -> None: ...

    async def fail(self, record: RunRecord, why: str) -> bool: ...

    def start_soon(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None: ...

    @property
    def started(self) -> bool:
        """Whether the daemon's task group runs (`start_soon` starts nothing before)."""
        ...


class Launching(Protocol):
    """The launcher as a part below it sees it: which runs it is launching right now."""

    launching: set[str]


class Wakes(Protocol):
    """The follow as a stop request sees it: woken to read a run at once."""

    def wake_run(self, record: RunRecord) -> None: ...


class FollowActions(Protocol):
    """The follow as a kind of target sees it (a pod's caps, its reconcile)."""

    cancelling: set[str]
    finishing: set[str]

    async def apply(self, record: RunRecord, probe: Any) -> None: ...

    async def fallback_cancel(self, record: RunRecord, why: str, note: str) -> None: ...

    def wake_run(self, record: RunRecord) -> None: ...
