# Over 600 lines on purpose for now: one launch, in the order it happens (record, machine, run
# directory, plugin, sources, job); splitting by kind of target is issue 35's 'one room per kind'.
"""Starting a run: the record first, then the target's machine, the run directory, the plugin,
the sources, and the job.

The record is saved `preparing` before anything is made on a target, so a daemon killed during
a launch finds the run on restart: re-attached if its job started, failed (saying so) if not.
A start whose answer was lost is never retried (it could start the job twice); the follow
looks in the run's directory once the target answers.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pwd
import secrets as pysecrets
import shutil
import stat
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import anyio
import structlog

from daemon.service.after import announced, output_env
from daemon.service.after import attach as attach_after
from daemon.service.api import ApiError, Peer, StartRequest
from daemon.service.carry import carry_checkpoint
from daemon.service.checkpoints import Checkpoint, resume_point
from daemon.service.config import Config
from daemon.service.follow import Follower
from daemon.service.gpus import Inventory, parse_wanted, queue_message
from daemon.service.limits import carry, check_start, from_request, job_time_of
from daemon.service.models import Paused, Placement, PreemptionPart, RunRecord, RunState, SweepTag
from daemon.service.placement import for_next_attempt, overflows, placement_of, preferences, reachable, settle
from daemon.service.policy import check_target, may_use, target_rule
from daemon.service.ports import Runs
from daemon.service.retention import set_keep
from daemon.service.specs import SPEC, load_spec, spec_bytes
from daemon.service.stop import write_pending_request
from daemon.service.store import StoreError, is_temporary
from daemon.service.sweeps import being_made, sweep_env
from daemon.service.targets import Targets
from daemon.service.trackers import chain_tensorboard_dir, continued, tracker_env
from executors.base import Executor, ExecutorError, JobSpec, LaunchUncertain, RunAs
from executors.factory import job_env_names, makes_pods
from executors.gpus import visible_devices
from trainer_plugin import rundir
from trainer_plugin.tools import creds

log = structlog.get_logger("obd")


class LaunchHost(Runs, Protocol):
    """What the launcher uses of the daemon beyond the records: the targets, the follow (a run
    that started is followed), the GPU inventory, and a caller's run by reference (a resume)."""

    @property
    def targets(self) -> Targets: ...

    @property
    def follow(self) -> Follower: ...

    @property
    def inventory(self) -> Inventory: ...

    def find(self, ref: str, peer: Peer) -> RunRecord: ...


PLUGIN_SRC = Path(__file__).resolve().parents[2] / "trainer_plugin"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + pysecrets.token_hex(3)


def target_secrets(target: str, names: list[str], given: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The job's secrets: the client's `--secret`s, plus the target's `secrets` from the daemon's environment.

    A name the target lists that neither has is refused at start, not left for the job to
    trip over hours later on a remote host.
    """
    missing = [n for n in names if n not in given and n not in environ]
    if missing:
        raise ApiError(
            f"target {target} lists secrets the daemon's environment lacks: {', '.join(missing)}; set them "
            "where the daemon starts (under systemd: an EnvironmentFile= line added with `systemctl edit obd`), "
            "or pass them with `obd train start --secret NAME` from a shell that has them",
            "usage",
        )
    return {**{n: environ[n] for n in names if n not in given}, **given}


MINIMAL_PATH = "/usr/local/bin:/usr/bin:/bin"
RESERVED_NAMES = frozenset({"PYTHONPATH"})  # obd leads it with the run's plugin/


def usable_targets(
    config: Config, peer: Peer, given: str, first: str, placed: Placement | None
) -> tuple[str, Placement | None, list[str]]:
    """The targets of `--target GIVEN` this caller may use (`[policy] target_users`/`target_groups`,
    docs/security.md), and what the run's history says of those left out. A target the caller named
    that they may not use is refused (ApiError), as is a list or pool with none they may use; a
    pool's members they may not use are left out, and so is an overflow (said, never refused)."""
    policy = config.policy
    prefs = list(placed.targets) if placed is not None else [first]
    named = {part.strip() for part in given.split(",")} - set(config.pools)
    others = sorted({"local", *config.targets})
    for target in prefs:
        if target in named or all(not may_use(policy, peer, t) for t in prefs):
            check_target(policy, peer, target, f"a run on target {target}", others)
    notes = [f"target {t} of {given} left out: {target_rule(policy, t)}" for t in prefs if not may_use(policy, peer, t)]
    prefs = [t for t in prefs if may_use(policy, peer, t)]
    for name, over, _ in overflows(config, prefs):
        if over not in prefs and not may_use(policy, peer, over):
            notes.append(f"overflow of target {name} to {over} skipped: {target_rule(policy, over)}")
    if placed is not None and len(prefs) > 1:
        placed = Placement(given=placed.given, targets=prefs)
    elif placed is not None:
        placed = None
    return prefs[0], placed, notes


def check_names(env: dict[str, str], secrets: dict[str, str]) -> None:
    """`--env` and `--secret` names: valid, not obd's own (OBD_*, PYTHONPATH), each given once."""
    for flag, names in (("--env", env), ("--secret", secrets)):
        for key in names:
            if not key or "=" in key or "\0" in key:
                raise ApiError(f"{flag} {key!r}: not a valid environment variable name", "usage")
            if key.startswith("OBD_") or key in RESERVED_NAMES:
                raise ApiError(
                    f"{flag} {key}: OBD_* and PYTHONPATH are set by obd for every job (the run's files, and its "
                    "plugin ahead of your PYTHONPATH); choose another name",
                    "usage",
                )
    both = sorted(set(env) & set(secrets))
    if both:
        raise ApiError(f"{', '.join(both)} given both with --env and --secret: give each name once", "usage")


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def caller_groups(peer: Peer, user: str, gid: int) -> list[int]:
    """The caller's supplementary groups as the socket recorded them when it connected (a caller
    that dropped groups has them dropped in its job too); as a login would get them only on a
    kernel that cannot say (no SO_PEERGROUPS). Never read from /proc/<pid>: by the time a
    request is read that pid may be another process's, whose groups the job must not get."""
    if peer.groups is not None:
        return list(peer.groups) or [gid]
    return os.getgrouplist(user, gid)


def account_for(peer: Peer) -> RunAs | None:
    """The account a local job of this caller runs as, when the daemon must switch to it.

    A root daemon runs each caller's jobs as the caller; a daemon of one user runs its own
    user's, and refuses others (it cannot become them).
    """
    me = os.geteuid()
    if peer.uid == me:
        return None
    if me != 0:
        if peer.is_root:
            return None  # root may use a user's daemon; the job runs as the daemon's user
        raise ApiError(
            f"this daemon runs as {user_name(me)} and can run jobs only as {user_name(me)}; start your own "
            "(`obd daemon`, or `systemctl --user start obd`), or use the system's daemon",
            "denied",
        )
    try:
        pw = pwd.getpwuid(peer.uid)
    except KeyError as exc:
        raise ApiError(f"uid {peer.uid} has no account on this machine; jobs run as a user", "denied") from exc
    return RunAs(
        uid=peer.uid,
        gid=peer.gid,
        groups=caller_groups(peer, pw.pw_name, peer.gid),
        user=pw.pw_name,
        home=pw.pw_dir,
    )


def caller_environment(req: StartRequest, run_as: RunAs | None, target_names: list[str]) -> dict[str, str]:
    """The environment a local job starts from: the caller's (like `sbatch --export=ALL`), never
    the daemon's, except the names the target lists; with --env-clear, a minimal one."""
    if run_as is not None:
        user, home = run_as.user, run_as.home
    else:
        pw = pwd.getpwuid(os.geteuid())
        user, home = pw.pw_name, pw.pw_dir
    if req.env_clear or req.environ is None:
        base = {"HOME": home, "USER": user, "LOGNAME": user, "PATH": MINIMAL_PATH}
    else:
        base = {k: v for k, v in req.environ.items() if not k.startswith("OBD_")}
    for name in target_names:
        if name in os.environ:
            base[name] = os.environ[name]
    return base


def check_cwd(cwd: str, run_as: RunAs | None) -> None:
    """A --cwd must be a directory the caller can open: checked with the caller's own rights, so
    a root daemon never tells a user what is in, or whether there is, a directory they cannot see."""
    who = creds.account(run_as.uid, run_as.gid, run_as.groups) if run_as is not None else None
    try:
        with creds.acting_as(who):
            fd = os.open(cwd, os.O_RDONLY | os.O_DIRECTORY)
        os.close(fd)
    except PermissionError as exc:
        raise ApiError(
            f"--cwd {cwd}: you cannot open it ({exc.strerror}); give a directory of yours", "denied"
        ) from exc
    except OSError as exc:
        raise ApiError(f"--cwd {cwd}: no such directory on the daemon's machine", "usage") from exc


class Launcher:
    """Makes run records and launches their jobs."""

    def __init__(self, daemon: LaunchHost) -> None:
        self.daemon = daemon
        self.launching: set[str] = set()  # runs this daemon is launching right now
        self._admitting: set[str] = set()  # ids of runs being made, not yet in the records
        # A cancel while a run prepares (a pod booting, an upload) ends the preparation at once.
        self._preparing: dict[str, anyio.CancelScope] = {}

    def cancel_preparation(self, record: RunRecord) -> None:
        scope = self._preparing.get(record.id)
        if scope is not None:
            scope.cancel()  # the job never starts; a machine made for it is ended

    # --- the record ----------------------------------------------------------------------

    async def start(
        self, req: StartRequest, peer: Peer, sweep: SweepTag | None = None, created: float | None = None
    ) -> RunRecord:
        """Check the request, save the run (`queued` when it waits for GPUs, for runs (`--after`) or
        as a sweep's member, else `preparing`), and launch it in the background when it can start.
        `created`: its place in the queue, for the members of a sweep made together, in their order."""
        daemon = self.daemon
        first, placed = placement_of(daemon.config, req.target)  # one target, or several (daemon/service/placement.py)
        first, placed, skipped = usable_targets(daemon.config, peer, req.target, first, placed)  # [policy]
        supervision = daemon.targets.get(first)
        check_names(req.env, req.secrets)
        run_as = account_for(peer)
        wanted = parse_wanted(req.gpus)
        for name in reachable(daemon.config, req.target):  # each target it may start on, its overflows too
            config = daemon.targets.get(name).config
            req.secrets = target_secrets(name, config.secrets, req.secrets, os.environ)
            if name not in (placed.targets if placed is not None else [first]):
                continue  # an overflow: a run starts there only once it can (daemon/service/placement.py)
            if placed is None or daemon.inventory.of(name):  # elsewhere among several: what its machine gives
                daemon.inventory.check(name, wanted)
            alone = req.model_copy(update={"target": name})
            check_start(alone, config, wanted, len(daemon.inventory.of(name)), time.time())
        source, point = None, None
        if req.resume_from:
            source = daemon.find(req.resume_from, peer)
            point = await resume_point(daemon, source, req.checkpoint)
            if point is None:
                raise ApiError(
                    f"run {source.id} has no snapshot and no complete checkpoint to resume from; "
                    f"start it again with `obd train start`",
                    "state",
                )
        if req.cwd:
            # On a local target it is where the job runs; elsewhere the directory uploaded as the job's src/.
            await anyio.to_thread.run_sync(check_cwd, req.cwd, run_as)
        record = self._new_record(req, peer.uid)
        record.target, record.placement = first, placed
        for note in skipped:
            record.note(note)
        if created is not None:
            record.created = created
        try:
            attach_after(daemon, req, peer, record)
        except ApiError:
            self._admitting.discard(record.id)  # refused: its id is no one's
            raise
        record.sweep = sweep or (source.sweep if source is not None else None)  # a member's resume is one
        record.gpus_wanted = wanted
        record.retries = req.retry if req.retry is not None else supervision.config.retry
        keep = req.keep_checkpoints
        set_keep(record, keep if keep is not None else supervision.config.keep_checkpoints)
        if supervision.shares_filesystem(record):
            # Where the job runs: --cwd, else where `obd train start` ran (a local run's, and a Slurm
            # run's where sbatch is on this machine: its submit directory), used in place.
            record.cwd = req.cwd or req.client_cwd
            # Only a local target's jobs start from the caller's environment (none is kept for others).
            record.env_from_caller = not req.env_clear and req.environ is not None
        else:
            record.cwd = req.cwd  # uploaded into the run directory (src/); a target may require it
        if source is not None and point is not None:
            record.resumed_from, record.resume_checkpoint, record.resume_reason = source.id, point.name, point.reason
        # A member of a sweep being made waits for the rest of it (said without a look at the GPUs'
        # holders, a look at every run: the queue's pass once it is whole says what it waits for then).
        making = being_made(record) if created is not None else None
        return await self._admit(record, req, run_as, source, waiting=making)

    def _new_record(self, req: StartRequest, owner_uid: int) -> RunRecord:
        daemon = self.daemon
        run_id = new_run_id()
        while run_id in daemon.records or run_id in self._admitting:
            run_id = new_run_id()
        self._admitting.add(run_id)  # taken until its record is saved (starts made together)
        return RunRecord(
            id=run_id,
            name=req.name,
            target=req.target,
            command=req.command,
            env_names=sorted(req.env),
            secret_names=sorted(req.secrets),
            owner_uid=owner_uid,
            owner=user_name(owner_uid),
            priority=req.priority,
            profile=req.profile,
            snapshot_on_sigterm=req.snapshot_on_sigterm,
            env_clear=req.env_clear,
            output_to=req.output_to,
            preemption=PreemptionPart(preemptible=req.preemptible),
            limits=from_request(req),
        )

    async def _admit(
        self,
        record: RunRecord,
        req: StartRequest,
        run_as: RunAs | None,
        source: RunRecord | None,
        why: str | None = None,
        waiting: str | None = None,
    ) -> RunRecord:
        """Save a new run, and its launch settings; launch it now, or queue it (saying `why`, when
        that is more than waiting: a retry's attempt, in the one history entry it starts with)."""
        daemon = self.daemon
        supervision = daemon.targets.of(record)
        record.trackers = continued(record, source)  # the tracker run its curves continue in
        waits = bool(daemon.inventory.wanted(record)) or record.not_before is not None
        waits = waits or bool(record.dependencies.after) or record.sweep is not None  # the queue decides when
        waits = waits or len(preferences(record)) > 1  # ... and where (daemon/service/placement.py)
        if waits:
            record.transition(
                RunState.queued, queue_message(daemon.inventory, record, why, waiting or announced(record))
            )
        else:
            record.transition(RunState.preparing, "created")
        workdir = supervision.workdir(record)
        # An SSH workdir like ~/obd is resolved on the target when the launch connects.
        if workdir.startswith("/"):
            record.remote_dir = f"{workdir.rstrip('/')}/{record.id}"
        try:  # off the event loop (each save fsyncs), durable before anyone is told of the run
            await daemon.store.save_async(record, beside={SPEC: spec_bytes(daemon, req, run_as)})
        except (StoreError, OSError) as exc:
            raise ApiError(str(exc)) from exc
        finally:
            self._admitting.discard(record.id)
        daemon.records[record.id] = record
        log.info(
            "run_created", run_id=record.id, target=record.target, command=record.command[:1], state=record.state.value
        )
        if waits:
            daemon.touch(record)  # the queue looks at it
        else:
            self.launching.add(record.id)
            daemon.start_soon(self._launch, record, req, source, run_as)
        return record

    async def launch_queued(self, record: RunRecord, devices: list[str]) -> None:
        """Start a queued run with these devices (the scheduler's call)."""
        daemon = self.daemon
        spec = load_spec(daemon, record.id)
        if spec is None:
            await daemon.fail(
                record, "its launch settings (launch.json) are gone; start it again with `obd train start`"
            )
            return
        req, run_as = spec
        async with daemon.editing(record):
            leaving = record.state == RunState.queued  # not when it was cancelled meanwhile
            if leaving:
                # Launching from the moment it is `preparing`: the follow's look for runs an
                # earlier daemon left preparing must not take it back while its state is saved.
                self.launching.add(record.id)
                record.gpus = devices
                record.not_before = None
                paused = record.preemption.paused
                if paused is not None:  # a paused run resumes: its pause is over
                    record.preemption.paused_seconds += max(0.0, time.time() - paused.since)
                gpus = f" with GPU{'s' if len(devices) != 1 else ''} {','.join(devices)}" if devices else ""
                record.transition(RunState.preparing, f"leaving the queue{gpus}")
        if not leaving:
            return
        source = daemon.records.get(record.resumed_from or "")
        daemon.start_soon(self._launch, record, req, source, run_as)

    async def next_attempt(
        self,
        prev: RunRecord,
        req: StartRequest,
        run_as: RunAs | None,
        point: Checkpoint | None,
        not_before: float,
        cause: str,
        paused: Paused | None = None,
        lost_steps: int = 0,
    ) -> RunRecord:
        """The next attempt of a chain: like `prev`, from `point` (or the start), after `not_before`;
        with `paused`, the attempt that resumes a run paused by a preemption or a drain (it uses no
        retry, and keeps its place among runs of its priority)."""
        record = self._new_record(req, prev.owner_uid if prev.owner_uid is not None else os.geteuid())
        # The chain's targets again, the one it overflowed to among them; one that was down, last.
        record.target, record.placement = for_next_attempt(self.daemon.config, prev, req.target, cause)
        record.chain = prev.chain or prev.id
        record.attempt = prev.attempt + 1
        record.retries = prev.retries
        set_keep(record, prev.retention.keep_checkpoints)
        record.gpus_wanted = prev.gpus_wanted
        record.priority = prev.priority
        record.cwd = prev.cwd
        record.env_from_caller = prev.env_from_caller
        if record.target != prev.target:  # queued elsewhere: that target's directory rule
            settle(self.daemon.targets, record, record.target, req)
        record.not_before = not_before
        # Its chain's preemption: whether it may be paused, the pause it resumes from, the totals.
        was = prev.preemption
        record.preemption = PreemptionPart(
            preemptible=was.preemptible,
            paused=paused,
            preemptions=was.preemptions + (paused is not None),
            paused_seconds=was.paused_seconds,
            lost_steps=was.lost_steps + lost_steps,
            queue_since=was.queue_since or prev.created,
        )
        record.limits = carry(self.daemon, prev, time.time())  # the chain's limits, and its totals so far
        record.sweep = prev.sweep
        if point is not None:  # of `prev`, or of an earlier attempt of the chain (point.source)
            record.resumed_from, record.resume_checkpoint = point.source or prev.id, point.name
            record.resume_reason = point.reason
        if paused is not None:
            n = record.preemption.preemptions
            times = f"{n} time{'s' if n != 1 else ''}"
            why = f"paused ({paused.why}) since {time.strftime('%H:%M:%S', time.localtime(paused.since))}, {times}"
        else:
            total = record.retries + 1 + record.preemption.preemptions  # a pause's attempt uses no retry
            why = f"attempt {record.attempt} of {total} after {prev.id} ended ({cause})"
        return await self._admit(record, req, run_as, prev, why)

    # --- the job -------------------------------------------------------------------------

    async def _launch(
        self, record: RunRecord, req: StartRequest, source: RunRecord | None, run_as: RunAs | None
    ) -> None:
        try:
            await self._launch_job(record, req, source, run_as)
        finally:
            self.launching.discard(record.id)

    async def _launch_job(
        self, record: RunRecord, req: StartRequest, source: RunRecord | None, run_as: RunAs | None
    ) -> None:
        daemon = self.daemon
        follow = daemon.follow
        try:
            with anyio.CancelScope() as preparation:
                self._preparing[record.id] = preparation
                try:
                    executor, spec = await self._prepare(record, req, source, run_as)
                finally:
                    self._preparing.pop(record.id, None)
            if preparation.cancelled_caught or record.stop.cancel_by == "user":
                await self._cancelled_before_start(record)
                return
            handle = await executor.spawn(spec)
        except LaunchUncertain as exc:
            # The job may be running: stay `preparing` and let the follow look in the run's
            # directory once the target answers (adopted if it started, failed if not).
            async with daemon.editing(record):
                record.note(f"the answer to the start was lost: {exc}; obd looks on the target once it answers")
            log.warning("launch_uncertain", run_id=record.id, error=str(exc))
            follow.ensure_loop(record)
            return
        except (ExecutorError, OSError, ApiError, TimeoutError, StoreError) as exc:
            await self._launch_failed(record, exc)
            return
        except Exception as exc:  # whatever broke, the run must not stay `preparing`
            log.exception("launch_crashed", run_id=record.id)
            await self._launch_failed(record, exc)
            return
        async with daemon.editing(record):
            record.job = handle.model_dump()
            record.transition(RunState.running, f"started ({handle.describe()})")
        log.info("run_started", run_id=record.id, pid=handle.pid)
        follow.ensure_loop(record)
        follow.watch(record)
        await write_pending_request(daemon, record)  # a stop that came while the run prepared
        if record.stop.cancel_by == "user":
            follow.start_cancel(record)

    async def _launch_failed(self, record: RunRecord, exc: Exception) -> None:
        why = str(exc) or "the target did not answer in time"
        log.error("launch_failed", run_id=record.id, error=why)
        # What the launch made (a pod) is ended first, so the final record says how that went.
        ended = await self._end_machine(record)
        async with self.daemon.editing(record):
            record.transition(RunState.failed, f"launch failed: {why}" + (f"; {ended}" if ended else ""))
        await self.daemon.targets.of(record).on_launch_failed(record)

    async def _cancelled_before_start(self, record: RunRecord) -> None:
        ended = await self._end_machine(record)
        async with self.daemon.editing(record):
            message = "cancelled by the user before the job started"
            record.transition(RunState.cancelled, message + (f"; {ended}" if ended else ""))

    async def _end_machine(self, record: RunRecord) -> str:
        try:
            return await self.daemon.targets.of(record).on_end(record)
        except Exception as exc:  # the record's end must not wait on it
            log.exception("end_machine_failed", run_id=record.id)
            return f"what the launch made could not be ended: {exc}"

    async def _prepare(
        self, record: RunRecord, req: StartRequest, source: RunRecord | None, run_as: RunAs | None
    ) -> tuple[Executor, JobSpec]:
        """Everything before the job starts: the machine, the run directory, the plugin, the sources."""
        daemon = self.daemon
        executor = await daemon.targets.of(record).prepare(record)
        if not record.remote_dir:
            with anyio.fail_after(daemon.config.daemon.probe_timeout * 3):
                workdir = await executor.resolve_workdir()
            async with daemon.editing(record):
                record.remote_dir = f"{workdir.rstrip('/')}/{record.id}"
        rd = record.remote_dir
        await executor.make_run_dir(rd, run_as)
        stage = await anyio.to_thread.run_sync(self._plugin_stage)  # every plugin file read and hashed: not on the loop
        await executor.upload(stage, rundir.RunPaths(rd).plugin)
        cwd = record.cwd
        if cwd and not Path(cwd).is_dir():
            cwd = None  # the client's directory went away before the launch: the run directory instead
        if cwd and not executor.shares_filesystem:
            cwd_there = rundir.RunPaths(rd).sources
            await self._upload_sources(record, Path(cwd), cwd_there, executor, run_as)
            cwd = cwd_there
        env = {**req.env, **job_env(record, rd)}
        env.update(sweep_env(record))
        env.update(await output_env(daemon, record))  # where the runs it waited for left their outputs
        base_env = None
        if executor.shares_filesystem:
            base_env = caller_environment(req, run_as, job_env_names(self.daemon.targets.of(record).config))
        target_config = self.daemon.targets.of(record).config
        user_set = {*req.env, *req.secrets, *(base_env or {})}
        board = chain_tensorboard_dir(record, rd, not makes_pods(target_config))
        env.update(tracker_env(record, user_set, board))  # the chain's tracker run (daemon/service/trackers.py)
        if source is not None and record.resume_checkpoint:
            env["OBD_RESUME_FROM"] = await self._resume_path(record, source, record.resume_checkpoint, executor)
            record.resume_checkpoint = env["OBD_RESUME_FROM"]
        if daemon_gpus := self.daemon.inventory.of(record.target):
            env.update(visible_devices([g for g in daemon_gpus if g.id in record.gpus]))
        command = list(req.command)
        if req.profile:
            from runner import wrap_command

            command = wrap_command(command, rundir.RunPaths(rd).plugin, rd, await executor.python())
            env["OBD_PROFILE_DIR"] = rundir.RunPaths(rd).profile
        time_limit, stop_lead = job_time_of(daemon, record, time.time())  # for a scheduler that ends jobs on time
        spec = JobSpec(
            run_id=record.id,
            remote_dir=rd,
            command=command,
            cwd=cwd,
            env=env,
            secrets=req.secrets,
            base_env=base_env,
            run_as=run_as if executor.shares_filesystem or getattr(executor, "runs_as_caller", False) else None,
            umask=req.umask,
            output_to=req.output_to,
            time_limit=time_limit,
            stop_lead=stop_lead,
        )
        return executor, spec

    async def _upload_sources(
        self, record: RunRecord, cwd: Path, there: str, executor: Executor, run_as: RunAs | None
    ) -> None:
        """Upload a --cwd to a target that does not share this machine's files. For a caller the
        daemon is not (a root daemon's users), it is first copied with the caller's own rights
        into a place of the daemon's, so only what the caller can read is ever uploaded, and no
        link swapped in meanwhile is followed with root's rights."""
        if run_as is None:
            await executor.upload(cwd, there)
            return
        stage = self.daemon.store.run_dir(record.id) / "sources-stage"
        who = creds.account(run_as.uid, run_as.gid, run_as.groups)
        try:
            await anyio.to_thread.run_sync(shutil.rmtree, stage, True)
            await anyio.to_thread.run_sync(
                functools.partial(creds.copy_tree, str(cwd), str(stage), read_as=who, write_as=None, keep_links=True)
            )
            await executor.upload(stage, there)
        finally:
            await anyio.to_thread.run_sync(shutil.rmtree, stage, True)

    async def _resume_path(self, record: RunRecord, source: RunRecord, checkpoint: str, executor: Executor) -> str:
        """Where the new run's job finds the checkpoint: in place on the same target, else copied
        into its run directory (from the copy obd retrieved, or from the source's target)."""
        if checkpoint.startswith("/"):
            return checkpoint  # a path the user gave, on the target
        name = checkpoint.rsplit("/", 1)[-1]
        targets = self.daemon.targets
        if targets.key(source) == targets.key(record):
            return rundir.RunPaths(source.remote_dir).in_output(name)
        # Another target: the checkpoint alone, every file verified on arrival (daemon/service/carry.py).
        dest = rundir.RunPaths(record.remote_dir).in_resume(name)
        stage = self.daemon.store.run_dir(record.id) / "carry"
        carried = await carry_checkpoint(self.daemon, source, name, executor, dest, stage, into=record)
        async with self.daemon.editing(record):
            record.note(
                f"{name} of {source.id} carried from target {source.target} to {record.target}: "
                f"{carried.files} files, {carried.size / 1e6:.1f} MB, each one's sha256 verified on arrival"
            )
        return dest

    def clear_staging_leftovers(self, started: float) -> None:
        """At start, before the reconcile: remove what a daemon killed while it staged the plugin
        left, made before `started` (a newer one is a write under way): the temporary files of
        its copies into the plugin/ of this machine's run directories (`.NAME.tmp.PID.HEX`) of the
        runs it may have been staging for (being started, running, or failed at their launch),
        and the half-made copies in STATE_DIR/plugin-stage/."""
        stage_root = self.daemon.state_dir / "plugin-stage"
        with contextlib.suppress(OSError):
            for name in os.listdir(stage_root):
                path = stage_root / name
                if ".tmp" in name and path.is_dir() and not path.is_symlink() and path.lstat().st_mtime < started:
                    shutil.rmtree(path, ignore_errors=True)
                    log.info("leftovers_removed", where=str(path), why="a plugin stage cut short")
        for record in list(self.daemon.records.values()):
            launching = record.state in (RunState.preparing, RunState.running)
            cut_short = record.state == RunState.failed and (
                record.message.startswith("launch failed") or "launch was cut short" in record.message
            )
            if not record.remote_dir or not (launching or cut_short):
                continue
            try:
                here = self.daemon.targets.of(record).answers_at_once()
            except Exception:  # a target no longer configured: nothing of this machine's to clear
                continue
            if here:
                removed = clear_temporaries(rundir.RunPaths(record.remote_dir).plugin, started)
                if removed:
                    log.info("leftovers_removed", run_id=record.id, files=removed, why="a plugin copy cut short")

    def _plugin_stage(self) -> Path:
        """The plugin/ directory every run gets, staged once per content: the `trainer_plugin`
        package as it is here (its two rooms, `plugin/` and `tools/`, under
        `plugin/trainer_plugin/`), and the plugin's `sitecustomize.py` at the top."""
        files: dict[str, Path] = {f"trainer_plugin/{rel}": path for rel, path in package_files(PLUGIN_SRC).items()}
        files["sitecustomize.py"] = PLUGIN_SRC / "plugin" / "sitecustomize.py"
        with contextlib.suppress(ImportError):
            from runner import TARGET_FILES

            files.update({p.name: Path(p) for p in TARGET_FILES})
        with _STAGING:  # run in a worker thread: two launches at once never stage into one temporary
            return self._staged(files)

    def _staged(self, files: dict[str, Path]) -> Path:
        digest = hashlib.sha256()
        for rel, path in sorted(files.items()):
            digest.update(rel.encode() + b"\0" + path.read_bytes())
        stage = self.daemon.state_dir / "plugin-stage" / digest.hexdigest()[:16]
        if not stage.exists():
            tmp = stage.with_name(stage.name + f".tmp{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            for rel, path in files.items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, tmp / rel)
            os.replace(tmp, stage)
        return stage


_STAGING = threading.Lock()


def package_files(root: Path) -> dict[str, Path]:
    """The Python files of the package at `root`, by their path relative to it (no caches)."""
    return {
        path.relative_to(root).as_posix(): path
        for path in sorted(root.rglob("*.py"))
        if "__pycache__" not in path.relative_to(root).parts
    }


def clear_temporaries(directory: str, started: float, depth: int = 3) -> list[str]:
    """Remove the temporary files of atomic writes cut short (`.NAME.tmp.PID.HEX`, regular files
    made before `started`) in `directory` and its subdirectories, `depth` deep; the names removed.
    Each directory is opened relative to its parent without following a link, so a link planted in
    a run directory never leads the daemon's removal elsewhere."""
    removed: list[str] = []
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        _clear_in(fd, directory, started, depth, removed)
    finally:
        os.close(fd)
    return removed


def _clear_in(fd: int, where: str, started: float, depth: int, removed: list[str]) -> None:
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and is_temporary(name) and st.st_mtime < started:
                os.unlink(name, dir_fd=fd)
                removed.append(os.path.join(where, name))
            elif stat.S_ISDIR(st.st_mode) and depth > 1:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    _clear_in(sub, os.path.join(where, name), started, depth - 1, removed)
                finally:
                    os.close(sub)


def job_env(record: RunRecord, rd: str) -> dict[str, str]:
    """The variables obd gives every job: where its run's files are."""
    env: dict[str, str] = {}
    paths = rundir.RunPaths(rd)
    env.update(
        OBD_RUN_ID=record.id,
        OBD_RUN_DIR=rd,
        OBD_OUTPUT_DIR=paths.output,
        OBD_SNAPSHOT_REQUEST=paths.request,
        OBD_SNAPSHOT_FILE=paths.proof,
        OBD_METRICS_FILE=paths.metrics,
    )
    if record.snapshot_on_sigterm:
        env["OBD_SNAPSHOT_ON_SIGTERM"] = "1"
    return env
