"""Resume anything resumable, and automatic recovery with --retry (issue 13), with the real tiny
Trainer: a run killed mid-training comes back from its newest complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")
CONFIG = FAST_CONFIG + '\n[retry]\nbackoff = "0.5s"\n'
MAX_STEPS = 30


@pytest.fixture
def rd(make_daemon) -> DaemonProc:
    d = make_daemon(CONFIG)
    d.start()
    return d


def start(d: DaemonProc, *opts: str, steps: int = MAX_STEPS) -> str:
    command = [PY, WORKLOAD, "--tiny", "--max_steps", str(steps), "--save_steps", "5", "--output_dir", "out"]
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def metrics(record: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(record["remote_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kill_after_a_checkpoint(d: DaemonProc, rid: str, checkpoint: int = 10) -> None:
    def ready() -> dict[str, Any] | None:
        r = d.record(rid)
        assert r["state"] in ("queued", "preparing", "running"), r["message"]
        state = Path(r["remote_dir"] or "/nonexistent") / "output" / f"checkpoint-{checkpoint}" / "trainer_state.json"
        return r if r["job"] and state.exists() else None

    record = wait_for(ready, 120, 0.05, f"checkpoint-{checkpoint} of {rid}")
    os.killpg(record["job"]["pid"], signal.SIGKILL)  # the whole job, its wrapper too: a lost node


def assert_continues(first: dict[str, Any], second: dict[str, Any]) -> int:
    """The second run resumed from the first's newest complete checkpoint and trained every step
    after it exactly once, up to MAX_STEPS; returns the checkpoint's step."""
    assert second["resumed_from"] == first["id"]
    step = int(second["resume_checkpoint"].rsplit("-", 1)[1])
    assert "complete" in second["resume_reason"] or "proof" in second["resume_reason"]
    lines = metrics(second)
    begin = next(line for line in lines if line["event"] == "begin")
    assert begin.get("start_step") == step
    steps = [line["step"] for line in lines if line["event"] == "log" and line.get("loss") is not None]
    assert steps == list(range(step + 1, MAX_STEPS + 1)), steps
    return step


def test_a_run_killed_mid_training_comes_back_on_its_own_from_its_checkpoint(rd: DaemonProc) -> None:
    rid = start(rd, "--retry", "2")
    kill_after_a_checkpoint(rd, rid)
    first = rd.wait_state(rid, "failed", timeout=60)
    second_id = wait_for(lambda: rd.record(rid)["retried_by"], 30, 0.1, "the next attempt")
    second = rd.wait_state(second_id, "succeeded", "failed", timeout=180)
    assert second["state"] == "succeeded", second["message"]
    assert second["attempt"] == 2 and second["chain"] == rid
    assert second["progress"]["step"] == MAX_STEPS
    step = assert_continues(first, second)
    assert step >= 10
    status = rd.record(second_id)
    assert [a["attempt"] for a in status["chain_runs"]] == [1, 2]
    assert "attempt 2 of 3" in rd.cli("train", "status", second_id).stdout
    listed = [r["id"] for r in json.loads(rd.cli("train", "list", "--json").stdout)]
    assert second_id in listed and rid not in listed  # the chain shows its latest attempt


def test_resume_by_hand_continues_a_failed_run_from_its_newest_complete_checkpoint(rd: DaemonProc) -> None:
    rid = start(rd)
    kill_after_a_checkpoint(rd, rid)
    first = rd.wait_state(rid, "failed", timeout=60)
    assert first["retried_by"] is None  # no --retry: it stays ended
    # A half-written checkpoint after the last good one is not trusted.
    broken = Path(first["remote_dir"]) / "output" / "checkpoint-99"
    broken.mkdir()
    (broken / "adapter_model.safetensors").write_bytes(b"half")
    out = rd.cli("train", "resume", rid)
    assert out.returncode == 0, out.stderr
    second = rd.wait_state(out.stdout.strip(), "succeeded", "failed", timeout=180)
    assert second["state"] == "succeeded", second["message"]
    assert not second["resume_checkpoint"].endswith("checkpoint-99")
    assert_continues(first, second)
    assert second["command"] == first["command"] and second["target"] == first["target"]


def test_a_sigterm_preemption_is_resumed_from_its_preempted_snapshot_under_retry(rd: DaemonProc) -> None:
    rid = start(rd, "--retry", "1", "--snapshot-on-sigterm")

    def announced() -> dict[str, Any] | None:
        r = rd.record(rid)
        return r if r["snapshots"] and (r["progress"]["step"] or 0) >= 3 else None

    record = wait_for(announced, 120, 0.05, "the run to train a few steps")
    os.killpg(record["job"]["pid"], signal.SIGTERM)  # what a preempting scheduler does
    first = rd.wait_state(rid, "stopped", "failed", timeout=120)
    assert first["state"] == "stopped" and first["snapshot"]["reason"] == "preempted", first["message"]
    second_id = wait_for(lambda: rd.record(rid)["retried_by"], 30, 0.1, "the next attempt")
    second = rd.wait_state(second_id, "succeeded", "failed", timeout=180)
    assert second["state"] == "succeeded", second["message"]
    assert "proof" in second["resume_reason"]
    assert assert_continues(first, second) == first["snapshot"]["step"]


def test_a_cancelled_run_is_never_retried(rd: DaemonProc) -> None:
    rid = start(rd, "--retry", "3")
    wait_for(lambda: rd.record(rid)["state"] == "running", 60, 0.1, "the run")
    rd.call("cancel", id=rid)
    rd.wait_state(rid, "cancelled")
    assert rd.record(rid)["retried_by"] is None
