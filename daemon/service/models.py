"""The run record and its parts: what the daemon keeps of every run, and what `--json` prints."""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from daemon.common import wire
from daemon.service.run_states import check_transition

# The reason words and the run-id rule are the run directory's contract (trainer_plugin/rundir.py);
# normalise_reason stays importable from here for the daemon's modules.
from trainer_plugin.rundir import (
    is_run_id,
    normalise_reason,  # noqa: F401 - re-exported
)

HISTORY_NOTES_LIMIT = 500


class RunState(str, Enum):
    """A run's state, as the service handles it: the wire's names (daemon/common/wire.py), defined there."""

    queued = wire.QUEUED
    preparing = wire.PREPARING
    running = wire.RUNNING
    stopped = wire.STOPPED
    succeeded = wire.SUCCEEDED
    failed = wire.FAILED
    cancelled = wire.CANCELLED

    @property
    def final(self) -> bool:
        return self.value in wire.FINAL


FINAL_STATES = frozenset(s for s in RunState if s.final)


class InvalidRunId(ValueError):
    pass


def check_run_id(run_id: str) -> str:
    """A run id names a directory locally and on targets, so it is never a path."""
    if not is_run_id(run_id):
        raise InvalidRunId(
            f"invalid run id {run_id!r}: ids are letters, digits, '-', '_' and '.'; "
            "see `obd train list` for the runs there are"
        )
    return run_id


class Transition(BaseModel):
    state: RunState | str
    time: float
    reason: str = ""


class Snapshot(BaseModel):
    """The proven snapshot an attempt may be resumed from, written by daemon/service/stop.py (a proof
    taken) and daemon/service/follow.py (cleared once its checkpoint is gone)."""

    checkpoint: str
    step: int
    reason: str = "requested"
    time: float | None = None


class Progress(BaseModel):
    """Where a run's job is, as its metrics.jsonl says, written by daemon/service/progress.py (each
    probe's lines folded in; `job_ended`), and daemon/service/carry.py (the `carry_*` fields of a
    checkpoint carried here)."""

    step: int | None = None
    max_steps: int | None = None
    loss: float | None = None
    eta_seconds: float | None = None
    last_checkpoint: str | None = None  # the newest output/checkpoint-<step> (a real directory)
    # Where the job's time goes now, as its plugin says (`training`, `evaluating`, `saving`,
    # `after_train`), and since when (unix seconds): a stop's cost depends on it.
    phase: str | None = None
    phase_since: float | None = None
    save_seconds: float | None = None  # the job's last checkpoint save, as its plugin timed it
    # What a stop asked now would take to its proof: the time to the nearest safe point plus the
    # save (daemon/service/progress.py `stop_estimate`); None before the plugin said anything.
    stop_seconds: float | None = None
    # A checkpoint being carried here from another target (`obd train move`, `resume --target`,
    # daemon/service/carry.py): the bytes arrived so far, of how many, and the rate (bytes a second).
    carry_bytes: int | None = None
    carry_total: int | None = None
    carry_rate: float | None = None


class StopState(BaseModel):
    """Where a snapshot request stands; persisted so a restarted daemon counts from the request.
    Written by daemon/service/stop.py (the request, what a read of the run shows, the cancels'
    marks: `cancel_asked`, `cancel_by_fallback`) and daemon/service/sweeps.py (a queued member taken
    out by its sweep's stop)."""

    requested_at: float | None = None  # when the daemon saw (or wrote) the request
    reason: str | None = None
    proof_at: float | None = None  # when a valid proof was first seen
    invalid_proof: str | None = None  # why the proof was rejected
    fallback: str | None = None  # why the daemon cancelled the job, if it did
    cancel_by: str | None = None  # "user" or "fallback"
    # Who asked through obd (`obd train stop`, the web view, a pod's cap...); None for a request
    # someone wrote in the run directory. A stop asked through obd of a job that never announces
    # the plugin is ended by the fallback; a request written by hand never cancels such a job.
    asked_by: str | None = None
    # A stop that came after the job's training had ended: the script's code it cut short (where
    # the job was), so the run's message says so; None otherwise.
    after_train: str | None = None
    # Why no snapshot can come while the job runs as it does now: it has not announced obd's plugin
    # and none of its processes is Python, which the plugin loads into, or a shell that could start
    # one (`stop --wait` says so at once, exit 7); None otherwise, and again once one runs in it.
    no_plugin: str | None = None


class Limits(BaseModel):
    """A chain's limits (docs/limits.md, daemon/service/limits.py) and what its earlier attempts used: on
    every attempt, the totals carried from attempt to attempt, so they hold across retries,
    preemptions and restarts of the daemon. Made by daemon/service/limits.py, which also keeps the
    chain's newest measured save (`learn_save`), put on a new attempt by daemon/service/launch.py;
    daemon/service/follow.py marks the limit it reached."""

    time_limit: float | None = None  # seconds of running wall time, summed over the chain's attempts
    deadline: float | None = None  # unix time by which the chain must have stopped
    max_gpu_hours: float | None = None  # GPUs × running hours, summed over the chain's attempts
    max_cost_usd: float | None = None  # US dollars, summed over the chain's attempts
    # What the chain's attempts before this one used.
    run_seconds: float = 0.0
    gpu_seconds: float = 0.0
    cost_usd: float = 0.0
    # The newest measured save on the chain: a snapshot's time from request to proof, or a periodic
    # save's duration as the plugin timed it (its `save` line).
    save_seconds: float | None = None
    reached: str | None = None  # the limit obd stopped this attempt for ("time limit", "deadline", ...)


class Preemption(BaseModel):
    """On a run being paused for another (or for a drain): why, and when it was asked."""

    for_run: str | None = None  # the run it makes way for; None: a drain of its target
    for_priority: int | None = None
    needed: int = 0  # the GPUs that run needed
    asked_at: float = Field(default_factory=time.time)
    why: str = ""  # as its history says it


class Paused(BaseModel):
    """On the attempt that resumes a paused run: what it was paused for, and since when."""

    by: str | None = None  # the run it made way for; None: a drain
    since: float = Field(default_factory=time.time)
    why: str = ""


class Dependency(BaseModel):
    """A run this one waits for (`--after RUN[:STATE[,STATE]]`, daemon/service/after.py): resolved once, at
    start, to the first attempt of that run's chain, so a name or `last` is never read again."""

    run: str  # the first attempt of the chain waited for (its chain's id)
    given: str = ""  # the reference as the user gave it (an id, a prefix, a name, `last`)
    name: str | None = None  # that run's name, for OBD_AFTER_<NAME>_OUTPUT
    states: list[str] = Field(default_factory=lambda: ["succeeded", "stopped"])  # the ends that let it start


class Move(BaseModel):
    """On a run being moved to another target (`obd train move RUN --to T`), written by
    daemon/service/move.py only: kept in its record so a daemon restarted at any point completes
    the move or says why it did not. `state`: `snapshot` (asked, waiting for the proof),
    `starting` (its resume on `to` being made), `carrying` (run `run` made there, its checkpoint on
    its way), `done` (`run` logged its first step there), `failed` (`why`; the run stays resumable
    where it was)."""

    to: str
    gpus: str | None = None
    asked_at: float = Field(default_factory=time.time)
    uid: int | None = None  # who asked (the resume is made as them)
    gid: int | None = None
    state: str = "snapshot"
    run: str | None = None  # the run that continues it on `to`
    why: str = ""


class Placement(BaseModel):
    """Where a run may start, when that is more than one target (daemon/service/placement.py): the targets
    of `--target a,b,c` or a pool, in order of preference, the overflow targets it may also go to
    after a wait; and where it was placed, and why, for `status`. Made by placement.py, written by
    daemon/service/launch.py (a new run's, a chain's next attempt's) and daemon/service/queue.py
    (where the queue placed it, and why)."""

    given: str  # as the user gave it: `a,b,c`, or a pool's name
    targets: list[str]  # in order of preference
    why: str = ""  # "placed on b: a's 2 GPUs all held"


class SweepTag(BaseModel):
    """A run's place in a sweep (`obd train sweep`): one combination of the grid. Made by
    daemon/service/sweeps.py, written by daemon/service/launch.py (a member made, a next attempt's or
    a resume's carried)."""

    id: str  # the sweep's id, shared by its members (`obd train status SWEEP`)
    name: str  # the sweep's name: its members are named <name>-<index>
    index: int  # 1.. in the order of the grid's combinations
    size: int  # how many members the sweep was made with (a sweep cut short by a crash has fewer)
    values: dict[str, str] = Field(default_factory=dict)  # the grid's values of this member, by name
    template: list[str] = Field(default_factory=list)  # the sweep's command, before its values were put in


class BadCheckpoint(BaseModel):
    """A checkpoint an attempt failed to resume from before its first new step (found by
    daemon/service/checkpoints.py): kept on that attempt's record by daemon/service/recovery.py, so no
    later attempt of any chain resumes from it again."""

    run: str  # the run whose directory holds it
    name: str  # checkpoint-<step>
    why: str = ""


class Trackers(BaseModel):
    """The experiment-tracker run a chain's attempts all log to: carried from attempt to attempt and
    to a run resumed from it, so its curves continue in one run. Put on a new attempt by
    daemon/service/launch.py (made by trackers.py's `continued`); daemon/service/trackers.py fills in
    the TensorBoard directory and the MLflow run the job opened."""

    root: str  # the first attempt of the chain (and of the runs resumed from it): W&B's run id is made from it
    target: str | None = None  # where `tensorboard_dir` is
    tensorboard_dir: str | None = None  # the chain's TensorBoard directory, in the first attempt's output/
    mlflow_run_id: str | None = None  # the MLflow run an attempt's job opened (it must exist on the server)


# The record's parts, each written by the modules named here and nowhere else
# (tests/daemon/test_record_parts.py checks it over daemon/ with `ast`): a part's fields are set,
# appended to or the part replaced only there; every other module reads them. `target_info` is
# the executor's dict of a run's pod (executors/runpod's PodInfo), converted in pod_record.py only.
PART_OWNERS: dict[str, tuple[str, ...]] = {
    "preemption": ("daemon/service/preempt.py", "daemon/service/launch.py"),
    "dependencies": ("daemon/service/after.py",),
    "retention": ("daemon/service/retention.py",),
    "limits": ("daemon/service/launch.py", "daemon/service/follow.py", "daemon/service/limits.py"),
    "target_info": ("daemon/service/pod_record.py",),
    "progress": ("daemon/service/progress.py", "daemon/service/carry.py"),
    "stop": ("daemon/service/stop.py", "daemon/service/sweeps.py"),
    "move": ("daemon/service/move.py",),
    "placement": ("daemon/service/launch.py", "daemon/service/queue.py"),
    "sweep": ("daemon/service/launch.py",),
    "trackers": ("daemon/service/launch.py", "daemon/service/trackers.py"),
    "bad_checkpoint": ("daemon/service/recovery.py",),
    "snapshot": ("daemon/service/stop.py", "daemon/service/follow.py"),
}


class PreemptionPart(BaseModel):
    """A run's preemption (docs/preemption.md), written by daemon/service/preempt.py (the pause it is
    asked for: `preempt`) and daemon/service/launch.py (a new attempt: whether it may be paused, the
    pause it resumes from, its chain's totals carried from attempt to attempt and when its chain
    first queued; a resumed pause's time added up when it leaves the queue)."""

    # Whether it may be paused for a run of higher priority (None: its target's default).
    preemptible: bool | None = None
    preempt: Preemption | None = None  # the pause under way
    paused: Paused | None = None  # the pause this attempt resumes from
    # The chain's totals, carried from attempt to attempt.
    preemptions: int = 0
    paused_seconds: float = 0.0
    lost_steps: int = 0
    queue_since: float | None = None  # when its chain first queued (its place among equal priority)


class DependenciesPart(BaseModel):
    """The runs it waits for (`--after`), and whether it starts whatever they ended in (`--after-any`);
    written by daemon/service/after.py when the run is made."""

    after: list[Dependency] = Field(default_factory=list)
    after_any: bool = False


class RetentionPart(BaseModel):
    """Checkpoint retention (docs/checkpoints.md), written by daemon/service/retention.py: how many
    complete checkpoints its chain keeps (None: all), and the checkpoints of its own directory obd
    deleted for it, with the bytes that freed."""

    keep_checkpoints: int | None = None
    pruned: list[str] = Field(default_factory=list)
    pruned_bytes: int = 0


# Where each field of a record of the last release (a91c419 and before) went: it kept its name,
# inside its part. `RunRecord` folds such flat keys into the parts when it loads one.
FLAT_FIELDS: dict[str, type[BaseModel]] = {
    "preemption": PreemptionPart,
    "dependencies": DependenciesPart,
    "retention": RetentionPart,
}


class RunRecord(BaseModel):
    """Everything obd knows of one run. Saved atomically as `runs/<id>/run.json`."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = 1
    id: str
    name: str | None = None
    state: RunState = RunState.preparing
    target: str = "local"
    remote_dir: str = ""
    command: list[str] = Field(default_factory=list)
    cwd: str | None = None
    # Names only: values (--env, --secret, the caller's environment) never reach a record.
    env_names: list[str] = Field(default_factory=list)
    secret_names: list[str] = Field(default_factory=list)
    env_from_caller: bool = False  # the job started from the caller's environment (a local target)
    env_clear: bool = False  # started from an empty environment (--env-clear)
    output_to: str | None = None  # where a job that succeeds leaves its outputs (--output-to)
    owner_uid: int | None = None  # who started the run: only they (and root) may act on it or read it
    owner: str | None = None  # their user name, as `list` shows it
    # GPUs: what the run asked for (a count, or device ids; None: the target's default), and
    # the devices it holds from leaving `queued` until its record is final.
    gpus_wanted: int | list[str] | None = None
    gpus: list[str] = Field(default_factory=list)
    priority: int = 0
    not_before: float | None = None  # a retry waits in the queue until then (its backoff)
    # The parts of its features, each written by its owners (PART_OWNERS above).
    preemption: PreemptionPart = Field(default_factory=PreemptionPart)  # may it be paused, its pauses
    dependencies: DependenciesPart = Field(default_factory=DependenciesPart)  # the runs it waits for (--after)
    sweep: SweepTag | None = None  # the sweep it is a member of
    # Recovery: the attempts of one logical run form a chain (its first run's id).
    chain: str | None = None
    attempt: int = 1
    retries: int = 0  # how many more attempts the chain may make after its first
    retried_by: str | None = None  # the next attempt, once made
    resume_reason: str | None = None  # why the checkpoint it resumed from is trusted
    message: str = ""
    snapshot: Snapshot | None = None
    resumed_from: str | None = None
    resume_checkpoint: str | None = None
    exit_code: int | None = None
    history: list[Transition] = Field(default_factory=list)
    progress: Progress = Field(default_factory=Progress)
    created: float = Field(default_factory=time.time)
    job: dict[str, Any] | None = None  # the executor's JobHandle
    snapshots: bool = False  # the plugin announced itself (`begin` with "snapshots": true)
    snapshot_on_sigterm: bool = False
    profile: bool = False
    stop: StopState = Field(default_factory=StopState)
    target_info: dict[str, Any] = Field(default_factory=dict)  # the executor's: a run's pod (pod_record.py)
    unreachable_since: float | None = None
    metrics: dict[str, Any] | None = None  # RunMetrics, when the run was profiled
    limits: Limits | None = None  # its chain's limits (--time-limit, --deadline, --max-gpu-hours, --max-cost-usd)
    trackers: Trackers | None = None  # the tracker run its chain logs to (None: a run made before obd gave one)
    retention: RetentionPart = Field(default_factory=RetentionPart)  # --keep-checkpoints, what obd pruned
    bad_checkpoint: BadCheckpoint | None = None  # the checkpoint it failed to resume from
    move: Move | None = None  # `obd train move` under way or done (daemon/service/move.py)
    placement: Placement | None = (
        None  # its targets of preference, and where it was placed (daemon/service/placement.py)
    )

    @model_validator(mode="before")
    @classmethod
    def _no_values_from_old_records(cls, data: Any) -> Any:
        """Records written before values were kept out of them had `env` as a dict: keep the names."""
        if isinstance(data, dict) and isinstance(data.get("env"), dict):
            data = dict(data)
            env = data.pop("env")
            data.setdefault("env_names", sorted(str(k) for k in env))
        return data

    @model_validator(mode="before")
    @classmethod
    def _flat_fields_into_parts(cls, data: Any) -> Any:
        """Records written before the parts kept their fields flat (`preemptions`, `after`,
        `pruned`...): each moves into its part under its own name (a part's own value wins)."""
        if not isinstance(data, dict):
            return data
        flat = {part: [k for k in model.model_fields if k in data] for part, model in FLAT_FIELDS.items()}
        if not any(flat.values()):
            return data
        data = dict(data)
        for part, keys in flat.items():
            if not keys:
                continue
            given = data.get(part)
            if isinstance(given, BaseModel):
                given = given.model_dump()
            data[part] = {**{k: data.pop(k) for k in keys}, **(given if isinstance(given, dict) else {})}
        return data

    @property
    def in_queue(self) -> bool:
        """Whether it waits in obd's queue for its GPUs (queued, no job started anywhere yet)."""
        return self.state == RunState.queued and self.job is None

    @property
    def has_job(self) -> bool:
        """Whether a job was started for it and has not ended: running, or pending in a scheduler."""
        return self.state == RunState.running or (self.state == RunState.queued and self.job is not None)

    def transition(self, state: RunState, reason: str, at: float | None = None) -> None:
        """Change the state, saying why; only along the edges of daemon/service/run_states.py (IllegalTransition else)."""
        check_transition(self.id, self.state.value, RunState(state).value)
        self.state = state
        self.message = reason
        self.history.append(Transition(state=state, time=at or time.time(), reason=reason))

    def note(self, event: str, at: float | None = None) -> None:
        """An event that is not a state change (a request seen, a proof, a retry) kept in history.

        Notes stop at HISTORY_NOTES_LIMIT entries (state changes never do), so a job that keeps
        rewriting its request cannot grow its record without bound.
        """
        if len(self.history) >= HISTORY_NOTES_LIMIT:
            return
        self.history.append(Transition(state=self.state, time=at or time.time(), reason=event))

    def summary(self, full: bool = True) -> dict[str, Any]:
        """What `list` shows of a run; another user's run shows no message (it may quote its log)."""
        return {
            "id": self.id,
            "name": self.name,
            "owner": self.owner,
            "state": self.state.value,
            "target": self.target,
            "created": self.created,
            "progress": self.progress.model_dump(),
            "message": self.message if full else "",
            "snapshot": self.snapshot.model_dump() if self.snapshot and full else None,
            "resumed_from": self.resumed_from,
            "gpus": self.gpus,
            "attempt": self.attempt,
            "attempts": self.retries + 1 + self.preemption.preemptions,  # a pause's attempt uses no retry
            "paused": (
                self.preemption.paused.model_dump() if self.preemption.paused is not None and self.in_queue else None
            ),
            "preemptions": self.preemption.preemptions,
            "sweep": self.sweep.id if self.sweep is not None else None,
        }

    def public(self) -> dict[str, Any]:
        return self.model_dump(mode="json")
