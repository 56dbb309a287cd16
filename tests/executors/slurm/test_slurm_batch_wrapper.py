"""The batch wrapper of a Slurm job (trainer_plugin/tools/slurm_batch.py batch), run as a real process
and sent the signals Slurm sends: USR1 before the time limit, TERM at a preemption or a cancel."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for

WRAPPER = REPO / "trainer_plugin" / "tools" / "slurm_batch.py"
# Waits for a snapshot request, then exits 0 as a job that snapshotted would.
WAIT_FOR_REQUEST = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\nprint('saw', open(sys.argv[1]).read().strip(), flush=True)\n"


class Batch:
    """A run directory with a job.json, and the wrapper running it."""

    def __init__(self, run_dir: Path, command: list[str], plan: dict | None, files: dict[str, str]) -> None:
        self.dir = run_dir
        run_dir.mkdir()
        for name, text in files.items():
            (run_dir / name).write_text(text)
        (run_dir / "job.json").write_text(json.dumps({"command": command, "cwd": str(run_dir)}))
        (run_dir / "slurm_launch.json").write_text(json.dumps({"nodes": 1, "launcher": "srun", **(plan or {})}))
        self.log = open(run_dir / "job.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(WRAPPER), "batch", str(run_dir)],
            stdout=self.log,
            stderr=self.log,
            start_new_session=True,
        )
        wait_for((run_dir / "job.pid").exists, 20, 0.02, "job.pid")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)  # the batch shell alone, as `--signal=B:...` does

    def wait(self) -> int:
        return self.proc.wait(30)

    def read(self, name: str) -> str | None:
        path = self.dir / name
        return path.read_text().strip() if path.exists() else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def batches(tmp_path: Path) -> Iterator[list[Batch]]:
    made: list[Batch] = []
    yield made
    for batch in made:
        batch.stop()


def start(
    batches: list[Batch],
    tmp_path: Path,
    command: list[str],
    plan: dict | None = None,
    files: dict[str, str] | None = None,
) -> Batch:
    batch = Batch(tmp_path / f"run{len(batches)}", command, plan, files or {})
    batches.append(batch)
    return batch


def waiting_job(tmp_path: Path, n: int) -> list[str]:
    return [sys.executable, "-c", WAIT_FOR_REQUEST, str(tmp_path / f"run{n}" / "snapshot.request")]


def test_slurms_usr1_before_the_time_limit_becomes_a_deadline_request(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, waiting_job(tmp_path, 0))
    handle = json.loads(batch.read("job.pid") or "{}")
    assert handle["pid"] == batch.proc.pid
    batch.signal(signal.SIGUSR1)
    assert batch.wait() == 0
    assert batch.read("snapshot.request") == "deadline"
    assert batch.read("exit_code") == "0"
    assert "saw deadline" in (batch.read("job.log") or "")


def test_a_term_that_is_not_obds_cancel_becomes_a_preempted_request(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, waiting_job(tmp_path, 0))
    batch.signal(signal.SIGTERM)
    assert batch.wait() == 0
    assert batch.read("snapshot.request") == "preempted"


def test_a_term_near_the_time_limit_becomes_a_deadline_request(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, waiting_job(tmp_path, 0), {"time_limit": 5})
    batch.signal(signal.SIGTERM)
    assert batch.wait() == 0
    assert batch.read("snapshot.request") == "deadline"


def test_a_request_already_there_keeps_its_reason(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, ["sleep", "30"])
    (batch.dir / "snapshot.request").write_text("requested\n")
    batch.signal(signal.SIGUSR1)
    batch.signal(signal.SIGTERM)
    time.sleep(0.5)  # the handlers have run (they would have written at once)
    assert batch.read("snapshot.request") == "requested"
    assert "snapshot requested" not in (batch.read("job.log") or "")


def test_a_term_during_obds_cancel_ends_the_job_and_records_its_exit(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, ["sleep", "30"])
    (batch.dir / "cancelling").write_text("now\n")
    batch.signal(signal.SIGTERM)
    assert batch.wait() == 143
    assert batch.read("exit_code") == "143"
    assert batch.read("snapshot.request") is None


def test_a_batch_that_begins_after_obds_cancel_starts_no_command(batches: list[Batch], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # obd's cancel writes `cancelling` before its scancel, which met the job as it began
    batch = start(batches, tmp_path, ["touch", str(marker)], files={"cancelling": "now\n"})
    assert batch.wait() == 143
    assert batch.read("exit_code") == "143"
    assert "cancelled before its command started" in (batch.read("job.log") or "")
    assert not marker.exists()


def test_a_command_that_cannot_start_is_exit_127_with_a_line_in_the_log(batches: list[Batch], tmp_path: Path) -> None:
    batch = start(batches, tmp_path, ["/no/such/program"])
    assert batch.wait() == 127
    assert batch.read("exit_code") == "127"
    assert "could not start" in (batch.read("job.log") or "")


def test_a_working_directory_missing_on_the_node_fails_the_job_saying_where_it_must_be(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    missing = tmp_path / "not-on-this-node"
    (run_dir / "job.json").write_text(json.dumps({"command": ["true"], "cwd": str(missing)}))
    (run_dir / "slurm_launch.json").write_text(json.dumps({"nodes": 1, "launcher": "srun"}))
    out = subprocess.run(
        [sys.executable, str(WRAPPER), "batch", str(run_dir)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 1
    assert (run_dir / "exit_code").read_text().strip() == "1"
    assert f"the job's working directory {missing} cannot be used on node" in out.stderr
    assert "it does not exist here" in out.stderr and "filesystem the compute nodes share" in out.stderr
