"""`RunMetrics`: what a profiled run measured, and where each number came from.

This is the boundary model between the parsers and everything that shows or stores metrics
(the daemon's run record, `obd train metrics`, `obd profile parse --json`). Every number is
optional: a number that was not measured stays `None`, with a warning saying why, and is never
replaced by a guess. `sources` maps a field name to a sentence naming the file and the method.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1

RunnerKind = Literal["live", "fake"]

# The seven buckets of the waste budget, in the order they are shown.
WASTE_BUCKETS = (
    "useful_gpu",
    "data_wait",
    "host_gap",
    "comm_excess",
    "memory_headroom",
    "precision_path",
    "kernel_shape",
)


class KernelShare(BaseModel):
    """One kernel (or, on the CPU path, one operator) and its share of all kernel time."""

    name: str  # kept whole: demangled template names are the only way to tell kernels apart
    pct_time: float
    calls: int | None = None
    total_ms: float | None = None


class WasteBudget(BaseModel):
    """Where one training step's wall time goes, in seconds per step.

    The buckets are disjoint; when all are known they add up to `step_time_s`. A bucket that
    the available profile cannot measure stays `None` (its reason is in `RunMetrics.sources`).
    """

    useful_gpu: float | None = None
    data_wait: float | None = None
    host_gap: float | None = None
    comm_excess: float | None = None
    memory_headroom: float | None = None
    precision_path: float | None = None
    kernel_shape: float | None = None
    step_time_s: float | None = None

    def known_total(self) -> float:
        """Sum of the buckets that were measured or estimated."""
        return sum(v for k in WASTE_BUCKETS if (v := getattr(self, k)) is not None)


class RunMetrics(BaseModel):
    """The metrics of one run (SPEC "RunMetrics"), plus the fields that say how they were obtained."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    runner_kind: RunnerKind = "live"
    profiler: str = "none"  # rocprofv3 | torch.profiler | none | fake
    device_kind: str | None = None  # amd | cuda | rocm | cpu

    steps: int | None = None
    step_time_s: float | None = None
    tokens_per_sec: float | None = None
    mfu_pct: float | None = None
    hbm_peak_gb: float | None = None
    hbm_avg_gb: float | None = None
    hbm_total_gb: float | None = None
    gpu_util_pct: float | None = None
    power_avg_w: float | None = None

    top_kernels: list[KernelShare] = Field(default_factory=list)
    other_kernels_pct: float = 0.0  # the share of every kernel not in top_kernels
    kernel_count: int = 0  # distinct kernel names seen
    dispatch_count: int = 0
    kernel_time_s: float | None = None  # sum of all kernel durations
    gpu_busy_s: float | None = None  # union of kernel intervals: time at least one kernel ran

    counters: dict[str, float] = Field(default_factory=dict)  # rocprofv3 --pmc: counter -> total over dispatches

    attention_kernel_loaded: bool | None = None
    attention_kernels: list[str] = Field(default_factory=list)

    waste_budget: WasteBudget = Field(default_factory=WasteBudget)

    gpu_name: str | None = None
    gpu_count: int | None = None
    peak_tflops: float | None = None  # dense bf16 peak of one GPU
    flops_per_token: float | None = None

    rocm_version: str | None = None
    pytorch_version: str | None = None

    sources: dict[str, str] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    files: list[str] = Field(default_factory=list)  # profile files read, relative to the profile dir

    def warn(self, message: str) -> None:
        """Add a warning once (the same gap found twice is said once)."""
        if message not in self.warnings:
            self.warnings.append(message)

    def source(self, field: str, text: str) -> None:
        self.sources[field] = text
