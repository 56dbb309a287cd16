"""What every `[targets.NAME]` section shares: durations, `StrictModel`, and `TargetBase` (the keys
every kind of target takes), on which each kind's model is built in its own package.

Each kind's model lives beside its `Kind` (executors/local_config.py, executors/ssh/config.py,
executors/slurm/config.py, executors/runpod/config.py, executors/ray/config.py); executors/config.py
is their union, built from the registry (executors/kinds.py). This module imports pydantic only,
and nothing of obd's: a kind's model imports it, and the union imports the kinds' models, with no
circle. Unknown keys are errors (a typo must not silently fall back to a default), and durations
are seconds or strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `30m`, `2h`."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '30m', '2h'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"a duration must be a finite number of seconds, not {value!r}")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"bad duration {value!r}: use a number of seconds or a string like '90s', '30m', '2h'")


def _words(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def between(lo: float, hi: float) -> AfterValidator:
    """A range check for a duration, whose error names the allowed range."""

    def check(value: float) -> float:
        if not lo <= value <= hi:
            raise ValueError(
                f"{_words(value) if math.isfinite(value) else value} is out of range: use {_words(lo)} to {_words(hi)}"
            )
        return value

    return AfterValidator(check)


HOUR, DAY = 3600.0, 86400.0
Duration = Annotated[float, BeforeValidator(parse_duration)]
# Durations with the range that makes sense for what they time (0, inf or 1e20 h never do).
Interval = Annotated[float, BeforeValidator(parse_duration), between(0.05, HOUR)]  # how often something is done
Timeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, DAY)]  # how long something may take
LongTimeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, 30 * DAY)]
Margin = Annotated[float, BeforeValidator(parse_duration), between(0, DAY)]  # ahead of, or grace before, an act


class StrictModel(BaseModel):
    """A config section: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


class TargetBase(StrictModel):
    """The keys every kind of target takes, with one meaning and one default; each kind's model
    adds `kind: Literal["NAME"]` (the union's discriminator) and its own keys.

    Where its waiting runs may go instead (docs/placement.md): a run queued on it longer than
    `overflow_after` (a run paused by a preemption or a drain included) continues on the target
    `overflow` names, once that one can start it.

    Keys only some kinds take stay in those kinds' models, so the others still refuse them as
    unknown: `price_per_gpu_hour` (on `PricedTarget`: not Runpod's, a pod has its own rate),
    `preemptible` and `min_runtime` (this machine's only: no other target's runs are preempted),
    `gpu_count`. The daemon asks a kind's hooks (executors/factory.py) for what those mean.
    """

    kind: str  # each kind's model narrows it to Literal["NAME"]
    overflow: str | None = Field(default=None, min_length=1)
    overflow_after: Margin = 600.0
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    # Names read from the daemon's environment and given to every job as secrets (never logged).
    secrets: list[str] = Field(default_factory=list)

    def gpu_hour_price(self) -> float | None:
        """What an hour of one GPU costs by this config, in US dollars; None: the config sets no
        such price (a kind priced otherwise, such as a pod's own rate, says so in its `Kind`)."""
        return None


class PricedTarget(TargetBase):
    """A kind whose runs are priced by its config, per GPU-hour: `--max-cost-usd` needs it (docs/limits.md)."""

    price_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)  # US dollars

    def gpu_hour_price(self) -> float | None:
        return self.price_per_gpu_hour


__all__ = [
    "DAY",
    "HOUR",
    "Duration",
    "Interval",
    "LongTimeout",
    "Margin",
    "PricedTarget",
    "StrictModel",
    "TargetBase",
    "Timeout",
    "between",
    "parse_duration",
]
