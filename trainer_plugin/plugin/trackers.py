"""Curves that continue across a chain's attempts, on the job's side (docs/trackers.md).

The daemon gives each attempt its chain's identity in the trackers' own variables (`WANDB_RUN_ID`,
`MLFLOW_RUN_ID`, `TENSORBOARD_LOGGING_DIR`). Two things only the job can do are here: a Trainer
whose TensorBoard directory is `args.logging_dir` (transformers before 5, which does not read
`TENSORBOARD_LOGGING_DIR`) and a tracker named by `args.run_name` (trackio) get the chain's, from
`OBD_TRACKER_DIR` and `OBD_TRACKER_NAME`, when the script left them at their defaults; and the
`begin` line says which W&B and MLflow runs the attempt logs to, so the daemon can hand an MLflow
run (which must exist on its server) to the next attempt. Standard library only.
"""

from __future__ import annotations

import os
import sys
from typing import Any

TRACKER_DIR = "OBD_TRACKER_DIR"  # the chain's TensorBoard directory
TRACKER_NAME = "OBD_TRACKER_NAME"  # the chain's run name, for a tracker that knows runs by name


def continue_in_args(training_args: Any, requested_output_dir: str | None) -> None:
    """Point the Trainer's `logging_dir` and `run_name` at the chain's, where obd gave them and the
    script left the Trainer's defaults: `logging_dir` unset or `<its output_dir>/runs/<time>_<host>`,
    `run_name` unset or its output_dir (older transformers' default). A value the script chose stays."""
    if training_args is None:
        return
    folder = os.environ.get(TRACKER_DIR)
    if folder and hasattr(training_args, "logging_dir"):
        current = training_args.logging_dir
        if current is None or _default_logging_dir(str(current), requested_output_dir):
            training_args.logging_dir = folder
    name = os.environ.get(TRACKER_NAME)
    if name and hasattr(training_args, "run_name"):
        current = training_args.run_name
        if current is None or (requested_output_dir is not None and str(current) == requested_output_dir):
            training_args.run_name = name


def _default_logging_dir(logging_dir: str, requested_output_dir: str | None) -> bool:
    """Whether `logging_dir` is the one transformers made up: `<output_dir>/runs/<something>`."""
    if requested_output_dir is None:
        return False
    runs = os.path.normpath(os.path.join(requested_output_dir, "runs"))
    return os.path.dirname(os.path.normpath(logging_dir)) == runs


def tracker_ids() -> dict[str, str | None]:
    """The W&B and MLflow runs this process logs to, where their libraries are loaded and a run is
    active (the Trainer's callbacks start them at train begin, before obd's); None otherwise.
    Never raises into training."""
    return {"wandb_run_id": _wandb_run_id(), "mlflow_run_id": _mlflow_run_id()}


def _wandb_run_id() -> str | None:
    wandb = sys.modules.get("wandb")
    try:
        run = getattr(wandb, "run", None)
        value = getattr(run, "id", None)
    except Exception:
        return None
    return value if isinstance(value, str) else None


def _mlflow_run_id() -> str | None:
    mlflow = sys.modules.get("mlflow")
    active = getattr(mlflow, "active_run", None)
    if active is None:
        return None
    try:
        run = active()
        value = getattr(getattr(run, "info", None), "run_id", None)
    except Exception:
        return None
    return value if isinstance(value, str) else None
