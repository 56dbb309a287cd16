"""The run store: one `runs/<id>/run.json` per run, each saved whole or not at all.

A save writes a temporary file beside the record, fsyncs it, renames it over the record and
fsyncs the directory, so a SIGKILL or a power cut at any moment leaves the old record or the
new one, never half of one; a full disk leaves the old record and raises `StoreError`.

What such a kill leaves is cleared when the records are loaded (`load_all`, at the daemon's
start): the temporary files of atomic writes (`.NAME.tmp.*`) made before this process started,
and the directory of a start cut short before its record was first saved (no `run.json`, only
its `launch.json` or such temporary files, or nothing): its `obd train start` never answered,
so no one knows the run, and it would otherwise be listed `unreadable` for ever. A directory
with anything else in it is left as it is and listed `unreadable`, for a person to look at.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
from pydantic import ValidationError

from daemon.models import RunRecord, check_run_id
from trainer_plugin.rundir import atomic_write, is_run_id

log = structlog.get_logger("obd.store")
RECORD_LIMIT = 16 * 1024 * 1024
# A run's launch settings (daemon/queue.py), written before its first record: alone in a
# directory, they are what a start cut short left.
LAUNCH_SETTINGS = "launch.json"
_IMPORTED_AT = time.time()


def process_started() -> float:
    """When this process started, in wall-clock seconds (from /proc; where /proc cannot say, when
    this module was imported, which the daemon does as it starts)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])  # since boot
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])  # to the hundredth (btime is to the second)
        return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT


def is_temporary(name: str) -> bool:
    """Whether a name is that of an atomic write's temporary file (`rundir.atomic_write`)."""
    return name.startswith(".") and ".tmp." in name


class StoreError(Exception):
    pass


@dataclass(frozen=True)
class BadRecord:
    """A record that could not be read; reported, never overwritten, never fatal."""

    run_id: str
    path: Path
    error: str


class RunStore:
    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.runs_dir = state_dir / "runs"

    def ensure(self) -> None:
        self.runs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / check_run_id(run_id)

    def record_path(self, run_id: str) -> Path:
        return self.run_dir(run_id) / "run.json"

    def save(self, record: RunRecord) -> None:
        directory = self.run_dir(record.id)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = record.model_dump_json(indent=1).encode() + b"\n"
        path = directory / "run.json"
        try:
            atomic_write(str(path), data, 0o600)
        except OSError as exc:
            raise StoreError(
                f"could not save the record of run {record.id} ({exc.strerror or exc}); "
                f"the previous record in {path} is intact. Free space in {self.state_dir} and retry"
            ) from exc

    def load(self, run_id: str) -> RunRecord:
        return parse_record(self.record_path(run_id), run_id)

    def load_all(self, started: float | None = None) -> tuple[dict[str, RunRecord], list[BadRecord]]:
        """Every record, and those that cannot be read; what a crash left before `started` (this
        process's start by default) is cleared first (see the module's docstring)."""
        started = process_started() if started is None else started
        records: dict[str, RunRecord] = {}
        bad: list[BadRecord] = []
        if not self.runs_dir.is_dir():
            return records, bad
        for name in sorted(os.listdir(self.runs_dir)):
            entry = self.runs_dir / name
            if name.startswith(".") or not entry.is_dir():
                continue
            path = entry / "run.json"
            _clear_leftovers(entry, started)
            if _drop_unrecorded_start(entry):
                continue
            try:
                check_run_id(entry.name)
                records[entry.name] = parse_record(path, entry.name)
            except (StoreError, ValueError) as exc:
                bad.append(BadRecord(entry.name, path, str(exc)))
        return records, bad


def _clear_leftovers(directory: Path, started: float) -> None:
    """Remove the temporary files of atomic writes cut short (a SIGKILL between write and rename)
    made before `started`: a newer one may be a write under way, by this daemon."""
    try:
        names = [name for name in os.listdir(directory) if is_temporary(name)]
    except OSError:
        return
    removed = []
    for name in names:
        path = directory / name
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < started:
                path.unlink()
                removed.append(name)
    if removed:
        log.info("leftovers_removed", run_id=directory.name, files=removed, why="atomic writes cut short")


def _drop_unrecorded_start(directory: Path) -> bool:
    """Remove the directory of a start cut short before its record was first saved (its launch
    settings alone, or nothing, and no `run.json`); True when it was removed."""
    if not is_run_id(directory.name) or os.path.lexists(directory / "run.json"):
        return False
    try:
        names = os.listdir(directory)
        if any(name != LAUNCH_SETTINGS for name in names):
            return False  # something more: left for a person, listed unreadable
        if names and not stat.S_ISREG(os.lstat(directory / LAUNCH_SETTINGS).st_mode):
            return False
        for name in names:
            os.unlink(directory / name)
        os.rmdir(directory)
    except OSError as exc:
        log.warning("unrecorded_start_not_removed", run_id=directory.name, error=str(exc))
        return False
    log.warning(
        "unrecorded_start_removed",
        run_id=directory.name,
        files=names,
        why="a start cut short before its record was saved; no one was told its id",
    )
    return True


def parse_record(path: Path, run_id: str) -> RunRecord:
    """Read one record; a malformed one raises StoreError saying where it is broken."""
    try:
        with open(path, "rb") as f:
            # Its size, not the limit: a read of the limit reserves 16 MiB for every record.
            data = f.read(min(os.fstat(f.fileno()).st_size, RECORD_LIMIT) + 1)
    except FileNotFoundError as exc:
        raise StoreError(f"{path}: missing run record") from exc
    except OSError as exc:
        raise StoreError(f"{path}: cannot be read: {exc.strerror}") from exc
    if len(data) > RECORD_LIMIT:
        raise StoreError(f"{path}: larger than {RECORD_LIMIT} bytes, not a run record")
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise StoreError(f"{path}: not UTF-8 at byte {exc.start}") from exc
    except json.JSONDecodeError as exc:
        raise StoreError(
            f"{path}: malformed JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); the record was left as it is"
        ) from exc
    except RecursionError as exc:
        raise StoreError(f"{path}: JSON nested too deeply to be a run record; the record was left as it is") from exc
    try:
        record = RunRecord.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise StoreError(f"{path}: invalid record at {where}: {first['msg']}") from exc
    if record.id != run_id:
        raise StoreError(f"{path}: the record names run {record.id!r}, not {run_id!r}")
    return record
