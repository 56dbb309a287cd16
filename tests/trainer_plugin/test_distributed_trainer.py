"""The Trainer under torchrun (2 ranks, gloo on CPU): rank 0 decides, both ranks stop at the same step, one proof."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.trainer_plugin.conftest import SCRIPTS, WORKLOAD, RunDir, assert_exit_zero
from tests.trainer_plugin.conftest import torchrun as launcher


def torchrun(tmp_path: Path, *argv: str) -> list[str]:
    return [*launcher(tmp_path), *argv]


def final_steps(log: str) -> list[tuple[int, int]]:
    """(rank, step) each rank reports at its train end (inside train(): a snapshot ends the job there)."""
    return sorted((int(r), int(s)) for s, r in re.findall(r"train ended at step (\d+) of \d+ \(rank (\d+)\)", log))


def test_a_request_stops_every_rank_at_the_same_step_and_rank_0_alone_writes(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    after_train = tmp_path / "after_train"
    after_train.mkdir()
    argv = torchrun(
        tmp_path,
        str(SCRIPTS / "plain_trainer.py"),
        "--output_dir",
        str(tmp_path / "mine"),
        "--write-at",
        "3",
        "--write-file",
        f"{run_dir.request}=cost",
        "--report-exit",
        "--finish",
        str(after_train),
    )
    job = start_job(run_dir, argv, run_dir.env())
    # torchrun exits 0 only when every rank did: the snapshot ended the job on both.
    assert_exit_zero(job, job.wait())
    assert final_steps(job.log_text()) == [(0, 3), (1, 3)]
    # Neither rank ran the script's code after train(): no final save, no "finished", no push.
    assert "trained to step" not in job.log_text()
    assert list(after_train.iterdir()) == []
    assert sorted(p.name for p in run_dir.output.iterdir()) == ["checkpoint-3"]
    proof = run_dir.proof()
    assert proof is not None and (proof["step"], proof["reason"]) == (3, "cost")
    checkpoint = run_dir.output / "checkpoint-3"
    # Each rank's share (its RNG state) was on disk before the proof.
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    metrics = run_dir.metrics()
    assert sum(m["event"] == "begin" for m in metrics) == 1 and metrics[0]["world_size"] == 2
    logs = [m for m in metrics if m["event"] == "log"]
    assert [m["step"] for m in logs] == [1, 2, 3]
    # Tokens count both ranks: 4 samples x 8 features per rank and step.
    assert [m["tokens"] for m in logs] == [64, 128, 192]
    assert job.log_text().count("obd: snapshot at step") == 1
    # The script never destroys its gloo group; the plugin does at exit, while the interpreter
    # is whole, so gloo's threads cannot abort the process during finalisation.
    assert sorted(re.findall(r"process group at exit: (\w+) \(rank (\d)\)", job.log_text())) == [
        ("destroyed", "0"),
        ("destroyed", "1"),
    ]


@pytest.mark.slow
def test_a_sigterm_on_one_rank_is_a_preempted_snapshot_of_all_ranks(run_dir: RunDir, start_job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    argv = torchrun(
        tmp_path,
        str(SCRIPTS / "plain_trainer.py"),
        "--output_dir",
        str(tmp_path / "mine"),
        "--sigterm-at",
        "4",
        "--sigterm-rank",
        "1",
    )
    job = start_job(run_dir, argv, run_dir.env(on_sigterm=True))
    assert_exit_zero(job, job.wait())
    assert final_steps(job.log_text()) == [(0, 4), (1, 4)]
    assert run_dir.proof()["reason"] == "preempted"  # type: ignore[index]
    assert run_dir.request.read_text().strip() == "preempted"


@pytest.mark.slow
def test_the_tiny_lora_workload_under_torchrun_snapshots_and_resumes(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    run_dir.request.write_text("requested")  # there before the start: the first step end takes it
    argv = torchrun(
        tmp_path,
        str(WORKLOAD),
        "--tiny",
        "--max_steps",
        "6",
        "--batch_size",
        "2",
        "--output_dir",
        str(tmp_path / "mine"),
    )
    job = start_job(run_dir, argv, run_dir.env())
    assert_exit_zero(job, job.wait())
    proof = run_dir.proof()
    assert proof is not None and proof["step"] == 1
    resumed = RunDir(tmp_path / "resumed")
    job = start_job(resumed, argv, resumed.env(resume_from=run_dir.output / "checkpoint-1"))
    assert_exit_zero(job, job.wait())
    assert [m["step"] for m in resumed.logs()] == [2, 3, 4, 5, 6]
    assert resumed.proof() is None
