# Over 600 lines on purpose: the control API as one table of ops, each handler short and checked
# against its message model here; the session op (exec) and the parts they call live elsewhere.
"""The control API's operations, in one table: each op, the message it takes, and what answers it.

The server (daemon/service/server.py) reads a line, looks the op up here, validates the message
against its model and calls the handler with the caller (`Peer`, from SO_PEERCRED); whatever a
handler raises as `ApiError` goes back to the caller as it is. Every handler that names a run
finds it for that caller (`Daemon.find`): only the run's owner and root may act on it or read it.

Over 600 lines on purpose: one short method per op, each checking its caller and handing the work
to the part that owns it (launch, stop, sweeps, retention, exec_session...); kept together so the
whole API surface, and who may call what, is read in one place.
"""

from __future__ import annotations

import base64
import math
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import anyio
import anyio.lowlevel
import structlog
from pydantic import BaseModel

from daemon.service import exec_session
from daemon.service.api import (
    ApiError,
    DrainRequest,
    ExecRequest,
    IdRequest,
    ListRequest,
    ListRunsRequest,
    MoveRequest,
    Peer,
    PruneRequest,
    RawJSON,
    ReadRequest,
    ResumeRequest,
    StartRequest,
    StopRequest,
    SweepRequest,
    WaitRequest,
    WatchRequest,
)
from daemon.service.checkpoints import bad_checkpoints, chain_attempts, chain_of, latest_attempt
from daemon.service.follow import Follower, job_handle
from daemon.service.gpus import Inventory
from daemon.service.launch import Launcher
from daemon.service.limits import report_of
from daemon.service.models import RunRecord, RunState, SweepTag
from daemon.service.move import Mover
from daemon.service.policy import admitted, check_resume_priority
from daemon.service.ports import Runs
from daemon.service.preempt import Preemptor
from daemon.service.queue import Scheduler
from daemon.service.recovery import Recovery
from daemon.service.retention import Retention, holding
from daemon.service.run_list import ListHost, RunLists
from daemon.service.specs import uses_caller_environment
from daemon.service.stop import ASKED_VIA, cancel_asked, request_snapshot
from daemon.service.sweeps import MAX_MEMBERS, Sweeps
from daemon.service.targets import Targets
from executors.base import Executor, ExecutorError
from executors.factory import is_this_machine, makes_pods
from trainer_plugin import rundir
from trainer_plugin.rundir import normalise_reason
from trainer_plugin.tools.creds import hand_over

log = structlog.get_logger("obd")
Handler = Callable[[Any, Peer], Awaitable[Any]]


class ServiceHost(Runs, ListHost, Protocol):
    """The daemon as the control API sees it: every part, since each op is a way into one of
    them, and the records as callers name, list and watch them."""

    changed_at: dict[str, int]

    @property
    def targets(self) -> Targets: ...

    @property
    def follow(self) -> Follower: ...

    @property
    def launcher(self) -> Launcher: ...

    @property
    def inventory(self) -> Inventory: ...

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def recovery(self) -> Recovery: ...

    @property
    def preemptor(self) -> Preemptor: ...

    @property
    def retention(self) -> Retention: ...

    def find(self, ref: str, peer: Peer) -> RunRecord: ...

    def visible(self, peer: Peer) -> list[RunRecord]: ...

    def final_event(self, run_id: str) -> anyio.Event: ...

    async def wait_change(self, since: int, timeout: float) -> int: ...


class Handlers:
    """The operations of the control socket; `table` maps each op to its model and handler."""

    def __init__(self, daemon: ServiceHost) -> None:
        self.daemon = daemon
        self.sweeps = Sweeps(daemon)  # a sweep's id or name is also taken by status, stop, cancel, resume
        self.moves = Mover(daemon, self.resume)  # `obd train move`: its listener and catch-up are the daemon's
        self.lists = RunLists(daemon)
        self.table: dict[str, tuple[type[BaseModel], Handler]] = {
            "ping": (ListRequest, self.ping),
            "list": (ListRunsRequest, self.list_runs),
            "targets": (ListRequest, self.targets),
            "drain": (DrainRequest, self.drain),
            "undrain": (DrainRequest, self.drain),
            "start": (StartRequest, self.start),
            "stop": (StopRequest, self.stop),
            "cancel": (IdRequest, self.cancel),
            "status": (IdRequest, self.status),
            "wait": (WaitRequest, self.wait),
            "metrics": (IdRequest, self.metrics),
            "read": (ReadRequest, self.read),
            "outputs": (IdRequest, self.outputs),
            "watch": (WatchRequest, self.watch),
            "resume": (ResumeRequest, self.resume),
            "move": (MoveRequest, self.move),
            "sweep": (SweepRequest, self.sweep),
            "prune": (PruneRequest, self.prune),
        }

    def model(self, op: str) -> type[BaseModel] | None:
        entry = self.table.get(op)
        return entry[0] if entry else None

    # Ops that take their connection over (daemon/service/server.py hands them a channel): `exec`.
    SESSIONS: ClassVar[dict[str, type[BaseModel]]] = {"exec": ExecRequest}

    def session_model(self, op: str) -> type[BaseModel] | None:
        return self.SESSIONS.get(op)

    async def run_session(self, request: Any, peer: Peer, channel: exec_session.Channel) -> None:
        """`obd train exec` and `obd train shell` (daemon/service/exec_session.py)."""
        await exec_session.serve(self.daemon, request, peer, channel)

    async def __call__(self, request: Any, peer: Peer) -> Any:
        entry = self.table.get(request.op)
        if entry is None:
            raise ApiError(f"unknown operation {request.op!r}", "usage")
        return await entry[1](request, peer)

    # --- reading -------------------------------------------------------------------------

    async def ping(self, req: ListRequest, peer: Peer) -> dict[str, Any]:
        # A member's runs are theirs in `ordered_of` (no look at others'): ping stays cheap with 5,000 queued.
        runs = len(self.daemon.records) if peer.is_root else len(self.lists.ordered_of(peer))
        return {"pid": os.getpid(), "runs": runs, "uid": os.geteuid()}

    async def list_runs(self, req: ListRunsRequest, peer: Peer) -> RawJSON | list[dict[str, Any]]:
        if req.sweep is not None:  # its members, each with its values and best loss (daemon/service/sweeps.py)
            return list((await self.sweeps.view(self.sweeps.find(req.sweep, peer)))["members"])
        return await self.lists.answer(req, peer)

    async def targets(self, req: ListRequest, peer: Peer) -> list[dict[str, Any]]:
        config = self.daemon.config
        inventory = self.daemon.inventory
        out = []
        for name in sorted({"local", *config.targets}):
            held = inventory.held(name)
            gpus = [
                {"id": g.id, "vendor": g.vendor, "name": g.name, "held_by": held.get(g.id)} for g in inventory.of(name)
            ]
            queued = len(self.daemon.scheduler.queued(name))
            target = config.target(name)
            # What the client may need to know of the kind, as the kind's capabilities say it.
            capabilities = {"this_machine": is_this_machine(target), "pods": makes_pods(target)}
            drained = name in self.daemon.preemptor.drains.targets
            # Where its runs may also go (docs/placement.md): the pools it is in, its overflow.
            pools = sorted(pool for pool, p in config.pools.items() if name in p.targets)
            placing = {"pools": pools, "overflow": target.overflow, "overflow_after": target.overflow_after}
            out.append(
                {
                    "name": name,
                    "kind": target.kind,
                    **capabilities,
                    "gpus": gpus,
                    "queued": queued,
                    "drained": drained,
                    **placing,
                }
            )
        return out

    async def drain(self, req: DrainRequest, peer: Peer) -> dict[str, Any]:
        """`obd targets drain|undrain NAME`: root's or the daemon's user's only (it pauses everyone's runs)."""
        if not (peer.is_root or peer.uid == os.geteuid()):
            raise ApiError("only root (or the daemon's own user) may drain a target: run it with sudo", "denied")
        self.daemon.targets.get(req.target)  # an unknown target is refused, naming the config
        preemptor = self.daemon.preemptor
        if req.op == "undrain":
            preemptor.undrain(req.target)
            self.daemon.scheduler.kick()
            return {"target": req.target, "drained": False}
        result = await preemptor.drain(req.target, req.cancel)
        return {"target": req.target, "drained": True, **result}

    async def status(self, req: IdRequest, peer: Peer) -> dict[str, Any]:
        if (sweep := self.sweeps.named(req.id, peer)) is not None:
            return await self.sweeps.view(sweep)
        record = self.daemon.find(req.id, peer)
        out = record.public()
        if record.id in self.daemon.follow.reconciling:
            out["reconciling"] = True  # its target has not answered since the daemon started
        out["pauses"] = pause_totals(latest_attempt(self.daemon, record))
        usage = report_of(self.daemon, latest_attempt(self.daemon, record), time.time())
        if usage is not None:
            out["usage"] = usage  # the chain's limits, used and left (docs/limits.md)
        if record.in_queue:
            out["queue"] = {
                "position": self.daemon.scheduler.position(record),
                "waiting_for": self.daemon.scheduler.waiting_for(record),
            }
        if record.chain or record.retries:
            out["chain_runs"] = chain_of(self.daemon, record)
        await self._checkpoints_of(record, out)
        if not record.state.final and not out.get("reconciling"):  # its target has not answered yet
            with anyio.move_on_after(10):
                out.update(await self.daemon.targets.of(record).describe(record))
        return out

    async def _checkpoints_of(self, record: RunRecord, out: dict[str, Any]) -> None:
        """For `status`: the checkpoints its chain marked bad, and, under a keep setting or where
        any was pruned, the disk its chain's checkpoints use (docs/checkpoints.md)."""
        chain = chain_attempts(self.daemon, record)
        ids = {r.id for r in chain}
        bad = [
            {"run": run, "name": name, "why": b.why}
            for (run, name), b in bad_checkpoints(self.daemon.records.values()).items()
            if run in ids
        ]
        if bad:
            out["bad_checkpoints"] = bad
        if record.retention.keep_checkpoints is not None or any(r.retention.pruned for r in chain):
            with anyio.move_on_after(10):
                out["checkpoints"] = await self.daemon.retention.usage(record)

    async def prune(self, req: PruneRequest, peer: Peer) -> dict[str, Any]:
        """`obd train prune RUN [--keep N]`: the retention rule applied to RUN's chain now."""
        record = self.daemon.find(req.id, peer)
        done = await self.daemon.retention.prune(record, req.keep)
        return done.answer(record.id)

    async def wait(self, req: WaitRequest, peer: Peer) -> dict[str, Any]:
        record = self.daemon.find(req.id, peer)
        if not record.state.final:
            with anyio.move_on_after(req.timeout):
                await self.daemon.final_event(record.id).wait()
        # Whether its chain goes on (a retry made or due, a paused run's way back): `logs --follow`.
        return {**record.public(), "attempt_to_come": self.daemon.recovery.attempt_to_come(record)}

    async def watch(self, req: WatchRequest, peer: Peer) -> dict[str, Any]:
        """A long poll: the summaries of the caller's runs that changed after version `since`."""
        version = await self.daemon.wait_change(req.since, req.timeout)
        changed = self.daemon.changed_at
        runs = [r.summary() for r in self.daemon.visible(peer) if changed.get(r.id, 0) > req.since]
        return {"version": version, "runs": runs}

    async def metrics(self, req: IdRequest, peer: Peer) -> dict[str, Any]:
        record = self.daemon.find(req.id, peer)
        return {"id": record.id, "state": record.state.value, "metrics": record.metrics, "profile": record.profile}

    async def read(self, req: ReadRequest, peer: Peer) -> dict[str, Any]:
        record = self.daemon.find(req.id, peer)
        if not record.remote_dir or (record.state == RunState.preparing and not record.job):
            return {"data": "", "offset": req.offset, "state": record.state.value}
        name = rundir.JOB_LOG if req.file == "log" else rundir.METRICS
        retrieved = self.daemon.store.run_dir(record.id) / "retrieved" / name
        if record.state.final and retrieved.is_file():
            # The copy obd brought home (a pod's run): its machine may be gone.
            offset = await _tail_local(retrieved, req.tail_lines) if req.tail_lines is not None else req.offset
            data = rundir.read_regular(str(retrieved), req.limit, offset) or b""
            return {
                "data": base64.b64encode(data).decode(),
                "offset": offset,
                "next": offset + len(data),
                "state": record.state.value,
                "progress": record.progress.model_dump(),
            }
        executor = self.daemon.targets.executor(record)
        path = rundir.RunPaths(record.remote_dir).file(name)
        offset = req.offset
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                if req.tail_lines is not None:
                    offset = await _tail_offset(executor, record, path, req.tail_lines, req.file)
                data = await executor.read_from(path, offset, req.limit)
        except (ExecutorError, TimeoutError, OSError) as exc:
            raise ApiError(f"could not read the log of run {record.id}: {exc}", "unavailable") from exc
        return {
            "data": base64.b64encode(data).decode(),
            "offset": offset,
            "next": offset + len(data),
            "state": record.state.value,
            "progress": record.progress.model_dump(),
        }

    async def outputs(self, req: IdRequest, peer: Peer) -> dict[str, Any]:
        """Where the run's outputs are on this machine, for the caller to copy (as themself).

        A local run's are in its run directory, which is its owner's; a remote run's are
        brought into a directory of the owner's under the state directory first (an ended pod
        run's from what obd retrieved, its pod never asked again)."""
        record = self.daemon.find(req.id, peer)
        if not record.remote_dir:
            raise ApiError(f"run {record.id} has no run directory yet ({record.state.value})", "state")
        supervision = self.daemon.targets.of(record)
        if supervision.shares_filesystem(record):
            where = Path(record.remote_dir)
        else:
            try:
                with holding(record.id):
                    where = await mirror_outputs(self.daemon, record)
            except (ExecutorError, TimeoutError, OSError) as exc:
                raise ApiError(
                    f"could not bring the outputs of run {record.id} from target {record.target}: {exc}; retry "
                    f"`obd train outputs {record.id}` once it answers",
                    "unavailable",
                ) from exc
        return {
            "id": record.id,
            "name": record.name,
            "owner_uid": record.owner_uid,
            "state": record.state.value,
            "run_dir": str(where),
            "output": rundir.RunPaths(where).output,
            "checkpoints": rundir.real_checkpoints(str(where)),
            "snapshot": record.snapshot.model_dump() if record.snapshot else None,
        }

    # --- acting --------------------------------------------------------------------------

    async def sweep(self, req: SweepRequest, peer: Peer) -> dict[str, Any]:
        """`obd train sweep`: every run of the grid made, queued, or none (daemon/service/sweeps.py)."""
        size = math.prod(len(axis.values) for axis in req.grid)
        if req.environ is not None and (req.env_clear or not uses_caller_environment(self.daemon, req.target)):
            req.environ = None  # as for a start: never kept where its jobs do not start from it
        # The cap checked and the members queued in one step (daemon/service/policy.py).
        async with admitted(self.daemon, peer, req.priority, size if size <= MAX_MEMBERS else 0, "obd train sweep"):
            with self.daemon.scheduler.holding():  # one pass of the queue once every member is saved
                return await self.sweeps.create(req, peer)

    async def _start_member(self, req: StartRequest, tag: SweepTag, peer: Peer) -> dict[str, Any]:
        """A sweep's member started again from the beginning (`obd train resume SWEEP`)."""
        if req.environ is not None and (req.env_clear or not uses_caller_environment(self.daemon, req.target)):
            req.environ = None
        async with admitted(self.daemon, peer, req.priority, 1, "obd train resume"):
            return (await self.daemon.launcher.start(req, peer, sweep=tag)).public()

    async def start(self, req: StartRequest, peer: Peer, what: str = "obd train start") -> dict[str, Any]:
        if req.environ is not None and (req.env_clear or not uses_caller_environment(self.daemon, req.target)):
            req.environ = None  # its jobs never start from the caller's environment: not kept, not even here
        async with admitted(self.daemon, peer, req.priority, 1, what):  # the box's [policy] (daemon/service/policy.py)
            return (await self.daemon.launcher.start(req, peer)).public()

    async def resume(self, req: ResumeRequest, peer: Peer) -> dict[str, Any]:
        """A new run like RUN (target, command, name, GPUs, directory), from its checkpoint, with
        the environment, `--env` values and secrets of whoever resumes it: never RUN's, which
        are not kept once nothing can start from RUN again (docs/security.md)."""
        daemon = self.daemon
        if (sweep := self.sweeps.named(req.id, peer)) is not None:
            return await self.sweeps.resume(
                sweep,
                req,
                lambda rid: self.resume(req.model_copy(update={"id": rid}), peer),
                lambda start, tag: self._start_member(start, tag, peer),
            )
        source = daemon.find(req.id, peer)
        # Its priority is kept only if the caller may give it (daemon/service/policy.py).
        check_resume_priority(daemon.config.policy, peer, source, req.command or source.command)
        target = req.target or source.target
        elsewhere = target != source.target
        # RUN's GPUs on its own target; elsewhere the new target's default unless --gpus says.
        gpus = req.gpus if req.gpus is not None else None if elsewhere else gpus_text(source.gpus_wanted)
        start = StartRequest(
            op="start",
            command=req.command or source.command,
            target=target,
            name=resumed_name(daemon, source.name),
            # The directory rule of the target it starts on: used in place where that machine sees
            # this one's files, else uploaded (a local run resumed on an SSH host uploads its cwd).
            cwd=source.cwd if not daemon.targets.get(target).shares_filesystem(source) else None,
            client_cwd=source.cwd,
            env=req.env or {},
            secrets=req.secrets,
            environ=req.environ,
            env_clear=req.env_clear,
            umask=req.umask,
            resume_from=source.id,
            checkpoint=req.checkpoint,
            gpus=gpus,
            priority=source.priority,
            retry=req.retry,
            profile=source.profile,
            snapshot_on_sigterm=source.snapshot_on_sigterm,
            time_limit=req.time_limit,
            deadline=req.deadline,
            max_gpu_hours=req.max_gpu_hours,
            max_cost_usd=req.max_cost_usd,
            keep_checkpoints=source.retention.keep_checkpoints,
        )
        answer = await self.start(start, peer, "obd train resume")
        changed = resumed_elsewhere(source, target, req.gpus)
        record = daemon.records.get(answer["id"])
        if changed and record is not None:
            async with daemon.editing(record):
                record.note(changed)
            answer = record.public()
        return answer

    async def stop(self, req: StopRequest, peer: Peer) -> dict[str, Any]:
        if (sweep := self.sweeps.named(req.id, peer)) is not None:  # every member that runs
            with self.daemon.scheduler.holding():
                return await self.sweeps.stop(sweep, lambda rid: self.stop(req.model_copy(update={"id": rid}), peer))
        record = latest_attempt(self.daemon, self.daemon.find(req.id, peer))
        reason = normalise_reason(req.reason) or rundir.DEFAULT_REASON
        if record.state.final:
            raise ApiError(f"run {record.id} already ended ({record.state.value}): {record.message}", "state")
        if record.in_queue:
            raise ApiError(
                f"run {record.id} is queued and has not started: there is nothing to snapshot; "
                f"`obd train cancel {record.id}` takes it out of the queue",
                "state",
            )
        if not record.snapshots and record.state == RunState.running:
            await self._refresh(record)  # the job may have announced the plugin since the last poll
        # A job that has not announced obd's plugin yet (still loading its model, or not started)
        # keeps the request: the plugin takes it at its first step boundary, and the stop
        # fallback ends a job that never announces it.
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                await request_snapshot(self.daemon, record, reason, ASKED_VIA[req.via])
        except (ExecutorError, TimeoutError, OSError) as exc:
            raise ApiError(
                f"could not write the snapshot request on target {record.target}: {exc or 'no answer in time'}; "
                f"retry `obd train stop {record.id}`, or `obd train cancel {record.id}`",
                "unavailable",
            ) from exc
        if not record.snapshots and record.state == RunState.running:
            await self._refresh(record)  # whether a snapshot can come at all (stop.see_no_plugin), in the reply
        return record.public()

    async def move(self, req: MoveRequest, peer: Peer) -> dict[str, Any]:
        """`obd train move RUN --to T`: a snapshot asked of the running RUN; once it is proven, the
        daemon resumes RUN on T as `resume --target T` does (daemon/service/move.py)."""
        record = latest_attempt(self.daemon, self.daemon.find(req.id, peer))
        if req.environ is not None and (req.env_clear or not uses_caller_environment(self.daemon, req.to)):
            req.environ = None  # as for a start: never kept where its jobs do not start from it
        if not record.snapshots and record.state == RunState.running:
            await self._refresh(record)  # the job may have announced the plugin since the last poll
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                await self.moves.ask(record, req, peer)
        except TimeoutError as exc:
            await self.moves.failed(record, f"target {record.target} did not take the snapshot request in time")
            raise ApiError(
                f"could not write the snapshot request on target {record.target}: no answer in time; the run goes "
                f"on there: retry `obd train move {record.id} --to {req.to}`",
                "unavailable",
            ) from exc
        if not record.snapshots and record.state == RunState.running:
            await self._refresh(record)  # whether a snapshot can come at all (stop.see_no_plugin), in the reply
        return record.public()

    async def _refresh(self, record: RunRecord) -> None:
        """Read the run's directory now (one probe) and fold it into the record."""
        try:
            executor = self.daemon.targets.executor(record)
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                [probe] = await executor.probe([(job_handle(record), record.remote_dir)])
        except (ExecutorError, TimeoutError, OSError, ApiError) as exc:
            log.info("refresh_failed", run_id=record.id, error=str(exc))
            return
        await self.daemon.follow.apply(record, probe)

    async def cancel(self, req: IdRequest, peer: Peer) -> dict[str, Any]:
        daemon = self.daemon
        if (sweep := self.sweeps.named(req.id, peer)) is not None:  # every member, one pass of the queue after
            with daemon.scheduler.holding():
                return await self.sweeps.cancel(
                    sweep, lambda rid: self.cancel(req.model_copy(update={"id": rid}), peer)
                )
        # Any attempt's id reaches the chain: the id `start` printed cancels the attempt now
        # queued or running, or, when the newest attempt has ended, the retry still to come.
        record = latest_attempt(daemon, daemon.find(req.id, peer))
        if record.state.final:
            await daemon.recovery.end_chain(record, "cancelled by the user")
            return record.public()  # idempotent: a run that ended is never signalled
        async with daemon.editing(record):  # one save, a queued run's cancel included
            cancel_asked(record, "cancel requested by the user")
            if record.in_queue:  # never started, and now never will
                record.transition(RunState.cancelled, "cancelled by the user while queued")
        log.info("cancel_requested", run_id=record.id)
        if record.has_job:
            daemon.follow.start_cancel(record)
        elif not record.state.final:  # preparing (a queued one was cancelled above)
            daemon.launcher.cancel_preparation(record)
        return record.public()


def pause_totals(latest: RunRecord) -> dict[str, Any]:
    """The chain's pauses, as its newest attempt carries them: how many, the time paused in all
    (the one under way counted up to now), and the steps lost (0 when every snapshot was verified)."""
    part = latest.preemption
    paused = part.paused_seconds
    if part.paused is not None and latest.in_queue:
        paused += max(0.0, time.time() - part.paused.since)
    return {"preemptions": part.preemptions, "paused_seconds": round(paused, 1), "lost_steps": part.lost_steps}


def resumed_name(daemon: ServiceHost, name: str | None) -> str | None:
    """`sft` resumed is `sft-r2`, then `sft-r3`: each name stays a run's own."""
    if not name:
        return None
    base = name
    head, sep, tail = name.rpartition("-r")
    if sep and tail.isdigit() and head:
        base = head
    taken = {r.name for r in daemon.records.values()}
    n = 2
    while f"{base}-r{n}" in taken:
        n += 1
    return f"{base}-r{n}"


def resumed_elsewhere(source: RunRecord, target: str, gpus: str | None) -> str:
    """What a resume changed of RUN's placement, for the new run's history ("" when nothing):
    another target, and GPUs other than RUN's (the Trainer's data-parallel size may change)."""
    said = []
    if target != source.target:
        said.append(f"resumed from {source.id} of target {source.target} on target {target}, its checkpoint carried")
    if gpus is not None and gpus != gpus_text(source.gpus_wanted):
        had = len(source.gpus) if source.gpus else gpus_text(source.gpus_wanted) or "the target's default"
        said.append(
            f"with --gpus {gpus} where {source.id} had {had}: with another data-parallel size the Trainer "
            "resumes at the same step, but the data order and the effective batch change, so the losses "
            "are not an uninterrupted run's (docs/checkpoints.md)"
        )
    return "; ".join(said)


def gpus_text(wanted: int | list[str] | None) -> str | None:
    if wanted is None:
        return None
    return ",".join(wanted) + ("," if len(wanted) == 1 else "") if isinstance(wanted, list) else str(wanted)


RETRIEVED_MANIFEST = "retrieved.json"  # written into retrieved/ once a pod's retrieval verified every file


def retrieved_copy(daemon: ServiceHost, record: RunRecord) -> Path | None:
    """The copy of an ended run's directory that obd brought home from its machine (a pod's:
    verified, with its manifest), when there is one: then it is all there is to read, and the
    machine, which may be gone, is not asked again."""
    local = daemon.store.run_dir(record.id) / "retrieved"
    if record.state.final and (Path(rundir.RunPaths(local).output).is_dir() or (local / RETRIEVED_MANIFEST).is_file()):
        return local
    return None


def no_output(record: RunRecord, target: str) -> str:
    """Why an ended run brought home without an output/ has nothing to copy, and where to look."""
    return (
        f"run {record.id} ({record.state.value}) wrote no output/: obd brought its run directory home from "
        f"target {target} when it ended, and there is no output/ in it, so there is nothing to copy. A job's "
        "outputs are what it writes in $OBD_OUTPUT_DIR (the run's output/; a transformers Trainer's output_dir "
        f"under obd); `obd train logs {record.id}` shows what it did"
    )


def outputs_lost(daemon: ServiceHost, record: RunRecord) -> str | None:
    """Why an ended run's outputs are nowhere any more (its pod ended before they were retrieved), as
    its target tells; None where the target may still have them."""
    return daemon.targets.of(record).outputs_lost(record)


async def mirror_outputs(daemon: ServiceHost, record: RunRecord) -> Path:
    """Bring a remote run's outputs into `STATE_DIR/jobs/<id>`, owned by the run's owner.

    An ended run whose directory obd brought home is served from that copy, never from its
    machine: a job that wrote no output/ is said to have written none, and a pod that ended before
    its outputs came home is said to have taken them with it, without reaching for it.

    They are gathered in a directory only the daemon can enter, handed over to the owner, then
    renamed into place, so nothing the owner can touch is ever written with the daemon's rights.
    """
    home = retrieved_copy(daemon, record)
    if home is None and record.state.final and (lost := outputs_lost(daemon, record)):
        raise ApiError(lost, "state")
    if home is not None and not Path(rundir.RunPaths(home).output).is_dir():
        raise ApiError(no_output(record, record.target), "state")
    jobs = daemon.state_dir / "jobs"
    stage = jobs / f".stage-{record.id}-{os.urandom(4).hex()}"
    stage.mkdir(mode=0o700)
    try:
        if home is not None:
            retrieved, staged = rundir.RunPaths(home).output, rundir.RunPaths(stage).output
            await anyio.to_thread.run_sync(lambda: shutil.copytree(retrieved, staged, symlinks=True))
        else:
            executor = daemon.targets.executor(record)
            with anyio.fail_after(3600):
                await executor.download(rundir.RunPaths(record.remote_dir).output, Path(rundir.RunPaths(stage).output))
        owner = record.owner_uid if record.owner_uid is not None else os.geteuid()
        if owner != os.geteuid():
            await anyio.to_thread.run_sync(hand_over, stage, owner, pwd_gid(owner))
        final = jobs / record.id
        if final.exists():
            old = jobs / f".old-{record.id}-{os.urandom(4).hex()}"
            os.rename(final, old)
            os.rename(stage, final)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(old, ignore_errors=True))
        else:
            os.rename(stage, final)
        return final
    finally:
        if stage.exists():
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(stage, ignore_errors=True))


def pwd_gid(uid: int) -> int:
    import pwd

    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


TAIL_BLOCK = 65536  # how much of a log one read takes when looking for where its last lines start


def newlines_back(chunk: bytes, start: int, end: int, wanted: int) -> tuple[int | None, int]:
    """Look back through `chunk` (a file's bytes from `start`; the file is `end` bytes) for `wanted` line starts.

    Returns the offset of the earliest of them once `wanted` are found (else None) and how many
    were found. The newline that ends the file's last line starts no line.
    """
    pos, found = len(chunk), 0
    while found < wanted:
        i = chunk.rfind(b"\n", 0, pos)
        if i < 0:
            return None, found
        pos = i
        if start + i != end - 1:
            found += 1
    return start + pos + 1, found


async def tail_start(read: Callable[[int, int], Awaitable[bytes]], end: int, lines: int) -> int:
    """The offset where the last `lines` lines of a file of `end` bytes start, read back from its end in blocks."""
    if lines == 0:
        return end
    pos, wanted = end, lines
    while pos > 0:
        start = max(0, pos - TAIL_BLOCK)
        offset, found = newlines_back(await read(start, pos - start), start, end, wanted)
        if offset is not None:
            return offset
        wanted -= found
        pos = start
    return 0


async def _tail_local(path: Path, lines: int) -> int:
    """The offset where the last `lines` lines of a local file (a retrieved copy) start."""

    async def read(start: int, size: int) -> bytes:
        return rundir.read_regular(str(path), size, start) or b""

    try:
        end = path.stat().st_size
    except OSError:
        return 0
    return await tail_start(read, end, lines)


async def _tail_offset(executor: Executor, record: RunRecord, path: str, lines: int, file: str) -> int:
    """The offset where the last `lines` lines of the run's log or metrics on the target start."""
    [probe] = await executor.probe([(job_handle(record), record.remote_dir)])

    async def read(start: int, size: int) -> bytes:
        return await executor.read_from(path, start, size)

    return await tail_start(read, probe.log_size if file == "log" else probe.metrics_size, lines)
