"""A start's save while a member's sweep is saved (issue 33): how long the express lane's save of a
new run (its launch settings beside its record) takes while the bulk lane writes a sweep of
1,000 new runs, and with nothing else written.

    python tests/bench/bench_store.py [--rounds 3] [--members 1000] [--compare DIR]

Each figure is one process of its own, with a store in a throwaway directory under /tmp (the
state directory's usual disk). `--compare DIR` times another tree's store (a checkout, e.g.
`git archive HEAD~1 | tar -x -C /tmp/before`) in the same rounds, the two taking turns, so
both see the same load; the ratio is this tree's median over the other's. Prints the median and
the 90th percentile of the starts' saves (ms) made during the sweep's trip, and alone, and how long
the sweep took to write while those starts were saved one after another.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ALONE = 20  # saves timed with nothing else written
SETTINGS = json.dumps({"command": ["python", "train.py"], "environ": {"PATH": "/usr/bin:/bin"}}).encode()


def _measure(members: int) -> dict[str, list[float]]:
    """In this process, the store of whichever tree is first on sys.path."""
    import logging

    import anyio
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # no trip's line
    from daemon.service.models import RunRecord, RunState
    from daemon.service.store import RunStore

    root = Path(tempfile.mkdtemp(prefix="obd-bs-", dir="/tmp"))
    ids = iter(range(1, 10**6))

    def record(state: RunState) -> RunRecord:
        return RunRecord(id=f"20261207-000000-{next(ids):06d}", state=state, command=["python", "train.py"])

    async def main() -> dict[str, list[float]]:
        store = RunStore(root)
        store.ensure()
        alone: list[float] = []
        for _ in range(ALONE):
            began = time.perf_counter()
            await store.save_async(record(RunState.preparing), beside={"launch.json": SETTINGS})
            alone.append(time.perf_counter() - began)
        during: list[float] = []
        swept = anyio.Event()
        sweep_s: list[float] = []

        async def sweep() -> None:  # as a sweep is made: its members' saves taken, then waited for
            began = time.perf_counter()
            saves = (
                store.save_later(record(RunState.queued), beside={"launch.json": SETTINGS}) for _ in range(members)
            )
            batches = {id(b): b for b in saves}
            for batch in batches.values():
                await store.written(batch)
            sweep_s.append(time.perf_counter() - began)
            swept.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(sweep)
            await anyio.sleep(0)  # the sweep's trip begins first
            while not swept.is_set():
                began = time.perf_counter()
                await store.save_async(record(RunState.preparing), beside={"launch.json": SETTINGS})
                during.append(time.perf_counter() - began)
        return {"alone": alone, "during": during, "sweep": sweep_s}

    try:
        return anyio.run(main)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(tree: Path, members: int) -> dict[str, list[float]]:
    code = (
        f"import sys, json; sys.path.insert(0, {str(tree)!r}); sys.path.insert(1, {str(REPO / 'tests' / 'bench')!r}); "
        f"import bench_store; print(json.dumps(bench_store._measure({members})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    return f"median {statistics.median(times) * 1000:6.1f} ms, p90 {p90 * 1000:6.1f} ms ({len(times)} saves)"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--compare", type=Path)
    args = parser.parse_args()
    trees = [REPO] + ([args.compare.resolve()] if args.compare else [])
    for n in range(1, args.rounds + 1):
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        medians = {}
        for tree in trees:
            got = _run(tree, args.members)
            medians[tree] = statistics.median(got["during"])
            print(f"round {n} (load {load}) {tree}:")
            print(f"  a start's save during a sweep of {args.members}: {_line(got['during'])}")
            print(f"  a start's save alone:                 {_line(got['alone'])}")
            print(f"  the sweep written, starts saved meanwhile: {got['sweep'][0]:.2f} s")
        if args.compare:
            print(f"  during the sweep, this tree / the other: {medians[REPO] / medians[trees[1]]:.2f}")


if __name__ == "__main__":
    main()
