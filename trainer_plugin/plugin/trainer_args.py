"""What obd changes in a Trainer's arguments: its output_dir (the run's output/) and its resume
(OBD_RESUME_FROM), and whether the train() under way resumed from obd's checkpoint.

Apart from the injection (inject.py, which patches Trainer and imports the callback when a
Trainer is made) because the callback uses these too: both import this module, neither the
other's. Standard library only at import time.
"""

from __future__ import annotations

import os
from typing import Any

from .runtime import RunEnv, log_error

_resume_used = False  # OBD_RESUME_FROM applies to the first train() call of the process only
_resumed_now = False  # the train() under way resumed from OBD_RESUME_FROM


def train_returned() -> None:
    """The train() under way returned: a later one did not resume from obd's checkpoint."""
    global _resumed_now
    _resumed_now = False


def resumed_from_obd() -> bool:
    """Whether the train() under way resumed from the checkpoint obd named (OBD_RESUME_FROM)."""
    return _resumed_now


def redirect_output_dir(training_args: Any, env: RunEnv) -> None:
    """Point the Trainer's output_dir at the run's output/, remembering what the script asked for."""
    if training_args is None or not env.output_dir:
        return
    if getattr(training_args, "_obd_output_dir_requested", None) is None:
        # Set once: the same TrainingArguments object may serve several Trainers.
        training_args._obd_output_dir_requested = str(training_args.output_dir)
    training_args.output_dir = env.output_dir


def requested_output_dir(training_args: Any) -> str | None:
    """What the script had asked for as output_dir before obd redirected it."""
    value = getattr(training_args, "_obd_output_dir_requested", None)
    return value if value is not None else getattr(training_args, "output_dir", None)


def with_training_args(args: tuple, kwargs: dict, env: RunEnv) -> tuple[tuple, dict]:
    """Trainer's (args, kwargs) with its TrainingArguments pointed at the run's output/."""
    # Trainer(model=None, args=None, ...): find `args` by keyword or position and redirect it
    # before __init__ runs, so the script's output_dir is never even created.
    if "args" in kwargs:
        if kwargs["args"] is None:
            kwargs = {**kwargs, "args": default_training_args(env)}
        else:
            redirect_output_dir(kwargs["args"], env)
    elif len(args) > 1:
        if args[1] is None:
            args = (args[0], default_training_args(env), *args[2:])
        else:
            redirect_output_dir(args[1], env)
    else:
        kwargs = {**kwargs, "args": default_training_args(env)}
    return args, kwargs


def default_training_args(env: RunEnv) -> Any:
    """What Trainer builds when given no arguments, minus the stray ./tmp_trainer directory."""
    from transformers import TrainingArguments

    training_args: Any = TrainingArguments(output_dir=env.output_dir)
    training_args._obd_output_dir_requested = "tmp_trainer"
    return training_args


def with_resume(args: tuple, kwargs: dict, env: RunEnv) -> tuple[tuple, dict]:
    """Resume the first train() call from OBD_RESUME_FROM unless the script named a checkpoint itself."""
    global _resume_used
    if not env.resume_from or _resume_used:
        return args, kwargs
    _resume_used = True
    given = kwargs.get("resume_from_checkpoint", args[0] if args else None)
    if isinstance(given, str) and given:
        log_error(f"obd: the script resumes from {given}; OBD_RESUME_FROM={env.resume_from} is not used")
        return args, kwargs
    if not os.path.isdir(env.resume_from):
        raise FileNotFoundError(f"obd: OBD_RESUME_FROM={env.resume_from} is not a directory")
    # None, False and True (= "the last checkpoint in output_dir", which is the run's empty output/)
    # all mean: resume from the checkpoint obd was asked to resume from.
    if args:
        args = (env.resume_from, *args[1:])
    else:
        kwargs = {**kwargs, "resume_from_checkpoint": env.resume_from}
    log_error(f"obd: resuming from {env.resume_from}")
    global _resumed_now
    _resumed_now = True
    return args, kwargs
