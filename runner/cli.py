"""`obd profile parse DIR [--json]`: parse a profile directory by hand, without the daemon.

DIR may be a run directory (holding `profile/` and `metrics.jsonl`), a `profile/` directory, or
any directory rocprofv3 wrote into (its default `HOST/PID_kernel_trace.csv` layout and the
`-o NAME` layout both). Also runnable as `python -m runner.cli DIR [--json]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from runner.assemble import parse_run
from runner.discover import find_profile_files
from runner.format import format_metrics
from trainer_plugin import rundir

USAGE = "usage: obd profile parse DIR [--json]"


def _locate(directory: Path) -> tuple[Path, Path | None]:
    """(profile directory, metrics.jsonl or None) for a run, profile or rocprofv3 output directory."""
    paths = rundir.RunPaths(directory)
    if Path(paths.profile).is_dir():
        metrics = Path(paths.metrics)
        return Path(paths.profile), metrics if metrics.is_file() else None
    for candidate in (Path(paths.metrics), Path(rundir.RunPaths(directory.parent).metrics)):
        if candidate.is_file() and (candidate.parent == directory or directory.name == rundir.PROFILE):
            return directory, candidate
    return directory, None


def profile_parse_main(argv: list[str]) -> int:
    """Parse DIR and print the human table (or the RunMetrics JSON); 2 on bad usage, 1 on a missing DIR or one
    with nothing to parse."""
    as_json = False
    positional: list[str] = []
    for arg in argv:
        if arg in ("-h", "--help"):
            print(f"{USAGE}\n\n{(__doc__ or '').strip()}")
            return 0
        if arg == "--json":
            as_json = True
        elif arg.startswith("-") and arg != "-":
            print(f"obd profile parse: unknown option {arg!r}\n{USAGE}", file=sys.stderr)
            return 2
        else:
            positional.append(arg)
    if len(positional) != 1:
        what = "a directory is required" if not positional else f"one directory expected, got {len(positional)}"
        print(f"obd profile parse: {what}\n{USAGE}", file=sys.stderr)
        return 2
    directory = Path(positional[0])
    if not directory.is_dir():
        reason = "is not a directory" if directory.exists() else "does not exist"
        print(f"obd profile parse: {directory} {reason}", file=sys.stderr)
        return 1
    profile_dir, metrics_file = _locate(directory)
    found = find_profile_files(profile_dir)
    if metrics_file is None and found.runner_json is None and not found.any_profile():
        print(
            f"obd profile parse: found nothing to parse in {directory}: no rocprofv3 output (*_kernel_trace.csv, "
            "*_kernel_stats.csv), amd-smi CSV/JSON, torch.profiler summary, runner.json or metrics.jsonl. "
            "Give a run directory (holding profile/), its profile/, or the directory rocprofv3 wrote into (-d)",
            file=sys.stderr,
        )
        return 1
    metrics = parse_run(profile_dir, metrics_file).model_dump(mode="json")
    if as_json:
        print(json.dumps(metrics, indent=2))
    else:
        sys.stdout.write(format_metrics(metrics))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["profile", "parse"]:
        args = args[2:]
    return profile_parse_main(args)


if __name__ == "__main__":
    sys.exit(main())
