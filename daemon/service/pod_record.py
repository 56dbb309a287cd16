"""A pod target's parts beside its supervision (daemon/service/pods.py): what it uses of the daemon
(`PodHost`), and what a run's record keeps of its pod (`target_info`), converted here and nowhere
else: the pod as `PodInfo`, what became of it at the end (terminated, gone, kept, left up), and
why an ended run's outputs went with its pod."""

from __future__ import annotations

import time
from typing import Protocol

from daemon.service.follow import Follower
from daemon.service.models import RunRecord
from daemon.service.ports import Launching, Runs
from daemon.service.targets import Targets
from executors.base import ExecutorError
from executors.runpod import PodEnd, PodInfo
from executors.runpod.book import BookEntry


class PodEnded(ExecutorError):
    """The run's pod is being emptied and ended, or was: it is not probed any more."""


class PodHost(Runs, Protocol):
    """What a pod target uses of the daemon beyond the records: the follow (a pod's caps cancel
    its job, its reconcile finishes runs), the runs being launched (never reconciled away), and
    the targets (a cap's snapshot request goes through them)."""

    @property
    def follow(self) -> Follower: ...

    @property
    def launcher(self) -> Launching: ...

    @property
    def targets(self) -> Targets: ...


def pod_info(record: RunRecord) -> PodInfo:
    """The run's pod, from its record."""
    return PodInfo.from_record(record.target_info)


def keep_pod(record: RunRecord, info: PodInfo) -> None:
    """Put the run's pod into its record (saved by the caller)."""
    record.target_info = info.to_record()


def mark_pod_end(record: RunRecord, end: PodEnd, why: str, at: float | None = None) -> None:
    """Keep in the record what became of the run's pod, when and why (saved by the caller):
    `status` of a run that ended shows it from the record, asking the API no more."""
    update = {"ended": True, "end": end, "ended_at": at or time.time(), "end_reason": why}
    keep_pod(record, pod_info(record).model_copy(update=update))


def end_from_book(entry: BookEntry | None, keep_pod_up: bool, pod_id: str, message: str) -> tuple[PodEnd, str, float]:
    """What `finish` (or the end of a run's pod) did with it, from the driver's book entry:
    terminated, gone, kept (`keep_pod`) or left up; why; and when."""
    now = time.time()
    if entry is not None and entry.terminated:
        why = "after the run ended, its outputs retrieved and verified first" if entry.retrieved else message
        return PodEnd.terminated, why, entry.finished or now
    if entry is not None and entry.pod_gone:
        return PodEnd.gone, message, entry.finished or now
    if entry is not None and entry.retrieved and keep_pod_up:
        return PodEnd.kept, f"keep_pod; its outputs are home: remove it with `obd pods rm {pod_id}`", entry.retrieved
    return PodEnd.left_up, message, now


def outputs_lost(record: RunRecord, retrieved_at: float | None) -> str | None:
    """Why an ended run's outputs can be read neither here nor on its pod (the pod ended before
    they were retrieved, `retrieved_at` None), or None."""
    info = pod_info(record)
    if not record.state.final or not info.pod_id or not info.gone or retrieved_at:
        return None
    when = f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info.ended_at))}" if info.ended_at else ""
    was = "was found gone" if info.end == PodEnd.gone else "was terminated"
    return (
        f"run {record.id} has no outputs to copy: its pod {info.pod_id} {was}{when} before they were "
        f"retrieved ({info.end_reason or info.error or 'no detail'}), and the outputs on it went with it "
        f"(`obd train status {record.id}` says how the run ended)"
    )
