"""A stop, in one place: the request (whoever asks), what a read of the run means for it (the
proof judged, the stop fallback), and how the run ends. Cf. overbrainer's runs/snapshot.rs.

`obd train stop` (the CLI, the web view, the Python API), a pod's cap and the daemon's own limits
ask through `request_snapshot`: the record first, then the file in the run directory. A stop
may come at any moment: before the job started (kept in the record, written once the job exists)
and before its plugin announced itself (the plugin takes a request it finds at its first step
boundary). The follow reads a run directory (a `RunProbe`) and the rules below, pure functions
with no I/O (their table tests are tests/daemon/test_stop_rules.py), decide what that means: a
request seen, a proof taken or refused, the stop fallback's cancel, the final state; the follow
acts on the decision. The proof's content rule is `trainer_plugin.rundir.parse_proof`, shared
with the plugin that writes proofs; the facts only a reader of the target has (whether the
checkpoint is a real directory, whether snapshot.json is a regular file) come in the probe. The
contract these follow is docs/contract.md ("Snapshot and stop", "Run states").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import anyio
import structlog

from daemon.service.limits import learn_save
from daemon.service.models import RunRecord, RunState, Snapshot
from daemon.service.ports import Runs, Wakes
from daemon.service.progress import update_progress
from daemon.service.targets import Targets
from daemon.service.trackers import learn as learn_trackers
from executors.base import JobState, JobStatus, RunProbe
from trainer_plugin import rundir
from trainer_plugin.rundir import normalise_reason

log = structlog.get_logger("obd")


# --- the request ---------------------------------------------------------------------------------


class StopHost(Runs, Protocol):
    """What a stop request uses of the daemon beyond the records: the run's target (to write the
    request) and the follow (woken to read the run at once)."""

    @property
    def targets(self) -> Targets: ...

    @property
    def follow(self) -> Wakes: ...


# Who asked, as the run's history says it, by the way the request came (`StopRequest.via`).
ASKED_VIA = {"cli": "`obd train stop`", "ui": "the web view", "api": "obd's Python API"}


async def request_snapshot(daemon: StopHost, record: RunRecord, reason: str, by: str) -> None:
    """Record a snapshot request, then write `snapshot.request` in the run directory.

    Recorded before the file is written, so a daemon killed in between still counts the
    fallback from the request; undone if the write fails. A run whose job has not started yet
    keeps the request in its record only: the launch writes it as soon as the job exists
    (`write_pending_request`).
    """
    async with daemon.editing(record):
        first = record.stop.requested_at is None
        before = record.stop.model_copy()
        if first:
            record.stop.requested_at = time.time()
        record.stop.reason = reason
        record.stop.asked_by = record.stop.asked_by or by
    if record.has_job:
        try:
            await _write(daemon, record, reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                async with daemon.editing(record):
                    record.stop = before
            raise
    async with daemon.editing(record):
        if first:
            later = "" if record.has_job else "; it reaches the job once it starts"
            record.note(f"snapshot requested ({reason}) by {by}{later}")
        elif before.reason != reason:
            record.note(f"snapshot request reason changed to {reason}")
    log.info("snapshot_requested", run_id=record.id, reason=reason, by=by)
    daemon.follow.wake_run(record)


def cancel_asked(record: RunRecord, note: str) -> None:
    """A cancel asked of obd (`obd train cancel`, a drain's cancel of a job without the plugin), kept
    in the record and its history once; a cancel already asked (the fallback's) keeps its word."""
    if record.stop.cancel_by is None:
        record.stop.cancel_by = "user"
        record.note(note)


def cancel_by_fallback(record: RunRecord, why: str, note: str) -> None:
    """The daemon's own cancel (the stop fallback, a pod's cap): why, in the record and its history."""
    record.stop.fallback = why
    record.stop.cancel_by = "fallback"
    record.note(note)


async def write_pending_request(daemon: StopHost, record: RunRecord) -> None:
    """A request made before the run's job started, written now that it has (the launch's call)."""
    reason = record.stop.reason
    if record.stop.requested_at is None or reason is None or not record.has_job:
        return
    try:
        await _write(daemon, record, reason)
    except Exception as exc:  # the record keeps it: the stop fallback still ends the job in time
        log.warning("pending_request_not_written", run_id=record.id, error=str(exc))
        async with daemon.editing(record):
            record.note(f"the snapshot request could not be written in the run directory: {exc}")


async def write_recorded_requests(daemon: StopHost) -> None:
    """At the daemon's start: every request a running job's record holds is written again. An
    earlier daemon killed between the record and the file left a request the job never saw, and
    only the stop fallback would end it, with no snapshot. The file is a standing request, so
    writing it twice changes nothing for a job that already took it."""
    async with anyio.create_task_group() as tg:  # one unreachable target delays no other's
        for record in list(daemon.records.values()):
            if record.has_job and not record.state.final and record.snapshot is None and record.stop.cancel_by is None:
                tg.start_soon(write_pending_request, daemon, record)


async def _write(daemon: StopHost, record: RunRecord, reason: str) -> None:
    executor = daemon.targets.executor(record)
    await executor.put_file(rundir.RunPaths(record.remote_dir).request, rundir.request_bytes(reason))


# --- what a read of the run means -----------------------------------------------------------------


class StopTimes(Protocol):
    """The stop fallback's two timeouts, in seconds (the `[stop]` section of the config)."""

    @property
    def proof_timeout(self) -> float: ...

    @property
    def end_timeout(self) -> float: ...


def format_duration(seconds: float) -> str:
    """`30 min`, `2 h`, `90 s`: a timeout as the fallback's messages say it."""
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{int(seconds // 3600)} h"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)} min"
    return f"{seconds:g} s"


# --- the proof -----------------------------------------------------------------------------------


def validate_proof(raw: str, too_large: bool = False) -> Snapshot | str:
    """The proof's text as a Snapshot, or why it is invalid: the content rule alone.

    `too_large` is the reader's word that the file was cut at 64 KiB.
    """
    if too_large:
        return f"{rundir.SNAPSHOT_PROOF} is larger than 64 KiB"
    # surrogatepass: a lone surrogate becomes bytes that are not UTF-8, so such a text is refused.
    result = rundir.parse_proof(raw.encode("utf-8", "surrogatepass"))
    if isinstance(result, rundir.InvalidProof):
        return result.why
    return Snapshot(checkpoint=result.checkpoint, step=result.step, reason=result.reason, time=result.time)


def checkpoint_of(snapshot: Snapshot) -> str:
    """The checkpoint's name in output/ (`checkpoint-<step>`) of a validated snapshot."""
    return rundir.checkpoint_name(snapshot.step)


def judge_proof(probe: RunProbe) -> Snapshot | str | None:
    """What the probe's snapshot.json proves: a Snapshot, why it is invalid, or None when there is nothing to judge.

    A proof is valid only if its content is (`validate_proof`) and its checkpoint is one of the
    probe's real checkpoint directories. A partial probe (`error`) judges nothing: its checkpoint
    list may be short, and the next probe reads the directory again.
    """
    if probe.proof_not_regular:
        return f"{rundir.SNAPSHOT_PROOF} is {probe.proof_not_regular}, not a regular file"
    if probe.proof is None or not probe.proof.strip() or probe.error:
        return None
    result = validate_proof(probe.proof, probe.proof_too_large)
    if isinstance(result, str):
        return result
    if checkpoint_of(result) not in probe.checkpoints:
        return (
            f"{rundir.SNAPSHOT_PROOF} names {result.checkpoint}, which is not a real directory in the run's "
            f"{rundir.OUTPUT}/ (missing, or a symbolic link on its path)"
        )
    return result


# --- what a probe means for a running run ---------------------------------------------------------


@dataclass
class Verdict:
    """What the follow must do after a probe: save, cancel the job, or finish the record."""

    changed: bool = False
    cancel: str | None = None  # the reason, when the stop fallback cancels the job
    final: JobStatus | None = None


def apply_probe(record: RunRecord, probe: RunProbe, now: float, stop: StopTimes) -> Verdict:
    """Fold one probe into the record (plugin, progress, request, proof) and apply the stop fallback."""
    verdict = Verdict()
    before = _fingerprint(record)
    if record.unreachable_since is not None:
        record.note("target reachable again", now)
        record.unreachable_since = None
    begin = probe.begin
    if begin is not None and begin.snapshots is True and not record.snapshots:
        record.snapshots = True
        record.note(f"snapshot plugin {begin.version or '?'} active", now)
    update_progress(record, probe, now)
    learned = learn_save(record, probe.last_save)  # the lead of the chain's limits (docs/limits.md)
    learned = learn_trackers(record, probe.begin) or learned  # an MLflow run for the next attempts
    see_request(record, probe.request, now)
    see_no_plugin(record, probe, now)
    see_proof(record, probe, now)
    if probe.status.state == JobState.pending:
        # Waiting for the target's scheduler: queued, and no fallback (nothing runs to snapshot).
        why = (
            f"waiting for the scheduler: {probe.status.detail}" if probe.status.detail else "waiting for the scheduler"
        )
        if record.state != RunState.queued or record.message != why:
            record.transition(RunState.queued, why, now)
    elif probe.status.state != JobState.running:
        if record.state == RunState.queued and probe.status.exit_code is not None:
            # Its job started and ended between two reads of the scheduler (a Slurm end marker).
            record.transition(RunState.running, "started by the target's scheduler", now)
        verdict.final = probe.status
    else:
        if record.state == RunState.queued:
            record.transition(RunState.running, "started by the target's scheduler", now)
        verdict.cancel = after_train_stop(record, probe) or fallback_reason(record, now, stop)
    verdict.changed = _fingerprint(record) != before or learned
    return verdict


def _fingerprint(record: RunRecord) -> tuple[object, ...]:
    """What a probe can change in a record, besides progress (which is not saved on its own)."""
    st = record.stop
    return (
        record.state,
        record.message,
        len(record.history),
        record.snapshots,
        record.snapshot is not None,
        record.unreachable_since,
        st.requested_at,
        st.reason,
        st.proof_at,
        st.invalid_proof,
        st.no_plugin,
    )


def see_request(record: RunRecord, raw: str | None, now: float) -> None:
    """A request found in the run directory: the fallback counts from when it was first seen; asking again changes only the reason."""
    reason = normalise_reason(raw)
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


NO_PLUGIN = (
    "its job has not loaded obd's plugin: none of its processes is Python, which the plugin loads into, "
    "or a shell that could start one"
)


def see_no_plugin(record: RunRecord, probe: RunProbe, now: float) -> None:
    """Whether a snapshot can still come for the request: not while the job has not announced the
    plugin and runs neither Python nor a shell that could start one (`sleep 120`), so `stop --wait`
    need not wait `proof_timeout` to say so. A Python started later (the plugin takes the request
    at its first step) or the plugin's announcement clears it."""
    st = record.stop
    if record.snapshots or st.requested_at is None:
        st.no_plugin = None
        return
    if probe.python is False and st.no_plugin is None:
        st.no_plugin = NO_PLUGIN
        record.note(f"no snapshot can come now: {NO_PLUGIN}", now)
    elif probe.python is True and st.no_plugin is not None:
        st.no_plugin = None
        record.note("a Python process runs in the job now: obd's plugin may still take the request", now)


def see_proof(record: RunRecord, probe: RunProbe, now: float) -> None:
    """The first proof decides: a valid one becomes the run's snapshot, an invalid one is kept as why the run fails."""
    if record.snapshot is not None or record.stop.invalid_proof:
        return
    result = judge_proof(probe)
    if result is None:
        return
    if isinstance(result, str):
        record.stop.invalid_proof = result
        record.note(f"invalid snapshot proof: {result}", now)
        return
    record.snapshot = result
    record.stop.proof_at = now
    record.note(f"snapshot proof: {result.checkpoint} at step {result.step} ({result.reason})", now)


def after_train_stop(record: RunRecord, probe: RunProbe) -> str | None:
    """A stop asked once the job's training had ended: no snapshot can come, so the job is ended now.

    The plugin's `end` line says training finished and its `after_train` phase line names the
    script's code after train() (a final evaluation, `save_model`, a push) the stop cuts short
    (trainer_plugin/plugin/interrupt.py). Rather than wait `proof_timeout` for a proof, the job is
    cancelled at once, its record saying so (`state_from_exit`).
    """
    st = record.stop
    phase = probe.phase
    if st.requested_at is None or record.snapshot is not None or st.fallback or st.invalid_proof:
        return None
    # Only on the plugin's word: a request that was there at the last step lets the run end as
    # usual (the plugin says nothing of it), and an older plugin never says it.
    if not probe.ended or phase is None or phase.phase != "after_train" or not phase.cut:
        return None
    st.after_train = phase.cut
    return f"its training had finished; the stop cuts short {st.after_train}"


def fallback_reason(record: RunRecord, now: float, stop: StopTimes) -> str | None:
    """Why the stop fallback must cancel the running job now, or None.

    A proof and the job still running `end_timeout` later: cancel (the run is then `stopped`).
    A request, no proof `proof_timeout` after it was seen, and a job that announced the plugin, or
    a stop asked through obd (which may come before the job announced it): cancel (the run is then
    `cancelled`). A job without the plugin is never cancelled for a request written by hand.
    """
    st = record.stop
    if st.fallback:  # already cancelling
        return None
    if record.snapshot is not None and st.proof_at is not None:
        if now - st.proof_at >= stop.end_timeout:
            return f"the job still ran {format_duration(stop.end_timeout)} after its snapshot"
        return None
    if (
        (record.snapshots or st.asked_by)
        and st.requested_at is not None
        and now - st.requested_at >= stop.proof_timeout
    ):
        never = "" if record.snapshots else " (the job never announced obd's snapshot plugin)"
        return f"no snapshot within {format_duration(stop.proof_timeout)} of the request{never}"
    return None


# --- the end --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FinalDecision:
    """How a run ends: its final state, the message that says why, and whether its snapshot stands.

    When `snapshot_stands` is False the record must show no snapshot (there was none, or its
    checkpoint is not in the run directory any more), so nothing resumes from it.
    """

    state: RunState
    message: str
    snapshot_stands: bool


def state_from_exit(record: RunRecord, status: JobStatus) -> tuple[RunState, str]:
    """The final state and message from how the job ended, what proof it left and who cancelled it."""
    rid = record.id
    snap = record.snapshot
    if record.stop.invalid_proof and status.state in (JobState.cancelled, JobState.exited):
        # An invalid proof fails the run however the job then ended, and no path of it is used.
        return RunState.failed, f"invalid snapshot proof: {record.stop.invalid_proof}; see `obd train logs {rid}`"
    if status.state == JobState.cancelled:
        if snap is not None:
            why = f"; then cancelled: {record.stop.fallback}" if record.stop.fallback else "; then cancelled"
            return RunState.stopped, f"{stopped_words(record, snap)}{why}"
        if record.stop.after_train is not None:
            progress = record.progress
            at = f" at step {progress.step}" if progress.step is not None else ""
            of = f" of {progress.max_steps}" if progress.step is not None and progress.max_steps else ""
            return RunState.cancelled, (
                f"training had finished{at}{of} when the stop came; the job was ended in the script's code "
                f"after train(), cutting short {record.stop.after_train}; `obd train outputs {rid}` has what it saved"
            )
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
    untaken = ""
    if snap is None and record.stop.asked_by and not record.snapshots:
        untaken = "; the stop asked for was never taken: the job never announced obd's snapshot plugin"
    if code == 0:
        if snap is not None:
            return RunState.stopped, stopped_words(record, snap)
        return RunState.succeeded, "exit 0" + untaken
    return RunState.failed, f"exit {code}; see `obd train logs {rid}`{untaken}"


def stopped_words(record: RunRecord, snap: Snapshot) -> str:
    """A stopped run's message: its snapshot; first, for a run obd stopped at its chain's limit
    (daemon/service/limits.py), that limit and the command that continues it."""
    words = f"snapshot {snap.checkpoint} at step {snap.step} ({snap.reason})"
    reached = record.limits.reached if record.limits is not None else None
    if reached is None:
        return words
    return f"stopped at its {reached}; resume with `obd train resume {record.id}` ({words})"


def final_state(record: RunRecord, status: JobStatus, checkpoints: list[str]) -> FinalDecision:
    """How the run ends, given the real checkpoint directories its run directory holds now.

    A snapshot whose checkpoint is gone by the end (deleted, or replaced by a link) proves
    nothing: a run that would be `stopped` fails, and no run keeps showing that snapshot.
    """
    state, message = state_from_exit(record, status)
    snap = record.snapshot
    if snap is None:
        return FinalDecision(state, message, snapshot_stands=False)
    if checkpoint_of(snap) in checkpoints:
        return FinalDecision(state, message, snapshot_stands=True)
    gone = f"the snapshot proof names {snap.checkpoint}, which is not in the run directory"
    if state == RunState.stopped:
        return FinalDecision(RunState.failed, f"{gone}; see `obd train logs {record.id}`", snapshot_stands=False)
    return FinalDecision(state, f"{message}; {gone}", snapshot_stands=False)
