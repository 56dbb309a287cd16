"""SSH executor benchmark (issue 4): many concurrent jobs on one SSH target, followed by probe.

    python tests/bench/bench_ssh.py [--jobs 50] [--intervals 0,1,3] [--json]

Starts a real sshd on loopback (tests/sshd.py), spawns `--jobs` short sleep jobs at once on that
one target (their ends staggered over ~5 s), then polls them the way the daemon's follow does:
one `probe` of every run per poll cycle. It reports, per poll interval:

- round trips per poll cycle (remote commands + SFTP requests; 1 is the goal),
- the wall time of one probe of all the runs (median, p99),
- the time from a job's exit (the mtime of its `exit_code` file) to the probe that first
  reports it exited (median, p99). This is the executor's share of "exit to recorded final
  state"; the daemon adds its own record write on top, and its poll interval
  (`remote_poll_interval`, 3 s by default) bounds the wait, as the 1 s and 3 s rows show.

The host is this machine, so network latency is ~0; each remote command still costs an SSH
channel and a login shell on the target (which, with a heavy ~/.bashrc, dominates).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.config import SshTarget  # noqa: E402
from executors.base import JobHandle, JobSpec, JobState  # noqa: E402
from executors.ssh import SshExecutor  # noqa: E402
from tests.sshd import SshServer  # noqa: E402


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


async def scenario(server: SshServer, workdir: Path, jobs: int, interval: float) -> dict[str, object]:
    """Spawn `jobs` jobs at once, probe until all have exited, and measure."""
    target = SshTarget(kind="ssh", workdir=str(workdir), python=sys.executable, **server.target_fields())
    ex = SshExecutor("bench", target)
    await ex.connect()
    runs: list[tuple[JobHandle | None, str]] = [(None, str(workdir / f"run-{i}")) for i in range(jobs)]
    (workdir / "go").unlink(missing_ok=True)

    async def start(i: int) -> None:
        # Every job waits for one start signal, so their ends are staggered from the same moment.
        script = f"while [ ! -e {workdir}/go ]; do sleep 0.05; done; sleep {1 + 5 * i / jobs:.3f}"
        spec = JobSpec(run_id=f"run-{i}", remote_dir=runs[i][1], command=["sh", "-c", script])
        runs[i] = (await ex.spawn(spec), runs[i][1])

    t0 = time.monotonic()
    rt0 = ex.round_trips
    async with anyio.create_task_group() as tg:
        for i in range(jobs):
            tg.start_soon(start, i)
    spawn_s = time.monotonic() - t0
    spawn_rt = ex.round_trips - rt0
    (workdir / "go").touch()

    detected: dict[str, float] = {}
    probe_s: list[float] = []
    trips: list[int] = []
    while len(detected) < jobs:
        rt = ex.round_trips
        started = time.monotonic()
        probes = await ex.probe(runs)
        probe_s.append(time.monotonic() - started)
        trips.append(ex.round_trips - rt)
        now = time.time()
        for p in probes:
            if p.status.state != JobState.running and p.remote_dir not in detected:
                detected[p.remote_dir] = now
        if interval:
            await anyio.sleep(interval)
    latency = []
    for run_dir, seen in detected.items():
        exited = os.stat(Path(run_dir) / "exit_code").st_mtime
        latency.append(seen - exited)
    await ex.aclose()
    return {
        "jobs": jobs,
        "poll_interval_s": interval,
        "spawn_all_s": round(spawn_s, 2),
        "spawn_round_trips_per_job": round(spawn_rt / jobs, 1),
        "connections": ex.connects,
        "poll_cycles": len(trips),
        "round_trips_per_poll": sorted(set(trips)),
        "probe_s_median": round(statistics.median(probe_s), 3),
        "probe_s_p99": round(pct(probe_s, 99), 3),
        "exit_to_detect_s_median": round(statistics.median(latency), 3),
        "exit_to_detect_s_p99": round(pct(latency, 99), 3),
    }


async def main(jobs: int, intervals: list[float]) -> list[dict[str, object]]:
    results = []
    base = Path(tempfile.mkdtemp(prefix="obd-bench-ssh-"))
    try:
        with SshServer() as server:
            for n, interval in enumerate(intervals):
                results.append(await scenario(server, base / f"wd{n}", jobs, interval))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--intervals", default="0,1,3", help="poll intervals in seconds, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    out = anyio.run(main, args.jobs, [float(x) for x in args.intervals.split(",")])
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for row in out:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
