"""Users' own training scripts under the real daemon, unchanged: a plain Trainer and TRL's SFTTrainer.

Neither script mentions obd. The daemon's injected plugin must give them snapshots at a step
boundary, a proof, a resume with no change to the script, and preemption on SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
SCRIPTS = REPO / "tests" / "trainer_plugin" / "scripts"
PLAIN = str(SCRIPTS / "plain_trainer.py")
TRL = str(SCRIPTS / "trl_sft.py")

CONFIG = FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "30s"').replace(
    'end_timeout = "30s"', 'end_timeout = "10s"'
)


@pytest.fixture
def sd(make_daemon) -> DaemonProc:
    d = make_daemon(CONFIG)
    d.start()
    return d


def start(d: DaemonProc, cwd: Path, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", "--cwd", str(cwd), *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def announced(d: DaemonProc, rid: str, step: int) -> dict:
    def check() -> dict | None:
        r = d.record(rid)
        if r["state"] not in ("running", "preparing"):
            raise AssertionError(f"run ended early: {r['message']}")
        return r if r["snapshots"] and (r["progress"]["step"] or 0) >= step else None

    return wait_for(check, 120, 0.1, f"run {rid} to announce snapshots and reach step {step}")


def metrics(record: dict) -> list[dict]:
    return [json.loads(x) for x in (Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]


def stop_and_resume(
    d: DaemonProc, cwd: Path, command: list[str], resume_command: Callable[[int], list[str]], files: tuple[str, ...]
) -> tuple[dict, dict]:
    """Stop a running user script with a snapshot, check its checkpoint holds `files`, then resume it
    with `resume_command(step)` to the end."""
    rid = start(d, cwd, *command)
    announced(d, rid, step=2)
    out = d.cli("train", "stop", rid, "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = json.loads(out.stdout)
    snap = stopped["snapshot"]
    assert stopped["state"] == "stopped" and snap["reason"] == "requested"
    ckpt = Path(stopped["remote_dir"]) / snap["checkpoint"]
    assert snap["checkpoint"] == f"output/checkpoint-{snap['step']}"
    for name in (*files, "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (ckpt / name).exists(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == snap["step"]

    resumed = start(d, cwd, *resume_command(snap["step"]), opts=("--resume-from", rid))
    final = d.wait_state(resumed, "succeeded", "failed", "stopped", "cancelled", timeout=180)
    assert final["state"] == "succeeded", final["message"]
    assert final["resumed_from"] == rid
    lines = metrics(final)
    losses = [x for x in lines if x["event"] == "log" and "loss" in x]
    assert lines[0]["event"] == "begin" and lines[0]["start_step"] == snap["step"]
    assert losses[0]["step"] == snap["step"] + 1
    return stopped, final


def test_a_plain_trainer_script_stops_with_a_snapshot_and_resumes_unchanged(sd: DaemonProc, short_tmp: Path) -> None:
    cwd = short_tmp / "work"
    cwd.mkdir()
    command = [PY, PLAIN, "--output_dir", "mine", "--max_steps", "100000", "--step-sleep", "0.02"]
    stopped, final = stop_and_resume(
        sd,
        cwd,
        command,
        lambda step: [PY, PLAIN, "--output_dir", "mine", "--max_steps", str(step + 4)],
        ("model.safetensors",),
    )
    begin = metrics(stopped)[0]
    assert begin["snapshots"] is True and begin["output_dir_requested"] == "mine"  # what the script asked for, kept
    assert not (cwd / "mine").exists()  # under obd the checkpoints went to the run's output/
    assert metrics(final)[-1]["event"] == "end"


@pytest.mark.slow  # the LoRA workload's preemption under the daemon runs by default (test_stop.py)
def test_a_plain_trainer_script_started_with_snapshot_on_sigterm_is_preempted_at_a_step(
    sd: DaemonProc, short_tmp: Path
) -> None:
    rid = start(
        sd,
        short_tmp,
        PY,
        PLAIN,
        "--output_dir",
        "mine",
        "--max_steps",
        "100000",
        "--step-sleep",
        "0.02",
        opts=("--snapshot-on-sigterm",),
    )
    record = announced(sd, rid, step=2)
    os.killpg(record["job"]["pid"], signal.SIGTERM)  # what a preempting scheduler does
    final = sd.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=60)
    assert final["state"] == "stopped", final["message"]
    snap = final["snapshot"]
    assert snap["reason"] == "preempted" and snap["checkpoint"] == f"output/checkpoint-{snap['step']}"
    assert (Path(final["remote_dir"]) / snap["checkpoint"] / "model.safetensors").exists()


def test_a_trl_sft_script_with_lora_stops_with_a_snapshot_and_resumes_unchanged(
    sd: DaemonProc, short_tmp: Path
) -> None:
    pytest.importorskip("trl", reason="TRL is in the test extra; install it with scripts/setup.sh")
    cwd = short_tmp / "work"
    cwd.mkdir()
    stopped, final = stop_and_resume(
        sd,
        cwd,
        [PY, TRL, "--max_steps", "100000"],
        lambda step: [PY, TRL, "--max_steps", str(step + 3)],
        ("adapter_model.safetensors", "adapter_config.json"),
    )
    assert not (cwd / "trl-out").exists()
    log = (Path(final["remote_dir"]) / "job.log").read_text()
    assert "SnapshotCallback" in log.split("callbacks:")[-1]  # injected into SFTTrainer, not written by the user
    assert f"trained to step {stopped['snapshot']['step'] + 3} of" in log


def test_a_stopped_trainer_script_ends_at_its_snapshot_and_its_outputs_are_never_offered_as_final(
    sd: DaemonProc, short_tmp: Path
) -> None:
    cwd = short_tmp / "work"
    after_train = short_tmp / "after_train"
    cwd.mkdir()
    after_train.mkdir()
    # After train() the script saves its model, writes "finished" and pushes (to a file).
    command = [PY, PLAIN, "--output_dir", "mine", "--max_steps", "100000", "--step-sleep", "0.02"]
    rid = start(sd, cwd, *command, "--finish", str(after_train))
    announced(sd, rid, step=2)
    out = sd.cli("train", "stop", rid, "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = json.loads(out.stdout)
    step = stopped["snapshot"]["step"]
    assert stopped["state"] == "stopped" and stopped["exit_code"] == 0
    assert list(after_train.iterdir()) == []  # none of the script's code after train() ran
    assert sorted(p.name for p in (Path(stopped["remote_dir"]) / "output").iterdir()) == [f"checkpoint-{step}"]

    status = sd.cli("train", "status", rid).stdout
    assert f"finish    stopped at step {step} of 100000; resume to finish: `obd train resume {rid}`" in status

    refused = sd.cli("train", "outputs", rid, "--checkpoint", "final", "--to", str(short_tmp / "final"))
    assert refused.returncode == 1
    assert f"run {rid} stopped at step {step} of 100000; resume to finish: `obd train resume {rid}`" in refused.stderr
    assert f"`obd train outputs {rid} --checkpoint {step}` copies that" in refused.stderr
    assert not (short_tmp / "final").exists()

    taken = sd.cli("train", "outputs", rid, "--checkpoint", str(step), "--to", str(short_tmp / "snapshot"))
    assert taken.returncode == 0, taken.stderr
    assert (short_tmp / "snapshot" / "model.safetensors").is_file()
    assert f"stopped at step {step} of 100000; resume to finish" in taken.stdout
