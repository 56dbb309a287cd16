"""The run-directory side of the in-job plugin: environment, request, proof, metrics, SIGTERM flag.

Standard library only, so the Trainer callback, the custom-loop helpers and `sitecustomize`
share one implementation of the file contract (its names and rules are in `rundir`) without
importing torch or transformers.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import signal
import stat
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from . import rundir
from .rundir import DEFAULT_REASON, REASONS, REQUEST_LIMIT, atomic_write, fsync_dir, parse_request

VERSION = "0.1.0"
# Set to 1 (or true, yes) in the job's environment, by the script itself or its command line
# (`env OBD_SNAPSHOT_RETURNS=1 python train.py`), to get train()'s return after a snapshot.
SNAPSHOT_RETURNS = "OBD_SNAPSHOT_RETURNS"
# At most one heartbeat `log` line (step, time, tokens; no loss) this often between Trainer logs.
DEFAULT_PROGRESS_INTERVAL = 10.0


@dataclass(frozen=True)
class RunEnv:
    """The `OBD_*` variables a job gets under obd; `active` is False outside obd (everything is a no-op)."""

    run_id: str | None
    run_dir: str | None
    output_dir: str | None
    request_path: str | None
    proof_path: str | None
    metrics_path: str | None
    resume_from: str | None
    snapshot_on_sigterm: bool
    profile_dir: str | None = None  # OBD_PROFILE_DIR, when the run is profiled
    torch_profile: bool = False  # OBD_TORCH_PROFILE=1: the callback drives torch_profile.StepProfiler
    progress_interval: float = DEFAULT_PROGRESS_INTERVAL  # OBD_PROGRESS_INTERVAL: seconds between heartbeat lines
    # OBD_SNAPSHOT_RETURNS=1: a Trainer stopped for a snapshot returns from train() (with a
    # marker, see StoppedForSnapshot) instead of ending the job there.
    snapshot_returns: bool = False

    @property
    def active(self) -> bool:
        return bool(self.run_dir)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> RunEnv:
        """Read the environment now; paths obd did not set default to their place in OBD_RUN_DIR."""
        env = os.environ if environ is None else environ
        run_dir = env.get("OBD_RUN_DIR") or None

        def path(name: str, default: str) -> str | None:
            value = env.get(name)
            if value:
                return value
            return os.path.join(run_dir, default) if run_dir else None

        return cls(
            run_id=env.get("OBD_RUN_ID") or None,
            run_dir=run_dir,
            output_dir=path("OBD_OUTPUT_DIR", rundir.OUTPUT),
            request_path=path("OBD_SNAPSHOT_REQUEST", rundir.SNAPSHOT_REQUEST),
            proof_path=path("OBD_SNAPSHOT_FILE", rundir.SNAPSHOT_PROOF),
            metrics_path=path("OBD_METRICS_FILE", rundir.METRICS),
            resume_from=env.get("OBD_RESUME_FROM") or None,
            snapshot_on_sigterm=_flag(env.get("OBD_SNAPSHOT_ON_SIGTERM")),
            profile_dir=env.get("OBD_PROFILE_DIR") or None,
            torch_profile=_flag(env.get("OBD_TORCH_PROFILE")),
            progress_interval=progress_interval(env.get("OBD_PROGRESS_INTERVAL")),
            snapshot_returns=_flag(env.get(SNAPSHOT_RETURNS)),
        )


def _flag(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes")


def progress_interval(value: str | None) -> float:
    """Seconds between heartbeat lines from OBD_PROGRESS_INTERVAL: 0 is every step, `inf` none.

    Unset, empty, negative or not a number: the default (a bad value is said in the job log).
    """
    text = (value or "").strip()
    if not text:
        return DEFAULT_PROGRESS_INTERVAL
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds < 0:
        log_error(
            f"obd: OBD_PROGRESS_INTERVAL={text!r} is not a number of seconds >= 0; using {DEFAULT_PROGRESS_INTERVAL:g}"
        )
        return DEFAULT_PROGRESS_INTERVAL
    return seconds


# --- the request ------------------------------------------------------------------------


_access = os.access


def read_request(path: str | None) -> str | None:
    """The pending request's reason, or None; costs one `access()` when there is no request.

    `access()` is a path lookup with no stat buffer and, when nothing is there, no exception:
    the cheapest check that still sees a request written by anyone, by any means, at any
    moment (a cached directory mtime would miss a request made within the same clock tick as
    the last change it saw, and an empty file there must still be watched for content).
    """
    if not path or not _access(path, os.F_OK):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if st.st_size == 0 or not stat.S_ISREG(st.st_mode):
        # Only a regular file is a request (as for the daemon's reader): a FIFO or device
        # someone put there is never opened, since opening it could block the training step.
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None  # removed between stat and open: no request any more
    try:
        data = os.read(fd, REQUEST_LIMIT)
    except OSError:
        data = b"?"  # unreadable but non-empty: a request all the same
    finally:
        os.close(fd)
    # The same reading as the daemon's (rundir.parse_request), so job and daemon always agree
    # on whether there is a request and what it asks for.
    return parse_request(data) if data else None


def reason_code(reason: str | None) -> int:
    """0 for no request, else the reason's 1-based position in REASONS (sent between ranks)."""
    if reason is None:
        return 0
    return REASONS.index(reason) + 1 if reason in REASONS else 1


def reason_from_code(code: int) -> str | None:
    if code <= 0:
        return None
    return REASONS[code - 1] if code <= len(REASONS) else DEFAULT_REASON


# --- durable files ----------------------------------------------------------------------


def fsync_tree(root: str) -> None:
    """fsync every regular file and directory under `root`, then `root`'s parent.

    fsync acts on the file, not on the descriptor, so this also flushes what other ranks
    of this node wrote into the checkpoint.
    """
    for directory, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.fsync(fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        fsync_dir(directory)
    fsync_dir(os.path.dirname(os.path.abspath(root)))


# --- the proof --------------------------------------------------------------------------


class IncompleteCheckpoint(RuntimeError):
    """The checkpoint a proof would name is missing or not fully written: no proof is written."""


def write_proof(env: RunEnv, step: int, reason: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Write `snapshot.json` for `output/checkpoint-<step>` once that directory is complete and on disk.

    `required` names files that must exist in the checkpoint (the Trainer's `trainer_state.json`,
    written last); the whole checkpoint is fsynced before the proof is renamed into place.
    """
    if not env.active or not env.output_dir or not env.proof_path:
        raise RuntimeError("write_proof needs OBD_RUN_DIR (it is a no-op outside obd)")
    name = rundir.checkpoint_name(step)
    checkpoint = os.path.join(env.output_dir, name)
    if not os.path.isdir(checkpoint):
        raise IncompleteCheckpoint(f"obd: no checkpoint directory {checkpoint}; no snapshot proof written")
    if not rundir.is_real_checkpoint(env.output_dir, name):
        # The daemon takes no proof of a linked checkpoint: say so here, where it can be fixed.
        raise IncompleteCheckpoint(
            f"obd: {checkpoint} or its output directory is a symbolic link; a snapshot must be a real "
            "directory in the run's output/, so no snapshot proof was written"
        )
    missing = [name for name in required if not os.path.exists(os.path.join(checkpoint, name))]
    if missing:
        raise IncompleteCheckpoint(
            f"obd: checkpoint {checkpoint} lacks {', '.join(missing)}; no snapshot proof written"
        )
    fsync_tree(checkpoint)
    data = rundir.proof_bytes(step, reason, time.time())
    atomic_write(env.proof_path, data)
    return dict(json.loads(data))


@dataclass(frozen=True)
class StoppedForSnapshot:
    """What a training that stopped for a snapshot left: the step it stopped at, why, and its checkpoint.

    `trainer.state.obd_snapshot` after a Trainer's train() (set on every rank once the proof is
    written), and `stopped_for_snapshot()` for the process. The training did not finish: its
    model is the checkpoint's, `step` of `max_steps` (None when the loop did not say).
    """

    step: int
    max_steps: int | None
    reason: str
    checkpoint: str  # the checkpoint directory the proof names, as an absolute path

    def __str__(self) -> str:
        of = f" of {self.max_steps}" if self.max_steps else ""
        return f"stopped for a snapshot at step {self.step}{of} ({self.reason}): {self.checkpoint}"


# This process's snapshot, once its proof is written: the first one (a later training in the
# same process never replaces it, see callback.py).
_stopped: StoppedForSnapshot | None = None


def note_snapshot(marker: StoppedForSnapshot) -> StoppedForSnapshot:
    """Record this process's snapshot (the first one wins); returns the one recorded."""
    global _stopped
    if _stopped is None:
        _stopped = marker
    return _stopped


def stopped_for_snapshot(trainer: Any = None) -> StoppedForSnapshot | None:
    """Whether training stopped for a snapshot, and where: None when it did not (or outside obd).

    With a Trainer: that Trainer's last train() (`trainer.state.obd_snapshot`). Without: any
    training of this process (a Trainer's or a custom loop's `write_proof`). A script gets to
    ask only when it opted out of the job ending at the snapshot (OBD_SNAPSHOT_RETURNS=1) or
    in a custom loop, which never ends the job itself.
    """
    if trainer is None:
        return _stopped
    marker = getattr(getattr(trainer, "state", None), SNAPSHOT_ATTRIBUTE, None)
    return marker if isinstance(marker, StoppedForSnapshot) else None


# The attribute of a Trainer's state that holds its StoppedForSnapshot.
SNAPSHOT_ATTRIBUTE = "obd_snapshot"


def write_request(env: RunEnv, reason: str) -> None:
    """Write `snapshot.request` (atomically), e.g. so the daemon sees a preemption the job noticed.

    A failure is reported, not raised: the snapshot itself goes on.
    """
    if not env.request_path:
        return
    try:
        atomic_write(env.request_path, rundir.request_bytes(reason))
    except OSError as exc:
        log_error(f"obd: cannot write {env.request_path} ({exc})")


# --- metrics.jsonl ----------------------------------------------------------------------


def sanitize(value: Any) -> Any:
    """A JSON-safe copy of `value`: non-finite floats become None, tensors/numpy scalars plain numbers."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [sanitize(v) for v in value]
    item = getattr(value, "item", None)  # torch/numpy scalars, without importing either
    if callable(item):
        try:
            return sanitize(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    try:
        return sanitize(float(value))
    except (TypeError, ValueError):
        return str(value)


def _not_json(value: Any) -> Any:
    raise TypeError(f"{type(value).__name__} is not JSON")


def _strict_encoder() -> Callable[[Any], str]:
    """Compact, strict JSON (`allow_nan=False`) of a dict, with an encoder built once.

    The C encoder that `json.dumps` would build on every call, made here once (the pure-Python
    `JSONEncoder` where the interpreter has no `_json`). Circularity is not checked: what it
    encodes is the plugin's own fresh dict, and a cycle in a logged value ends in RecursionError,
    which `encode_line` handles like any other value it cannot encode.
    """
    from json import encoder as json_encoder

    make = getattr(json_encoder, "c_make_encoder", None)
    if make is None:
        return json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
    encode = make(None, _not_json, json_encoder.encode_basestring_ascii, None, ":", ",", False, False, False)
    return lambda value: "".join(encode(value, 0))


_encode = _strict_encoder()


def encode_line(record: dict[str, Any]) -> bytes:
    """One `metrics.jsonl` line of `record`: strict JSON, non-finite numbers as null, newline-terminated.

    A dict of plain numbers and strings (every Trainer log) is encoded as it is, with no
    sanitising pass; the strict encoder refuses NaN, infinities and types JSON has no word for
    (tensors, numpy integers), and only then is the whole record sanitised, nested values
    included, and encoded again.
    """
    try:
        line = _encode(record)
    except (ValueError, TypeError, RecursionError):
        line = _encode(sanitize(record))
    return (line + "\n").encode()


# The Trainer's step logs are written together at most this often (seconds): at a log a step,
# a write() per line was most of the plugin's share of a short step, and a write every 0.25 s
# still about a tenth of it (a cache-cold append of ~40 us, and the batch's first cold lines).
LOG_BATCH_SECONDS = 1.0
# Step logs that no step end wrote (a Trainer that hangs, a long evaluation or save, the last
# steps before a crash) are written by a thread this long after they were due, so every logged
# step is in the file within LOG_BATCH_SECONDS + LOG_LATE_SECONDS whether or not another step
# comes. Longer than a typical short step, so that the step end, where the writing costs least
# (no thread to wake, no switch of the GIL), is almost always the one that writes them.
LOG_LATE_SECONDS = 0.1
_monotonic = time.monotonic


def step_log_lines(waiting: list[tuple[float, int, int, dict[str, Any]]], offset: float) -> bytes:
    """The `log` lines of Trainer step logs `(time.monotonic(), step, tokens, logs)`; each line's time is its monotonic time + `offset`.

    Each line is what `encode_line` makes of `{"event": "log", "time", "step", "loss",
    "learning_rate", "grad_norm", "epoch", "tokens", **logs}`: the Trainer's keys land in the
    slots laid out first (null when absent), any other after `tokens`, and `event` and `time`
    are never replaced. The Trainer's usual log (exactly `loss`, `learning_rate`, `grad_norm`,
    `epoch`, all finite floats) is built by one f-string in this loop, byte for byte the same
    (float repr is JSON's) at a fraction of the cost; any other goes through `encode_line`. A
    log that cannot be encoded costs its line (said in the job log), never the training.
    """
    out: list[str] = []
    add = out.append
    for mono, step, tokens, logs in waiting:
        now = mono + offset
        if len(logs) == 4 and type(step) is type(tokens) is int:
            get = logs.get
            loss, rate, norm, epoch = get("loss"), get("learning_rate"), get("grad_norm"), get("epoch")
            if type(loss) is type(rate) is type(norm) is type(epoch) is float:
                total = loss + rate + norm + epoch
                if total - total == 0.0:  # no NaN or infinity among them (nor a sum past the float range)
                    add(
                        f'{{"event":"log","time":{now!r},"step":{step},"loss":{loss!r},"learning_rate":{rate!r},'
                        f'"grad_norm":{norm!r},"epoch":{epoch!r},"tokens":{tokens}}}\n'
                    )
                    continue
        record: dict[str, Any] = {
            "event": "log",
            "time": now,
            "step": step,
            "loss": None,
            "learning_rate": None,
            "grad_norm": None,
            "epoch": None,
            "tokens": tokens,
        }
        record.update(logs)
        record["event"], record["time"] = "log", now
        try:
            add(encode_line(record).decode())
        except Exception as exc:  # a logged value whose str() fails must not stop training
            log_error(f"obd: a log line could not be written as JSON ({exc!r}); skipped")
    return "".join(out).encode()


class MetricsWriter:
    """Appends one JSON object a line to `metrics.jsonl`; a no-op without a path (outside obd, or rank > 0).

    The file is opened with O_APPEND and lines go to it whole, each `write()` holding whole
    lines, so a reader never sees part of a line (short of a full disk). Every line is in the
    file (the kernel's page cache) when `write_record` returns, except the Trainer's step logs
    (`write_soon`): those wait for the next write, a step end past LOG_BATCH_SECONDS, or at the
    latest for a thread that writes them LOG_LATE_SECONDS after that, whether or not another
    step comes. So a line is in the file at most LOG_BATCH_SECONDS + LOG_LATE_SECONDS after it
    was logged, a job that hangs shows its last logged step, and a job killed outright loses at
    most that much of its loss curve, never its order.
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._fd: int | None = None
        self._lock = threading.Lock()
        self.began = False
        # Step logs not yet written, oldest first, as (time.monotonic(), step, tokens, logs): the
        # lines are made when written, several together, where formatting them one a step was
        # cache-cold; their wall time is taken from the clocks' offset then (one clock read a log).
        # The list object is never replaced: write_soon appends to it without a lock while the
        # late writer's thread may be taking lines from its front (write_line).
        self._waiting: list[tuple[float, int, int, dict[str, Any]]] = []
        # time.monotonic() from which step logs that wait are written (by write_soon or flush).
        self._due = 0.0
        # The late writer: a thread started when the first batch of step logs waits. `_late_idle`
        # is True until then and while the thread sleeps with nothing waiting (write_soon then
        # wakes it); otherwise it sleeps until LOG_LATE_SECONDS past `_due` on its own.
        self._late: threading.Condition | None = None
        self._late_idle = True
        self._closed = False
        if path is not None:  # a script that ends without the Trainer's train end (a crash) keeps its step logs
            atexit.register(self.close)
            _writers.add(self)

    def write_soon(self, mono: float, step: int, tokens: int, logs: dict[str, Any]) -> float:
        """A Trainer step log, logged at `mono` (time.monotonic()): written at once if none was in the
        last LOG_BATCH_SECONDS, else with the next write or by the late writer. Returns `write_due()` after it."""
        self._waiting.append((mono, step, tokens, logs))  # one append: atomic, no lock needed
        if mono >= self._due:
            self.flush(mono)
            return math.inf
        if self._late_idle:  # a batch starts waiting and no thread is timing one: about once a second at most
            self._wake_late_writer()
        return self._due

    def write_due(self) -> float:
        """When the step logs that wait are to be written (time.monotonic()); infinity when none wait."""
        return self._due if self._waiting else math.inf

    def flush(self, mono: float) -> None:
        """Write the step logs that wait (a step end past `due`, a snapshot, the end of training, the late writer)."""
        if self._waiting:
            self.write_line(b"")
        self._due = mono + LOG_BATCH_SECONDS

    def _wake_late_writer(self) -> None:
        """Start the late writer's thread, or wake it from its idle wait."""
        late = self._late
        if late is None:
            self._late = late = threading.Condition(threading.Lock())
            self._late_idle = False
            threading.Thread(target=self._write_late, args=(late,), name="obd-metrics-late", daemon=True).start()
            return
        with late:
            late.notify()

    def _write_late(self, late: threading.Condition) -> None:
        """The late writer's thread: write step logs still waiting LOG_LATE_SECONDS after they were due.

        It sleeps (the GIL released) until then, and while nothing waits. A step end usually
        writes them first (steps are shorter than LOG_LATE_SECONDS), and then the thread only
        wakes to find the next batch's time: about once a second while step logs come.
        """
        with late:
            while self._late_turn(late):
                pass

    def _late_turn(self, late: threading.Condition) -> bool:
        """One turn of the late writer, which holds `late`: a wait, or a write of what is overdue; False once closed."""
        if self._closed:
            return False
        self._late_idle = True  # before looking: a line appended after the look wakes the thread
        if not self._waiting:
            late.wait()
            return True
        self._late_idle = False
        now = _monotonic()
        delay = self._due + LOG_LATE_SECONDS - now
        if delay > 0:
            late.wait(delay)
        else:
            self.flush(now)
        return True

    def write(self, event: str, **fields: Any) -> None:
        self.write_record(event, fields)

    def write_record(self, event: str, fields: dict[str, Any]) -> None:
        """Append the line `{"event": event, "time": <now>, **fields}`; `event` and `time` are never overridden."""
        if self.path is None:
            return
        now = time.time()
        record = {"event": event, "time": now}
        record.update(fields)
        if len(record) != len(fields) + 2:
            record["event"], record["time"] = event, now
        try:
            line = encode_line(record)
        except Exception as exc:  # a logged value whose str() fails must not stop training
            log_error(f"obd: a {event} line could not be written as JSON ({exc!r}); skipped")
            return
        if self.write_line(line) and event == "begin":
            self.began = True

    def write_line(self, line: bytes) -> bool:
        """Append encoded lines (`encode_line`, `step_log_lines`); False if they were not written."""
        with self._lock:
            waiting = self._waiting
            if self.path is None:
                waiting.clear()  # nowhere to go: the late writer must not keep finding them
                return False
            if waiting:  # step logs that waited go first, in the same write
                # Taken from the front, the list kept: a line write_soon appends meanwhile stays.
                count = len(waiting)
                taken = waiting[:count]
                del waiting[:count]
                line = step_log_lines(taken, time.time() - time.monotonic()) + line
            try:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                written = os.write(self._fd, line)
                while written < len(line):  # only on a nearly full disk; the rest follows at once
                    written += os.write(self._fd, line[written:])
            except OSError as exc:
                # Metrics must never stop training (a full disk, a vanished directory): say so
                # once in the job log and stop writing them.
                log_error(f"obd: cannot write {self.path} ({exc}); no more metrics from this job")
                self.path = None
                return False
        return True

    def close(self) -> None:
        if self._waiting:
            self.write_line(b"")
        atexit.unregister(self.close)  # closed: nothing is left for the end of the process
        self._closed = True
        late = self._late
        if late is not None:
            with late:
                late.notify()  # the thread sees `_closed` and ends
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _forget_in_child(self) -> None:
        """In a child forked from the job (a DataLoader worker, a script's own fork): write nothing.

        The parent writes this job's metrics; a child's copy would write its lines again at its
        exit. Its locks may have been held by a thread that does not exist in the child, and it
        has no late writer: all made anew, inert.
        """
        self.path = None
        self._waiting = []
        self._lock = threading.Lock()
        self._late, self._late_idle, self._closed = None, True, True
        atexit.unregister(self.close)


# The writers with a path in this process, for the fork hook; weak, so a writer dropped is gone.
_writers: weakref.WeakSet[MetricsWriter] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for writer in list(_writers):
        writer._forget_in_child()
    _writers.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- SIGTERM ----------------------------------------------------------------------------


class SigtermFlag:
    """With OBD_SNAPSHOT_ON_SIGTERM=1, turns SIGTERM into a flag that the next step end handles as `preempted`.

    The handler only sets the flag (nothing is safe to do inside a signal handler in the middle
    of a training step). It is installed only while training runs: outside that window nobody
    would act on the flag, so `restore()` puts the previous handler back and re-delivers a
    SIGTERM that was never turned into a snapshot, giving it its usual meaning.
    """

    def __init__(self) -> None:
        self.pending = False
        self._previous: Callable[[int, FrameType | None], Any] | int | None = None
        self._installed = False
        self._on_signal: Callable[[], None] | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.pending = True
        if self._on_signal is not None:
            self._on_signal()

    def install(self, on_signal: Callable[[], None] | None = None) -> bool:
        """Turn SIGTERM into the flag (main thread only); `on_signal` also runs in the handler, so keep it to a store."""
        self._on_signal = on_signal
        if self._installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            print("obd: SIGTERM snapshots need the main thread; not installed", file=sys.stderr)
            return False
        self._previous = signal.signal(signal.SIGTERM, self._handler)
        self._installed = True
        return True

    def consume(self) -> bool:
        """True once for each SIGTERM received since the last call."""
        pending, self.pending = self.pending, False
        return pending

    def restore(self) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed = False
        if self.consume():
            os.kill(os.getpid(), signal.SIGTERM)


def log_error(message: str) -> None:
    """Say something to the job's log (stderr is job.log under obd)."""
    print(message, file=sys.stderr, flush=True)
