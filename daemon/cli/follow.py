"""The `obd` commands that follow a run: waits that outlive a daemon restart, logs, the list's watch.

Standard library only, like every module the client imports.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from daemon.cli import render
from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.cli.common import (
    EXIT_ERROR,
    RECONNECT_FOR,
    STATE_EXIT,
    on_this_machine,
)
from daemon.common.wire import FINAL


def _width() -> int | None:
    """The terminal's width for tables: COLUMNS, else the terminal's; None (no limit) when piped."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size().columns
    return None


def _watch_list(client: Client, params: dict[str, Any]) -> int:
    """Redraw the list every second until Ctrl-C; a daemon restart is waited out.

    Ctrl-C is the watch's only way out, so it ends it whatever the watch is doing (waiting for the
    daemon's answer, drawing, sleeping), also when the watch was started with SIGINT ignored (a
    script's background job, nohup), where Python would leave it ignored. A frame is written
    straight to the terminal, so nothing of a frame cut short is left to flush at the exit (which
    would wait on a terminal whose output is stopped)."""
    import shutil
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)
    patient = Patient(client)
    fd = sys.stdout.fileno()
    try:
        while True:
            runs = patient.call("list", **params)
            size = shutil.get_terminal_size()
            header = f"obd train list, every 1s (Ctrl-C to quit)  {time.strftime('%H:%M:%S')}"
            lines = [render.shorten_middle(header, size.columns), *render.table(runs, width=size.columns).split("\n")]
            frame = ("\033[H\033[2J" + "\n".join(lines[: max(size.lines - 1, 3)]) + "\n").encode(
                sys.stdout.encoding or "utf-8", "replace"
            )
            while frame:
                frame = frame[os.write(fd, frame) :]
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


class Patient:
    """Calls for a command that waits on a run: a daemon that went away (a restart) is waited for
    up to RECONNECT_FOR, and a target that cannot be read is waited for, each said once on stderr.
    Until the first call succeeds, errors are the caller's as usual."""

    def __init__(self, client: Client, answered: bool = True) -> None:
        self.client = client
        self.answered = answered

    def call(self, op: str, **params: Any) -> Any:
        lost_since: float | None = None
        waiting = ""  # what is waited for: "the target", "the daemon"
        while True:
            try:
                reply = self.client.call(op, **params)
            except RequestFailed as exc:
                if exc.kind != "unavailable" or not self.answered:
                    raise
                if not waiting:
                    waiting = "the target"
                    self._say(f"obd: {exc}; waiting for the target, the follow goes on where it was")
            except (DaemonUnreachable, DaemonBusy) as exc:
                if not self.answered:
                    raise
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_FOR:
                    raise
                if not waiting:
                    waiting = "the daemon"
                    first = str(exc).splitlines()[0].removeprefix("obd: ")
                    self._say(
                        f"obd: lost the daemon ({first}); waiting up to {RECONNECT_FOR / 60:.0f} min for it to "
                        "come back, the follow goes on where it was"
                    )
            else:
                if waiting:
                    self._say(f"obd: {waiting} answers again")
                self.answered = True
                return reply
            time.sleep(0.5)

    @staticmethod
    def _say(text: str) -> None:
        sys.stderr.write(render.printable(text) + "\n")
        sys.stderr.flush()


class _Feedback:
    """What a `--wait` waits for, on a terminal: one line per stage, the current one kept up to date.

    `targets` asks the daemon for its list of targets: whether a run's target is this machine
    (whose checkpoint's size can be read here) is asked once, and only of a target not `local`.
    """

    def __init__(self, targets: Callable[[], list[dict[str, Any]]] = list) -> None:
        self.stage = ""
        self.sizes: dict[str, str] = {}
        self.targets = targets
        self.here: dict[str, bool] = {}  # target -> whether it is this machine

    @classmethod
    def for_terminal(cls, targets: Callable[[], list[dict[str, Any]]] = list) -> _Feedback | None:
        return cls(targets) if sys.stderr.isatty() else None

    def show(self, record: dict[str, Any]) -> None:
        import shutil

        width = shutil.get_terminal_size().columns - 1
        stage, text = render.wait_stage(record, time.time(), self._size(record), width)
        if not text:
            return
        if self.stage and stage != self.stage:
            sys.stderr.write("\n")  # the stage that passed stays on the screen
        self.stage = stage
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()

    def done(self) -> None:
        if self.stage:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _size(self, record: dict[str, Any]) -> str | None:
        """The checkpoint's size on disk, for a run on this machine whose directory this user can read."""
        snapshot = record.get("snapshot") or {}
        if not snapshot or not record.get("remote_dir") or not self._here(record.get("target")):
            return None
        path = os.path.join(record["remote_dir"], snapshot["checkpoint"])
        if path not in self.sizes:
            self.sizes[path] = render.size_text(_disk_usage(path))
        return self.sizes[path] or None

    def _here(self, target: str | None) -> bool:
        """Whether the target is this machine; a daemon that does not answer leaves the size out."""
        name = str(target)
        if name not in self.here:
            try:
                self.here[name] = on_this_machine(target, self.targets)
            except (DaemonUnreachable, DaemonBusy, RequestFailed, OSError):
                return False  # asked again at the next show
        return self.here[name]


def _disk_usage(path: str, limit: int = 10000) -> int | None:
    """Bytes under `path` (links not followed, at most `limit` entries); None when it cannot be read."""
    total, seen = 0, 0
    stack = [path]
    try:
        while stack:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > limit:
                        return total
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return None
    return total


def _wait(patient: Patient, record: dict[str, Any], feedback: _Feedback | None) -> dict[str, Any]:
    """The run's record once it is final; on a terminal, what is awaited is shown as it goes."""
    run_id = record["id"]
    try:
        if feedback is not None:
            feedback.show(record)
        while record["state"] not in FINAL:
            record = patient.call("wait", id=run_id, timeout=1 if feedback is not None else 20)
            if feedback is not None:
                feedback.show(record)
    finally:
        if feedback is not None:
            feedback.done()
    return record


def _metrics(result: dict[str, Any], as_json: bool) -> int:
    metrics = result.get("metrics")
    if metrics is None:
        why = (
            "it was not started with --profile"
            if not result.get("profile")
            else "they come once the run has ended and its profile is parsed"
        )
        message = f"run {result['id']} has no metrics: {why}"
        if as_json:
            print(json.dumps({**result, "metrics": None, "message": message}, indent=1))
        else:
            print(f"{message}; state {result['state']}")
        return 0
    if as_json:
        print(json.dumps(metrics, indent=1))
        return 0
    from daemon.cli import machinery

    print(render.printable_lines(machinery.entry("format_metrics")(metrics)))
    return 0


class _Ndjson:
    """`logs --json`: one object a line, {"offset": where the line starts in job.log, "text": ...}."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.pending = b""

    def write(self, data: bytes) -> None:
        self.pending += data
        lines = self.pending.split(b"\n")
        self.pending = lines.pop()
        out = []
        for line in lines:
            out.append(self._line(line))
            self.offset += len(line) + 1
        if out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()

    def close(self) -> None:
        """The last line, when the log does not end with a newline."""
        if self.pending:
            sys.stdout.write(self._line(self.pending))
            self.offset += len(self.pending)
            self.pending = b""
        sys.stdout.flush()

    def _line(self, line: bytes) -> str:
        return json.dumps({"offset": self.offset, "text": line.decode("utf-8", "replace")}) + "\n"


class _Raw:
    def __init__(self) -> None:
        self.out = sys.stdout.buffer

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    def close(self) -> None:
        self.out.flush()


def _logs(client: Client, ref: str, follow: bool, tail: int | None, as_json: bool) -> int:
    """Print the log (or follow it until the run's chain ends, through each next attempt of a
    retry or a preemption: the exit code is its last attempt's final state's)."""
    patient = Patient(client, answered=False)
    run_id = patient.call("wait", id=ref, timeout=0)["id"]  # `last` or a name: the run it names now
    first = {"tail_lines": tail} if tail is not None else {}
    reply = patient.call("read", id=run_id, offset=0, **first)
    sink: _Ndjson | _Raw = _Ndjson(reply.get("offset", 0)) if as_json else _Raw()
    live = follow and sys.stdout.isatty() and not as_json
    while True:
        shown_progress = _print_log(patient, run_id, reply, sink, follow, live)
        if not follow:
            sink.close()
            return 0
        record = patient.call("wait", id=run_id, timeout=0)
        following = _next_attempt(patient, record)
        if following is None:
            break
        if shown_progress:
            sys.stderr.write("\r\033[K")
        print(f"obd: {render.outcome(record)}; following its next attempt, {following}", file=sys.stderr)
        run_id = following
        reply = patient.call("read", id=run_id, offset=0)
        if as_json:
            sink = _Ndjson(0)
    sink.close()
    if record["state"] != "succeeded":
        print(f"obd: {render.outcome(record)}", file=sys.stderr)  # its message names the exit code
    return STATE_EXIT.get(record["state"], EXIT_ERROR)


def _print_log(
    patient: Patient, run_id: str, reply: dict[str, Any], sink: _Ndjson | _Raw, follow: bool, live: bool
) -> bool:
    """One attempt's log from `reply` on: what there is, or (following) until the attempt ended
    and its last lines were read. Whether a progress line is left on the terminal."""
    shown_progress = False
    while True:
        data = base64.b64decode(reply.get("data", ""))
        if data:
            if shown_progress:
                sys.stderr.write("\r\033[K")
                shown_progress = False
            sink.write(data)
        offset = reply.get("next", reply.get("offset", 0))
        if not follow:
            if not data or len(data) < 65536:
                return shown_progress
        elif not data:
            if reply.get("state") in FINAL:
                # One more read: the job may have written its last lines before it ended.
                reply = patient.call("read", id=run_id, offset=offset)
                if not reply.get("data"):
                    return shown_progress
                continue
            if live:
                sys.stderr.write("\r\033[K" + render.progress_line(reply.get("progress") or {}))
                sys.stderr.flush()
                shown_progress = True
            time.sleep(0.25)
        reply = patient.call("read", id=run_id, offset=offset)


def _next_attempt(patient: Patient, record: dict[str, Any]) -> str | None:
    """The next attempt of an ended attempt's chain, once the daemon made it (after a retry's
    backoff, or a paused run's turn in the queue); None when the chain ends here."""
    while record.get("attempt_to_come"):
        if record.get("retried_by"):
            return str(record["retried_by"])
        time.sleep(0.5)
        record = patient.call("wait", id=record["id"], timeout=0)
    return None
