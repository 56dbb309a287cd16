"""Matching the pods this obd install made with the runs the daemon knows, and listing them.

A pod belongs to one target: the one named by its `OBD_TARGET` tag. Pods made before that tag
existed are claimed through the pod book, and failing that by the target the caller says takes
untagged pods, so that two `kind = "runpod"` targets never each take the other's pods for
orphans. An orphan's run directory is under the workdir its pod was made with.
"""

from __future__ import annotations

from typing import Any, Literal

import structlog
from pydantic import BaseModel

from executors.runpod.api import Pod
from executors.runpod.context import TAG_RUN, TAG_TARGET, TAG_WORKDIR, PodContext
from executors.runpod.info import PodInfo, PodPhase
from trainer_plugin.rundir import is_run_id

log = structlog.get_logger("obd.runpod")

FindingKind = Literal["matched", "adopted", "orphan", "gone", "not_created", "creating"]


class Finding(BaseModel):
    """One thing the reconcile found.

    `matched`: pod and run agree. `adopted`: the run's record had no pod id yet and a pod carries
    its tag (`target_info` is the pod to store). `orphan`: a pod with no live run (the daemon
    retrieves its outputs into `remote_dir`'s copy and terminates it). `gone`: the run's pod no
    longer exists. `not_created`: the run was recorded before a create that never made a pod.
    `creating`: the run was recorded mid-create and a pod made by that create may still appear
    until `look_again_at`: look again then.
    """

    kind: FindingKind
    run_id: str | None = None
    pod_id: str | None = None
    pod_name: str | None = None
    state: str | None = None
    remote_dir: str | None = None
    reason: str | None = None
    look_again_at: float | None = None
    target_info: PodInfo | None = None


class Reconciler:
    """The reconcile and the listing of one target's pods."""

    def __init__(self, ctx: PodContext, *, create_window: float) -> None:
        self.ctx = ctx
        self.create_window = create_window

    def belongs_here(self, pod: Pod, *, take_untagged: bool) -> bool:
        """Whether the pod is this target's: made by this install and tagged for this target (or,
        for a pod older than the target tag, booked for it, or taken as untagged)."""
        if not self.ctx.is_ours(pod):
            return False
        tagged = pod.env.get(TAG_TARGET)
        if tagged is not None:
            return tagged == self.ctx.name
        run_id = pod.env.get(TAG_RUN) or ""
        booked = self.ctx.book.info(run_id) if is_run_id(run_id) else None
        if booked is not None and booked.pod_id == pod.id and booked.target:
            return booked.target == self.ctx.name
        return take_untagged

    async def reconcile(self, known: dict[str, PodInfo], *, take_untagged: bool = True) -> list[Finding]:
        """Match this target's pods with its live runs (`known`: run id → its pod as recorded)."""
        ctx = self.ctx
        now = ctx.clock()
        pods = [p for p in await ctx.api.list_pods() if self.belongs_here(p, take_untagged=take_untagged)]
        by_id = {p.id: p for p in pods}
        claimed: set[str] = set()
        out: list[Finding] = []
        for run_id, info in known.items():
            pod_id = info.pod_id
            if pod_id and pod_id in by_id:
                claimed.add(pod_id)
                out.append(Finding(kind="matched", run_id=run_id, pod_id=pod_id, state=by_id[pod_id].desired_status))
                continue
            if pod_id:
                reason = (
                    f"pod {pod_id} no longer exists (terminated outside obd, or reclaimed by Runpod); "
                    "the outputs on it are lost"
                )
                out.append(Finding(kind="gone", run_id=run_id, pod_id=pod_id, reason=reason))
                continue
            tagged = [p for p in pods if p.env.get(TAG_RUN) == run_id and p.id not in claimed]
            if tagged:
                pod = tagged[0]
                claimed.add(pod.id)
                adopted = self.info_from_pod(pod, info)
                out.append(Finding(kind="adopted", run_id=run_id, pod_id=pod.id, target_info=adopted))
                continue
            due = info.create_answer_due(self.create_window)
            if due is not None and now < due:
                reason = "obd stopped while the pod's create call was under way; its outcome is not known yet"
                out.append(Finding(kind="creating", run_id=run_id, reason=reason, look_again_at=due))
                continue
            reason = "obd stopped before the pod was created (no pod carries this run's tag); start the run again"
            out.append(Finding(kind="not_created", run_id=run_id, reason=reason))
        for pod in pods:
            if pod.id in claimed:
                continue
            out.append(self._orphan(pod))
        for item in out:
            if item.kind != "matched":
                log.warning("runpod.reconcile", target=ctx.name, **item.model_dump(exclude={"target_info"}))
        return out

    def _orphan(self, pod: Pod) -> Finding:
        """A pod with no live run: found with the workdir it was made with."""
        run_id = pod.env.get(TAG_RUN) or ""
        entry = self.ctx.book.get(run_id) if is_run_id(run_id) else None
        booked = entry.target_info if entry is not None else None
        mine = booked is not None and booked.pod_id == pod.id
        info = booked if booked is not None and mine else self.info_from_pod(pod, None)
        remote_dir = None
        if entry is not None and mine and entry.remote_dir:
            remote_dir = entry.remote_dir
        elif is_run_id(run_id):
            remote_dir = self.ctx.remote_dir(info, run_id)
        return Finding(
            kind="orphan",
            run_id=run_id or None,
            pod_id=pod.id,
            pod_name=pod.name,
            remote_dir=remote_dir,
            target_info=info,
            reason=f"pod {pod.id} ({pod.name}) has no live run in obd",
        )

    def info_from_pod(self, pod: Pod, base: PodInfo | None) -> PodInfo:
        """A PodInfo for a pod found by its tags (its host key is pinned by `pin_host_key`)."""
        ctx = self.ctx
        base = base or PodInfo()
        started = base.started_at or (ctx.clock() - float(pod.uptime_seconds or 0))
        return base.model_copy(
            update={
                "target": ctx.name,
                "run_id": pod.env.get(TAG_RUN) or base.run_id,
                "pod_name": pod.name,
                "pod_id": pod.id,
                "owner": ctx.owner,
                "workdir": base.workdir or pod.env.get(TAG_WORKDIR) or ctx.target.workdir,
                # Ready only once its host key is pinned: `resume` waits for SSH and pins it.
                "phase": PodPhase.ready if pod.ssh_host and base.host_key else PodPhase.booting,
                "gpu_type": pod.gpu_display_name,
                "cost_per_hr": pod.cost_per_hr or base.cost_per_hr,
                "started_at": started,
                "ssh_host": pod.ssh_host,
                "ssh_port": pod.ssh_port,
                "ssh_user": ctx.ssh_user,
                "host_key": base.host_key,
                "max_hours": ctx.target.max_hours,
                "max_cost_usd": ctx.target.max_cost_usd,
            }
        )

    async def list_pods(self) -> list[dict[str, Any]]:
        """The pods this obd install made (whichever target), with their state, rate and spend."""
        ctx = self.ctx
        now = ctx.clock()
        booked = {e.target_info.pod_id: e.target_info for e in ctx.book.all().values() if e.target_info}
        out = []
        for pod in await ctx.api.list_pods():
            if not ctx.is_ours(pod):
                continue
            info = booked.get(pod.id)
            started = info.started_at if info is not None else None
            if started is None and pod.uptime_seconds is not None:
                started = now - float(pod.uptime_seconds)
            out.append(
                {
                    "pod_id": pod.id,
                    "pod_name": pod.name,
                    "run_id": pod.env.get(TAG_RUN),
                    "target": pod.env.get(TAG_TARGET) or (info.target if info is not None else None),
                    "state": pod.desired_status,
                    "gpu_type": pod.gpu_display_name,
                    "gpu_count": pod.gpu_count,
                    "cost_per_hr": pod.cost_per_hr,
                    "started_at": started,
                    "spend_usd": PodInfo(cost_per_hr=pod.cost_per_hr, started_at=started).spend(now),
                    "ssh": f"{pod.ssh_host}:{pod.ssh_port}" if pod.ssh_host else None,
                }
            )
        return out
