"""Notifications: the `[[notify]]` entries, told of what happens to runs, each event exactly once.

A run's history is the log events are read from: every entry of it that changes the run's state
is an event (`queued`, `started` for running, and the four final states), and so are the notes
of a valid snapshot proof (`snapshot`) and of a snapshot request for the cost cap
(`cost_warning`). For each notify entry and each run, the index of the next history entry to
look at is kept on disk, beside the run's record (`runs/<id>/notify.json`, written atomically).
An event is read from the record only once the record holding it is saved, is delivered, and
only then is the mark moved past it; so after a SIGKILL and a restart the daemon delivers what
was pending, in order, and never again what was marked. One window remains: a daemon killed
after a receiver took an event and before its mark was written delivers that event again after
its restart, with the same `event_id` (`<run id>:<history index>:<event>`), by which the
receiver can drop it.

Deliveries run in their own tasks, one per entry and run, with a timeout per attempt, retries and
backoff: a slow or failing hook never holds up a follow, a record or another entry. An event
that still fails after its retries is logged once, with the reason, and given up.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import ssl
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import unquote, urlsplit

import anyio
import anyio.to_thread
import structlog

from daemon.service.config import NotifyEntry
from daemon.service.models import RunRecord, RunState, Transition
from daemon.service.ports import Runs
from executors.factory import pod_cost
from trainer_plugin.rundir import atomic_write

if TYPE_CHECKING:
    from anyio.abc import TaskGroup


log = structlog.get_logger("obd.notify")


class NotifyHost(Runs, Protocol):
    """What notifications use of the daemon beyond the records: which records are not saved yet
    (their events wait, so a delivery is never marked ahead of its record)."""

    @property
    def unsaved(self) -> set[str]: ...


MARKS_FILE = "notify.json"  # per run, beside run.json: the next history index per notify entry
ENTRIES_FILE = "notify.json"  # in the state directory: when each notify entry was first seen
MARKS_LIMIT = 1024 * 1024
MAX_BACKOFF = 300.0
PARALLEL_PER_ENTRY = 4  # runs whose events one entry delivers at once
STATE_EVENTS = {
    RunState.queued.value: "queued",
    RunState.running.value: "started",
    RunState.stopped.value: "stopped",
    RunState.succeeded.value: "succeeded",
    RunState.failed.value: "failed",
    RunState.cancelled.value: "cancelled",
}
# The notes daemon/service/stop.py and daemon/service/handlers.py write in a run's history.
PROOF_NOTE = "snapshot proof: "
COST_NOTES = ("snapshot requested (cost)", "snapshot request reason changed to cost")
PREEMPT_NOTES = ("preempted for run ", "target ")  # daemon/service/preempt.py's pause notes: for a run, or a drain
BAD_CHECKPOINT_NOTE = "checkpoint "  # daemon/service/recovery.py's mark: "checkpoint X of run Y is bad: ..."
# What a command gets of the daemon's environment, besides the names its entry lists.
COMMAND_ENV = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LC_ALL", "TZ")
USER_AGENT = "obd-notify/1"


# --- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """One thing that happened to a run, at one entry of its history."""

    run_id: str
    index: int  # in the run's history
    kind: str  # one of config.NOTIFY_EVENTS
    state: str  # the run's state at that entry
    time: float
    message: str

    @property
    def id(self) -> str:
        """Stable across restarts and retries: a receiver drops an event whose id it has seen."""
        return f"{self.run_id}:{self.index}:{self.kind}"


def _state(entry: Transition) -> str:
    return entry.state.value if isinstance(entry.state, RunState) else str(entry.state)


def classify(previous: str | None, entry: Transition) -> str | None:
    """The event an entry of a history is, given the state before it; None for other notes."""
    state = _state(entry)
    if state != previous:
        return STATE_EVENTS.get(state)
    if entry.reason.startswith(PROOF_NOTE):
        return "snapshot"
    if entry.reason.startswith(COST_NOTES):
        return "cost_warning"
    if entry.reason.startswith(BAD_CHECKPOINT_NOTE) and " is bad: " in entry.reason:
        return "bad_checkpoint"
    if entry.reason.startswith(PREEMPT_NOTES) and (
        "preempted for run " in entry.reason or entry.reason.endswith(" drained")
    ):
        return "preempted"
    return None


def events(record: RunRecord, start: int = 0) -> Iterator[Event]:
    """The run's events at history entries `start` and after, in order."""
    history = record.history
    for index in range(max(start, 0), len(history)):
        previous = _state(history[index - 1]) if index else None
        kind = classify(previous, history[index])
        if kind is not None:
            entry = history[index]
            yield Event(record.id, index, kind, _state(entry), entry.time, entry.reason)


def pod_spend(record: RunRecord, at: float) -> dict[str, Any] | None:
    """The run's pod, its rate and what it had cost at `at`; None for a run with no pod."""
    cost = pod_cost(record.target_info, at)
    if cost is None:
        return None
    return {
        "pod_id": cost.pod_id,
        "gpu_type": cost.gpu_type,
        "cost_per_hr": cost.cost_per_hr,
        "spend_usd": cost.spend_usd,
    }


def payload(record: RunRecord, event: Event) -> dict[str, Any]:
    """What a receiver gets: fields of the record and the event, never a value of a secret or of
    the run's environment (records hold only their names, and none of them is sent)."""
    return {
        "event": event.kind,
        "event_id": event.id,
        "time": event.time,
        "run_id": record.id,
        "name": record.name,
        "owner": record.owner,
        "target": record.target,
        "state": event.state,
        "message": event.message,
        "state_now": record.state.value,
        "exit_code": record.exit_code,
        "snapshot": record.snapshot.model_dump(mode="json") if record.snapshot else None,
        "progress": record.progress.model_dump(mode="json"),
        "pod": pod_spend(record, event.time),
        "resumed_from": record.resumed_from,
    }


def applies(entry: NotifyEntry, record: RunRecord) -> bool:
    """Whether an entry hears of this run at all (its `owners` and `targets` filters)."""
    if entry.owners is not None and record.owner not in entry.owners:
        return False
    return entry.targets is None or record.target in entry.targets


# --- delivery ----------------------------------------------------------------------------------


class DeliveryError(Exception):
    """One attempt failed; `final` when trying again cannot help (a 4xx, a missing program)."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.final = final


_tls: ssl.SSLContext | None = None


def _tls_context() -> ssl.SSLContext:
    global _tls
    if _tls is None:
        _tls = ssl.create_default_context()
    return _tls


def http_request(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    """The bytes of a POST of `body` to `url` (HTTP/1.1, one request, then the connection closes)."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [
        f"POST {target} HTTP/1.1",
        f"Host: {parts.netloc.rpartition('@')[2]}",
        f"User-Agent: {USER_AGENT}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if parts.username is not None:
        secret = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        lines.append(f"Authorization: Basic {base64.b64encode(secret).decode()}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_of(head: bytes) -> tuple[int, str]:
    """(status code, reason phrase) from the start of an HTTP answer."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    fields = line.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise DeliveryError(f"not an HTTP answer: {line[:80]!r}" if line else "the receiver closed without answering")
    return int(fields[1]), fields[2].strip() if len(fields) > 2 else ""


async def post_json(url: str, body: bytes, headers: dict[str, str]) -> None:
    """POST a JSON body; return on a 2xx answer, raise DeliveryError on anything else."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host = parts.hostname or ""
    port = parts.port or (443 if https else 80)
    try:
        if https:
            stream: Any = await anyio.connect_tcp(host, port, tls=True, ssl_context=_tls_context(), tls_hostname=host)
        else:
            stream = await anyio.connect_tcp(host, port)
    except OSError as exc:
        raise DeliveryError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
    except ssl.SSLError as exc:
        raise DeliveryError(f"TLS with {host}:{port} failed: {exc.reason or exc}") from exc
    async with stream:
        head = b""
        try:
            await stream.send(http_request(url, body, headers))
            while b"\r\n" not in head and len(head) < 8192:
                head += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass  # judged by what came back, below
    code, phrase = status_of(head)
    if not 200 <= code < 300:
        raise DeliveryError(f"HTTP {code} {phrase}".strip(), final=400 <= code < 500 and code not in (408, 429))


def command_env(entry: NotifyEntry, event: Event, record: RunRecord) -> dict[str, str]:
    """A hook command's environment: a few of the daemon's variables (never all: the daemon's may
    hold secrets), those its entry names, and what the event is."""
    env = {k: os.environ[k] for k in (*COMMAND_ENV, *entry.env) if k in os.environ}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(
        OBD_EVENT=event.kind,
        OBD_EVENT_ID=event.id,
        OBD_RUN_ID=record.id,
        OBD_RUN_STATE=event.state,
        OBD_RUN_NAME=record.name or "",
    )
    return env


async def run_command(argv: list[str], body: bytes, env: dict[str, str]) -> None:
    """Run a hook command with `body` on its stdin; return on exit 0, raise DeliveryError otherwise.
    Cancelled (its timeout), its whole process group is killed."""
    try:
        process = await anyio.open_process(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd="/",
            start_new_session=True,
        )
    except OSError as exc:
        final = isinstance(exc, (FileNotFoundError, PermissionError))
        raise DeliveryError(f"cannot run {argv[0]}: {exc.strerror or exc}", final=final) from exc
    errors = bytearray()
    try:
        assert process.stdin is not None and process.stderr is not None
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await process.stdin.send(body)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await process.stdin.aclose()
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:  # until the command (and whatever kept its stderr) is done
                errors += await process.stderr.receive()
                del errors[:-2000]
        code = await process.wait()
    finally:
        if process.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(process.pid, signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await process.wait()
        with anyio.CancelScope(shield=True):
            await process.aclose()
    if code != 0:
        tail = errors.decode("utf-8", "replace").strip().splitlines()
        why = f"; stderr: {tail[-1][:300]}" if tail else ""
        raise DeliveryError(f"{os.path.basename(argv[0])} exited with status {code}{why}")


# --- what was delivered ------------------------------------------------------------------------


class DeliveryMarks:
    """For each run and notify entry, the index of the next history entry to deliver, on disk.

    An entry seen for the first time starts at the events that come after that moment (its
    `since`, kept in STATE_DIR/notify.json): adding a hook never replays every run ever made.
    """

    def __init__(self, state_dir: Path, runs_dir: Path, keys: list[str], now: float) -> None:
        self.path = state_dir / ENTRIES_FILE
        self.runs_dir = runs_dir
        self._next: dict[str, dict[str, int]] = {}  # run id -> entry key -> next history index
        self._locks: dict[str, anyio.Lock] = {}
        self._io = anyio.CapacityLimiter(2)
        self.since = self._load_since(keys, now)

    def _load_since(self, keys: list[str], now: float) -> dict[str, float]:
        since: dict[str, float] = {}
        try:
            raw = json.loads(self.path.read_bytes()[:MARKS_LIMIT])
            since = {str(k): float(v["since"]) for k, v in raw.get("entries", {}).items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
            log.error("notify_entries_unreadable", path=str(self.path), error=str(exc))
        missing = [k for k in keys if k not in since]
        if missing:
            since.update(dict.fromkeys(missing, now))
            data = json.dumps({"entries": {k: {"since": v} for k, v in sorted(since.items())}}, indent=1)
            try:
                atomic_write(str(self.path), data.encode() + b"\n", 0o600)
            except OSError as exc:  # kept in memory: only a restart before it is saved loses it
                log.error("notify_entries_save_failed", path=str(self.path), error=str(exc))
        return since

    def _file(self, run_id: str) -> Path:
        return self.runs_dir / run_id / MARKS_FILE

    def _load(self, record: RunRecord) -> dict[str, int]:
        if record.id not in self._next:
            marks: dict[str, int] = {}
            path = self._file(record.id)
            with contextlib.suppress(OSError):
                for leftover in path.parent.glob(f".{MARKS_FILE}.tmp.*"):
                    leftover.unlink()  # a save cut short
            try:
                raw = json.loads(path.read_bytes()[:MARKS_LIMIT])
                marks = {str(k): int(v) for k, v in raw["next"].items()}
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
                # Delivering again (the same event ids) is better than losing events.
                log.error("notify_marks_unreadable", run_id=record.id, path=str(path), error=str(exc))
            self._next[record.id] = marks
        return self._next[record.id]

    def known(self, run_id: str, key: str) -> int | None:
        """The next index, if it is in memory already (no disk read)."""
        return self._next.get(run_id, {}).get(key)

    def next_index(self, record: RunRecord, key: str) -> int:
        """The first history entry this entry has not delivered or passed over."""
        marks = self._load(record)
        if key not in marks:
            since = self.since.get(key, 0.0)
            marks[key] = next((i for i, h in enumerate(record.history) if h.time >= since), len(record.history))
        return marks[key]

    def advance(self, run_id: str, key: str, index: int) -> None:
        marks = self._next.setdefault(run_id, {})
        marks[key] = max(marks.get(key, 0), index)

    async def save(self, run_id: str) -> None:
        """Write the run's marks atomically (in a thread: a save fsyncs)."""
        lock = self._locks.setdefault(run_id, anyio.Lock())
        async with lock:
            data = json.dumps({"next": dict(sorted(self._next.get(run_id, {}).items()))}).encode() + b"\n"
            path = str(self._file(run_id))
            try:
                await anyio.to_thread.run_sync(atomic_write, path, data, 0o600, limiter=self._io)
            except OSError as exc:  # a full disk: after a restart, these events come again
                log.error("notify_marks_save_failed", run_id=run_id, error=str(exc))


# --- the service -------------------------------------------------------------------------------


class Notifications:
    """The daemon's listener for run changes, and the tasks that deliver each entry's events."""

    def __init__(self, daemon: NotifyHost, entries: list[NotifyEntry]) -> None:
        self.daemon = daemon
        self.entries = list(entries)
        self.marks = DeliveryMarks(daemon.state_dir, daemon.store.runs_dir, [e.key for e in entries], time.time())
        self._limiters = {e.key: anyio.CapacityLimiter(PARALLEL_PER_ENTRY) for e in entries}
        self._dirty: set[str] = set()
        self._again: set[tuple[str, str]] = set()  # (entry, run) changed while its delivery ran
        self._active: set[tuple[str, str]] = set()
        self._wake = anyio.Event()
        self._tg: TaskGroup | None = None
        # What each entry did since the daemon started, for /metrics.
        self.delivered: dict[str, int] = dict.fromkeys((e.label for e in entries), 0)
        self.failed: dict[str, int] = dict.fromkeys((e.label for e in entries), 0)

    def listener(self, record: RunRecord) -> None:
        """Called by `Daemon.touch` in the event loop: note the run and return at once."""
        self._dirty.add(record.id)
        self._again.update((e.key, record.id) for e in self.entries)
        self._wake.set()

    async def serve(self) -> None:
        """Deliver what was pending when the daemon stopped, then what every change brings."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            self._dirty.update(self.daemon.records)
            while True:
                runs, self._dirty = self._dirty, set()
                for run_id in sorted(runs):
                    for entry in self.entries:
                        try:
                            self._start(entry, run_id)
                        except Exception:  # a bug here must not end the daemon: the next change tries again
                            log.exception("notify_crashed", notify=entry.label, run_id=run_id)
                await self._wake.wait()
                self._wake = anyio.Event()

    def _start(self, entry: NotifyEntry, run_id: str) -> None:
        pair = (entry.key, run_id)
        if pair in self._active:
            return  # its task sees the change (`_again`)
        self._again.discard(pair)
        record = self.daemon.records.get(run_id)
        if record is None or not record.history or not applies(entry, record):
            return
        if record.history[-1].time < self.marks.since.get(entry.key, 0.0):
            return  # nothing new since this entry was added
        known = self.marks.known(run_id, entry.key)
        if known is not None and known >= len(record.history):
            return
        assert self._tg is not None
        self._active.add(pair)
        self._tg.start_soon(self._drain, entry, run_id)

    async def _drain(self, entry: NotifyEntry, run_id: str) -> None:
        """Deliver one run's pending events to one entry, in order, marking each once done."""
        pair = (entry.key, run_id)
        try:
            while True:
                self._again.discard(pair)
                pending = await self._next(entry, run_id)
                if pending is None:
                    if pair in self._again:
                        continue
                    return
                event, body = pending
                async with self._limiters[entry.key]:
                    await self._deliver(entry, event, body)
                with anyio.CancelScope(shield=True):  # a SIGTERM now must not undo the mark
                    self.marks.advance(run_id, entry.key, event.index + 1)
                    await self.marks.save(run_id)
        except Exception:  # a bug here must not end the daemon: the next change tries again
            log.exception("notify_crashed", notify=entry.label, run_id=run_id)
        finally:
            self._active.discard(pair)

    async def _next(self, entry: NotifyEntry, run_id: str) -> tuple[Event, dict[str, Any]] | None:
        """The next event of the run this entry wants, and its payload, read from the record as it
        is on disk (under the run's lock, once a failed save was retried)."""
        while True:
            record = self.daemon.records.get(run_id)
            if record is None:
                return None
            async with self.daemon.lock(run_id):
                # A record whose last save failed (a full disk) holds changes a restart would not
                # find: its events wait until it is saved, so a mark never runs ahead of the record.
                if run_id not in self.daemon.unsaved:
                    start = self.marks.next_index(record, entry.key)
                    for event in events(record, start):
                        if event.kind in entry.on:
                            return event, payload(record, event)
                    self.marks.advance(run_id, entry.key, len(record.history))
                    return None
            await anyio.sleep(1.0)

    async def _deliver(self, entry: NotifyEntry, event: Event, body: dict[str, Any]) -> None:
        """Deliver one event by every means the entry has (each with its own retries)."""
        data = json.dumps(body, sort_keys=True).encode()
        async with anyio.create_task_group() as tg:
            if entry.url:
                url = entry.url
                headers = {"X-Obd-Event": event.kind, "X-Obd-Event-Id": event.id}
                tg.start_soon(self._attempts, entry, event, "webhook", lambda: post_json(url, data, headers))
            if entry.command:
                argv = entry.command
                record = self.daemon.records[event.run_id]
                env = command_env(entry, event, record)
                tg.start_soon(self._attempts, entry, event, "command", lambda: run_command(argv, data, env))

    async def _attempts(
        self, entry: NotifyEntry, event: Event, channel: str, attempt: Callable[[], Awaitable[None]]
    ) -> None:
        """Try until delivered or out of retries; a failure is logged once, with the last reason."""
        said = log.bind(
            notify=entry.label, channel=channel, run_id=event.run_id, event_kind=event.kind, event_id=event.id
        )
        reason = ""
        tries = 0
        for tries in range(1, entry.retries + 2):
            if tries > 1:
                await anyio.sleep(min(entry.backoff * 2 ** (tries - 2), MAX_BACKOFF))
            try:
                with anyio.fail_after(entry.timeout):
                    await attempt()
            except TimeoutError:
                reason = f"no answer within {entry.timeout:g} s"
            except DeliveryError as exc:
                reason = str(exc)
                if exc.final:
                    break
            else:
                self.delivered[entry.label] += 1
                said.debug("notify_delivered", attempts=tries)
                return
            said.debug("notify_attempt_failed", attempt=tries, reason=reason)
        self.failed[entry.label] += 1
        said.warning("notify_failed", attempts=tries, reason=reason)
