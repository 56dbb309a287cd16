"""Daemon benchmarks (issue 2 and the stop latency of issue 3); prints the figures.

    python tests/bench/bench_daemon.py [--jobs 200] [--runs 1000] [--stops 20]

- `obd train list --json` against a daemon holding 1,000 runs: median wall time of the whole
  client process, and the client's import time (and that it imports no torch/transformers).
- The daemon following 200 concurrent local jobs: its CPU time per job per minute, and the
  time from a job's exit to its recorded final state (median, p99).
- Stop latency: from `obd train stop` to the recorded `stopped`, less what the job itself
  spends (waiting for its step end, saving): the part obd adds, median and p99 over 20 stops.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.models import RunRecord, RunState  # noqa: E402
from daemon.store import RunStore  # noqa: E402
from tests.conftest import DaemonProc, kill_job_groups, kill_leftover_jobs, wait_for  # noqa: E402

CONFIG = '[daemon]\npoll_interval = "1s"\n[stop]\ncancel_grace = "2s"\n'


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_list(root: Path, runs: int) -> None:
    d = DaemonProc(root, CONFIG)
    store = RunStore(d.state_dir)
    for i in range(runs):
        r = RunRecord(id=f"20260101-000000-{i:06x}", command=["python", "train.py", f"--seed={i}"], name=f"run{i}")
        r.transition(RunState.preparing, "created")
        r.transition(RunState.running, "started")
        r.transition(RunState.succeeded, "exit 0")
        store.save(r)
    d.start()
    try:
        walls = []
        for _ in range(15):
            t = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "daemon.cli", "train", "list", "--json"], env=d.env, capture_output=True, cwd=REPO)
            walls.append(time.perf_counter() - t)
            assert out.returncode == 0 and len(json.loads(out.stdout)) == runs
        base = []
        for _ in range(15):
            t = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], env=d.env, cwd=REPO)
            base.append(time.perf_counter() - t)
        imp = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import daemon.cli, sys; print(','.join(m for m in ('torch','transformers','pydantic') if m in sys.modules))"],
            env=d.env, capture_output=True, text=True, cwd=REPO,
        )
        rows = [line[len("import time:"):].split("|") for line in imp.stderr.splitlines() if line.startswith("import time:")]
        total_us = sum(int(r[0]) for r in rows if r[0].strip().isdigit())  # the `self` column
        print(f"train list --json, {runs} runs: median {statistics.median(walls)*1000:.0f} ms per client process "
              f"(bare `python -c pass`: {statistics.median(base)*1000:.0f} ms; ratio {statistics.median(walls)/statistics.median(base):.2f})")
        print(f"client import time (daemon.cli and all it imports, -X importtime self times summed): {total_us/1000:.1f} ms; heavy modules imported: {imp.stdout.strip() or 'none'}")
    finally:
        d.stop()


def bench_follow(root: Path, jobs: int) -> None:
    d = DaemonProc(root, CONFIG)
    d.start()
    try:
        c = d.client()
        ids = [c.call("start", command=["sh", "-c", f"sleep {20 + (i % 20)}"])["id"] for i in range(jobs)]
        wait_for(lambda: all(d.record(r)["state"] == "running" for r in ids), 120, 0.5, "all jobs running")
        cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(15)  # steady state: every job running, the daemon only follows
        cpu1, t1 = cpu_seconds(d.proc.pid), time.monotonic()
        per_job_min = (cpu1 - cpu0) / jobs / ((t1 - t0) / 60)
        records = wait_for(lambda: [r for r in (d.record(x) for x in ids) if r["state"] in ("succeeded", "failed")] if all(d.record(x)["state"] == "succeeded" for x in ids) else None, 180, 1, "all jobs to end")
        lags = []
        for r in records:
            exited = (Path(r["remote_dir"]) / "exit_code").stat().st_mtime
            lags.append(r["history"][-1]["time"] - exited)
        print(f"following {jobs} local jobs: daemon CPU {per_job_min*1000:.1f} ms per job per minute "
              f"(poll_interval 1 s); exit → final state median {statistics.median(lags)*1000:.0f} ms, p99 {pct(lags, 99)*1000:.0f} ms")
        c.close()
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)


def bench_stop(root: Path, stops: int) -> None:
    d = DaemonProc(root, CONFIG)
    d.start()
    try:
        job = str(REPO / "tests" / "bench" / "custom_loop_job.py")
        ids = [d.call("start", command=[sys.executable, job, "0.1"])["id"] for _ in range(stops)]
        for rid in ids:
            wait_for(lambda: d.record(rid)["snapshots"], 60, 0.2, "the plugin's begin line")
        added, totals = [], []
        for rid in ids:
            t0 = time.time()
            out = subprocess.run([sys.executable, "-m", "daemon.cli", "train", "stop", rid, "--wait", "--json"], env=d.env, capture_output=True, text=True, cwd=REPO)
            assert out.returncode == 0, out.stderr
            r = json.loads(out.stdout)
            rd = Path(r["remote_dir"])
            requested = (rd / "snapshot.request").stat().st_mtime
            exited = (rd / "exit_code").stat().st_mtime
            recorded = next(h["time"] for h in r["history"] if h["state"] == "stopped")
            added.append((requested - t0) + (recorded - exited))  # obd's part: before the job sees it, after it ends
            totals.append(recorded - t0)
        print(f"stop latency over {stops} stops: obd's part median {statistics.median(added)*1000:.0f} ms, p99 {pct(added, 99)*1000:.0f} ms "
              f"(whole stop → stopped median {statistics.median(totals)*1000:.0f} ms, with a 100 ms step; poll_interval 1 s)")
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)


def bench_ssh_follow(root: Path, jobs: int) -> None:
    """The daemon following `jobs` runs on one SSH target (a real loopback sshd)."""
    from tests.sshd import SshServer

    with SshServer(root / "sshd") as server:
        f = server.target_fields()
        config = CONFIG.replace("[stop]", "remote_poll_interval = \"1s\"\n[stop]") + (
            f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
            f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
            f'workdir = "{root / "remote"}"\npython = "{sys.executable}"\n'
        )
        d = DaemonProc(root, config)
        d.start()
        try:
            c = d.client()
            ids = [c.call("start", target="box", command=["sh", "-c", f"sleep {25 + (i % 10)}"])["id"] for i in range(jobs)]
            wait_for(lambda: all(d.record(r)["state"] == "running" for r in ids), 300, 0.5, "all jobs running")
            time.sleep(2)
            before = server.log_tail(10**8).count("Starting session: command")
            t0 = time.monotonic()
            time.sleep(10)
            commands = server.log_tail(10**8).count("Starting session: command") - before
            polls = (time.monotonic() - t0) / 1.0
            records = wait_for(
                lambda: [d.record(x) for x in ids] if all(d.record(x)["state"] in ("succeeded", "failed") for x in ids) else None,
                300, 1, "all jobs to end",
            )
            lags = [r["history"][-1]["time"] - (Path(r["remote_dir"]) / "exit_code").stat().st_mtime for r in records]
            print(f"following {jobs} runs on one SSH target (remote_poll_interval 1 s): {commands} remote commands in {polls:.0f} s "
                  f"of steady state, i.e. one per poll cycle (each cycle: one probe of all {jobs} runs, then the interval); "
                  f"exit → final state median {statistics.median(lags)*1000:.0f} ms, p99 {pct(lags, 99)*1000:.0f} ms")
            c.close()
        finally:
            d.stop()
            kill_job_groups((root / "remote").glob("*/job.pid"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--stops", type=int, default=20)
    p.add_argument("--ssh-jobs", type=int, default=50)
    p.add_argument("--only", help="comma-separated: list,stop,follow,ssh")
    a = p.parse_args()
    import tempfile

    only = set(a.only.split(",")) if a.only else None
    for name, fn, n in (
        ("list", bench_list, a.runs),
        ("stop", bench_stop, a.stops),
        ("follow", bench_follow, a.jobs),
        ("ssh", bench_ssh_follow, a.ssh_jobs),
    ):
        if only and name not in only:
            continue
        root = Path(tempfile.mkdtemp(prefix=f"obdb-{name}-", dir="/tmp"))
        fn(root, n)


if __name__ == "__main__":
    main()
