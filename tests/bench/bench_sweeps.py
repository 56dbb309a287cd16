"""A member's sweeps alone on the box: how long the daemon takes to make and cancel them, and its CPU time, its own and the kernel's (issue 33, item 1); prints the figures.

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/bench/bench_sweeps.py

A daemon with one GPU by config; one client makes OBD_BENCH_SWEEPS sweeps (4 by default) of
OBD_BENCH_MEMBERS runs (`sleep 600 --gpus 1`: all but one wait queued), cancels the last, then
starts 20 CPU-only runs (`true --gpus 0`) one after another. For each phase: the wall time the
client waited and the daemon's user and system CPU time (from /proc, all its threads), so that a
change in what the daemon does (user) is told apart from what it asks of the filesystem (system:
on an ext4 that has seen many files come and go, finding a free inode for each new file). Nothing
else runs: bench_fairness.py measures the others' answers under the same load. To compare two
versions, run it from each tree in turns (see bench_fairness.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG

pytestmark = [pytest.mark.bench]

SWEEPS = int(os.environ.get("OBD_BENCH_SWEEPS", "4"))
MEMBERS = int(os.environ.get("OBD_BENCH_MEMBERS", "1000"))
STARTS = 20


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's user and system CPU time so far, every thread of it."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def test_a_member_makes_and_cancels_sweeps_alone(make_daemon, short_tmp: Path) -> None:
    d = make_daemon(FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n')
    d.start(log_level="info")
    assert d.proc is not None
    client = d.client()
    client.timeout = 600
    env = {"PATH": "/usr/bin:/bin"}
    grid = [{"name": "a", "values": [str(i) for i in range(MEMBERS)]}]
    phases: list[tuple[str, float, tuple[float, float]]] = []

    pid = d.proc.pid

    def timed(name: str, call: Callable[[], Any]) -> Any:
        before, t = cpu_seconds(pid), time.perf_counter()
        out = call()
        after = cpu_seconds(pid)
        phases.append((name, time.perf_counter() - t, (after[0] - before[0], after[1] - before[1])))
        return out

    made: dict[str, Any] = {}
    for n in range(SWEEPS):
        made = timed(
            f"sweep {n + 1} of {MEMBERS} made",
            lambda n=n: client.call(
                "sweep",
                command=["sleep", "600", "{a}"],
                gpus="1",
                environ=env,
                client_cwd=str(short_tmp),
                name=f"load{n}",
                grid=grid,
            ),
        )
    timed(f"its last sweep cancelled ({SWEEPS * MEMBERS} queued)", lambda: client.call("cancel", id=made["sweep"]))

    def starts() -> None:
        for _ in range(STARTS):
            client.call("start", command=["true"], gpus="0", environ=env, client_cwd=str(short_tmp))

    timed(f"{STARTS} starts of a CPU-only run, one after another", starts)
    rows = client.call("list", sweep=made["sweep"])
    print(f"\n== a member's sweeps alone ({Path(__file__).resolve().parents[2]})")
    for name, wall, (user, system) in phases:
        print(f"{name}: {wall:.2f} s; the daemon's CPU: user {user:.2f} s, system {system:.2f} s")
    assert len(rows) == MEMBERS and {r["state"] for r in rows} == {"cancelled"}
