"""Root's `obd train list` in this process: the event loop's time to answer it with Q runs queued and
H ended (the member's 5,000 queued runs of issue 33 are all in root's default list).

    python tests/bench/bench_list.py [--calls 20]

A daemon object of this tree in a throwaway state directory (no server, no jobs, nothing saved),
laid out as tests/bench/bench_queue_pass.py lays it out. Before each call another user's run with
no GPU starts and ends (as on a busy box: the list's answer kept from the last call no longer
holds), or, in the last rows, one more run is queued (as while a sweep is made: the queued runs'
piece no longer holds). Prints the median and minimum of the calls (ms) and the answer's size. Then the client's
side: the answer for 5,000 queued decoded by `daemon.cli.client.decode` (the collector paused)
and by a plain `json.loads`, in turns, in a process that holds HEAP objects as a long-lived SDK
caller does (a notebook, a script's own data): median and maximum of each. To compare two
versions, run it from each tree, in turns, on the same box:

    git archive OLD | tar -x -C /tmp/before && python /tmp/before/tests/bench/bench_list.py
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "bench"))

import anyio
from bench_queue_pass import cpu_run_ended, make_daemon, run_queued

from daemon.cli.client import decode
from daemon.service.api import ListRunsRequest, Peer
from daemon.service.handlers import Handlers

SIZES = [(10, 300), (5_000, 300), (5_000, 20_000)]


HEAP = 2_000_000  # objects the client's process holds besides the answer


def calls(
    queued: int, ended: int, count: int, answers: list[bytes] | None = None, between: Any = cpu_run_ended
) -> tuple[list[float], int]:
    state = Path(tempfile.mkdtemp(prefix="obd-bl-", dir="/tmp"))
    try:
        daemon = make_daemon(state, queued, ended)
        handlers = Handlers(daemon)
        root, request = Peer(uid=0, gid=0), ListRunsRequest(op="list")

        async def main() -> tuple[list[float], int]:
            await handlers.list_runs(request, root)  # every entry encoded once, as a first list does
            times, size = [], 0
            for n in range(count):
                between(daemon, n)
                began = time.perf_counter()
                answer = await handlers.list_runs(request, root)
                times.append(time.perf_counter() - began)
                size = len(answer) if isinstance(answer, bytes) else len(str(answer))
            if answers is not None:
                answers.append(bytes(answer) if isinstance(answer, bytes) else str(answer).encode())
            return times, size

        return anyio.run(main)
    finally:
        shutil.rmtree(state, ignore_errors=True)


def decodes(answer: bytes, count: int) -> dict[str, list[float]]:
    """The answer decoded `count` times each way, in turns, with HEAP objects held meanwhile."""
    held = [[n] for n in range(HEAP // 2)]  # lists: objects the collector tracks, as a caller's are
    times: dict[str, list[float]] = {"decode": [], "json.loads": []}
    for _ in range(count):
        for name, how in (("decode", decode), ("json.loads", json.loads)):
            began = time.perf_counter()
            result = how(answer)
            times[name].append(time.perf_counter() - began)
            del result
    del held
    gc.collect()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    print(f"root's list ({REPO})")
    answers: list[bytes] = []
    for queued, ended in SIZES:
        times, size = calls(queued, ended, args.calls, answers if queued == 5_000 and not answers else None)
        print(
            f"  {queued:>5} queued, {ended:>6} ended: median {statistics.median(times) * 1000:6.1f} ms, "
            f"min {min(times) * 1000:6.1f} ms, {size / 1e6:.2f} MB"
        )
    for queued, ended in SIZES[1:2]:
        times, size = calls(queued, ended, args.calls, between=run_queued)
        print(
            f"  {queued:>5} queued, {ended:>6} ended, one more queued before each: "
            f"median {statistics.median(times) * 1000:6.1f} ms, min {min(times) * 1000:6.1f} ms, {size / 1e6:.2f} MB"
        )
    print(f"the client's decode of the answer for 5,000 queued, {HEAP:,} objects held:")
    for name, times in decodes(answers[-1], args.calls).items():
        print(f"  {name:>10}: median {statistics.median(times) * 1000:6.1f} ms, max {max(times) * 1000:6.1f} ms")


if __name__ == "__main__":
    main()
