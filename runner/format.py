"""The human text of `obd train metrics ID` and `obd profile parse DIR`: numbers with their sources.

Every number is printed next to where it came from; an unknown number prints as "unknown", never
as 0. Fake (canned) metrics carry a `runner_kind: fake` banner at the top and bottom, so a copy of
any part of the text still shows what it is.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from runner.metrics import WASTE_BUCKETS, RunMetrics

_SUMMARY: tuple[tuple[str, str, str], ...] = (
    # field, label, format
    ("steps", "steps", "{:,.0f}"),
    ("step_time_s", "step time", "{:.4g} s"),
    ("tokens_per_sec", "tokens/s", "{:,.1f}"),
    ("mfu_pct", "MFU", "{:.1f} %"),
    ("hbm_peak_gb", "HBM peak", "{:.2f} GB"),
    ("hbm_avg_gb", "HBM average", "{:.2f} GB"),
    ("hbm_total_gb", "HBM total", "{:.2f} GB"),
    ("gpu_util_pct", "GPU utilisation", "{:.1f} %"),
    ("power_avg_w", "power (mean)", "{:.0f} W"),
    ("peak_tflops", "GPU peak (bf16)", "{:.1f} TFLOPs"),
    ("flops_per_token", "model FLOPs/token", "{:.3g}"),
    ("gpu_busy_s", "GPU busy (total)", "{:.4g} s"),
    ("kernel_time_s", "kernel time (sum)", "{:.4g} s"),
)


def _fmt(value: Any, pattern: str) -> str:
    if value is None:
        return "unknown"
    try:
        return pattern.format(value)
    except (ValueError, TypeError):
        return str(value)


def format_metrics(metrics: dict) -> str:
    """The RunMetrics dict (as stored with the run, or printed by `--json`) as text for a terminal."""
    try:
        m = RunMetrics.model_validate(metrics or {})
    except ValidationError as exc:
        return f"metrics unreadable ({exc.error_count()} invalid fields); raw: {metrics!r}\n"
    lines: list[str] = []
    fake = m.runner_kind == "fake"
    banner = (
        "runner_kind: fake  -- CANNED NUMBERS FROM A SYNTHETIC SCENARIO, NOTHING WAS MEASURED"
        if fake
        else "runner_kind: live"
    )
    lines.append(banner)
    head = [f"profiler: {m.profiler}"]
    if m.device_kind:
        head.append(f"device: {m.device_kind}")
    if m.gpu_name:
        head.append(f"GPU: {m.gpu_name}" + (f" x{m.gpu_count}" if m.gpu_count and m.gpu_count > 1 else ""))
    head.append(f"ROCm: {m.rocm_version or 'unknown'}")
    head.append(f"PyTorch: {m.pytorch_version or 'unknown'}")
    lines.append("   ".join(head))
    lines.append("")

    width = max(len(label) for _, label, _ in _SUMMARY)
    for field, label, pattern in _SUMMARY:
        value = getattr(m, field)
        source = m.sources.get(field, "")
        lines.append(f"  {label:<{width}}  {_fmt(value, pattern):>16}   {source}".rstrip())
    attention = {True: "yes", False: "no", None: "unknown"}[m.attention_kernel_loaded]
    lines.append(
        f"  {'attention kernel':<{width}}  {attention:>16}   {m.sources.get('attention_kernel_loaded', '')}".rstrip()
    )
    for name in m.attention_kernels:
        lines.append(f"  {'':<{width}}  {'':>16}     {name}")
    lines.append("")
    lines.extend(_kernel_table(m))
    if m.counters:
        lines.append("")
        lines.append(f"Counters ({m.sources.get('counters', 'source unknown')})")
        lines.extend(f"  {name:<24} {value:>20,.6g}" for name, value in m.counters.items())
    lines.append("")
    lines.extend(_budget_table(m))
    if m.warnings:
        lines.append("")
        lines.append("Warnings:")
        lines.extend(f"  - {warning}" for warning in m.warnings)
    if m.files:
        lines.append("")
        lines.append("Files read: " + ", ".join(m.files))
    if fake:
        lines.append("")
        lines.append(banner)
    return "\n".join(lines) + "\n"


def _kernel_table(m: RunMetrics) -> list[str]:
    if not m.top_kernels:
        return ["Top kernels: none recorded"]
    what = "operators" if m.device_kind == "cpu" else "kernels"
    lines = [
        f"Top {what} ({m.sources.get('top_kernels', 'source unknown')}; "
        f"{m.kernel_count:,} distinct, {m.dispatch_count:,} calls)",
        f"  {'% time':>7}  {'calls':>10}  {'total ms':>11}  name",
    ]
    for k in m.top_kernels:
        calls = f"{k.calls:,}" if k.calls is not None else ""
        total = f"{k.total_ms:,.2f}" if k.total_ms is not None else ""
        lines.append(f"  {k.pct_time:6.2f}%  {calls:>10}  {total:>11}  {k.name}")
    if m.other_kernels_pct > 0:
        rest = max(m.kernel_count - len(m.top_kernels), 0)
        lines.append(f"  {m.other_kernels_pct:6.2f}%  {'':>10}  {'':>11}  ({rest:,} other {what})")
    return lines


def _budget_table(m: RunMetrics) -> list[str]:
    budget = m.waste_budget
    step = budget.step_time_s
    lines = [f"Waste budget (seconds per step; step time {_fmt(step, '{:.4g} s')})"]
    if "waste_budget" in m.sources:
        lines.append(f"  {m.sources['waste_budget']}")
    for bucket in WASTE_BUCKETS:
        value = getattr(budget, bucket)
        share = f"{100.0 * value / step:5.1f}%" if value is not None and step else "      "
        source = m.sources.get(f"waste_budget.{bucket}", "")
        lines.append(f"  {bucket:<16} {_fmt(value, '{:.4g}'):>10}  {share}  {source}".rstrip())
    return lines
