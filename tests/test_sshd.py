"""The test sshd (tests/sshd.py) ends what it started: a job that detached from its SSH session
(as a pod's job and watchdog do) does not outlive the server's `close`."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tests.sshd import SshServer, sshd_skip_reason


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


@pytest.mark.skipif(sshd_skip_reason() is not None or shutil.which("ssh") is None, reason="needs sshd and ssh")
def test_a_job_detached_over_ssh_ends_when_the_server_is_closed() -> None:
    server = SshServer().start()
    job = None
    try:
        out = subprocess.run(
            [
                "ssh",
                "-p",
                str(server.port),
                "-i",
                str(server.identity_file),
                "-o",
                f"UserKnownHostsFile={server.known_hosts}",
                "-o",
                "BatchMode=yes",
                f"{server.user}@{server.host}",
                "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        job = int(out.stdout.split()[-1])
        assert _alive(job)  # it outlived its session
        # Known as the session's. Read once its exec is done: in the middle of one the kernel shows
        # an empty environment (a fresh-clone CI read it then).
        marker = f"PYTEST_OBD_SESSION={os.environ['PYTEST_OBD_SESSION']}".encode()
        wait_for(lambda: marker in Path(f"/proc/{job}/environ").read_bytes().split(b"\0"), 10, 0.02, "its environ")
        server.close()
        assert not _alive(job)
        assert all(reaper.poll() is not None for reaper in server.reapers)
    finally:
        server.close()
        if job is not None:
            with contextlib.suppress(OSError):
                os.kill(job, signal.SIGKILL)
