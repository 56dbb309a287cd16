"""obd's Python API: `from obd import Client` (sync) or `from obd import AsyncClient` (async).

    from obd import Client

    with Client() as obd:                       # the socket `obd` finds (OBD_SOCKET, the config...)
        run = obd.start(["python", "train.py"], name="sft", gpus=2)
        run.wait("running")
        run.stop(wait=True)                     # a verified snapshot, then stopped
        print(run.resume().wait().state)

The API is implemented in daemon/cli/sdk.py (and daemon/cli/aio.py for AsyncClient); this
module only names it. Importing it imports the standard library and obd's client, never torch,
transformers, pydantic or anyio: anyio is imported when `AsyncClient` is first asked for.
Every exception is an `ObdError` whose `exit_code` is the code the `obd` command gives it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from daemon.cli.sdk import Client, Run
from daemon.cli.sdk_results import (
    BadRequest,
    DaemonBusy,
    DaemonUnreachable,
    Denied,
    ExecResult,
    NotFound,
    ObdError,
    Outputs,
    Progress,
    RequestFailed,
    RunError,
    RunStatus,
    Snapshot,
    SweepStarted,
    WaitTimeout,
)
from daemon.common.wire import FINAL, STATES

if TYPE_CHECKING:
    from daemon.cli.aio import AsyncClient, AsyncRun

_ASYNC = ("AsyncClient", "AsyncRun")


def __getattr__(name: str) -> Any:
    """`AsyncClient` and `AsyncRun`, imported (with anyio) only when asked for."""
    if name in _ASYNC:
        from daemon.cli import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'obd' has no attribute {name!r}")


__all__ = [
    "FINAL",
    "STATES",
    "AsyncClient",
    "AsyncRun",
    "BadRequest",
    "Client",
    "DaemonBusy",
    "DaemonUnreachable",
    "Denied",
    "ExecResult",
    "NotFound",
    "ObdError",
    "Outputs",
    "Progress",
    "RequestFailed",
    "Run",
    "RunError",
    "RunStatus",
    "Snapshot",
    "SweepStarted",
    "WaitTimeout",
]
