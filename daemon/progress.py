"""A run's progress (step of max steps, loss, ETA) from the `begin` and last `log` lines of its metrics.jsonl.

Pure: the follow hands over each probe; only finite numbers of the right type are taken, since
anyone who can write the run directory writes these lines.
"""

from __future__ import annotations

import math
from typing import Any

from daemon.models import RunRecord
from executors.base import RunProbe
from trainer_plugin.rundir import checkpoint_relpath, checkpoint_step


def finite(value: object) -> float | None:
    """`value` as a float when it is a finite int or float (never a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def update_progress(record: RunRecord, probe: RunProbe, now: float) -> None:
    """Fold a probe's metrics summary into `record.progress`."""
    begin, log = probe.begin or {}, probe.last_log or {}
    max_steps = begin.get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
        record.progress.max_steps = max_steps
    step = log.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        record.progress.step = step
    if "loss" in log:
        record.progress.loss = finite(log.get("loss"))
    record.progress.eta_seconds = eta_seconds(begin, log, record.progress.max_steps, now)
    steps = [s for s in (checkpoint_step(n) for n in probe.checkpoints) if s is not None]
    if steps:
        record.progress.last_checkpoint = checkpoint_relpath(max(steps))


def eta_seconds(begin: dict[str, Any], log: dict[str, Any], max_steps: int | None, now: float) -> float | None:
    """Seconds left at the pace since `begin`, less the time since the last `log` line; None when unknown."""
    start_time, log_time = finite(begin.get("time")), finite(log.get("time"))
    step, first = log.get("step"), begin.get("start_step") or 0
    if start_time is None or log_time is None or max_steps is None:
        return None
    if not isinstance(step, int) or not isinstance(first, int):
        return None
    done = step - first
    if done <= 0 or log_time <= start_time:
        return None
    per_step = (log_time - start_time) / done
    return max(0.0, (max_steps - step) * per_step - max(0.0, now - log_time))
