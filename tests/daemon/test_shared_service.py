"""obd as the GPU box's shared service (issue 12): a root daemon runs each user's job as that
user, with that user's environment, and keeps every run private to its owner.

Root only: the tests create throwaway users (and a group for the socket) and delete them;
the fixtures that do it are in tests/users.py, shared with the web view's tests.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import json
import os
import stat
import subprocess
import uuid
from pathlib import Path

from tests import users
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts, box = users.accounts, users.box  # the fixtures, shared with the web view's tests


def test_a_users_job_runs_as_them_with_their_environment_and_not_the_daemons(box: Box) -> None:
    alice = box.alice
    script = (
        'echo "id=$(id -u):$(id -g)"; echo "groups=$(id -G)"; echo "myvar=$MYVAR"; '
        'echo "python=$(command -v python3)"; echo "home=$HOME"; echo "daemon=$DAEMON_ONLY_SECRET"; '
        'echo "umask=$(umask)"; touch made-by-the-job; mkdir -p "$OBD_OUTPUT_DIR"; echo w > "$OBD_OUTPUT_DIR/model.bin"'
    )
    env = box.env(alice, MYVAR="x-from-alice")
    work = alice.home / "work"
    subprocess.run(["install", "-d", "-o", str(alice.uid), "-g", str(alice.gid), str(work)], check=True)
    rid = box.start(alice, "sh", "-c", script, env=env)
    record = box.daemon.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    log = box.obd(alice, "train", "logs", rid)
    assert log.returncode == 0, log.stderr
    lines = dict(line.split("=", 1) for line in log.stdout.splitlines() if "=" in line)
    assert lines["id"] == f"{alice.uid}:{alice.gid}"
    assert str(grp.getgrnam(box.group).gr_gid) in lines["groups"].split()
    assert lines["myvar"] == "x-from-alice"
    assert lines["python"] == f"{box.venv}/bin/python3"
    assert lines["home"] == str(alice.home)
    assert lines["daemon"] == ""  # the daemon's own environment never reaches a job
    made = alice.home / "made-by-the-job"
    assert made.stat().st_uid == alice.uid
    rd = Path(record["remote_dir"])
    for path in (rd, rd / "job.log", rd / "output" / "model.bin"):
        assert path.stat().st_uid == alice.uid, path
    assert record["owner"] == alice.name and record["owner_uid"] == alice.uid
    assert record["job"]["cwd"] == str(alice.home) and record["job"]["python"] == f"{box.venv}/bin/python3"
    status = box.obd(alice, "train", "status", rid)
    assert f"python {box.venv}/bin/python3" in status.stdout and f"in {alice.home}" in status.stdout


def test_another_user_can_neither_act_on_nor_read_a_run_but_root_can(box: Box) -> None:
    rid = box.start(box.alice, "sh", "-c", "echo private-output-of-alice; sleep 60")
    box.daemon.wait_state(rid, "running")
    bob = box.bob
    for args in (
        ("status", rid),
        ("logs", rid),
        ("stop", rid),
        ("cancel", rid),
        ("outputs", rid, "--to", "x"),
        ("metrics", rid),
    ):
        out = box.obd(bob, "train", *args)
        assert out.returncode == 77, (args, out.returncode, out.stderr)
        assert "not yours" in out.stderr and "private-output" not in out.stdout + out.stderr
    mine = json.loads(box.obd(bob, "train", "list", "--json").stdout)
    assert rid not in [r["id"] for r in mine]
    everyone = json.loads(box.obd(bob, "train", "list", "--all", "--json").stdout)
    [theirs] = [r for r in everyone if r["id"] == rid]
    assert theirs["owner"] == box.alice.name and theirs["message"] == "" and "command" not in theirs
    assert box.daemon.record(rid)["state"] == "running"  # nothing bob did reached it
    # Root may.
    assert box.daemon.cli("train", "status", rid).returncode == 0
    assert box.daemon.cli("train", "cancel", rid, "--wait").returncode == 0


def test_no_value_reaches_a_command_line_a_log_a_record_or_a_file_others_can_read(box: Box) -> None:
    alice = box.alice
    secret, value = "s3cret-" + uuid.uuid4().hex, "v4lue-" + uuid.uuid4().hex
    env = box.env(alice, TOKEN=secret, MYVAR=value)
    rid = box.start(
        alice,
        "sh",
        "-c",
        'test -n "$TOKEN" && test -n "$VISIBLE" && sleep 30',
        opts=("--secret", "TOKEN", "--env", f"VISIBLE={value}"),
        env=env,
    )
    box.daemon.wait_state(rid, "running")
    cmdlines = b""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            cmdlines += Path(f"/proc/{pid}/cmdline").read_bytes()
    assert secret.encode() not in cmdlines and value.encode() not in cmdlines
    box.daemon.call("cancel", id=rid)
    box.daemon.wait_state(rid, "cancelled")
    assert secret not in box.daemon.log_path.read_text() and value not in box.daemon.log_path.read_text()
    for root, _dirs, files in os.walk(box.daemon.state_dir):
        for name in files:
            path = Path(root) / name
            if path.is_symlink():
                continue
            try:  # its mode and bytes from one open file: a save may rename it meanwhile
                with path.open("rb") as f:
                    mode, data = os.fstat(f.fileno()).st_mode, f.read()
            except FileNotFoundError:
                continue  # a save's temporary file renamed since the walk listed it (the record it replaced is read)
            if name == "run.json":
                assert secret.encode() not in data and value.encode() not in data, path
            if mode & 0o044:  # readable by a group or by others
                assert secret.encode() not in data and value.encode() not in data, path


def test_state_records_and_run_directories_are_private(box: Box) -> None:
    rid = box.start(box.alice, "sh", "-c", "echo hi")
    record = box.daemon.wait_state(rid, "succeeded")
    state = box.daemon.state_dir
    assert stat.S_IMODE(state.stat().st_mode) & 0o044 == 0
    assert stat.S_IMODE((state / "runs").stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "runs" / rid / "run.json").stat().st_mode) == 0o600
    rd = Path(record["remote_dir"])
    assert stat.S_IMODE(rd.stat().st_mode) == 0o700
    assert stat.S_IMODE((rd / "job.log").stat().st_mode) & 0o077 == 0
    # Bob cannot list the run directories, nor enter alice's.
    for path in (state / "jobs", rd):
        out = subprocess.run(["ls", str(path)], check=False, user=box.bob.uid, group=box.bob.gid, capture_output=True)
        assert out.returncode != 0, path


def test_outputs_copies_a_checkpoint_into_a_directory_the_caller_owns(box: Box) -> None:
    alice = box.alice
    script = (
        'mkdir -p "$OBD_OUTPUT_DIR/checkpoint-3" && head -c 300000 /dev/urandom > "$OBD_OUTPUT_DIR/checkpoint-3/adapter.bin"'
        ' && echo final > "$OBD_OUTPUT_DIR/adapter_config.json"'
    )
    rid = box.start(alice, "sh", "-c", script)
    record = box.daemon.wait_state(rid, "succeeded")
    src = Path(record["remote_dir"]) / "output" / "checkpoint-3" / "adapter.bin"
    out = box.obd(alice, "train", "outputs", rid, "--to", "mine", "--checkpoint", "latest")
    assert out.returncode == 0, out.stderr
    copy = alice.home / "mine" / "adapter.bin"
    assert copy.stat().st_uid == alice.uid and (alice.home / "mine").stat().st_uid == alice.uid
    assert hashlib.sha256(copy.read_bytes()).hexdigest() == hashlib.sha256(src.read_bytes()).hexdigest()
    again = box.obd(alice, "train", "outputs", rid, "--to", "mine")
    assert again.returncode == 1 and "not empty" in again.stderr  # never written into
    whole = box.obd(alice, "train", "outputs", rid, "--to", "all")
    assert whole.returncode == 0 and (alice.home / "all" / "adapter_config.json").read_text() == "final\n"


def test_a_user_without_access_to_the_socket_is_told_who_may_use_it(box: Box, accounts) -> None:
    os.chmod(box.daemon.socket, 0o600)  # the group's access withdrawn
    try:
        out = box.obd(box.alice, "train", "list")
        assert out.returncode == 69
        assert (
            "permission denied" in out.stderr
            and "socket_group" in out.stderr
            and "obd daemon" not in out.stderr.split("start")[0]
        )
    finally:
        os.chmod(box.daemon.socket, 0o660)


def test_env_clear_starts_from_an_empty_environment(box: Box) -> None:
    alice = box.alice
    rid = box.start(
        alice,
        "sh",
        "-c",
        'echo "myvar=$MYVAR path=$PATH home=$HOME"',
        opts=("--env-clear",),
        env=box.env(alice, MYVAR="should-not-pass"),
    )
    box.daemon.wait_state(rid, "succeeded")
    log = box.obd(alice, "train", "logs", rid).stdout
    assert "myvar= " in log and f"home={alice.home}" in log and "path=/usr/local/bin:/usr/bin:/bin" in log


def test_obd_names_and_names_given_twice_are_refused(box: Box) -> None:
    alice = box.alice
    env = box.env(alice, K="1")
    for opts, words in (
        (("--env", "OBD_RUN_DIR=/tmp/x"), "OBD_"),
        (("--secret", "OBD_RUN_DIR"), "OBD_"),
        (("--env", "PYTHONPATH=/x"), "PYTHONPATH"),
        (("--env", "K=a", "--secret", "K"), "once"),
        (("--env", "K=a", "--env", "K=b"), "twice"),
    ):
        out = box.obd(alice, "train", "start", *opts, "--", "true", env={**env, "OBD_RUN_DIR": "/x"})
        assert out.returncode == 2 and words in out.stderr, (opts, out.stderr)


def test_a_job_of_a_user_sees_the_callers_sys_executable_as_its_python(box: Box) -> None:
    """The shipped unit's PATH is not the user's: `python3` resolves through the caller's PATH."""
    alice = box.alice
    rid = box.start(alice, "python3", "-c", "import sys; print(sys.executable)")
    box.daemon.wait_state(rid, "succeeded")
    assert box.obd(alice, "train", "logs", rid).stdout.strip() == f"{box.venv}/bin/python3"
