"""A Slurm job's end, recorded from its batch wrapper's end marker (issue 34 item 27).

The wrapper writes `slurm_end.json` and `exit_code` into the run directory on the shared
filesystem the moment the command ends; the daemon records the run from them without asking
Slurm, unless the marker shows Slurm's hand (its TERM, an OOM kill, a command killed by a
signal): then Slurm's end state decides (docs/slurm.md, "How a run's end is recorded"). The
cluster tests use test_slurm_target.py's daemon and cluster.
"""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import pytest

from executors.slurm.events import SlurmEvents
from tests.conftest import DaemonProc, wait_for
from tests.daemon.test_slurm_target import hpc, jobs_named, start  # noqa: F401 - the shared fixture
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture
from trainer_plugin.tools import slurm_batch

SLURM_QUERIES = ("squeue", "scontrol", "sacct")


def hanging_queries(directory: Path, gate: Path) -> Path:
    """`squeue`, `scontrol` and `sacct` first on PATH, each hanging while `gate` exists (a
    controller that stopped answering), then running the real one."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in SLURM_QUERIES:
        shim = directory / name
        shim.write_text(f'#!/bin/sh\nwhile [ -e "{gate}" ]; do sleep 0.05; done\nexec /usr/bin/{name} "$@"\n')
        shim.chmod(0o755)
    return directory


def status_lines(d: DaemonProc, run_id: str) -> dict[str, str]:
    """`obd train status RUN` as a user reads it: its `state`, `exit` and `message` lines."""
    out = d.cli("train", "status", run_id)
    assert out.returncode == 0, out.stderr
    fields = {}
    for line in out.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ("state", "exit", "message") and key not in fields:
            fields[key] = value.strip()
    return fields


def test_a_job_s_end_is_in_its_record_from_its_end_marker_while_squeue_scontrol_and_sacct_hang(
    hpc: DaemonProc,  # noqa: F811
    short_tmp: Path,
) -> None:
    gate = short_tmp / "slurm-hangs"
    go = short_tmp / "go"
    shims = hanging_queries(short_tmp / "shims", gate)
    hpc.stop()
    hpc.start(extra_env={"PATH": f"{shims}:{os.environ['PATH']}"})
    wait_then = f'while [ ! -e "{go}" ]; do sleep 0.1; done; echo ending'
    ok = start(hpc, "hpc", "sh", "-c", f"{wait_then}; exit 0")
    bad = start(hpc, "hpc", "sh", "-c", f"{wait_then}; exit 3")
    for rid in (ok, bad):
        hpc.wait_state(rid, "running", timeout=60)
        wait_for((Path(hpc.record(rid)["remote_dir"]) / "job.pid").exists, 30, 0.1, "the job wrapper on its node")
    gate.touch()  # from now on Slurm's controller answers nothing
    try:
        go.touch()  # both jobs end
        for rid in (ok, bad):
            hpc.wait_state(rid, "succeeded", "failed", "cancelled", "stopped", timeout=90)
        assert gate.exists()  # recorded while squeue, scontrol and sacct still hung
        assert status_lines(hpc, ok)["state"] == "succeeded"
        assert status_lines(hpc, ok)["exit"] == "0"
        failed = status_lines(hpc, bad)
        assert failed["state"] == "failed" and failed["exit"] == "3"
        assert failed["message"].startswith("exit 3;") and f"obd train logs {bad}" in failed["message"]
    finally:
        gate.unlink(missing_ok=True)
    marker = slurm_batch.read_end_marker(hpc.record(bad)["remote_dir"])
    assert marker is not None and marker["exit_code"] == 3 and marker["slurm_signals"] == []


def test_a_queued_run_whose_job_starts_and_ends_while_squeue_hangs_is_recorded_with_its_start(
    hpc: DaemonProc,  # noqa: F811
    short_tmp: Path,
) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    gate = short_tmp / "slurm-hangs"
    shims = hanging_queries(short_tmp / "shims", gate)
    hpc.stop()
    hpc.start(extra_env={"PATH": f"{shims}:{os.environ['PATH']}"})
    blocker = cluster.run(
        "sbatch", "--parsable", "--nodes=2", "--exclusive", "--output=/dev/null", "--wrap=sleep 300"
    ).stdout.strip()
    try:
        wait_for(lambda: any(j["id"] == blocker and j["state"] == "RUNNING" for j in cluster.jobs()), 30)
        rid = start(hpc, "hpc", "sh", "-c", "echo done")
        hpc.wait_state(rid, "queued", timeout=30)
        gate.touch()  # no read of Slurm's queue can see the job running from now on
        cluster.run("scancel", blocker)  # the job starts, and ends at once
        record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", "stopped", timeout=90)
        assert gate.exists()
    finally:
        gate.unlink(missing_ok=True)
        cluster.run("scancel", blocker, check=False)
    assert record["state"] == "succeeded" and record["exit_code"] == 0, record["message"]
    states = [h["state"] for h in record["history"] if h["reason"] in ("started by the target's scheduler", "exit 0")]
    assert states == ["running", "succeeded"]


def test_a_job_whose_command_exits_0_after_an_scancel_outside_obd_is_not_recorded_a_success(
    hpc: DaemonProc,  # noqa: F811
) -> None:
    cluster: Cluster = hpc.cluster  # type: ignore[attr-defined]
    # The command takes Slurm's TERM and exits 0: its end marker says 0, but Slurm ended the job.
    rid = start(hpc, "hpc", "sh", "-c", "trap 'echo took TERM; exit 0' TERM; echo up; while :; do sleep 0.1; done")
    hpc.wait_state(rid, "running", timeout=60)
    wait_for(lambda: "up" in hpc.cli("train", "logs", rid).stdout, 30, 0.2, "the command to start")
    job_id = jobs_named(cluster, rid)[0]["id"]
    cluster.run("scancel", job_id)
    record = hpc.wait_state(rid, "succeeded", "failed", "cancelled", "stopped", timeout=60)
    marker = slurm_batch.read_end_marker(record["remote_dir"])
    assert marker is not None and marker["exit_code"] == 0 and marker["slurm_signals"] == ["TERM"]
    shown = status_lines(hpc, rid)
    assert shown["state"] == "failed", shown
    assert f"Slurm job {job_id} was cancelled in Slurm (scancel outside obd)" in shown["message"]
    assert "its command had exited 0" in shown["message"] and "Slurm's end state wins" in shown["message"]


# --- which word wins: the marker's or Slurm's --------------------------------------------------------


@pytest.mark.parametrize(
    ("marker", "code", "slurm_decides"),
    [
        ({"slurm_signals": [], "oom_kills": 0}, 0, False),
        ({"slurm_signals": [], "oom_kills": None}, 3, False),
        ({"slurm_signals": ["USR1"], "oom_kills": None}, 0, False),  # a deadline snapshot's request
        (None, 0, False),  # an exit_code with no marker (an older wrapper): as before
        ({"slurm_signals": ["TERM"], "oom_kills": None}, 0, True),  # time limit, preemption, scancel
        ({"slurm_signals": [], "oom_kills": 1}, 0, True),
        ({"slurm_signals": [], "oom_kills": None}, 137, True),  # killed by a signal
    ],
)
def test_an_end_marker_settles_a_job_s_end_unless_it_shows_slurm_s_hand(
    marker: dict | None, code: int, slurm_decides: bool
) -> None:
    assert (slurm_batch.contested(marker, code) is not None) == slurm_decides


@pytest.mark.parametrize(
    ("slurm_state", "code", "state"),
    [
        ("RUNNING", 0, "running"),
        ("COMPLETING", 0, "running"),
        ("COMPLETED", 0, "exited"),
        ("TIMEOUT", 0, "lost"),
        ("OUT_OF_MEMORY", 0, "lost"),
        ("CANCELLED", 0, "lost"),
        ("TIMEOUT", 143, "exited"),  # a failure either way: the command's code, Slurm's explanation
        (None, 0, "exited"),  # Slurm no longer knows the job: the marker stands
    ],
)
def test_a_contested_marker_waits_for_slurm_whose_end_state_wins_over_an_exit_0(
    slurm_state: str | None, code: int, state: str
) -> None:
    facts = {"exit_code": code, "cancelled": False, "cancelling": False, "contested": "Slurm sent the job a TERM"}
    job = {"job_id": "7", "state": slurm_state, "reason": "None"} if slurm_state else None
    status = slurm_batch.combine(facts, job, {"job_id": "7"}, 0.0)
    assert status["state"] == state
    assert status["exit_code"] == (None if state == "running" else code)


def test_an_end_marker_written_where_inotify_cannot_see_it_is_found_by_the_scan(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # As on a network filesystem written from another node: no inotify event comes.
    events = SlurmEvents(scan=0.05, inotify=False)

    async def main() -> set[str]:
        events.watch(str(run_dir))
        (run_dir / "exit_code").write_text("0\n")
        with anyio.fail_after(30):
            return await events.changed_files()

    assert anyio.run(main) == {f"{run_dir}/exit_code"}


def test_the_wrapper_s_own_failure_still_writes_the_end_marker_with_exit_1(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text("{not json")  # the wrapper cannot even read its job
    assert slurm_batch.batch(str(run_dir)) == 1
    assert (run_dir / "exit_code").read_text() == "1\n"
    marker = slurm_batch.read_end_marker(str(run_dir))
    assert marker is not None and marker["exit_code"] == 1
