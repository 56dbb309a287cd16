"""What obd knows of one run's pod (`PodInfo`), and what the API last said of it (`PodObservation`).

`PodInfo` is saved in the run's record (`target_info`) before each step that could leave a pod
behind, and in the driver's pod book. Its JSON keys are the ones records have always had, so a
record written by an earlier obd loads and is followed; keys it does not know are ignored.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class PodPhase(str, Enum):
    """Where a run's pod stands, as obd made it."""

    creating = "creating"  # recorded before the create call; no pod id known yet
    create_failed = "create_failed"  # every create was refused: no pod exists
    booting = "booting"  # the pod exists; its SSH is not answering (or not pinned) yet
    ready = "ready"  # SSH answers with the pinned host key
    stopped = "stopped"  # stopped (not terminated) so that its volume keeps the outputs
    terminated = "terminated"  # ended by obd because it never became ready
    terminate_failed = "terminate_failed"  # it never became ready, and ending it failed too


class PodEnd(str, Enum):
    """What became of a run's pod once obd was done with it (kept in the record for `status`, which
    then no longer asks the API)."""

    terminated = "terminated"  # obd terminated it (after retrieving the outputs, or past its cap)
    gone = "gone"  # it no longer existed when obd looked (terminated outside obd, or reclaimed)
    kept = "kept"  # left up on purpose (keep_pod), its outputs home
    left_up = "left up"  # left up because its outputs could not be retrieved (or it could not be terminated)


# Phases after which the pod will never run the job.
SETTLED_PHASES = frozenset({PodPhase.terminated, PodPhase.terminate_failed, PodPhase.create_failed})


class PodInfo(BaseModel):
    """One run's pod: its identity, where it stands, how to reach it, what it costs."""

    model_config = ConfigDict(extra="ignore")

    kind: Literal["runpod"] = "runpod"
    target: str = ""  # the obd target it was made for
    run_id: str = ""
    pod_name: str = ""
    pod_id: str | None = None  # None until the create answered (or the pod was found by its tags)
    owner: str = ""  # the obd install that made it
    phase: PodPhase = PodPhase.creating
    gpu_types: list[str] = Field(default_factory=list)  # the types the create tried, in order
    requested_at: float | None = None  # when the create was decided (before any create call)
    create_sent_at: float | None = None  # when the last create call was sent
    workdir: str | None = None  # the target's workdir when the pod was made (its runs' directories are there)
    error: str | None = None  # why the pod was ended or stopped, when obd did that
    gpu_type: str | None = None
    cost_per_hr: float | None = None
    started_at: float | None = None  # unix time the pod was created: the caps count from here
    restarted_at: float | None = None  # when obd last started it again after a stop
    max_hours: float | None = None
    max_cost_usd: float | None = None
    ssh_host: str | None = None
    ssh_port: int | None = None
    ssh_user: str | None = None
    host_key: str | None = None  # `alg base64`, pinned on first contact
    # Kept by the daemon:
    ended: bool = False  # the run is over and its pod was emptied and ended (or is gone)
    stopped_outside: float | None = None  # when the daemon saw the pod stopped outside obd
    end: PodEnd | None = None  # what became of it once obd was done with it (None: not yet, or an older record)
    ended_at: float | None = None  # when: terminated, found gone, kept or left up
    end_reason: str | None = None  # why, in words

    @classmethod
    def from_record(cls, raw: dict[str, Any] | None) -> PodInfo:
        """From a record's `target_info` (as any obd version saved it)."""
        return cls.model_validate(raw or {})

    def to_record(self) -> dict[str, Any]:
        """For a record's `target_info`: plain JSON values."""
        return self.model_dump(mode="json")

    @property
    def is_ready(self) -> bool:
        """SSH answered and its host key is pinned: the pod can be used."""
        return self.phase == PodPhase.ready and bool(self.host_key)

    @property
    def settled(self) -> bool:
        """The pod will never run the job (never made, or ended because it never got ready)."""
        return self.phase in SETTLED_PHASES

    @property
    def ssh_address(self) -> str | None:
        if not self.ssh_host:
            return None
        return f"{self.ssh_user or 'root'}@{self.ssh_host}:{self.ssh_port}"

    def create_answer_due(self, window: float) -> float | None:
        """While the create's outcome is unknown (recorded mid-create, no pod id), the time until
        which a pod it made may still appear; None otherwise."""
        if self.pod_id or self.phase != PodPhase.creating:
            return None
        sent = self.create_sent_at or self.requested_at
        return None if sent is None else sent + window

    @property
    def gone(self) -> bool:
        """Whether the pod no longer exists: obd terminated it, found it gone, or never made it."""
        return self.end in (PodEnd.terminated, PodEnd.gone) or self.phase in (
            PodPhase.terminated,
            PodPhase.create_failed,
        )

    def spend(self, now: float, rate: float | None = None) -> float | None:
        """Dollars spent on the pod so far: hourly rate × hours since it was created."""
        rate = rate or self.cost_per_hr
        if not rate or self.started_at is None:
            return None
        return round(float(rate) * max(0.0, now - float(self.started_at)) / 3600.0, 4)


class PodObservation(BaseModel):
    """What the API said of a pod at one moment (or that it could not say)."""

    state: str  # Runpod's desiredStatus (RUNNING, EXITED, ...), `gone`, or `unknown`
    at: float  # unix time of the answer
    cost_per_hr: float | None = None
    uptime_s: float | None = None
    error: str | None = None  # why the state is `unknown`


def spend(cost_per_hr: float | None, started_at: float | None, now: float) -> float | None:
    """Dollars spent at `cost_per_hr` since `started_at`."""
    return PodInfo(cost_per_hr=cost_per_hr, started_at=started_at).spend(now)
