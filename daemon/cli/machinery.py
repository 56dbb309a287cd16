"""The one door from the `obd` command into obd's machinery, for the commands that run it in their
own process instead of asking the daemon: `obd daemon` (the service), `obd targets check` and
`obd pods` (the executors and the Runpod API, so they work while the daemon is down), and
`obd profile parse` and `obd train metrics`' table (the runner, on pydantic).

The client imports none of that anywhere else, at import time or later: the contract between the
client and the service (pyproject.toml) holds with no ignored import, and `obd train list` stays
on the standard library. An entry is imported by name here, only when its command runs
(tests/test_layers.py checks that no other client module reaches past this door).
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

ENTRIES = {
    "daemon": "daemon.service.commands:run_daemon",  # obd daemon
    "admin": "daemon.service.commands:admin_main",  # obd targets check, obd pods
    "profile": "runner.cli:profile_parse_main",  # obd profile parse
    "format_metrics": "runner.format:format_metrics",  # obd train metrics, as a table
}


def entry(name: str) -> Callable[..., Any]:
    """The function behind the door `name` (a key of ENTRIES), imported now."""
    module, _, attr = ENTRIES[name].partition(":")
    function: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return function
