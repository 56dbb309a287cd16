"""The run-directory side of the in-job plugin: environment, request, proof, SIGTERM flag (metrics.jsonl is metrics_file.py).

Standard library only, so the Trainer callback, the custom-loop helpers and `sitecustomize`
share one implementation of the file contract (its names and rules are in `rundir`) without
importing torch or transformers.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .. import rundir
from ..rundir import DEFAULT_REASON, REASONS, REQUEST_LIMIT, atomic_write, fsync_dir, parse_request

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
