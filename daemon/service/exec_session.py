"""`obd train exec` and `obd train shell`: a command where a run's job runs (docs/exec-and-shell.md).

The one socket op that takes its connection over: after the request line, the daemon sends the
command's output as it comes (`{"out": B64}`, `{"err": B64}`) and ends with `{"exit": N}`, or
with an error (`{"ok": false, ...}`) where it could not run; the client sends its input
(`{"in": B64}`, `{"eof": true}`) and, on a terminal, its size (`{"size": [ROWS, COLS]}`). A client
that hangs up ends the command.

The daemon does the work: it alone holds the targets' SSH keys and, as root, may act as a run's
user. Only the run's owner and root may do it (`Daemon.find`), only while the run's job runs, and
the command runs as the run's user (never as root for a user's run), in its run directory, with
the variables its job got (its GPUs, `OBD_*`); each target's executor runs it there
(`Executor.exec_in_run`).
"""

from __future__ import annotations

import base64
import binascii
import os
import pwd
from typing import Any, Protocol

import anyio
import structlog

from daemon.service.api import ApiError, ExecRequest, Peer
from daemon.service.checkpoints import latest_attempt
from daemon.service.gpus import Inventory
from daemon.service.launch import job_env
from daemon.service.models import RunRecord, RunState
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from executors.base import ExecInput, ExecSpec, ExecutorError, JobHandle, RunAs, TermSize
from executors.gpus import visible_devices

log = structlog.get_logger("obd.exec")


class ExecHost(Runs, Protocol):
    """The daemon as a session sees it: the runs as callers name them, the targets, the GPUs held."""

    @property
    def targets(self) -> Targets: ...

    @property
    def inventory(self) -> Inventory: ...

    def find(self, ref: str, peer: Peer) -> RunRecord: ...

    def final_event(self, run_id: str) -> anyio.Event: ...


class Channel(Protocol):
    """The caller's connection, one JSON object a line each way (daemon/service/server.py)."""

    async def send(self, message: dict[str, Any]) -> None: ...

    async def receive(self) -> dict[str, Any] | None:
        """The caller's next message; None once it hung up."""
        ...


class ChannelIO:
    """A command's output sent to the caller as frames, its input read from the caller's."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.gone = False

    async def write(self, stream: str, data: bytes) -> None:
        if self.gone:
            return
        try:
            await self.channel.send({stream: base64.b64encode(data).decode()})
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.gone = True  # the reader sees the hang-up and ends the command

    async def read(self) -> ExecInput | None:
        while True:
            message = await self.channel.receive()
            if message is None:
                self.gone = True
                return None
            if (item := input_of(message)) is not None:
                return item


def input_of(message: dict[str, Any]) -> ExecInput | None:
    """One message of the caller as input to the command; None for one that means nothing."""
    if isinstance(data := message.get("in"), str):
        try:
            return ExecInput(data=base64.b64decode(data, validate=True))
        except (binascii.Error, ValueError):
            return None
    if message.get("eof") is True:
        return ExecInput(eof=True)
    size = message.get("size")
    if isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and 0 < n < 10000 for n in size):
        return ExecInput(size=(size[0], size[1]))
    return None


def not_running(record: RunRecord) -> str | None:
    """Why a command cannot run in this run now, and what to do; None while its job runs."""
    rid = record.id
    if record.state.final:
        return (
            f"run {rid} has ended ({record.state.value}): its job is gone, so there is nowhere to run a "
            f"command. Its files: `obd train outputs {rid}`, `obd train logs {rid}`"
        )
    if record.in_queue or record.state in (RunState.queued, RunState.preparing) or record.job is None:
        return (
            f"run {rid} is {record.state.value}: its job has not started, so there is nowhere to run a command "
            f"yet; `obd train status {rid}` says where it is, and `obd train exec` works once it is running"
        )
    if not record.remote_dir:
        return f"run {rid} has no run directory on record; `obd train status {rid}` says why"
    return None


def account_of(record: RunRecord) -> RunAs | None:
    """Whom the command runs as, when not the daemon's own user: the run's owner, under a root
    daemon (whoever asks, root included). Refused for an owner with no account here any more."""
    owner = record.owner_uid
    if os.geteuid() != 0 or owner is None or owner == 0:
        return None
    try:
        pw = pwd.getpwuid(owner)
    except KeyError as exc:
        raise ApiError(
            f"the owner of run {record.id} (uid {owner}) has no account on this machine, and obd runs a "
            "command in a run only as its user; restore the account (same uid)",
            "denied",
        ) from exc
    return RunAs(
        uid=pw.pw_uid,
        gid=pw.pw_gid,
        groups=sorted(set(os.getgrouplist(pw.pw_name, pw.pw_gid))),
        user=pw.pw_name,
        home=pw.pw_dir,
    )


def exec_env(daemon: ExecHost, record: RunRecord) -> dict[str, str]:
    """The variables the run's job got from obd: where its files are, and its GPUs (on a target
    whose GPUs obd hands out; a Slurm job's are Slurm's, which its step gets from Slurm)."""
    env = job_env(record, record.remote_dir)
    if gpus := daemon.inventory.of(record.target):
        env.update(visible_devices([g for g in gpus if g.id in record.gpus]))
    return env


def spec_of(daemon: ExecHost, req: ExecRequest, record: RunRecord) -> ExecSpec:
    return ExecSpec(
        run_id=record.id,
        remote_dir=record.remote_dir,
        command=req.command,
        env=exec_env(daemon, record),
        run_as=account_of(record),
        tty=TermSize(term=req.term, rows=req.rows, cols=req.cols) if req.tty else None,
        job=JobHandle.model_validate(record.job) if record.job else None,
    )


async def serve(daemon: ExecHost, req: ExecRequest, peer: Peer, channel: Channel) -> None:
    """Run the caller's command in its run and stream it; ApiError where it cannot run."""
    record = latest_attempt(daemon, daemon.find(req.id, peer))
    if (why := not_running(record)) is not None:
        raise ApiError(why, "state")
    spec = spec_of(daemon, req, record)
    executor = daemon.targets.executor(record)
    io = ChannelIO(channel)
    what = "shell" if req.command is None else "exec"
    log.info(what, run_id=record.id, uid=peer.uid, user=spec.run_as.user if spec.run_as else None, tty=req.tty)
    code: int | None = None
    failed: list[Exception] = []
    try:
        # The session ends with its run: where the run's end did not end the command already (its
        # cgroup's or its identity's end, trainer_plugin/tools/contain.py), leaving this ends its group.
        async with anyio.create_task_group() as tg:

            async def run_it() -> None:
                nonlocal code
                try:
                    code = await executor.exec_in_run(spec, io)
                except Exception as exc:  # raised below, outside the task group (not as a group)
                    failed.append(exc)
                tg.cancel_scope.cancel()

            async def end_with_run() -> None:
                await daemon.final_event(record.id).wait()
                tg.cancel_scope.cancel()

            tg.start_soon(run_it)
            tg.start_soon(end_with_run)
        if failed:
            raise failed[0]
    except (ExecutorError, OSError, TimeoutError) as exc:
        log.info(f"{what}_failed", run_id=record.id, error=str(exc))
        raise ApiError(
            f"could not run the command in run {record.id} on target {record.target}: {exc or 'no answer in time'}",
            "unavailable",
        ) from exc
    if code is None:
        log.info(f"{what}_ended_with_run", run_id=record.id, state=record.state.value)
        raise ApiError(
            f"run {record.id} ended ({record.state.value}) and the command ended with it; "
            f"`obd train status {record.id}` says how",
            "state",
        )
    log.info(f"{what}_ended", run_id=record.id, exit_code=code, caller_gone=io.gone)
    if not io.gone:
        await channel.send({"exit": code})
