"""What a careless user or an attacker can do to the daemon, and what it must do about it (issue 11)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import FAST_CONFIG, DaemonProc, wait_for

FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
PY = __import__("sys").executable
SLOW_POLL = FAST_CONFIG.replace("poll_interval = 0.2", "poll_interval = 30")


def begun(d: DaemonProc, rid: str) -> bool:
    metrics = d.state_dir / "jobs" / rid / "metrics.jsonl"
    return metrics.exists() and b'"begin"' in metrics.read_bytes()


def test_a_stop_the_moment_the_job_announces_the_plugin_is_taken(make_daemon) -> None:
    d = make_daemon(SLOW_POLL)  # the follow would not read metrics.jsonl for 30 s
    d.start()
    proof = '{"checkpoint": "output/checkpoint-STEP", "step": STEP, "reason": "requested"}'
    rid = d.call("start", command=[PY, FAKE, "proof=" + proof])["id"]
    wait_for(lambda: begun(d, rid), 30, 0.02, "the begin line")
    out = d.cli("train", "stop", rid)
    assert out.returncode == 0, out.stderr
    assert (d.state_dir / "jobs" / rid / "snapshot.request").read_text().strip() == "requested"
    record = d.wait_state(rid, "stopped", timeout=60)
    assert record["snapshot"]["checkpoint"].startswith("output/checkpoint-")


def test_a_stop_of_a_job_that_never_announced_the_plugin_is_still_refused(make_daemon) -> None:
    d = make_daemon(SLOW_POLL)
    d.start()
    rid = d.call("start", command=[PY, FAKE, "no-plugin"])["id"]
    wait_for(lambda: (d.state_dir / "jobs" / rid / "job.log").exists(), 30, 0.05, "the job")
    time.sleep(0.5)
    out = d.cli("train", "stop", rid)
    assert out.returncode == 1 and "train cancel" in out.stderr, out.stderr
    assert not (d.state_dir / "jobs" / rid / "snapshot.request").exists()
    d.call("cancel", id=rid)


def test_every_final_state_is_logged_once_as_run_finished(daemon: DaemonProc) -> None:
    ok = daemon.call("start", command=["true"])["id"]
    bad = daemon.call("start", command=["false"])["id"]
    cancelled = daemon.call("start", command=["sleep", "30"])["id"]
    daemon.wait_state(cancelled, "running")
    daemon.call("cancel", id=cancelled)
    missing = daemon.call("start", command=["/no/such/program"])["id"]
    for rid in (ok, bad, cancelled, missing):
        daemon.wait_state(rid, "succeeded", "failed", "cancelled", timeout=30)
    lines = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
    finished = [line["run_id"] for line in lines if line.get("event") == "run_finished"]
    for rid in (ok, bad, cancelled, missing):
        assert finished.count(rid) == 1, (rid, finished)
