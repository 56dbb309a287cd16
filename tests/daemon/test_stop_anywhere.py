"""A stop honoured wherever the job's time goes, through the real daemon and a real Trainer (issue 32).

`obd train stop --wait` during an evaluation returns with a proven snapshot of the last completed
step, not after the evaluation; `status` said the run was evaluating; the resumed run trains every
later step bitwise as an uninterrupted run and performs the interrupted evaluation first, so the
chain's evaluation curve has every point. A stop after train() returned ends the job at once,
saying that training had finished and which code it cut short.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.trainer_plugin.conftest import torchrun as launcher

pytest.importorskip("transformers")

PY = sys.executable
SCRIPT = str(REPO / "tests" / "trainer_plugin" / "scripts" / "phases_trainer.py")
BASE = ["--max_steps", "12", "--accumulation", "4", "--eval_steps", "5"]


def start(d: DaemonProc, cwd: Path, *args: str) -> str:
    out = d.cli("train", "start", "--cwd", str(cwd), "--", PY, SCRIPT, *BASE, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def lines(record: dict) -> list[dict[str, Any]]:
    path = Path(record["remote_dir"]) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def steps(record: dict) -> dict[int, tuple[float, float]]:
    return {x["step"]: (x["loss"], x["grad_norm"]) for x in lines(record) if x["event"] == "log" and "loss" in x}


def evaluations(*records: dict) -> list[tuple[int, float]]:
    return [
        (x["step"], x["eval_loss"]) for r in records for x in lines(r) if x["event"] == "metrics" and "eval_loss" in x
    ]


def job_log(d: DaemonProc, rid: str) -> str:
    return d.cli("train", "logs", rid).stdout


def test_stop_wait_during_an_evaluation_returns_with_the_last_step_s_snapshot_and_the_resume_is_exact(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon()
    d.start()
    whole = d.wait_state(start(d, short_tmp), "succeeded", "failed", timeout=240)
    assert whole["state"] == "succeeded", whole["message"]

    slow = short_tmp / "slow-eval"
    slow.write_text("")  # every evaluation sample takes 0.3 s: the evaluation at step 5 takes 12 s and more
    rid = start(d, short_tmp, "--slow-eval", str(slow))
    wait_for(lambda: "slow evaluation began" in job_log(d, rid), 240, 0.2, "the slow evaluation")
    evaluating = wait_for(
        lambda: (r := d.record(rid))["progress"].get("phase") == "evaluating" and r, 60, 0.1, "status: evaluating"
    )
    assert evaluating["progress"]["step"] == 5
    shown = d.cli("train", "status", rid).stdout
    assert "evaluating" in shown and "stop      ~" in shown  # and what a stop costs now
    assert evaluating["progress"]["stop_seconds"] is not None

    out = d.cli("train", "stop", rid, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = d.record(rid)
    assert stopped["state"] == "stopped" and stopped["snapshot"]["step"] == 5, stopped["message"]
    assert "the stop came during evaluating" in job_log(d, rid)
    # It did not wait for the evaluation: the job's log never reached the evaluation's end.
    assert not any(x["event"] == "metrics" and "eval_loss" in x for x in lines(stopped))

    slow.unlink()
    resumed = d.cli("train", "resume", rid)
    assert resumed.returncode == 0, resumed.stderr
    back = d.wait_state(resumed.stdout.strip(), "succeeded", "failed", timeout=240)
    assert back["state"] == "succeeded", back["message"]
    after = steps(back)
    assert min(after) == 6 and after == {s: steps(whole)[s] for s in after}  # bitwise
    assert evaluations(stopped, back) == evaluations(whole)  # every point of the curve, once


def test_a_stop_after_train_returned_ends_the_job_at_once_saying_training_had_finished(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "2h"'))  # never waited for
    d.start()
    rid = start(d, short_tmp, "--max_steps", "3", "--after-train", "600")
    wait_for(lambda: "after-train code began" in job_log(d, rid), 240, 0.2, "the script's code after train()")
    wait_for(lambda: d.record(rid)["progress"].get("phase") == "after_train", 60, 0.1, "status: after training")
    out = d.cli("train", "stop", rid, "--wait", timeout=120)
    assert out.returncode == 4, out.stdout + out.stderr  # ended without a snapshot: its training had finished
    record = d.record(rid)
    assert record["state"] == "cancelled" and record["snapshot"] is None
    assert record["message"].startswith("training had finished at step 3 of 3"), record["message"]
    assert "phases_trainer.py:" in record["message"]
    assert "the script ended" not in job_log(d, rid)


@pytest.mark.slow  # three torchrun jobs (~2.5 min); the same on two ranks without the daemon: tests/trainer_plugin
def test_a_two_rank_job_stopped_while_one_rank_evaluates_and_the_other_waits_stops_both_at_one_step(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon()
    d.start()
    torchrun = [*launcher(short_tmp), SCRIPT, *BASE]

    def start_ranks(*args: str) -> str:
        out = d.cli("train", "start", "--cwd", str(short_tmp), "--", *torchrun, *args)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    whole = d.wait_state(start_ranks(), "succeeded", "failed", timeout=300)
    assert whole["state"] == "succeeded", whole["message"]
    slow = short_tmp / "slow-eval"
    slow.write_text("")
    # Rank 0 takes 0.6 s an evaluation batch; rank 1 waits for it in each batch's gather.
    rid = start_ranks("--slow-eval", str(slow), "--slow-rank", "0")
    wait_for(lambda: "slow evaluation began" in job_log(d, rid), 300, 0.2, "the slow evaluation")
    out = d.cli("train", "stop", rid, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = d.record(rid)
    assert stopped["state"] == "stopped" and stopped["snapshot"]["step"] == 5, stopped["message"]
    log = job_log(d, rid)
    assert log.count("the stop came during evaluating; the snapshot is the state at the end of step 5") == 2
    assert log.count("obd: snapshot at step") == 1  # one proof, by rank 0

    slow.unlink()
    resumed = d.cli("train", "resume", rid)
    assert resumed.returncode == 0, resumed.stderr
    back = d.wait_state(resumed.stdout.strip(), "succeeded", "failed", timeout=300)
    assert back["state"] == "succeeded", back["message"]
    after = steps(back)
    assert min(after) == 6 and after == {s: steps(whole)[s] for s in after}  # bitwise, on two ranks
    assert evaluations(stopped, back) == evaluations(whole)
