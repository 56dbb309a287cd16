"""Runpod targets: a pod per run. The API client (`api.py`), what obd knows of a pod (`info.py`),
its book (`book.py`), its life (`lifecycle.py`), caps and watchdog (`caps.py`), verified
retrieval (`retrieve.py`), reconcile (`reconcile.py`), and `RunpodDriver` over them (`driver.py`)."""

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
