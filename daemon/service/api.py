"""Messages of the control API: one JSON object a line each way over the unix socket."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from daemon.common.wire import MAX_OFFSET, MAX_TAIL_LINES, READ_LIMIT


class RawJSON(bytes):
    """A result already encoded as JSON: the server puts it in its reply as it is."""


class ApiError(Exception):
    """An error the client shows as it is; `kind` picks its exit code."""

    def __init__(self, message: str, kind: str = "error") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Peer:
    """Who is at the other end of the socket: every request acts as them.

    All of it is what the kernel recorded on the socket when the caller connected (SO_PEERCRED,
    SO_PEERGROUPS), never read again from the calling process: its pid may be gone or reused
    by then, and a process that took it over must not lend the caller its groups. `groups` is
    None only where the kernel cannot say (SO_PEERGROUPS needs Linux 4.13).
    """

    uid: int
    gid: int
    groups: tuple[int, ...] | None = None

    @property
    def is_root(self) -> bool:
        return self.uid == 0


class _Req(BaseModel):
    # Strict: a request says exactly what it means ("profile": "yes" is not a bool).
    model_config = ConfigDict(extra="forbid", strict=True)


class StartRequest(_Req):
    op: Literal["start"]
    command: list[str] = Field(min_length=1)
    target: str = "local"
    name: str | None = None
    cwd: str | None = None
    client_cwd: str | None = None  # where `obd train start` ran: a local job's default cwd
    env: dict[str, str] = Field(default_factory=dict, repr=False)
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    # The caller's environment: a local job starts from it (like `sbatch --export=ALL`).
    environ: dict[str, str] | None = Field(default=None, repr=False)
    env_clear: bool = False  # start from an empty environment instead
    umask: int | None = Field(default=None, ge=0, le=0o777)  # the caller's, for what the job writes
    # Where a job that succeeds leaves its outputs (hard links or copies of output/), as its user;
    # "asked": the output_dir the script asked for. Never into a directory that is not empty.
    output_to: str | None = None
    resume_from: str | None = None
    checkpoint: str | None = None  # with resume_from: latest, a step, or a path on the target
    gpus: str | None = None  # "N" devices, "0,2" (or "device=0") those devices, "all"
    priority: int = Field(default=0, ge=-100, le=100)
    retry: int | None = Field(default=None, ge=0, le=100)  # None: the target's default
    profile: bool = False
    snapshot_on_sigterm: bool = False
    preemptible: bool | None = None  # None: the target's default (`preemptible` in its config)
    # The chain's limits (docs/limits.md): running seconds, a unix time, GPU-hours, US dollars.
    time_limit: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_gpu_hours: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_cost_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    # Runs it waits for, each `RUN[:STATE[,STATE]]` (daemon/service/after.py); with after_any it starts
    # once they ended, whatever their end.
    after: list[str] = Field(default_factory=list, max_length=100)
    after_any: bool = False
    # How many complete checkpoints the chain keeps (daemon/service/retention.py); None: the target's default.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)

    @field_validator("name")
    @classmethod
    def _name_is_printable(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value.strip() or len(value) > 100:
            raise ValueError("--name must be 1 to 100 characters")
        if "/" in value or value in (".", "..", "last"):
            raise ValueError("--name may not hold '/' nor be '.', '..' or 'last' (those name other things)")
        if any(unicodedata.category(ch).startswith("C") for ch in value):
            raise ValueError("--name may not hold control characters (escape sequences, newlines, tabs)")
        return value


class GridAxis(_Req):
    """One `--grid NAME=V1,V2` of a sweep."""

    name: str
    values: list[str] = Field(min_length=1, max_length=1000)


class SweepRequest(StartRequest):
    """`obd train sweep`: one run per combination of the grid, made all at once or not at all
    (daemon/service/sweeps.py); its `command` holds `{NAME}` where each run's value goes, its `name` is
    the sweep's."""

    op: Literal["sweep"]  # type: ignore[assignment]
    grid: list[GridAxis] = Field(min_length=1, max_length=20)


class ResumeRequest(_Req):
    """Start a new run like RUN (target, command, name, GPUs, directory) from its checkpoint; on
    `target` instead of RUN's, the checkpoint carried there and verified (daemon/service/carry.py)."""

    op: Literal["resume"]
    id: str
    target: str | None = None  # None: RUN's own target
    gpus: str | None = None  # as a start's; None: RUN's on its own target, the target's default elsewhere
    checkpoint: str | None = None  # latest (default: the proof's, else the newest complete), a step, a path
    command: list[str] | None = None  # a new command; the old one when absent
    env: dict[str, str] | None = Field(default=None, repr=False)  # None: the old run's --env values
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    environ: dict[str, str] | None = Field(default=None, repr=False)
    env_clear: bool = False
    umask: int | None = Field(default=None, ge=0, le=0o777)
    retry: int | None = Field(default=None, ge=0, le=100)
    # The new run's own limits (RUN's are not carried: a resumed run is a chain of its own).
    time_limit: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    deadline: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_gpu_hours: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    max_cost_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class MoveRequest(_Req):
    """`obd train move RUN --to T [--gpus N]`: a snapshot of the running RUN, then its resume on T
    (the same as `resume --target T`), made by the daemon once the snapshot is proven
    (daemon/service/move.py). The resume's `--env` values, secrets and caller's environment are kept in
    memory only: a daemon restarted before the snapshot makes the resume without them."""

    op: Literal["move"]
    id: str
    to: str = Field(min_length=1, max_length=200)
    gpus: str | None = None  # as a start's; None: the new target's default
    env: dict[str, str] | None = Field(default=None, repr=False)
    secrets: dict[str, str] = Field(default_factory=dict, repr=False)
    environ: dict[str, str] | None = Field(default=None, repr=False)
    env_clear: bool = False
    umask: int | None = Field(default=None, ge=0, le=0o777)
    via: Literal["cli", "ui", "api"] = "cli"


class StopRequest(_Req):
    op: Literal["stop"]
    id: str
    reason: str = "requested"
    via: Literal["cli", "ui", "api"] = "cli"  # how the request came, for the run's history


class PruneRequest(_Req):
    """`obd train prune RUN [--keep N]`: delete the checkpoints of RUN's chain that retention would,
    keeping N (default: the run's --keep-checkpoints)."""

    op: Literal["prune"]
    id: str
    keep: int | None = Field(default=None, ge=1, le=100000)


class IdRequest(_Req):
    op: Literal["status", "cancel", "metrics", "outputs"]
    id: str


class WaitRequest(_Req):
    """Answer once the run is final, or after `timeout` seconds with the record as it is."""

    op: Literal["wait"]
    id: str
    timeout: float = Field(default=30.0, ge=0, le=300)


class DrainRequest(_Req):
    """Drain a target for maintenance (pause its runs, start nothing), or undrain it."""

    op: Literal["drain", "undrain"]
    target: str
    cancel: bool = False  # drain: cancel the runs that cannot snapshot, instead of leaving them


class ListRequest(_Req):
    op: Literal["ping", "targets"]


class ListRunsRequest(_Req):
    """Which runs `list` answers with: by default the caller's active runs and recent ends."""

    op: Literal["list"]
    all: bool = False  # every run, of every user and any age
    states: list[str] = Field(default_factory=list)
    target: str | None = None
    name: str | None = None
    since: float | None = Field(default=None, allow_inf_nan=False)  # unix time: runs created at or after it
    limit: int | None = Field(default=None, ge=1, le=100_000)
    recent: int = Field(default=10, ge=0, le=100_000)  # finished runs shown by default
    sweep: str | None = None  # the members of this sweep (its id or name), each with its best loss
    # Each sweep's queued members (that never ran) as one entry, as `squeue` folds a job array's
    # pending tasks: the table's view (daemon/service/run_list.py `fold`); scripts get each run.
    fold: bool = False


class WatchRequest(_Req):
    """Answer when any of the caller's runs changed after `since` (a version), or after `timeout`."""

    op: Literal["watch"]
    since: int = Field(default=0, ge=0, le=MAX_OFFSET)
    timeout: float = Field(default=25.0, ge=0, le=300)


class ReadRequest(_Req):
    op: Literal["read"]
    id: str
    file: Literal["log", "metrics"] = "log"  # job.log, or metrics.jsonl (the plugin's progress lines)
    offset: int = Field(default=0, ge=0, le=MAX_OFFSET)
    limit: int = Field(default=65536, ge=1, le=READ_LIMIT)
    tail_lines: int | None = Field(default=None, ge=0, le=MAX_TAIL_LINES)


class ExecRequest(_Req):
    """`obd train exec RUN -- COMMAND` (no `command`: `obd train shell RUN`, a login shell): a
    session that takes the connection over (daemon/service/exec_session.py)."""

    op: Literal["exec"]
    id: str
    command: list[str] | None = Field(default=None, min_length=1, max_length=10000)
    tty: bool = False  # on a pseudo-terminal of the caller's size and TERM
    term: str = Field(default="xterm", min_length=1, max_length=100, pattern=r"^[A-Za-z0-9._+-]+$")
    rows: int = Field(default=24, ge=1, le=10000)
    cols: int = Field(default=80, ge=1, le=10000)

    @field_validator("command")
    @classmethod
    def _no_nul(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any("\0" in word for word in value):
            raise ValueError("a word of the command holds a NUL byte, which no command line can carry")
        return value
