"""Resume anything resumable, and automatic recovery with --retry (issue 13), with the real tiny
Trainer: a run killed mid-training comes back from its newest complete checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
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


def assert_continues(first: dict[str, Any], second: dict[str, Any], max_steps: int = MAX_STEPS) -> int:
    """The second run resumed from the first's newest complete checkpoint and trained every step
    after it exactly once, up to `max_steps`; returns the checkpoint's step."""
    assert second["resumed_from"] == first["id"]
    step = int(second["resume_checkpoint"].rsplit("-", 1)[1])
    assert "complete" in second["resume_reason"] or "proof" in second["resume_reason"]
    lines = metrics(second)
    begin = next(line for line in lines if line["event"] == "begin")
    assert begin.get("start_step") == step
    steps = [line["step"] for line in lines if line["event"] == "log" and line.get("loss") is not None]
    assert steps == list(range(step + 1, max_steps + 1)), steps
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


# The SIGTERM must come while the job trains: the tiny workload runs some 75 steps a second, and
# the plugin writes its step logs at most a second apart, so a run of MAX_STEPS steps could end
# before `progress` showed step 3 (it failed so 3 times in 3). A longer run, and a signal sent
# as soon as the job's first checkpoint is on disk (seen in the run directory, not in the
# record), keep seconds of training after the signal on any machine.
SIGTERM_STEPS = 300


def test_a_sigterm_preemption_is_resumed_from_its_preempted_snapshot_under_retry(rd: DaemonProc) -> None:
    rid = start(rd, "--retry", "1", "--snapshot-on-sigterm", steps=SIGTERM_STEPS)

    def training() -> dict[str, Any] | None:
        r = rd.record(rid)
        assert r["state"] in ("preparing", "running"), r["message"]
        state = Path(r["remote_dir"] or "/nonexistent") / "output" / "checkpoint-5" / "trainer_state.json"
        return r if r["job"] and state.exists() else None

    record = wait_for(training, 120, 0.02, "the run's first checkpoint")
    os.killpg(record["job"]["pid"], signal.SIGTERM)  # what a preempting scheduler does
    first = rd.wait_state(rid, "stopped", "failed", timeout=120)
    assert first["state"] == "stopped" and first["snapshot"]["reason"] == "preempted", first["message"]
    assert first["snapshot"]["step"] < SIGTERM_STEPS
    second_id = wait_for(lambda: rd.record(rid)["retried_by"], 30, 0.1, "the next attempt")
    second = rd.wait_state(second_id, "succeeded", "failed", timeout=180)
    assert second["state"] == "succeeded", second["message"]
    assert "proof" in second["resume_reason"]
    assert assert_continues(first, second, SIGTERM_STEPS) == first["snapshot"]["step"]


def test_a_cancelled_run_is_never_retried(rd: DaemonProc) -> None:
    rid = start(rd, "--retry", "3")
    wait_for(lambda: rd.record(rid)["state"] == "running", 60, 0.1, "the run")
    rd.call("cancel", id=rid)
    rd.wait_state(rid, "cancelled")
    assert rd.record(rid)["retried_by"] is None


CHAIN_JOB = str(Path(__file__).with_name("fake_chain_job.py"))


def test_an_attempt_that_died_before_saving_does_not_send_the_chain_back_to_step_zero(
    rd: DaemonProc, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    # Attempt 1 saves checkpoint-10, half-writes checkpoint-12 and fails; attempt 2 fails before
    # saving anything; attempt 3 must start from attempt 1's checkpoint-10, not from the start.
    plans = ["save=5,save=10,half=12,exit=1", "exit=1", "exit=0"]
    out = rd.cli("train", "start", "--name", "chain", "--retry", "2", "--", PY, CHAIN_JOB, str(ledger), *plans)
    assert out.returncode == 0, out.stderr
    first_id = out.stdout.strip()
    second_id = wait_for(lambda: rd.record(first_id)["retried_by"], 30, 0.1, "attempt 2")
    third_id = wait_for(lambda: rd.record(second_id)["retried_by"], 30, 0.1, "attempt 3")
    third = rd.wait_state(third_id, "succeeded", "failed", timeout=60)
    assert third["state"] == "succeeded", third["message"]
    first = rd.record(first_id)
    checkpoint = f"{first['remote_dir']}/output/checkpoint-10"
    assert third["resumed_from"] == first_id and third["resume_checkpoint"] == checkpoint
    assert "complete" in third["resume_reason"] and f"of attempt 1 ({first_id})" in third["resume_reason"]
    starts = [line.split() for line in ledger.read_text().splitlines()]
    assert starts == [
        ["start", first_id, "-"],
        ["start", second_id, checkpoint],  # attempt 2 resumed from it too, and died before saving
        ["start", third_id, checkpoint],
    ]
    assert f"from checkpoint-10 of {first_id}" in rd.record(second_id)["history"][-1]["reason"]
    # The name and `last` reach the chain's newest attempt; the chain is in every attempt's status.
    assert rd.record("chain")["id"] == third_id and rd.record("last")["id"] == third_id
    assert [a["id"] for a in rd.record(first_id)["chain_runs"]] == [first_id, second_id, third_id]


def test_cancelling_the_printed_id_while_a_retry_waits_out_its_backoff_ends_the_chain(
    make_daemon, tmp_path: Path
) -> None:
    d = make_daemon(FAST_CONFIG + '\n[retry]\nbackoff = "2s"\n')
    d.start()
    ledger = tmp_path / "ledger"
    out = d.cli("train", "start", "--retry", "3", "--", PY, CHAIN_JOB, str(ledger), "exit=1")
    assert out.returncode == 0, out.stderr
    first_id = out.stdout.strip()
    second_id = wait_for(lambda: d.record(first_id)["retried_by"], 30, 0.1, "attempt 2")
    assert d.record(second_id)["state"] == "queued" and d.record(second_id)["not_before"]
    cancelled = d.cli("train", "cancel", first_id)
    assert cancelled.returncode == 0, cancelled.stderr
    time.sleep(3 * 2)  # three times the backoff: the attempt would have started by now
    second = d.record(second_id)
    assert second["state"] == "cancelled" and second["job"] is None, second["message"]
    assert len(ledger.read_text().splitlines()) == 1  # only attempt 1 ever ran
    assert d.record(second_id)["retried_by"] is None
    assert [a["id"] for a in d.record(first_id)["chain_runs"]] == [first_id, second_id]


def test_logs_follow_of_the_printed_id_follows_each_next_attempt_to_the_chains_end(
    rd: DaemonProc, tmp_path: Path
) -> None:
    marker = tmp_path / "marker"
    script = f"if [ -e {marker} ]; then echo second-attempt-line; exit 0; fi; touch {marker}; echo first-attempt-line; exit 3"
    out = rd.cli("train", "start", "--retry", "1", "--", "sh", "-c", script)
    assert out.returncode == 0, out.stderr
    first = out.stdout.strip()
    follow = rd.cli("train", "logs", first, "--follow")
    assert follow.returncode == 0, follow.stderr  # the chain's end: its second attempt succeeded
    assert follow.stdout.splitlines() == ["first-attempt-line", "second-attempt-line"]
    second = rd.record(first)["retried_by"]
    assert f"following its next attempt, {second}" in follow.stderr
    # Without --follow, a log is its own attempt's.
    assert rd.cli("train", "logs", first).stdout.splitlines() == ["first-attempt-line"]
