"""Checkpoint retention (issue 26 item 5): the rule as a table, the target-side removal that never
leaves the run directory, and a real daemon with a real Trainer script keeping the newest two
complete checkpoints of a chain over three attempts while every attempt still resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.service.models import RunRecord, RunState, Snapshot
from daemon.service.retention import Held, is_run_dir, plan, protections
from executors.base import ExecutorError
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.daemon.test_ssh_target import ssh_config
from tests.sshd import SshServer, running_sshd
from trainer_plugin.tools import jobctl

# --- the rule, as a table ---------------------------------------------------------------------

A, B, C = "run-a", "run-b", "run-c"  # attempts 1, 2, 3 of one chain
CHAIN = {A, B, C}
ATTEMPT = {A: 1, B: 2, C: 3}


def held(spec: str) -> list[Held]:
    """`a5 a10 b15? c20!`: the run's letter and the step; `?` incomplete, `!` marked bad (not complete)."""
    out = []
    for word in spec.split():
        run = {"a": A, "b": B, "c": C, "x": "other-run"}[word[0]]
        step = int(word[1:].rstrip("?!"))
        out.append(Held(run, ATTEMPT.get(run, 1), f"checkpoint-{step}", not word.endswith(("?", "!"))))
    return out


def names(items: list[Held]) -> str:
    letter = {A: "a", B: "b", C: "c", "other-run": "x"}
    return " ".join(f"{letter[h.run]}{h.name.split('-')[1]}" for h in sorted(items, key=lambda h: h.order))


@pytest.mark.parametrize(
    ("on_disk", "keep", "protected", "removed"),
    [
        # the newest N complete are kept, every older one goes
        ("a5 a10 a15 a20", 2, {}, "a5 a10"),
        ("a5 a10 a15 a20", 1, {}, "a5 a10 a15"),
        ("a5 a10", 2, {}, ""),
        # newest: the highest step, then the later attempt
        ("a5 a10 b5 b10", 2, {}, "a5 b5"),
        ("a10 b10 b15", 1, {}, "a10 b10"),
        # the checkpoint an attempt resumes from is never deleted, however old
        ("a5 a10 b15 b20 b25", 2, {(A, "checkpoint-10"): "run-b resumes from it"}, "a5 b15"),
        # a proven snapshot a later attempt may resume is kept
        ("a5 a7 a10 a15", 1, {(A, "checkpoint-7"): "the proven snapshot"}, "a5 a10"),
        # nothing is deleted until a complete checkpoint exists to keep
        ("a5? a10?", 1, {}, ""),
        # one newer than the newest complete may still be being written: kept
        ("a5 a10 a15?", 1, {}, "a5"),
        # an incomplete one older than the newest complete is a save cut short: deleted
        ("a5 a10? a15", 1, {}, "a5 a10"),
        # a bad one never counts among the N; once older than the newest complete it goes
        ("a10 a15! b20", 2, {}, "a15"),
        ("a10 a15!", 1, {}, ""),
        # nothing of a run outside the chain is ever named
        ("x5 x10 a15 a20", 1, {}, "a15"),
    ],
)
def test_the_rule_keeps_the_newest_complete_and_what_a_resume_needs_and_deletes_the_rest(
    on_disk: str, keep: int, protected: dict, removed: str
) -> None:
    decided = plan(held(on_disk), keep, protected, CHAIN)
    assert names(decided.remove) == removed
    for key in protected:
        assert key in decided.kept and key not in {h.key for h in decided.remove}


def test_a_name_that_is_not_a_checkpoint_is_never_named_for_deletion() -> None:
    odd = [Held(A, 1, name, False) for name in ("../checkpoint-1", "checkpoint-1/..", "checkpoint-01", "model")]
    decided = plan([*odd, *held("a5 a10")], 1, {}, CHAIN)
    assert names(decided.remove) == "a5"


def record(run_id: str, state: RunState, **fields: Any) -> RunRecord:
    return RunRecord(id=run_id, state=state, remote_dir=f"/w/{run_id}", **fields)


def test_what_is_protected_is_what_a_live_run_resumes_and_the_newest_attempt_s_proof() -> None:
    a = record(A, RunState.stopped, snapshot=Snapshot(checkpoint="output/checkpoint-7", step=7), retried_by=B)
    b = record(
        B, RunState.running, chain=A, attempt=2, resumed_from=A, resume_checkpoint="/w/run-a/output/checkpoint-7"
    )
    other = record("elsewhere", RunState.queued, resumed_from=A, resume_checkpoint="checkpoint-3")
    done = record("done", RunState.succeeded, resumed_from=A, resume_checkpoint="checkpoint-5")
    got = protections([a, b, other, done], [a, b])
    assert set(got) == {(A, "checkpoint-7"), (A, "checkpoint-3")}  # an ended run's source is free again
    c = record(C, RunState.stopped, chain=A, attempt=3, snapshot=Snapshot(checkpoint="output/checkpoint-9", step=9))
    b.state = RunState.failed
    assert set(protections([a, b, c], [a, b, c])) == {(C, "checkpoint-9")}  # only the newest attempt's proof


def test_only_a_run_s_own_directory_is_a_run_directory() -> None:
    assert is_run_dir(record(A, RunState.running))
    for where in ("", "relative/run-a", "/w/other", "/w/../run-a", "/"):
        assert not is_run_dir(RunRecord(id=A, remote_dir=where))


# --- the removal on the target ----------------------------------------------------------------


def make_checkpoint(run_dir: Path, step: int, size: int = 1000) -> Path:
    path = run_dir / "output" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * size)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_removal_deletes_the_checkpoint_says_what_it_freed_and_never_follows_a_link(tmp_path: Path) -> None:
    run_dir, outside = tmp_path / "run", tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"k" * 50)
    path = make_checkpoint(run_dir, 5, 1000)
    (path / "sub").mkdir()
    (path / "sub" / "more").write_bytes(b"m" * 24)
    (path / "link-out").symlink_to(outside)  # a link inside: removed as a link, not followed
    make_checkpoint(run_dir, 10)
    state = len(json.dumps({"global_step": 5}))
    assert jobctl.checkpoint_sizes(str(run_dir)) == {"checkpoint-5": 1000 + 24 + state, "checkpoint-10": 1001 + state}
    done = jobctl.remove_checkpoint(str(run_dir), "checkpoint-5")
    assert done == {"name": "checkpoint-5", "freed": 1000 + 24 + state, "removed": True}
    assert sorted(os.listdir(run_dir / "output")) == ["checkpoint-10"]
    assert (outside / "keep.bin").read_bytes() == b"k" * 50
    assert jobctl.remove_checkpoint(str(run_dir), "checkpoint-5")["removed"] is False  # gone: nothing to do


@pytest.mark.parametrize("name", ["../precious", "checkpoint-5/../../precious", "precious", "checkpoint-05", ""])
def test_removal_refuses_a_name_that_is_not_a_checkpoint(tmp_path: Path, name: str) -> None:
    (tmp_path / "precious").mkdir()
    make_checkpoint(tmp_path / "run", 5)
    with pytest.raises(jobctl.CheckpointRefused):
        jobctl.remove_checkpoint(str(tmp_path / "run"), name)
    assert (tmp_path / "precious").is_dir() and (tmp_path / "run" / "output" / "checkpoint-5").is_dir()


def test_removal_refuses_a_checkpoint_or_an_output_that_is_a_link(tmp_path: Path) -> None:
    elsewhere = make_checkpoint(tmp_path / "elsewhere", 5)
    run_dir = tmp_path / "run"
    (run_dir / "output").mkdir(parents=True)
    (run_dir / "output" / "checkpoint-5").symlink_to(elsewhere)
    with pytest.raises(jobctl.CheckpointRefused):
        jobctl.remove_checkpoint(str(run_dir), "checkpoint-5")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "output").symlink_to(tmp_path / "elsewhere" / "output")
    with pytest.raises(OSError):
        jobctl.remove_checkpoint(str(linked), "checkpoint-5")
    assert jobctl.checkpoint_sizes(str(linked)) == {}
    assert (elsewhere / "model.safetensors").is_file()


NOBODY = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the root service's executor acting as a run's owner")
async def test_under_root_a_checkpoint_is_removed_with_the_run_owner_s_rights_only(short_tmp: Path) -> None:
    from executors.local import LocalExecutor

    short_tmp.chmod(0o755)  # the run's user reaches its run directory, as under the state directory
    workdir = short_tmp / "wd"
    run_dir = workdir / "run-1"
    path = make_checkpoint(run_dir, 5)
    make_checkpoint(run_dir, 10)
    for root, dirs, files in os.walk(run_dir):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, NOBODY, NOBODY)  # the run's user owns its directory, as root gave it
    workdir.chmod(0o755)
    (path / "roots").mkdir()  # something in it the user could not delete (root's, in a directory of root's)
    (path / "roots" / "file").write_bytes(b"r")
    executor = LocalExecutor("local", workdir)
    with pytest.raises(ExecutorError, match="checkpoint-5/roots is a directory of uid 0"):
        await executor.remove_checkpoint(str(run_dir), "checkpoint-5")  # root could; the run's owner cannot
    assert sorted(os.listdir(run_dir / "output")) == ["checkpoint-10", "checkpoint-5"]  # refused whole, nothing moved
    assert (path / "roots" / "file").exists() and (path / "trainer_state.json").exists()
    with pytest.raises(ExecutorError):  # never outside its workdir
        await executor.remove_checkpoint(str(short_tmp / "elsewhere"), "checkpoint-5")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the run's owner, and a mount point in a checkpoint")
async def test_an_odd_directory_is_removed_as_its_owner_may_and_a_removal_cut_short_is_put_back_and_said(
    short_tmp: Path,
) -> None:
    from executors.local import LocalExecutor

    short_tmp.chmod(0o755)
    workdir = short_tmp / "wd"
    run_dir = workdir / "run-1"
    locked, read_only, stuck = (make_checkpoint(run_dir, step) for step in (1, 2, 3))
    for path in (locked, read_only):
        (path / "d").mkdir()
        (path / "d" / "f").write_bytes(b"x")
    (stuck / "mnt").mkdir()
    for root, dirs, files in os.walk(run_dir):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.lchown(name, NOBODY, NOBODY)
    (locked / "d").chmod(0)  # its owner cannot enter it, but may chmod it
    (read_only / "d").chmod(0o555)
    workdir.chmod(0o755)
    executor = LocalExecutor("local", workdir)
    assert set(await executor.checkpoint_sizes(str(run_dir))) == {locked.name, read_only.name, stuck.name}
    assert await executor.remove_checkpoint(str(run_dir), locked.name) == 1000 + 18 + 1
    assert await executor.remove_checkpoint(str(run_dir), read_only.name) == 1000 + 18 + 1
    assert os.listdir(run_dir / "output") == [stuck.name]  # nothing half-removed under another name
    # A removal that fails part way (a mount point cannot be removed): put back, no longer complete.
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"uid={NOBODY},gid={NOBODY}", "obd-test", str(stuck / "mnt")], check=True
    )
    try:
        with pytest.raises(ExecutorError, match="what is left is output/checkpoint-3, no longer a complete"):
            await executor.remove_checkpoint(str(run_dir), stuck.name)
    finally:
        subprocess.run(["umount", str(stuck / "mnt")], check=True)
    assert os.listdir(run_dir / "output") == [stuck.name] and not (stuck / "trainer_state.json").exists()


# --- a real daemon, a real Trainer script -----------------------------------------------------

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
CONFIG = FAST_CONFIG + '\n[retry]\nbackoff = "0.5s"\n'
STEPS = 30


def start(d: DaemonProc, cwd: Path, *opts: str) -> str:
    command = [PY, PLAIN, "--output_dir", "out", "--max_steps", str(STEPS), "--save_steps", "5", "--step-sleep", "0.2"]
    out = d.cli("train", "start", "--cwd", str(cwd), *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def on_disk(d: DaemonProc, ids: list[str]) -> dict[tuple[str, str], bool]:
    """Every checkpoint of these runs' directories, and whether it is complete."""
    out = {}
    for rid in ids:
        output = Path(d.record(rid)["remote_dir"]) / "output"
        for name in sorted(os.listdir(output)) if output.is_dir() else []:
            if name.startswith("checkpoint-"):
                state = output / name / "trainer_state.json"
                out[(rid, name)] = state.is_file() and (output / name / "model.safetensors").is_file()
    return out


def step_of(key: tuple[str, str], attempts: list[str]) -> tuple[int, int]:
    return int(key[1].split("-")[1]), attempts.index(key[0])


def newest_two_and(d: DaemonProc, attempts: list[str], resumed: tuple[str, str] | None) -> bool:
    """Whether the chain's directories hold exactly its newest two complete checkpoints and the one
    being resumed (a checkpoint newer than those, being written, aside)."""
    disk = on_disk(d, attempts)
    complete = sorted((k for k, ok in disk.items() if ok), key=lambda k: step_of(k, attempts), reverse=True)
    if len(complete) < 2:
        return False
    newest = set(complete[:2]) | ({resumed} if resumed else set())
    writing = {k for k, ok in disk.items() if not ok and step_of(k, attempts) > step_of(complete[0], attempts)}
    return set(disk) - writing == newest


def kill_after(d: DaemonProc, rid: str, step: int) -> None:
    def saved() -> dict[str, Any] | None:
        r = d.record(rid)
        assert r["state"] in ("queued", "preparing", "running"), r["message"]
        state = Path(r["remote_dir"] or "/nonexistent") / "output" / f"checkpoint-{step}" / "trainer_state.json"
        if not r["job"] or not state.exists():
            return None
        try:  # the Trainer's last file of a save, written in place: whole once it parses
            json.loads(state.read_text())
        except ValueError:
            return None
        return r

    r = wait_for(saved, 120, 0.03, f"checkpoint-{step} of {rid}")
    os.killpg(r["job"]["pid"], signal.SIGKILL)  # a lost node: no snapshot, no goodbye


def test_a_chain_keeping_two_checkpoints_holds_the_newest_two_and_what_it_resumes_over_three_attempts(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(CONFIG)
    d.start()
    a1 = start(d, short_tmp, "--keep-checkpoints", "2", "--retry", "2")
    kill_after(d, a1, 10)
    assert d.wait_state(a1, "failed", timeout=60)["retention"]["keep_checkpoints"] == 2
    a2 = wait_for(lambda: d.record(a1)["retried_by"], 30, 0.1, "attempt 2")
    second = d.record(a2)
    source = (a1, second["resume_checkpoint"].rsplit("/", 1)[-1])  # a1's newest complete: 10 (15 on a slow day)
    assert second["resumed_from"] == a1 and step_of(source, [a1]) >= (10, 0)
    assert second["retention"]["keep_checkpoints"] == 2  # kept on the record, from attempt to attempt

    # Attempt 2 saves its own: once it has two, the disk holds those two and its source, nothing else.
    def two_of_its_own_and_its_source() -> bool:
        own = [k for k, ok in on_disk(d, [a1, a2]).items() if k[0] == a2 and ok]
        return len(own) >= 2 and newest_two_and(d, [a1, a2], source)

    wait_for(two_of_its_own_and_its_source, 90, 0.05, "a2 keeping its newest two and its source")
    assert [k for k in on_disk(d, [a1, a2]) if k[0] == a1] == [source]  # its source stays while it runs
    os.killpg(d.record(a2)["job"]["pid"], signal.SIGKILL)
    d.wait_state(a2, "failed", timeout=60)
    a3 = wait_for(lambda: d.record(a2)["retried_by"], 30, 0.1, "attempt 3")
    third = d.wait_state(a3, "succeeded", "failed", timeout=180)
    assert third["state"] == "succeeded", third["message"]
    assert third["resumed_from"] == a2 and third["progress"]["step"] == STEPS
    resumed = int(third["resume_checkpoint"].rsplit("-", 1)[1])
    assert resumed >= 20
    steps = [
        json.loads(x)["step"]
        for x in (Path(third["remote_dir"]) / "metrics.jsonl").read_text().splitlines()
        if json.loads(x).get("event") == "log" and "loss" in json.loads(x)
    ]
    assert steps == list(range(resumed + 1, STEPS + 1))  # it resumed, nothing trained twice
    chain = [a1, a2, a3]
    wait_for(lambda: newest_two_and(d, chain, None), 30, 0.1, "the chain's newest two, and nothing else")
    kept = on_disk(d, chain)
    assert len(kept) == 2 and all(kept.values()) and not any(run == a1 for run, _ in kept)
    status = d.cli("train", "status", a3)
    assert "keeping the newest 2 complete" in status.stdout and "pruned" in status.stdout, status.stdout

    # By hand: keep one; it says what it removed and what that freed.
    older = min(kept, key=lambda k: step_of(k, chain))
    size = sum(f.stat().st_size for f in (Path(d.record(older[0])["remote_dir"]) / "output" / older[1]).rglob("*"))
    out = d.cli("train", "prune", a1, "--keep", "1")
    assert out.returncode == 0, out.stderr
    assert f"removed   {older[1]} of {older[0]}" in out.stdout and "freed" in out.stdout, out.stdout
    import obd

    with obd.Client(d.socket) as client:  # the Python API's way to it
        answer = client.run(a3).prune(keep=1)
    assert answer["removed"] == [] and answer["freed"] == 0 and answer["keep"] == 1  # nothing left to free
    assert len(on_disk(d, chain)) == 1
    assert d.record(older[0])["retention"]["pruned_bytes"] >= size > 0


def test_a_restarted_daemon_prunes_what_a_killed_one_left_without_waiting_for_the_chain_to_change(
    make_daemon,
) -> None:
    d = make_daemon(CONFIG)
    d.start()
    out = d.cli("train", "start", "--keep-checkpoints", "1", "--", "true")
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    run_dir = Path(d.wait_state(rid, "succeeded")["remote_dir"])
    # Killed before its pass: the run's checkpoints are on disk, and the record will not change again.
    d.kill()
    older, newer = make_checkpoint(run_dir, 5), make_checkpoint(run_dir, 10)
    d.start()
    wait_for(lambda: not older.exists(), 30, 0.1, "checkpoint-5 pruned by the restarted daemon")
    assert newer.is_dir() and d.record(rid)["retention"]["pruned"] == ["checkpoint-5"]


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def test_an_ssh_target_s_default_keeps_one_checkpoint_and_the_rest_are_removed_on_the_host(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    d = make_daemon(ssh_config(sshd, short_tmp / "remote", extra="keep_checkpoints = 1\n", proof_timeout="60s"))
    d.start()
    command = [PY, PLAIN, "--output_dir", "out", "--max_steps", "20", "--save_steps", "5"]
    out = d.cli("train", "start", "--target", "box", "--", *command)
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    record = d.wait_state(rid, "succeeded", "failed", timeout=180)
    assert record["state"] == "succeeded", record["message"]
    assert record["retention"]["keep_checkpoints"] == 1  # the target's default
    wait_for(lambda: len(d.record(rid)["retention"]["pruned"]) == 3, 30, 0.1, "the older ones pruned")
    assert d.record(rid)["retention"]["pruned"] == [
        "checkpoint-5",
        "checkpoint-10",
        "checkpoint-15",
    ]  # the oldest first
    assert list(on_disk(d, [rid])) == [(rid, "checkpoint-20")]
    assert "keeping the newest 1 complete" in d.cli("train", "status", rid).stdout


# --- hostile JSON and odd directories in a checkpoint (issue 33 items 4, 5) -----------------------

DEEP = b"[" * 200_000 + b"]" * 200_000  # nested past any parser's stack


def test_a_trainer_state_nested_200000_deep_is_an_incomplete_checkpoint_and_said_once(make_daemon) -> None:
    d = make_daemon(CONFIG)
    d.start()
    out = d.cli("train", "start", "--keep-checkpoints", "1", "--", "true")
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    run_dir = Path(d.wait_state(rid, "succeeded")["remote_dir"])
    make_checkpoint(run_dir, 5)
    deep = make_checkpoint(run_dir, 10)
    (deep / "trainer_state.json").write_bytes(DEEP)
    for _ in range(3):  # status reads every checkpoint of the chain each time
        status = d.cli("train", "status", rid, "--json")
        assert status.returncode == 0, status.stderr
    shown = {c["name"]: c["complete"] for c in json.loads(status.stdout)["checkpoints"]["checkpoints"]}
    assert shown == {"checkpoint-5": True, "checkpoint-10": False}
    pruned = d.cli("train", "prune", rid, "--keep", "1", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["removed"] == []  # the newest complete is 5; 10 may still be being written
    resumed = d.cli("train", "resume", rid, "--again")  # a resume reads the same file: it takes the newest complete one
    assert resumed.returncode == 0, resumed.stderr
    assert d.record(resumed.stdout.strip())["resume_checkpoint"].endswith("checkpoint-5")
    log = d.log_path.read_text()
    assert log.count("checkpoint_state_unreadable") == 1, log[-3000:]
    assert "RecursionError" not in log and "Traceback" not in log, log[-3000:]
