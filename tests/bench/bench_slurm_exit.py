"""Slurm exit -> record benchmark (issue 34 item 27): how soon a job's end is in its run's record.

    python tests/bench/bench_slurm_exit.py [--runs 20] [--poll 3] [--json]

Brings up the test cluster (tests/executors/slurm/cluster.py: munge, slurmctld, two slurmd with
4 CPUs each), starts a daemon with its default settings and one Slurm target polled every
`--poll` seconds (3 s, the default `remote_poll_interval`), and starts `--runs` one-node runs at
once. Each job waits until every run's job is submitted (the daemon done launching), sleeps a
little (their ends spread over the poll's phase; 8 run at a time, the others wait in Slurm's
queue), then, as its very last instruction, writes the time into a file of its own and exits
(every fourth with exit 3). Reported: from that time to the time of the record's final
transition (`status`'s history), median, p99 and max, with the final states and exit codes.
"""

from __future__ import annotations

import argparse
import json
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

from tests.conftest import DaemonProc, wait_for
from tests.executors.slurm.cluster import TEST_SETTINGS, missing_reason, running_cluster

FINAL = {"stopped", "succeeded", "failed", "cancelled"}
# Each job waits for every submit to be through (the gate), sleeps a little, then, as its last
# instruction, writes the time (GNU date, nanoseconds) where the bench reads it.
JOB = 'while [ ! -e "{gate}" ]; do sleep 0.05; done; sleep {sleep}; date +%s.%N > "{marks}/$OBD_RUN_ID"; exit {code}'


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def config(workdir: Path, poll: float) -> str:
    """The daemon's defaults (a Slurm target is polled every `remote_poll_interval`, 3 s), but `poll`."""
    return f'[daemon]\nremote_poll_interval = {poll}\n\n[targets.hpc]\nkind = "slurm"\nworkdir = "{workdir}"\nvenv = "{sys.prefix}"\n'


def bench(runs: int, poll: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="obd-bench-slurm-exit-", dir="/tmp"))
    marks = root / "marks"
    marks.mkdir()
    try:
        with running_cluster(TEST_SETTINGS) as cluster:
            (root / "d").mkdir()
            d = DaemonProc(root / "d", config(root / "shared", poll))
            d.env.update(cluster.env)
            d.start(log_level="warning")
            client = d.client()
            try:
                expected: dict[str, int] = {}
                for i in range(runs):
                    code = 3 if i % 4 == 3 else 0
                    script = JOB.format(gate=root / "go", sleep=round(1 + (i % 7) * 0.37, 2), marks=marks, code=code)
                    rid = client.call("start", target="hpc", command=["sh", "-c", script])["id"]
                    expected[rid] = code

                def all_submitted() -> bool:
                    return all(client.call("status", id=i).get("job") for i in expected)

                # Measured once the daemon is no longer busy submitting: an end, not a launch, is timed.
                wait_for(all_submitted, 120 + runs * 5, 0.2, "every run's job to be submitted")
                (root / "go").touch()

                def all_final() -> bool:
                    listed = client.call("list", all=True)
                    return sum(r["state"] in FINAL for r in listed if r["id"] in expected) == runs

                wait_for(all_final, 120 + runs * 5, 0.5, "every run to end")
                records = [client.call("status", id=i) for i in expected]
            finally:
                client.close()
                d.stop()
        return summarise(records, expected, marks, poll)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def summarise(records: list[dict], expected: dict[str, int], marks: Path, poll: float) -> dict[str, object]:
    latencies: list[float] = []
    slowest: list[tuple[float, str, int]] = []
    states: Counter[str] = Counter()
    wrong: list[str] = []
    for record in records:
        states[record["state"]] += 1
        if record["exit_code"] != expected[record["id"]]:
            wrong.append(f"{record['id']}: exit_code {record['exit_code']}, expected {expected[record['id']]}")
        final = next(h["time"] for h in reversed(record["history"]) if h["state"] in FINAL)
        last = float((marks / record["id"]).read_text().strip())
        latencies.append(final - last)
        slowest.append((round(final - last, 3), record["id"], expected[record["id"]]))
    return {
        "runs": len(records),
        "remote_poll_interval_s": poll,
        "states": dict(states),
        "wrong_exit_codes": wrong,
        "last_instruction_to_final_record": {
            "median_s": round(statistics.median(latencies), 3),
            "p99_s": round(pct(latencies, 99), 3),
            "max_s": round(max(latencies), 3),
        },
        "slowest": sorted(slowest, reverse=True)[:3],  # (seconds, run, exit code)
    }


@pytest.mark.bench
def test_bench_slurm_exit_to_record() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    result = bench(20, 3.0)
    print(json.dumps(result, indent=1))
    assert result["states"] == {"succeeded": 15, "failed": 5}
    assert result["wrong_exit_codes"] == []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--poll", type=float, default=3.0, help="the daemon's remote_poll_interval")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    reason = missing_reason()
    if reason:
        print(f"skipped: {reason}")
        return 0
    started = time.monotonic()
    result = bench(args.runs, args.poll)
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    s = result["last_instruction_to_final_record"]
    print(
        f"{result['runs']} one-node runs on 2 nodes x 4 CPUs, poll {args.poll:g} s ({time.monotonic() - started:.0f} s)"
    )
    print(f"  final states: {result['states']}; wrong exit codes: {result['wrong_exit_codes'] or 'none'}")
    print(
        f"  job's last instruction -> recorded final state: median {s['median_s']} s, p99 {s['p99_s']} s, max {s['max_s']} s"
    )  # type: ignore[index]
    return 0


if __name__ == "__main__":
    sys.exit(main())
