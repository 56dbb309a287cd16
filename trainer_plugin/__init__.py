"""obd's in-job plugin: snapshots (save at a step boundary, prove it, stop) and metrics for training jobs.

`SnapshotCallback` is the transformers.Trainer callback (imported lazily, so `import
trainer_plugin` never pulls in transformers or torch); the other names are the helpers for
custom training loops (see `trainer_plugin.loop`), and `stopped_for_snapshot(trainer=None)`, which
says whether a training stopped mid-way for a snapshot (a Trainer's, or any of this process's).
Outside obd (no OBD_RUN_DIR) all of it is a no-op.
"""

from __future__ import annotations

from typing import Any

from .loop import (
    begin,
    checkpoint_dir,
    end,
    log_metrics,
    resume_from,
    snapshot_requested,
    write_proof,
)
from .runtime import REASONS, VERSION, IncompleteCheckpoint, StoppedForSnapshot, stopped_for_snapshot

__version__ = VERSION
__all__ = [
    "REASONS",
    "IncompleteCheckpoint",
    "SnapshotCallback",
    "StoppedForSnapshot",
    "begin",
    "checkpoint_dir",
    "end",
    "log_metrics",
    "resume_from",
    "snapshot_requested",
    "stopped_for_snapshot",
    "write_proof",
]


def __getattr__(name: str) -> Any:
    # PEP 562: SnapshotCallback subclasses transformers.TrainerCallback, so it is only
    # imported (with transformers) when someone asks for it.
    if name == "SnapshotCallback":
        from .callback import SnapshotCallback

        return SnapshotCallback
    raise AttributeError(f"module 'trainer_plugin' has no attribute {name!r}")
