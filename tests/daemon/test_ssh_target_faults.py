"""Faults of an SSH target as a user meets them: `obd train start --target box`, then
`obd train status` (text and --json), under the real daemon against a real sshd.

Each test checks what a person would look at: the run's state, whether its message names the
fix, whether anything was left running or written on the host, and whether the daemon goes on
serving other runs afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import DaemonProc, kill_job_groups, wait_for
from tests.daemon.test_ssh_target import FAKE, PY, ssh_config, start
from tests.sshd import SshServer, running_sshd, write_key_pair


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def box_daemon(make_daemon, server: SshServer, workdir: Path, more: str = "") -> DaemonProc:
    """A started daemon whose [targets.box] reaches `server` with `workdir`; `more` adds sections."""
    d = make_daemon(ssh_config(server, workdir) + more)
    d.start()
    return d


def status_json(d: DaemonProc, rid: str) -> dict:
    out = d.cli("train", "status", rid, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_text(d: DaemonProc, rid: str) -> str:
    out = d.cli("train", "status", rid)
    assert out.returncode == 0, out.stderr
    return out.stdout


def failed_at_start(d: DaemonProc, rid: str) -> dict:
    """The run, once it left `preparing`: it must be `failed` (never left preparing, never running)."""
    record = d.wait_state(rid, "failed", "running", "succeeded", timeout=60)
    assert record["state"] == "failed", record
    assert record["job"] is None  # no job was ever started
    return status_json(d, rid)


def test_a_changed_host_key_fails_the_start_with_the_command_that_fixes_it(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    workdir = short_tmp / "remote"
    sshd.write_known_hosts(write_key_pair(short_tmp / "old_host_key"))  # known_hosts holds another key
    d = box_daemon(make_daemon, sshd, workdir)
    rid = start(d, "sh", "-c", "echo should never run")
    record = failed_at_start(d, rid)
    fix = f"ssh-keygen -R '[127.0.0.1]:{sshd.port}' -f {sshd.known_hosts}"
    assert "launch failed" in record["message"] and "CHANGED" in record["message"]
    assert fix in record["message"]
    text = status_text(d, rid)
    assert "failed" in text and fix in text
    assert not workdir.exists()  # refused before anything was sent: no directory, no job
    # The fix works as printed; with the new key recorded the next start runs.
    subprocess.run(fix, shell=True, check=True, capture_output=True)
    assert sshd.known_hosts.read_text().strip() == ""
    sshd.write_known_hosts()
    time.sleep(1)  # past the executor's first backoff
    again = start(d, "sh", "-c", "echo ran")
    assert d.wait_state(again, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    assert d.cli("train", "logs", again).stdout == "ran\n"


def test_a_wrong_identity_key_fails_the_start_saying_how_to_install_the_key(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    workdir = short_tmp / "remote"
    stranger = short_tmp / "stranger_key"
    write_key_pair(stranger)
    config = ssh_config(sshd, workdir).replace(
        f'identity_file = "{sshd.identity_file}"', f'identity_file = "{stranger}"'
    )
    d = make_daemon(config)
    d.start()
    rid = start(d, "true")
    record = failed_at_start(d, rid)
    message = record["message"]
    assert "launch failed" in message and "permission denied" in message
    assert "authorized_keys" in message and f"ssh-copy-id -i {stranger}" in message
    assert "obd targets check box" in message
    assert message in status_text(d, rid)
    assert not workdir.exists()


def test_a_workdir_that_cannot_be_created_fails_the_start_naming_it_and_the_setting(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    blocker = short_tmp / "a-file"
    blocker.write_text("not a directory")
    workdir = blocker / "obd"
    d = box_daemon(make_daemon, sshd, workdir)
    rid = start(d, "true")
    record = failed_at_start(d, rid)
    message = record["message"]
    assert "launch failed" in message and str(workdir) in message and "cannot be created" in message
    assert "Not a directory" in message and "Set workdir in [targets.box]" in message
    assert message in status_text(d, rid)
    assert blocker.read_text() == "not a directory"


@pytest.fixture
def tiny_disk(short_tmp: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs, standing for the host's disk (needs root and mount; skipped otherwise)."""
    mnt = short_tmp / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk ({r.stderr.strip()}); run as root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(directory: Path) -> None:
    """Write into `directory` until its filesystem has no byte left."""
    with open(directory / "filler", "wb", buffering=0) as f:
        try:
            while f.write(b"\0" * 4096):
                pass
        except OSError:
            pass
    assert os.statvfs(directory).f_bavail == 0


ROOMY = """
[targets.roomy]
kind = "ssh"
host = "{host}"
port = {port}
user = "{user}"
identity_file = "{identity_file}"
known_hosts = "{known_hosts}"
workdir = "{workdir}"
python = "{py}"
connect_timeout = 3
"""


def test_a_full_remote_disk_fails_the_start_clearly_and_the_daemon_serves_on(
    make_daemon, sshd: SshServer, short_tmp: Path, tiny_disk: Path
) -> None:
    more = ROOMY.format(**sshd.target_fields(), workdir=short_tmp / "roomy", py=PY)
    d = box_daemon(make_daemon, sshd, tiny_disk / "obd", more=more)
    fill(tiny_disk)  # full before obd ever wrote there
    rid = start(d, "sh", "-c", "echo should never run")
    message = failed_at_start(d, rid)["message"]
    assert "launch failed" in message and str(tiny_disk / "obd") in message
    assert "No space left on device" in message and "is the disk full? check `df -h` there" in message
    assert message in status_text(d, rid)
    # The daemon keeps serving: the list answers, and a run on a target with room works.
    listed = {r["id"]: r["state"] for r in json.loads(d.cli("train", "list", "--json").stdout)}
    assert listed == {rid: "failed"}
    out = d.cli("train", "start", "--target", "roomy", "--", "sh", "-c", "echo room enough")
    assert out.returncode == 0, out.stderr
    later = out.stdout.strip()
    assert d.wait_state(later, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    assert d.cli("train", "logs", later).stdout == "room enough\n"


def test_a_disk_that_filled_up_since_the_last_run_fails_the_next_start_saying_so(
    make_daemon, sshd: SshServer, tiny_disk: Path
) -> None:
    d = box_daemon(make_daemon, sshd, tiny_disk / "obd")
    first = start(d, "sh", "-c", "echo fits")
    assert d.wait_state(first, "succeeded", "failed", timeout=60)["state"] == "succeeded"
    fill(tiny_disk)  # obd's own files are there already: now the run's upload meets the full disk
    rid = start(d, "sh", "-c", "echo should never run")
    message = failed_at_start(d, rid)["message"]
    run_dir = f"{tiny_disk}/obd/{rid}"
    assert "launch failed" in message and f"to {run_dir}/plugin" in message
    assert f"a full disk? check `df -h {run_dir}/plugin` there" in message
    assert message in status_text(d, rid)
    (tiny_disk / "filler").unlink()  # room again: the same target starts runs again
    again = start(d, "sh", "-c", "echo room again")
    assert d.wait_state(again, "succeeded", "failed", timeout=60)["state"] == "succeeded"


def test_a_job_that_hangs_after_its_proof_on_an_ssh_target_is_cancelled_and_recorded_stopped(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    from trainer_plugin.tools import jobctl

    workdir = short_tmp / "remote"
    d = box_daemon(make_daemon, sshd, workdir)
    try:
        rid = start(d, PY, FAKE, "hang-after")
        record = wait_for(lambda: (r := d.record(rid))["snapshots"] and r, 30, what="the plugin's begin line")
        handle = jobctl.read_handle(record["remote_dir"])
        out = d.cli("train", "stop", rid, "--wait", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        record = json.loads(out.stdout)
        assert record["state"] == "stopped"
        assert record["snapshot"]["checkpoint"] == f"output/checkpoint-{record['snapshot']['step']}"
        assert "still ran 3 s after its snapshot" in record["message"]
        assert (Path(record["remote_dir"]) / "cancelled").exists()
        assert handle is not None and not jobctl.handle_alive(handle)  # the hung job is gone from the host
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


def test_a_host_key_that_changes_during_a_follow_keeps_the_run_running_and_status_gives_the_fix(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    from trainer_plugin.tools import jobctl

    workdir = short_tmp / "remote"
    gate = short_tmp / "gate"
    d = box_daemon(make_daemon, sshd, workdir)
    try:
        rid = start(d, "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; echo finished")
        d.wait_state(rid, "running")
        sshd.rotate_host_key()
        sshd.restart()
        wait_for(lambda: d.record(rid)["unreachable_since"], 30, 0.1, "the host to be seen unreachable")
        fix = f"ssh-keygen -R '[127.0.0.1]:{sshd.port}' -f {sshd.known_hosts}"
        text = wait_for(lambda: fix in (t := status_text(d, rid)) and t, 30, 0.2, "status to give the fix")
        assert "unreachable since" in text and "CHANGED" in text
        assert "(exit 255)" not in text  # a connection cut mid-probe reads as lost, not as a failed command
        time.sleep(2)  # a few more polls fail on the key: the run stays running, the job runs on
        record = status_json(d, rid)
        assert record["state"] == "running" and record["unreachable_since"]
        assert jobctl.handle_alive(jobctl.read_handle(record["remote_dir"]))
        # The user applies the fix; the follow picks the run up again and sees it end.
        subprocess.run(fix, shell=True, check=True, capture_output=True)
        sshd.write_known_hosts()
        gate.touch()
        record = d.wait_state(rid, "succeeded", "failed", timeout=60)
        assert record["state"] == "succeeded" and record["unreachable_since"] is None
        assert d.cli("train", "logs", rid).stdout == "finished\n"
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))
