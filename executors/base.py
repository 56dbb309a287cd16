"""The `Executor` protocol: how the daemon starts, watches, cancels and reads jobs on a target.

An executor knows one target (this machine, an SSH host, a Runpod pod). The daemon never
touches a target except through it, so the follow and stop logic is the same everywhere.
Paths given to an executor are absolute paths on the target.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)


class JobSpec(BaseModel):
    """What to run: the command, its environment and where its run directory is."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    remote_dir: str
    command: list[str]
    cwd: str | None = None
    # Values that must reach the job but never a command line, a record, a log or a file:
    # they go to the job wrapper on its stdin.
    env: dict[str, str] = Field(default_factory=dict, repr=False, exclude=True)
    secrets: dict[str, str] = Field(default_factory=dict, repr=False, exclude=True)
    # The environment the job starts from; None: the target's own (the remote login's).
    base_env: dict[str, str] | None = Field(default=None, repr=False, exclude=True)
    run_as: RunAs | None = None  # the user the job runs as, when not the executor's own
    umask: int | None = None
    output_to: str | None = None  # where a successful job's outputs are placed ("asked": the script's output_dir)
    # The wall time the job may run (what its chain's time limit or deadline leaves it), and how long
    # before that its `deadline` snapshot is asked: a scheduler that ends jobs on time (Slurm) is
    # given them; elsewhere the daemon asks (docs/limits.md). None: no such limit.
    time_limit: float | None = None
    stop_lead: float | None = None


class RunAs(BaseModel):
    """The account a job runs as on a daemon shared by several users (it switches to it)."""

    model_config = ConfigDict(frozen=True)

    uid: int
    gid: int
    groups: list[int] = Field(default_factory=list)
    user: str
    home: str


class TermSize(BaseModel):
    """The caller's terminal, for a command run on a pseudo-terminal (`obd train shell`)."""

    model_config = ConfigDict(frozen=True)

    term: str = "xterm"
    rows: int = 24
    cols: int = 80


class ExecSpec(BaseModel):
    """A command to run where a run's job runs (`obd train exec`, `obd train shell`): in its run
    directory, as its user, with the variables the job got (its GPUs, `OBD_*`)."""

    model_config = ConfigDict(frozen=True)

    run_id: str
    remote_dir: str  # the working directory of the command
    command: list[str] | None = None  # None: the user's login shell
    env: dict[str, str] = Field(default_factory=dict, repr=False)
    run_as: RunAs | None = None  # the user, when not the executor's own (a root daemon's local run)
    tty: TermSize | None = None  # run on a pseudo-terminal of this size
    job: JobHandle | None = None  # the run's job (a Slurm job's id is its pid)


@dataclass(frozen=True)
class ExecInput:
    """One thing the caller sent to a running command: bytes for its stdin, the end of its stdin,
    or a new terminal size (rows, cols)."""

    data: bytes = b""
    eof: bool = False
    size: tuple[int, int] | None = None


class ExecIO(Protocol):
    """The caller of a command run in a run (the daemon's session with `obd train exec`)."""

    async def write(self, stream: str, data: bytes) -> None:
        """Pass output on as it comes: `stream` is "out" or "err"."""

    async def read(self) -> ExecInput | None:
        """The caller's next input; None once the caller hung up (the command is then ended)."""
        ...


class JobHandle(BaseModel):
    """Identifies a started job for good: its group leader's pid, start time and boot.

    The start time (clock ticks since boot, from /proc/PID/stat) and the boot id make a
    reused pid or a reboot impossible to mistake for the job.
    """

    pid: int
    start_time: int
    boot_id: str = ""
    host: str = ""
    # What the job got, as the wrapper saw it: its uid, working directory, program and Python.
    uid: int | None = None
    cwd: str | None = None
    executable: str | None = None
    python: str | None = None

    def describe(self) -> str:
        """How a person names the job: its pid, or the scheduler's job id where it has one."""
        return self.host if self.host.startswith(("slurm job", "ray job")) else f"pid {self.pid}"


class JobState(str, Enum):
    pending = "pending"  # submitted, waiting for a scheduler (Slurm) to start it
    running = "running"
    exited = "exited"
    cancelled = "cancelled"
    lost = "lost"


class JobStatus(BaseModel):
    state: JobState
    exit_code: int | None = None
    detail: str | None = None  # what the target says of it (Slurm's pending reason, its end state)


def _or_none(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        return None


# A value of the wrong type in a metrics line reads as missing: anyone who can write the run
# directory writes these lines, so they are taken as far as they make sense and no further.
Int = Annotated[StrictInt | None, WrapValidator(_or_none)]
Number = Annotated[Annotated[StrictFloat, Field(allow_inf_nan=False)] | None, WrapValidator(_or_none)]
Flag = Annotated[StrictBool | None, WrapValidator(_or_none)]
Text = Annotated[StrictStr | None, WrapValidator(_or_none)]


class BeginLine(BaseModel):
    """metrics.jsonl's `begin` line, as far as obd reads it (the plugin writes more)."""

    model_config = ConfigDict(extra="allow")

    time: Number = None
    max_steps: Int = None
    start_step: Int = None
    snapshots: Flag = None  # the plugin announces it can snapshot (exactly `true`)
    version: Text = None
    mlflow_run_id: Text = None  # the MLflow run the job's Trainer opened (daemon/service/trackers.py)


class LogLine(BaseModel):
    """metrics.jsonl's last `log` line, as far as obd reads it. A heartbeat has no `loss`."""

    model_config = ConfigDict(extra="allow")

    time: Number = None
    step: Int = None
    loss: Number = None

    @property
    def has_loss(self) -> bool:
        return "loss" in self.model_fields_set


class SaveLine(BaseModel):
    """metrics.jsonl's last `save` line: how long the Trainer's checkpoint save at `step` took
    (periodic, or a snapshot's), as the plugin measured it (docs/contract.md)."""

    model_config = ConfigDict(extra="allow")

    time: Number = None
    step: Int = None
    seconds: Number = None
    snapshot: Flag = None


class PhaseLine(BaseModel):
    """metrics.jsonl's last `phase` line: where the job's time goes now (`training`, `evaluating`,
    `saving`, `after_train`), from the step it is at; after training, `cut` names the script's code a
    stop cuts short (trainer_plugin/plugin/interrupt.py)."""

    model_config = ConfigDict(extra="allow")

    time: Number = None
    phase: Text = None
    step: Int = None
    cut: Text = None


def _line(kind: type[BaseModel]) -> Any:
    def parse(value: Any) -> Any:
        return kind.model_validate(value) if isinstance(value, dict) else None

    return BeforeValidator(parse)


class RunProbe(BaseModel):
    """Everything the follow needs to know of one run directory, read in one go.

    Executors fill it from a single pass over the directory (one round trip on SSH), so the
    follow of many runs on one target costs one read per poll, not one per file per run.
    """

    remote_dir: str
    status: JobStatus
    request: str | None = None  # the raw reason word, None when there is no request
    proof: str | None = None  # raw snapshot.json, at most 64 KiB; None when absent or not a regular file
    proof_too_large: bool = False
    # What snapshot.json is when it exists but is not a regular file ("a FIFO", "a symbolic link",
    # "a directory", ...): never opened, and an invalid proof.
    proof_not_regular: str | None = None
    begin: Annotated[BeginLine | None, _line(BeginLine)] = None  # the metrics.jsonl `begin` line
    last_log: Annotated[LogLine | None, _line(LogLine)] = None  # its last `log` line
    last_save: Annotated[SaveLine | None, _line(SaveLine)] = None  # its last `save` line in the tail read
    phase: Annotated[PhaseLine | None, _line(PhaseLine)] = None  # its last `phase` line in the tail read
    ended: bool = False  # metrics.jsonl has an `end` line
    log_size: int = 0
    metrics_size: int = 0
    # The wrapper's handle (to adopt a run after a crash): from the run's facts directory where the
    # target keeps one (the local target), else job.pid as the wrapper wrote it.
    handle: dict | None = None
    # End marks (`cancelled`, `cancelling`) found in a run directory whose job's end is recorded
    # elsewhere: only the job's user can have put them there; they change nothing, and are logged.
    planted: list[str] = Field(default_factory=list)
    # Names of the output/checkpoint-* entries that are real directories, with no symbolic link
    # on their path (output/ itself included): the only checkpoints a proof can name.
    checkpoints: list[str] = Field(default_factory=list)
    # Whether a Python (obd's plugin loads into nothing else) or a shell runs in the job, read only
    # while a stop waits on a job that has not announced the plugin (`jobctl.python_seen`); None:
    # not read.
    python: bool | None = None
    error: str | None = None  # why the directory could not be read (the probe is then partial)


@dataclass(frozen=True)
class PodCost:
    """A run's own machine (a pod) and what it costs, as notifications and metrics tell it.

    Kind-neutral on purpose: the daemon's notifications and its `/metrics` learn it from the
    factory (`executors.factory.pod_cost`), never by reading a kind's record format themselves.
    """

    pod_id: str
    gpu_type: str | None
    cost_per_hr: float | None  # US dollars an hour
    spend_usd: float | None  # what it had cost at the time asked; None where its rate or start is unknown
    alive: bool  # obd keeps it for the run: made, not ended, and not one that never ran the job


class ExecutorError(Exception):
    """A target refused or failed an operation; the message says what to do next."""


class TargetUnreachable(ExecutorError):
    """The target could not be reached; the job may well still be running there."""


class LaunchUncertain(TargetUnreachable):
    """The connection went while the start command ran: the job may or may not have started.

    Never retried (a retry could start it twice); the run's directory says, once the target answers.
    """


class HostKeyError(ExecutorError):
    """The target's host key is unknown, changed, or not the pinned one: the connection was refused."""


class AuthError(ExecutorError):
    """The target answered but refused the login (wrong key or user)."""


class WorkdirError(ExecutorError):
    """The workdir (or obd's files in it) cannot be created on the target."""


class LinkRefused(ExecutorError):
    """A transfer met a symbolic link it must not follow (one that could lead out of the run
    directory): nothing was copied through it."""


class CommandResult(BaseModel):
    """What a command run on the target returned."""

    returncode: int
    stdout: bytes = b""
    stderr: bytes = b""


class Reached(BaseModel):
    """What reaching a target found, for `obd targets check`."""

    where: str  # where jobs run, in words: "this machine", "me@gpu1:22"
    trust: str  # how the target's identity was checked: "matches known_hosts", "not applicable", ...
    workdir: str  # the workdir as an absolute path there


class RunEvents(Protocol):
    """A capability of targets that can tell the follow at once what happened to a run.

    The local target has it (a pidfd for the exit, inotify on run directories); targets
    without it leave `Executor.events` None and are polled.
    """

    def watch(self, remote_dir: str) -> None:
        """Start reporting files written in this run directory."""

    def unwatch(self, remote_dir: str) -> None:
        """Stop reporting this run directory (its run ended)."""

    async def changed_files(self) -> set[str]:
        """Block until files were written in watched directories; their paths (`<run dir>/<name>`),
        or bare names where the target cannot say which run directory."""
        ...

    async def wait_exit(self, handle: JobHandle) -> None:
        """Return once the job's wrapper has exited (or at once if it cannot be watched)."""


class Executor(Protocol):
    """The target-side operations the daemon needs (cf. submitit's Executor/Job split).

    Every executor implements every method; what only some targets can do is a named
    capability (`events`), None where absent, so callers never ask an executor what it is.
    """

    # Read-only to callers: an executor may hold them as plain attributes or compute them.
    @property
    def name(self) -> str:
        """The target's name in the config."""
        ...

    @property
    def workdir(self) -> str:
        """The workdir as configured; may need the target to resolve it (`~/obd`)."""
        ...

    @property
    def shares_filesystem(self) -> bool:
        """True when the target sees the daemon's filesystem: a job's --cwd is used where it is,
        not uploaded into the run directory."""
        ...

    @property
    def events(self) -> RunEvents | None:
        """The events capability, where the target has it."""
        ...

    async def resolve_workdir(self) -> str:
        """The workdir as an absolute path on the target (connecting if need be)."""
        ...

    async def reach(self) -> Reached:
        """Connect (where there is anything to connect to) and say how; raises TargetUnreachable,
        HostKeyError, AuthError or WorkdirError with what to do next."""
        ...

    async def python(self) -> str:
        """The interpreter obd's wrapper runs with on the target (the target's `python`/`venv`)."""
        ...

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """Run one command on the target, its arguments quoted; no shell is involved locally."""
        ...

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        """Make the run directory before anything is put in it, and give it to `owner` (the user
        a root daemon runs the job as) where the target runs jobs as other users; elsewhere the
        first write makes it, as the target's own user."""
        ...

    async def spawn(self, job: JobSpec) -> JobHandle: ...

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus: ...

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus: ...

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]: ...

    async def read_from(self, path: str, offset: int, limit: int) -> bytes: ...

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        """The bytes each real `output/checkpoint-<step>` of a run directory holds (for retention,
        daemon/service/retention.py); links are never followed."""
        ...

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        """Delete a run directory's `output/<name>` (a `checkpoint-<step>` that is a real directory,
        with the run directory's owner's rights, never through a link); the bytes it freed.
        Raises ExecutorError when it may not or could not be removed."""
        ...

    async def put_file(self, path: str, data: bytes) -> None: ...

    async def upload(self, local: Path, remote: str) -> None: ...

    async def download(self, remote: str, local: Path) -> None: ...

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        """Run a command where the run's job runs (docs/exec-and-shell.md), its output passed to
        `io` as it comes and `io`'s input to it; its exit status (128+N for a signal N). Raises
        ExecutorError where it cannot run, with what to do."""
        ...

    async def aclose(self) -> None: ...
