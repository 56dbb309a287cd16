"""A resume that survives a bad checkpoint (issue 26 item 6): which failed attempt marks which
checkpoint bad, a chain's resume point passing over it, and a real daemon with a real Trainer
script whose newest checkpoint was truncated on purpose: the attempt resuming from it fails at
load, the next resumes from the older one and finishes, and `status` names the bad one."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from daemon.service.checkpoints import bad_checkpoints, chain_resume_point, failed_at_load, load_attempted
from daemon.service.models import BadCheckpoint, Progress, RunRecord, RunState
from daemon.service.records import Records
from executors.base import ExecutorError
from tests.conftest import FAST_CONFIG, REPO, wait_for


def attempt(**fields: Any) -> RunRecord:
    base: dict[str, Any] = {
        "id": "a2",
        "state": RunState.failed,
        "exit_code": 1,
        "resumed_from": "a1",
        "resume_checkpoint": "/w/a1/output/checkpoint-20",
    }
    return RunRecord(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({}, ("a1", "checkpoint-20")),  # failed with no step logged: it could not load it
        ({"progress": Progress(step=20)}, ("a1", "checkpoint-20")),  # a heartbeat at the resumed step
        ({"resume_checkpoint": "/w/a2/resume/checkpoint-20"}, ("a1", "checkpoint-20")),  # copied from elsewhere
        ({"progress": Progress(step=21)}, None),  # it trained a step after it: the checkpoint loaded
        ({"state": RunState.stopped}, None),
        ({"state": RunState.cancelled}, None),
        ({"exit_code": None}, None),  # lost, not failed at load
        ({"resumed_from": None}, None),  # started from the beginning
        ({"resume_checkpoint": "/data/my-ckpt"}, None),  # a path given by hand, not a checkpoint of a run
    ],
)
def test_an_attempt_that_failed_before_its_first_new_step_marks_the_checkpoint_it_resumed_from_bad(
    fields: dict[str, Any], bad: tuple[str, str] | None
) -> None:
    found = failed_at_load(attempt(**fields))
    assert (None if found is None else (found.run, found.name)) == bad


def test_the_mark_in_the_history_is_a_notification_event_of_its_own() -> None:
    from daemon.service.notify import events

    record = attempt(state=RunState.running)  # it runs, then fails (a final state is never left)
    record.transition(RunState.failed, "exited with code 1")
    bad = failed_at_load(record)
    assert bad is not None
    record.note(f"checkpoint {bad.name} of run {bad.run} is bad: {bad.why}; no attempt resumes from it again")
    record.note("checkpoint-5 copied")  # another note about a checkpoint is no such event
    assert [e.kind for e in events(record)] == ["failed", "bad_checkpoint"]


class Gone:
    """A target that no longer answers (the attempts here are read from their retrieved copies)."""

    def executor(self, record: RunRecord) -> Any:
        raise ExecutorError(f"the target of {record.id} is gone")


class Chain:
    """Just what chain_resume_point reads: the records, where each attempt's copy is, its target."""

    def __init__(self, root: Path, records: list[RunRecord]) -> None:
        from daemon.service.config import Config

        self.records = Records({r.id: r for r in records})
        self.config = Config()
        self.store = type("Store", (), {"run_dir": lambda _self, rid: root / rid})()
        self.targets = Gone()


def checkpoint(root: Path, run_id: str, step: int) -> None:
    path = root / run_id / "retrieved" / "output" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "model.safetensors").write_bytes(b"w")


def test_a_chain_resumes_from_the_next_older_checkpoint_never_a_bad_one(tmp_path: Path) -> None:
    for step in (10, 20):
        checkpoint(tmp_path, "a1", step)
    a1 = RunRecord(id="a1", state=RunState.failed, exit_code=1, retried_by="a2")
    a2 = attempt(chain="a1", attempt=2)
    chain = Chain(tmp_path, [a1, a2])
    first = anyio.run(chain_resume_point, chain, a2)
    assert first is not None and (first.source, first.name) == ("a1", "checkpoint-20")
    a2.bad_checkpoint = failed_at_load(a2)
    assert set(bad_checkpoints([a1, a2])) == {("a1", "checkpoint-20")}
    again = anyio.run(chain_resume_point, chain, a2)
    assert again is not None and (again.source, again.name) == ("a1", "checkpoint-10")
    a3 = attempt(id="a3", chain="a1", attempt=3, resume_checkpoint="/w/a1/output/checkpoint-10")
    a3.bad_checkpoint = BadCheckpoint(run="a1", name="checkpoint-10")
    chain.records["a3"] = a3
    assert anyio.run(chain_resume_point, chain, a3) is None  # from the start: never a bad one again


@pytest.mark.parametrize(
    ("resumed_at", "then"),
    [
        (20, "checkpoint-15"),  # its snapshot, bad: the parent's next older complete one
        (10, "checkpoint-5"),  # a checkpoint the user chose: never forward past it
    ],
)
def test_a_resumed_runs_retry_after_a_bad_checkpoint_resumes_from_the_parents_next_older_one_not_step_0(
    tmp_path: Path, resumed_at: int, then: str
) -> None:
    from daemon.service.models import Snapshot

    for step in (5, 10, 15, 20):
        checkpoint(tmp_path, "bad", step)
    parent = RunRecord(
        id="bad",
        state=RunState.stopped,
        snapshot=Snapshot(checkpoint="output/checkpoint-20", step=20, reason="requested", time=1.0),
    )
    resumed = attempt(id="r", resumed_from="bad", resume_checkpoint=f"/w/bad/output/checkpoint-{resumed_at}")
    resumed.bad_checkpoint = failed_at_load(resumed)  # attempt 1 failed loading it
    assert resumed.bad_checkpoint is not None and resumed.bad_checkpoint.name == f"checkpoint-{resumed_at}"
    (tmp_path / "r" / "retrieved" / "output").mkdir(parents=True)
    point = anyio.run(chain_resume_point, Chain(tmp_path, [parent, resumed]), resumed)
    assert point is not None and (point.source, point.name) == ("bad", then)
    assert "of run bad, which its chain was resumed from" in point.reason


@pytest.mark.parametrize(
    ("log", "attempted"),
    [
        (b"loading data\nobd: resuming from /w/a1/output/checkpoint-20\nTraceback ...\n", True),
        (b"python: can't open file 'trian.py'\n", False),  # it never got to the checkpoint
        (b"obd: resuming from /w/a1/output/checkpoint-10\n", False),  # another checkpoint
        (None, False),  # no log at all
    ],
)
def test_a_checkpoint_is_marked_bad_only_once_the_job_handed_it_to_the_trainer(
    tmp_path: Path, log: bytes | None, attempted: bool
) -> None:
    a2 = attempt()
    (tmp_path / "a2" / "retrieved" / "output").mkdir(parents=True)
    if log is not None:
        (tmp_path / "a2" / "retrieved" / "job.log").write_bytes(log)
    assert anyio.run(load_attempted, Chain(tmp_path, [a2]), a2) is attempted


# --- a real daemon, a real Trainer script -----------------------------------------------------

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
# The backoff leaves the first attempt's directory alone while the test truncates it.
CONFIG = FAST_CONFIG + '\n[retry]\nbackoff = "1s"\n'
STEPS = 25


def test_a_truncated_newest_checkpoint_fails_one_attempt_at_load_and_the_next_resumes_from_the_older_one(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(CONFIG)
    d.start()
    # The first attempt hangs once checkpoint-10 is saved (the marker made as it hangs), so that
    # checkpoint-10 is its newest however slow the machine; the later attempts train on.
    hung = short_tmp / "hung"
    command = [PY, PLAIN, "--output_dir", "out", "--max_steps", str(STEPS), "--save_steps", "5", "--step-sleep", "0.2"]
    command += ["--hang-after", "10", "--hang-marker", str(hung)]
    out = d.cli("train", "start", "--cwd", str(short_tmp), "--retry", "2", "--", *command)
    assert out.returncode == 0, out.stderr
    a1 = out.stdout.strip()

    def saved() -> dict[str, Any] | None:
        r = d.record(a1)
        assert r["state"] in ("queued", "preparing", "running"), r["message"]
        return r if r["job"] and hung.exists() else None

    first = wait_for(saved, 120, 0.1, "the first attempt hanging after checkpoint-10")
    assert not (Path(first["remote_dir"]) / "output" / "checkpoint-15").exists()
    weights = Path(first["remote_dir"]) / "output" / "checkpoint-10" / "model.safetensors"
    with open(weights, "r+b") as f:  # half of it, as a full disk leaves it
        f.truncate(os.path.getsize(weights) // 2)
    os.killpg(first["job"]["pid"], signal.SIGKILL)
    assert d.wait_state(a1, "failed", timeout=60)["state"] == "failed"

    a2 = wait_for(lambda: d.record(a1)["retried_by"], 30, 0.1, "attempt 2")
    second = d.wait_state(a2, "failed", "succeeded", timeout=120)
    assert second["state"] == "failed", second["message"]
    assert second["resume_checkpoint"].endswith("checkpoint-10")
    assert "safetensors" in (Path(second["remote_dir"]) / "job.log").read_text().lower()  # it failed at load
    second = wait_for(lambda: (r := d.record(a2))["bad_checkpoint"] and r, 30, 0.1, "the mark")
    assert second["bad_checkpoint"]["run"] == a1 and second["bad_checkpoint"]["name"] == "checkpoint-10"
    assert any("checkpoint-10" in h["reason"] and "bad" in h["reason"] for h in second["history"])

    a3 = wait_for(lambda: d.record(a2)["retried_by"], 30, 0.1, "attempt 3")
    third = d.wait_state(a3, "succeeded", "failed", timeout=180)
    assert third["state"] == "succeeded", third["message"]
    assert third["resumed_from"] == a1 and third["resume_checkpoint"].endswith("checkpoint-5")
    assert third["progress"]["step"] == STEPS
    lines = [json.loads(x) for x in (Path(third["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    steps = [x["step"] for x in lines if x.get("event") == "log" and "loss" in x]
    assert steps == list(range(6, STEPS + 1))  # from the older checkpoint to max_steps, each once
    assert third["bad_checkpoints"] == [{"run": a1, "name": "checkpoint-10", "why": second["bad_checkpoint"]["why"]}]
    status = d.cli("train", "status", a1).stdout
    assert f"bad       checkpoint-10 of {a1}" in status, status
    # No keep setting: obd keeps every checkpoint, and a prune by hand asks how many to keep.
    refused = d.cli("train", "prune", a3)
    assert refused.returncode == 2 and f"obd train prune {a3} --keep N" in refused.stderr, refused.stderr
