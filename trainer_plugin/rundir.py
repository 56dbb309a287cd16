"""The run directory's contract as code: its file names, the reason words, the limits, the proof rule.

docs/contract.md ("The run directory on the target") spelled out once, so the daemon, the executors, the
job wrapper (jobctl), the in-job plugin and the pod watchdog cannot disagree on it: the one module
both rooms of `trainer_plugin` (`plugin/`, `tools/`) import. Standard library only: it runs on
targets that have nothing of obd installed, as a plain module beside the tools (or in the folder
above them), and inside the job as part of the `trainer_plugin` package.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import posixpath
import re
import stat
from typing import NamedTuple

# --- the files of a run directory (`<target workdir>/<run id>/`) -----------------------------

JOB_SPEC = "job.json"  # obd, before the start: the job's argv, cwd, env and PYTHONPATH (read by `jobctl start` on remote targets)
JOB_LOG = "job.log"  # the job: its stdout and stderr
JOB_PID = "job.pid"  # the job wrapper: its pid (the job's process-group leader), start time and boot id
EXIT_CODE = "exit_code"  # the job wrapper, once the job ended: its exit status
CANCELLING = "cancelling"  # cancel: a cancel is under way (TERM sent, KILL may follow)
CANCELLED = "cancelled"  # cancel: the cancel is done; a finished job is never signalled again
OUTPUT = "output"  # the trainer: its output_dir; checkpoints are `output/checkpoint-<step>`
SNAPSHOT_REQUEST = "snapshot.request"  # anyone allowed to write the run directory: one reason word
SNAPSHOT_PROOF = "snapshot.json"  # the plugin, rank 0, once the checkpoint is fully on disk: the proof
METRICS = "metrics.jsonl"  # the plugin, rank 0: `begin`, `log` and `end` lines, one JSON object each
# Files whose appearance a follower acts on at once (the daemon's inotify, the SSH helper's
# push); metrics.jsonl growing can wait for the next tick.
URGENT_FILES = (EXIT_CODE, CANCELLED, SNAPSHOT_REQUEST, SNAPSHOT_PROOF)
PROFILE = "profile"  # the runner's wrapper: profiler artefacts of a run started with --profile
PLUGIN = "plugin"  # obd: the trainer_plugin files for this run, first on the job's PYTHONPATH
SOURCES = "src"  # obd: the job's --cwd, uploaded to targets that do not share the daemon's filesystem
RESUME = "resume"  # obd: a checkpoint brought from another target for OBD_RESUME_FROM

# The facts directory: where the job wrapper records the job's handle and end, in a place of the
# daemon's own that the job's user cannot write (a local target's `STATE_DIR/facts/<run id>/`).
# The cancel marks (CANCELLING, CANCELLED) go there too; the run directory's copies are for people.
FACT_HANDLE = "handle.json"  # the wrapper, before the job starts: its pid, start time, boot id
FACT_EXIT = "exit_code"  # the wrapper, once every process of the job is gone: the exit status

# The pod watchdog's files (Runpod targets only).
WATCHDOG_CONFIG = "watchdog.json"  # obd: the watchdog's caps and settings (no secret in it)
WATCHDOG_LOG = "watchdog.log"  # the watchdog: one JSON line per decision
WATCHDOG_LOCK = "watchdog.lock"  # the watchdog: flock'd for its life, so one runs per run directory
WATCHDOG_JOB = "watchdog"  # obd: the run directory of the watchdog's own process (its job.pid, exit_code)
LEASE = "lease"  # the daemon: unix time until which it is in charge of the caps
RETRIEVED = "retrieved"  # the daemon, once the outputs are safe: the watchdog's work is over

# The Slurm job's files (Slurm targets only).
SLURM_SUBMIT = "slurm.json"  # the submit's intent, then the job id: {"job_name", "submitting", "job_id"}
SLURM_LAUNCH = "slurm_launch.json"  # obd: how the batch wrapper launches the command (nodes, launcher, python)
SLURM_SCRIPT = "slurm_batch.sh"  # obd: the batch script sbatch is given
# Where obd runs torchrun for a run (a Slurm or Ray target's `launcher = "torchrun"`): its log
# directory (a rank's error file), a folder per node, instead of a `/tmp/torchelastic_*` left behind.
TORCHRUN_LOGS = "torchrun"

# What obd retrieves from a pod before it ends it (sizes and sha256 checked).
OUTPUTS = (OUTPUT, JOB_LOG, METRICS, SNAPSHOT_PROOF, PROFILE, EXIT_CODE, WATCHDOG_LOG)


class _DirPaths:
    """Paths of files in one directory, joined with posixpath (a target's paths are POSIX)."""

    __slots__ = ("root",)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r})"

    def file(self, name: str) -> str:
        """`<directory>/<name>`, for a name held in a variable."""
        return posixpath.join(self.root, name)


class RunPaths(_DirPaths):
    """The path of each file of one run directory, named once (cf. submitit's `JobPaths`).

    `RunPaths(run_dir).job_log` instead of `f"{run_dir}/job.log"`: whoever reads or writes a run
    directory (the daemon, an executor, the profiler, the job wrapper, the watchdog) asks this
    object, so a file's name is written in one place, above. Paths are joined with `posixpath`:
    a run directory is a path on its target, and every target is POSIX, whatever the caller runs
    on. The paths are plain strings (wrap them in `Path` for local use); nothing is checked or
    touched here.
    """

    __slots__ = ()

    @property
    def run_dir(self) -> str:
        return self.root

    @property
    def job_spec(self) -> str:
        """`job.json`: the job's argv, cwd, env and PYTHONPATH, written by obd before the start."""
        return self.file(JOB_SPEC)

    @property
    def job_log(self) -> str:
        """`job.log`: the job's stdout and stderr."""
        return self.file(JOB_LOG)

    @property
    def job_pid(self) -> str:
        """`job.pid`: the job wrapper's handle (pid, start time, boot id)."""
        return self.file(JOB_PID)

    @property
    def exit_code(self) -> str:
        """`exit_code`: the job's exit status, once it ended."""
        return self.file(EXIT_CODE)

    @property
    def cancelling(self) -> str:
        """`cancelling`: a cancel is under way."""
        return self.file(CANCELLING)

    @property
    def cancelled(self) -> str:
        """`cancelled`: the cancel is done."""
        return self.file(CANCELLED)

    @property
    def output(self) -> str:
        """`output`: the trainer's output_dir."""
        return self.file(OUTPUT)

    def checkpoint(self, step: int) -> str:
        """`output/checkpoint-<step>`: where the Trainer saves step `step`."""
        return posixpath.join(self.run_dir, checkpoint_relpath(step))

    def in_output(self, name: str) -> str:
        """`output/<name>`: an entry of the output directory (a checkpoint known by its name)."""
        return posixpath.join(self.run_dir, OUTPUT, name)

    @property
    def request(self) -> str:
        """`snapshot.request`: a snapshot request, one reason word."""
        return self.file(SNAPSHOT_REQUEST)

    @property
    def proof(self) -> str:
        """`snapshot.json`: the proof of a snapshot."""
        return self.file(SNAPSHOT_PROOF)

    @property
    def metrics(self) -> str:
        """`metrics.jsonl`: the plugin's `begin`, `log` and `end` lines."""
        return self.file(METRICS)

    @property
    def profile(self) -> str:
        """`profile`: the profiler's artefacts of a run started with --profile."""
        return self.file(PROFILE)

    @property
    def plugin(self) -> str:
        """`plugin`: obd's trainer_plugin files for this run, first on the job's PYTHONPATH."""
        return self.file(PLUGIN)

    def package_file(self, rel: str) -> str:
        """`plugin/trainer_plugin/<rel>`: one file of the run's copy of the `trainer_plugin` package."""
        return posixpath.join(self.run_dir, PLUGIN, "trainer_plugin", rel)

    def tool(self, name: str) -> str:
        """`plugin/trainer_plugin/tools/<name>`: one of the job-side tools in the run's copy, run by
        path (Slurm's batch helper, the pod watchdog); it finds `rundir.py` in the folder above."""
        return self.package_file(f"tools/{name}")

    @property
    def sources(self) -> str:
        """`src`: the job's --cwd, uploaded where the target does not share the daemon's files."""
        return self.file(SOURCES)

    @property
    def resume(self) -> str:
        """`resume`: checkpoints brought from another target for OBD_RESUME_FROM."""
        return self.file(RESUME)

    def in_resume(self, name: str) -> str:
        """`resume/<name>`: a checkpoint brought from another target, by its name."""
        return posixpath.join(self.run_dir, RESUME, name)

    @property
    def watchdog_config(self) -> str:
        """`watchdog.json`: the pod watchdog's caps and settings."""
        return self.file(WATCHDOG_CONFIG)

    @property
    def watchdog_log(self) -> str:
        """`watchdog.log`: the pod watchdog's decisions."""
        return self.file(WATCHDOG_LOG)

    @property
    def watchdog_lock(self) -> str:
        """`watchdog.lock`: flock'd by the one watchdog of the run directory."""
        return self.file(WATCHDOG_LOCK)

    @property
    def watchdog_job(self) -> str:
        """`watchdog`: the run directory of the watchdog's own process."""
        return self.file(WATCHDOG_JOB)

    @property
    def lease(self) -> str:
        """`lease`: until when the daemon is in charge of the caps."""
        return self.file(LEASE)

    @property
    def retrieved(self) -> str:
        """`retrieved`: the daemon's mark that the outputs are safe."""
        return self.file(RETRIEVED)

    @property
    def slurm_submit(self) -> str:
        """`slurm.json`: the Slurm submit's intent, then its job id."""
        return self.file(SLURM_SUBMIT)

    @property
    def slurm_launch(self) -> str:
        """`slurm_launch.json`: how the Slurm batch wrapper launches the command."""
        return self.file(SLURM_LAUNCH)

    @property
    def slurm_script(self) -> str:
        """`slurm_batch.sh`: the batch script sbatch is given."""
        return self.file(SLURM_SCRIPT)

    def torchrun_logs(self, node: int | str) -> str:
        """`torchrun/node-<node>`: the log directory of the torchrun obd runs on that node."""
        return posixpath.join(self.file(TORCHRUN_LOGS), f"node-{node}")


class FactPaths(_DirPaths):
    """The path of each file of a facts directory (`STATE_DIR/facts/<run id>/`, the daemon's own).

    It has the run directory's end marks under the same names (`exit_code`, `cancelling`,
    `cancelled`), so the job wrapper reads and writes `marks.exit_code` with `marks` a
    `FactPaths` or a `RunPaths`, whichever holds the job's end.
    """

    __slots__ = ()

    @property
    def facts_dir(self) -> str:
        return self.root

    @property
    def handle(self) -> str:
        """`handle.json`: the wrapper's handle, written before the job starts."""
        return self.file(FACT_HANDLE)

    @property
    def exit_code(self) -> str:
        """`exit_code`: the job's exit status, once every process of it is gone."""
        return self.file(FACT_EXIT)

    @property
    def cancelling(self) -> str:
        """`cancelling`: a cancel is under way."""
        return self.file(CANCELLING)

    @property
    def cancelled(self) -> str:
        """`cancelled`: the cancel is done."""
        return self.file(CANCELLED)


# --- limits: what a reader takes of files that anyone on the target may write ------------------

PROOF_LIMIT = 64 * 1024  # a larger snapshot.json is an invalid proof
REQUEST_LIMIT = 256  # a reason is one word: never more than this is read of a request
METRICS_HEAD = 64 * 1024  # where the `begin` line is looked for
METRICS_TAIL = 64 * 1024  # where the last `log` and the `end` lines are looked for
JOB_PID_LIMIT = 4096
EXIT_CODE_LIMIT = 64
JOB_SPEC_LIMIT = 1 << 20

# --- the reason words of a snapshot request ----------------------------------------------------

REQUESTED = "requested"  # `obd train stop`, or any word that is not one of these
DEADLINE = "deadline"  # a time limit is near (the pod watchdog's max_hours, Slurm's --signal)
COST = "cost"  # the spend is near its cap (max_cost_usd)
DISK = "disk"  # the disk policy (too little free space)
PREEMPTED = "preempted"  # the job is being preempted (a SIGTERM under --snapshot-on-sigterm)
# Their position (1-based) is also the code the plugin's ranks exchange.
REASONS: tuple[str, ...] = (REQUESTED, DEADLINE, COST, DISK, PREEMPTED)
DEFAULT_REASON = REQUESTED


def normalise_reason(word: str | None) -> str | None:
    """The reason a request names: None when missing or blank, any unknown word `requested`.

    Surrounding whitespace is ignored and words match exactly (`DEADLINE` is unknown: `requested`).
    """
    if word is None:
        return None
    word = word.strip()
    if not word:
        return None
    return word if word in REASONS else DEFAULT_REASON


def parse_request(data: bytes) -> str | None:
    """The reason a request file's content names (see `normalise_reason`); bytes that are not UTF-8 still make a request."""
    return normalise_reason(data.decode("utf-8", "replace"))


def request_bytes(reason: str) -> bytes:
    """What a writer of `snapshot.request` puts in it for `reason` (one word and a newline)."""
    return f"{normalise_reason(reason) or DEFAULT_REASON}\n".encode()


# --- run ids -------------------------------------------------------------------------------------

RUN_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
RUN_ID_RE = re.compile(rf"^{RUN_ID_PATTERN}$", re.ASCII)


def is_run_id(value: object) -> bool:
    """Whether `value` can be a run id: it names a directory locally and on targets, so it is never a path."""
    return isinstance(value, str) and value not in (".", "..") and RUN_ID_RE.fullmatch(value) is not None


# --- checkpoints ---------------------------------------------------------------------------------

CHECKPOINT_PREFIX = "checkpoint-"
# The only names a proof can give: no sign, no leading zero, ASCII digits.
CHECKPOINT_NAME_RE = re.compile(r"checkpoint-(0|[1-9][0-9]*)", re.ASCII)


def checkpoint_name(step: int) -> str:
    """`checkpoint-<step>`, the directory the Trainer saves step `step` in."""
    return f"{CHECKPOINT_PREFIX}{int(step)}"


def checkpoint_relpath(step: int) -> str:
    """The exact `checkpoint` string a valid proof holds for `step`."""
    return f"{OUTPUT}/{checkpoint_name(step)}"


def checkpoint_step(name: str) -> int | None:
    """The step of a `checkpoint-<step>` name, or None for any other name."""
    match = CHECKPOINT_NAME_RE.fullmatch(name)
    return int(match.group(1)) if match else None


def real_checkpoints(run_dir: str) -> list[str]:
    """Names of the `output/checkpoint-*` entries that are real directories, with no link on their path.

    `output` itself must be a real directory too. The entries are looked at through a descriptor
    of `output` opened without following a link, so a link swapped in meanwhile is never followed.
    """
    try:
        out = os.open(os.path.join(run_dir, OUTPUT), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # missing, a link (ELOOP), or not a directory
        return []
    try:
        names = os.listdir(out)
        found = []
        for name in names:
            if not name.startswith(CHECKPOINT_PREFIX):
                continue
            try:
                st = os.stat(name, dir_fd=out, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                found.append(name)
        return sorted(found)
    except OSError:
        return []
    finally:
        os.close(out)


def is_real_checkpoint(output_dir: str, name: str) -> bool:
    """Whether `output_dir/name` is a real directory and `output_dir` is not a link (the plugin's check before a proof)."""
    try:
        out = os.lstat(output_dir)
        entry = os.lstat(os.path.join(output_dir, name))
    except OSError:
        return False
    return stat.S_ISDIR(out.st_mode) and stat.S_ISDIR(entry.st_mode)


# --- the proof -----------------------------------------------------------------------------------


# Named tuples, not dataclasses: `dataclasses` imports `inspect` (and with it `tokenize`, `dis`,
# `ast`), which this module, imported by every jobctl call on a target and by the `obd` command,
# has no use for.


class Proof(NamedTuple):
    """A valid `snapshot.json`: its checkpoint is exactly `output/checkpoint-<step>`."""

    checkpoint: str
    step: int
    reason: str
    time: float | None


class InvalidProof(NamedTuple):
    """A `snapshot.json` that proves nothing, and why; none of its paths is ever used."""

    why: str


def parse_proof(data: bytes) -> Proof | InvalidProof:
    """The proof in `data` (the bytes of `snapshot.json`), or why it is invalid.

    Pure: whether the checkpoint exists as a real directory is for the reader of the run
    directory to say (`real_checkpoints`).
    """
    if len(data) > PROOF_LIMIT:
        return InvalidProof(f"{SNAPSHOT_PROOF} is larger than 64 KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return InvalidProof(f"{SNAPSHOT_PROOF} is not UTF-8 text")
    try:
        value = load_json(text)
    except ValueError:
        return InvalidProof(f"{SNAPSHOT_PROOF} is not valid JSON")
    if not isinstance(value, dict):
        return InvalidProof(f"{SNAPSHOT_PROOF} is not a JSON object")
    step = value.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return InvalidProof(f"{SNAPSHOT_PROOF} has no valid step")
    checkpoint = value.get("checkpoint")
    expected = checkpoint_relpath(step)
    if checkpoint != expected:
        return InvalidProof(f"{SNAPSHOT_PROOF} names a checkpoint other than {expected}")
    when = value.get("time")
    if not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when):
        when = None
    reason = value.get("reason")
    return Proof(
        checkpoint=expected,
        step=step,
        reason=normalise_reason(reason if isinstance(reason, str) else None) or DEFAULT_REASON,
        time=None if when is None else float(when),
    )


def proof_bytes(step: int, reason: str, when: float) -> bytes:
    """The `snapshot.json` the plugin writes for `output/checkpoint-<step>`."""
    proof = {
        "checkpoint": checkpoint_relpath(step),
        "step": int(step),
        "time": when,
        "reason": normalise_reason(reason) or DEFAULT_REASON,
    }
    return (json.dumps(proof) + "\n").encode()


# --- JSON that others may have written -------------------------------------------------------

JSON_DEPTH_LIMIT = 64  # arrays and objects nested deeper than this are refused unparsed
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string, its escapes included
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonTooDeep(ValueError):
    """JSON nested deeper than the limit: refused before it is parsed (Python's parser recurses,
    and a file of 200,000 nested lists ends in a RecursionError)."""


def too_deep(data: bytes, limit: int) -> bool:
    """Whether `data`'s arrays and objects nest deeper than `limit` (brackets inside strings are
    not counted). Each pass drops the innermost pairs, so the work is the depth's, at most `limit`
    passes over the brackets alone; brackets that do not pair are left to the parser to refuse."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return False  # it cannot nest deeper than the brackets it has
    brackets = _JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        inner = brackets.replace(b"[]", b"").replace(b"{}", b"")
        if len(inner) == len(brackets):
            return False  # nothing pairs any more: not JSON, which the parser says
        brackets = inner
        if not brackets:
            return False
    return True


def load_json(data: bytes | str, limit: int = JSON_DEPTH_LIMIT) -> object:
    """Parse JSON written by a job or anyone else who can write where it lies, nesting at most
    `limit` deep: a ValueError (JsonTooDeep) for deeper, as for any JSON that does not parse."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    if too_deep(raw, limit):
        raise JsonTooDeep(f"JSON nested more than {limit} deep")
    try:
        return json.loads(raw)
    except RecursionError as exc:  # a limit above what the interpreter's stack takes
        raise JsonTooDeep(f"JSON nested too deep to parse: {exc}") from exc


# --- reading and writing files that others may tamper with ------------------------------------


def file_kind(mode: int) -> str:
    """What a file is, in words, from its `st_mode` (for messages about a file that is not a regular one)."""
    for test, words in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return words
    return "not a regular file"


def non_regular(path: str) -> str | None:
    """What `path` is when it exists but is not a regular file (`a FIFO`, `a symbolic link`, ...), else None.

    Only lstat()s: a FIFO or device is never opened, so this never blocks.
    """
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return None if stat.S_ISREG(st.st_mode) else file_kind(st.st_mode)


def read_regular(path: str, limit: int, offset: int = 0) -> bytes | None:
    """Read at most `limit` bytes of a regular file; None if it is missing or not a plain file.

    Never follows a link and never blocks on a FIFO or device someone put in the run directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        if offset:
            os.lseek(fd, offset, os.SEEK_SET)
        chunks = []
        left = limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write a file whole or not at all: a temporary file in the same directory, then rename."""
    directory = os.path.dirname(path) or "."
    # A fresh name opened with O_EXCL|O_NOFOLLOW: a link planted in the run directory under a
    # guessable temporary name can never redirect the write elsewhere.
    while True:
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}.{os.urandom(6).hex()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            break
        except FileExistsError:
            continue
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make a directory's entries durable; filesystems that refuse fsync on a directory are skipped."""
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)
