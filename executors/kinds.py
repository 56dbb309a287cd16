"""The registry of the kinds of target: each kind is one class, registered from its own package.

A kind says what it is as data (its config model, on executors/config_base.py's `TargetBase`; its
`Capability` set) and fills a few small hooks (its executor, its GPUs, what a run there counts and
costs), typed with its own model (`Kind[ItsTarget]`). Nothing else names a kind: the factory
(executors/factory.py) and the daemon ask the registry, and executors/config.py's union of the
targets' models is built from it. Adding a kind is its package (config model, executor, `Kind`
subclass) plus one line in `KIND_MODULES`; docs/architecture.md lists what a kind implements.

The kinds' modules are light (no SDK, no SSH library at import): the registry imports them all on
its first lookup, and each imports its heavy parts only when it makes an executor.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from executors.base import Executor, ExecutorError, PodCost
from executors.config_base import TargetBase

if TYPE_CHECKING:
    from executors.gpus import Gpu

# One line per kind: the module that registers it (the registration line of a new kind). The
# order is the config union's (executors/config.py), whose errors list the kinds in it.
KIND_MODULES = (
    "executors.local_kind",
    "executors.ssh.kind",
    "executors.runpod.kind",
    "executors.slurm.kind",
    "executors.ray.kind",
)

C = TypeVar("C", bound=TargetBase)  # a kind's config model


class Capability(str, Enum):
    """What a kind of target can do or is, as the daemon asks it (never by the kind's name)."""

    THIS_MACHINE = "this_machine"  # the daemon's own machine: files here, jobs from the caller's environment
    HANDS_OUT_GPUS = "hands_out_gpus"  # obd hands out its GPUs (the GPU queue, preemption, drain)
    MAKES_PODS = "makes_pods"  # each run gets a machine of its own, made and ended by obd
    SCHEDULES_JOBS = "schedules_jobs"  # a scheduler queues its jobs and ends them on its own terms
    SHARED_MACHINE = "shared_machine"  # one executor serves every run of the target
    EXEC = "exec"  # `obd train exec/shell` where the job runs
    CARRIES_FILES = "carries_files"  # files in and out (checkpoints, sources) through the executor


class Kind(Generic[C]):
    """One kind of target: its name, config model, capabilities and hooks (defaults: a remote machine).

    A kind subclasses `Kind[ItsTarget]`, so its hooks read its model's keys typed; the defaults
    read only `TargetBase`'s."""

    name: ClassVar[str]
    config: ClassVar[type[TargetBase]]  # the pydantic model of its section in the daemon's config, `C`
    capabilities: ClassVar[frozenset[Capability]]
    # Its daemon-side supervision, "module:Class" imported on first use (None: a machine target's).
    supervision: ClassVar[str | None] = None

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities

    def make_executor(self, name: str, target: C, state_dir: Path, remote_poll: float) -> Executor:
        raise ExecutorError(
            f"target {name!r} of kind {self.name!r} has no machine of its own; each run gets one "
            "(`obd pods list` shows the pods)"
        )

    def gpu_inventory(self, target: C) -> list[Gpu]:
        """The GPUs obd hands out to the target's runs (only where it `HANDS_OUT_GPUS`)."""
        return []

    def gpus_counted(self, target: C, held: int) -> int | None:
        """The GPUs a run counts for its GPU-hours and price; None where the config does not say."""
        return None

    def run_price(
        self, target: C, gpus: int, target_info: Mapping[str, Any], at: float
    ) -> tuple[float | None, float | None]:
        """(US dollars an hour, dollars its own machine had cost at `at`); (None, None) without a price.
        By default the config's price per GPU-hour (`PricedTarget.price_per_gpu_hour`) × the run's GPUs."""
        price = target.gpu_hour_price()
        return (None, None) if price is None else (price * gpus, None)

    def has_price(self, target: C) -> bool:
        return target.gpu_hour_price() is not None

    def pod_cost(self, target_info: Mapping[str, Any], at: float) -> PodCost | None:
        """The pod a run's record keeps and what it had cost at `at` (only a kind that makes pods)."""
        return None

    def preemption(self, target: C) -> tuple[bool, float]:
        """(whether its runs are preemptible by default, the least seconds a run runs before it may be)."""
        return False, 0.0

    def job_env_names(self, target: C) -> list[str]:
        """Names passed from the daemon's own environment to every job (this machine's `env`)."""
        return []


_KINDS: dict[str, Kind[Any]] = {}
_loaded = False
K = TypeVar("K", bound="Kind[Any]")


def register(kind: K) -> K:
    """Called once by each kind's module (listed in KIND_MODULES)."""
    if kind.name in _KINDS and type(_KINDS[kind.name]) is not type(kind):
        raise RuntimeError(f"two kinds of target are named {kind.name!r}")
    _KINDS[kind.name] = kind
    return kind


def _load() -> None:
    global _loaded
    if not _loaded:
        for module in KIND_MODULES:
            importlib.import_module(module)
        _loaded = True


def kinds() -> dict[str, Kind[Any]]:
    """Every registered kind, by name."""
    _load()
    return dict(_KINDS)


def kind_named(name: str) -> Kind[Any]:
    _load()
    try:
        return _KINDS[name]
    except KeyError:
        known = ", ".join(sorted(_KINDS))
        raise ExecutorError(f"no kind of target is named {name!r}; the kinds are: {known}") from None


def kind_of(target: TargetBase) -> Kind[Any]:
    """The kind of a target's config (its `kind` key)."""
    return kind_named(target.kind)
