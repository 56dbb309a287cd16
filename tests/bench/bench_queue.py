"""The queue (issue 13): 500 queued runs on a 4-GPU config target, drained by short jobs.

    python tests/bench/bench_queue.py [--runs 500] [--job-seconds 0.3]

Prints, from the runs' own histories: the time from a GPU freeing (its holder's record final)
to the next run leaving the queue with it, and to that run's job running (median, p99); and the
daemon's CPU while the queue drains (share of one core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import itertools

from tests.bench.bench_daemon import cpu_seconds, pct
from tests.conftest import DaemonProc, kill_leftover_jobs, wait_for

CONFIG = '[targets.local]\nkind = "local"\ngpus = ["0", "1", "2", "3"]\n'  # the default 1 s poll


def first(history: list[dict], state: str) -> float:
    return next(h["time"] for h in history if h["state"] == state)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=500)
    p.add_argument("--job-seconds", type=float, default=0.3)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="obd-bq-", dir="/tmp"))
    d = DaemonProc(root, CONFIG)
    d.start()
    try:
        client = d.client()
        cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
        ids = [
            client.call("start", command=["sleep", str(args.job_seconds)], gpus="1", environ={"PATH": "/usr/bin:/bin"})[
                "id"
            ]
            for _ in range(args.runs)
        ]

        def drained() -> bool:
            return all(r["state"] in ("succeeded", "failed", "cancelled") for r in client.call("list", all=True))

        wait_for(drained, 3600, 0.5, "the queue to drain")
        cpu1, t1 = cpu_seconds(d.proc.pid), time.monotonic()
        records = [client.call("status", id=rid) for rid in ids]
        client.close()
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)
    failed = [r for r in records if r["state"] != "succeeded"]
    by_device: dict[str, list[dict]] = {}
    for r in records:
        by_device.setdefault(r["gpus"][0], []).append(r)
    to_leave, to_run = [], []
    for runs in by_device.values():
        runs.sort(key=lambda r: first(r["history"], "preparing"))
        for before, after in itertools.pairwise(runs):
            freed = first(before["history"], before["state"])
            to_leave.append(first(after["history"], "preparing") - freed)
            to_run.append(first(after["history"], "running") - freed)
    wall = t1 - t0
    print(f"runs: {args.runs} on 4 GPUs, jobs of {args.job_seconds:g} s; {len(failed)} did not succeed")
    print(
        f"GPU freed -> next run leaves the queue: median {statistics.median(to_leave) * 1000:.1f} ms, "
        f"p99 {pct(to_leave, 99) * 1000:.1f} ms"
    )
    print(
        f"GPU freed -> next run's job running: median {statistics.median(to_run) * 1000:.1f} ms, "
        f"p99 {pct(to_run, 99) * 1000:.1f} ms"
    )
    print(
        f"drain: {wall:.1f} s wall (ideal {args.runs * args.job_seconds / 4:.1f} s); daemon CPU "
        f"{(cpu1 - cpu0) / wall * 100:.1f} % of one core"
    )


if __name__ == "__main__":
    main()
