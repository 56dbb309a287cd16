"""`obd train move RUN --to T` (issue 36 item 2), through the real daemon and a real sshd: a running
Trainer run snapshotted here, its checkpoint carried to an SSH host (sha256 verified on arrival)
and continued there as one chain, bitwise; a carry that fails leaves the run stopped and
resumable here, and both runs' histories say why; a daemon killed in the middle of a move
completes it when it comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import DaemonProc, wait_for
from tests.daemon.test_resume_elsewhere import hashes, notes, resume, sshd, start, steps, trainer, two_places  # noqa: F401 - the fixtures

pytest.importorskip("transformers")


def at_step(d: DaemonProc, rid: str, step: int) -> None:
    wait_for(lambda: (d.record(rid)["progress"].get("step") or 0) >= step, 180, 0.1, f"step {step} of {rid}")


def test_a_running_run_moved_to_an_ssh_host_continues_there_bitwise_as_one_chain(
    two_places: DaemonProc,  # noqa: F811 - the fixture
    short_tmp: Path,
) -> None:
    d = two_places
    project = short_tmp / "project"
    project.mkdir()
    whole = d.wait_state(start(d, project), "succeeded", "failed", timeout=300)
    assert whole["state"] == "succeeded", whole["message"]
    reference = steps(whole)

    rid = start(d, project, "--hold-at", "4")  # trains on past step 4 only once a snapshot is asked
    at_step(d, rid, 4)
    out = d.cli("train", "move", rid, "--to", "box", "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "snapshot asked" in out.stderr  # the progress line, one per change off a terminal

    source = d.record(rid)
    assert source["state"] == "stopped" and source["snapshot"]["step"] == 5, source["message"]
    move = source["move"]
    assert move["state"] == "done" and move["to"] == "box", move
    assert f"moved to target box: run {move['run']} logged step" in notes(source)
    assert (Path(source["remote_dir"]) / "output" / "checkpoint-5").is_dir()  # nothing deleted here

    new = d.record(move["run"])
    assert new["target"] == "box" and new["resumed_from"] == rid
    carried = new["progress"]
    assert carried["carry_total"] > 0 and carried["carry_bytes"] == carried["carry_total"]
    assert "of its checkpoint arrived (100%)" in d.cli("train", "status", new["id"]).stdout
    said = notes(new)
    assert f"checkpoint-5 of {rid} carried from target local to box" in said and "sha256 verified" in said
    assert f"moved from run {rid} of target local" in said

    new = d.wait_state(new["id"], "succeeded", "failed", timeout=300)
    assert new["state"] == "succeeded", new["message"]
    there = steps(new)
    assert min(there) == 6 and max(there) == 12  # none twice, none skipped
    assert there == {s: reference[s] for s in there}  # bitwise: losses and grad norms
    assert new["trackers"] == source["trackers"]  # one chain: the tracker run continued


def test_a_move_whose_carry_fails_leaves_the_run_stopped_and_resumable_where_it_was(
    two_places: DaemonProc,  # noqa: F811 - the fixture
    short_tmp: Path,
) -> None:
    d = two_places
    project = short_tmp / "project"
    project.mkdir()
    rid = start(d, project, "--hold-at", "2", "--max_steps", "4")
    at_step(d, rid, 2)
    out = d.cli("train", "move", rid, "--to", "flaky", "--wait", timeout=300)
    assert out.returncode == 6, out.stdout + out.stderr  # the snapshot came; the carry failed
    assert f"the move of {rid} to target flaky failed" in out.stderr and "did not arrive whole" in out.stderr

    source = d.record(rid)
    assert source["state"] == "stopped" and source["snapshot"]["step"] == 3
    move = source["move"]
    assert move["state"] == "failed" and "sha256 differs" in move["why"], move
    said = notes(source)
    assert "move to target flaky failed" in said and "nothing deleted" in said
    assert f"`obd train resume {rid}` continues it there" in said  # the next command
    failed = d.record(move["run"])
    assert failed["state"] == "failed" and failed.get("job") is None  # refused before its job started
    assert f"the move of run {rid} failed here" in notes(failed)

    checkpoint = Path(source["remote_dir"]) / "output" / "checkpoint-3"
    before = hashes(checkpoint)
    again = d.wait_state(resume(d, rid, "--", *trainer("--max_steps", "4")), "succeeded", "failed", timeout=300)
    assert again["state"] == "succeeded", again["message"]
    assert again["target"] == "local" and min(steps(again)) == 4
    assert hashes(checkpoint) == before


def test_a_move_cut_short_by_a_daemon_restart_is_completed_when_it_comes_back(
    two_places: DaemonProc,  # noqa: F811 - the fixture
    short_tmp: Path,
) -> None:
    d = two_places
    project = short_tmp / "project"
    project.mkdir()
    rid = start(d, project, "--hold-at", "2", "--max_steps", "4")
    at_step(d, rid, 2)
    out = d.cli("train", "move", rid, "--to", "box")
    assert out.returncode == 0, out.stderr
    assert d.record(rid)["move"]["state"] == "snapshot"
    d.kill()  # the job snapshots and ends while no daemon runs
    d.start()

    def done() -> dict | None:
        record = d.record(rid)
        return record if record["move"]["state"] in ("done", "failed") else None

    source = wait_for(done, 300, 0.2, f"the move of {rid} after the restart")
    assert source["move"]["state"] == "done", source["move"]
    assert source["state"] == "stopped" and source["snapshot"]["step"] == 3
    new = d.wait_state(source["move"]["run"], "succeeded", "failed", timeout=300)
    assert new["state"] == "succeeded" and new["target"] == "box", new["message"]
    assert min(steps(new)) == 4


def test_the_python_apis_move_waits_for_the_new_run_sync_and_async(
    make_daemon, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Run.move(to, wait=True)` and `AsyncRun.move`: the run that continues the moved one, once it
    trained a step there (two targets of this machine, a job that speaks the snapshot protocol)."""
    import inspect
    import sys

    import anyio

    import obd
    from tests.conftest import FAST_CONFIG

    assert inspect.signature(obd.AsyncRun.move) == inspect.signature(obd.Run.move).replace(return_annotation="AsyncRun")
    config = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
    config += f'\n[targets.spare]\nkind = "local"\ngpus = ["0"]\nworkdir = "{short_tmp / "spare"}"\n'
    d = make_daemon(config)
    d.start()
    for name in ("OBD_SOCKET", "OBD_CONFIG", "OBD_STATE_DIR"):
        monkeypatch.setenv(name, d.env[name])
    job = [sys.executable, str(Path(__file__).with_name("fake_plugin_job.py")), "snapshot"]

    with obd.Client() as client:
        run = client.start(job)
        wait_for(lambda: (r := d.record(run.id))["snapshots"] and (r["progress"].get("step") or 0) > 3, 60, 0.05)
        there = run.move("spare", wait=True)
    assert isinstance(there, obd.Run) and there.id != run.id
    moved = d.record(run.id)
    assert moved["state"] == "stopped" and moved["move"] == {**moved["move"], "state": "done", "run": there.id}
    new = d.record(there.id)
    assert new["target"] == "spare" and new["resumed_from"] == run.id
    assert (new["progress"].get("step") or 0) > moved["snapshot"]["step"]  # it trained on there
    assert "obd's Python API" in notes(moved)

    async def back() -> obd.AsyncRun:
        async with obd.AsyncClient() as client:
            return await (await client.run(there.id)).move("local", wait=True)

    again = anyio.run(back)
    assert isinstance(again, obd.AsyncRun)
    record = d.record(again.id)
    assert record["target"] == "local" and record["resumed_from"] == there.id
    assert d.record(there.id)["move"]["state"] == "done"
    assert "carried from target spare to local" in notes(record)
    d.call("cancel", id=again.id)
