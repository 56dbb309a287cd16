"""`WorkloadConfig`: the description of a fine-tuning workload that a runner benchmarks.

It is what the benchmark cache hashes, what a fake scenario's `match` is tested against, and what
the live runner turns into a command line for the workload script.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class WorkloadConfig(BaseModel):
    """One workload: model, method and shapes, the hardware it runs on, and the script that runs it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "custom"
    model: str = "Qwen/Qwen2.5-0.5B"
    method: Literal["lora", "full"] = "lora"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    seq_len: int = Field(512, ge=1)
    batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1)
    gradient_checkpointing: bool = False
    dataloader_workers: int = Field(0, ge=0)
    lora_r: int | None = 16
    gpu: str | None = None  # e.g. "MI300X"; None: whatever the target has
    num_gpus: int = Field(1, ge=1)
    model_params: float | None = None  # parameter count, for MFU when the profile does not say
    trainable_params: float | None = None
    script: str = "workloads/train_qwen_lora.py"
    args: list[str] = Field(default_factory=list)  # extra arguments for the script

    def canonical_json(self) -> str:
        """The config as JSON with sorted keys and no whitespace: the same config, the same bytes."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def matches(self, match: dict[str, Any]) -> bool:
        """True when every key of `match` agrees with this config.

        Strings are shell patterns (`"Qwen/Qwen2.5-*"`), compared case-insensitively; other values
        must be equal. A key the config does not have never matches.
        """
        values = self.model_dump(mode="json")
        for key, wanted in match.items():
            if key not in values:
                return False
            actual = values[key]
            if isinstance(wanted, str) and isinstance(actual, str):
                if not fnmatch.fnmatchcase(actual.lower(), wanted.lower()):
                    return False
            elif actual != wanted:
                return False
        return True
