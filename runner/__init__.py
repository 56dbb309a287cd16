"""Profiling: the job wrapper, the parsers, `RunMetrics`, the runners and the benchmark cache.

What the daemon uses:

- `TARGET_FILES`: standard-library scripts to copy into a run's `plugin/` directory;
- `wrap_command(...)`: the command to run instead of the user's when `--profile` is given;
- `runner.collect.collect_metrics(...)`: fetch and parse the profile after the run ended;
- `runner.format.format_metrics(...)`: the text of `obd train metrics`;
- `runner.cli.profile_parse_main(...)`: `obd profile parse DIR [--json]`.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

_HERE = Path(__file__).resolve().parent

#: Scripts that run on the target (standard library only); the daemon uploads them to `plugin/`.
TARGET_FILES: list[Path] = [_HERE / "wrap.py"]


def wrap_command(command: list[str], plugin_dir: str, run_dir: str, python: str = "python3") -> list[str]:
    """The argv that runs `command` under the profiling wrapper on the target.

    The user's arguments pass through after `--` untouched: no shell, no quoting, any bytes.
    """
    if not command:
        raise ValueError("wrap_command: the command is empty")
    return [python, posixpath.join(plugin_dir, "wrap.py"), "--run-dir", run_dir, "--", *command]


def __getattr__(name: str):
    # The runners pull in pydantic models and the parsers; import them only when asked for, so
    # `wrap_command` and `TARGET_FILES` stay cheap for the daemon's start path.
    if name in ("Runner", "LiveRunner", "FakeRunner", "RunnerFailed", "NoScenario", "get_runner"):
        from runner import runners

        return getattr(runners, name)
    if name in ("RunMetrics", "WorkloadConfig", "BenchmarkCache"):
        from runner.cache import BenchmarkCache
        from runner.metrics import RunMetrics
        from runner.workload import WorkloadConfig

        return {"RunMetrics": RunMetrics, "WorkloadConfig": WorkloadConfig, "BenchmarkCache": BenchmarkCache}[name]
    raise AttributeError(f"module 'runner' has no attribute {name!r}")


__all__ = [
    "TARGET_FILES",
    "BenchmarkCache",
    "FakeRunner",
    "LiveRunner",
    "NoScenario",
    "RunMetrics",
    "Runner",
    "RunnerFailed",
    "WorkloadConfig",
    "get_runner",
    "wrap_command",
]
