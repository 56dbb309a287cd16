"""The waste budget: one step's wall time split into seven disjoint buckets, in seconds per step.

    step time = GPU busy + GPU idle
    GPU busy  = useful_gpu + comm_excess + precision_path + kernel_shape
    GPU idle  = data_wait + memory_headroom + host_gap

GPU busy is the union of kernel intervals per step; it is split by each kernel's share of kernel
time, by name (communication kernels; fp32 GEMMs where bf16 would do; launch-bound kernels
averaging under 10 us; everything else is useful). Idle time is split into the wait for the next
batch (when the torch.profiler path measured it), an estimate of the fixed per-step cost that a
batch filling the free HBM would amortise, and the rest: host gaps. Buckets the inputs cannot
give stay None, and the sources say why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import overload

from runner.kernels import Category
from runner.metrics import WasteBudget


@dataclass
class BudgetInputs:
    step_time_s: float | None = None
    busy_s: float | None = None  # GPU busy per step (union of kernel intervals)
    category_ns: dict[Category, float] = field(default_factory=dict)  # summed kernel time by bucket
    data_wait_s: float | None = None
    hbm_peak_gb: float | None = None
    hbm_total_gb: float | None = None
    busy_source: str = ""
    data_source: str = ""
    gpu: bool = True  # False on a CPU-only run: there are no GPU buckets


@dataclass
class Budget:
    budget: WasteBudget
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


_BUSY_BUCKETS: tuple[tuple[str, Category, str], ...] = (
    ("useful_gpu", "useful", "kernels not counted in the other busy buckets"),
    ("comm_excess", "comm", "RCCL/NCCL collective kernels (by name), exposed or not"),
    ("precision_path", "precision", "fp32/fp64 GEMM kernels (by name: sgemm, Tensile _S_/_SB_ types)"),
    ("kernel_shape", "shape", "launch-bound kernels averaging under 10 us"),
)


def waste_budget(inputs: BudgetInputs) -> Budget:
    """Split the step time into the seven buckets as far as the inputs allow."""
    out = Budget(WasteBudget(step_time_s=inputs.step_time_s))
    step, busy = inputs.step_time_s, inputs.busy_s
    if not inputs.gpu:
        out.sources["waste_budget"] = "CPU run: no GPU, so the GPU buckets do not apply"
        _set_data_wait(out, inputs, idle=None)
        return out
    if busy is None:
        out.sources["waste_budget"] = "no kernel timings: the GPU buckets are unknown"
        if step is not None:
            _set_data_wait(out, inputs, idle=None)
        return out
    if step is not None and busy > step:
        if busy > step * 1.02:  # beyond timing noise: say so
            out.warnings.append(
                f"GPU busy per step ({busy:.3f} s) exceeds the step time ({step:.3f} s): the trace covers work "
                "outside the timed steps (loading, evaluation); the busy buckets are scaled to the step time"
            )
        busy = step
    kernel_total = sum(inputs.category_ns.values())
    for field_name, category, meaning in _BUSY_BUCKETS:
        share = inputs.category_ns.get(category, 0.0) / kernel_total if kernel_total > 0 else 0.0
        setattr(out.budget, field_name, busy * share)
        out.sources[f"waste_budget.{field_name}"] = (
            f"{share * 100:.1f}% of kernel time x GPU busy per step ({inputs.busy_source}): {meaning}"
        )
    if step is None:
        out.sources["waste_budget.host_gap"] = "no step time: idle time unknown"
        return out
    idle = max(step - busy, 0.0)
    idle = _set_data_wait(out, inputs, idle)
    if inputs.hbm_peak_gb is not None and inputs.hbm_total_gb and inputs.hbm_total_gb > 0:
        free = max(0.0, 1.0 - inputs.hbm_peak_gb / inputs.hbm_total_gb)
        out.budget.memory_headroom = idle * free
        out.sources["waste_budget.memory_headroom"] = (
            f"estimate: {free * 100:.0f}% of HBM unused at peak x the remaining idle time per step, the "
            "fixed cost a batch filling HBM would amortise"
        )
        idle -= out.budget.memory_headroom
    else:
        out.sources["waste_budget.memory_headroom"] = "unknown: no HBM peak and total (amd-smi) to size the headroom"
    out.budget.host_gap = idle
    out.sources["waste_budget.host_gap"] = (
        "step time - GPU busy - the other idle buckets: launch gaps, Python, synchronisation"
        + ("" if out.budget.data_wait is not None else "; includes any wait for data (not measured separately)")
    )
    return out


@overload
def _set_data_wait(out: Budget, inputs: BudgetInputs, idle: float) -> float: ...
@overload
def _set_data_wait(out: Budget, inputs: BudgetInputs, idle: None) -> None: ...
def _set_data_wait(out: Budget, inputs: BudgetInputs, idle: float | None) -> float | None:
    """Fill `data_wait` (capped at the idle time) and return the idle time left."""
    if inputs.data_wait_s is None:
        out.sources["waste_budget.data_wait"] = "not measured: only the torch.profiler path times the batch fetch"
        return idle
    wait = inputs.data_wait_s if idle is None else min(inputs.data_wait_s, idle)
    out.budget.data_wait = wait
    out.sources["waste_budget.data_wait"] = inputs.data_source
    return None if idle is None else idle - wait
