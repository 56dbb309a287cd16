"""The custom-loop helpers: in this process against a fake run directory, and in real loops alone and under torchrun."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.trainer_plugin.conftest import PY, SCRIPTS, RunDir, assert_exit_zero
from tests.trainer_plugin.conftest import torchrun as launcher
from trainer_plugin import loop

SCRIPT = SCRIPTS / "custom_loop.py"


@pytest.fixture
def obd_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("OBD_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OBD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("OBD_OUTPUT_DIR", str(tmp_path / "output"))
    return tmp_path


@pytest.fixture
def no_obd(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OBD_"):
            monkeypatch.delenv(name)


def test_snapshot_requested_reads_the_reason_and_none_without_a_request(obd_env: Path) -> None:
    assert loop.snapshot_requested() is None
    (obd_env / "snapshot.request").write_text("disk")
    assert loop.snapshot_requested() == "disk"
    (obd_env / "snapshot.request").write_text("???")
    assert loop.snapshot_requested() == "requested"


def test_write_proof_checks_the_checkpoint_exists_and_names_it_exactly(obd_env: Path) -> None:
    with pytest.raises(loop.runtime.IncompleteCheckpoint):
        loop.write_proof(5)
    path = loop.checkpoint_dir(5)
    assert path == str(obd_env / "output" / "checkpoint-5")
    os.makedirs(path)
    proof = loop.write_proof(5, path, reason="cost")
    assert proof is not None
    assert json.loads((obd_env / "snapshot.json").read_text()) == proof
    assert (proof["checkpoint"], proof["step"], proof["reason"]) == ("output/checkpoint-5", 5, "cost")


def test_write_proof_refuses_a_directory_other_than_output_checkpoint_step(obd_env: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere" / "checkpoint-5"
    elsewhere.mkdir(parents=True)
    (obd_env / "output" / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(ValueError):
        loop.write_proof(5, str(elsewhere))
    with pytest.raises(ValueError):
        loop.write_proof(5, str(obd_env / "output" / "checkpoint-4"))
    assert not (obd_env / "snapshot.json").exists()


def test_logging_before_begin_writes_a_begin_line_first_that_claims_no_snapshots(obd_env: Path) -> None:
    loop.log_metrics(1, loss=float("nan"), extra=3)
    loop.end(1)
    lines = [json.loads(line) for line in (obd_env / "metrics.jsonl").read_text().splitlines()]
    assert [m["event"] for m in lines] == ["begin", "log", "end"]
    assert lines[0]["snapshots"] is False
    assert lines[1]["loss"] is None and lines[1]["extra"] == 3 and lines[1]["grad_norm"] is None


def test_outside_obd_every_helper_is_a_no_op(no_obd: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert loop.snapshot_requested() is None
    assert loop.write_proof(3) is None
    loop.begin(max_steps=3)
    loop.log_metrics(1, loss=1.0)
    loop.end(1)
    assert loop.resume_from() is None
    assert loop.checkpoint_dir(3, "mine") == os.path.join("mine", "checkpoint-3")
    assert list(tmp_path.iterdir()) == []


def stopped_at(log: str) -> list[tuple[int, int, str]]:
    return sorted(
        (int(r), int(s), why) for r, s, why in re.findall(r"rank (\d+) stopped at step (\d+) reason (\S+)", log)
    )


def test_a_custom_loop_snapshots_on_request_and_resumes_to_the_end(run_dir: RunDir, start_job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    job = start_job(
        run_dir, [PY, str(SCRIPT), "--write-at", "3", "--write-file", f"{run_dir.request}=deadline"], run_dir.env()
    )
    assert_exit_zero(job, job.wait())
    assert stopped_at(job.log_text()) == [(0, 3, "deadline")]
    checkpoint = run_dir.output / "checkpoint-3"
    assert f"rank 0 marker: stopped for a snapshot at step 3 of 10 (deadline): {checkpoint}" in job.log_text()
    proof = run_dir.proof()
    assert proof is not None and (proof["checkpoint"], proof["reason"]) == ("output/checkpoint-3", "deadline")
    assert [m["event"] for m in run_dir.metrics()] == ["begin", "log", "log", "log", "end"]

    resumed = RunDir(tmp_path / "resumed")
    job = start_job(resumed, [PY, str(SCRIPT)], resumed.env(resume_from=run_dir.output / "checkpoint-3"))
    assert_exit_zero(job, job.wait())
    assert stopped_at(job.log_text()) == [(0, 10, "None")]
    assert "rank 0 marker: None" in job.log_text()  # it trained to the end
    assert [m["step"] for m in resumed.logs()] == list(range(4, 11))
    assert resumed.proof() is None


def torchrun(script: Path, run_dir: RunDir, *opts: str) -> list[str]:
    return [*launcher(run_dir.root), str(script), *opts]


@pytest.mark.slow  # the Trainer's torchrun test covers a request under torchrun by default
def test_under_torchrun_a_request_stops_both_ranks_at_the_same_step_with_one_proof(run_dir: RunDir, start_job) -> None:  # type: ignore[no-untyped-def]
    job = start_job(
        run_dir, torchrun(SCRIPT, run_dir, "--write-at", "4", "--write-file", f"{run_dir.request}=disk"), run_dir.env()
    )
    assert_exit_zero(job, job.wait())
    # Rank 0 saw the file after step 4; rank 1 never looks at it and still stops at 4.
    assert stopped_at(job.log_text()) == [(0, 4, "disk"), (1, 4, "disk")]
    assert run_dir.proof()["step"] == 4  # type: ignore[index]
    # Every rank knows the run stopped mid-way, once rank 0's proof is on disk.
    assert len(re.findall(r"rank [01] marker: stopped for a snapshot at step 4 of 10 \(disk\)", job.log_text())) == 2
    metrics = run_dir.metrics()
    assert sum(m["event"] == "begin" for m in metrics) == 1  # rank 0 alone writes metrics
    assert metrics[0]["world_size"] == 2


def test_under_torchrun_a_sigterm_on_rank_1_alone_is_a_preempted_snapshot_of_both(run_dir: RunDir, start_job) -> None:  # type: ignore[no-untyped-def]
    job = start_job(
        run_dir, torchrun(SCRIPT, run_dir, "--sigterm-at", "5", "--sigterm-rank", "1"), run_dir.env(on_sigterm=True)
    )
    code = job.wait()
    log = job.log_text()
    assert stopped_at(log) == [(0, 5, "preempted"), (1, 5, "preempted")], f"exit {code}:\n{log[-4000:]}"
    if code != 0:
        # After both ranks ended their loop (the proof is written), torch's gloo teardown in the
        # rank that took the SIGTERM aborts now and then (about one run in eight on a loaded
        # machine, with or without obd's part in the exit): only that abort is let through.
        assert "terminate called without an active exception" in log, f"exit {code}:\n{log[-4000:]}"
    assert run_dir.proof()["reason"] == "preempted"  # type: ignore[index]
    assert run_dir.request.read_text().strip() == "preempted"


def test_a_loop_stopped_inside_a_step_puts_back_the_last_boundary_s_rng_and_saves_that_step(
    run_dir: RunDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    import random

    import numpy as np
    import torch

    from trainer_plugin import loop

    for name, value in run_dir.env().items():
        if name.startswith("OBD_"):
            monkeypatch.setenv(name, value)
    loop.boundary(3)  # optimizer step 3 ended
    at_boundary = (torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist())
    assert loop.stop_pending() is None
    run_dir.request.write_text("cost\n")  # ...and a stop comes in step 4's micro-batches
    assert loop.stop_pending() == "cost"
    assert loop.restore_boundary() == 3
    # What step 4 drew is drawn again: the checkpoint saved now holds step 3's RNG states.
    assert (torch.rand(4).tolist(), random.random(), np.random.rand(2).tolist()) == at_boundary
