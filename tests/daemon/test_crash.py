"""The daemon killed at any moment, and started again: no record lost, no job lost or left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from daemon.service.store import RunStore
from tests.conftest import DaemonProc, wait_for
from trainer_plugin.tools import jobctl


def _all_records_parse(d: DaemonProc) -> dict[str, dict]:
    records, bad = RunStore(d.state_dir).load_all()
    assert bad == [], bad
    return {k: v.model_dump(mode="json") for k, v in records.items()}


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.1, 0.3])
def test_a_sigkill_during_a_start_loses_nothing(daemon: DaemonProc, delay: float) -> None:
    c = daemon.client()
    rid = c.call("start", command=["sh", "-c", "sleep 1; echo done"])["id"]
    time.sleep(delay)
    daemon.kill()
    c.close()
    daemon.start()
    record = daemon.wait_state(rid, "succeeded", "failed", timeout=30)
    if record["state"] == "failed":  # killed before the job was launched: said so, nothing runs
        assert "never started" in record["message"]
        assert not (Path(record["remote_dir"]) / "job.pid").exists()
    else:
        assert record["exit_code"] == 0
    # On disk too: the daemon shows a change as its edit makes it, and its save follows at once
    # (a fresh-clone CI read the disk between the two).
    wait_for(lambda: _all_records_parse(daemon)[rid]["state"] == record["state"], 30, what="the record saved")


def test_a_job_keeps_running_through_a_sigkill_of_the_daemon_and_is_followed_again(daemon: DaemonProc) -> None:
    # The job ends when the test says so (a file), not after a sleep a slow restart could outlast.
    job = 'while [ ! -e "$OBD_RUN_DIR/go" ]; do sleep 0.05; done; echo finished'
    rid = daemon.cli("train", "start", "--", "sh", "-c", job).stdout.strip()
    record = daemon.wait_state(rid, "running")
    handle = record["job"]
    daemon.kill()
    assert jobctl.handle_alive(handle)  # the daemon's death did not touch the job
    daemon.start()
    assert daemon.record(rid)["state"] == "running"
    (Path(record["remote_dir"]) / "go").touch()
    record = daemon.wait_state(rid, "succeeded", timeout=30)
    assert record["exit_code"] == 0


def test_a_job_that_ended_while_the_daemon_was_down_gets_its_final_state(daemon: DaemonProc) -> None:
    # Each job ends when the test says so (a file), and the daemon starts again once both ended:
    # no sleep that a loaded machine could outlast either way.
    wait = 'while [ ! -e "$OBD_RUN_DIR/go" ]; do sleep 0.05; done'
    ok = daemon.cli("train", "start", "--", "sh", "-c", wait).stdout.strip()
    bad = daemon.cli("train", "start", "--", "sh", "-c", f"{wait}; exit 5").stdout.strip()
    records = [daemon.wait_state(rid, "running") for rid in (ok, bad)]
    daemon.kill()
    for record in records:
        (Path(record["remote_dir"]) / "go").touch()
    for record in records:
        wait_for(lambda r=record: not jobctl.handle_alive(r["job"]), 60, what=f"job {record['id']} to end")
    daemon.start()
    assert daemon.wait_state(ok, "succeeded", "failed")["state"] == "succeeded"
    failed = daemon.wait_state(bad, "failed", "succeeded")
    assert failed["state"] == "failed" and failed["exit_code"] == 5


def test_sigterm_stops_the_daemon_cleanly_and_leaves_every_job_running(daemon: DaemonProc) -> None:
    rid = daemon.cli("train", "start", "--", "sleep", "30").stdout.strip()
    record = daemon.wait_state(rid, "running")
    assert daemon.signal(signal.SIGTERM) == 0
    assert not daemon.socket.exists()
    assert jobctl.handle_alive(record["job"])
    daemon.start()
    assert daemon.record(rid)["state"] == "running"
    daemon.cli("train", "cancel", rid, "--wait")


def test_sigkill_during_record_saves_never_leaves_a_half_written_record(daemon: DaemonProc) -> None:
    ids: list[str] = []
    for round_ in range(4):
        c = daemon.client()
        for _ in range(12):
            ids.append(c.call("start", command=["sh", "-c", "echo x"])["id"])
        time.sleep(0.05 * round_)
        daemon.kill()  # while launches, follows and saves are under way
        c.close()
        records = _all_records_parse(daemon)
        assert set(ids) <= set(records)
        daemon.start()
    for rid in ids:
        assert daemon.wait_state(rid, "succeeded", "failed")["state"] in ("succeeded", "failed")
    assert len(_all_records_parse(daemon)) == len(ids)


def test_a_stale_socket_of_a_killed_daemon_is_replaced(daemon: DaemonProc) -> None:
    daemon.kill()
    assert daemon.socket.exists()
    daemon.start()
    assert daemon.call("ping")["runs"] == 0


def test_a_second_daemon_on_the_same_state_dir_is_refused(daemon: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "other").mkdir(exist_ok=True)
    other = DaemonProc(short_tmp / "other", daemon.config_path.read_text())
    other.env["OBD_STATE_DIR"] = str(daemon.state_dir)
    other.start(wait=False)
    assert other.proc.wait(15) != 0
    assert "another daemon" in other.log_path.read_text()


@pytest.mark.parametrize("on_term", ["ignore", "exit"])
def test_a_cancel_cut_short_by_a_sigkill_of_the_daemon_is_finished_after_the_restart(
    daemon: DaemonProc, on_term: str
) -> None:
    trap = "trap '' TERM" if on_term == "ignore" else "trap 'sleep 1; exit 143' TERM"
    rid = daemon.cli("train", "start", "--", "bash", "-c", f"{trap}; while true; do sleep 0.1; done").stdout.strip()
    record = daemon.wait_state(rid, "running")
    daemon.cli("train", "cancel", rid)
    time.sleep(0.3)  # within the 2 s grace: the TERM was sent, the KILL not yet
    daemon.kill()
    daemon.start()
    record = daemon.wait_state(rid, "cancelled", "failed", timeout=30)
    assert record["state"] == "cancelled" and "by the user" in record["message"]
    assert not jobctl.group_alive(record["job"])


def test_a_job_whose_wrapper_was_killed_is_still_running_and_cancel_reaches_its_processes(daemon: DaemonProc) -> None:
    import os

    rid = daemon.cli("train", "start", "--", "bash", "-c", "sleep 600; true").stdout.strip()
    record = daemon.wait_state(rid, "running")
    wait_for(lambda: len(list(Path(record["remote_dir"]).glob("job.log"))) == 1, 10)
    time.sleep(0.5)
    os.kill(record["job"]["pid"], signal.SIGKILL)  # the wrapper only; bash and sleep live on
    time.sleep(1.0)
    assert daemon.record(rid)["state"] == "running"
    assert jobctl.group_alive(record["job"])
    assert daemon.cli("train", "cancel", rid, "--wait").returncode == 0
    assert daemon.record(rid)["state"] == "cancelled"
    assert not jobctl.group_alive(record["job"])


def test_what_a_sigkill_leaves_of_a_start_and_of_atomic_writes_is_cleared_at_the_next_start(
    daemon: DaemonProc,
) -> None:
    rid = daemon.cli("train", "start", "--", "sh", "-c", "exit 0").stdout.strip()
    daemon.wait_state(rid, "succeeded")
    daemon.kill()
    runs = daemon.state_dir / "runs"
    # As a SIGKILL leaves them: a start killed after its launch.json was written and before its
    # record was (its `train start` never answered), one killed amid that first write, and
    # temporary files of atomic writes killed between write and rename, beside a good record.
    cut_short = runs / "20260101-000000-aaaaaa"
    cut_short.mkdir(mode=0o700)
    (cut_short / "launch.json").write_text('{"request": {}, "run_as": null}')
    amid = runs / "20260101-000000-bbbbbb"
    amid.mkdir(mode=0o700)
    (amid / ".launch.json.tmp.123.00aa11bb22cc").write_text('{"requ')
    leftovers = [runs / rid / f".{name}.tmp.123.00aa11bb22cc" for name in ("run.json", "launch.json", "notify.json")]
    for path in leftovers:
        path.write_text("half")
    # Someone's own file in a record directory with no record: left for a person to look at.
    kept = runs / "20260101-000000-cccccc"
    kept.mkdir(mode=0o700)
    (kept / "notes.txt").write_text("mine")
    a_minute_ago = time.time() - 60  # the crash came before this start
    for path in [*leftovers, amid / ".launch.json.tmp.123.00aa11bb22cc", cut_short / "launch.json"]:
        os.utime(path, (a_minute_ago, a_minute_ago))
    daemon.start()
    listed = {r["id"]: r["state"] for r in daemon.call("list", all=True)}
    assert listed[rid] == "succeeded"
    assert listed.get(cut_short.name) is None and listed.get(amid.name) is None
    assert listed[kept.name] == "unreadable" and (kept / "notes.txt").exists()
    assert not cut_short.exists() and not amid.exists()
    assert not any(path.exists() for path in leftovers)
    log = daemon.log_path.read_text()
    assert "unrecorded_start_removed" in log and cut_short.name in log and "leftovers_removed" in log
    daemon.kill()  # and a second start finds nothing more to clear or to list unreadable
    daemon.start()
    assert {r["id"]: r["state"] for r in daemon.call("list", all=True)} == listed
