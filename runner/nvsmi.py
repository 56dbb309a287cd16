"""NVML samples from `nvidia-smi --query-gpu=index,timestamp,utilization.gpu,memory.used,memory.total,power.draw --format=csv -lms N`.

What the profiling wrapper writes on an NVIDIA GPU (`profile/nvidia_smi.csv`), folded into the
same per-GPU running sums as amd-smi's samples (`amdsmi.Telemetry`), so the summary (the GPUs the
job used, peak and mean memory, mean utilisation and power) is computed one way for both vendors.
nvidia-smi writes units in the header (`memory.used [MiB]`) and, without `nounits`, in each cell
(`1234 MiB`, `87 %`, `301.22 W`); a cell's unit is used, and a bare number is MiB, the only
unit nvidia-smi reports memory in. `[N/A]` (a
figure the GPU does not report, e.g. power in some virtual machines) is no sample of that figure.
Utilisation is NVML's `utilization.gpu`: the share of the sample period in which a kernel ran.
"""

from __future__ import annotations

from pathlib import Path

from runner.amdsmi import Telemetry, _to_gb
from runner.csvstream import TableSpec, normalise, parse_number, read_table, unit_of

COLUMNS: dict[str, tuple[str, ...]] = {
    "gpu": ("index",),
    "util": ("utilizationgpu%", "utilizationgpu"),
    "mem_used": ("memoryusedmib", "memoryused"),
    "mem_total": ("memorytotalmib", "memorytotal"),
    "power": ("powerdraww", "powerdraw", "powerdrawaveragew", "powerdrawinstantw"),
}
QUERY = TableSpec(
    COLUMNS, ("gpu", "util"), "nvidia-smi --query-gpu header (index, utilization.gpu)", skipped="nvidia-smi rows"
)


def read_query_csv(path: Path, telemetry: Telemetry, label: str | None = None) -> None:
    """Fold an nvidia-smi query CSV (one header, or one per restart of the loop) into `telemetry`."""
    with read_table(path, QUERY, telemetry.warnings, label) as table:
        if table is None:
            return
        telemetry.files.append(table.label)
        for row in table.rows:
            index = table.cell(row, "gpu").strip()
            if normalise(index) == "index":  # the header again (the loop restarted)
                continue
            if not index.isdigit():
                table.bad += bool(row)  # a warning nvidia-smi printed between samples
                continue
            samples = telemetry.gpu(index)
            for key, series in (("mem_used", samples.vram_used_gb), ("mem_total", samples.vram_total_gb)):
                text = table.cell(row, key)
                value = parse_number(text)
                unit = unit_of(text) or "mib"
                if value is not None:
                    telemetry.vram_units.add(unit.upper())
                series.add(_to_gb(value, unit))
            util = table.number(row, "util")
            samples.gfx_pct.add(util if util is not None and 0.0 <= util <= 100.0 else None)
            samples.power_w.add(table.number(row, "power"))
            telemetry.samples += 1
