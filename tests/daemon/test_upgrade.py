"""An upgrade as users make one: runs started by an earlier obd are followed, stopped and finished by this one.

The earlier obd is the tree of commit `e14d25d` (taken with `git archive`, so nothing in this
checkout changes), run from its own directory. Its daemon starts jobs and writes records; it is
stopped with SIGTERM, as `systemctl restart obd` does; this version's daemon then starts on the
same state directory with the jobs still running (one ends while no daemon runs).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProc, wait_for

PREVIOUS = "e14d25d"  # the last version that landed before this one's command line
PY = sys.executable
OBD = Path(sys.executable).with_name("obd")
# A custom loop on the plugin its run got (the earlier version's, copied into the run's plugin/).
SNAPSHOT_LOOP = """
import os, time
from trainer_plugin import begin, checkpoint_dir, end, log_metrics, snapshot_requested, write_proof
begin(max_steps=100000)
for step in range(1, 100001):
    time.sleep(0.1)
    log_metrics(step, loss=1.0 / step)
    reason = snapshot_requested()
    if reason:
        path = checkpoint_dir(step)
        os.makedirs(path)
        with open(os.path.join(path, "weights.txt"), "w") as f:
            f.write(str(step))
        write_proof(step, path, reason=reason)
        break
end(step)
"""


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The earlier version's tree, from git (nothing in this checkout is touched)."""
    archive = subprocess.run(["git", "archive", PREVIOUS], cwd=REPO, capture_output=True, timeout=120)
    if archive.returncode != 0:
        pytest.skip(f"commit {PREVIOUS} is not in this clone: {archive.stderr.decode()[-200:]}")
    root = tmp_path_factory.mktemp("previous")
    with tarfile.open(fileobj=BytesIO(archive.stdout)) as tar:
        tar.extractall(root, filter="data")
    yield root


def _previous_cli(tree: Path, d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**d.env, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [PY, "-m", "daemon.cli", *args], env=env, cwd=tree, capture_output=True, text=True, timeout=60
    )


def _start_previous_daemon(tree: Path, d: DaemonProc) -> None:
    env = {**d.env, "PYTHONPATH": str(tree)}
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen([PY, "-m", "daemon.cli", "daemon"], env=env, cwd=tree, stdout=log, stderr=log)
    wait_for(d.ready, 30, 0.1, "the earlier version's daemon")


def _obd(d: DaemonProc, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(OBD), *args], env=d.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def test_runs_started_by_the_previous_version_are_followed_stopped_and_finished_by_this_one(
    previous: Path, make_daemon, short_tmp: Path
) -> None:
    d = make_daemon()
    _start_previous_daemon(previous, d)
    loop = short_tmp / "loop.py"
    loop.write_text(SNAPSHOT_LOOP)

    def start(*command: str, name: str) -> str:
        out = _previous_cli(previous, d, "train", "start", "--name", name, "--", *command)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    finished = start("sh", "-c", "echo finished early", name="finished")
    failed = start("sh", "-c", "echo broken; exit 3", name="failed")
    d.wait_state(finished, "succeeded")
    d.wait_state(failed, "failed")
    assert "OWNER" not in _previous_cli(previous, d, "train", "list").stdout  # the earlier code, not this one
    snapshot = start(PY, str(loop), name="snapshot")
    logs = start("sh", "-c", "for i in $(seq 1 40); do echo line $i; sleep 0.2; done", name="logs")
    while_down = start("sh", "-c", "sleep 2; echo ended while no daemon ran", name="while-down")
    wait_for(lambda: d.record(snapshot)["snapshots"] and d.record(snapshot)["progress"]["step"], 60, 0.1, "a step")
    down_dir = Path(d.wait_state(while_down, "running")["remote_dir"])

    d.stop()  # SIGTERM, as `systemctl restart obd`: the earlier daemon goes, its jobs run on
    wait_for((down_dir / "exit_code").exists, 30, 0.1, "the job that ends while no daemon runs")
    d.start()  # this version, on the same state directory

    listed = {r["id"]: r for r in json.loads(_obd(d, "train", "list", "--all", "--json").stdout)}
    assert set(listed) == {finished, failed, snapshot, logs, while_down}
    assert listed[finished]["state"] == "succeeded" and listed[failed]["state"] == "failed"
    assert listed[snapshot]["state"] == "running"
    ended = d.wait_state(while_down, "succeeded", "failed")
    assert ended["state"] == "succeeded" and ended["exit_code"] == 0  # its end, recorded after the fact
    history = json.loads(_obd(d, "train", "status", "finished", "--json").stdout)["history"]
    assert [h["state"] for h in history] == ["preparing", "running", "succeeded"]  # kept as it was

    follow = _obd(d, "train", "logs", logs, "--follow")
    assert follow.returncode == 0, follow.stderr
    assert follow.stdout.splitlines() == [f"line {i}" for i in range(1, 41)]

    stop = _obd(d, "train", "stop", "snapshot", "--wait", "--json")
    assert stop.returncode == 0, stop.stderr
    record = json.loads(stop.stdout)
    assert (
        record["state"] == "stopped"
        and record["snapshot"]["checkpoint"] == f"output/checkpoint-{record['snapshot']['step']}"
    )
    assert (Path(record["remote_dir"]) / record["snapshot"]["checkpoint"] / "weights.txt").exists()

    # A run of the earlier version resumes under this one, with this version's plugin.
    resumed = _obd(d, "train", "resume", "snapshot")
    assert resumed.returncode == 0, resumed.stderr
    rid = resumed.stdout.strip()
    wait_for(lambda: d.record(rid)["snapshots"], 60, 0.1, "the resumed run's plugin")
    assert _obd(d, "train", "cancel", rid, "--wait").returncode == 0
    assert d.record(rid)["resumed_from"] == snapshot
