"""The Slurm executor: jobs submitted with sbatch on this machine or on a login node over SSH.

See `executor.py` for how a job is submitted, read and cancelled, `script.py` for what sbatch is
given, `states.py` for what Slurm's job states mean to obd, and docs/slurm.md for users.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executors.slurm.executor import SlurmExecutor

__all__ = ["SlurmExecutor"]


def __getattr__(name: str) -> Any:
    # Lazily, so reading a config (executors.config) never imports asyncssh or the executor.
    if name == "SlurmExecutor":
        from executors.slurm.executor import SlurmExecutor

        return SlurmExecutor
    raise AttributeError(name)
