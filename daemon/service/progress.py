"""A run's progress (step of max steps, loss, ETA) from the `begin` and last `log` lines of its metrics.jsonl.

Pure: the follow hands over each probe; only finite numbers of the right type are taken, since
anyone who can write the run directory writes these lines.
"""

from __future__ import annotations

from daemon.service.models import Progress, RunRecord
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
    if probe.last_save is not None and probe.last_save.seconds is not None and probe.last_save.seconds >= 0:
        record.progress.save_seconds = probe.last_save.seconds
    record.progress.stop_seconds = stop_estimate(record.progress, record.snapshots)
    steps = [s for s in (checkpoint_step(n) for n in probe.checkpoints) if s is not None]
    if steps:
        record.progress.last_checkpoint = checkpoint_relpath(max(steps))


def job_ended(record: RunRecord) -> None:
    """A job that ended has no time left to show (the rest of its progress stays)."""
    record.progress.eta_seconds = None


def eta_seconds(begin: BeginLine, log: LogLine, max_steps: int | None, now: float) -> float | None:
    """Seconds left at the pace since `begin`, less the time since the last `log` line; None when unknown."""
    if begin.time is None or log.time is None or max_steps is None or log.step is None:
        return None
    done = log.step - (begin.start_step or 0)
    if done <= 0 or log.time <= begin.time:
        return None
    per_step = (log.time - begin.time) / done
    return max(0.0, (max_steps - log.step) * per_step - max(0.0, now - log.time))


# How long a stop waits for a safe point at most (trainer_plugin/plugin/interrupt.py: the thread's look
# every 0.2 s, then a grace of 0.8 s for the loop's own safe point before it is interrupted).
SAFE_POINT_SECONDS = 1.0
# A save not measured yet: what a small LoRA checkpoint takes on a local disk.
UNMEASURED_SAVE_SECONDS = 5.0


def stop_estimate(progress: Progress, snapshots: bool) -> float | None:
    """Seconds from a stop request to its proof, by where the job's time goes now (issue 32).

    Training or evaluating: the nearest safe point (at most `SAFE_POINT_SECONDS`) and a save as long
    as the last one measured. Saving: that save is the snapshot, so at most one save. After
    training: no save, the job is ended at once. None for a job without the plugin.
    """
    if not snapshots:
        return None
    save = progress.save_seconds if progress.save_seconds is not None else UNMEASURED_SAVE_SECONDS
    if progress.phase == "after_train":
        return 0.0
    if progress.phase == "saving":
        return save
    return SAFE_POINT_SECONDS + save
