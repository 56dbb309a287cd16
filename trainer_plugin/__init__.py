"""What obd runs beside the job, in two rooms that share the run directory's contract (`rundir.py`):

- `plugin/`: the in-Trainer plugin, inside the job's process: snapshots (save at a step
  boundary, prove it, stop) and metrics. Its public names are this package's, below.
- `tools/`: the job-side tools, beside the job on its target: the job wrapper, the control of a
  run directory, the SSH helper, Slurm's batch helper, the pod watchdog. They are copied flat
  into one directory on remote hosts and run there by path (`tools/__init__.py`).

Neither room imports the other (pyproject.toml's contracts). `SnapshotCallback` is the
transformers.Trainer callback (imported lazily, so `import trainer_plugin` never pulls in
transformers or torch; asking for it installs the Trainer patch, as obd's sitecustomize does);
the other names are the helpers for custom training loops (`from trainer_plugin import loop`),
and `stopped_for_snapshot(trainer=None)`, which says whether a training stopped mid-way for a
snapshot (a Trainer's, or any of this process's). Outside obd (no OBD_RUN_DIR) all of it is a no-op.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plugin import loop, torch_profile
    from .plugin.callback import SnapshotCallback
    from .plugin.loop import begin, checkpoint_dir, end, log_metrics, resume_from, snapshot_requested, write_proof
    from .plugin.runtime import REASONS, VERSION, IncompleteCheckpoint, StoppedForSnapshot, stopped_for_snapshot

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
    "loop",
    "resume_from",
    "snapshot_requested",
    "stopped_for_snapshot",
    "torch_profile",
    "write_proof",
]

# Where each public name lives. They are imported on first use (PEP 562), so importing one
# module of the package (`trainer_plugin.rundir`, as the `obd` command does for the reason
# words) costs that module alone; SnapshotCallback subclasses transformers.TrainerCallback, so
# transformers is only imported when someone asks for it. `loop` and `torch_profile` are modules
# a custom loop imports by name (`from trainer_plugin import loop`).
_HOMES = {
    "SnapshotCallback": ".plugin.callback",
    "begin": ".plugin.loop",
    "checkpoint_dir": ".plugin.loop",
    "end": ".plugin.loop",
    "log_metrics": ".plugin.loop",
    "resume_from": ".plugin.loop",
    "snapshot_requested": ".plugin.loop",
    "write_proof": ".plugin.loop",
    "REASONS": ".plugin.runtime",
    "VERSION": ".plugin.runtime",
    "IncompleteCheckpoint": ".plugin.runtime",
    "StoppedForSnapshot": ".plugin.runtime",
    "stopped_for_snapshot": ".plugin.runtime",
}
_MODULES = {"loop": ".plugin.loop", "torch_profile": ".plugin.torch_profile"}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        name = "VERSION"
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name], __name__)
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name], __name__), name)
        if name == "SnapshotCallback":
            # A callback added by hand under obd with no sitecustomize (`python -S`) still gets
            # the Trainer patched for output_dir, OBD_RESUME_FROM and one callback a Trainer.
            importlib.import_module(".plugin.inject", __name__).install()
    else:
        raise AttributeError(f"module 'trainer_plugin' has no attribute {name!r}")
    globals()[name] = value  # found once: a loop's obd.log_metrics per step is a plain lookup after that
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "__version__", "VERSION"})
