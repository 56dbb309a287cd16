"""A checkpoint carried to another target under the root service (issue 36 item 5).

Root only: a root daemon shared by throwaway users (tests/users.py), with two local-kind targets
(`local` and `other`, each its own workdir) and a target kept for one user by `[policy]`. A
user's `obd train resume RUN --target other` carries the checkpoint with every file theirs at
the destination, read and written by a helper that is them (carry_local.py); a checkpoint
holding a link to a root-only file is refused and the secret's bytes appear nowhere under the
destination; a target the policy keeps from a user is refused at start, resume --target and
move --to, naming the rule.
"""

from __future__ import annotations

import os
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, wait_for
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts = users.accounts
BIG = 300_000_000  # a sparse file: a carry of it takes a moment, the disk nothing

# A job (standard library only) that logs a step every 0.05 s and, once asked for a snapshot,
# writes a checkpoint (and, with LINK set, a link in it to that path) and its proof, then exits.
JOB = r"""
import json, os, sys, time
rd = os.environ["OBD_RUN_DIR"]
def write(path, data):
    with open(path + ".tmp", "w") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
with open(os.environ["OBD_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"event": "begin", "time": time.time(), "max_steps": 100000, "snapshots": True}) + "\n")
step = int(os.environ.get("OBD_RESUME_FROM", "x-0").rstrip("/").rsplit("-", 1)[-1] or 0)
while True:
    step += 1
    time.sleep(0.05)
    with open(os.environ["OBD_METRICS_FILE"], "a") as f:
        f.write(json.dumps({"event": "log", "time": time.time(), "step": step, "loss": 1.0 / step}) + "\n")
    if os.path.exists(os.environ["OBD_SNAPSHOT_REQUEST"]):
        ckpt = f"{rd}/output/checkpoint-{step}"
        os.makedirs(ckpt + "/sub", exist_ok=True)
        write(f"{ckpt}/trainer_state.json", json.dumps({"global_step": step, "log_history": []}))
        write(f"{ckpt}/sub/model.safetensors", "weights" * 1000)
        if os.environ.get("BIG"):
            with open(f"{ckpt}/sub/optimizer.pt", "wb") as f:
                f.truncate(int(os.environ["BIG"]))
        if os.environ.get("LINK"):
            os.symlink(os.environ["LINK"], f"{ckpt}/optimizer.pt")
        proof = {"checkpoint": f"output/checkpoint-{step}", "step": step, "time": time.time(), "reason": "requested"}
        write(os.environ["OBD_SNAPSHOT_FILE"], json.dumps(proof))
        sys.exit(0)
"""


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:  # type: ignore[no-untyped-def]
    bob, venv = accounts[1], accounts[4]
    python = f"{venv}/bin/python"
    for workdir in ("other", "kept"):  # reachable by the users, as the state directory's jobs/ is
        (short_tmp / workdir).mkdir(mode=0o711)
        (short_tmp / workdir).chmod(0o711)
    config = (
        FAST_CONFIG
        + f'\n[policy]\ntarget_users = {{ kept = ["{bob.name}"] }}\n'
        + f'\n[targets.local]\nkind = "local"\npython = "{python}"\n'
        + f'\n[targets.other]\nkind = "local"\nworkdir = "{short_tmp / "other"}"\npython = "{python}"\n'
        + f'\n[targets.kept]\nkind = "local"\nworkdir = "{short_tmp / "kept"}"\npython = "{python}"\n'
    )
    yield users.shared_daemon(make_daemon, short_tmp, accounts, config)


def job_file(box: Box) -> Path:
    path = box.alice.home / "job.py"
    path.write_text(JOB)
    os.chown(path, box.alice.uid, box.alice.gid)
    return path


def stopped_run(box: Box, *env: str) -> dict:
    job = job_file(box)
    opts = tuple(x for kv in env for x in ("--env", kv))
    rid = box.start(box.alice, f"{box.venv}/bin/python", str(job), opts=opts)
    wait_for(lambda: (box.daemon.record(rid)["progress"].get("step") or 0) >= 2, 120, 0.1, f"steps of {rid}")
    out = box.obd(box.alice, "train", "stop", rid, "--wait", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    record = box.daemon.record(rid)
    assert record["state"] == "stopped" and record["snapshot"], record["message"]
    return record


def test_a_users_resume_on_another_target_carries_the_checkpoint_as_theirs(box: Box) -> None:
    alice = box.alice
    source = stopped_run(box, f"BIG={BIG}")
    # While it is carried, nothing of it is ever staged in the daemon's own state directory (the
    # carry before this change copied it into STATE_DIR/runs/ID/carry/ as root, then on).
    staged: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            staged.extend(str(p) for p in (box.daemon.state_dir / "runs").glob("*/carry"))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out = box.obd(alice, "train", "resume", source["id"], "--target", "other")
        assert out.returncode == 0, out.stderr
        new = box.daemon.wait_state(out.stdout.strip(), "running", timeout=120)
    finally:
        done.set()
        watcher.join()
    assert not staged, staged
    name = source["snapshot"]["checkpoint"].rsplit("/", 1)[-1]
    carried = Path(new["remote_dir"]) / "resume" / name
    assert carried.is_dir(), new["message"]
    entries = [carried, *carried.rglob("*")]
    assert {p.relative_to(carried).as_posix() for p in entries if p.is_file()} == {
        "trainer_state.json",
        "sub/model.safetensors",
        "sub/optimizer.pt",
    }
    assert (carried / "sub" / "optimizer.pt").stat().st_size == BIG
    for path in entries:  # every file and directory of the copy is alice's, none root's
        st = os.lstat(path)
        assert (st.st_uid, st.st_gid) == (alice.uid, alice.gid), (path, st.st_uid)
    assert (carried / "sub" / "model.safetensors").read_text() == "weights" * 1000
    history = "\n".join(h["reason"] for h in box.daemon.record(new["id"])["history"])
    assert f"{name} of {source['id']} carried from target local to other" in history
    box.obd(alice, "train", "cancel", new["id"])


def test_a_checkpoint_holding_a_link_to_a_root_only_file_is_not_carried(box: Box, short_tmp: Path) -> None:
    token = "root-only-secret-" + uuid.uuid4().hex
    secret_dir = short_tmp / "root-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "secret.bin"
    secret.write_text(token)
    secret.chmod(0o600)
    assert stat.S_IMODE(secret_dir.stat().st_mode) == 0o700
    source = stopped_run(box, f"LINK={secret}")
    out = box.obd(box.alice, "train", "resume", source["id"], "--target", "other")
    assert out.returncode == 0, out.stderr
    new = box.daemon.wait_state(out.stdout.strip(), "failed", timeout=120)
    assert new["message"].startswith("launch failed"), new["message"]
    assert "optimizer.pt is a symbolic link" in new["message"] and "nothing was carried" in new["message"]
    for root in (Path(new["remote_dir"]), box.daemon.state_dir):  # the secret's bytes are nowhere
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                assert token.encode() not in path.read_bytes(), path
    assert box.daemon.record(source["id"])["state"] == "stopped"  # still resumable where it was


def test_a_target_the_policy_keeps_from_a_user_is_refused_at_start_resume_and_move(box: Box) -> None:
    alice, bob = box.alice, box.bob
    job = job_file(box)
    out = box.obd(alice, "train", "start", "--target", "kept", "--", f"{box.venv}/bin/python", str(job))
    assert out.returncode != 0
    said = out.stderr
    assert f"{alice.name} may not use target kept" in said and "target_users" in said, said
    assert "ask the administrator" in said
    source = stopped_run(box)
    out = box.obd(alice, "train", "resume", source["id"], "--target", "kept")
    assert out.returncode != 0 and f"{alice.name} may not use target kept" in out.stderr, out.stderr
    running = box.start(alice, f"{box.venv}/bin/python", str(job))
    box.daemon.wait_state(running, "running", timeout=120)
    out = box.obd(alice, "train", "move", running, "--to", "kept")
    assert out.returncode != 0 and f"{alice.name} may not use target kept" in out.stderr, out.stderr
    record = box.daemon.record(running)
    assert record["state"] == "running" and not record.get("move"), record  # nothing asked of the run
    # A placement naming it is refused too; bob, whom the rule names, may use it.
    out = box.obd(alice, "train", "start", "--target", "other,kept", "--", "true")
    assert out.returncode != 0 and "may not use target kept" in out.stderr, out.stderr
    rid = box.start(bob, "true", opts=("--target", "kept"))
    box.daemon.wait_state(rid, "succeeded", timeout=120)
    box.obd(alice, "train", "cancel", running)
