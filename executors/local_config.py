"""What a `[targets.NAME]` section of `kind = "local"` (this machine) holds: `LocalTarget`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from executors.config_base import Margin, PricedTarget


class LocalTarget(PricedTarget):
    kind: Literal["local"] = "local"
    workdir: Path | None = None  # default: <state_dir>/jobs
    python: str | None = None  # the interpreter that runs obd's job wrapper
    venv: str | None = None  # its bin/ leads every job's PATH
    # Names passed from the daemon's own environment to every job (the daemon's environment
    # reaches no job otherwise): plain values here, secrets in `secrets` (never logged).
    env: list[str] = Field(default_factory=list)
    # The GPUs jobs are given: found with nvidia-smi/amd-smi when unset; a list of device ids;
    # or 0 for none. Each run gets the ones it asks for (--gpus), alone.
    gpus: list[str] | int | None = None
    gpu_vendor: Literal["nvidia", "amd"] | None = None
    # Preemption (docs/preemption.md): a run is preemptible unless started with
    # --no-preemptible (or this says False); none is preempted before it ran min_runtime.
    # This machine's keys only: obd hands out no other target's GPUs, so preempts no run there.
    preemptible: bool = True
    min_runtime: Margin = 600.0

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, value: list[str] | int | None) -> list[str] | int | None:
        if isinstance(value, int) and not 0 <= value <= 64:
            raise ValueError("gpus is a list of device ids, or a count from 0 to 64")
        distinct = isinstance(value, list) and len(set(value)) == len(value)
        if isinstance(value, list) and not (distinct and all(v and v.replace("-", "").isalnum() for v in value)):
            raise ValueError('gpus is a list of distinct device ids such as ["0", "1"]')
        return value


__all__ = ["LocalTarget"]
