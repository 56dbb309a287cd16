"""Curves that continue (issue 26 item 7; docs/trackers.md): every attempt of a chain, and every run
resumed from it, logs to one experiment-tracker run, so a loss curve in W&B, MLflow or TensorBoard
does not break into one run per retry, preemption or resume.

obd gives each attempt the chain's identity through the trackers' own variables, in its job's
environment: W&B `WANDB_RUN_ID` (made from the chain's first attempt's id) with `WANDB_RESUME=allow`;
MLflow `MLFLOW_RUN_ID`, once an attempt's job has opened one (an MLflow run id must exist on its
server, so obd never makes one up: the `begin` line says which run the job's Trainer opened);
TensorBoard `TENSORBOARD_LOGGING_DIR` (transformers 5 reads it; the plugin sets `logging_dir` from
`OBD_TRACKER_DIR` on older ones), one directory in the first attempt's output/; and
`OBD_TRACKER_NAME`, the Trainer's `run_name` where the script left none (trackio knows runs by
name). A name the user set (`--env`, `--secret`, or the caller's environment on a local target) is
never replaced. The record keeps it all (`RunRecord.trackers`), so it holds across daemon restarts.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from daemon.service.models import RunRecord, Trackers
from executors.base import BeginLine
from trainer_plugin import rundir
from trainer_plugin.plugin.trackers import TRACKER_DIR, TRACKER_NAME

WANDB_RUN_ID, WANDB_RESUME = "WANDB_RUN_ID", "WANDB_RESUME"
MLFLOW_RUN_ID = "MLFLOW_RUN_ID"
TENSORBOARD_DIR = "TENSORBOARD_LOGGING_DIR"
# What an MLflow run id looks like (a uuid's hex; other servers' ids are of the same letters): a
# `begin` line is the job's word, taken only as far as it makes sense.
_MLFLOW_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# W&B run ids: at most 64 characters, none of `/\\#?%:`; obd's are lowercase letters, digits and `-`.
_WANDB_UNSAFE = re.compile(r"[^a-z0-9_-]+")
_WANDB_MAX = 64


def continued(record: RunRecord, source: RunRecord | None) -> Trackers:
    """The tracker run a new run logs to: its source's (the attempt it follows in a chain, or the run
    it resumes), else a new one rooted at itself. A source from before obd kept one is rooted at its
    chain's first attempt, with no TensorBoard directory known."""
    if source is None:
        return Trackers(root=record.id, target=record.target)
    if source.trackers is not None:
        return source.trackers.model_copy()
    return Trackers(root=source.chain or source.id, target=source.target)


def wandb_run_id(root: str) -> str:
    """The W&B run id of a chain: `obd-<its first attempt's id>`, lowercase, valid for W&B."""
    return ("obd-" + _WANDB_UNSAFE.sub("-", root.lower()))[:_WANDB_MAX]


def chain_tensorboard_dir(record: RunRecord, remote_dir: str, shares_machine: bool) -> str | None:
    """Where the chain's TensorBoard logs go, fixed once by its first attempt: `output/runs/<root>` in
    that attempt's run directory. None where a later attempt cannot write it: on another target, or
    on a target whose every attempt is a machine of its own (a pod)."""
    trackers = record.trackers
    if trackers is None or not shares_machine or trackers.target != record.target:
        return None
    if trackers.tensorboard_dir is None and trackers.root == record.id:
        trackers.tensorboard_dir = f"{rundir.RunPaths(remote_dir).output}/runs/{record.id}"
    return trackers.tensorboard_dir


def tracker_env(record: RunRecord, user_set: Collection[str], tensorboard_dir: str | None) -> dict[str, str]:
    """The variables that give the job its chain's tracker run; none the user set (`user_set`: the
    names of `--env`, `--secret` and the caller's environment where it is used)."""
    trackers = record.trackers
    if trackers is None:
        return {}
    env: dict[str, str] = {}
    if WANDB_RUN_ID not in user_set:
        env[WANDB_RUN_ID] = wandb_run_id(trackers.root)
        if WANDB_RESUME not in user_set:
            env[WANDB_RESUME] = "allow"  # the first attempt makes the run, the next ones continue it
    if trackers.mlflow_run_id is not None and MLFLOW_RUN_ID not in user_set:
        env[MLFLOW_RUN_ID] = trackers.mlflow_run_id
    if tensorboard_dir is not None and TENSORBOARD_DIR not in user_set:
        env[TENSORBOARD_DIR] = env[TRACKER_DIR] = tensorboard_dir
    env[TRACKER_NAME] = wandb_run_id(trackers.root)
    return env


def learn(record: RunRecord, begin: BeginLine | None) -> bool:
    """Keep the MLflow run the attempt's job opened (its `begin` line), for the attempts after it;
    the first one seen on the chain stays. True when that changed the record."""
    trackers = record.trackers
    if trackers is None or begin is None or trackers.mlflow_run_id is not None:
        return False
    found = begin.mlflow_run_id
    if found is None or not _MLFLOW_ID.fullmatch(found):
        return False
    trackers.mlflow_run_id = found
    return True
