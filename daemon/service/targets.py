"""How the daemon serves each target: its executor, and the hooks a kind of target needs around a run.

A machine target (this machine, an SSH host) needs none of the hooks: one executor serves all
its runs. A pod target (daemon/service/pods.py) overrides them to make, watch and end a machine per
run. The launch and the follow call the hooks of every run's target the same way, so they
hold no code for any one kind; which class serves a target is decided once, here, by asking
the executor factory whether the target makes pods.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

from daemon.service.api import ApiError
from daemon.service.config import ConfigError
from daemon.service.models import RunRecord
from daemon.service.ports import Runs
from executors.base import Executor, ExecutorError
from executors.factory import is_this_machine, make_executor
from executors.kinds import kind_of


class Supervision:
    """One target as the daemon sees it: a single executor for every run, and no-op hooks."""

    # Whether its runs are read at every poll even when the target reports events (a pod's
    # lease is renewed and its caps checked with each read).
    reads_every_poll = False
    # Whether, with events, an event reads only the runs it was about while every run is still read
    # at each poll interval (a scheduler's queue moves without writing in run directories).
    sweeps_every_poll = False

    def __init__(self, daemon: Runs, name: str, config: Any) -> None:
        self.daemon = daemon
        self.name = name
        self.config = config
        self._executor: Executor | None = None

    # --- executors -----------------------------------------------------------------------

    def executor_key(self, record: RunRecord) -> str:
        """Runs with the same key share an executor and one follow loop (one probe per poll)."""
        return self.name

    def executor(self, record: RunRecord) -> Executor:
        if self._executor is None:
            try:
                self._executor = make_executor(
                    self.name, self.config, self.daemon.state_dir, self.daemon.config.daemon.remote_poll_interval
                )
            except ExecutorError as exc:
                raise ApiError(str(exc), "usage") from exc
        return self._executor

    def workdir(self, record: RunRecord) -> str:
        """The workdir as configured; a run directory is `<workdir>/<run id>` once it is absolute."""
        return self.executor(record).workdir

    def shares_filesystem(self, record: RunRecord) -> bool:
        """Whether the run's machine sees the daemon's files (a --cwd is then used where it is)."""
        return self.executor(record).shares_filesystem

    def answers_at_once(self) -> bool:
        """Whether the target is this machine, whose runs are reconciled before the daemon
        answers; any other (a host, a cluster, a cloud API) is reconciled in the background,
        so nothing remote can hold up the socket."""
        return is_this_machine(self.config)

    def poll_interval(self, record: RunRecord) -> float:
        d = self.daemon.config.daemon
        if self.shares_filesystem(record):
            return d.poll_interval
        return min(d.remote_poll_interval, self.daemon.config.stop.request_poll)

    async def forget(self, record: RunRecord) -> None:
        """Let go of what served this run alone (nothing, on a machine target)."""

    async def aclose(self) -> None:
        if self._executor is not None:
            with contextlib.suppress(Exception):
                await self._executor.aclose()

    # --- hooks around a run's life ----------------------------------------------------------

    async def prepare(self, record: RunRecord) -> Executor:
        """Whatever must exist before the run directory can be made; the run's executor."""
        return self.executor(record)

    async def ready(self, record: RunRecord) -> bool:
        """Whether a run left by an earlier daemon can be probed now (its machine is there)."""
        return True

    async def before_poll(self, record: RunRecord, executor: Executor) -> None:
        """Called before each probe of a run (a pod renews its lease and checks its caps here)."""

    async def on_unreachable(self, record: RunRecord) -> bool:
        """The target did not answer a probe: True when this hook settled the run's fate."""
        return False

    def outputs_lost(self, record: RunRecord) -> str | None:
        """Why an ended run's outputs are nowhere any more (a pod that ended before they were
        retrieved), or None where the target may still have them (a machine target always may)."""
        return None

    def explain_lost(self, record: RunRecord, message: str) -> str:
        """The message of a run whose job was lost, with what the target knows of why."""
        return message

    async def on_end(self, record: RunRecord) -> str:
        """After the job ended: bring back what must be brought back, end what must be ended.

        Returns a message for the record (empty when there is nothing to say)."""
        return ""

    async def on_launch_failed(self, record: RunRecord) -> None:
        """A launch failed after the record was made: clean up what the launch made."""

    async def describe(self, record: RunRecord) -> dict[str, Any]:
        """Live facts for `status` beyond the record (a pod's state and spend)."""
        return {}

    async def reconcile(self) -> None:
        """At start, before runs are re-attached: match what the target holds with the records."""

    async def periodically(self) -> None:
        """A task the daemon runs for the target's lifetime (none for a machine target)."""


class Targets:
    """The supervision of every target, made on first use from the config."""

    def __init__(self, daemon: Runs) -> None:
        self.daemon = daemon
        self._by_name: dict[str, Supervision] = {}

    def get(self, name: str) -> Supervision:
        if name not in self._by_name:
            try:
                config = self.daemon.config.target(name)
            except ConfigError as exc:
                raise ApiError(str(exc), "usage") from exc
            self._by_name[name] = self._make(name, config)
        return self._by_name[name]

    def _make(self, name: str, config: Any) -> Supervision:
        """The kind's own supervision (pods, a scheduler: named by its Kind, imported on first use), else a machine's."""
        spec = kind_of(config).supervision
        if spec is None:
            return Supervision(self.daemon, name, config)
        module, _, cls = spec.partition(":")
        made: Supervision = getattr(importlib.import_module(module), cls)(self.daemon, name, config)
        return made

    def of(self, record: RunRecord) -> Supervision:
        return self.get(record.target)

    def configured(self) -> list[Supervision]:
        """Every target in the config (and `local`), so each can reconcile at start."""
        names = sorted({"local", *self.daemon.config.targets})
        return [self.get(n) for n in names]

    def executor(self, record: RunRecord) -> Executor:
        return self.of(record).executor(record)

    def key(self, record: RunRecord) -> str:
        try:
            return self.of(record).executor_key(record)
        except ApiError:  # a target removed from the config: its runs are reported, not followed
            return record.target

    async def aclose(self) -> None:
        for supervision in self._by_name.values():
            await supervision.aclose()
