"""Find the profiler files in a profile directory, whatever layout wrote them.

rocprofv3 writes `<dir>/<host>/<pid>_kernel_trace.csv` by default and `<dir>/<name>_kernel_trace.csv`
with `-o <name>`; `rocpd convert` writes `kernel_trace.csv`; a multi-process job leaves one set
per process. With `--pmc` it writes `counter_collection.csv`; ROCm 7's default output is instead
one SQLite database per process, `<host>/<pid>_results.db` (`--output-format rocpd`). Files are matched by the end of their name, a few directories deep; links are not
followed (the directory came from a target and may hold anything).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MAX_DEPTH = 4


@dataclass
class ProfileFiles:
    root: Path
    kernel_traces: list[Path] = field(default_factory=list)
    kernel_stats: list[Path] = field(default_factory=list)
    counter_collections: list[Path] = field(default_factory=list)
    rocpd_dbs: list[Path] = field(default_factory=list)  # rocprofv3's SQLite output (runner/rocpd.py)
    agent_infos: list[Path] = field(default_factory=list)
    amdsmi_csv: list[Path] = field(default_factory=list)
    amdsmi_json: list[Path] = field(default_factory=list)
    nvidia_smi: list[Path] = field(default_factory=list)  # the wrapper's NVML samples (runner/nvsmi.py)
    torch_kernels: Path | None = None
    torch_summary: Path | None = None
    runner_json: Path | None = None

    def label(self, path: Path) -> str:
        """A file's name relative to the profile directory, for sources and warnings."""
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def any_profile(self) -> bool:
        return bool(
            self.kernel_traces
            or self.kernel_stats
            or self.counter_collections
            or self.rocpd_dbs
            or self.torch_kernels
            or self.torch_summary
            or self.amdsmi_csv
            or self.amdsmi_json
            or self.nvidia_smi
        )


def is_rocpd_name(name: str) -> bool:
    """Whether a file name is rocprofv3's database: `<pid>_results.db` (or `<name>_results.db` with -o)."""
    lowered = name.lower()
    return lowered == "results.db" or lowered.endswith("_results.db")


def _walk(root: Path) -> list[Path]:
    found: list[Path] = []
    base_depth = len(root.parts)
    for directory, dirs, files in os.walk(root, followlinks=False):
        here = Path(directory)
        if len(here.parts) - base_depth >= MAX_DEPTH:
            dirs[:] = []
        dirs.sort()
        for name in sorted(files):
            path = here / name
            if path.is_file() and not path.is_symlink():
                found.append(path)
    return found


def find_profile_files(root: Path) -> ProfileFiles:
    """Sort the files under `root` by what they hold; rank subdirectories of torch.profiler are skipped."""
    out = ProfileFiles(root=root)
    if not root.is_dir():
        return out
    for path in _walk(root):
        name = path.name.lower()
        relative = path.relative_to(root)
        top_level = len(relative.parts) == 1
        if name.endswith("kernel_trace.csv"):
            out.kernel_traces.append(path)
        elif name.endswith("kernel_stats.csv"):
            out.kernel_stats.append(path)
        elif name.endswith("counter_collection.csv"):
            out.counter_collections.append(path)
        elif is_rocpd_name(name):
            out.rocpd_dbs.append(path)
        elif name.endswith("agent_info.csv"):
            out.agent_infos.append(path)
        elif name.endswith(".csv") and ("amdsmi" in name or "amd_smi" in name or "amd-smi" in name):
            out.amdsmi_csv.append(path)
        elif name.endswith(".csv") and ("nvidia_smi" in name or "nvidia-smi" in name):
            out.nvidia_smi.append(path)
        elif (name.endswith(".json") or name.endswith(".jsonl")) and (
            "amdsmi" in name or "amd_smi" in name or "amd-smi" in name
        ):
            out.amdsmi_json.append(path)
        elif name == "torch_kernels.csv" and top_level:
            out.torch_kernels = path
        elif name == "torch_profile.json" and top_level:
            out.torch_summary = path
        elif name == "runner.json" and top_level:
            out.runner_json = path
    return out
