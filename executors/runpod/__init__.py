"""Runpod targets: a pod per run. The API client (`api.py`), what obd knows of a pod (`info.py`),
its book (`book.py`), its life (`lifecycle.py`), caps and watchdog (`caps.py`), verified
retrieval (`retrieve.py`), reconcile (`reconcile.py`), and `RunpodDriver` over them (`driver.py`).

The names below are imported on first use (PEP 562), so the kinds registry can import this
package's `kind.py` at the daemon's start without the driver, the API client or their imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as they are, for type checkers
    from executors.runpod.api import (
        AuthError,
        NoCapacity,
        Pod,
        RunpodApi,
        RunpodApiError,
        TransientError,
        UnknownGpu,
        resolve_api_key,
    )
    from executors.runpod.book import BookEntry, PodBook, owner_id
    from executors.runpod.context import POD_PREFIX, PodContext
    from executors.runpod.driver import RunpodDriver
    from executors.runpod.info import PodEnd, PodInfo, PodObservation, PodPhase
    from executors.runpod.lifecycle import PodGone
    from executors.runpod.reconcile import Finding
    from executors.runpod.retrieve import safe_relpath, sha256_local

_WHERE = {
    "AuthError": "api",
    "NoCapacity": "api",
    "Pod": "api",
    "RunpodApi": "api",
    "RunpodApiError": "api",
    "TransientError": "api",
    "UnknownGpu": "api",
    "resolve_api_key": "api",
    "BookEntry": "book",
    "PodBook": "book",
    "owner_id": "book",
    "POD_PREFIX": "context",
    "PodContext": "context",
    "RunpodDriver": "driver",
    "PodEnd": "info",
    "PodInfo": "info",
    "PodObservation": "info",
    "PodPhase": "info",
    "PodGone": "lifecycle",
    "Finding": "reconcile",
    "safe_relpath": "retrieve",
    "sha256_local": "retrieve",
}

__all__ = [
    "POD_PREFIX",
    "AuthError",
    "BookEntry",
    "Finding",
    "NoCapacity",
    "Pod",
    "PodBook",
    "PodContext",
    "PodEnd",
    "PodGone",
    "PodInfo",
    "PodObservation",
    "PodPhase",
    "RunpodApi",
    "RunpodApiError",
    "RunpodDriver",
    "TransientError",
    "UnknownGpu",
    "owner_id",
    "resolve_api_key",
    "safe_relpath",
    "sha256_local",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'executors.runpod' has no attribute {name!r}")
    return getattr(importlib.import_module(f"executors.runpod.{module}"), name)
