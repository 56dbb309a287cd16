"""Secrets kept only while needed (issue 22, item 8).

The client sends its environment only for a target whose jobs start from it (a local one), and
the daemon keeps a run's launch settings (launch.json: the caller's environment, `--env` values,
secrets) only while an attempt of its chain may still start: the file is deleted when the chain
ends. A resume takes the resumer's values, never the stored ones. Each test puts unique marker
values in the client's environment, in --env and in --secret, and greps for them on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, kill_job_groups, wait_for
from tests.daemon.test_ssh_target import ssh_config
from tests.sshd import SshServer, running_sshd


class Markers:
    """One unique value for each way a value reaches a run: the caller's shell, --env, --secret."""

    def __init__(self) -> None:
        self.environ = "environ-" + uuid.uuid4().hex
        self.env = "env-" + uuid.uuid4().hex
        self.secret = "secret-" + uuid.uuid4().hex

    @property
    def all(self) -> tuple[str, str, str]:
        return self.environ, self.env, self.secret

    def client_env(self) -> dict[str, str]:
        return {"MARK_ENVIRON": self.environ, "TOKEN": self.secret}

    def opts(self) -> tuple[str, ...]:
        return ("--env", f"VISIBLE={self.env}", "--secret", "TOKEN")


def holding(roots: list[Path], values: tuple[str, ...]) -> list[str]:
    """Every file under `roots` (links not followed) holding any of `values`, and which."""
    found = []
    wanted = [v.encode() for v in values]
    for root in roots:
        for path in [root] if root.is_file() else root.rglob("*"):
            if path.is_symlink() or not path.is_file():
                continue
            try:
                data = path.read_bytes()
            except OSError:
                continue
            found += [f"{path}: {v.decode()[:12]}..." for v in wanted if v in data]
    return found


def start(d: DaemonProc, *command: str, opts: tuple[str, ...], env: dict[str, str]) -> str:
    out = d.cli("train", "start", *opts, "--", *command, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


# The job checks that each value reached it (so each was sent), without ever printing one.
CHECK = '[ -n "$MARK_ENVIRON" ] && [ -n "$VISIBLE" ] && [ -n "$TOKEN" ] || exit 9'


@pytest.mark.parametrize(
    ("ending", "script", "final"),
    [
        ("succeeds", f"{CHECK}; exit 0", "succeeded"),
        ("fails", f"{CHECK}; exit 5", "failed"),
        ("is cancelled", f'{CHECK}; touch "$OBD_RUN_DIR/checked"; sleep 60', "cancelled"),
    ],
)
def test_once_a_run_ends_no_value_of_its_callers_environment_env_or_secrets_is_left_under_the_state_dir(
    daemon: DaemonProc, ending: str, script: str, final: str
) -> None:
    marks = Markers()
    rid = start(daemon, "sh", "-c", script, opts=marks.opts(), env=marks.client_env())
    if final == "cancelled":
        record = wait_for(lambda: (r := daemon.record(rid))["remote_dir"] and r, 30, what="the run directory")
        wait_for(lambda: (Path(record["remote_dir"]) / "checked").exists(), 30, what="the job to check its values")
        # While it may still be needed, the copy is root's alone: 0600 in a 0700 directory.
        spec = daemon.state_dir / "runs" / rid / "launch.json"
        assert stat.S_IMODE(spec.stat().st_mode) == 0o600 and spec.stat().st_uid == os.geteuid()
        assert stat.S_IMODE(spec.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((daemon.state_dir / "runs").stat().st_mode) == 0o700
        daemon.call("cancel", id=rid)
    record = daemon.wait_state(rid, final)
    assert record["exit_code"] != 9, "a value never reached the job"
    wait_for(lambda: not holding([daemon.state_dir, daemon.log_path], marks.all), 10, what="the values to go")
    assert not (daemon.state_dir / "runs" / rid / "launch.json").exists()


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def test_an_ssh_run_never_stores_the_callers_shell_environment_and_drops_its_values_when_it_ends(
    make_daemon: Any, sshd: SshServer, short_tmp: Path
) -> None:
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir))
    d.start()
    try:
        marks = Markers()
        # The shell's variable never reaches an SSH job; --env and --secret do.
        script = '[ -z "$MARK_ENVIRON" ] && [ -n "$VISIBLE" ] && [ -n "$TOKEN" ] || exit 9; touch "$OBD_RUN_DIR/checked"; sleep 3'
        rid = start(d, "sh", "-c", script, opts=("--target", "box", *marks.opts()), env=marks.client_env())
        record = wait_for(lambda: (r := d.record(rid))["remote_dir"] and r, 30, what="the run directory")
        checked = Path(record["remote_dir"]) / "checked"
        while d.record(rid)["state"] not in ("succeeded", "failed"):
            time.sleep(0.1)
            # At any time: the shell's environment is nowhere, neither here nor on the target.
            assert not holding([d.state_dir, d.log_path, workdir], (marks.environ,))
        record = d.wait_state(rid, "succeeded", "failed")
        assert record["state"] == "succeeded", record["message"]
        assert checked.exists()
        wait_for(lambda: not holding([d.state_dir, d.log_path, workdir], marks.all), 10, what="the values to go")
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


def test_a_retried_chain_gets_its_values_on_attempt_2_and_drops_them_after_the_last(make_daemon: Any) -> None:
    d = make_daemon(FAST_CONFIG + '\n[retry]\nbackoff = "0.5s"\n')
    d.start()
    marks = Markers()
    digest = hashlib.sha256("".join(marks.all).encode()).hexdigest()
    # Each attempt prints a digest of the three values (never a value) and fails.
    script = 'printf %s "$MARK_ENVIRON$VISIBLE$TOKEN" | sha256sum; exit 3'
    first = start(d, "sh", "-c", script, opts=("--retry", "1", *marks.opts()), env=marks.client_env())
    d.wait_state(first, "failed")
    second = wait_for(lambda: d.record(first)["retried_by"], 30, what="attempt 2")
    record = d.wait_state(second, "failed")
    assert record["attempt"] == 2 and record["retried_by"] is None
    assert digest in (Path(record["remote_dir"]) / "job.log").read_text()  # attempt 2 had every value
    assert digest in (Path(d.record(first)["remote_dir"]) / "job.log").read_text()
    wait_for(lambda: not holding([d.state_dir, d.log_path], marks.all), 10, what="the values to go")
    for rid in (first, second):
        assert not (d.state_dir / "runs" / rid / "launch.json").exists()


CHECKPOINT = (
    'mkdir -p "$OBD_OUTPUT_DIR/checkpoint-1" && echo \'{"global_step": 1}\' > "$OBD_OUTPUT_DIR/checkpoint-1/trainer_state.json"'
    ' && echo w > "$OBD_OUTPUT_DIR/checkpoint-1/adapter_model.safetensors"; echo "mark=$MARK shell=$SHELLVAR"'
)


def test_a_resume_gets_the_resumers_environment_never_the_stored_one(daemon: DaemonProc) -> None:
    old_mark, first_shell, second_shell = (f"{w}-{uuid.uuid4().hex[:8]}" for w in ("old", "first", "second"))
    rid = start(daemon, "sh", "-c", CHECKPOINT, opts=("--env", f"MARK={old_mark}"), env={"SHELLVAR": first_shell})
    first = daemon.wait_state(rid, "succeeded")
    assert f"mark={old_mark} shell={first_shell}" in (Path(first["remote_dir"]) / "job.log").read_text()
    out = daemon.cli("train", "resume", rid, "--again", env={"SHELLVAR": second_shell})
    assert out.returncode == 0, out.stderr
    second = daemon.wait_state(out.stdout.strip(), "succeeded")
    assert second["resumed_from"] == rid
    assert "mark= shell=" + second_shell in (Path(second["remote_dir"]) / "job.log").read_text()
    assert "--env MARK" in out.stderr  # and told that the old value is not carried over


# --- the client: its environment only for a target that uses it ----------------------------------


# As the daemon answers `targets`: each kind's capabilities beside its label.
TARGETS = [
    {"name": "local", "kind": "local", "this_machine": True, "pods": False},
    {"name": "box", "kind": "ssh", "this_machine": False, "pods": False},
    {"name": "here", "kind": "local", "this_machine": True, "pods": False},
]


class FakeDaemon:
    """A socket that answers like the daemon and keeps every request the client sent."""

    def __init__(self, path: Path) -> None:
        self.requests: list[dict[str, Any]] = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rwb") as f:
                for line in f:
                    request = json.loads(line)
                    self.requests.append(request)
                    result: Any = {"id": "20250101-000000-abcdef", "target": "box", "env_names": []}
                    if request["op"] == "targets":
                        result = TARGETS
                    f.write(json.dumps({"ok": True, "result": result}).encode() + b"\n")
                    f.flush()

    def close(self) -> None:
        self.sock.close()


def client(socket_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    """`obd ARGS` against `socket_path`, with a unique value in its environment."""
    mark = "m-" + uuid.uuid4().hex
    env = {**os.environ, "OBD_SOCKET": str(socket_path), "MARK_ENVIRON": mark}
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out, mark


def test_the_client_sends_its_environment_only_for_a_target_whose_jobs_start_from_it(short_tmp: Path) -> None:
    for args, sent, asked in (
        (("--target", "box"), False, True),  # SSH: never sent
        ((), True, False),  # no --target: local, and no question asked
        (("--target", "local"), True, False),
        (("--target", "here"), True, True),  # another local target, as the daemon's config says
        (("--target", "local", "--env-clear"), False, False),  # an empty environment needs none of it
    ):
        path = short_tmp / f"fake-{uuid.uuid4().hex[:6]}.sock"
        fake = FakeDaemon(path)
        try:
            _, mark = client(path, "train", "start", *args, "--", "true")
        finally:
            fake.close()
        [begin] = [r for r in fake.requests if r["op"] == "start"]
        assert (begin.get("environ") is not None) == sent, args
        assert (mark in json.dumps(fake.requests)) == sent, args
        assert any(r["op"] == "targets" for r in fake.requests) == asked, args


def test_the_client_does_not_send_its_environment_to_resume_a_run_of_an_ssh_target(short_tmp: Path) -> None:
    fake = FakeDaemon(short_tmp / "fake.sock")
    try:
        _, mark = client(short_tmp / "fake.sock", "train", "resume", "20250101-000000-abcdef")
    finally:
        fake.close()
    [resume] = [r for r in fake.requests if r["op"] == "resume"]
    assert resume.get("environ") is None and mark not in json.dumps(fake.requests)
