"""What a `[targets.NAME]` section holds: one pydantic model per kind of target, and durations.

These live below the daemon so the executors that serve a target read its settings without
importing `daemon/`; `daemon/config.py` builds the whole config from them. Unknown keys are
errors (a typo must not silently fall back to a default), and durations are seconds or
strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# A Runpod network volume id: the SDK pastes it unescaped into GraphQL, so nothing else gets through.
_NETWORK_VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


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


MINUTE, HOUR, DAY = 60.0, 3600.0, 86400.0
Duration = Annotated[float, BeforeValidator(parse_duration)]
# Durations with the range that makes sense for what they time (0, inf or 1e20 h never do).
Interval = Annotated[float, BeforeValidator(parse_duration), between(0.05, HOUR)]  # how often something is done
Timeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, DAY)]  # how long something may take
LongTimeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, 30 * DAY)]
Margin = Annotated[float, BeforeValidator(parse_duration), between(0, DAY)]  # ahead of, or grace before, an act


class StrictModel(BaseModel):
    """A config section: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


class LocalTarget(StrictModel):
    kind: Literal["local"] = "local"
    workdir: Path | None = None  # default: <state_dir>/jobs
    python: str | None = None  # the interpreter that runs obd's job wrapper
    venv: str | None = None  # its bin/ leads every job's PATH
    # Names passed from the daemon's own environment to every job (the daemon's environment
    # reaches no job otherwise): plain values, and secrets (never logged).
    env: list[str] = Field(default_factory=list)
    secrets: list[str] = Field(default_factory=list)


class SshTarget(StrictModel):
    kind: Literal["ssh"]
    host: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_unknown_host: bool = False
    workdir: str = "~/obd"
    python: str = "python3"
    venv: str | None = None
    keepalive: Interval = 15.0
    connect_timeout: Timeout = 15.0
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment


class RunpodTarget(StrictModel):
    kind: Literal["runpod"]
    gpu_type: str | list[str] = "NVIDIA GeForce RTX 4090"
    gpu_count: int = Field(default=1, ge=1, le=64)
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    volume_gb: int = Field(default=50, ge=1, le=100_000)
    container_disk_gb: int = Field(default=50, ge=1, le=100_000)
    network_volume_id: str | None = None
    max_hours: float | None = Field(default=None, gt=0, le=24 * 365, allow_inf_nan=False)
    max_cost_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    disk_min_free_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    disk_max_used_pct: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    keep_pod: bool = False
    boot_grace: Timeout = 600.0
    abandon_grace: LongTimeout = 1800.0
    identity_file: Path | None = None
    ssh_user: str = "root"
    workdir: str = "/workspace/obd"
    python: str = "python3"
    secrets: list[str] = Field(default_factory=list)
    snapshot_margin: Margin = 900.0  # ask for the snapshot this long before a cap
    watchdog_interval: Interval = 30.0
    lease_ttl: Timeout = 300.0  # the daemon's lease the watchdog honours
    api_poll_interval: Interval = 5.0  # how often a booting pod is looked at

    @field_validator("network_volume_id")
    @classmethod
    def _network_volume_id_is_plain(cls, value: str | None) -> str | None:
        if value is not None and not _NETWORK_VOLUME_ID_RE.match(value):
            raise ValueError(
                f"network_volume_id {value!r} is not a Runpod network volume id: it is letters, digits, '-' and '_' "
                "only (no spaces, quotes or newlines); copy the id from the Storage page of the Runpod console"
            )
        return value

    @model_validator(mode="after")
    def _one_kind_of_volume(self) -> RunpodTarget:
        if self.network_volume_id is not None and "volume_gb" in self.model_fields_set:
            raise ValueError(
                "volume_gb and network_volume_id are both set: a pod gets either its own volume of volume_gb GB "
                "or the network volume network_volume_id, mounted at /workspace; remove one of the two keys"
            )
        return self

    def gpu_types(self) -> list[str]:
        """The GPU types to try, in the order given."""
        return [self.gpu_type] if isinstance(self.gpu_type, str) else list(self.gpu_type)


AnyTarget = LocalTarget | SshTarget | RunpodTarget
Target = Annotated[AnyTarget, Field(discriminator="kind")]

__all__ = [
    "DAY",
    "HOUR",
    "MINUTE",
    "AnyTarget",
    "Duration",
    "Interval",
    "LocalTarget",
    "LongTimeout",
    "Margin",
    "RunpodTarget",
    "SshTarget",
    "StrictModel",
    "Target",
    "Timeout",
    "parse_duration",
]
