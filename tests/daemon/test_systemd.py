"""systemd integration: the notify protocol against a real datagram socket, the unit, the job scope."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from daemon.service.systemd import Notifier
from executors.local import systemd_scope_prefix
from tests.conftest import REPO, DaemonProc, wait_for


def _listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(15)
    return sock


def _messages(sock: socket.socket, until: str) -> list[str]:
    got: list[str] = []
    while not any(until in m for m in got):
        got.append(sock.recv(4096).decode())
    return got


def test_the_daemon_speaks_systemds_notify_protocol(short_tmp: Path) -> None:
    listener = _listen(short_tmp / "notify.sock")
    d = DaemonProc(short_tmp)
    d.start(extra_env={"NOTIFY_SOCKET": str(short_tmp / "notify.sock"), "WATCHDOG_USEC": "400000"})
    try:
        first = _messages(listener, "READY=1")
        ready = next(m for m in first if "READY=1" in m)
        assert "STATUS=following 0 running runs" in ready
        assert any("WATCHDOG=1" in m for m in _messages(listener, "WATCHDOG=1"))
        # It keeps petting the watchdog at half the interval.
        assert any("WATCHDOG=1" in m for m in _messages(listener, "WATCHDOG=1"))
        d.signal()
        assert any("STOPPING=1" in m for m in _messages(listener, "STOPPING=1"))
    finally:
        d.stop()
        listener.close()


def test_ready_is_sent_only_after_the_records_are_reconciled(short_tmp: Path) -> None:
    d = DaemonProc(short_tmp)
    d.start()
    rid = d.cli("train", "start", "--", "sh", "-c", "sleep 1").stdout.strip()
    run_dir = Path(d.wait_state(rid, "running")["remote_dir"])
    d.kill()
    # The job ends while the daemon is down (its wrapper writes the exit status once every process is gone).
    wait_for(lambda: (run_dir / "exit_code").is_file(), 60, 0.05, "the job's end")
    listener = _listen(short_tmp / "notify.sock")
    d.start(extra_env={"NOTIFY_SOCKET": str(short_tmp / "notify.sock")}, wait=False)
    try:
        ready = next(m for m in _messages(listener, "READY=1") if "READY=1" in m)
        # The job ended while the daemon was down: by READY its record is already final.
        assert "following 0 running runs" in ready
        assert d.record(rid)["state"] == "succeeded"
    finally:
        d.stop()
        listener.close()


def test_an_abstract_notify_socket_is_addressed_with_a_nul_byte() -> None:
    name = f"obd-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).send("STATUS=hello")
        assert sock.recv(100) == b"STATUS=hello"
    finally:
        sock.close()
    assert not Notifier({}).enabled


def test_jobs_are_launched_in_their_own_systemd_scope_under_the_service(short_tmp: Path, monkeypatch) -> None:
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    log = short_tmp / "systemd-run.args"
    fake = bin_dir / "systemd-run"
    # A stand-in that records its arguments and runs the command after its own options.
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'while [ $# -gt 0 ]; do case "$1" in --*) shift;; *) break;; esac; done\n'
        'exec "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("INVOCATION_ID", "0123456789abcdef")
    monkeypatch.delenv("OBD_NO_SCOPE", raising=False)
    assert systemd_scope_prefix("r1")[:2] == [str(fake), "--scope"] or "--scope" in systemd_scope_prefix("r1")
    d = DaemonProc(short_tmp)
    d.env.update(PATH=os.environ["PATH"], INVOCATION_ID="0123456789abcdef")
    d.env.pop("OBD_NO_SCOPE")
    d.start()
    try:
        rid = d.cli("train", "start", "--", "true").stdout.strip()
        assert d.wait_state(rid, "succeeded")["exit_code"] == 0
        args = log.read_text()
        assert "--scope" in args and f"--unit=obd-run-{rid}" in args and "supervisor.py start" in args
    finally:
        d.stop()


def test_a_scope_that_cannot_be_made_falls_back_to_launching_the_job_directly(short_tmp: Path, monkeypatch) -> None:
    bin_dir = short_tmp / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "systemd-run"
    # What systemd-run says for a `User=` service with no user manager to talk to.
    fake.write_text('#!/bin/sh\necho "Failed to connect to bus: No medium found" >&2\nexit 1\n')
    fake.chmod(0o755)
    d = DaemonProc(short_tmp)
    d.env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", INVOCATION_ID="0123456789abcdef")
    d.env.pop("OBD_NO_SCOPE")
    d.start()
    try:
        rid = d.cli("train", "start", "--", "sh", "-c", "echo ran").stdout.strip()
        record = d.wait_state(rid, "succeeded", "failed")
        assert record["state"] == "succeeded", d.log_path.read_text()[-3000:]
        assert d.cli("train", "logs", rid).stdout == "ran\n"  # launched once, not twice
        log = d.log_path.read_text()
        assert "systemd_scope_failed" in log and "Failed to connect to bus" in log
    finally:
        d.stop()


def test_the_shipped_unit_is_a_notify_service_that_kills_no_job_on_restart() -> None:
    unit = (REPO / "systemd" / "obd.service").read_text()
    assert "Type=notify" in unit
    assert "KillMode=process" in unit
    assert "WatchdogSec=" in unit
    assert "ExecStart=" in unit and " daemon" in unit
    assert "NotifyAccess=main" in unit
