"""The wire contract between the `obd` command and the service: the run states and the limits of
the control socket (standard library only, so the client imports it at no cost).

The request and reply messages themselves are `daemon/api.py` (pydantic, the service's side);
the run directory's contract is `trainer_plugin/rundir.py`.
"""

from __future__ import annotations

from enum import Enum


class RunState(str, Enum):
    """A run's state (docs/contract.md: "Run states")."""

    queued = "queued"  # waiting for GPUs on its target, or for a scheduler (Slurm) to start it
    preparing = "preparing"
    running = "running"
    stopped = "stopped"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def final(self) -> bool:
        return self in FINAL_STATES


FINAL_STATES = frozenset({RunState.stopped, RunState.succeeded, RunState.failed, RunState.cancelled})
STATES = tuple(s.value for s in RunState)  # as the client names them, in their order
FINAL = frozenset(s.value for s in FINAL_STATES)

MAX_MESSAGE = 1 << 20  # the daemon's limit on one request
READ_LIMIT = 1 << 20  # the most bytes one `read` answers
MAX_TAIL_LINES = 100_000  # the most lines one `read` may ask to start from the end
MAX_OFFSET = (1 << 63) - 1  # the largest file offset a read may ask for (off_t is signed 64 bits)
