"""SSH targets: the connection and its reconnects (`connection.py`), files over SFTP
(`files.py`), the persistent helper of each connection (`helper.py`: `jobctl.py serve`, which
answers probes, starts, cancels, reads and writes on one channel), the events its pushes feed
(`events.py`), and the jobs with the `SshExecutor` itself (`executor.py`)."""

from executors.base import AuthError, HostKeyError, WorkdirError
from executors.ssh.executor import SshExecutor

__all__ = ["AuthError", "HostKeyError", "SshExecutor", "WorkdirError"]
