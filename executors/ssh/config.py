"""What a `[targets.NAME]` section of `kind = "ssh"` (a host reached over SSH) holds: `SshTarget`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from executors.config_base import Interval, PricedTarget, Timeout


class SshTarget(PricedTarget):
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
    # A persistent `jobctl.py serve` on one channel for probes, starts and events (no shell per
    # poll); false: one remote command per operation, as before.
    helper: bool = True
    keepalive: Interval = 15.0
    connect_timeout: Timeout = 15.0
    # The GPUs a job there uses, counted for `--max-gpu-hours` and a price (obd hands out none here).
    gpu_count: int | None = Field(default=None, ge=0, le=64)


__all__ = ["SshTarget"]
