"""`obd train move RUN --to T [--gpus N]`: a running run's snapshot, then its resume on T.

One verb for what a user would do in three: `obd train stop RUN --wait`, `obd train resume RUN
--target T`, and a look at whether it trains there. The move is kept on the run's record
(`RunRecord.move`), each step saved before the next, so a daemon restarted at any point finds
where it was: `snapshot` (asked; waiting for the proof), `starting` (the resume being made),
`carrying` (the new run made on T, its checkpoint on its way and checked), then `done` once the
new run logged its first step on T, or `failed` with why. The resume is the same code path as
`resume --target` (the handlers' `resume`): the checkpoint alone carried, every file's sha256
verified on arrival (daemon/service/carry.py).

Nothing is deleted at the source by a move: the stopped run keeps its proven snapshot, which
retention never removes while it is its chain's newest attempt's (daemon/service/retention.py
`protections`), so a move whose carry or start fails leaves the run resumable where it was, and
both runs' histories say what happened.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from daemon.service.api import ApiError, MoveRequest, Peer, ResumeRequest
from daemon.service.models import Move, RunRecord, RunState
from daemon.service.policy import check_target
from daemon.service.stop import StopHost, request_snapshot
from executors.base import ExecutorError

log = structlog.get_logger("obd")

ASKED_BY = {"cli": "`obd train move`", "ui": "the web view", "api": "obd's Python API"}
UNDER_WAY = ("snapshot", "starting", "carrying")
Resume = Callable[[ResumeRequest, Peer], Awaitable[dict[str, Any]]]


class MoveHost(StopHost, Protocol):
    """What a move uses of the daemon: a stop's (the targets, the follow) and the records."""


def stepped_there(moved: RunRecord, new: RunRecord) -> bool:
    """Whether the run continuing a moved one logged a step of its own on its target (a step past
    the snapshot it resumed from), or ended having trained."""
    after = moved.snapshot.step if moved.snapshot is not None else 0
    return (new.progress.step or 0) > after or new.state == RunState.succeeded


class Mover:
    """The moves under way: asked (`ask`), carried on by the records' changes (`on_change`, a
    listener) and, at the daemon's start, from what the records say (`catch_up`)."""

    def __init__(self, daemon: MoveHost, resume: Resume) -> None:
        self.daemon = daemon
        self.resume = resume
        # The resume each move makes, with the mover's --env values, secrets and environment:
        # in memory only, never in a record (docs/security.md).
        self._asked: dict[str, ResumeRequest] = {}
        self._busy: set[str] = set()

    async def ask(self, record: RunRecord, req: MoveRequest, peer: Peer) -> None:
        """Record the move on `record` (running, on another target than `req.to`) and ask its job
        for a snapshot; ApiError when it cannot move."""
        daemon = self.daemon
        if record.move is not None and record.move.state in UNDER_WAY:
            if record.move.to == req.to:
                return  # asked again: the same move goes on
            raise ApiError(
                f"run {record.id} is already being moved to target {record.move.to} ({record.move.state}); "
                f"`obd train status {record.id}` follows it",
                "state",
            )
        self._check(record, req.to)
        # A target the mover may not use is refused before anything is asked of the run ([policy]).
        check_target(daemon.config.policy, peer, req.to, f"obd train move {record.id} --to {req.to}")
        move = Move(to=req.to, gpus=req.gpus, uid=peer.uid, gid=peer.gid)
        self._asked[record.id] = ResumeRequest(
            op="resume",
            id=record.id,
            target=req.to,
            gpus=req.gpus,
            env=req.env,
            secrets=req.secrets,
            environ=req.environ,
            env_clear=req.env_clear,
            umask=req.umask,
        )
        by = ASKED_BY[req.via]
        async with daemon.editing(record):
            record.move = move
            record.note(
                f"move to target {req.to} asked by {by}: a snapshot here, then its checkpoint carried there "
                "and the training continued as a new run of this chain"
            )
        log.info("move_requested", run_id=record.id, to=req.to, gpus=req.gpus)
        try:
            await request_snapshot(daemon, record, "requested", by)
        except (ExecutorError, TimeoutError, OSError) as exc:
            self._asked.pop(record.id, None)
            await self.failed(record, f"the snapshot request could not be written on target {record.target}: {exc}")
            raise ApiError(
                f"could not write the snapshot request on target {record.target}: {exc or 'no answer in time'}; "
                f"the run goes on there: retry `obd train move {record.id} --to {req.to}`",
                "unavailable",
            ) from exc

    def _check(self, record: RunRecord, to: str) -> None:
        if record.state.final:
            hint = (
                f"`obd train resume {record.id} --target {to}` continues it there"
                if record.state == RunState.stopped and record.snapshot is not None
                else f"`obd train status {record.id}` says how it ended"
            )
            raise ApiError(f"run {record.id} already ended ({record.state.value}): there is nothing to move; {hint}")
        if record.in_queue or record.state == RunState.preparing or not record.has_job:
            raise ApiError(
                f"run {record.id} is {record.state.value} and has not started training: there is nothing to "
                f"snapshot; `obd train cancel {record.id}` and start it on target {to} instead",
                "state",
            )
        self.daemon.targets.get(to)  # an unknown target is refused, naming the config
        if to == record.target:
            raise ApiError(f"run {record.id} already runs on target {to}: give --to another target", "usage")

    # --- carried on by the records' changes ------------------------------------------------

    def on_change(self, record: RunRecord) -> None:
        """A listener: a moved run that ended (its snapshot proven, or not), and the run that
        continues one (its launch failed, or it logged its first step there)."""
        move = record.move
        if move is not None and move.state == "snapshot" and record.state.final:
            self._soon(record.id, self._after_snapshot)
        source = self.daemon.records.get(record.resumed_from) if record.resumed_from else None
        if source is None or source.move is None or source.move.run != record.id or source.move.state != "carrying":
            return
        if stepped_there(source, record) or record.state.final:
            self._soon(source.id, self._settle)

    def catch_up(self) -> None:
        """At the daemon's start: every move an earlier daemon left under way goes on from where
        its record says it was."""
        for record in list(self.daemon.records.values()):
            move = record.move
            if move is None or move.state not in UNDER_WAY:
                continue
            if move.state == "snapshot":
                self.on_change(record)
            elif move.state == "starting":
                self._soon(record.id, self._start_there)
            elif move.run is not None and move.run in self.daemon.records:
                self.on_change(self.daemon.records[move.run])
            else:
                self._soon(record.id, self._settle)

    def _soon(self, run_id: str, step: Callable[[str], Awaitable[None]]) -> None:
        if run_id in self._busy:
            return
        self._busy.add(run_id)

        async def go() -> None:
            try:
                await step(run_id)
            except Exception as exc:  # a move's bug must never end the daemon: the run says it
                log.exception("move_failed", run_id=run_id)
                record = self.daemon.records.get(run_id)
                if record is not None and record.move is not None and record.move.state in UNDER_WAY:
                    await self.failed(record, f"obd could not go on with it: {exc}")
            finally:
                self._busy.discard(run_id)

        self.daemon.start_soon(go)

    async def _after_snapshot(self, run_id: str) -> None:
        record = self.daemon.records[run_id]
        if record.state == RunState.stopped and record.snapshot is not None:
            await self._start_there(run_id)
            return
        self._asked.pop(run_id, None)
        await self.failed(
            record,
            f"the run ended {record.state.value} without a snapshot ({record.message}), so nothing was carried",
            resumable=False,
        )

    async def _start_there(self, run_id: str) -> None:
        """The resume on the move's target, as `obd train resume RUN --target T` makes it."""
        daemon = self.daemon
        record = daemon.records[run_id]
        move = record.move
        assert move is not None
        made = self._made_already(record, move)  # a daemon stopped after making it, before saying so
        if made is None:
            async with daemon.editing(record):
                move.state = "starting"
            req = self._asked.pop(run_id, None)
            if req is None:  # the daemon was restarted since the move was asked
                req = ResumeRequest(op="resume", id=run_id, target=move.to, gpus=move.gpus)
            uid = move.uid if move.uid is not None else record.owner_uid
            peer = Peer(uid=uid if uid is not None else os.geteuid(), gid=move.gid or 0)
            try:
                answer = await self.resume(req, peer)
            except ApiError as exc:
                await self.failed(record, f"its resume on target {move.to} was refused: {exc}")
                return
            made = daemon.records.get(str(answer.get("id")))
            if made is None:
                await self.failed(record, f"its resume on target {move.to} made no run")
                return
        async with daemon.editing(record):
            move.state, move.run = "carrying", made.id
            record.note(
                f"moving to target {move.to}: continues as run {made.id} there, from {record.snapshot.checkpoint if record.snapshot else 'its checkpoint'} "
                "carried and verified; nothing is deleted here"
            )
        async with daemon.editing(made):
            made.note(f"moved from run {record.id} of target {record.target} (`obd train move`)")
        log.info("move_started", run_id=record.id, to=move.to, new_run=made.id)
        self.on_change(made)  # its launch may have ended already

    def _made_already(self, record: RunRecord, move: Move) -> RunRecord | None:
        if move.state != "starting":
            return None
        made = [
            r
            for r in self.daemon.records.values()
            if r.resumed_from == record.id and r.target == move.to and r.created >= move.asked_at
        ]
        return max(made, key=lambda r: r.created) if made else None

    async def _settle(self, run_id: str) -> None:
        """The move's end: done once the new run logged a step there, failed if it ended before."""
        daemon = self.daemon
        record = daemon.records[run_id]
        move = record.move
        if move is None or move.state != "carrying":
            return
        new = daemon.records.get(move.run or "")
        if new is None:
            await self.failed(record, f"the run made on target {move.to} ({move.run}) is gone")
            return
        if stepped_there(record, new):
            async with daemon.editing(record):
                move.state = "done"
                record.note(f"moved to target {move.to}: run {new.id} logged step {new.progress.step} there")
            async with daemon.editing(new):
                new.note(f"move from target {record.target} done: step {new.progress.step} logged here")
            log.info("move_done", run_id=record.id, to=move.to, new_run=new.id, step=new.progress.step)
        elif new.state.final:
            why = f"run {new.id} on target {move.to} ended {new.state.value}: {new.message}"
            # The run made there first: whoever sees the move failed finds that run saying so.
            async with daemon.editing(new):
                new.note(f"the move of run {record.id} failed here; {record.id} stays stopped and resumable")
            await self.failed(record, why)

    async def failed(self, record: RunRecord, why: str, resumable: bool = True) -> None:
        """The move ends, said on the run with what it can do next."""
        move = record.move
        assert move is not None
        async with self.daemon.editing(record):
            move.state, move.why = "failed", why
            if not record.state.final:
                why += f"; the run goes on on target {record.target}"
            elif resumable:
                why += (
                    f"; the run stays {record.state.value} on target {record.target}, nothing deleted: "
                    f"`obd train resume {record.id}` continues it there, "
                    f"`obd train resume {record.id} --target {move.to}` tries the move again"
                )
            record.note(f"move to target {move.to} failed: {why}")
        log.info("move_failed", run_id=record.id, to=move.to, why=why)
