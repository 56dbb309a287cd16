"""Snapshot and stop under the real daemon: proofs, the stop fallback, requests from anyone, resume."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
PY = sys.executable
WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")

STOP_CONFIG = FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "3s"').replace(
    'end_timeout = "30s"', 'end_timeout = "2s"'
)


@pytest.fixture
def sd(make_daemon) -> DaemonProc:
    d = make_daemon(STOP_CONFIG)
    d.start()
    return d


@pytest.fixture
def lora_sd(make_daemon) -> DaemonProc:
    """A daemon with the usual proof timeout, for the real Trainer: its save may take seconds on a loaded machine."""
    d = make_daemon(FAST_CONFIG)
    d.start()
    return d


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def announced(d: DaemonProc, rid: str, step: int = 0) -> dict:
    def check() -> dict | None:
        r = d.record(rid)
        if r["state"] != "running" and r["state"] != "preparing":
            raise AssertionError(f"run ended early: {r['message']}")
        return r if r["snapshots"] and (r["progress"]["step"] or 0) >= step else None

    return wait_for(check, 120, 0.1, f"run {rid} to announce snapshots and reach step {step}")


def test_a_stop_with_no_snapshot_in_time_cancels_the_job(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "ignore")
    announced(sd, rid)
    out = sd.cli("train", "stop", rid, "--wait")
    assert out.returncode == 3, out.stdout + out.stderr  # documented: the stop fell back to a cancel
    record = sd.record(rid)
    assert record["state"] == "cancelled"
    assert record["message"] == "cancelled by the stop fallback: no snapshot within 3 s of the request"
    assert record["snapshot"] is None
    requested = record["stop"]["requested_at"]
    assert record["history"][-1]["time"] - requested >= 3


def test_a_job_that_hangs_after_its_proof_is_cancelled_and_recorded_stopped(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "hang-after")
    announced(sd, rid)
    out = sd.cli("train", "stop", rid, "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(out.stdout)
    assert record["state"] == "stopped"
    assert record["snapshot"]["checkpoint"] == f"output/checkpoint-{record['snapshot']['step']}"
    assert "still ran 2 s after its snapshot" in record["message"]
    assert (Path(record["remote_dir"]) / "cancelled").exists()


@pytest.mark.parametrize(
    "proof, why",
    [
        ('{"checkpoint": "output/checkpoint-STEP/../../../etc", "step": STEP}', "other than"),
        ('{"checkpoint": "/etc/passwd", "step": STEP}', "other than"),
        ('{"checkpoint": "output/checkpoint-999999", "step": STEP}', "other than"),
        ('{"checkpoint": "output/checkpoint-STEP", "step": "STEP"}', "no valid step"),
        ('{"checkpoint": "output/checkpoint-STEP", "step": true}', "no valid step"),
        ("not json at all", "not valid JSON"),
        ('["output/checkpoint-STEP"]', "not a JSON object"),
        ("@huge", "larger than 64 KiB"),
    ],
)
def test_an_invalid_proof_fails_the_run_and_no_path_of_it_is_used(sd: DaemonProc, proof: str, why: str) -> None:
    rid = start(sd, PY, FAKE, f"proof={proof}")
    announced(sd, rid)
    sd.cli("train", "stop", rid)
    record = sd.wait_state(rid, "failed", "stopped", "succeeded")
    assert record["state"] == "failed"
    assert why in record["message"] and "invalid snapshot proof" in record["message"]
    assert record["snapshot"] is None


def test_a_stop_of_a_job_that_never_announces_the_plugin_is_kept_then_ended_by_the_fallback_saying_why(
    sd: DaemonProc,
) -> None:
    rid = start(sd, PY, FAKE, "no-plugin")
    sd.wait_state(rid, "running")
    out = sd.cli("train", "stop", rid)
    assert out.returncode == 0, out.stderr
    assert "not announced" in out.stdout  # the user is told the job will be asked once it can snapshot
    record = sd.wait_state(rid, "cancelled", "stopped", "failed", timeout=30)
    assert record["state"] == "cancelled"
    assert "no snapshot within 3 s of the request (the job never announced obd's snapshot plugin)" in record["message"]


def test_a_request_from_elsewhere_never_gets_a_job_without_the_plugin_cancelled(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "no-plugin")
    record = sd.wait_state(rid, "running")
    (Path(record["remote_dir"]) / "snapshot.request").write_text("cost\n")
    wait_for(lambda: sd.record(rid)["stop"]["requested_at"], 10, what="the request to be seen")
    time.sleep(4.5)  # past proof_timeout (3 s)
    record = sd.record(rid)
    assert record["state"] == "running" and record["stop"]["reason"] == "cost"
    sd.cli("train", "cancel", rid, "--wait")


def test_a_hand_written_request_is_seen_at_once_and_the_fallback_counts_from_then(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "ignore")
    record = announced(sd, rid)
    written = time.time()
    (Path(record["remote_dir"]) / "snapshot.request").write_text("garbage-word")
    seen = wait_for(lambda: sd.record(rid)["stop"]["requested_at"], 10, 0.05, "the request to be seen")
    assert seen - written < 1.0  # a local target sees a hand-written request within a poll
    assert sd.record(rid)["stop"]["reason"] == "requested"  # any unknown word means `requested`
    record = sd.wait_state(rid, "cancelled", timeout=30)
    assert "no snapshot within 3 s" in record["message"]


def test_a_sigkill_between_request_and_proof_keeps_the_fallback_counted_from_the_request(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "ignore")
    announced(sd, rid)
    assert sd.cli("train", "stop", rid).returncode == 0
    requested = sd.record(rid)["stop"]["requested_at"]
    sd.kill()
    time.sleep(1.5)
    sd.start()
    record = sd.wait_state(rid, "cancelled", timeout=30)
    assert record["stop"]["requested_at"] == requested
    cancelled_at = record["history"][-1]["time"]
    assert 3 <= cancelled_at - requested < 3 + 2 + 3  # the timeout, the grace and a few polls


def test_asking_again_only_changes_the_reason(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "ignore")
    record = announced(sd, rid)
    sd.cli("train", "stop", rid, "--reason", "deadline")
    first = sd.record(rid)["stop"]
    sd.cli("train", "stop", rid, "--reason", "disk")
    second = sd.record(rid)["stop"]
    assert second["requested_at"] == first["requested_at"] and second["reason"] == "disk"
    assert (Path(record["remote_dir"]) / "snapshot.request").read_text().strip() == "disk"
    sd.cli("train", "cancel", rid, "--wait")


def test_a_run_dir_file_that_would_block_a_read_never_holds_up_the_follow(sd: DaemonProc) -> None:
    slow = start(sd, PY, FAKE, "ignore")
    record = announced(sd, slow)
    os.mkfifo(Path(record["remote_dir"]) / "snapshot.json")  # a reader that opened it would block
    quick = start(sd, "sh", "-c", "sleep 0.5")
    assert sd.wait_state(quick, "succeeded", timeout=20)["exit_code"] == 0
    assert sd.record(slow)["state"] == "running"
    sd.cli("train", "cancel", slow, "--wait")


# --- with the real tiny LoRA workload ---------------------------------------------------


def test_the_tiny_lora_run_stops_at_a_step_boundary_with_a_proof_and_resumes_to_the_end(lora_sd: DaemonProc) -> None:
    sd = lora_sd
    rid = start(sd, PY, WORKLOAD, "--tiny", "--max_steps", "400", opts=("--name", "lora"))
    announced(sd, rid, step=2)
    status = sd.cli("train", "status", rid).stdout
    assert "step " in status and "/400" in status  # progress from metrics.jsonl
    out = sd.cli("train", "stop", rid, "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(out.stdout)
    snap = record["snapshot"]
    assert record["state"] == "stopped" and snap["reason"] == "requested"
    ckpt = Path(record["remote_dir"]) / snap["checkpoint"]
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        assert (ckpt / name).exists(), name
    assert json.loads((ckpt / "trainer_state.json").read_text())["global_step"] == snap["step"]
    # The job ended at its snapshot: the workload's save_model() after train() never wrote a
    # half-trained adapter beside the checkpoint, and the run's final output is refused.
    assert record["exit_code"] == 0 and not (ckpt.parent / "adapter_model.safetensors").exists()
    refused = sd.cli("train", "outputs", rid, "--checkpoint", "final", "--to", str(sd.root / "final"))
    assert refused.returncode == 1 and f"stopped at step {snap['step']} of 400; resume to finish" in refused.stderr

    resumed = start(sd, PY, WORKLOAD, "--tiny", "--max_steps", str(snap["step"] + 3), opts=("--resume-from", rid))
    final = sd.wait_state(resumed, "succeeded", "failed", "stopped", timeout=180)
    assert final["state"] == "succeeded", final["message"]
    assert final["resumed_from"] == rid
    lines = [json.loads(x) for x in (Path(final["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    begin = lines[0]
    logs = [x for x in lines if x["event"] == "log" and "loss" in x]
    assert begin["start_step"] == snap["step"]
    assert logs[0]["step"] == snap["step"] + 1 and logs[-1]["step"] == snap["step"] + 3


def test_a_run_with_no_snapshot_and_no_complete_checkpoint_cannot_be_resumed(sd: DaemonProc) -> None:
    rid = start(sd, "true")
    sd.wait_state(rid, "succeeded")
    out = sd.cli("train", "start", "--resume-from", rid, "--", "true")
    assert out.returncode == 1 and "no complete checkpoint" in out.stderr


def test_a_sigterm_to_a_job_started_with_snapshot_on_sigterm_becomes_a_preempted_snapshot(lora_sd: DaemonProc) -> None:
    sd = lora_sd
    rid = start(sd, PY, WORKLOAD, "--tiny", "--max_steps", "400", opts=("--snapshot-on-sigterm",))
    record = announced(sd, rid, step=1)
    os.killpg(record["job"]["pid"], signal.SIGTERM)  # what a preempting scheduler does
    record = sd.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=120)
    assert record["state"] == "stopped", record["message"]
    assert record["snapshot"]["reason"] == "preempted"


def test_an_invalid_proof_fails_the_run_even_when_the_job_then_hangs_and_is_cancelled(sd: DaemonProc) -> None:
    rid = start(sd, PY, FAKE, "bad-proof-hang")
    announced(sd, rid)
    out = sd.cli("train", "stop", rid, "--wait")
    assert out.returncode == 4  # ended without a (valid) snapshot
    record = sd.record(rid)
    assert record["state"] == "failed" and "invalid snapshot proof" in record["message"]


def test_a_run_directory_with_absurdly_nested_json_harms_no_other_run(sd: DaemonProc) -> None:
    hostile = start(sd, PY, FAKE, "nested-metrics")
    sd.wait_state(hostile, "running")
    time.sleep(0.5)
    quick = start(sd, "sh", "-c", "sleep 0.5")
    assert sd.wait_state(quick, "succeeded", "failed", timeout=30)["state"] == "succeeded"
    assert "follow_poll_failed" not in sd.log_path.read_text()
    sd.cli("train", "cancel", hostile, "--wait")
    assert sd.record(hostile)["state"] == "cancelled"


def test_on_a_local_target_a_hand_written_request_is_seen_at_once_even_between_slow_polls(make_daemon) -> None:
    d = make_daemon(STOP_CONFIG.replace("poll_interval = 0.2", "poll_interval = 30"))
    d.start()
    rid = start(d, PY, FAKE, "hang-after")
    # After the first poll (at start) no poll comes again for 30 s: the request must wake the follow.
    record = wait_for(lambda: (r := d.record(rid))["remote_dir"] and r, 20, 0.05, "the run's directory")
    metrics = Path(record["remote_dir"]) / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and '"begin"' in metrics.read_text(), 20, 0.05, "the job's begin line")
    written = time.time()
    (Path(record["remote_dir"]) / "snapshot.request").write_text("deadline\n")
    seen = wait_for(lambda: d.record(rid)["stop"]["requested_at"], 10, 0.02, "the request to be seen")
    assert seen - written < 2.0  # inotify, not the 30 s poll
    assert d.record(rid)["stop"]["reason"] == "deadline"
    wait_for(lambda: d.record(rid)["snapshot"], 10, 0.05, "the proof to be seen at once too")
    d.cli("train", "cancel", rid, "--wait")
