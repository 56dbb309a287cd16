"""Root's `obd train list` in this process: the event loop's time to answer it with Q runs queued and
H ended (the member's 5,000 queued runs of issue 33 are all in root's default list).

    python tests/bench/bench_list.py [--calls 20]

A daemon object of this tree in a throwaway state directory (no server, no jobs, nothing saved),
laid out as tests/bench/bench_queue_pass.py lays it out. Before each call another user's run with
no GPU starts and ends (as on a busy box: the list's answer kept from the last call no longer
holds). Prints the median and minimum of the calls (ms) and the answer's size. To compare two
versions, run it from each tree, in turns, on the same box:

    git archive OLD | tar -x -C /tmp/before && python /tmp/before/tests/bench/bench_list.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "bench"))

import anyio
from bench_queue_pass import cpu_run_ended, make_daemon

from daemon.service.api import ListRunsRequest, Peer
from daemon.service.handlers import Handlers

SIZES = [(10, 300), (5_000, 300), (5_000, 20_000)]


def calls(queued: int, ended: int, count: int) -> tuple[list[float], int]:
    state = Path(tempfile.mkdtemp(prefix="obd-bl-", dir="/tmp"))
    try:
        daemon = make_daemon(state, queued, ended)
        handlers = Handlers(daemon)
        root, request = Peer(uid=0, gid=0), ListRunsRequest(op="list")

        async def main() -> tuple[list[float], int]:
            await handlers.list_runs(request, root)  # every entry encoded once, as a first list does
            times, size = [], 0
            for n in range(count):
                cpu_run_ended(daemon, n)
                began = time.perf_counter()
                answer = await handlers.list_runs(request, root)
                times.append(time.perf_counter() - began)
                size = len(answer) if isinstance(answer, bytes) else len(str(answer))
            return times, size

        return anyio.run(main)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"root's list ({REPO})")
    for queued, ended in SIZES:
        times, size = calls(queued, ended, args.calls)
        print(
            f"  {queued:>5} queued, {ended:>6} ended: median {statistics.median(times) * 1000:6.1f} ms, "
            f"min {min(times) * 1000:6.1f} ms, {size / 1e6:.2f} MB"
        )


if __name__ == "__main__":
    main()
