"""The Python API's exceptions (each with the exit code `obd` gives it) and its results (small
frozen dataclasses made from the daemon's records): what `from obd import ...` names.

Apart from daemon/cli/sdk.py, which does the work, so the types are read in one place.
Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.cli import client as wire_client
from daemon.cli.common import (
    EXIT_BUSY,
    EXIT_DENIED,
    EXIT_ERROR,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    LOCAL_TARGET,
)
from daemon.common.wire import FINAL

# --- errors: the exit codes of `obd` as attributes ----------------------------------------------


class ObdError(Exception):
    """Anything obd reports; `exit_code` is what `obd` would exit with, `kind` the daemon's word."""

    exit_code: int = EXIT_ERROR

    def __init__(self, message: str, kind: str = "error") -> None:
        # Not super(): the next class may be the command client's RequestFailed, whose kind is required.
        Exception.__init__(self, message)
        self.kind = kind


class DaemonUnreachable(ObdError, wire_client.DaemonUnreachable):
    """No daemon answers at the socket (or it may not be opened); the message says how to start one."""

    exit_code = EXIT_UNREACHABLE


class DaemonBusy(ObdError, wire_client.DaemonBusy):
    """The daemon turned this caller away (too many connections); retrying in a moment may work."""

    exit_code = EXIT_BUSY


class RequestFailed(ObdError, wire_client.RequestFailed):
    """The daemon refused or failed a request (`kind`: state, unavailable, error...)."""


class BadRequest(RequestFailed):
    """Bad usage: an unknown or wrong option, a run file that is not valid, a request too large."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, kind: str = "usage") -> None:
        super().__init__(message, kind)


class Denied(RequestFailed):
    """The run is another user's, or the caller may not do this."""

    exit_code = EXIT_DENIED


class NotFound(RequestFailed):
    """No run by that id, prefix or name."""


class RunError(ObdError):
    """The run ended otherwise than asked: `status` is how it ended, `exit_code` the code `obd`
    gives it (a stop --wait with no snapshot: 3 or 4; failed: 6; stopped: 5)."""

    def __init__(self, message: str, status: RunStatus, exit_code: int) -> None:
        super().__init__(message, "run")
        self.status = status
        self.exit_code = exit_code


class WaitTimeout(ObdError, TimeoutError):
    """A wait's `timeout` passed before the run reached a state it waited for; `status` is its last."""

    def __init__(self, message: str, status: RunStatus) -> None:
        super().__init__(message, "timeout")
        self.status = status


_BY_KIND: dict[str, type[RequestFailed]] = {
    "usage": BadRequest,
    "too_large": BadRequest,
    "denied": Denied,
    "not_found": NotFound,
}


def error_for(message: str, kind: str) -> ObdError:
    """The exception of a daemon's answer that failed."""
    if kind == "busy":
        return DaemonBusy(message, kind)
    return _BY_KIND.get(kind, RequestFailed)(message, kind)


def translated(exc: Exception) -> Exception:
    """The API's exception for one of the command's client (daemon/cli/client.py)."""
    if isinstance(exc, ObdError):
        return exc
    if isinstance(exc, wire_client.DaemonUnreachable):
        return DaemonUnreachable(str(exc), "unreachable")
    if isinstance(exc, wire_client.DaemonBusy):
        return DaemonBusy(str(exc), "busy")
    if isinstance(exc, wire_client.RequestFailed):
        return error_for(str(exc), exc.kind)
    return exc


# --- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """How far a run is, from its metrics.jsonl."""

    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    eta_seconds: float | None = None
    last_checkpoint: str | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any] | None) -> Progress:
        data = data or {}
        return cls(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Snapshot:
    """A verified snapshot: the checkpoint (relative to the run directory), its step, why."""

    checkpoint: str
    step: int
    reason: str = "requested"
    time: float | None = None

    @classmethod
    def of(cls, data: Mapping[str, Any] | None) -> Snapshot | None:
        if not data:
            return None
        return cls(data["checkpoint"], data["step"], data.get("reason", "requested"), data.get("time"))


@dataclass(frozen=True)
class RunStatus:
    """A run as the daemon answered for it: the fields most use, and the whole record (`record`:
    history, stop, limits..., docs/contract.md). Entries of `Client.runs` come from the list,
    which carries fewer fields (no remote_dir, no exit_code): those are None there."""

    id: str
    state: str
    name: str | None = None
    target: str = LOCAL_TARGET
    message: str = ""
    owner: str | None = None
    created: float | None = None
    progress: Progress = field(default_factory=Progress)
    snapshot: Snapshot | None = None
    resumed_from: str | None = None
    exit_code: int | None = None
    remote_dir: str | None = None
    gpus: tuple[str, ...] = ()
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> RunStatus:
        return cls(
            id=record["id"],
            state=record["state"],
            name=record.get("name"),
            target=record.get("target") or LOCAL_TARGET,
            message=record.get("message") or "",
            owner=record.get("owner"),
            created=record.get("created"),
            progress=Progress.of(record.get("progress")),
            snapshot=Snapshot.of(record.get("snapshot")),
            resumed_from=record.get("resumed_from"),
            exit_code=record.get("exit_code"),
            remote_dir=record.get("remote_dir") or None,
            gpus=tuple(record.get("gpus") or ()),
            record=record,
        )

    @property
    def final(self) -> bool:
        """Whether the run has ended (stopped, succeeded, failed or cancelled)."""
        return self.state in FINAL


@dataclass(frozen=True)
class ExecResult:
    """What `Run.exec` ran where the run's job runs: its exit status, and what it wrote."""

    exit_code: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class SweepStarted:
    """What `Client.sweep` queued: the sweep's id (for `obd train status SWEEP`) and its runs'
    ids, in the order of the grid's combinations."""

    id: str
    name: str
    run_ids: tuple[str, ...]


@dataclass(frozen=True)
class Outputs:
    """What `Run.outputs` copied: from where, to where, how many files and bytes; the symbolic
    links it left out (never followed)."""

    id: str
    source: Path
    to: Path
    files: int
    bytes: int
    skipped_links: tuple[str, ...] = ()
