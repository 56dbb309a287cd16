"""A pytest plugin for scripts/gpu_check.sh (`-p tests.gpu.report`): each test's outcome, kept as it happens.

Every test's result (passed, failed, skipped with its reason) is appended to `OBD_GPU_RESULTS`
the moment the test ends, beside the figures `harness.record` keeps there; so a check cut short
by the script's time limit still leaves the outcomes of the tests that ran, which a report
written at the end of the session (--junitxml) would lose.
"""

from __future__ import annotations

import json
import os
import time

import pytest


def _message(report: pytest.TestReport) -> str:
    """The skip reason, or the failure's own message (its first lines), short."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    text = str(getattr(crash, "message", "") or "") or report.longreprtext or ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(lines[:4])[:600]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep every phase's duration (a module's runs happen in its first test's setup), and the outcome of
    the phase that decides it: a setup that skipped or failed, the call, a teardown that failed."""
    path = os.environ.get("OBD_GPU_RESULTS")
    if not path:
        return
    entries: list[dict[str, object]] = [
        {"kind": "phase", "test": report.nodeid, "when": report.when, "duration_s": round(report.duration, 2)}
    ]
    decisive = (
        report.when == "call"
        or (report.when == "setup" and not report.passed)
        or (report.when == "teardown" and report.failed)
    )
    if decisive:
        outcome = "error" if report.failed and report.when != "call" else report.outcome
        entries.append(
            {
                "kind": "outcome",
                "test": report.nodeid,
                "outcome": outcome,
                "message": _message(report),
                "time": time.time(),
            }
        )
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
