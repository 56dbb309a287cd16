"""A run's launch settings (`launch.json`): what a run that waits needs to start later.

Its request (`--env` values and secrets included), its user, and the caller's environment for a
target whose jobs start from it, kept beside its record, readable by the daemon's user only, and
only while an attempt of its chain may still start from it: the file is deleted when the chain
ends (daemon/service/recovery.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Collection

from daemon.service.api import ApiError, StartRequest
from daemon.service.config import ConfigError
from daemon.service.placement import reachable
from daemon.service.ports import Runs
from daemon.service.store import LAUNCH_SETTINGS
from executors.base import RunAs
from executors.factory import is_this_machine
from trainer_plugin.rundir import atomic_write, read_regular

SPEC = LAUNCH_SETTINGS


def uses_caller_environment(daemon: Runs, target: str) -> bool:
    """Whether a job on this target starts from its caller's environment: only a local target's
    (this machine's). SSH, Slurm and pod jobs start from their machine's, so the caller's
    environment is neither kept nor used for them."""
    try:  # any target it may run on: of several (`--target a,b`, a pool), and their overflows
        return any(is_this_machine(daemon.config.target(t)) for t in reachable(daemon.config, target))
    except (ConfigError, ApiError):
        return False  # an unknown target: the start is refused, nothing is kept


def save_spec(daemon: Runs, run_id: str, req: StartRequest, run_as: RunAs | None) -> None:
    """Keep what a run needs to start later (its request, values included, and its user), in a
    file only the daemon's user can read; the caller's environment only where it is used."""
    directory = daemon.store.run_dir(run_id)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(str(directory / SPEC), spec_bytes(daemon, req, run_as), 0o600)


def spec_bytes(daemon: Runs, req: StartRequest, run_as: RunAs | None) -> bytes:
    """`launch.json` as `save_spec` writes it (the store writes it beside a new record, in one trip)."""
    if req.environ is not None and (req.env_clear or not uses_caller_environment(daemon, req.target)):
        req = req.model_copy(update={"environ": None})
    data = {"request": req.model_dump(mode="json"), "run_as": run_as.model_dump() if run_as else None}
    return json.dumps(data).encode()


def load_spec(daemon: Runs, run_id: str) -> tuple[StartRequest, RunAs | None] | None:
    raw = read_regular(str(daemon.store.run_dir(run_id) / SPEC), 16 << 20)
    if not raw:
        return None
    try:
        data = json.loads(raw)
        req = StartRequest.model_validate(data["request"])
        run_as = RunAs.model_validate(data["run_as"]) if data.get("run_as") else None
    except (ValueError, KeyError, TypeError):
        return None
    return req, run_as


def drop_spec(daemon: Runs, run_id: str) -> None:
    """Delete a run's launch.json (its caller's environment, `--env` values and secrets) once
    nothing can start from the run again. Deleted, not emptied: no value of it stays on disk. A
    resume takes the resumer's values, never these. Removed by the store's writer thread (a
    sweep of 1,000 cancelled is 1,000 unlinks, seconds on a busy disk: never on the event loop);
    one a crash left is removed by the next start's catch-up."""
    if not daemon.started:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(daemon.store.run_dir(run_id) / SPEC)
        return
    if daemon.store.drop_later(run_id, SPEC):
        daemon.start_soon(daemon.store.flush)


def drop_orphan_specs(daemon: Runs, keep: Collection[str]) -> None:
    """Delete the launch settings of run directories with no record at all (a start whose record
    could not be saved after its launch.json was, a crash amid the write of one), with any
    temporary copy left behind. The runs in `keep` and those whose record is there but unreadable
    (it may be mended by hand, and its run started) are left alone."""
    try:
        names = os.listdir(daemon.store.runs_dir)
    except FileNotFoundError:
        return
    for name in names:
        directory = daemon.store.runs_dir / name
        if name in keep or os.path.lexists(directory / "run.json"):
            continue
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.listdir(directory):
                if entry == SPEC or entry.startswith(f".{SPEC}.tmp."):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(directory / entry)
