"""The tiny Qwen2 LoRA workload under obd, as real processes: snapshot on request mid-run, then resume to the end.

The workload knows nothing of obd; only the environment and PYTHONPATH differ from a plain run.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.trainer_plugin.conftest import (
    PY,
    WORKLOAD,
    Job,
    RunDir,
    assert_exit_zero,
    wait_until,
)

MAX_STEPS = 400  # far more than the run gets to: the request stops it
CHECKPOINT_FILES = (
    "adapter_model.safetensors",
    "adapter_config.json",
    "optimizer.pt",
    "scheduler.pt",
    "trainer_state.json",
)


def workload(output_dir: Path, max_steps: int) -> list[str]:
    return [
        PY,
        str(WORKLOAD),
        "--tiny",
        "--max_steps",
        str(max_steps),
        "--output_dir",
        str(output_dir),
        "--batch_size",
        "4",
    ]


@dataclass
class Snapshot:
    run: RunDir
    job: Job
    code: int
    requested_at: int  # the last step logged when the request was written
    script_output: Path


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Snapshot:
    """One run of the workload, asked (reason `deadline`) to snapshot once it logged step 3."""
    root = tmp_path_factory.mktemp("tiny")
    run = RunDir(root / "run")
    script_output = root / "scripts_own_output"
    cwd = root / "cwd"
    cwd.mkdir()
    job = Job(run, workload(script_output, MAX_STEPS), run.env(), cwd)
    try:
        requested_at = wait_until(lambda: run.last_step() >= 3 and run.last_step(), job, what="step 3")
        run.request.write_text("deadline\n")
        code = job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    return Snapshot(run, job, code, requested_at, script_output)


def test_a_request_makes_the_trainer_save_and_stop_at_the_current_step(snapshot: Snapshot) -> None:
    assert_exit_zero(snapshot.job, snapshot.code)
    proof = snapshot.run.proof()
    assert proof is not None, snapshot.job.log_text()[-3000:]
    step = proof["step"]
    assert snapshot.requested_at <= step < MAX_STEPS
    # It stopped at the step it saved: nothing was trained after the checkpoint.
    assert snapshot.run.last_step() == step
    checkpoints = sorted(p.name for p in snapshot.run.output.glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{step}"]


def test_the_checkpoint_holds_adapter_optimizer_scheduler_and_trainer_state_of_that_step(snapshot: Snapshot) -> None:
    proof = snapshot.run.proof()
    assert proof is not None
    checkpoint = snapshot.run.root / proof["checkpoint"]
    for name in CHECKPOINT_FILES:
        assert (checkpoint / name).is_file(), f"{name} missing from {checkpoint}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == proof["step"]


def test_the_proof_names_exactly_output_checkpoint_step_with_the_requests_reason(snapshot: Snapshot) -> None:
    proof = snapshot.run.proof()
    assert proof is not None
    assert set(proof) == {"checkpoint", "step", "time", "reason"}
    assert proof["checkpoint"] == f"output/checkpoint-{proof['step']}"
    assert proof["reason"] == "deadline"
    assert "obd: snapshot at step" in snapshot.job.log_text()


def test_metrics_start_with_begin_log_every_step_with_tokens_and_end(snapshot: Snapshot) -> None:
    metrics = snapshot.run.metrics()
    begin = metrics[0]
    assert begin["event"] == "begin"
    assert begin["snapshots"] is True and begin["max_steps"] == MAX_STEPS and begin["start_step"] == 0
    assert begin["version"] and begin["world_size"] == 1
    assert begin["output_dir_requested"] == str(snapshot.script_output)
    logs = [m for m in metrics if m["event"] == "log"]
    assert [m["step"] for m in logs] == list(range(1, len(logs) + 1))
    for m in logs:
        assert {"time", "loss", "learning_rate", "grad_norm", "epoch", "tokens"} <= set(m)
        assert isinstance(m["loss"], float)
    tokens = [m["tokens"] for m in logs]
    assert tokens[0] > 0 and all(b > a for a, b in itertools.pairwise(tokens))
    assert metrics[-1]["event"] == "end" and metrics[-1]["step"] == logs[-1]["step"]
    assert sum(m["event"] == "begin" for m in metrics) == 1


def test_everything_the_trainer_saves_lands_in_the_runs_output_not_the_scripts(snapshot: Snapshot) -> None:
    assert not snapshot.script_output.exists()
    proof = snapshot.run.proof()
    assert proof is not None
    assert (snapshot.run.root / proof["checkpoint"] / "adapter_model.safetensors").is_file()


def test_a_stopped_run_never_saves_its_half_trained_adapter_as_the_final_model(snapshot: Snapshot) -> None:
    # The workload's save_model() after train() never ran: the job ended at the snapshot.
    assert sorted(p.name for p in snapshot.run.output.iterdir()) == [f"checkpoint-{snapshot.run.proof()['step']}"]  # type: ignore[index]
    assert "train_metrics" not in snapshot.job.log_text()


def test_a_resumed_run_continues_from_the_checkpoint_step_to_max_steps(snapshot: Snapshot, tmp_path: Path) -> None:
    first = snapshot.run.proof()
    assert first is not None
    checkpoint = snapshot.run.root / first["checkpoint"]
    checkpoint_tokens = json.loads((checkpoint / "trainer_state.json").read_text())["num_input_tokens_seen"]
    run = RunDir(tmp_path / "resumed", run_id="run-resumed")
    max_steps = first["step"] + 4
    (tmp_path / "cwd").mkdir()
    job = Job(run, workload(tmp_path / "elsewhere", max_steps), run.env(resume_from=checkpoint), tmp_path / "cwd")
    assert_exit_zero(job, job.wait())
    metrics = run.metrics()
    assert metrics[0]["event"] == "begin" and metrics[0]["start_step"] == first["step"]
    assert metrics[0]["resume_from"] == str(checkpoint)
    logs = [m for m in metrics if m["event"] == "log"]
    assert [m["step"] for m in logs] == list(range(first["step"] + 1, max_steps + 1))
    assert logs[0]["tokens"] > checkpoint_tokens > 0  # the token count carries on from the checkpoint
    # The scheduler came back too: a fresh linear schedule would start at the initial 2e-4,
    # the restored one is already below the learning rate of the snapshot's own step.
    lr_at_snapshot = next(m for m in snapshot.run.logs() if m["step"] == first["step"])["learning_rate"]
    assert 0 < logs[0]["learning_rate"] < lr_at_snapshot < 2e-4
    assert metrics[-1]["event"] == "end" and metrics[-1]["step"] == max_steps
    assert run.proof() is None  # it ended as usual
    assert (run.output / "adapter_model.safetensors").is_file()  # and the script's final save_model() ran, into output/
    assert "obd: resuming from" in job.log_text()
