"""metrics.jsonl as the in-job plugin writes it (standard library only): one JSON object a line,
`begin`, `log` and `end`, non-finite numbers as null, step logs written together at most a
second late (a late writer's thread writes a batch still waiting, so a job that hangs shows its
last step), nothing written twice by a forked child. Kept apart from runtime.py (the request,
the proof, SIGTERM) for its size.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .runtime import log_error


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
