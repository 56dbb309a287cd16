"""What a probe of a run directory means for the run: progress, requests, proofs, the end.

Pure functions over a record and a probe, so the stop rules (SPEC "Snapshot and stop") are
checked in one place and tested without processes; the follow loop applies what they decide.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from daemon.config import StopSection
from daemon.models import RunRecord, RunState, Snapshot, normalise_reason
from executors.base import JobState, JobStatus, RunProbe

PROOF_LIMIT = 64 * 1024
_CHECKPOINT_RE = re.compile(r"^output/checkpoint-(\d+)$")


def validate_proof(raw: str, too_large: bool = False) -> Snapshot | str:
    """The proof as a Snapshot, or why it is invalid. Its path is never used unless valid."""
    if too_large or len(raw.encode()) > PROOF_LIMIT:
        return "snapshot.json is larger than 64 KiB"
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return "snapshot.json is not valid JSON"
    if not isinstance(data, dict):
        return "snapshot.json is not a JSON object"
    step = data.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return "snapshot.json has no valid step"
    checkpoint = data.get("checkpoint")
    if checkpoint != f"output/checkpoint-{step}":
        return f"snapshot.json names a checkpoint other than output/checkpoint-{step}"
    when = data.get("time")
    when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) and math.isfinite(when) else None
    reason = normalise_reason(data.get("reason") if isinstance(data.get("reason"), str) else None)
    return Snapshot(checkpoint=checkpoint, step=step, reason=reason or "requested", time=when)


def format_duration(seconds: float) -> str:
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


def _finite(value: object) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def update_progress(record: RunRecord, probe: RunProbe, now: float) -> None:
    begin, log = probe.begin or {}, probe.last_log or {}
    max_steps = begin.get("max_steps")
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
        record.progress.max_steps = max_steps
    step = log.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        record.progress.step = step
    if "loss" in log:
        record.progress.loss = _finite(log.get("loss"))
    record.progress.eta_seconds = _eta(begin, log, record.progress.max_steps, now)


def _eta(begin: dict, log: dict, max_steps: int | None, now: float) -> float | None:
    start_time, log_time = _finite(begin.get("time")), _finite(log.get("time"))
    step, first = log.get("step"), begin.get("start_step") or 0
    if None in (start_time, log_time, max_steps) or not isinstance(step, int) or not isinstance(first, int):
        return None
    done = step - first
    if done <= 0 or log_time <= start_time:
        return None
    per_step = (log_time - start_time) / done
    return max(0.0, (max_steps - step) * per_step - max(0.0, now - log_time))


@dataclass
class Verdict:
    """What the follow must do after a probe: save, cancel the job, or finish the record."""

    changed: bool = False
    cancel: str | None = None  # the reason, when the stop fallback cancels the job
    final: JobStatus | None = None


def apply_probe(record: RunRecord, probe: RunProbe, now: float, stop: StopSection) -> Verdict:
    """Fold one probe into the record and apply the stop fallback."""
    verdict = Verdict()
    before = record.model_dump_json(exclude={"progress"})
    if record.unreachable_since is not None:
        record.note("target reachable again", now)
        record.unreachable_since = None
    begin = probe.begin or {}
    if begin.get("snapshots") is True and not record.snapshots:
        record.snapshots = True
        record.note(f"snapshot plugin {begin.get('version', '?')} active", now)
    update_progress(record, probe, now)
    _see_request(record, probe, now)
    _see_proof(record, probe, now)
    if probe.status.state != JobState.running:
        verdict.final = probe.status
    else:
        verdict.cancel = fallback_reason(record, now, stop)
    verdict.changed = record.model_dump_json(exclude={"progress"}) != before
    return verdict


def _see_request(record: RunRecord, probe: RunProbe, now: float) -> None:
    reason = normalise_reason(probe.request)
    if reason is None:
        return
    if record.stop.requested_at is None:
        record.stop.requested_at = now
        record.stop.reason = reason
        who = "" if record.snapshots else " (the job has not announced the snapshot plugin: it cannot snapshot)"
        record.note(f"snapshot requested ({reason}){who}", now)
    elif record.stop.reason != reason:
        record.stop.reason = reason
        record.note(f"snapshot request reason changed to {reason}", now)


def _see_proof(record: RunRecord, probe: RunProbe, now: float) -> None:
    if probe.proof is None or record.snapshot is not None or record.stop.invalid_proof:
        return
    if not probe.proof.strip():
        return
    result = validate_proof(probe.proof, probe.proof_too_large)
    if isinstance(result, str):
        record.stop.invalid_proof = result
        record.note(f"invalid snapshot proof: {result}", now)
        return
    record.snapshot = result
    record.stop.proof_at = now
    record.note(f"snapshot proof: {result.checkpoint} at step {result.step} ({result.reason})", now)


def fallback_reason(record: RunRecord, now: float, stop: StopSection) -> str | None:
    """Why the stop fallback must cancel the running job now, or None."""
    st = record.stop
    if st.fallback:  # already cancelling
        return None
    if record.snapshot is not None and st.proof_at is not None:
        if now - st.proof_at >= stop.end_timeout:
            return f"the job still ran {format_duration(stop.end_timeout)} after its snapshot"
        return None
    if record.snapshots and st.requested_at is not None and now - st.requested_at >= stop.proof_timeout:
        return f"no snapshot within {format_duration(stop.proof_timeout)} of the request"
    return None


def final_state(record: RunRecord, status: JobStatus) -> tuple[RunState, str]:
    """The run's final state and message from how the job ended and what proof it left."""
    rid = record.id
    snap = record.snapshot
    if record.stop.invalid_proof and status.state in (JobState.cancelled, JobState.exited):
        # An invalid proof fails the run however the job then ended, and no path of it is used.
        return RunState.failed, f"invalid snapshot proof: {record.stop.invalid_proof}; see `obd train logs {rid}`"
    if status.state == JobState.cancelled:
        if snap is not None:
            why = f"; then cancelled: {record.stop.fallback}" if record.stop.fallback else "; then cancelled"
            return RunState.stopped, f"snapshot {snap.checkpoint} at step {snap.step} ({snap.reason}){why}"
        if record.stop.cancel_by == "fallback" and record.stop.fallback:
            return RunState.cancelled, f"cancelled by the stop fallback: {record.stop.fallback}"
        if record.stop.cancel_by == "user":
            return RunState.cancelled, "cancelled by the user"
        return RunState.cancelled, "cancelled on the target (a `cancelled` file was written there)"
    if status.state == JobState.lost:
        return RunState.failed, (
            f"lost: the job has no exit code and no process (killed with its wrapper, or the "
            f"machine rebooted); see `obd train logs {rid}`"
        )
    code = status.exit_code
    if code == 0:
        if snap is not None:
            return RunState.stopped, f"snapshot {snap.checkpoint} at step {snap.step} ({snap.reason})"
        return RunState.succeeded, "exit 0"
    return RunState.failed, f"exit {code}; see `obd train logs {rid}`"
