"""The run store: one `runs/<id>/run.json` per run, each saved whole or not at all.

A save writes a temporary file beside the record, fsyncs it, renames it over the record and
fsyncs the directory, so a SIGKILL or a power cut at any moment leaves the old record or the
new one, never half of one; a full disk leaves the old record and raises `StoreError`.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from daemon.models import RunRecord, check_run_id
from trainer_plugin.rundir import atomic_write

RECORD_LIMIT = 16 * 1024 * 1024


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

    def load_all(self) -> tuple[dict[str, RunRecord], list[BadRecord]]:
        records: dict[str, RunRecord] = {}
        bad: list[BadRecord] = []
        if not self.runs_dir.is_dir():
            return records, bad
        for name in sorted(os.listdir(self.runs_dir)):
            entry = self.runs_dir / name
            if name.startswith(".") or not entry.is_dir():
                continue
            path = entry / "run.json"
            _clear_leftovers(entry)
            try:
                check_run_id(entry.name)
                records[entry.name] = parse_record(path, entry.name)
            except (StoreError, ValueError) as exc:
                bad.append(BadRecord(entry.name, path, str(exc)))
        return records, bad


def _clear_leftovers(directory: Path) -> None:
    """Remove the temporary files of saves cut short (a SIGKILL between write and rename)."""
    try:
        names = [p for p in directory.iterdir() if p.name.startswith(".run.json.tmp.")]
    except OSError:
        return
    for leftover in names:
        with contextlib.suppress(OSError):
            leftover.unlink()


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
