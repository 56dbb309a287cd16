"""Step time, tokens per second and step counts from the plugin's `metrics.jsonl`.

The plugin (rank 0) writes a `begin` line, a `log` line every logging step with the global step,
the wall time and the cumulative input tokens of all ranks, and an `end` line. Between Trainer
logs it also writes heartbeat `log` lines (`"heartbeat": true`, no `loss`) at a step end, at most
every OBD_PROGRESS_INTERVAL seconds: they carry the same step, time and cumulative tokens, taken
at a step end like the Trainer's, so they are pace points like any other `log` line (only the
loss, which nothing here reads, is missing). Rates are taken between the first and the last `log`
lines, so model loading and the first step's warm-up stay out of them whenever there are two log
lines or more. The file is read line by line.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass
class StepLog:
    """What `metrics.jsonl` says about the run's pace; only a few lines are kept, whatever its length."""

    begin: dict | None = None
    end: dict | None = None
    first_log: dict | None = None
    last_log: dict | None = None
    first_tokens: dict | None = None  # first `log` line that counted tokens
    last_tokens: dict | None = None
    log_lines: int = 0
    bad_lines: int = 0
    found: bool = False


def read_metrics_jsonl(path: Path) -> StepLog:
    """Fold `metrics.jsonl` into a `StepLog`; a missing or broken file gives an empty one."""
    log = StepLog()
    try:
        with open(path, encoding="utf-8", errors="replace") as stream:
            log.found = True
            for line in stream:
                if line.strip():
                    _fold_line(log, line)
    except OSError:
        pass  # missing: `found` stays False; cut by a failing disk: the lines read so far count
    return log


def _fold_line(log: StepLog, line: str) -> None:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        log.bad_lines += 1  # a line cut short by a kill, or garbage
        return
    if not isinstance(event, dict):
        log.bad_lines += 1
        return
    kind = event.get("event")
    if kind == "begin" and log.begin is None:
        log.begin = event
    elif kind == "end":
        log.end = event
    elif kind == "log":
        if _finite(event.get("step")) is None or _finite(event.get("time")) is None:
            log.bad_lines += 1  # a log line without a finite step and time cannot be placed
            return
        log.log_lines += 1
        if log.first_log is None:
            log.first_log = event
        log.last_log = event
        if _finite(event.get("tokens")) is not None:
            if log.first_tokens is None:
                log.first_tokens = event
            log.last_tokens = event


@dataclass
class Pace:
    steps: int | None = None
    step_time_s: float | None = None
    tokens_per_sec: float | None = None
    world_size: int | None = None
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def pace(log: StepLog) -> Pace:
    """Steps run, seconds per step and tokens per second, each with its source or a warning."""
    out = Pace()
    if not log.found:
        out.warnings.append(
            "metrics.jsonl is missing: no step time, tokens/s or step count "
            "(the job did not run the obd plugin, or the file was not retrieved)"
        )
        return out
    if log.bad_lines:
        out.warnings.append(f"metrics.jsonl: {log.bad_lines} unreadable lines skipped")
    begin = log.begin or {}
    start_step = int(_finite(begin.get("start_step")) or 0)
    world = _finite(begin.get("world_size"))
    out.world_size = int(world) if world and world >= 1 else None

    final = _finite((log.end or {}).get("step"))
    if final is None and log.last_log is not None:
        final = _finite(log.last_log.get("step"))
    if final is not None:
        out.steps = max(0, int(final) - start_step)
        out.sources["steps"] = f"metrics.jsonl: steps {start_step} to {int(final)}"
    else:
        out.warnings.append("metrics.jsonl has no log or end line with a step: the step count is unknown")

    first, last = log.first_log, log.last_log
    if first is not None and last is not None and last is not first:
        _rates_between(first, last, log, out, "log lines")
    elif last is not None and _finite(begin.get("time")) is not None:
        # One log line only: measure from `begin`, which includes the first step's warm-up.
        anchor = {"step": start_step, "time": begin["time"], "tokens": 0}
        _rates_between(anchor, last, log, out, "the begin line and the only log line")
        out.warnings.append("metrics.jsonl has a single log line: step time and tokens/s include warm-up")
    else:
        out.warnings.append("metrics.jsonl has fewer than two timed lines: no step time or tokens/s")
    return out


def _gain(first: dict, last: dict, key: str) -> float | None:
    """How much `key` grew from one line to a later one; None when either line lacks a finite value."""
    a, b = _finite(first.get(key)), _finite(last.get(key))
    return None if a is None or b is None else b - a


def _rates_between(first: dict, last: dict, log: StepLog, out: Pace, what: str) -> None:
    steps, seconds = _gain(first, last, "step"), _gain(first, last, "time")
    if steps is not None and seconds is not None and steps > 0 and seconds > 0:
        out.step_time_s = seconds / steps
        out.sources["step_time_s"] = (
            f"metrics.jsonl: {seconds:.4g} s over steps {int(first['step'])} to {int(last['step'])}, between {what}"
        )
    else:
        out.warnings.append("metrics.jsonl: the log lines do not advance in both step and time")
        return
    a, b = (log.first_tokens, log.last_tokens) if what == "log lines" else (first, log.last_tokens)
    if a is None or b is None or a is b:
        out.warnings.append(
            "metrics.jsonl has no token counts: tokens/s unknown "
            "(the plugin counts tokens only when batches carry input_ids)"
        )
        return
    tokens = (_finite(b.get("tokens")) or 0.0) - (_finite(a.get("tokens")) or 0.0)
    span = _gain(a, b, "time")
    if tokens >= 0 and span is not None and span > 0:
        out.tokens_per_sec = tokens / span
        out.sources["tokens_per_sec"] = (
            f"metrics.jsonl: {tokens:.0f} input tokens (all ranks) in {span:.4g} s, cumulative counts of the plugin"
        )
    else:
        out.warnings.append("metrics.jsonl: token counts go backwards; tokens/s not computed")
