"""The GPU check's summary: one table of the checks and their outcomes, one of every figure with its source.

    python tests/gpu/summary.py RESULTS.jsonl [--machine TEXT] [--note TEXT] [--not-run TEXT]
                                [--markdown OUT.md] [--json OUT.json]

Reads what the checks kept in RESULTS.jsonl (figures from `harness.record`, outcomes from the
`tests.gpu.report` plugin), prints the tables, and writes them as Markdown (and everything as
JSON) where asked. A check with no outcome is `not run` (the time limit, or a crash, came first).
Standard library only. Exit status: 0 when every check that ran passed (or was skipped), 1 when
one failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

# Each check of issue 28: its title (as the figures name it) and the test files that prove it.
CHECKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("discovery and assignment", ("tests/gpu/test_discovery.py",)),
    (
        "stop/resume in bf16",
        ("tests/gpu/test_stop_resume.py::test_a_bf16", "tests/gpu/test_stop_resume.py::test_after"),
    ),
    ("snapshot against the disk", ("tests/gpu/test_stop_resume.py::test_the_snapshot",)),
    ("plugin cost per step", ("tests/bench/bench_gpu_plugin.py",)),
    ("live RunMetrics", ("tests/gpu/test_profile.py",)),
    ("DDP with NCCL", ("tests/gpu/test_ddp.py",)),
)


def load(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(figures, outcomes, phases) from the results file; a missing file or a bad line leaves them shorter."""
    figures: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        kind = entry.get("kind")
        (outcomes if kind == "outcome" else phases if kind == "phase" else figures).append(entry)
    return figures, outcomes, phases


NOT_RUN = "no test of this check reported (the time limit, or a crash, came first)"


def outcome_of(prefixes: tuple[str, ...], outcomes: list[dict[str, Any]], not_run: str = NOT_RUN) -> tuple[str, str]:
    """A check's outcome from its tests': failed if one failed, passed if one passed and none failed, else skipped."""
    mine = [o for o in outcomes if o["test"].startswith(prefixes)]
    if not mine:
        return "not run", not_run
    bad = [o for o in mine if o["outcome"] in ("failed", "error")]
    if bad:
        return "FAILED", "; ".join(f"{o['test'].split('::')[-1]}: {o['message']}" for o in bad)
    passed = [o for o in mine if o["outcome"] == "passed"]
    if passed:
        skipped = [o for o in mine if o["outcome"] == "skipped"]
        note = f"{len(passed)} test(s) passed" + (
            f", {len(skipped)} skipped: {skipped[0]['message']}" if skipped else ""
        )
        return "passed", note
    return "skipped", mine[0]["message"]


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def tables(
    figures: list[dict[str, Any]],
    outcomes: list[dict[str, Any]],
    phases: list[dict[str, Any]],
    not_run: str = NOT_RUN,
) -> tuple[list[list[str]], list[list[str]]]:
    """The checks' rows (title, outcome, time of its tests' setup, call and teardown, detail) and the figures' rows."""
    checks = []
    for title, prefixes in CHECKS:
        outcome, detail = outcome_of(prefixes, outcomes, not_run)
        seconds = sum(p.get("duration_s") or 0 for p in phases if p["test"].startswith(prefixes))
        checks.append([title, outcome, f"{seconds:.0f} s" if seconds else "", detail])
    rows = [
        [f["check"], f["name"], f"{f['value']} {f.get('unit') or ''}".strip(), f.get("source") or "NO SOURCE"]
        for f in figures
    ]
    return checks, rows


def markdown(checks: list[list[str]], rows: list[list[str]], machine: str, note: str) -> str:
    out = ["# obd GPU check", "", f"Run {time.strftime('%Y-%m-%d %H:%M:%S %Z')}. {machine}".rstrip(), ""]
    if note:
        out += [note, ""]
    out += ["| check | outcome | test time | detail |", "|---|---|---|---|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in checks]
    out += ["", "| check | figure | value | where it came from |", "|---|---|---|---|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows] or ["| (no figures were recorded) | | | |"]
    return "\n".join(out) + "\n"


def text(checks: list[list[str]], rows: list[list[str]]) -> str:
    """The tables for a terminal: the checks in columns, each figure on its line with its source below it."""
    width = max(len(c[0]) for c in checks)
    out = ["CHECK".ljust(width) + "  OUTCOME   DETAIL"]
    out += [f"{c[0].ljust(width)}  {c[1]:<9} {c[2] + '; ' if c[2] else ''}{c[3]}" for c in checks]
    out.append("")
    out.append("FIGURES (value, then where it came from)")
    for check, name, value, source in rows:
        out.append(f"  {check} | {name}: {value}")
        out.append(f"      from: {source}")
    if not rows:
        out.append("  (none recorded)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("--machine", default="", help="a line on the machine (GPUs, torch)")
    p.add_argument("--note", default="", help="a line put above the tables")
    p.add_argument("--not-run", default=NOT_RUN, help="what a check with no outcome says")
    p.add_argument("--markdown", type=Path)
    p.add_argument("--json", type=Path)
    opts = p.parse_args(argv)
    figures, outcomes, phases = load(opts.results)
    checks, rows = tables(figures, outcomes, phases, opts.not_run)
    print(text(checks, rows))
    if opts.markdown:
        opts.markdown.write_text(markdown(checks, rows, opts.machine, opts.note))
    if opts.json:
        document = {"machine": opts.machine, "figures": figures, "outcomes": outcomes, "phases": phases}
        opts.json.write_text(json.dumps(document, indent=1))
    return 1 if any(c[1] == "FAILED" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
