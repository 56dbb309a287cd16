"""The Slurm tests' cluster: munge, slurmctld and two slurmd (n1, n2) for the whole session.

`tests/daemon/test_slurm_target.py` imports `slurm_cluster` from here, so the executor's and the
daemon's tests share one cluster. Where Slurm is not installed, or the tests do not run as root,
every test that asks for the cluster is skipped and says why.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.executors.slurm.cluster import SHARED, Cluster, missing_reason


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[Cluster]:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    cluster = SHARED.acquire()
    try:
        yield cluster
    finally:
        SHARED.release()


def run_processes(run_id: str) -> list[int]:
    """Pids of processes whose environment names this run (OBD_RUN_ID): the job's, on every node."""
    needle = f"OBD_RUN_ID={run_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids
