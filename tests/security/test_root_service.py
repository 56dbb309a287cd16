"""The root service against a hostile job and a group member (issue 22, items 1-3).

Root only: a root daemon shared by two throwaway users (tests/users.py). Each test is an attack
that worked against the code before the privilege separation (the daemon acting on a user's
run directory with root's rights, and trusting files the job writes), or the stop that never
snapshotted under root, and holds now.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, REPO, wait_for
from tests.users import Box, User
from trainer_plugin.tools import jobctl

pytestmark = users.needs_root_and_users
accounts = users.accounts

PLAIN = REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py"
CONFIG = (
    FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "40s"')
    + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
)


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    """A root daemon with one configured GPU, whose socket the throwaway users' group may use."""
    yield users.shared_daemon(make_daemon, short_tmp, accounts, CONFIG, own_python=True)


@pytest.fixture(scope="module")
def training_python(accounts) -> Path:
    """A Python the throwaway users can run that has torch and transformers (users.training_python)."""
    return users.training_python(accounts[4].parent)


def _workdir(user: User) -> Path:
    work = user.home / f"work-{uuid.uuid4().hex[:6]}"
    subprocess.run(["install", "-d", "-o", str(user.uid), "-g", str(user.gid), str(work)], check=True)
    script = work / PLAIN.name
    shutil.copy(PLAIN, script)
    os.chown(script, user.uid, user.gid)
    return work


def _steps(record: dict) -> dict[int, tuple[float, float]]:
    """Each logged step's loss and grad norm, from the run's metrics.jsonl."""
    lines = [json.loads(x) for x in (Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: (x["loss"], x.get("grad_norm")) for x in lines if x.get("event") == "log" and "loss" in x}


def _announced(box: Box, rid: str, step: int) -> None:
    def check() -> bool:
        r = box.daemon.record(rid)
        if r["state"] not in ("running", "preparing"):
            raise AssertionError(f"run ended early: {r['message']}")
        return bool(r["snapshots"] and (r["progress"]["step"] or 0) >= step)

    wait_for(check, 120, 0.1, f"run {rid} to announce snapshots and reach step {step}")


@contextlib.contextmanager
def _root_secret() -> Iterator[tuple[Path, str]]:
    """A directory only root can enter, holding a file with a marker no one else may ever see."""
    where = Path(tempfile.mkdtemp(prefix="obd-root-only-", dir="/tmp"))
    os.chmod(where, 0o700)
    marker = "root-only-" + uuid.uuid4().hex
    (where / "secret.txt").write_text(marker + "\n")
    try:
        yield where, marker
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _files_holding(root: Path, marker: str, skip: Path) -> list[Path]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink() and skip not in path.parents:
            with contextlib.suppress(OSError):
                if marker.encode() in path.read_bytes():
                    found.append(path)
    return found


def test_a_group_members_unmodified_trainer_script_stops_with_a_proven_snapshot_and_resumes_exactly(
    box: Box, training_python: Path
) -> None:
    alice = box.alice
    work = _workdir(alice)
    command = (str(training_python), PLAIN.name, "--output_dir", "mine", "--max_steps", "24", "--step-sleep", "0.1")
    whole = box.start(alice, *command, cwd=work)
    uninterrupted = box.daemon.wait_state(whole, "succeeded", "failed", "cancelled", timeout=240)
    assert uninterrupted["state"] == "succeeded", uninterrupted["message"]

    rid = box.start(alice, *command, cwd=work)
    _announced(box, rid, step=3)
    began = time.monotonic()
    out = box.obd(alice, "train", "stop", rid, "--wait", "--json", timeout=120)
    took = time.monotonic() - began
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = json.loads(out.stdout)
    assert stopped["state"] == "stopped", stopped["message"]  # under the old code: cancelled by the fallback
    snap = stopped["snapshot"]
    assert snap["reason"] == "requested" and snap["checkpoint"] == f"output/checkpoint-{snap['step']}"
    assert took < 30, f"the stop took {took:.1f} s"
    request = Path(stopped["remote_dir"]) / "snapshot.request"
    assert request.stat().st_uid == alice.uid  # written as alice, so her job could read it

    resumed = box.obd(alice, "train", "resume", rid, cwd=work)
    assert resumed.returncode == 0, resumed.stderr
    final = box.daemon.wait_state(resumed.stdout.strip(), "succeeded", "failed", "cancelled", timeout=240)
    assert final["state"] == "succeeded", final["message"]
    after, before = _steps(final), _steps(uninterrupted)
    assert min(after) == snap["step"] + 1 and max(after) == 24
    assert {s: after[s] for s in after} == {s: before[s] for s in after}  # bitwise: losses and grad norms


def test_a_stop_with_the_reason_deadline_arrives_as_deadline_and_is_retried(box: Box, training_python: Path) -> None:
    alice = box.alice
    work = _workdir(alice)
    # 60 steps of 0.1 s: on a loaded machine 16 were over before the stop reached the job.
    command = (str(training_python), PLAIN.name, "--output_dir", "mine", "--max_steps", "60", "--step-sleep", "0.1")
    rid = box.start(alice, *command, opts=("--retry", "1"), cwd=work)
    _announced(box, rid, step=2)
    out = box.obd(alice, "train", "stop", rid, "--reason", "deadline")
    assert out.returncode == 0, out.stderr
    first = box.daemon.wait_state(rid, "stopped", "failed", "cancelled", timeout=120)
    assert first["state"] == "stopped" and first["snapshot"]["reason"] == "deadline", first["message"]
    second_id = wait_for(lambda: box.daemon.record(rid)["retried_by"], 30, 0.1, "the next attempt")
    second = box.daemon.wait_state(second_id, "succeeded", "failed", "cancelled", timeout=240)
    assert second["state"] == "succeeded", second["message"]
    assert second["resumed_from"] == rid and min(_steps(second)) == first["snapshot"]["step"] + 1


_RACER = """
import json, os, sys, time
run_dir, forged = sys.argv[1], sys.argv[2]
end = time.monotonic() + 20
while time.monotonic() < end:
    if os.path.isdir(run_dir):
        tmp = os.path.join(run_dir, ".forged")
        try:
            with open(tmp, "w") as f:
                f.write(forged)
            os.replace(tmp, os.path.join(run_dir, "job.pid"))
        except OSError:
            pass
"""


def test_a_job_pid_forged_from_the_launch_on_never_makes_root_signal_another_process(box: Box) -> None:
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)  # root's, in a group of its own
    try:
        start_time = jobctl.process_start_time(victim.pid)
        forged = json.dumps({"pid": victim.pid, "start_time": start_time, "boot_id": jobctl.boot_id()})
        alice = box.alice
        rid = box.start(alice, "sh", "-c", f"cd \"$OBD_RUN_DIR\"; echo '{forged}' > job.pid; sleep 300")
        rd = box.daemon.state_dir / "jobs" / rid
        racer = subprocess.Popen(  # alice rewrites job.pid as fast as she can, from the moment it can be
            [f"{box.venv}/bin/python", "-S", "-c", _RACER, str(rd), forged],
            user=alice.uid,
            group=alice.gid,
        )
        try:
            record = box.daemon.wait_state(rid, "running")
            assert record["job"]["pid"] != victim.pid
            box.daemon.kill()  # a daemon SIGKILLed and started again adopts what it recorded, not job.pid
            box.daemon.start()
            out = box.obd(alice, "train", "cancel", rid, "--wait")
            assert out.returncode == 0, out.stdout + out.stderr
        finally:
            racer.kill()
            racer.wait()
        time.sleep(0.5)
        assert victim.poll() is None, "root signalled a process the job named in job.pid"
        assert not jobctl.job_processes(record["job"]["pid"])  # the job's own processes are gone
    finally:
        victim.kill()
        victim.wait()


def test_a_planted_end_mark_changes_nothing_and_a_gpu_is_never_given_to_two_runs(box: Box) -> None:
    alice = box.alice
    with _root_secret() as (secret, _):
        plant = f'cd "$OBD_RUN_DIR"; echo planted > cancelled; echo 0 > exit_code; ln -s {secret}/nothing cancelling; sleep 300'
        first = box.start(alice, "sh", "-c", plant, opts=("--gpus", "1"))
        box.daemon.wait_state(first, "running")
        second = box.start(alice, "sh", "-c", "echo second ran", opts=("--gpus", "1"))
        rd = Path(box.daemon.record(first)["remote_dir"])
        wait_for(lambda: (rd / "cancelled").exists(), 20, 0.1, "the job to plant its marks")
        time.sleep(2)  # ten polls and the events of the writes
        assert box.daemon.record(first)["state"] == "running"
        assert box.daemon.record(second)["state"] == "queued"  # its GPU is still held
        assert "run_dir_tampering" in box.daemon.log_path.read_text()
    out = box.obd(alice, "train", "cancel", first, "--wait")
    assert out.returncode == 0, out.stderr
    assert box.daemon.wait_state(second, "succeeded", "failed", timeout=60)["state"] == "succeeded"


def test_links_in_a_run_directory_never_make_root_read_copy_or_serve_a_root_only_file(box: Box) -> None:
    alice = box.alice
    with _root_secret() as (secret, marker):
        job = (
            f'cd "$OBD_RUN_DIR"; ln -s {secret}/secret.txt metrics.jsonl; rm -rf profile; ln -s {secret} profile; '
            f"mkdir -p output; ln -s {secret} output/checkpoint-1; ln -s {secret}/secret.txt snapshot.json; exit 0"
        )
        rid = box.start(alice, "sh", "-c", job, opts=("--profile",))
        final = box.daemon.wait_state(rid, "succeeded", "failed", "stopped", "cancelled", timeout=60)
        assert final["snapshot"] is None
        rd = Path(final["remote_dir"])
        assert (rd / "metrics.jsonl").is_symlink() and (rd / "profile").is_symlink()  # the job did plant them
        for args in (("logs", rid), ("status", rid, "--json"), ("metrics", rid, "--json")):
            out = box.obd(alice, "train", *args)
            assert marker not in out.stdout + out.stderr, args
        dest = alice.home / f"copy-{uuid.uuid4().hex[:6]}"
        box.obd(alice, "train", "outputs", rid, "--to", str(dest))
        assert not _files_holding(box.daemon.state_dir, marker, secret)
        assert not _files_holding(alice.home, marker, secret)


def test_root_copying_a_users_outputs_follows_none_of_their_links(box: Box, short_tmp: Path) -> None:
    alice = box.alice
    with _root_secret() as (secret, marker):
        rid = box.start(alice, "sh", "-c", f'cd "$OBD_RUN_DIR"; ln -s {secret} output')
        box.daemon.wait_state(rid, "succeeded", "failed")
        dest = short_tmp / "root-copy"
        out = box.daemon.cli("train", "outputs", rid, "--to", str(dest))  # run by root
        assert marker not in out.stdout
        assert not dest.exists() or not _files_holding(dest, marker, secret)

        # A --to that goes through alice's link never writes into root's directory.
        real = box.start(alice, "sh", "-c", 'cd "$OBD_RUN_DIR"; mkdir -p output; echo weights > output/model.bin')
        box.daemon.wait_state(real, "succeeded", "failed")
        link = alice.home / f"to-{uuid.uuid4().hex[:6]}"
        os.symlink(secret, link)
        os.lchown(link, alice.uid, alice.gid)
        out = box.daemon.cli("train", "outputs", real, "--to", f"{link}/out")
        assert out.returncode != 0 and f"as {alice.name}" in out.stderr, out.stdout + out.stderr
        assert sorted(p.name for p in secret.iterdir()) == ["secret.txt"]


def test_a_cwd_the_caller_cannot_open_is_refused_at_start_for_every_target(box: Box) -> None:
    with _root_secret() as (secret, marker):
        out = box.obd(box.alice, "train", "start", "--cwd", str(secret), "--", "sh", "-c", "cat secret.txt")
        assert out.returncode != 0
        assert "cannot open" in out.stderr and marker not in out.stdout + out.stderr
        listed = box.obd(box.alice, "train", "list", "--all", "--json")
        assert json.loads(listed.stdout) == []


def test_the_job_runs_as_its_user_while_the_wrapper_that_records_its_end_stays_root(box: Box) -> None:
    rid = box.start(box.alice, "sh", "-c", "kill -KILL $PPID; sleep 1; echo still-supervised; exit 7")
    final = box.daemon.wait_state(rid, "succeeded", "failed", timeout=60)
    assert final["state"] == "failed" and final["exit_code"] == 7, final[
        "message"
    ]  # alice's KILL could not reach the wrapper
    facts = box.daemon.state_dir / "facts" / rid
    assert (facts / "exit_code").read_text().strip() == "7"
    assert facts.stat().st_uid == 0 and (facts.stat().st_mode & 0o077) == 0
