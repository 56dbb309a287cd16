"""A plain Trainer script of the user's (tests/trainer_plugin/scripts/plain_trainer.py) under obd, as real processes.

The script's "test" options write the request file or send SIGTERM at an exact step, standing
in for the outside world, so no test depends on timing.
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from runner.assemble import parse_run
from tests.trainer_plugin.conftest import PY, REPO, SCRIPTS, Job, RunDir, assert_exit_zero, clean_environ, wait_until

SCRIPT = SCRIPTS / "plain_trainer.py"
MODEL_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json")


def plain(output_dir: Path, *opts: str) -> list[str]:
    return [PY, str(SCRIPT), "--output_dir", str(output_dir), *opts]


@dataclass
class Done:
    run: RunDir
    job: Job
    code: int


@pytest.fixture(scope="module")
def garbage_request(tmp_path_factory: pytest.TempPathFactory) -> Done:
    """A Trainer subclass with SnapshotCallback added by hand twice; at step 3 someone writes nonsense in the request."""
    root = tmp_path_factory.mktemp("plain")
    run = RunDir(root / "run")
    (root / "cwd").mkdir()
    argv = plain(
        root / "mine",
        "--subclass",
        "--callback-by-hand",
        "--write-at",
        "3",
        "--write-file",
        f"{run.request}=stop it now please",
    )
    job = Job(run, argv, run.env(), root / "cwd")
    return Done(run, job, job.wait())


def test_a_request_that_is_not_a_reason_word_snapshots_with_reason_requested(garbage_request: Done) -> None:
    assert_exit_zero(garbage_request.job, garbage_request.code)
    assert garbage_request.run.proof() == {
        "checkpoint": "output/checkpoint-3",
        "step": 3,
        "time": garbage_request.run.proof()["time"],  # type: ignore[index]
        "reason": "requested",
    }
    checkpoint = garbage_request.run.output / "checkpoint-3"
    for name in MODEL_FILES:
        assert (checkpoint / name).is_file(), name
    assert "train ended at step 3 of 8" in garbage_request.job.log_text()


def test_a_callback_added_by_hand_is_not_doubled_by_the_injected_one(garbage_request: Done) -> None:
    log = garbage_request.job.log_text()
    callbacks = next(line for line in log.splitlines() if line.startswith("callbacks: "))
    assert callbacks.count("SnapshotCallback") == 1
    metrics = garbage_request.run.metrics()
    assert sum(m["event"] == "begin" for m in metrics) == 1
    assert sum(m["event"] == "end" for m in metrics) == 1
    assert log.count("obd: snapshot at step") == 1


def test_resume_from_checkpoint_true_in_the_script_resumes_from_obds_checkpoint(
    garbage_request: Done, tmp_path: Path
) -> None:
    # The script asks for "the last checkpoint in output_dir"; under obd that is OBD_RESUME_FROM.
    run = RunDir(tmp_path / "run2")
    (tmp_path / "cwd").mkdir()
    checkpoint = garbage_request.run.output / "checkpoint-3"
    job = Job(run, plain(tmp_path / "mine", "--resume", "true"), run.env(resume_from=checkpoint), tmp_path / "cwd")
    assert_exit_zero(job, job.wait())
    steps = [m["step"] for m in run.logs()]
    assert steps == [4, 5, 6, 7, 8]
    assert run.metrics()[0]["start_step"] == 3
    assert run.proof() is None


def test_a_request_at_the_last_step_lets_the_run_end_as_usual_without_a_proof(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    job = start_job(
        run_dir,
        plain(
            tmp_path / "mine", "--save_steps", "3", "--write-at", "8", "--write-file", f"{run_dir.request}=requested"
        ),
        run_dir.env(),
    )
    assert_exit_zero(job, job.wait())
    assert run_dir.proof() is None
    assert run_dir.metrics()[-1] == {**run_dir.metrics()[-1], "event": "end", "step": 8}
    # The script's own saves still happened, in the run's output/.
    assert sorted(p.name for p in run_dir.output.glob("checkpoint-*")) == [
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-8",
    ]
    assert "obd: snapshot" not in job.log_text()


def test_outside_obd_the_plugin_on_the_path_writes_nothing_and_changes_nothing(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    mine = tmp_path / "mine"
    request = tmp_path / "stray.request"
    job = start_job(
        run_dir,
        plain(mine, "--callback-by-hand", "--write-at", "2", "--write-file", f"{request}=requested"),
        run_dir.env(obd=False),
    )
    assert_exit_zero(job, job.wait())
    assert sorted(p.name for p in run_dir.root.iterdir()) == ["job.log", "plugin"]
    assert "trained to step 8 of 8" in job.log_text()
    assert (mine / "model.safetensors").is_file() is False  # the script saves no final model...
    assert mine.is_dir()  # ...but Trainer made its own output_dir, untouched by obd


def test_sigterm_with_snapshot_on_sigterm_is_a_preempted_snapshot_at_that_step(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    job = start_job(run_dir, plain(tmp_path / "mine", "--sigterm-at", "4"), run_dir.env(on_sigterm=True))
    assert_exit_zero(job, job.wait())
    proof = run_dir.proof()
    assert proof is not None and proof["step"] == 4 and proof["reason"] == "preempted"
    assert proof["checkpoint"] == "output/checkpoint-4"
    # The daemon learns of it through the request file, like any other request.
    assert run_dir.request.read_text().strip() == "preempted"
    assert run_dir.metrics()[0]["snapshot_on_sigterm"] is True


@pytest.mark.slow  # ~10 s of imports; an edge of the SIGTERM test above
def test_without_snapshot_on_sigterm_a_sigterm_ends_the_job_as_usual(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    job = start_job(run_dir, plain(tmp_path / "mine", "--sigterm-at", "4"), run_dir.env())
    assert job.wait() == -signal.SIGTERM
    assert run_dir.proof() is None
    assert not run_dir.request.exists()


@pytest.mark.slow  # ~10 s of imports; an edge of the SIGTERM test above
def test_an_existing_request_reason_wins_over_a_sigterm_in_the_same_step(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    argv = plain(tmp_path / "mine", "--sigterm-at", "2", "--write-at", "2", "--write-file", f"{run_dir.request}=cost")
    job = start_job(run_dir, argv, run_dir.env(on_sigterm=True))
    assert_exit_zero(job, job.wait())
    proof = run_dir.proof()
    assert proof is not None and (proof["step"], proof["reason"]) == (2, "cost")
    assert run_dir.request.read_text() == "cost"  # not overwritten
    assert json.loads(run_dir.metrics_path.read_text().splitlines()[-1])["reason"] == "cost"


@pytest.mark.slow  # ~10 s of imports; a multi-stage script: an edge
def test_a_later_training_in_the_same_job_never_replaces_the_proof(run_dir: RunDir, start_job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Two stages, a new Trainer each, same output_dir; the request (still there) came in stage 1.
    # A second stage runs only in a script that opted out of the job ending at the snapshot.
    argv = plain(tmp_path / "mine", "--stages", "2", "--write-at", "3", "--write-file", f"{run_dir.request}=requested")
    job = start_job(run_dir, argv, {**run_dir.env(), "OBD_SNAPSHOT_RETURNS": "1"})
    assert_exit_zero(job, job.wait())
    log = job.log_text()
    assert "train ended at step 3 of 8" in log and "train ended at step 1 of 8" in log
    assert run_dir.proof()["checkpoint"] == "output/checkpoint-3"  # type: ignore[index]
    assert sorted(p.name for p in run_dir.output.glob("checkpoint-*")) == ["checkpoint-3"]
    assert log.count("obd: snapshot at step") == 1


def test_with_obd_torch_profile_the_callback_drives_the_step_profiler(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    env = {**run_dir.env(), "OBD_TORCH_PROFILE": "1", "OBD_PROFILE_DIR": str(run_dir.root / "profile")}
    job = start_job(run_dir, plain(tmp_path / "mine", "--max_steps", "6"), env)
    assert_exit_zero(job, job.wait())
    summary = json.loads((run_dir.root / "profile" / "torch_profile.json").read_text())
    assert [s["step"] for s in summary["step_records"]] == [1, 2, 3, 4, 5, 6]
    assert summary["state"] == "done" and summary["window"]["profiled_steps"]
    assert summary["model"]["params"] == 8 * 16 + 16 + 16 + 1  # note_model saw the Trainer's model
    assert (run_dir.root / "profile" / "torch_kernels.csv").is_file()


def test_a_callback_added_by_hand_works_without_obds_sitecustomize(run_dir: RunDir, start_job, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Only the package on the path, no sitecustomize: importing SnapshotCallback patches Trainer itself.
    (run_dir.plugin / "sitecustomize.py").unlink()
    mine = tmp_path / "mine"
    argv = plain(mine, "--callback-by-hand", "--write-at", "2", "--write-file", f"{run_dir.request}=disk")
    job = start_job(run_dir, argv, run_dir.env())
    assert_exit_zero(job, job.wait())
    assert run_dir.proof()["checkpoint"] == "output/checkpoint-2"  # type: ignore[index]
    assert run_dir.metrics()[0]["output_dir_requested"] == str(mine)
    assert not mine.exists()


def test_a_profiled_trainer_run_reports_mfu_from_the_models_own_parameter_count(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # The first layer frozen, as LoRA freezes the base model: trainable is the second layer only.
    job = start_job(run_dir, plain(tmp_path / "mine", "--max_steps", "4", "--freeze-first"), run_dir.env())
    assert_exit_zero(job, job.wait())
    begin = run_dir.metrics()[0]
    assert begin["event"] == "begin"
    params, trainable = 8 * 16 + 16 + 16 + 1, 16 + 1
    assert (begin["model_params"], begin["trainable_params"]) == (params, trainable)

    # The runner reads this metrics.jsonl as is, with rocprofv3's agent_info.csv of an MI300X.
    profile = tmp_path / "profile"
    (profile / "gpuhost").mkdir(parents=True)
    shutil.copy(REPO / "tests/runner/fixtures/rocm7/gpuhost/4024_agent_info.csv", profile / "gpuhost")
    metrics = parse_run(profile, run_dir.metrics_path)
    flops = 4 * params + 2 * trainable
    assert metrics.flops_per_token == flops
    assert "begin line" in metrics.sources["flops_per_token"]
    assert metrics.tokens_per_sec and metrics.gpu_count == 1
    assert metrics.mfu_pct == pytest.approx(100 * metrics.tokens_per_sec * flops / (metrics.peak_tflops * 1e12))
    assert metrics.peak_tflops == pytest.approx(1307.4, abs=0.1)
    assert not [w for w in metrics.warnings if "MFU unknown" in w]


# --- stop means stop: the script's code after train() -------------------------------------


def finishing(run: RunDir, tmp_path: Path) -> tuple[list[str], Path]:
    """The plain script stopped at step 3, with code after train() that saves, says "finished" and pushes (to files)."""
    folder = tmp_path / "after_train"
    folder.mkdir()
    argv = plain(
        tmp_path / "mine", "--write-at", "3", "--write-file", f"{run.request}=requested", "--finish", str(folder)
    )
    return argv, folder


def test_a_snapshot_ends_the_job_with_exit_0_before_the_scripts_save_push_and_finished_marker(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    argv, folder = finishing(run_dir, tmp_path)
    job = start_job(run_dir, argv, run_dir.env())
    assert_exit_zero(job, job.wait())
    proof = run_dir.proof()
    assert proof is not None and proof["step"] == 3
    log = job.log_text()
    assert "train ended at step 3 of 8" in log  # train() itself ran to its end...
    assert "trained to step" not in log  # ...and not a line of the script after it
    assert sorted(p.name for p in folder.iterdir()) == []  # no "finished" marker, no push
    # No save_model(): the run's output/ holds the snapshot and nothing posing as a final model.
    assert sorted(p.name for p in run_dir.output.iterdir()) == ["checkpoint-3"]
    assert run_dir.metrics()[-1] == {**run_dir.metrics()[-1], "event": "end", "snapshot": "output/checkpoint-3"}
    assert "the job ends here with exit 0" in log and "obd train resume run-test" in log


def test_with_obd_snapshot_returns_the_script_sees_the_marker_and_its_code_after_train_runs(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    argv, folder = finishing(run_dir, tmp_path)
    job = start_job(run_dir, argv, {**run_dir.env(), "OBD_SNAPSHOT_RETURNS": "1"})
    assert_exit_zero(job, job.wait())
    log = job.log_text()
    checkpoint = run_dir.output / "checkpoint-3"
    marker = f"StoppedForSnapshot(step=3, max_steps=8, reason='requested', checkpoint={str(checkpoint)!r})"
    # On the Trainer's state and from the helper alike.
    assert f"after train: marker {marker}; helper {marker}" in log
    assert "trained to step 3 of 8" in log
    assert sorted(p.name for p in folder.iterdir()) == ["finished", "pushed"]
    assert run_dir.proof()["step"] == 3  # type: ignore[index]


def test_a_trainer_that_hangs_after_a_logged_step_has_that_step_in_metrics_within_2_s(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Steps of a few ms: step 20 is logged well within the 1 s that step logs may wait, and
    # no step end, heartbeat or other line ever comes after it.
    argv = plain(tmp_path / "mine", "--max_steps", "100", "--hang-after", "20")
    job = start_job(run_dir, argv, run_dir.env())
    wait_until(lambda: "hanging after step 20" in job.log_text(), job, what="the hang after step 20")
    deadline = time.monotonic() + 2.0
    while run_dir.last_step() < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run_dir.last_step() == 20, f"metrics.jsonl still ends at step {run_dir.last_step()}"
    job.proc.kill()


def test_a_snapshot_exit_runs_finally_and_atexit_then_skips_the_interpreters_teardown(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    for folder in (stopped, whole):
        folder.mkdir()
    argv = plain(tmp_path / "mine", "--write-at", "3", "--write-file", f"{run_dir.request}=requested")
    job = start_job(run_dir, [*argv, "--exit-probe", str(stopped)], run_dir.env())
    assert_exit_zero(job, job.wait())
    # The script's finally and its atexit handler ran; the teardown of every object (a second
    # and more in a process holding torch and a model, the GPU held) did not.
    assert sorted(p.name for p in stopped.iterdir()) == ["atexit", "finally"]
    ended = start_job(run_dir, [*plain(tmp_path / "again"), "--exit-probe", str(whole)], clean_environ())
    assert ended.wait() == 0  # the same script, no obd, no snapshot: the teardown runs as ever
    assert sorted(p.name for p in whole.iterdir()) == ["atexit", "finally", "teardown"]


def test_a_script_that_catches_the_snapshot_exit_and_exits_otherwise_keeps_its_exit_code(
    run_dir: RunDir, start_job, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    argv = plain(tmp_path / "mine", "--write-at", "3", "--write-file", f"{run_dir.request}=requested")
    job = start_job(run_dir, [*argv, "--catch-exit", "3"], run_dir.env())
    assert job.wait() == 3
    assert run_dir.proof()["step"] == 3  # type: ignore[index]
