"""One queue pass, in this process: the event loop's time for it with Q runs queued and H ended runs
in the box's history (issue 33: the daemon's work must not grow with its history).

    python tests/bench/bench_queue_pass.py [--passes 30]

A daemon object of this tree in a throwaway state directory (no server, no jobs, nothing saved):
one run holds the target's only GPU, Q runs wait for it (the members of sweeps of 1,000, or single
runs), H runs ended. Prints, for each (Q, H), the first pass and the median and minimum of the rest
(ms), for three kinds of pass: after nothing changed; after another user's run that held no GPU
ended (what most passes of a busy box follow: every start and end of a run kicks the queue); and
after one more run was queued (the queue changed: a pass looks at every queued run). To compare
two versions, run it from each tree, in turns, on the same box:

    git archive OLD | tar -x -C /tmp/before && python /tmp/before/tests/bench/bench_queue_pass.py
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import anyio

from daemon.service.config import Config
from daemon.service.daemon import Daemon
from daemon.service.models import RunRecord, RunState, SweepTag

SIZES = [(10, 300), (10, 20_000), (5_000, 300), (5_000, 20_000)]


def make_daemon(state: Path, queued: int, ended: int) -> Daemon:
    config = Config.model_validate(
        {
            "daemon": {"state_dir": str(state), "socket": str(state / "s")},
            "targets": {"local": {"kind": "local", "gpus": ["0"]}},
        }
    )
    daemon = Daemon(config)
    daemon.store.ensure()
    holder = RunRecord(
        id="20260101-000000-000000", command=["sleep"], state=RunState.running, gpus=["0"], gpus_wanted=1, job={}
    )
    daemon.records[holder.id] = holder
    for n in range(queued):
        sweep, index = divmod(n, 1000)
        tag = SweepTag(id=f"sweep-{sweep:08x}", name="load", index=index + 1, size=min(1000, queued), values={})
        record = RunRecord(
            id=f"20260101-000001-{n:06x}",
            command=["sleep", "600", str(n)],
            state=RunState.queued,
            gpus_wanted=1,
            created=1000.0 + n * 1e-3,
            sweep=tag if queued >= 1000 else None,
        )
        daemon.records[record.id] = record
    for n in range(ended):
        record = RunRecord(
            id=f"20251201-000000-{n:06x}", command=["true"], state=RunState.succeeded, gpus=["0"], created=float(n)
        )
        daemon.records[record.id] = record
    return daemon


def nothing(daemon: Daemon, n: int) -> None:
    pass


def cpu_run_ended(daemon: Daemon, n: int) -> None:
    """Another user's run with no GPU, started and ended (as `obd train start --gpus 0 true`)."""
    record = RunRecord(id=f"20260102-000000-{n:06x}", command=["true"], state=RunState.preparing, owner_uid=1002)
    daemon.records[record.id] = record
    record.transition(RunState.running, "launched")
    daemon.touch(record)
    record.transition(RunState.succeeded, "exited 0")
    daemon.touch(record)


def run_queued(daemon: Daemon, n: int) -> None:
    """One more run queued for the GPU."""
    record = RunRecord(
        id=f"20260103-000000-{n:06x}", command=["sleep"], state=RunState.queued, gpus_wanted=1, created=9e9 + n
    )
    daemon.records[record.id] = record
    daemon.touch(record)


KINDS = {"nothing changed": nothing, "a run with no GPU ended": cpu_run_ended, "a run queued": run_queued}


def passes(daemon: Daemon, count: int, between: Callable[[Daemon, int], None] = nothing) -> list[float]:
    async def main() -> list[float]:
        times = []
        for n in range(count):
            between(daemon, n)
            began = time.perf_counter()
            await daemon.scheduler.schedule()
            times.append(time.perf_counter() - began)
        return times

    return anyio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passes", type=int, default=30)
    args = parser.parse_args()
    print(f"one queue pass ({REPO})")
    for queued, ended in SIZES:
        for kind, between in KINDS.items():
            state = Path(tempfile.mkdtemp(prefix="obd-bqp-", dir="/tmp"))
            try:
                daemon = make_daemon(state, queued, ended)
                first = passes(daemon, 2)  # the first looks at everything; the second may be quiet
                times = passes(daemon, args.passes, between)
            finally:
                shutil.rmtree(state, ignore_errors=True)
            print(
                f"  {queued:>5} queued, {ended:>6} ended, {kind + ':':<24} first {first[0] * 1000:7.1f} ms, "
                f"median {statistics.median(times) * 1000:7.1f} ms, min {min(times) * 1000:7.1f} ms"
            )


if __name__ == "__main__":
    main()
