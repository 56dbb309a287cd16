"""An in-memory target: an `Executor` whose files and jobs are Python objects, for fast daemon tests.

A `MemoryWorld` is the target's machine: its files (a dict of path -> bytes), the programs its
jobs run and the commands `exec_in_run` runs (Python callables, registered by name), and its jobs,
which outlive any one `MemoryExecutor` as a host's jobs outlive a daemon (a new executor over the
same world finds a job by its handle). A job is scripted state transitions: its program turns the
`JobSpec` into a list of steps, each a callable that acts on the job's run directory and says
whether it is done (a step that is not done yet is a wait: for a file, for a time). The world
advances its jobs whenever anyone looks (a status, a probe, a write, an event wait), so nothing
runs in the background and no task outlives a test.

It keeps the contract of the real kinds (executors/base.py, tests/executors/conformance/): the
wrapper's files (`job.pid`, `exit_code`, `cancelling`, `cancelled`), the probe's reading of a run
directory, link-free checkpoints, the events capability. It lives here, not in `executors/`: the
design card names four kinds there and no config kind selects it; a test builds one directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from executors.base import (
    CommandResult,
    ExecInput,
    ExecIO,
    ExecSpec,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    Reached,
    RunAs,
    RunProbe,
)
from trainer_plugin import rundir

Step = Callable[["MemoryJob"], bool]  # does its part; True once done (False: waits, tried again later)
Program = Callable[["MemoryJob"], list[Step]]  # a job's steps, from its spec (command[0] names the program)
Command = Callable[["MemoryCommand"], Awaitable[int]]  # a command of exec_in_run or run_command; its exit status
TERM_EXIT = 128 + 15  # a job ended by a cancel's TERM, as a shell reports it


def _norm(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            raise ExecutorError(f"{path}: a path with '..' is never used on a target")
        parts.append(part)
    return "/" + "/".join(parts)


@dataclass
class MemoryJob:
    """One job of the world: its spec, its handle, where its steps are, and how it ended."""

    spec: JobSpec
    handle: JobHandle
    world: MemoryWorld
    steps: list[Step] = field(default_factory=list)
    state: JobState = JobState.running
    exit_code: int = 0  # what it exits with once its steps are done (a step may set it)

    def path(self, rel: str) -> str:
        return f"{self.spec.remote_dir.rstrip('/')}/{rel}"

    def write(self, rel: str, data: bytes | str) -> None:
        self.world.write(self.path(rel), data.encode() if isinstance(data, str) else data)

    def append(self, rel: str, data: bytes | str) -> None:
        path = self.path(rel)
        self.world.write(
            path, self.world.files.get(_norm(path), b"") + (data.encode() if isinstance(data, str) else data)
        )

    def print(self, text: str) -> None:
        """What the job writes to its stdout: its log."""
        self.append(rundir.JOB_LOG, text)

    def exists(self, rel: str) -> bool:
        return self.world.exists(self.path(rel))

    def read(self, rel: str) -> bytes | None:
        return self.world.files.get(_norm(self.path(rel)))


@dataclass
class MemoryCommand:
    """A command run by `exec_in_run` (or `run_command`): its argv, its directory, its variables, its caller."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    io: ExecIO
    world: MemoryWorld


class MemoryWorld:
    """The target's machine: files, programs, commands and jobs, shared by every executor made on it."""

    def __init__(self, name: str = "memory") -> None:
        self.name = name
        self.boot_id = f"memory-boot-{id(self):x}"
        self.files: dict[str, bytes] = {}
        self.dirs: set[str] = {"/"}
        self.jobs: dict[int, MemoryJob] = {}
        self.programs: dict[str, Program] = {}
        self.commands: dict[str, Command] = {}
        self._next_pid = 1000
        self._listeners: list[Callable[[str], None]] = []
        self._advancing = False

    # --- files ----------------------------------------------------------------------------------

    def mkdir(self, path: str) -> None:
        path = _norm(path)
        while path not in self.dirs:
            self.dirs.add(path)
            path = path.rsplit("/", 1)[0] or "/"

    def write(self, path: str, data: bytes) -> None:
        """A whole file written at once (as the real targets' atomic writes), its directories made."""
        path = _norm(path)
        if path in self.dirs:
            raise ExecutorError(f"{path} is a directory")
        self.mkdir(path.rsplit("/", 1)[0] or "/")
        self.files[path] = data
        for listener in list(self._listeners):
            listener(path)
        self.advance()

    def exists(self, path: str) -> bool:
        path = _norm(path)
        return path in self.files or path in self.dirs

    def under(self, directory: str) -> dict[str, bytes]:
        """The files under `directory`, by their path relative to it."""
        prefix = _norm(directory).rstrip("/") + "/"
        return {p[len(prefix) :]: data for p, data in self.files.items() if p.startswith(prefix)}

    def remove_tree(self, directory: str) -> int:
        """Remove a directory and what it holds; the bytes freed."""
        path = _norm(directory)
        prefix = path.rstrip("/") + "/"
        freed = 0
        for name in [p for p in self.files if p.startswith(prefix)]:
            freed += len(self.files.pop(name))
        self.dirs = {d for d in self.dirs if d != path and not d.startswith(prefix)}
        return freed

    def listen(self, listener: Callable[[str], None]) -> Callable[[], None]:
        """Call `listener(path)` on every write; the function that stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    # --- jobs -----------------------------------------------------------------------------------

    def start(self, spec: JobSpec) -> MemoryJob:
        program = self.programs.get(spec.command[0]) if spec.command else None
        if program is None:
            raise ExecutorError(
                f"no program {spec.command[:1]!r} on the memory target {self.name}; a test registers one in "
                "`world.programs` before it starts a job"
            )
        self._next_pid += 1
        handle = JobHandle(pid=self._next_pid, start_time=int(time.monotonic() * 100), boot_id=self.boot_id)
        job = MemoryJob(spec, handle, self)
        job.steps = list(program(job))
        self.mkdir(spec.remote_dir)
        job.write(rundir.JOB_LOG, b"")
        job.write(rundir.JOB_PID, handle.model_dump_json().encode())  # as the wrapper writes it
        self.jobs[handle.pid] = job  # only now: the writes above advance the world's other jobs
        self.advance()
        return job

    def job(self, handle: JobHandle | dict[str, Any] | None) -> MemoryJob | None:
        """The job a handle names, if it is this world's (same boot, same start): never a reused pid."""
        if handle is None:
            return None
        h = handle if isinstance(handle, JobHandle) else JobHandle.model_validate(handle)
        job = self.jobs.get(h.pid)
        if job is None or job.handle.start_time != h.start_time or h.boot_id != self.boot_id:
            return None
        return job

    def advance(self) -> None:
        """Run every job's steps as far as they go now; a job with none left exits."""
        if self._advancing:
            return
        self._advancing = True
        try:
            moved = True
            while moved:
                moved = False
                for job in list(self.jobs.values()):
                    while job.state == JobState.running and job.steps:
                        if not job.steps[0](job):
                            break
                        job.steps.pop(0)
                        moved = True
                    if job.state == JobState.running and not job.steps:
                        job.state = JobState.exited
                        job.write(rundir.EXIT_CODE, f"{job.exit_code}\n")
                        moved = True
        finally:
            self._advancing = False

    def end(self, job: MemoryJob) -> None:
        """A cancel's TERM: the job stops where it is; its wrapper records the exit."""
        if job.state == JobState.running:
            job.state = JobState.cancelled
            job.steps = []
            job.write(rundir.EXIT_CODE, f"{TERM_EXIT}\n")


# --- steps a program is made of ----------------------------------------------------------------


def do(action: Callable[[MemoryJob], object]) -> Step:
    """A step that acts once."""

    def step(job: MemoryJob) -> bool:
        action(job)
        return True

    return step


def until(condition: Callable[[MemoryJob], bool]) -> Step:
    """A step that waits until `condition` holds."""
    return condition


def sleep(seconds: float) -> Step:
    """A step that waits `seconds` from when it is first tried."""
    started: list[float] = []

    def step(job: MemoryJob) -> bool:
        started[:] = started or [time.monotonic()]
        return time.monotonic() - started[0] >= seconds

    return step


def exit_with(code: int) -> Step:
    def step(job: MemoryJob) -> bool:
        job.exit_code = code
        return True

    return step


# --- the executor ------------------------------------------------------------------------------


class MemoryEvents:
    """The events capability: every write in a watched run directory, and a job's exit, at once."""

    TICK = 0.02  # how often a wait looks again at jobs waiting for time

    def __init__(self, world: MemoryWorld) -> None:
        self.world = world
        self._dirs: set[str] = set()
        self._changed: set[str] = set()
        self._stop = world.listen(self._written)

    def _written(self, path: str) -> None:
        where = path.rsplit("/", 1)[0]
        if where in self._dirs:
            self._changed.add(path)

    def watch(self, remote_dir: str) -> None:
        self._dirs.add(_norm(remote_dir))

    def unwatch(self, remote_dir: str) -> None:
        self._dirs.discard(_norm(remote_dir))

    async def changed_files(self) -> set[str]:
        while True:
            self.world.advance()
            if self._changed:
                changed, self._changed = self._changed, set()
                return changed
            await anyio.sleep(self.TICK)

    async def wait_exit(self, handle: JobHandle) -> None:
        while True:
            self.world.advance()
            job = self.world.job(handle)
            if job is None or job.state != JobState.running:
                return
            await anyio.sleep(self.TICK)

    def close(self) -> None:
        self._stop()


class MemoryExecutor:
    """An `Executor` on a `MemoryWorld`; many may share one world (a daemon restarted is a new one)."""

    shares_filesystem = False

    def __init__(self, name: str, world: MemoryWorld, workdir: str = "/memory/obd", *, events: bool = True) -> None:
        self.name = name
        self.world = world
        self.workdir = workdir
        self.events: MemoryEvents | None = MemoryEvents(world) if events else None

    async def resolve_workdir(self) -> str:
        return _norm(self.workdir)

    async def reach(self) -> Reached:
        return Reached(where=f"memory {self.world.name}", trust="not applicable", workdir=_norm(self.workdir))

    async def python(self) -> str:
        return "python3"

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        out: dict[str, bytearray] = {"out": bytearray(), "err": bytearray()}

        class Collect:
            sent = False

            async def write(self, stream: str, data: bytes) -> None:
                out[stream].extend(data)

            async def read(self) -> ExecInput | None:
                if self.sent:
                    return None
                self.sent = True
                return ExecInput(data=stdin, eof=True)

        code = await self._command(argv, _norm(self.workdir), {}, Collect(), timeout)
        return CommandResult(returncode=code, stdout=bytes(out["out"]), stderr=bytes(out["err"]))

    async def _command(self, argv: list[str], cwd: str, env: dict[str, str], io: ExecIO, timeout: float) -> int:
        command = self.world.commands.get(argv[0]) if argv else None
        if command is None:
            await io.write("err", f"{argv[:1]}: command not found on the memory target\n".encode())
            return 127
        with anyio.fail_after(timeout):
            return await command(MemoryCommand(argv, cwd, env, io, self.world))

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        self.world.mkdir(remote_dir)

    async def spawn(self, job: JobSpec) -> JobHandle:
        return self.world.start(job).handle

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        return self._status(handle, remote_dir)

    def _status(self, handle: JobHandle | None, remote_dir: str) -> JobStatus:
        """As the wrapper's files say (jobctl.job_status): cancelled, running, exited, or lost."""
        self.world.advance()
        files, rd = self.world.files, _norm(remote_dir)
        raw = files.get(f"{rd}/{rundir.EXIT_CODE}")
        code = int(raw) if raw is not None and raw.strip().lstrip(b"-").isdigit() else None
        if f"{rd}/{rundir.CANCELLED}" in files or f"{rd}/{rundir.CANCELLING}" in files:
            return JobStatus(state=JobState.cancelled, exit_code=code)
        job = self.world.job(handle or self._handle(rd))
        if job is not None and job.state == JobState.running:
            return JobStatus(state=JobState.running)
        if code is not None:
            return JobStatus(state=JobState.exited, exit_code=code)
        return JobStatus(state=JobState.lost)

    def _handle(self, remote_dir: str) -> dict[str, Any] | None:
        raw = self.world.files.get(f"{_norm(remote_dir)}/{rundir.JOB_PID}")
        try:
            handle = json.loads(raw) if raw else None
        except ValueError:
            return None
        return handle if isinstance(handle, dict) else None

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        """TERM, idempotent: a job that ended is never touched; a second cancel only reports."""
        status = self._status(handle, remote_dir)
        if status.state in (JobState.exited, JobState.cancelled):
            return status
        rd = _norm(remote_dir)
        self.world.write(f"{rd}/{rundir.CANCELLING}", f"{time.time()}\n".encode())
        job = self.world.job(handle)
        if job is not None:
            self.world.end(job)
        self.world.write(f"{rd}/{rundir.CANCELLED}", json.dumps({"time": time.time(), "killed": False}).encode())
        return self._status(handle, remote_dir)

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        return [self._probe(handle, remote_dir) for handle, remote_dir in runs]

    def _probe(self, handle: JobHandle | None, remote_dir: str) -> RunProbe:
        rd = _norm(remote_dir)
        files = self.world.files
        status = self._status(handle, rd)
        request = files.get(f"{rd}/{rundir.SNAPSHOT_REQUEST}")
        proof = files.get(f"{rd}/{rundir.SNAPSHOT_PROOF}")
        metrics = files.get(f"{rd}/{rundir.METRICS}", b"")
        return RunProbe(
            remote_dir=remote_dir,
            status=status,
            request=request[: rundir.REQUEST_LIMIT].decode("utf-8", "replace") if request is not None else None,
            proof=proof[: rundir.PROOF_LIMIT].decode("utf-8", "backslashreplace") if proof is not None else None,
            proof_too_large=proof is not None and len(proof) > rundir.PROOF_LIMIT,
            log_size=len(files.get(f"{rd}/{rundir.JOB_LOG}", b"")),
            metrics_size=len(metrics),
            handle=self._handle(rd),
            checkpoints=sorted(self._checkpoints(rd), key=lambda n: rundir.checkpoint_step(n) or 0),
            **_metrics_summary(metrics),
        )

    def _checkpoints(self, remote_dir: str) -> dict[str, int]:
        out = f"{_norm(remote_dir)}/{rundir.OUTPUT}"
        sizes: dict[str, int] = {}
        for d in self.world.dirs:
            name = d[len(out) + 1 :] if d.startswith(out + "/") else ""
            if name and "/" not in name and rundir.checkpoint_step(name) is not None:
                sizes[name] = sum(len(data) for data in self.world.under(d).values())
        return sizes

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        self.world.advance()
        return self.world.files.get(_norm(path), b"")[offset : offset + limit]

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        self.world.advance()
        return self._checkpoints(remote_dir)

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        if rundir.checkpoint_step(name) is None:
            raise ExecutorError(f"could not remove {remote_dir}/{rundir.OUTPUT}/{name}: not a checkpoint-<step> name")
        if not _norm(remote_dir).startswith(_norm(self.workdir) + "/"):
            raise ExecutorError(f"{remote_dir} is not a run directory of target {self.name}: nothing removed")
        return self.world.remove_tree(f"{_norm(remote_dir)}/{rundir.OUTPUT}/{name}")

    async def put_file(self, path: str, data: bytes) -> None:
        self.world.write(path, data)

    async def upload(self, local: Path, remote: str) -> None:
        """A file, or a tree (its directories kept, links and caches left out, as the real kinds do)."""
        if local.is_file():
            self.world.write(remote, local.read_bytes())
            return
        self.world.mkdir(remote)
        for path in sorted(local.rglob("*")):
            rel = path.relative_to(local)
            if path.is_symlink() or any(p in {".git", "__pycache__", ".venv", "venv"} for p in rel.parts):
                continue
            if path.is_dir():
                self.world.mkdir(f"{remote}/{rel.as_posix()}")
            elif path.is_file():
                self.world.write(f"{remote}/{rel.as_posix()}", path.read_bytes())

    async def download(self, remote: str, local: Path) -> None:
        self.world.advance()
        path = _norm(remote)
        if path in self.world.files:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(self.world.files[path])
            return
        if path not in self.world.dirs:
            raise ExecutorError(f"{remote} does not exist on target {self.name}")
        local.mkdir(parents=True, exist_ok=True)
        for rel, data in self.world.under(path).items():
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            (local / rel).write_bytes(data)

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        """A registered command, in the run directory with the spec's variables (and the job's `OBD_*`)."""
        argv = spec.command or ["shell"]
        env = {"OBD_RUN_ID": spec.run_id, "OBD_RUN_DIR": spec.remote_dir, **spec.env}
        return await self._command(argv, spec.remote_dir, env, io, timeout=3600.0)

    async def aclose(self) -> None:
        if self.events is not None:
            self.events.close()


def _metrics_summary(data: bytes) -> dict[str, Any]:
    """metrics.jsonl's `begin` line, its last `log`, `save` and `phase` lines, and whether it ended
    (jobctl's reading, over bytes)."""
    out: dict[str, Any] = {"begin": None, "last_log": None, "last_save": None, "phase": None, "ended": False}
    lines = [_event(line) for line in data.split(b"\n") if line.strip()]
    if lines and lines[0] and lines[0].get("event") == "begin":
        out["begin"] = lines[0]
    for event in reversed(lines):
        kind = event.get("event") if event else None
        if kind == "end" and out["last_log"] is None:
            out["ended"] = True
        for name, wanted in (("last_log", "log"), ("last_save", "save"), ("phase", "phase")):
            if kind == wanted and out[name] is None:
                out[name] = event
    return out


def _event(line: bytes) -> dict[str, Any] | None:
    try:
        value = rundir.load_json(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
