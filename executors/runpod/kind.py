"""Runpod as a kind of target (`kind = "runpod"`): each run gets a pod of its own, made, watched,
priced and ended by obd (daemon/service/pods.py supervises it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from executors.base import PodCost
from executors.kinds import Capability, Kind, register
from executors.runpod.config import RunpodTarget

# What a pod's record (`target_info`, executors/runpod/info.py's PodInfo) says its kind is.
POD_RECORD_KIND = "runpod"


class RunpodKind(Kind[RunpodTarget]):
    name = "runpod"
    config = RunpodTarget
    capabilities = frozenset({Capability.MAKES_PODS, Capability.EXEC, Capability.CARRIES_FILES})
    supervision = "daemon.service.pods:PodSupervision"

    def gpus_counted(self, target: RunpodTarget, held: int) -> int | None:
        return target.gpu_count

    def has_price(self, target: RunpodTarget) -> bool:
        return True  # the pod's own rate

    def run_price(
        self, target: RunpodTarget, gpus: int, target_info: Mapping[str, Any], at: float
    ) -> tuple[float | None, float | None]:
        """The pod's rate and its spend from its creation to its end (or `at`): billed whether or not the job runs."""
        from executors.runpod.info import PodInfo

        info = PodInfo.from_record(dict(target_info)) if target_info.get("kind") == POD_RECORD_KIND else None
        if info is None or not info.pod_id or not info.cost_per_hr:
            return None, None
        until = min(at, info.ended_at) if info.ended_at is not None else at
        return float(info.cost_per_hr), info.spend(until)

    def pod_cost(self, target_info: Mapping[str, Any], at: float) -> PodCost | None:
        if target_info.get("kind") != POD_RECORD_KIND:
            return None
        from executors.runpod.info import PodInfo

        info = PodInfo.from_record(dict(target_info))
        if not info.pod_id:
            return None
        return PodCost(
            pod_id=info.pod_id,
            gpu_type=info.gpu_type,
            cost_per_hr=info.cost_per_hr,
            spend_usd=info.spend(at),
            alive=not info.ended and not info.settled,
        )


RUNPOD = register(RunpodKind())
