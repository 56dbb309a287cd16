"""One run followed for a browser: its record, the end of its log and its metrics, each by offset.

A feed yields events (`record`, `curve`, `points`, `log`, `error`) for one server-sent-events
stream. It reads the run's files from where it left off: once a second while the run is active
(a log grows without the record changing), at once when the hub says the run changed, and
not at all once the run has ended and its last lines were read.
"""

from __future__ import annotations

import base64
import codecs
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from daemon.cli import plot
from daemon.cli.client import Client, RequestFailed
from daemon.cli.ui.hub import Hub
from daemon.common.wire import FINAL

LOG_TAIL_LINES = 300  # lines of the log a page opens with
ACTIVE_TICK = 1.0  # seconds between two reads of an active run's files
IDLE_TICK = 15.0  # a heartbeat on a run that ended
Event = tuple[str, Any]


class RunFeed:
    """The events of one run's page, from a connection of its own to the daemon."""

    def __init__(self, socket_path: Path, run_id: str, hub: Hub, metric: str = "loss") -> None:
        self.client = Client(socket_path, timeout=60)
        self.run_id = run_id
        self.hub = hub
        self.metric = metric
        self.log_offset = 0
        self.metrics_offset = 0
        self.state = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span two reads

    def close(self) -> None:
        self.client.close()

    def events(self) -> Iterator[Event | None]:
        """The page's events, forever; None when there is nothing new (time for a heartbeat)."""
        seq = self.hub.seq
        try:
            record = self.client.call("status", id=self.run_id)
        except RequestFailed as exc:
            yield "error", {"message": str(exc), "kind": exc.kind, "fatal": True}
            return
        self.run_id, self.state = record["id"], record["state"]
        yield "record", record
        yield from self._opening(record)
        finished = False
        while True:
            if not finished:
                yield from self._read_new()
                finished = self.state in FINAL
            seq_before = seq
            seq = self.hub.wait(seq, IDLE_TICK if finished else ACTIVE_TICK)
            if seq > seq_before and self.hub.changed_since(self.run_id, seq_before):
                try:
                    record = self.client.call("status", id=self.run_id)
                except RequestFailed as exc:
                    yield "error", {"message": str(exc), "kind": exc.kind}
                    continue
                if record["state"] != self.state:
                    finished = False  # one more read: the job may have written its last lines as it ended
                self.state = record["state"]
                yield "record", record
            elif finished:
                yield None

    def _opening(self, record: dict[str, Any]) -> Iterator[Event]:
        """The curve so far (the runs it resumed from included) and the end of its log."""
        try:
            chain, note = plot.load_chain(self.client, self.run_id)
            data: list[tuple[dict[str, Any], plot.RunMetrics]] = []
            for r in chain[:-1]:
                data.append((r, plot.parse_metrics(plot.read_file(self.client, r["id"])[0])))
            own, end = plot.read_file(self.client, self.run_id)
            complete = own[: own.rfind(b"\n") + 1]
            self.metrics_offset = end - (len(own) - len(complete))
            data.append((record, plot.parse_metrics(complete)))
            curve = plot.join_chain(data, self.metric)
            yield (
                "curve",
                {
                    "metric": self.metric,
                    "points": curve.points,
                    "snapshots": curve.snapshots,
                    "resumes": curve.resumes,
                    "runs": curve.runs,
                    "note": note,
                },
            )
            reply = self.client.call("read", id=self.run_id, file="log", tail_lines=LOG_TAIL_LINES)
            self.log_offset = int(reply.get("next", 0))
            yield "log", {"text": _text(reply), "reset": True}
        except RequestFailed as exc:
            yield "error", {"message": str(exc), "kind": exc.kind}

    def _read_new(self) -> Iterator[Event]:
        """What the log and metrics.jsonl gained since the last read."""
        try:
            while True:
                reply = self.client.call("read", id=self.run_id, file="log", offset=self.log_offset)
                data = base64.b64decode(reply.get("data", ""))
                self.log_offset = int(reply.get("next", self.log_offset + len(data)))
                if data:
                    yield "log", {"text": self._decoder.decode(data)}
                if len(data) < 65536:
                    break
            data, end = plot.read_file(self.client, self.run_id, offset=self.metrics_offset)
            complete = data[: data.rfind(b"\n") + 1]
            self.metrics_offset = end - (len(data) - len(complete))
            points = plot.parse_metrics(complete).points(self.metric)
            if points:
                yield "points", {"points": points, "time": time.time()}
        except RequestFailed as exc:
            yield "error", {"message": str(exc), "kind": exc.kind}


def _text(reply: dict[str, Any]) -> str:
    return base64.b64decode(reply.get("data", "")).decode("utf-8", "replace")
