"""SSH targets: the connection and its reconnects (`connection.py`), files over SFTP
(`files.py`), and the jobs with the `SshExecutor` itself (`executor.py`)."""

from executors.base import AuthError, HostKeyError, WorkdirError
from executors.ssh.executor import SshExecutor

__all__ = ["AuthError", "HostKeyError", "SshExecutor", "WorkdirError"]
