"""Prometheus metrics of the daemon: `GET /metrics` on `[daemon] metrics_listen`, opt-in.

Every number is read from the run records and the follow at the moment of the scrape (nothing is
counted on the side, so a restarted daemon reports what its records say): runs by state and
target, the queue, how long since each target was last read, how stops that fell back ended,
how long snapshots took (request to proof), the pods alive and their spend, the notifications
delivered and failed, and the daemon's own CPU, memory and open files. The text is exposition
format 0.0.4, written by hand: a hundred lines instead of a dependency.
"""

from __future__ import annotations

import math
import os
import resource
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog
from anyio.abc import SocketStream

from daemon.service.config import parse_listen
from daemon.service.follow import Follower
from daemon.service.models import FINAL_STATES, RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from executors.base import PodCost
from executors.factory import makes_pods, pod_cost

if TYPE_CHECKING:
    from daemon.service.notify import Notifications

log = structlog.get_logger("obd.metrics")


class MetricsHost(Runs, Protocol):
    """What the exporter reads of the daemon beyond the records: the unreadable records, the
    follow's last reads and the targets."""

    bad_records: dict[str, str]

    @property
    def follow(self) -> Follower: ...

    @property
    def targets(self) -> Targets: ...


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Request to proof: a step boundary comes within seconds for most jobs, minutes for big ones.
LATENCY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
REQUEST_LIMIT = 16384
REQUEST_TIMEOUT = 10.0


# --- the exposition format ---------------------------------------------------------------------


@dataclass
class Family:
    """One metric: its name, type, help and samples (suffix, labels, value)."""

    name: str
    kind: str  # gauge, counter, histogram
    help: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, suffix: str = "", **labels: str) -> None:
        self.samples.append((suffix, labels, value))


def _escape_label(value: str) -> str:
    return _escape_help(value).replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def exposition(families: Iterable[Family]) -> str:
    """The text format 0.0.4 of these metrics."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        lines.append(f"# TYPE {fam.name} {fam.kind}")
        for suffix, labels, value in fam.samples:
            text = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
            lines.append(
                f"{fam.name}{suffix}{{{text}}} {_number(value)}" if text else f"{fam.name}{suffix} {_number(value)}"
            )
    return "\n".join(lines) + "\n"


def histogram(fam: Family, values: list[float], buckets: tuple[float, ...], **labels: str) -> None:
    """Cumulative buckets, +Inf, sum and count of `values` into a histogram family."""
    for bound in buckets:
        fam.add(sum(v <= bound for v in values), "_bucket", **labels, le=repr(float(bound)))
    fam.add(len(values), "_bucket", **labels, le="+Inf")
    fam.add(sum(values), "_sum", **labels)
    fam.add(len(values), "_count", **labels)


# --- the daemon's own process ------------------------------------------------------------------


def _boot_time() -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except OSError:
        pass
    return None


def process_families() -> list[Family]:
    """CPU, memory, open files and start time of this process, under Prometheus' standard names."""
    times = os.times()
    cpu = Family("process_cpu_seconds_total", "counter", "User and system CPU time the daemon spent, in seconds.")
    cpu.add(times.user + times.system)
    out = [cpu]
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/self/statm") as f:
            virtual, resident = (int(x) for x in f.read().split()[:2])
        rss = Family("process_resident_memory_bytes", "gauge", "Resident memory of the daemon, in bytes.")
        rss.add(resident * page)
        vms = Family("process_virtual_memory_bytes", "gauge", "Virtual memory of the daemon, in bytes.")
        vms.add(virtual * page)
        out += [rss, vms]
    except (OSError, ValueError):
        pass
    try:
        fds = Family("process_open_fds", "gauge", "File descriptors the daemon has open.")
        fds.add(len(os.listdir("/proc/self/fd")))
        out.append(fds)
    except OSError:
        pass
    limit = Family("process_max_fds", "gauge", "The daemon's limit on open file descriptors.")
    limit.add(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    out.append(limit)
    boot = _boot_time()
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time since boot
        if boot is not None:
            start = Family("process_start_time_seconds", "gauge", "When the daemon started, in unix seconds.")
            start.add(boot + ticks / os.sysconf("SC_CLK_TCK"))
            out.append(start)
    except (OSError, ValueError, IndexError):
        pass
    return out


# --- the runs ----------------------------------------------------------------------------------


def alive_pod(record: RunRecord, now: float) -> PodCost | None:
    """The run's pod and its cost at `now`, while obd keeps it for the run (made, not ended); None otherwise."""
    cost = pod_cost(record.target_info, now)
    return cost if cost is not None and cost.alive else None


def snapshot_latency(record: RunRecord) -> float | None:
    """Seconds from the snapshot request to its valid proof, when both were seen."""
    stop = record.stop
    if stop.requested_at is None or stop.proof_at is None or record.snapshot is None:
        return None
    return max(0.0, stop.proof_at - stop.requested_at)


class MetricsExporter:
    """Renders the metrics from the daemon's state, and serves them over HTTP."""

    def __init__(self, daemon: MetricsHost, notifications: Notifications | None = None) -> None:
        self.daemon = daemon
        self.notifications = notifications
        self.started = time.time()

    def families(self, now: float | None = None) -> list[Family]:
        now = time.time() if now is None else now
        records = list(self.daemon.records.values())
        return [
            *self._runs(records),
            self._follow_lag(records, now),
            *self._stops(records),
            *self._pods(records, now),
            *self._notify(),
            *process_families(),
        ]

    def render(self, now: float | None = None) -> str:
        return exposition(self.families(now))

    def _runs(self, records: list[RunRecord]) -> list[Family]:
        runs = Family("obd_runs", "gauge", "Runs in the daemon's records, by state and target.")
        counts = Counter((r.state.value, r.target) for r in records)
        targets = sorted({"local", *self.daemon.config.targets, *(r.target for r in records)})
        for target in targets:
            for state in RunState:
                runs.add(counts[(state.value, target)], state=state.value, target=target)
        queue = Family("obd_queue_length", "gauge", "Runs queued: waiting for GPUs or for a scheduler.")
        queue.add(sum(r.state == RunState.queued for r in records))
        bad = Family("obd_records_unreadable", "gauge", "Run records that could not be read (see the daemon's log).")
        bad.add(len(self.daemon.bad_records))
        preempted = Family(
            "obd_preemptions_total",
            "counter",
            "Runs obd paused through a snapshot, for a run of higher priority or a drain.",
        )
        paused = Family("obd_runs_paused", "gauge", "Runs paused by obd, waiting in the queue to resume on their own.")
        pauses = Counter(r.target for r in records if r.preemption.preempt is not None)
        waiting = Counter(r.target for r in records if r.preemption.paused is not None and r.in_queue)
        for target in targets:
            preempted.add(pauses[target], target=target)
            paused.add(waiting[target], target=target)
        return [runs, queue, bad, preempted, paused]

    def _follow_lag(self, records: list[RunRecord], now: float) -> Family:
        """Per target (one follow loop each) with a job to follow: seconds since it was last read."""
        lag = Family(
            "obd_follow_lag_seconds",
            "gauge",
            "Seconds since the follow last read each target that has runs to follow (since the daemon started, if never).",
        )
        keys = sorted({self.daemon.targets.key(r) for r in records if r.has_job})
        last_read = self.daemon.follow.last_read
        for key in keys:
            lag.add(max(0.0, now - last_read.get(key, self.started)), target=key)
        return lag

    def _stops(self, records: list[RunRecord]) -> list[Family]:
        fallbacks = Family(
            "obd_stop_fallbacks_total",
            "counter",
            "Runs whose stop fell back to a cancel, by how they ended (cancelled: no snapshot in time; stopped: "
            "a snapshot, but the job did not end).",
        )
        ended = Counter(r.state.value for r in records if r.stop.cancel_by == "fallback" and r.state.final)
        for state in sorted(s.value for s in FINAL_STATES):
            fallbacks.add(ended[state], outcome=state)
        pending = Family(
            "obd_stop_fallbacks_pending", "gauge", "Runs whose stop fell back to a cancel still under way."
        )
        pending.add(sum(r.stop.cancel_by == "fallback" and not r.state.final for r in records))
        latency = Family(
            "obd_snapshot_latency_seconds", "histogram", "Seconds from a snapshot request to its valid proof, per run."
        )
        values = [v for v in (snapshot_latency(r) for r in records) if v is not None]
        histogram(latency, values, LATENCY_BUCKETS)
        return [fallbacks, pending, latency]

    def _pods(self, records: list[RunRecord], now: float) -> list[Family]:
        alive = Family("obd_pods_alive", "gauge", "Pods obd made for runs and has not ended, by target.")
        spend = Family("obd_pod_spend_dollars", "gauge", "What each live pod has cost so far, in US dollars.")
        rate = Family("obd_pod_cost_per_hour_dollars", "gauge", "Each live pod's hourly rate, in US dollars.")
        by_target: Counter[str] = Counter()
        for record in records:
            info = alive_pod(record, now)
            if info is None:
                continue
            by_target[record.target] += 1
            labels = {"target": record.target, "run_id": record.id, "pod_id": str(info.pod_id)}
            spent = info.spend_usd
            if spent is not None:
                spend.add(spent, **labels)
            if info.cost_per_hr is not None:
                rate.add(info.cost_per_hr, **labels)
        pod_targets = sorted({t for t, c in self.daemon.config.targets.items() if makes_pods(c)} | set(by_target))
        for target in pod_targets:
            alive.add(by_target[target], target=target)
        return [alive, spend, rate]

    def _notify(self) -> list[Family]:
        fam = Family(
            "obd_notify_deliveries_total",
            "counter",
            "Notification deliveries since the daemon started, by [[notify]] entry and outcome.",
        )
        if self.notifications is None:  # no [[notify]] entries: the metric, with no samples
            return [fam]
        for label in sorted(self.notifications.delivered):
            fam.add(self.notifications.delivered[label], notify=label, outcome="delivered")
            fam.add(self.notifications.failed[label], notify=label, outcome="failed")
        return [fam]

    # --- HTTP ------------------------------------------------------------------------------

    async def serve(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve `/metrics` on `metrics_listen` for the daemon's lifetime. An address that cannot be
        bound is logged, and the daemon goes on without metrics (its runs matter more)."""
        address = self.daemon.config.daemon.metrics_listen
        assert address is not None
        host, port = parse_listen(address)
        try:
            listener = await anyio.create_tcp_listener(local_host=host, local_port=port)
        except OSError as exc:
            log.error(
                "metrics_listen_failed",
                address=address,
                error=exc.strerror or str(exc),
                hint="set [daemon] metrics_listen to a free HOST:PORT and restart the daemon",
            )
            task_status.started()
            return
        log.info("metrics_listening", address=address)
        task_status.started()
        async with listener:
            await listener.serve(self._answer)

    async def _answer(self, stream: SocketStream) -> None:
        async with stream:
            try:
                with anyio.fail_after(REQUEST_TIMEOUT):
                    head = b""
                    while b"\r\n\r\n" not in head and b"\n\n" not in head:
                        if len(head) > REQUEST_LIMIT:
                            await stream.send(_response(431, "Request Header Fields Too Large", b"too large\n"))
                            return
                        head += await stream.receive()
                    await stream.send(self._respond(head))
            except (TimeoutError, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return

    def _respond(self, head: bytes) -> bytes:
        try:
            return self._page(head)
        except Exception:  # a bug in a metric must not take the daemon down with the scrape
            log.exception("metrics_render_failed")
            return _response(500, "Internal Server Error", b"the metrics could not be rendered: see the daemon's log\n")

    def _page(self, head: bytes) -> bytes:
        fields = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].decode("latin-1").split()
        if len(fields) != 3 or not fields[2].startswith("HTTP/"):
            return _response(400, "Bad Request", b"not an HTTP request\n")
        method, path = fields[0], fields[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return _response(405, "Method Not Allowed", b"use GET /metrics\n", {"Allow": "GET, HEAD"})
        if path == "/metrics":
            body = self.render().encode()
            return _response(200, "OK", b"" if method == "HEAD" else body, {"Content-Type": CONTENT_TYPE}, len(body))
        if path == "/":
            return _response(200, "OK", b"obd daemon: metrics at /metrics\n")
        return _response(404, "Not Found", b"no such page: metrics are at /metrics\n")


def _response(
    code: int, phrase: str, body: bytes, headers: dict[str, str] | None = None, length: int | None = None
) -> bytes:
    lines = [
        f"HTTP/1.1 {code} {phrase}",
        f"Content-Length: {len(body) if length is None else length}",
        "Connection: close",
    ]
    headers = {"Content-Type": "text/plain; charset=utf-8", **(headers or {})}
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
