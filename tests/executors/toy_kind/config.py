"""The toy kind's `[targets.NAME]` section: the keys every kind takes (TargetBase, here with a
price per GPU-hour), `kind = "toy"`, and one key of its own."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from executors.config_base import PricedTarget


class ToyTarget(PricedTarget):
    kind: Literal["toy"]
    slots: int = Field(default=1, ge=1, le=8)  # the GPUs each of its runs counts


__all__ = ["ToyTarget"]
