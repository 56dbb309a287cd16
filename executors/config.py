"""What a `[targets.NAME]` section holds: one pydantic model per kind of target, and durations.

These live below the daemon so the executors that serve a target read its settings without
importing `daemon/`; `daemon/config.py` builds the whole config from them. Unknown keys are
errors (a typo must not silently fall back to a default), and durations are seconds or
strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# A Runpod network volume id: the SDK pastes it unescaped into GraphQL, so nothing else gets through.
_NETWORK_VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `30m`, `2h`."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '30m', '2h'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"bad duration {value!r}: use a number of seconds or a string like '90s', '30m', '2h'")


Duration = Annotated[float, BeforeValidator(parse_duration)]


class StrictModel(BaseModel):
    """A config section: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


class LocalTarget(StrictModel):
    kind: Literal["local"] = "local"
    workdir: Path | None = None  # default: <state_dir>/jobs
    python: str | None = None  # the interpreter that runs obd's job wrapper


class SshTarget(StrictModel):
    kind: Literal["ssh"]
    host: str
    port: int = 22
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_unknown_host: bool = False
    workdir: str = "~/obd"
    python: str = "python3"
    venv: str | None = None
    keepalive: Duration = 15.0
    connect_timeout: Duration = 15.0
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment


class RunpodTarget(StrictModel):
    kind: Literal["runpod"]
    gpu_type: str | list[str] = "NVIDIA GeForce RTX 4090"
    gpu_count: int = 1
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    volume_gb: int = 50
    container_disk_gb: int = 50
    network_volume_id: str | None = None
    max_hours: float | None = None
    max_cost_usd: float | None = None
    disk_min_free_gb: float | None = None
    disk_max_used_pct: float | None = None
    keep_pod: bool = False
    boot_grace: Duration = 600.0
    abandon_grace: Duration = 1800.0
    identity_file: Path | None = None
    ssh_user: str = "root"
    workdir: str = "/workspace/obd"
    python: str = "python3"
    secrets: list[str] = Field(default_factory=list)
    snapshot_margin: Duration = 900.0  # ask for the snapshot this long before a cap
    watchdog_interval: Duration = 30.0
    lease_ttl: Duration = 300.0  # the daemon's lease the watchdog honours
    api_poll_interval: Duration = 5.0  # how often a booting pod is looked at

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
    "AnyTarget",
    "Duration",
    "LocalTarget",
    "RunpodTarget",
    "SshTarget",
    "StrictModel",
    "Target",
    "parse_duration",
]
