"""What a `[targets.NAME]` section of `kind = "ray"` (a Ray cluster's Jobs API) holds: `RayTarget`."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator

from executors.config_base import Margin, PricedTarget, Timeout


class RayTarget(PricedTarget):
    """A Ray cluster reached through its Jobs API (the dashboard's HTTP port, or KubeRay's service).

    Each run is one Ray job whose entrypoint is obd's job wrapper. `workdir` must be on a filesystem
    the daemon and every Ray node share (one machine, or a shared volume): run directories live
    there, and the wrapper writes them from the node the job runs on (docs/ray.md).
    """

    kind: Literal["ray"]
    address: str = "http://127.0.0.1:8265"  # the Jobs API (RAY_API_SERVER_ADDRESS)
    # Sent with every request (a proxy's own headers); values, not secrets.
    headers: dict[str, str] = Field(default_factory=dict)
    # The name of a variable of the daemon's environment whose value is sent as `Authorization:
    # Bearer <value>` (a secured cluster); never written in the config itself.
    token_env: str | None = None
    workdir: str = "~/obd"  # on the filesystem the Ray nodes share with the daemon
    python: str = "python3"  # the job's interpreter, looked up on the PATH the Ray node started with
    # What each run's job asks of the cluster (Ray's entrypoint_num_cpus/num_gpus/memory/resources).
    num_cpus: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    num_gpus: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    memory: int | None = Field(default=None, ge=0)  # bytes
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, such as {"node_a": 1}
    # A multi-node run (docs/ray.md): a placement group of `nodes` bundles, one a Ray node
    # (STRICT_SPREAD), each asking the resources above; the command runs on each node as given, or
    # under torchrun with its c10d rendezvous on the first bundle's node (`launcher`).
    nodes: int = Field(default=1, ge=1, le=1000)
    launcher: Literal["command", "torchrun"] = "command"
    nproc_per_node: int | None = Field(default=None, ge=1, le=1024)  # torchrun's; default num_gpus or 1
    # Ray's runtime_env for every job, in Ray's terms (pip, conda, env_vars, working_dir as a URI).
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    # How long Ray waits after its SIGTERM before its SIGKILL when obd cancels a job (Ray's
    # RAY_JOB_STOP_WAIT_TIME_S, set for each job obd submits; Ray's own default is 3 s).
    stop_wait: Margin = 30.0
    request_timeout: Timeout = 30.0  # one Jobs API request

    @field_validator("address")
    @classmethod
    def _http_address(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError(
                f"address {value!r} is not the Jobs API's address: use http://HOST:PORT (the dashboard port, "
                "8265 by default), as RAY_API_SERVER_ADDRESS takes it"
            )
        return value.rstrip("/")

    @field_validator("runtime_env")
    @classmethod
    def _runtime_env_in_rays_terms(cls, value: dict[str, Any]) -> dict[str, Any]:
        working_dir = value.get("working_dir")
        if working_dir is not None and (not isinstance(working_dir, str) or "://" not in working_dir):
            raise ValueError(
                "runtime_env.working_dir must be a URI Ray can fetch (gcs://, s3://, https://...zip): obd does not "
                "upload a local directory; a run works in the directory it was started from, on the shared "
                "filesystem (docs/ray.md)"
            )
        env_vars = value.get("env_vars", {})
        if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
            raise ValueError("runtime_env.env_vars is a table of strings")
        return value

    @property
    def gpu_count(self) -> int | None:
        """The GPUs a run counts for `--max-gpu-hours` and a price: its `num_gpus`, rounded up."""
        return None if self.num_gpus is None else math.ceil(self.num_gpus)


__all__ = ["RayTarget"]
