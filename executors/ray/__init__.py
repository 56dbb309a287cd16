"""The Ray executor: each run is one job of a Ray cluster, submitted, read and stopped through
Ray's Jobs API (the dashboard's HTTP port; KubeRay exposes the same API).

See `executor.py` for how a job is submitted, read and cancelled, `api.py` for the HTTP client,
`states.py` for what Ray's job states mean to obd, and docs/ray.md for users. Ray itself is never
imported: the daemon speaks HTTP to the cluster.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executors.ray.executor import RayExecutor

__all__ = ["RayExecutor"]


def __getattr__(name: str) -> Any:
    # Lazily, so reading a config (executors.config) never imports the executor.
    if name == "RayExecutor":
        from executors.ray.executor import RayExecutor

        return RayExecutor
    raise AttributeError(name)
