"""Daemon benchmarks (issue 2 and the stop latency of issue 3); prints the figures.

    python tests/bench/bench_daemon.py [--jobs 200] [--runs 1000] [--stops 20]

- `obd train list --json` against a daemon holding 1,000 runs: median wall time of the whole
  client process, and the client's import time (and that it imports no torch/transformers).
- Daemon start with 1,000 records against none, to a socket that answers.
- The daemon following 100, 300 and 1,000 local jobs: its CPU over a 60 s window (share of a
  core, and ms per job per minute), and the time from a job's exit to its recorded final state
  (median, p99) while the others are followed.
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

from daemon.service.models import RunRecord, RunState
from daemon.service.store import RunStore
from tests.conftest import DaemonProc, kill_job_groups, kill_leftover_jobs, wait_for

CONFIG = '[daemon]\npoll_interval = "1s"\n[stop]\ncancel_grace = "2s"\n'


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(argv: list[str], env: dict[str, str], reps: int = 15) -> list[float]:
    walls = []
    for _ in range(reps):
        t = time.perf_counter()
        out = subprocess.run(argv, env=env, capture_output=True, cwd=REPO)
        walls.append(time.perf_counter() - t)
        assert out.returncode == 0, out.stderr
    return walls


def _start_time(root: Path, runs: int) -> float:
    """Seconds from starting a daemon holding `runs` finished records to its socket answering."""
    root.mkdir(parents=True, exist_ok=True)
    d = DaemonProc(root, CONFIG)
    store = RunStore(d.state_dir)
    for i in range(runs):
        r = RunRecord(id=f"20260101-000000-{i:06x}", command=["python", "train.py", f"--seed={i}"], name=f"run{i}")
        for state, why in (
            (RunState.preparing, "created"),
            (RunState.running, "started"),
            (RunState.succeeded, "exit 0"),
        ):
            r.transition(state, why)
        store.save(r)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        d.start(wait=False)
        while not d.ready():  # every 2 ms: the tests' 50 ms wait would round the figure to it
            if time.perf_counter() - t > 30:
                raise RuntimeError("the daemon did not answer within 30 s")
            time.sleep(0.002)
        times.append(time.perf_counter() - t)
        d.stop()
    return statistics.median(times)


def bench_list(root: Path, runs: int) -> None:
    empty = _start_time(root / "empty", 0)
    full = _start_time(root / "full", runs)
    print(
        f"daemon start to a socket that answers: {full * 1000:.0f} ms with {runs} records, {empty * 1000:.0f} ms with none "
        f"(+{(full - empty) * 1000:.0f} ms)"
    )
    d = DaemonProc(root / "full", CONFIG)
    d.start()
    try:
        cli = [sys.executable, "-m", "daemon.cli", "train", "list"]
        out = subprocess.run([*cli, "--all", "--json"], env=d.env, capture_output=True, cwd=REPO)
        assert len(json.loads(out.stdout)) == runs
        as_json = _timed([*cli, "--all", "--json"], d.env)
        as_text = _timed([*cli, "--all"], d.env)
        base = _timed([sys.executable, "-c", "pass"], d.env)
        imp = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-c",
                "import daemon.cli, sys; print(','.join(m for m in ('torch','transformers','pydantic','anyio','structlog') if m in sys.modules))",
            ],
            env=d.env,
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        rows = [
            line[len("import time:") :].split("|")
            for line in imp.stderr.splitlines()
            if line.startswith("import time:")
        ]
        total_us = sum(int(r[0]) for r in rows if r[0].strip().isdigit())  # the `self` column
        b = statistics.median(base)
        for what, walls in (("--json", as_json), ("(text)", as_text)):
            m = statistics.median(walls)
            print(
                f"train list --all {what}, {runs} runs: median {m * 1000:.0f} ms per client process "
                f"(bare `python -c pass`: {b * 1000:.0f} ms; ratio {m / b:.2f}; obd's own part {(m - b) * 1000:.0f} ms)"
            )
        print(
            f"client import time (daemon.cli and all it imports, -X importtime self times summed): {total_us / 1000:.1f} ms; heavy modules imported: {imp.stdout.strip() or 'none'}"
        )
    finally:
        d.stop()


def _job_children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def bench_follow(root: Path, jobs: int, window: float = 60.0) -> None:
    """The daemon following `jobs` local `sleep` jobs: its CPU over a quiet window, then the time
    from each job's exit (its exit_code file) to its recorded final state, as they end one by one."""
    d = DaemonProc(root, CONFIG)
    d.start()
    try:
        c = d.client()
        ids = [
            c.call("start", command=["sleep", "100000"], environ={"PATH": "/usr/bin:/bin"})["id"] for _ in range(jobs)
        ]
        wait_for(lambda: all(r["state"] == "running" for r in c.call("list", all=True)), 600, 1, "all jobs running")
        time.sleep(2)
        cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
        time.sleep(window)  # steady state: every job running, the daemon only follows
        cpu1, t1 = cpu_seconds(d.proc.pid), time.monotonic()
        share = (cpu1 - cpu0) / (t1 - t0)
        per_job_min = (cpu1 - cpu0) / jobs / ((t1 - t0) / 60)
        sample = ids if jobs <= 100 else ids[:: max(1, jobs // 100)]
        for rid in sample:  # end some jobs, one at a time, with the others still followed
            pid = c.call("status", id=rid)["job"]["pid"]
            for child in _job_children(pid):
                os.kill(child, 15)
            time.sleep(0.2)
        lags = []
        for rid in sample:

            def ended(rid: str = rid) -> dict | None:
                record = c.call("status", id=rid)
                return record if record["state"] == "failed" else None

            r = wait_for(ended, 60, 0.2, "the end")
            exited = (Path(r["remote_dir"]) / "exit_code").stat().st_mtime
            lags.append(r["history"][-1]["time"] - exited)
        print(
            f"following {jobs} local jobs: daemon CPU {share * 100:.2f} % of a core over {window:.0f} s "
            f"({per_job_min * 1000:.2f} ms per job per minute); exit → final state over {len(lags)} exits: "
            f"median {statistics.median(lags) * 1000:.0f} ms, p99 {pct(lags, 99) * 1000:.0f} ms"
        )
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
            wait_for(lambda rid=rid: d.record(rid)["snapshots"], 60, 0.2, "the plugin's begin line")
        added, totals = [], []
        for rid in ids:
            t0 = time.time()
            out = subprocess.run(
                [sys.executable, "-m", "daemon.cli", "train", "stop", rid, "--wait", "--json"],
                env=d.env,
                capture_output=True,
                text=True,
                cwd=REPO,
            )
            assert out.returncode == 0, out.stderr
            r = json.loads(out.stdout)
            rd = Path(r["remote_dir"])
            requested = (rd / "snapshot.request").stat().st_mtime
            exited = (rd / "exit_code").stat().st_mtime
            recorded = next(h["time"] for h in r["history"] if h["state"] == "stopped")
            added.append((requested - t0) + (recorded - exited))  # obd's part: before the job sees it, after it ends
            totals.append(recorded - t0)
        print(
            f"stop latency over {stops} stops: obd's part median {statistics.median(added) * 1000:.0f} ms, p99 {pct(added, 99) * 1000:.0f} ms "
            f"(whole stop → stopped median {statistics.median(totals) * 1000:.0f} ms, with a 100 ms step; poll_interval 1 s)"
        )
    finally:
        d.stop()
        kill_leftover_jobs(d.state_dir)


def bench_ssh_follow(root: Path, jobs: int) -> None:
    """The daemon following `jobs` runs on one SSH target (a real loopback sshd)."""
    from tests.sshd import SshServer

    with SshServer(root / "sshd") as server:
        f = server.target_fields()
        config = CONFIG.replace("[stop]", 'remote_poll_interval = "1s"\n[stop]') + (
            f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
            f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
            f'workdir = "{root / "remote"}"\npython = "{sys.executable}"\n'
        )
        d = DaemonProc(root, config)
        d.start()
        try:
            c = d.client()
            ids = [
                c.call("start", target="box", command=["sh", "-c", f"sleep {25 + (i % 10)}"])["id"] for i in range(jobs)
            ]
            wait_for(lambda: all(d.record(r)["state"] == "running" for r in ids), 300, 0.5, "all jobs running")
            time.sleep(2)
            before = server.log_tail(10**8).count("Starting session: command")
            t0 = time.monotonic()
            time.sleep(10)
            commands = server.log_tail(10**8).count("Starting session: command") - before
            polls = (time.monotonic() - t0) / 1.0
            records = wait_for(
                lambda: (
                    [d.record(x) for x in ids]
                    if all(d.record(x)["state"] in ("succeeded", "failed") for x in ids)
                    else None
                ),
                300,
                1,
                "all jobs to end",
            )
            lags = [r["history"][-1]["time"] - (Path(r["remote_dir"]) / "exit_code").stat().st_mtime for r in records]
            print(
                f"following {jobs} runs on one SSH target (remote_poll_interval 1 s): {commands} remote commands in {polls:.0f} s "
                f"of steady state, i.e. one per poll cycle (each cycle: one probe of all {jobs} runs, then the interval); "
                f"exit → final state median {statistics.median(lags) * 1000:.0f} ms, p99 {pct(lags, 99) * 1000:.0f} ms"
            )
            c.close()
        finally:
            d.stop()
            kill_job_groups((root / "remote").glob("*/job.pid"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--jobs", default="100,300,1000", help="comma-separated numbers of jobs to follow")
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--stops", type=int, default=20)
    p.add_argument("--ssh-jobs", type=int, default=50)
    p.add_argument("--only", help="comma-separated: list,stop,follow,ssh")
    a = p.parse_args()
    import tempfile

    only = set(a.only.split(",")) if a.only else None
    for name, fn, n in (
        ("list", bench_list, a.runs),
        ("stop", bench_stop, a.stops),
        ("ssh", bench_ssh_follow, a.ssh_jobs),
    ):
        if only and name not in only:
            continue
        root = Path(tempfile.mkdtemp(prefix=f"obdb-{name}-", dir="/tmp"))
        fn(root, n)
    if not only or "follow" in only:
        for jobs in (int(j) for j in str(a.jobs).split(",")):
            bench_follow(Path(tempfile.mkdtemp(prefix="obdb-follow-", dir="/tmp")), jobs, a.window)


if __name__ == "__main__":
    main()
