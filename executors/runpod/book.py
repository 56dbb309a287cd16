"""The driver's own records: the id of this obd install, and a book of the pods it made.

The book (`STATE_DIR/runpod/pods/<run id>.json`) outlives run records, so `obd pods retrieve`
and the reconcile know a pod's run, target, workdir and host key even when the daemon or the
run's record is gone.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from executors.base import ExecutorError
from executors.runpod.info import PodInfo
from trainer_plugin.rundir import is_run_id


def owner_id(state_dir: Path) -> str:
    """A stable random id of this obd install, created once in `state_dir/runpod/owner`."""
    path = Path(state_dir) / "runpod" / "owner"
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate = secrets.token_hex(8)
    tmp = path.with_name(f".owner.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(candidate + "\n")
    try:
        os.link(tmp, path)  # first writer wins; a concurrent one reads the winner's id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


class BookEntry(BaseModel):
    """What the book holds of one run's pod."""

    model_config = ConfigDict(extra="ignore")

    target_info: PodInfo | None = None
    remote_dir: str | None = None  # the run directory on the pod, once the run ended
    local_dir: str | None = None  # where its outputs go on this machine
    retrieved: float | None = None  # when the outputs were retrieved and verified
    finished: float | None = None  # when obd was done with the pod
    terminated: bool = False
    pod_gone: bool = False  # the pod had vanished when obd came to empty it


class PodBook:
    """One JSON file per run, written atomically."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "runpod" / "pods"

    def put(self, run_id: str, **fields: Any) -> BookEntry:
        """Update the run's entry with these fields (a PodInfo for `target_info`)."""
        if not is_run_id(run_id):
            raise ExecutorError(f"invalid run id {run_id!r}; see `obd train list`")
        current = self.get(run_id) or BookEntry()
        entry = BookEntry.model_validate({**current.model_dump(), **fields})
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{run_id}.json.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(entry.model_dump(mode="json", exclude_none=True), sort_keys=True))
        os.replace(tmp, self.dir / f"{run_id}.json")
        return entry

    def get(self, run_id: str) -> BookEntry | None:
        if not is_run_id(run_id):
            return None
        return _read(self.dir / f"{run_id}.json")

    def info(self, run_id: str) -> PodInfo | None:
        """The run's pod as last booked."""
        entry = self.get(run_id)
        return entry.target_info if entry else None

    def all(self) -> dict[str, BookEntry]:
        out: dict[str, BookEntry] = {}
        for path in sorted(self.dir.glob("*.json")):
            entry = _read(path)
            if entry is not None:
                out[path.stem] = entry
        return out


def _read(path: Path) -> BookEntry | None:
    try:
        return BookEntry.model_validate_json(path.read_bytes())
    except (OSError, ValidationError):
        return None
