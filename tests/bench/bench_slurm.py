"""Slurm target benchmark (issue 16): many runs through the real daemon on a real cluster.

    python tests/bench/bench_slurm.py [--runs 200] [--job-seconds 1] [--poll 1] [--json]

Brings up the test cluster (tests/executors/slurm/cluster.py: munge, slurmctld, two slurmd with
4 CPUs each, so 8 one-CPU jobs run at once and the rest wait in Slurm's queue), starts a daemon
with one Slurm target (`remote_poll_interval` = --poll), starts `--runs` runs of
`sleep --job-seconds` at once, and waits until every run is final. Every Slurm command and every
call of obd's helper goes through a wrapper that logs it with its parent, so it reports:

- Slurm commands per poll cycle: the commands run by the helper's `probe` calls, divided by the
  number of those calls (the goal: 1, one squeue for every run of the target), and the other
  Slurm commands per run (the submit's sbatch and its squeue by name, the end's scontrol);
- job exit -> recorded final state: from the mtime of the run's `exit_code` (written by the job
  wrapper on the node) to the time of the record's final transition (median, p99);
- submit -> running: from sbatch's answer (`slurm.json`) to the job wrapper's start on a node
  (`job.pid`'s mtime), mostly Slurm's queue here; and, for the runs obd saw queued, from that
  start to the record saying `running`.
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
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.conftest import FAST_CONFIG, DaemonProc, wait_for
from tests.executors.slurm.cluster import TEST_SETTINGS, missing_reason, running_cluster

SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol", "sacct", "sinfo", "srun")
FINAL = {"stopped", "succeeded", "failed", "cancelled"}


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def wrappers(root: Path, log: Path) -> tuple[Path, Path]:
    """A bin/ of logging Slurm commands, and a venv whose python logs the helper's calls."""
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    # Each line: the command, then its parent's command line (a probe, a submit, the daemon).
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        assert real, name
        path = bin_dir / name
        path.write_text(
            f'#!/bin/sh\nprintf "%s\\t%s\\n" {name} "$(tr "\\0" " " < /proc/$PPID/cmdline)" >> {log}\nexec {real} "$@"\n'
        )
        path.chmod(0o755)
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nprintf "python\\t%s\\n" "$*" >> {log}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    return bin_dir, venv


def config(workdir: Path, venv: Path, poll: float) -> str:
    return FAST_CONFIG.replace("remote_poll_interval = 0.5", f"remote_poll_interval = {poll}") + (
        f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{workdir}"\nvenv = "{venv}"\n'
    )


def count_commands(log: Path) -> dict[str, object]:
    lines = [line.split("\t", 1) for line in log.read_text().splitlines() if "\t" in line]
    probes = sum(1 for what, args in lines if what == "python" and args.endswith(" probe"))
    by_parent: Counter[str] = Counter()
    for what, parent in lines:
        if what == "python":
            continue
        role = next((r for r in ("probe", "submit", "cancel", "batch") if f"slurm_batch.py {r}" in parent), "daemon")
        by_parent[f"{what} from {role}"] += 1
    in_probes = sum(n for key, n in by_parent.items() if key.endswith("from probe"))
    return {"probe_calls": probes, "slurm_commands_in_probes": in_probes, "by_caller": dict(by_parent)}


def bench(runs: int, job_seconds: float, poll: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="obd-bench-slurm-", dir="/tmp"))
    log = root / "commands.log"
    bin_dir, venv = wrappers(root, log)
    try:
        with running_cluster(TEST_SETTINGS) as cluster:
            (root / "d").mkdir()
            d = DaemonProc(root / "d", config(root / "shared", venv, poll))
            d.env.update(cluster.env)
            d.env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
            d.start(log_level="warning")
            client = d.client()
            try:
                started = time.monotonic()
                command = ["sleep", str(job_seconds)]
                ids = [client.call("start", target="hpc", command=command)["id"] for _ in range(runs)]
                submit_s = time.monotonic() - started

                def all_final() -> bool:
                    listed = client.call("list", all=True)
                    return sum(r["state"] in FINAL for r in listed if r["id"] in ids) == runs

                wait_for(all_final, 60 + runs * (job_seconds + 2), 1.0, "every run to end")
                wall_s = time.monotonic() - started
                records = [client.call("status", id=i) for i in ids]
            finally:
                client.close()
                d.stop()
        return summarise(records, count_commands(log), runs, job_seconds, poll, submit_s, wall_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarise(
    records: list[dict], commands: dict, runs: int, job_seconds: float, poll: float, submit_s: float, wall_s: float
) -> dict[str, object]:
    exit_to_final: list[float] = []
    submit_to_start: list[float] = []
    start_to_running: list[float] = []
    states: Counter[str] = Counter()
    for record in records:
        states[record["state"]] += 1
        rd = Path(record["remote_dir"])
        final = next(h["time"] for h in reversed(record["history"]) if h["state"] in FINAL)
        exit_to_final.append(final - (rd / "exit_code").stat().st_mtime)
        submitted = json.loads((rd / "slurm.json").read_text())["submitted"]
        submit_to_start.append((rd / "job.pid").stat().st_mtime - submitted)
        # A run seen queued becomes `running` once a probe finds its job started.
        seen = [h["time"] for h in record["history"] if h["reason"] == "started by the target's scheduler"]
        if seen:
            start_to_running.append(seen[-1] - (rd / "job.pid").stat().st_mtime)

    def summary(values: list[float]) -> dict[str, float]:
        return {"median_s": round(statistics.median(values), 3), "p99_s": round(pct(values, 99), 3)}

    return {
        "runs": runs,
        "job_seconds": job_seconds,
        "remote_poll_interval_s": poll,
        "states": dict(states),
        "submit_all_s": round(submit_s, 1),
        "wall_s": round(wall_s, 1),
        "poll_cycles": commands["probe_calls"],
        "slurm_commands_per_poll_cycle": round(
            commands["slurm_commands_in_probes"] / max(1, commands["probe_calls"]), 3
        ),
        "slurm_commands_by_caller": commands["by_caller"],
        "exit_to_recorded_final": summary(exit_to_final),
        "submit_to_job_start": summary(submit_to_start),
        "job_start_to_recorded_running": summary(start_to_running) if start_to_running else None,
        "runs_seen_queued": len(start_to_running),
    }


@pytest.mark.bench
def test_bench_slurm_target() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    result = bench(20, 1.0, 1.0)
    print(json.dumps(result, indent=1))
    assert result["states"] == {"succeeded": 20}
    assert result["slurm_commands_per_poll_cycle"] == 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--job-seconds", type=float, default=1.0)
    parser.add_argument("--poll", type=float, default=1.0, help="the daemon's remote_poll_interval")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    result = bench(args.runs, args.job_seconds, args.poll)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(
        f"{result['runs']} runs of `sleep {result['job_seconds']:g}` on 2 nodes x 4 CPUs, poll {result['remote_poll_interval_s']:g} s"
    )
    print(
        f"  final states: {result['states']}; all submitted in {result['submit_all_s']} s, all ended in {result['wall_s']} s"
    )
    print(
        f"  Slurm commands per poll cycle: {result['slurm_commands_per_poll_cycle']} over {result['poll_cycles']} cycles"
    )
    print(f"  Slurm commands by caller: {result['slurm_commands_by_caller']}")
    for key in ("exit_to_recorded_final", "submit_to_job_start", "job_start_to_recorded_running"):
        s = result[key]
        if s:
            print(f"  {key.replace('_', ' ')}: median {s['median_s']} s, p99 {s['p99_s']} s")  # type: ignore[index]
    print(f"  runs seen queued before they started: {result['runs_seen_queued']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
