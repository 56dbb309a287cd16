"""SSH targets: the connection and its reconnects (`connection.py`), files over SFTP
(`files.py`), the persistent helper of each connection (`helper.py`: `jobctl.py serve`, which
answers probes, starts, cancels, reads and writes on one channel), the events its pushes feed
(`events.py`), and the jobs with the `SshExecutor` itself (`executor.py`).

`SshExecutor` is imported on first use (PEP 562): the kinds registry imports `kind.py` at the
daemon's start without asyncssh."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from executors.base import AuthError, HostKeyError, WorkdirError

if TYPE_CHECKING:
    from executors.ssh.executor import SshExecutor

__all__ = ["AuthError", "HostKeyError", "SshExecutor", "WorkdirError"]


def __getattr__(name: str) -> Any:
    if name == "SshExecutor":
        from executors.ssh.executor import SshExecutor

        return SshExecutor
    raise AttributeError(f"module 'executors.ssh' has no attribute {name!r}")
