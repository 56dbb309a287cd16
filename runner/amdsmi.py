"""amd-smi telemetry: `amd-smi monitor --csv` samples and `amd-smi metric --json` documents.

Units are decided per column, because amd-smi changes them with the flags: `vram_used` and
`vram_total` are GB (1024 MB, one decimal) in the default output and MB with `-v`
(`--vram-usage`), which also adds `vram_free` and `vram_percent`; a unit written in the cell
wins over both. Utilisation is the `gfx` column (graphics activity %); `power_usage` is watts and
is never read as utilisation. Samples are folded into running sums, so a long watch stays small.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.csvstream import Table, TableSpec, normalise, parse_number, read_table, unit_of

MONITOR_COLUMNS: dict[str, tuple[str, ...]] = {
    "gpu": ("gpu",),
    "timestamp": ("timestamp",),
    "power": ("powerusage", "power", "socketpower"),
    "gfx": ("gfx", "gfx%", "gfxutil", "gfxactivity"),
    "vram_used": ("vramused",),
    "vram_total": ("vramtotal",),
    "vram_free": ("vramfree",),
    "vram_percent": ("vrampercent", "vram%"),
}
MONITOR = TableSpec(MONITOR_COLUMNS, ("gpu",), "amd-smi monitor header (a 'gpu' column)", skipped="amd-smi rows")

_TO_GB = {
    "b": 1 / 1024**3,
    "kb": 1 / 1024**2,
    "kib": 1 / 1024**2,
    "mb": 1 / 1024,
    "mib": 1 / 1024,
    "gb": 1.0,
    "gib": 1.0,
    "tb": 1024.0,
}


@dataclass
class Series:
    """Running count, sum, min and max of one metric of one GPU."""

    count: int = 0
    total: float = 0.0
    low: float | None = None
    high: float | None = None

    def add(self, value: float | None) -> None:
        if value is None:
            return
        self.count += 1
        self.total += value
        self.low = value if self.low is None else min(self.low, value)
        self.high = value if self.high is None else max(self.high, value)

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class GpuSamples:
    vram_used_gb: Series = field(default_factory=Series)
    vram_total_gb: Series = field(default_factory=Series)
    gfx_pct: Series = field(default_factory=Series)
    power_w: Series = field(default_factory=Series)


@dataclass
class Telemetry:
    """amd-smi samples per GPU, plus what was read and what was skipped."""

    gpus: dict[str, GpuSamples] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    vram_units: set[str] = field(default_factory=set)
    samples: int = 0
    warnings: list[str] = field(default_factory=list)

    def gpu(self, key: str) -> GpuSamples:
        samples = self.gpus.get(key)
        if samples is None:
            samples = self.gpus[key] = GpuSamples()
        return samples


def _to_gb(value: float | None, unit: str | None) -> float | None:
    if value is None or unit is None:
        return None
    factor = _TO_GB.get(unit.lower())
    return value * factor if factor is not None else None


def read_monitor_csv(
    path: Path, telemetry: Telemetry, label: str | None = None, vram_unit_hint: str | None = None
) -> None:
    """Fold an `amd-smi monitor --csv` file (with or without `-w` watch) into `telemetry`.

    `vram_unit_hint` ("MB"/"GB") is what the wrapper knows from the flags it used; without it the
    unit follows from the columns (`vram_free`/`vram_percent` only exist with `-v`, in MB).
    """
    with read_table(path, MONITOR, telemetry.warnings, label) as table:
        if table is None:
            return
        if len(table.index) < 2:
            telemetry.warnings.append(
                f"{table.label}: the amd-smi header has no metric this parser knows; file skipped"
            )
            return
        verbose = "vram_free" in table.index or "vram_percent" in table.index
        column_unit = (vram_unit_hint or ("MB" if verbose else "GB")).lower()
        telemetry.files.append(table.label)
        _fold_monitor_rows(table, column_unit, telemetry)


def _fold_monitor_rows(table: Table, column_unit: str, telemetry: Telemetry) -> None:
    i_gpu = table.index["gpu"]
    for row in table.rows:
        if len(row) <= i_gpu or not row[i_gpu].strip():
            table.bad += bool(row)
            continue
        gpu_cell = row[i_gpu].strip()
        if normalise(gpu_cell) == "gpu":
            continue  # the header again: watch mode and concatenated files repeat it
        if parse_number(gpu_cell) is None:
            table.bad += 1  # a warning or error line amd-smi printed between samples
            continue
        samples = telemetry.gpu(gpu_cell)
        for key, series in (("vram_used", samples.vram_used_gb), ("vram_total", samples.vram_total_gb)):
            text = table.cell(row, key)
            value = parse_number(text)
            unit = unit_of(text) or column_unit
            if value is not None:
                telemetry.vram_units.add(unit.upper())
            series.add(_to_gb(value, unit))
        samples.gfx_pct.add(_percent(table.number(row, "gfx")))
        samples.power_w.add(table.number(row, "power"))
        telemetry.samples += 1


def _percent(value: float | None) -> float | None:
    return value if value is not None and 0.0 <= value <= 100.0 else None


def _value_unit(entry: object, default_unit: str | None = None) -> tuple[float | None, str | None]:
    """`{"value": 12, "unit": "MB"}` -> (12.0, "MB"); a bare number or "12 MB" string too."""
    if isinstance(entry, dict):
        raw = entry.get("value")
        unit = entry.get("unit") or default_unit
        if isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return parse_number(str(raw)), unit
        return parse_number(str(raw)) if raw is not None else None, unit
    if isinstance(entry, (int, float)) and not isinstance(entry, bool):
        return parse_number(str(entry)), default_unit
    if isinstance(entry, str):
        return parse_number(entry), unit_of(entry) or default_unit
    return None, default_unit


def gpu_entries(document: object) -> list[dict[str, Any]]:
    """The per-GPU objects of an `amd-smi metric --json` document: a list (ROCm 6) or `gpu_data` (ROCm 7)."""
    if isinstance(document, dict):
        if isinstance(document.get("gpu_data"), list):
            document = document["gpu_data"]
        elif "gpu" in document:
            document = [document]
        else:
            return []
    if not isinstance(document, list):
        return []
    return [entry for entry in document if isinstance(entry, dict)]


def _section(entry: dict[str, Any], key: str) -> dict[str, Any]:
    """The object under `key` of a GPU's entry; empty when amd-smi left it out (or wrote N/A)."""
    value = entry.get(key)
    return value if isinstance(value, dict) else {}


def fold_metric_document(document: object, telemetry: Telemetry) -> int:
    """Add one `amd-smi metric --json` sample (every GPU in it) to `telemetry`; returns GPUs read."""
    read = 0
    for entry in gpu_entries(document):
        key = str(entry.get("gpu", len(telemetry.gpus)))
        samples = telemetry.gpu(key)
        usage, power, memory = _section(entry, "usage"), _section(entry, "power"), _section(entry, "mem_usage")
        samples.gfx_pct.add(_percent(_value_unit(usage.get("gfx_activity"))[0]))
        watts, _ = _value_unit(power.get("socket_power", power.get("average_socket_power")))
        samples.power_w.add(watts)
        for name, series in (("used_vram", samples.vram_used_gb), ("total_vram", samples.vram_total_gb)):
            value, unit = _value_unit(memory.get(name), "MB")
            if value is not None and unit:
                telemetry.vram_units.add(unit.upper())
            series.add(_to_gb(value, unit))
        telemetry.samples += 1
        read += 1
    return read


def read_metric_json(path: Path, telemetry: Telemetry, label: str | None = None) -> None:
    """An `amd-smi metric --json` output: one document, or JSON lines of `{"time", "data"}` samples.

    Read line by line, so a long watch never sits in memory whole: a line that is JSON by
    itself is one sample; otherwise lines gather into one document (amd-smi's own output is
    indented over many lines) until a line at the left margin closes it or starts the next.
    Text before the JSON (amd-smi's warnings about groups or drivers) is skipped.
    """
    label = label or path.name
    bad = read = 0
    seen_json = False
    pending: list[str] = []  # the lines of a document spread over several lines

    def fold(document: object) -> None:
        nonlocal read
        if isinstance(document, dict) and "data" in document and "gpu" not in document:
            document = document["data"]
        read += fold_metric_document(document, telemetry)

    def close_pending() -> bool:
        """Parse the gathered lines as one document; False (lines kept) while they are not JSON yet."""
        try:
            document = json.loads("".join(pending))
        except (ValueError, RecursionError):
            return False
        pending.clear()
        fold(document)
        return True

    try:
        with open(path, encoding="utf-8", errors="replace") as stream:
            for raw in stream:
                line = raw
                if not seen_json:
                    starts = [i for i in (raw.find("["), raw.find("{")) if i >= 0]
                    if not starts:
                        continue  # the preamble
                    seen_json, line = True, raw[min(starts) :]
                if not line.strip():
                    continue
                # A new document starting at the left margin: lines gathered before it that never closed are bad.
                if pending and line[:1] in ("[", "{") and not close_pending():
                    bad += sum(1 for text in pending if text.strip())
                    pending.clear()
                if not pending:
                    try:
                        fold(json.loads(line))
                        continue
                    except (ValueError, RecursionError):
                        pass
                pending.append(line)
                if line[:1] in ("]", "}"):
                    close_pending()  # a closing bracket at the left margin may end the document
    except OSError as exc:
        telemetry.warnings.append(f"{label}: could not be read ({exc.strerror or exc})")
        return
    if pending and not close_pending():
        bad += sum(1 for text in pending if text.strip())
    if not seen_json:
        telemetry.warnings.append(f"{label}: no JSON in the amd-smi metric output; file skipped")
        return
    if read:
        telemetry.files.append(label)
    else:
        telemetry.warnings.append(f"{label}: no GPU entries in the amd-smi metric output")
    if bad:
        telemetry.warnings.append(f"{label}: {bad} unreadable JSON lines skipped")


@dataclass
class TelemetrySummary:
    hbm_peak_gb: float | None
    hbm_avg_gb: float | None
    hbm_total_gb: float | None
    gpu_util_pct: float | None
    power_avg_w: float | None
    active_gpus: list[str]


def summarise(telemetry: Telemetry) -> TelemetrySummary:
    """Peak and mean VRAM, mean graphics activity and power over the GPUs the job used.

    A GPU counts as used when its VRAM moved by more than 0.5 GB or its graphics activity went
    above 5 %: on an 8-GPU box a one-GPU job would otherwise be averaged with seven idle cards.
    If no GPU qualifies, all are used.
    """
    active = [
        key
        for key, s in telemetry.gpus.items()
        if (
            s.vram_used_gb.high is not None
            and s.vram_used_gb.low is not None
            and s.vram_used_gb.high - s.vram_used_gb.low > 0.5
        )
        or (s.gfx_pct.high or 0.0) > 5.0
    ] or list(telemetry.gpus)
    chosen = [telemetry.gpus[key] for key in active]

    def pooled_mean(series: list[Series]) -> float | None:
        count = sum(s.count for s in series)
        return sum(s.total for s in series) / count if count else None

    peaks = [s.vram_used_gb.high for s in chosen if s.vram_used_gb.high is not None]
    totals = [s.vram_total_gb.high for s in chosen if s.vram_total_gb.high is not None]
    return TelemetrySummary(
        hbm_peak_gb=max(peaks) if peaks else None,
        hbm_avg_gb=pooled_mean([s.vram_used_gb for s in chosen]),
        hbm_total_gb=max(totals) if totals else None,
        gpu_util_pct=pooled_mean([s.gfx_pct for s in chosen]),
        power_avg_w=pooled_mean([s.power_w for s in chosen]),
        active_gpus=active,
    )
