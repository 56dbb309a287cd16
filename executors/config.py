"""What a `[targets.NAME]` section holds: the union of the kinds' config models, built from the
registry (executors/kinds.py), and the shared parts (executors/config_base.py) re-exported.

Each kind's model lives in its own package, on `TargetBase` (executors/config_base.py); a new
kind adds nothing here: `AnyTarget` and `Target` are the models of the kinds `KIND_MODULES`
registers, in its order, so its package and its registration line are all a new kind needs.
The five kinds' models are re-exported below for the modules that import them from here (the
daemon's config and its tests); a new kind's model is imported from its own package.

Type checkers see `AnyTarget` as `TargetBase` (a union built at run time is no type to them): the
daemon reads the keys every kind takes through it, and what only some kinds have through a
kind's hooks (executors/factory.py) or after a capability's `TypeGuard` (`makes_pods`,
`schedules_jobs`). tests/executors/test_kinds.py checks the union holds the registry's kinds.
These modules import pydantic only (the registry's kinds import nothing heavy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, Union

from pydantic import Field

from executors.config_base import (
    DAY,
    HOUR,
    Duration,
    Interval,
    LongTimeout,
    Margin,
    PricedTarget,
    StrictModel,
    TargetBase,
    Timeout,
    parse_duration,
)
from executors.kinds import kinds

# Re-exported for the modules that import them from here (not needed for a new kind).
from executors.local_config import LocalTarget
from executors.ray.config import RayTarget
from executors.runpod.config import RunpodTarget
from executors.slurm.config import SlurmLogin, SlurmTarget, slurm_time_seconds
from executors.ssh.config import SshTarget


def target_models() -> tuple[type[TargetBase], ...]:
    """The config model of every registered kind, in `KIND_MODULES`' order."""
    return tuple(kind.config for kind in kinds().values())


def target_union() -> Any:
    """The union of the registered kinds' models (pydantic tells them apart by `kind`)."""
    models = target_models()
    return Union[models] if len(models) > 1 else models[0]  # noqa: UP007 (a union of a tuple built at run time)


if TYPE_CHECKING:
    AnyTarget: TypeAlias = TargetBase
else:
    AnyTarget = target_union()
Target = Annotated[AnyTarget, Field(discriminator="kind")]

__all__ = [
    "DAY",
    "HOUR",
    "AnyTarget",
    "Duration",
    "Interval",
    "LocalTarget",
    "LongTimeout",
    "Margin",
    "PricedTarget",
    "RayTarget",
    "RunpodTarget",
    "SlurmLogin",
    "SlurmTarget",
    "SshTarget",
    "StrictModel",
    "Target",
    "TargetBase",
    "Timeout",
    "parse_duration",
    "slurm_time_seconds",
    "target_models",
    "target_union",
]
