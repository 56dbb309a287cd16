"""The wire contract between the `obd` command and the service: the run states and the limits of
the control socket (standard library only, no enum even, so the client imports it at no cost).

The service's `RunState` enum (daemon/service/models.py) is made of these names; the request and reply
messages are `daemon/service/api.py` (pydantic, the service's side); the run directory's contract is
`trainer_plugin/rundir.py`.
"""

from __future__ import annotations

# A run's states (docs/contract.md: "Run states"), in their order.
QUEUED, PREPARING, RUNNING = "queued", "preparing", "running"  # queued: waiting for GPUs or a scheduler
STOPPED, SUCCEEDED, FAILED, CANCELLED = "stopped", "succeeded", "failed", "cancelled"
STATES = (QUEUED, PREPARING, RUNNING, STOPPED, SUCCEEDED, FAILED, CANCELLED)
FINAL = frozenset({STOPPED, SUCCEEDED, FAILED, CANCELLED})

MAX_MESSAGE = 1 << 20  # the daemon's limit on one request
READ_LIMIT = 1 << 20  # the most bytes one `read` answers
MAX_TAIL_LINES = 100_000  # the most lines one `read` may ask to start from the end
MAX_OFFSET = (1 << 63) - 1  # the largest file offset a read may ask for (off_t is signed 64 bits)
