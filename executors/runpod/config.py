"""What a `[targets.NAME]` section of `kind = "runpod"` (a pod per run) holds: `RunpodTarget`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from executors.config_base import Interval, LongTimeout, Margin, TargetBase, Timeout

# A Runpod network volume id: the SDK pastes it unescaped into GraphQL, so nothing else gets through.
_NETWORK_VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class RunpodTarget(TargetBase):
    """Runpod: each run gets a pod of its own, made, watched and ended by obd. No `price_per_gpu_hour`:
    a pod is priced by its own rate, as Runpod bills it (executors/runpod/kind.py)."""

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


__all__ = ["RunpodTarget"]
