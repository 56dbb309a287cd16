"""Helpers shared by the SSH executor tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio

from daemon.service.config import SshTarget
from executors.base import JobHandle, JobSpec, JobState, JobStatus
from executors.ssh import SshExecutor
from tests.sshd import SshServer


def make_target(server: SshServer, workdir: Path | str, **overrides: object) -> SshTarget:
    """An SshTarget for `server` with short timeouts, as a test wants them."""
    fields: dict[str, object] = {
        "kind": "ssh",
        "workdir": str(workdir),
        "connect_timeout": 5,
        "keepalive": 5,
        "python": sys.executable,
        **server.target_fields(),
    }
    fields.update(overrides)
    return SshTarget.model_validate(fields)


async def wait_state(ex: SshExecutor, handle: JobHandle, run_dir: str, timeout: float = 10) -> JobStatus:
    """Poll until the job is no longer running."""
    with anyio.fail_after(timeout):
        while True:
            status = await ex.status(handle, run_dir)
            if status.state != JobState.running:
                return status
            await anyio.sleep(0.05)


async def wait_file(path: Path, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not path.exists():
            await anyio.sleep(0.02)


def group_environs(pgid: int) -> list[bytes]:
    """The environments of the processes of a process group."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            if int(stat[stat.rfind(b")") + 2 :].split()[2]) == pgid:
                out.append(Path(f"/proc/{pid}/environ").read_bytes())
        except (OSError, ValueError, IndexError):
            continue
    return out


def job(run_dir: Path, script: str, **kw: object) -> JobSpec:
    return JobSpec(run_id=run_dir.name, remote_dir=str(run_dir), command=["sh", "-c", script], **kw)
