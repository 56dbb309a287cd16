"""SSH target benchmark (issue 17, item 4): polls without a shell, exits without waiting for a poll.

    python tests/bench/bench_ssh.py [--jobs 50] [--bashrc-sleep 1] [--polls 20] [--no-daemon] [--json]

A real sshd on loopback (tests/sshd.py) whose sessions read a ~/.bashrc of their own that sleeps
`--bashrc-sleep` seconds (a slow pyenv or conda init) and counts the shells started. Two ways of
following the same `--jobs` runs on that one target, measured in the same run:

- commands: every operation is one remote command, so every poll starts a channel and the
  user's shell (`SshExecutor(helper=False)`; under the daemon, a target `python` that cannot run
  the helper, which is the fallback);
- helper: the connection's `jobctl.py serve` answers probes on its one channel and pushes exits.

Reported for each:

- a probe cycle's wall time (one probe of every run, as the follow does per poll): median, p99;
- shells and sshd sessions started per poll (from the counting ~/.bashrc and sshd's log);
- under the real daemon at the default 3 s `remote_poll_interval`: the time from each job's exit
  (its exit_code file's mtime) to its recorded final state (the history's time), median and p99,
  and the shells started per poll while every run is followed.

The host is this machine, so network latency is ~0: what is left is the shell, the channel and
the poll interval.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from executors.base import JobHandle, JobSpec, JobState
from executors.config import SshTarget
from executors.ssh import SshExecutor
from tests.conftest import DaemonProc, kill_job_groups, wait_for
from tests.sshd import SshServer

MODES = ("commands", "helper")


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def python_that_cannot_serve(where: Path) -> Path:
    """A target `python` that runs everything but the helper: the target falls back to commands."""
    script = where / "python-no-helper"
    script.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = serve ] && { echo "no helper in this benchmark" >&2; exit 3; }; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return script


# --- the executor: a probe cycle, and what it starts on the host ---------------------------------


async def probe_cycles(server: SshServer, workdir: Path, mode: str, jobs: int, polls: int) -> dict[str, object]:
    target = SshTarget(kind="ssh", workdir=str(workdir), python=sys.executable, **server.target_fields())
    ex = SshExecutor("bench", target, helper=mode == "helper")
    gate = workdir / "gate"
    runs: list[tuple[JobHandle | None, str]] = [(None, str(workdir / f"run-{i}")) for i in range(jobs)]
    try:

        async def start(i: int) -> None:
            spec = JobSpec(
                run_id=f"run-{i}",
                remote_dir=runs[i][1],
                command=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.2; done"],
            )
            runs[i] = (await ex.spawn(spec), runs[i][1])

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            for i in range(jobs):
                tg.start_soon(start, i)
        spawn_s = time.monotonic() - t0
        await ex.probe(runs)  # warm: the connection (and its helper) are up
        shells, sessions = server.shells_started(), server.sessions_started()
        walls = []
        for _ in range(polls):
            started = time.monotonic()
            probes = await ex.probe(runs)
            walls.append(time.monotonic() - started)
            assert all(p.status.state == JobState.running for p in probes)
        return {
            "mode": mode,
            "jobs": jobs,
            "spawn_all_s": round(spawn_s, 2),
            "probe_cycle_ms_median": ms(statistics.median(walls)),
            "probe_cycle_ms_p99": ms(pct(walls, 99)),
            "shells_per_poll": round((server.shells_started() - shells) / polls, 2),
            "sessions_per_poll": round((server.sessions_started() - sessions) / polls, 2),
        }
    finally:
        gate.touch()
        await ex.aclose()
        kill_job_groups(workdir.glob("*/job.pid"))


# --- the daemon: exit -> record at the default poll ------------------------------------------------


def daemon_follow(server: SshServer, root: Path, mode: str, jobs: int, window: float) -> dict[str, object]:
    workdir = root / "remote"
    python = sys.executable if mode == "helper" else str(python_that_cannot_serve(root))
    f = server.target_fields()
    config = (
        '[stop]\ncancel_grace = "2s"\n'
        f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
        f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
        f'workdir = "{workdir}"\npython = "{python}"\n'
    )
    d = DaemonProc(root, config)
    d.start(log_level="info")
    gate = root / "gate"
    try:
        c = d.client()
        # Each job waits for the gate, then ends at its own time over ~9 s, so the exits fall
        # everywhere in the poll interval.
        ids = [
            c.call(
                "start",
                target="box",
                command=["sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; sleep {1 + 9 * i / jobs:.3f}"],
            )["id"]
            for i in range(jobs)
        ]
        wait_for(lambda: all(d.record(r)["state"] == "running" for r in ids), 600, 0.5, "every run running")
        time.sleep(4)
        shells, sessions, t0 = server.shells_started(), server.sessions_started(), time.monotonic()
        time.sleep(window)  # steady state: every run followed, nothing happening
        polls = (time.monotonic() - t0) / 3.0
        shells_per_poll = (server.shells_started() - shells) / polls
        sessions_per_poll = (server.sessions_started() - sessions) / polls
        gate.touch()
        records = wait_for(
            lambda: [d.record(x) for x in ids] if all(d.record(x)["state"] == "succeeded" for x in ids) else None,
            300,
            0.5,
            "every run to succeed",
        )
        lags = [r["history"][-1]["time"] - (Path(r["remote_dir"]) / "exit_code").stat().st_mtime for r in records]
        c.close()
        return {
            "mode": mode,
            "jobs": jobs,
            "poll_s": 3.0,
            "exit_to_record_ms_median": ms(statistics.median(lags)),
            "exit_to_record_ms_p99": ms(pct(lags, 99)),
            "exit_to_record_ms_max": ms(max(lags)),
            "shells_per_poll": round(shells_per_poll, 2),
            "sessions_per_poll": round(sessions_per_poll, 2),
        }
    finally:
        gate.touch()
        d.stop()
        kill_job_groups(workdir.glob("*/job.pid"))


def main(jobs: int, bashrc_sleep: float, polls: int, daemon: bool, window: float) -> list[dict[str, object]]:
    results: list[dict[str, object]] = []
    base = Path(tempfile.mkdtemp(prefix="obdb-ssh-", dir="/tmp"))
    try:
        with SshServer(base / "sshd", bashrc=f"sleep {bashrc_sleep:g}") as server:
            for mode in MODES:
                row = anyio.run(probe_cycles, server, base / f"probe-{mode}", mode, jobs, polls)
                results.append({"what": "probe cycle", "bashrc_sleep_s": bashrc_sleep, **row})
            if daemon:
                for mode in MODES:
                    (base / f"daemon-{mode}").mkdir()
                    row = daemon_follow(server, base / f"daemon-{mode}", mode, jobs, window)
                    results.append({"what": "daemon follow", "bashrc_sleep_s": bashrc_sleep, **row})
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--bashrc-sleep", type=float, default=1.0, help="seconds the target's ~/.bashrc sleeps")
    parser.add_argument("--polls", type=int, default=20, help="probe cycles timed per mode")
    parser.add_argument("--window", type=float, default=15.0, help="seconds of steady follow counted for shells")
    parser.add_argument("--no-daemon", action="store_true", help="only the executor's probe cycles")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only
    out = main(args.jobs, args.bashrc_sleep, args.polls, not args.no_daemon, args.window)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for row in out:
            print("  ".join(f"{k}={v}" for k, v in row.items()))
