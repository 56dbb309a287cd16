"""Read what `trainer_plugin/plugin/torch_profile.py` wrote: `torch_kernels.csv` and `torch_profile.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.csvstream import TableSpec, read_table

KERNEL_COLUMNS: dict[str, tuple[str, ...]] = {
    "name": ("name",),
    "calls": ("calls",),
    "total_us": ("totalus",),
    "device": ("device",),
}
KERNELS = TableSpec(KERNEL_COLUMNS, ("name", "total_us"), "header (name, total_us)")


@dataclass
class TorchKernels:
    gpu: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (calls, total ns)
    cpu: dict[str, tuple[int, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def read_torch_kernels(path: Path, label: str | None = None) -> TorchKernels:
    """The window's kernels (device "gpu") and operators (device "cpu"), by self time in ns."""
    out = TorchKernels()
    with read_table(path, KERNELS, out.warnings, label) as table:
        if table is None:
            return out
        i_name = table.index["name"]
        for row in table.rows:
            total = table.number(row, "total_us")
            if not table.fits(row) or total is None or total < 0:
                table.bad += 1
                continue
            name = row[i_name]
            device = table.cell(row, "device").strip().lower() if "device" in table.index else "cpu"
            kernels = out.gpu if device == "gpu" else out.cpu
            prev_calls, prev_ns = kernels.get(name, (0, 0.0))
            kernels[name] = (prev_calls + int(table.number(row, "calls") or 0), prev_ns + total * 1000.0)
    return out


def _section(document: dict[str, Any], key: str) -> dict[str, Any]:
    """The object under `key`; empty when the file has none there (or something else)."""
    value = document.get(key)
    return value if isinstance(value, dict) else {}


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


@dataclass
class TorchSummary:
    """The parts of `torch_profile.json` the metrics use; None where the file did not say."""

    device_kind: str | None = None
    device_name: str | None = None
    device_count: int | None = None
    torch_version: str | None = None
    hip_version: str | None = None
    period_s: float | None = None  # mean step_begin -> next step_begin
    in_step_s: float | None = None
    wait_between_s: float | None = None
    steps_timed: int | None = None
    device_time_per_step_s: float | None = None
    peak_reserved_bytes: float | None = None
    peak_allocated_bytes: float | None = None
    total_memory_bytes: float | None = None
    host_peak_rss_bytes: float | None = None
    window_steps: list = field(default_factory=list)
    model_params: float | None = None
    trainable_params: float | None = None
    errors: list[str] = field(default_factory=list)
    state: str | None = None


def read_torch_summary(path: Path, warnings: list[str], label: str | None = None) -> TorchSummary | None:
    """Parse `torch_profile.json`; None (with a warning) when it is unreadable."""
    label = label or path.name
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError, RecursionError) as exc:
        warnings.append(f"{label}: unreadable ({exc})")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{label}: not a JSON object")
        return None
    device, steps, model = _section(data, "device"), _section(data, "steps"), _section(data, "model")
    period, inner, gap, clean_period, clean_gap = (
        _section(steps, k)
        for k in ("period", "in_step", "wait_between", "period_unprofiled", "wait_between_unprofiled")
    )
    # Steps the profiler did not touch give the undisturbed pace; the profiled ones are the fallback.
    if (_num(clean_period.get("count")) or 0) >= 1:
        period = clean_period
    if (_num(clean_gap.get("count")) or 0) >= 1:
        gap = clean_gap
    window = _section(data, "window").get("profiled_steps")
    errors = data.get("errors")
    count = _num(device.get("count"))
    return TorchSummary(
        device_kind=device.get("kind") if isinstance(device.get("kind"), str) else None,
        device_name=device.get("name") if isinstance(device.get("name"), str) else None,
        device_count=int(count) if count is not None else None,
        torch_version=device.get("torch_version") if isinstance(device.get("torch_version"), str) else None,
        hip_version=device.get("hip_version") if isinstance(device.get("hip_version"), str) else None,
        period_s=_num(period.get("mean_s")),
        in_step_s=_num(inner.get("mean_s")),
        wait_between_s=_num(gap.get("mean_s")),
        steps_timed=int(_num(inner.get("count")) or 0) or None,
        device_time_per_step_s=_num(data.get("device_time_per_window_step_s")),
        peak_reserved_bytes=_num(device.get("peak_memory_reserved_bytes")),
        peak_allocated_bytes=_num(device.get("peak_memory_allocated_bytes")),
        total_memory_bytes=_num(device.get("total_memory_bytes")),
        host_peak_rss_bytes=_num(data.get("host_peak_rss_bytes")),
        window_steps=window if isinstance(window, list) else [],
        model_params=_num(model.get("params")),
        trainable_params=_num(model.get("trainable_params")),
        errors=[str(e) for e in errors] if isinstance(errors, list) else [],
        state=data.get("state") if isinstance(data.get("state"), str) else None,
    )
