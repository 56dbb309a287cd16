"""The web view's one `watch` long poll on the daemon, fanned out to every browser stream.

A thread keeps a `watch` open; each answer updates the summaries of the caller's runs and wakes
every stream waiting on the hub, so any number of open pages costs the daemon one long poll.
Pod runs also get their spend (a `status` call) when they change, and at most once a minute.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.common.wire import FINAL

WATCH_TIMEOUT = 25.0  # seconds the daemon holds a watch before it answers "nothing changed"
POD_REFRESH = 60.0  # seconds between two reads of a pod run's spend when nothing else changed


class Hub:
    """What the daemon says of the caller's runs, kept current by one watch; streams wait on it."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.seq = 0  # bumped at every change the streams should hear of
        self.runs: dict[str, dict[str, Any]] = {}
        self.changed: dict[str, int] = {}  # run id -> the seq it last changed at
        self.error: str | None = None  # why the daemon cannot be followed now
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._pod_targets: set[str] = set()
        self._pod_read: dict[str, float] = {}
        self._thread = threading.Thread(target=self._loop, name="obd-ui-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    # --- for the streams -----------------------------------------------------------------

    def wait(self, seq: int, timeout: float) -> int:
        """Wait until something changed after `seq` (or `timeout`); the seq now."""
        with self._cond:
            self._cond.wait_for(lambda: self.seq > seq or self._stop.is_set(), timeout)
            return self.seq

    def snapshot(self) -> tuple[int, list[dict[str, Any]], str | None]:
        with self._cond:
            runs = sorted(self.runs.values(), key=lambda r: (r.get("created") or 0, r["id"]))
            return self.seq, runs, self.error

    def changes_since(self, seq: int) -> tuple[int, list[dict[str, Any]], str | None]:
        """The runs changed after `seq`, with the seq they bring the caller to and the error, read at once."""
        with self._cond:
            runs = [self.runs[rid] for rid, at in self.changed.items() if at > seq and rid in self.runs]
            return self.seq, runs, self.error

    def changed_since(self, run_id: str, seq: int) -> bool:
        with self._cond:
            return self.changed.get(run_id, 0) > seq

    # --- the watch -----------------------------------------------------------------------

    def _publish(self, runs: list[dict[str, Any]], error: str | None, replace: bool = False) -> None:
        with self._cond:
            self.seq += 1
            if replace:
                self.runs = {}
            for run in runs:
                old = self.runs.get(run["id"], {})
                kept = {"pod": old["pod"]} if "pod" in old and "pod" not in run else {}
                self.runs[run["id"]] = {**run, **kept}
                self.changed[run["id"]] = self.seq
            self.error = error
            self._cond.notify_all()

    def _loop(self) -> None:
        client: Client | None = None
        since, backoff = 0, 0.5
        while not self._stop.is_set():
            try:
                if client is None:
                    client = Client(self.socket_path, timeout=WATCH_TIMEOUT + 30)
                    since = client.call("watch", since=0, timeout=0)["version"]
                    self._pod_targets = {t["name"] for t in client.call("targets") if t.get("pods")}
                    self._publish(self._with_pods(client, client.call("list")), None, replace=True)
                    backoff = 0.5
                reply = client.call("watch", since=since, timeout=WATCH_TIMEOUT)
                if reply["version"] < since:  # the daemon restarted: its versions began again
                    client.close()
                    client = None
                    continue
                since = reply["version"]
                runs = self._with_pods(client, reply["runs"]) + self._stale_pods(client, reply["runs"])
                if runs or self.error:
                    self._publish(runs, None)
            except (DaemonUnreachable, DaemonBusy, RequestFailed, OSError, KeyError, TypeError) as exc:
                if client is not None:
                    client.close()
                client = None
                message = str(exc).removeprefix("obd: ").split("\n")[0]
                if message != self.error:
                    self._publish([], message)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        if client is not None:
            client.close()

    def _with_pods(self, client: Client, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Runs on Runpod targets get `pod` (id, state, rate, spend) from a `status` call."""
        return [
            {**run, "pod": self._pod_of(client, run["id"])} if run.get("target") in self._pod_targets else run
            for run in runs
        ]

    def _stale_pods(self, client: Client, fresh: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Active pod runs whose spend was last read over a minute ago (spend grows with no change)."""
        done = {r["id"] for r in fresh}
        now = time.monotonic()
        with self._cond:
            due = [
                r
                for r in self.runs.values()
                if r.get("target") in self._pod_targets
                and r.get("state") not in FINAL
                and r["id"] not in done
                and now - self._pod_read.get(r["id"], 0) > POD_REFRESH
            ]
        return self._with_pods(client, due)

    def _pod_of(self, client: Client, run_id: str) -> dict[str, Any] | None:
        self._pod_read[run_id] = time.monotonic()
        try:
            record = client.call("status", id=run_id)
        except RequestFailed:
            return None
        return pod_summary(record)


def pod_summary(record: dict[str, Any]) -> dict[str, Any] | None:
    """A pod run's pod as the page shows it: id, state, GPU, rate and spend (from `status`)."""
    info, live = record.get("target_info") or {}, record.get("pod") or {}
    if not info.get("pod_id"):
        return None
    return {
        "pod_id": info["pod_id"],
        "state": live.get("state") or info.get("phase") or "unknown",
        "gpu_type": live.get("gpu_type") or info.get("gpu_type"),
        "cost_per_hr": live.get("cost_per_hr", info.get("cost_per_hr")),
        "spend_usd": live.get("spend_usd"),
        "error": live.get("error"),
    }
