"""obd's in-job plugin: snapshots (save at a step boundary, prove it, stop) and metrics for training jobs.

`SnapshotCallback` is the transformers.Trainer callback (imported lazily, so `import
trainer_plugin` never pulls in transformers or torch); the other names are the helpers for
custom training loops (see `trainer_plugin.loop`), and `stopped_for_snapshot(trainer=None)`, which
says whether a training stopped mid-way for a snapshot (a Trainer's, or any of this process's).
Outside obd (no OBD_RUN_DIR) all of it is a no-op.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .callback import SnapshotCallback
    from .loop import begin, checkpoint_dir, end, log_metrics, resume_from, snapshot_requested, write_proof
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

# Where each public name lives. They are imported on first use (PEP 562), so importing one
# module of the package (`trainer_plugin.rundir`, as the `obd` command does for the reason
# words) costs that module alone; SnapshotCallback subclasses transformers.TrainerCallback, so
# transformers is only imported when someone asks for it.
_HOMES = {
    "SnapshotCallback": ".callback",
    "begin": ".loop",
    "checkpoint_dir": ".loop",
    "end": ".loop",
    "log_metrics": ".loop",
    "resume_from": ".loop",
    "snapshot_requested": ".loop",
    "write_proof": ".loop",
    "REASONS": ".runtime",
    "VERSION": ".runtime",
    "IncompleteCheckpoint": ".runtime",
    "StoppedForSnapshot": ".runtime",
    "stopped_for_snapshot": ".runtime",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        name = "VERSION"
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'trainer_plugin' has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # found once: a loop's obd.log_metrics per step is a plain lookup after that
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__", "VERSION"})
