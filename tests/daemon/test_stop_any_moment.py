"""A stop at any moment (issue 23): asked while the job is still starting or loading its model, it is
kept, reaches the job once it exists, and is taken at the first step boundary."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")


@pytest.fixture
def sd(make_daemon) -> DaemonProc:
    d = make_daemon(FAST_CONFIG)
    d.start()
    return d


def test_a_stop_sent_a_tenth_of_a_second_after_start_ends_stopped_at_the_first_step(
    sd: DaemonProc, short_tmp: Path
) -> None:
    start = sd.cli(
        "train", "start", "--cwd", str(short_tmp), "--", PY, PLAIN, "--output_dir", "mine", "--max_steps", "50"
    )
    assert start.returncode == 0, start.stderr
    rid = start.stdout.strip()
    time.sleep(0.1)
    assert sd.record(rid)["snapshots"] is False  # transformers is still being imported
    out = sd.cli("train", "stop", rid, "--wait", "--json", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads(out.stdout)
    assert record["state"] == "stopped" and record["snapshot"]["step"] == 1, record["message"]
    assert (Path(record["remote_dir"]) / "output" / "checkpoint-1" / "trainer_state.json").exists()
    notes = [h["reason"] for h in record["history"]]
    assert any("snapshot requested (requested) by `obd train stop`" in n for n in notes), notes


def test_a_stop_through_the_web_view_is_recorded_as_the_web_views(sd: DaemonProc) -> None:
    rid = sd.call("start", command=[PY, "-c", "import time; time.sleep(60)"])["id"]
    sd.wait_state(rid, "running")
    sd.call("stop", id=rid, reason="requested", via="ui")
    notes = [h["reason"] for h in sd.record(rid)["history"]]
    assert any(n.startswith("snapshot requested (requested) by the web view") for n in notes), notes
    sd.call("cancel", id=rid)
