"""A run's progress (step of max steps, loss, ETA) from the `begin` and last `log` lines of its metrics.jsonl.

Pure: the follow hands over each probe; only finite numbers of the right type are taken, since
anyone who can write the run directory writes these lines.
"""

from __future__ import annotations

from daemon.models import RunRecord
from executors.base import BeginLine, JobState, LogLine, RunProbe
from trainer_plugin.rundir import checkpoint_relpath, checkpoint_step


def update_progress(record: RunRecord, probe: RunProbe, now: float) -> None:
    """Fold a probe's metrics summary into `record.progress`."""
    begin, log = probe.begin or BeginLine(), probe.last_log or LogLine()
    if begin.max_steps is not None and begin.max_steps > 0:
        record.progress.max_steps = begin.max_steps
    if log.step is not None:
        record.progress.step = log.step
    if log.has_loss:
        record.progress.loss = log.loss
    record.progress.eta_seconds = eta_seconds(begin, log, record.progress.max_steps, now)
    phase = probe.phase
    if probe.ended and probe.status.state == JobState.running and record.snapshot is None:
        # Training ended and the job goes on: the script's code after train() (the plugin says so
        # in a `phase` line only when a stop comes then).
        if record.progress.phase != "after_train":
            record.progress.phase, record.progress.phase_since = "after_train", now
    elif phase is not None and phase.phase is not None and phase.phase != record.progress.phase:
        record.progress.phase, record.progress.phase_since = phase.phase, phase.time or now
    steps = [s for s in (checkpoint_step(n) for n in probe.checkpoints) if s is not None]
    if steps:
        record.progress.last_checkpoint = checkpoint_relpath(max(steps))


def eta_seconds(begin: BeginLine, log: LogLine, max_steps: int | None, now: float) -> float | None:
    """Seconds left at the pace since `begin`, less the time since the last `log` line; None when unknown."""
    if begin.time is None or log.time is None or max_steps is None or log.step is None:
        return None
    done = log.step - (begin.start_step or 0)
    if done <= 0 or log.time <= begin.time:
        return None
    per_step = (log.time - begin.time) / done
    return max(0.0, (max_steps - log.step) * per_step - max(0.0, now - log.time))
