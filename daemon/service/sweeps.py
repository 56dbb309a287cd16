"""Sweeps: `obd train sweep [start options] --grid NAME=V1,V2 ... -- COMMAND ... {NAME} ...`
(docs/dependencies-and-sweeps.md).

A sweep is one run per combination of its grid, each with its values put in its command where
`{NAME}` is and in its environment as `OBD_SWEEP_<NAME>`, named `<sweep>-<n>` and tagged with
the sweep's id (`RunRecord.sweep`). The daemon makes them all in one request, every member
`queued`, and none leaves the queue before the last is saved: a start refused for one member
(a bad option: the first) refuses the sweep, a failure after some were made cancels those, and
a daemon killed in the middle leaves members that the queue cancels when it starts again
(`gate`: a member made by an earlier daemon whose sweep has fewer members than its size). They
then go through the normal queue, so with GPUs by config they run in GPU-sized batches.

`obd train status SWEEP` and `obd train list --sweep SWEEP` show the members as a table (state,
step, loss, the lowest loss logged, from metrics.jsonl); `stop`, `cancel` and `resume` given a
sweep's id or name act on every member (`Sweeps`).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import secrets as pysecrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import structlog

from daemon.service.after import Verdict
from daemon.service.api import ApiError, GridAxis, Peer, ResumeRequest, StartRequest, SweepRequest
from daemon.service.checkpoints import latest_attempt
from daemon.service.models import RunRecord, RunState, SweepTag
from daemon.service.ports import Runs
from daemon.service.stop import cancel_asked
from daemon.service.store import LAUNCH_SETTINGS as SPEC
from daemon.service.store import Batch
from daemon.service.targets import Targets
from daemon.service.turns import Share
from executors.base import ExecutorError
from trainer_plugin import rundir

log = structlog.get_logger("obd.sweeps")

MAX_MEMBERS = 1000
GRID_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# The message of a member that `obd train stop SWEEP` took out of the queue before it started:
# `obd train resume SWEEP` starts those again from the beginning.
STOPPED_QUEUED = "cancelled while queued: its sweep was stopped (`obd train resume SWEEP` starts it again)"
METRICS_CHUNK = 4 << 20  # one read of a member's metrics.jsonl
METRICS_CHUNKS = 16  # at most this many reads a look (what is left is read by the next look)
MEMBERS_AT_ONCE = 64  # members a stop or cancel acts on together (their saves share the writer's trips)
SLICE = 100  # members a trip of the store's writer takes (their saves' fsyncs made together)
CANCELLED_QUEUED = "cancelled by the user while queued"


# --- the grid (pure) ---------------------------------------------------------------------------


def combinations(grid: list[GridAxis]) -> list[dict[str, str]]:
    """Every combination of the grid's values, the first axis varying slowest, each as {NAME: value};
    names are identifiers, each given once (not even in another case, as OBD_SWEEP_<NAME> is upper
    case), values non-empty and each given once per name, at most MAX_MEMBERS combinations."""
    seen: dict[str, str] = {}
    for axis in grid:
        if not GRID_NAME.match(axis.name):
            raise ApiError(
                f"--grid {axis.name}=...: a grid name is letters, digits and '_', not starting with a digit "
                "(it is {NAME} in the command and OBD_SWEEP_NAME in the job's environment)",
                "usage",
            )
        if axis.name.upper() in seen:
            raise ApiError(
                f"--grid {axis.name} and --grid {seen[axis.name.upper()]}: a name is given once (its environment "
                f"variable is OBD_SWEEP_{axis.name.upper()} for both); put every value in one --grid",
                "usage",
            )
        seen[axis.name.upper()] = axis.name
        if any(not value for value in axis.values) or len(set(axis.values)) != len(axis.values):
            raise ApiError(f"--grid {axis.name}: give each value once, none empty, e.g. --grid lr=1e-4,2e-4", "usage")
        if any("\0" in value for value in axis.values):
            raise ApiError(f"--grid {axis.name}: a value may not hold a NUL character", "usage")
    count = math.prod(len(axis.values) for axis in grid)
    if count > MAX_MEMBERS:
        raise ApiError(f"the grid makes {count} runs; a sweep has at most {MAX_MEMBERS}: split it", "usage")
    names = [axis.name for axis in grid]
    return [dict(zip(names, values, strict=True)) for values in itertools.product(*(a.values for a in grid))]


def substitute(command: list[str], values: dict[str, str]) -> list[str]:
    """The command with `{NAME}` replaced by the value of NAME wherever it is in a word; braces that
    name nothing of the grid (a shell's, a format string's) are left as they are."""
    out = []
    for word in command:
        made = word
        for name, value in values.items():
            made = made.replace("{" + name + "}", value)
        out.append(made)
    return out


def sweep_env(record: RunRecord) -> dict[str, str]:
    """A member's variables: OBD_SWEEP_<NAME> (upper case) for each of its values, and the sweep's
    id and the member's index; none for a run of no sweep."""
    tag = record.sweep
    if tag is None:
        return {}
    env = {f"OBD_SWEEP_{name.upper()}": value for name, value in tag.values.items()}
    env.update(OBD_SWEEP_ID=tag.id, OBD_SWEEP_INDEX=str(tag.index))
    return env


def gate(record: RunRecord, made: int, started: float) -> Verdict | None:
    """Whether a queued member may leave the queue as far as its sweep goes (None: it may), given how
    many of its sweep's members are saved and when this daemon started: a member of a sweep not
    all made waits while it is being made, and is cancelled when an earlier daemon made it (its
    making was cut short: no one was told the sweep's id)."""
    tag = record.sweep
    if tag is None or made >= tag.size:
        return None
    if record.created < started:
        return Verdict(
            "cancel",
            f"cancelled while queued: the daemon stopped while sweep {tag.id} was being made ({made} of its "
            f"{tag.size} runs saved), so none of it runs; start the sweep again with `obd train sweep`",
        )
    return Verdict("wait", being_made(record) or "")


def being_made(record: RunRecord) -> str | None:
    """What a member of a sweep being made waits for (None: a run of no sweep)."""
    return f"waiting for the rest of sweep {record.sweep.id} to be made" if record.sweep is not None else None


def fold_best(data: bytes, best: tuple[float | None, int | None]) -> tuple[float | None, int | None]:
    """The lowest loss of the `log` lines in `data` (whole lines of metrics.jsonl), and its step,
    given the best so far; only finite numbers are taken (anyone who can write the run directory
    writes these lines)."""
    loss, step = best
    for line in data.split(b"\n"):
        if b'"log"' not in line:
            continue
        try:
            event = rundir.load_json(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("event") != "log":
            continue
        value = event.get("loss")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        if loss is None or value < loss:
            at = event.get("step")
            loss, step = float(value), at if isinstance(at, int) and not isinstance(at, bool) else None
    return loss, step


def gpus_text(wanted: int | list[str] | None) -> str | None:
    """A run's `gpus_wanted` as `--gpus` writes it (as handlers.gpus_text, for a start again)."""
    if wanted is None:
        return None
    return ",".join(wanted) + ("," if len(wanted) == 1 else "") if isinstance(wanted, list) else str(wanted)


# --- the daemon's side ---------------------------------------------------------------------------


class Continuing(Protocol):
    """Recovery as a sweep's stop sees it: a chain whose retry is still to come can be ended."""

    def attempt_to_come(self, record: RunRecord) -> bool: ...

    async def end_chain(self, record: RunRecord, why: str) -> bool: ...


class Starts(Protocol):
    """The launcher as a sweep sees it: a run started, tagged as a member of a sweep, and the ids
    of the runs being made (taken, not yet in the records)."""

    _admitting: set[str]  # the launcher's own: a copy of a member takes its id there too

    async def start(
        self, req: StartRequest, peer: Peer, sweep: SweepTag | None = None, created: float | None = None
    ) -> RunRecord: ...


class SweepHost(Runs, Protocol):
    """What sweeps use of the daemon: the launcher (the members), the targets (their metrics),
    recovery, and the caller's runs by reference."""

    @property
    def launcher(self) -> Starts: ...

    @property
    def targets(self) -> Targets: ...

    @property
    def recovery(self) -> Continuing: ...

    def find(self, ref: str, peer: Peer) -> RunRecord: ...

    def visible(self, peer: Peer) -> list[RunRecord]: ...

    def final_event(self, run_id: str) -> anyio.Event: ...


@dataclass
class Sweep:
    """A sweep as a caller named it: its id and name, and every run of it (attempts and resumes)."""

    id: str
    name: str
    size: int
    runs: list[RunRecord]

    def members(self) -> list[tuple[int, list[RunRecord]]]:
        """Each member's index and its runs, oldest first (its newest is what it is now)."""
        by_index: dict[int, list[RunRecord]] = {}
        for record in sorted(self.runs, key=lambda r: (r.created, r.id)):
            assert record.sweep is not None
            by_index.setdefault(record.sweep.index, []).append(record)
        return sorted(by_index.items())


@dataclass
class _Best:
    offset: int = 0
    loss: float | None = None
    step: int | None = None


@dataclass
class Acted:
    """What an operation on every member did: the records acted on, and what it left, and why."""

    sweep: Sweep
    runs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def answer(self) -> dict[str, Any]:
        return {"sweep": self.sweep.id, "name": self.sweep.name, "runs": self.runs, "notes": self.notes}

    def take(self, done: list[tuple[str, dict[str, Any] | ApiError]]) -> None:
        """The outcome of an operation on each member: its record, or a note of why not."""
        for rid, result in done:
            if isinstance(result, ApiError):
                self.notes.append(f"{rid}: {result}")
            else:
                self.runs.append(result)


RunOp = Callable[[str], Awaitable[dict[str, Any]]]


async def each(records: list[RunRecord], op: RunOp) -> list[tuple[str, dict[str, Any] | ApiError]]:
    """`op` on every record, MEMBERS_AT_ONCE at a time, so that their saves share the store's
    trips (one at a time, a sweep of 1,000 is 1,000 trips); each outcome in the records' order."""
    done: dict[str, dict[str, Any] | ApiError] = {}
    todo = iter(records)  # shared: each worker takes the next (no task made per record)

    async def worker() -> None:
        for record in todo:
            try:
                done[record.id] = await op(record.id)
            except ApiError as exc:
                done[record.id] = exc

    async with anyio.create_task_group() as tg:
        for _ in range(min(MEMBERS_AT_ONCE, len(records))):
            tg.start_soon(worker)
    return [(r.id, done[r.id]) for r in records]


class Sweeps:
    """Makes sweeps, finds them by reference, shows them, and acts on every member."""

    def __init__(self, daemon: SweepHost) -> None:
        self.daemon = daemon
        self._best: dict[str, _Best] = {}
        self._random: list[int] = []  # random bytes for the next run ids (`_new_run_id`)

    def _new_id(self) -> str:
        taken = {r.sweep.id for r in self.daemon.records.values() if r.sweep is not None}
        while True:
            sweep_id = "sweep-" + pysecrets.token_hex(4)
            if sweep_id not in taken:
                return sweep_id

    async def create(self, req: SweepRequest, peer: Peer) -> dict[str, Any]:
        """Every member of a sweep, queued, or none (see the module's docstring)."""
        combos = combinations(req.grid)
        sweep_id = self._new_id()
        name = req.name or sweep_id
        if len(f"{name}-{len(combos)}") > 100:
            raise ApiError(f"--name {name[:40]}...: too long for its runs' names (<name>-<n>, 100 at most)", "usage")
        base = req.model_dump(exclude={"op", "grid"})
        start = {**base, "op": "start", "command": substitute(req.command, combos[0]), "name": f"{name}-1"}
        tag = SweepTag(id=sweep_id, name=name, index=1, size=len(combos), values=combos[0], template=list(req.command))
        made: dict[int, RunRecord] = {}
        try:
            # The first as `obd train start` makes a run (every check: a bad option refuses the
            # sweep before anything else is made), the others as copies of it.
            made[1] = await self.daemon.launcher.start(
                StartRequest.model_validate(start), peer, sweep=tag, created=time.time()
            )
            with anyio.CancelScope(shield=True):  # a client gone: every member saved is in `made`
                await self._copies(made[1], req.command, combos, made)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._undo(list(made.values()), exc)
            raise
        made_runs = [made[index] for index in sorted(made)]
        log.info("sweep_created", sweep=sweep_id, runs=len(made_runs), first=made_runs[0].id, last=made_runs[-1].id)
        return {
            "sweep": sweep_id,
            "name": name,
            "size": len(made),
            "runs": [
                {"id": r.id, "name": r.name, "state": r.state.value, "command": r.command, "values": tag_values(r)}
                for r in made_runs
            ],
        }

    async def _copies(
        self, first: RunRecord, command: list[str], combos: list[dict[str, str]], made: dict[int, RunRecord]
    ) -> None:
        """Every member after the first, into `made`: a copy of the first's record and launch
        settings but for its id, name, command, values and place in the queue (`created`, in the
        grid's order), as a start of its request would make it (the requests differ only there,
        so every check of the first holds for them). Made SLICE at a time between two turns of
        the event loop, each slice handed to the store's writer as it is made (`_handed_over`:
        its threads write one while the next is made, a sweep of 1,000 is ten trips); each
        member is a run of the daemon once saved. A save that failed (a full disk) raises, the
        members saved being in `made` (`_undo` cancels them)."""
        daemon = self.daemon
        store = daemon.store
        raw = await anyio.to_thread.run_sync(rundir.read_regular, str(store.run_dir(first.id) / SPEC), 16 << 20)
        spec = rundir.load_json(raw or b"{}")
        if not isinstance(spec, dict) or not isinstance(spec.get("request"), dict):
            raise ApiError(f"the launch settings of run {first.id} could not be read back to copy them")
        template = first.model_dump()
        reserved = daemon.launcher._admitting
        copies: list[tuple[RunRecord, Batch]] = []
        slices: list[Batch] = []
        failed = ""
        share = Share()
        try:
            for n, values in enumerate(combos[1:], 2):
                record = self._copy(first, template, n, values, substitute(command, values))
                reserved.add(record.id)
                spec["request"]["command"], spec["request"]["name"] = record.command, record.name
                copies.append((record, store.save_later(record, beside={SPEC: json.dumps(spec).encode()})))
                if n % SLICE == 0:
                    await self._handed_over(copies[-1][1], slices)
                else:
                    await share.turn()
            await store.flush()
            for record, batch in copies:
                await share.turn()
                if record.id in batch.failed:
                    failed = failed or batch.failed[record.id]
                    continue
                daemon.records[record.id] = record
                assert record.sweep is not None
                made[record.sweep.index] = record
                daemon.touch(record)  # the queue looks at it (once the sweep is whole)
        finally:
            reserved.difference_update(record.id for record, _ in copies)
        if failed:
            raise ApiError(failed)

    async def _handed_over(self, batch: Batch, slices: list[Batch]) -> None:
        """A slice of saves made (`batch`, the store's open batch): its trip asked for, written
        while the next slice is made; at most two slices wait for the writer, so that a trip is
        a slice or two, never a whole sweep another user's save would wait behind."""
        store = self.daemon.store
        self.daemon.start_soon(store.written, batch)
        slices.append(batch)
        if len(slices) > 2:
            await store.written(slices.pop(0))
        await anyio.lowlevel.checkpoint()

    def _copy(
        self, first: RunRecord, template: dict[str, Any], index: int, values: dict[str, str], command: list[str]
    ) -> RunRecord:
        """Member `index` of the first's sweep, as a copy of the first's record (see `_copies`):
        `template`, its record as a dict, validated again with what differs (a validation makes
        every list and model of its own, at a tenth of a deep copy's cost)."""
        run_id = self._new_run_id()
        data = {
            **template,
            "id": run_id,
            "name": f"{template['sweep']['name']}-{index}",
            "command": command,
            "created": first.created + index * 1e-5,
            "sweep": {**template["sweep"], "index": index, "values": values},
        }
        if first.remote_dir.endswith(f"/{first.id}"):
            data["remote_dir"] = first.remote_dir[: -len(first.id)] + run_id
        if first.trackers is not None and first.trackers.root == first.id:
            data["trackers"] = {**template["trackers"], "root": run_id}
        return RunRecord.model_validate(data)

    def _new_run_id(self) -> str:
        """A run id as the launcher makes them, taken by no run and no start under way (its random
        part drawn SLICE at a time: a getrandom call each is a syscall each, slow on a loaded box)."""
        daemon = self.daemon
        while True:
            if not self._random:
                self._random = list(pysecrets.token_bytes(3 * SLICE))
            part = bytes(self._random[:3]).hex()
            del self._random[:3]
            run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + part
            if run_id not in daemon.records and run_id not in daemon.launcher._admitting:
                return run_id

    async def _undo(self, made: list[RunRecord], exc: BaseException) -> None:
        """A sweep that could not be made whole: the members made are cancelled before any starts."""
        why = str(exc) or type(exc).__name__
        for record in made:
            async with self.daemon.editing(record):
                if record.in_queue:
                    record.transition(
                        RunState.cancelled,
                        f"cancelled while queued: its sweep could not be made whole ({why}), so none of it runs",
                    )

    def named(self, ref: str, peer: Peer) -> Sweep | None:
        """The sweep `ref` names for this caller: its id, else (when `ref` names no run of theirs)
        the name of their newest sweep of that name. None: it names a run, or nothing."""
        daemon = self.daemon
        if ref in daemon.records:
            return None  # a run's id (a sweep's is `sweep-...`): asked once per member of a sweep's cancel
        runs = [r for r in daemon.records.values() if r.sweep is not None and r.sweep.id == ref]
        if not runs:
            try:
                daemon.find(ref, peer)
                return None
            except ApiError as exc:
                if exc.kind != "not_found":
                    return None
            mine = [r for r in daemon.visible(peer) if r.sweep is not None and r.sweep.name == ref]
            if not mine:
                return None
            newest = mine[-1].sweep
            assert newest is not None
            runs = [r for r in daemon.records.values() if r.sweep is not None and r.sweep.id == newest.id]
        if not peer.is_root and any(r.owner_uid != peer.uid for r in runs):
            raise ApiError(f"sweep {ref} is not yours: only its owner and root may use it", "denied")
        tag = runs[0].sweep
        assert tag is not None
        return Sweep(tag.id, tag.name, tag.size, runs)

    def find(self, ref: str, peer: Peer) -> Sweep:
        """`named`, or an error that says there is no such sweep."""
        sweep = self.named(ref, peer)
        if sweep is None:
            raise ApiError(f"no sweep {ref!r}: give a sweep's id or name (`obd train sweep` printed it)", "not_found")
        return sweep

    # --- reading -------------------------------------------------------------------------

    async def view(self, sweep: Sweep) -> dict[str, Any]:
        """The sweep as its table shows it: each member's newest run (state, progress, message) with
        its values and the lowest loss logged over all its runs."""
        rows = []
        counts: dict[str, int] = {}
        for index, runs in sweep.members():
            newest = latest_attempt(self.daemon, runs[-1])
            best_loss, best_step = None, None
            for record in runs:
                best = await self._best_of(record)
                if best.loss is not None and (best_loss is None or best.loss < best_loss):
                    best_loss, best_step = best.loss, best.step
            counts[newest.state.value] = counts.get(newest.state.value, 0) + 1
            rows.append(
                {
                    **newest.summary(),
                    "index": index,
                    "values": tag_values(newest),
                    "command": newest.command,
                    "best_loss": best_loss,
                    "best_step": best_step,
                    "runs": [r.id for r in runs],
                }
            )
        grid: dict[str, list[str]] = {}
        for row in rows:
            for key, value in row["values"].items():
                if value not in grid.setdefault(key, []):
                    grid[key].append(value)
        first = sweep.runs[0].sweep
        return {
            "sweep": sweep.id,
            "name": sweep.name,
            "size": sweep.size,
            "template": first.template if first is not None else [],
            "grid": grid,
            "counts": counts,
            "members": rows,
        }

    async def _best_of(self, record: RunRecord) -> _Best:
        """The lowest loss in a run's metrics.jsonl, read on from where the last look stopped (where
        it is: the copy obd brought home from a pod, else its target); unknown while unreadable."""
        best = self._best.setdefault(record.id, _Best())
        if not record.remote_dir or never_ran(record):
            return best  # no job wrote there: no look (1,000 queued members, 1,000 reads on the loop)
        home = self.daemon.store.run_dir(record.id) / "retrieved" / rundir.METRICS
        local = record.state.final and home.is_file()
        path = rundir.RunPaths(record.remote_dir).metrics
        try:
            for _ in range(METRICS_CHUNKS):
                if local:
                    data = rundir.read_regular(str(home), METRICS_CHUNK, best.offset) or b""
                else:
                    executor = self.daemon.targets.executor(record)
                    with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                        data = await executor.read_from(path, best.offset, METRICS_CHUNK)
                end = data.rfind(b"\n")
                if end < 0:
                    break
                best.loss, best.step = fold_best(data[:end], (best.loss, best.step))
                best.offset += end + 1
                if len(data) < METRICS_CHUNK:
                    break
        except (ApiError, ExecutorError, TimeoutError, OSError) as exc:
            log.info("sweep_metrics_unreadable", run_id=record.id, error=str(exc))
        return best

    # --- acting on every member ----------------------------------------------------------------

    def _newest(self, sweep: Sweep) -> list[RunRecord]:
        return [latest_attempt(self.daemon, runs[-1]) for _, runs in sweep.members()]

    async def stop(self, sweep: Sweep, stop_one: RunOp) -> dict[str, Any]:
        """`obd train stop SWEEP`: a snapshot of every member that runs (as `obd train stop` asks
        it); every member still queued is taken out of the queue (`resume SWEEP` starts it again),
        and a retry still to come is not made, so nothing of the sweep starts after the stop."""
        acted = Acted(sweep)
        newest = self._newest(sweep)
        # Out of the queue first: a member stopping frees its GPUs, which a queued one would take.
        for record in newest:
            if record.state.final and self.daemon.recovery.attempt_to_come(record):
                await self.daemon.recovery.end_chain(record, "its sweep was stopped")
                acted.notes.append(f"{record.id}: its retry will not be made")

        def take_out(record: RunRecord) -> None:
            record.stop.cancel_by = "user"
            record.transition(RunState.cancelled, STOPPED_QUEUED)

        acted.runs += await self.out_of_queue(sweep, [r for r in newest if r.in_queue], take_out)
        for record in newest:
            if record.state.final:
                continue
            try:
                acted.runs.append(await stop_one(record.id))
            except ApiError as exc:
                acted.notes.append(f"{record.id}: {exc}")
        return acted.answer()

    async def cancel(self, sweep: Sweep, cancel_one: RunOp) -> dict[str, Any]:
        """`obd train cancel SWEEP`: every member cancelled as `obd train cancel` does it (a queued
        one leaves the queue, a running one is ended, a retry still to come is not made)."""
        acted = Acted(sweep)
        newest = self._newest(sweep)
        queued = [r for r in newest if r.in_queue]
        rest = [r for r in newest if not r.in_queue]
        rest = [r for r in rest if not r.state.final or self.daemon.recovery.attempt_to_come(r)]
        # The queued first: a member cancelled frees its GPUs, which a queued one would take.
        # Together, as `obd train cancel` changes each (one save of all, the handler's way for
        # those whose record an edit holds now).
        acted.runs += await self.out_of_queue(sweep, queued, cancel_queued)
        left = [r for r in queued if not r.state.final]
        acted.take(await each(left + rest, cancel_one))
        return acted.answer()

    async def out_of_queue(
        self, sweep: Sweep, records: list[RunRecord], change: Callable[[RunRecord], None]
    ) -> list[dict[str, Any]]:
        """Take queued members out of the queue together, as one edit: each locked and changed by
        `change` (to a final state), no turn of the event loop between a member's look and its
        change, their bytes taken into one batch of the store's bulk lane, saved by one trip
        (others' saves go by the express lane meanwhile), then told to the daemon's watchers and
        parts; each loop a share of the event loop at a time (`Share`: others answered meanwhile,
        a member launched meanwhile is not taken); their records, as `public()`. A member whose
        lock is held (an edit of it under way: its start) or that left the queue meanwhile is left
        as it is, for the caller's one-by-one way. Shielded: a client that hangs up never leaves
        members changed in memory and not saved."""
        daemon = self.daemon
        taken: list[RunRecord] = []
        with anyio.CancelScope(shield=True):
            locks: list[anyio.Lock] = []
            batches: list[Batch] = []
            try:
                share = Share()
                for record in records:
                    await share.turn()
                    lock = daemon.lock(record.id)
                    if lock.locked() or not record.in_queue:
                        continue
                    lock.acquire_nowait()  # no await between the look and the change
                    locks.append(lock)
                    change(record)
                    taken.append(record)
                for record in taken:
                    batch = daemon.store.save_later(record)
                    if not batches or batches[-1] is not batch:  # a trip took the last meanwhile
                        batches.append(batch)
                    await share.turn()
                for batch in batches:
                    await daemon.store.written(batch)
                failed = {rid for batch in batches for rid in batch.failed}
                for record in taken:
                    if record.id in failed:  # a full disk: kept in memory, saved again later
                        daemon.save_quietly(record)
            finally:
                for lock in locks:
                    lock.release()
            answer = []
            share = Share()
            for record in taken:
                await share.turn()
                daemon.touch(record)
                daemon.final_event(record.id).set()
                answer.append(record.public())
        if taken:
            log.info(
                "sweep_members_ended_while_queued",
                sweep=sweep.id,
                runs=len(taken),
                state=taken[0].state.value,
                message=taken[0].message,
            )
        return answer

    async def resume(
        self,
        sweep: Sweep,
        req: ResumeRequest,
        resume_one: RunOp,
        start: Callable[[StartRequest, SweepTag], Awaitable[dict[str, Any]]],
    ) -> dict[str, Any]:
        """`obd train resume SWEEP`: every stopped member resumed from its snapshot (as `obd train
        resume` does it, taking its place in the sweep), and every member a sweep's stop took out
        of the queue before it started, started again from the beginning."""
        acted = Acted(sweep)
        for record in self._newest(sweep):
            assert record.sweep is not None
            if record.state == RunState.stopped:
                try:
                    acted.runs.append(await resume_one(record.id))
                except ApiError as exc:
                    acted.notes.append(f"{record.id}: {exc}")
            elif record.state == RunState.cancelled and record.message == STOPPED_QUEUED:
                acted.runs.append(await start(self.again(record, req), record.sweep))
        if not acted.runs:
            raise ApiError(
                f"no run of sweep {sweep.id} is stopped, nor was taken out of the queue by `obd train stop "
                f"{sweep.id}`: there is nothing to resume (`obd train status {sweep.id}` shows its runs)",
                "state",
            )
        return acted.answer()

    def again(self, member: RunRecord, req: ResumeRequest) -> StartRequest:
        """The start of a member again from the beginning, like it (command, target, name, GPUs,
        directory, retries), with the environment, `--env` values and secrets of whoever resumes; on
        the resume's `--target` and `--gpus` when given (as its resumed members)."""
        target = req.target or member.target
        here = self.daemon.targets.get(target).shares_filesystem(member)
        same = target == member.target
        return StartRequest(
            op="start",
            command=member.command,
            target=target,
            name=member.name,
            cwd=None if here else member.cwd,
            client_cwd=member.cwd,
            env=req.env or {},
            secrets=req.secrets,
            environ=req.environ,
            env_clear=req.env_clear,
            umask=req.umask,
            gpus=req.gpus if req.gpus is not None else gpus_text(member.gpus_wanted) if same else None,
            priority=member.priority,
            retry=req.retry if req.retry is not None else member.retries,
            profile=member.profile,
            snapshot_on_sigterm=member.snapshot_on_sigterm,
            preemptible=member.preemption.preemptible,
        )


def cancel_queued(record: RunRecord) -> None:
    """A queued member's cancel, as `obd train cancel` makes it (daemon/service/handlers.py)."""
    cancel_asked(record, "cancel requested by the user")
    record.transition(RunState.cancelled, CANCELLED_QUEUED)


def never_ran(record: RunRecord) -> bool:
    """Whether no job of the run ever ran (queued, or ended without running): it has no metrics."""
    if record.in_queue:
        return True
    return record.state.final and not any(entry.state == RunState.running for entry in record.history)


def tag_values(record: RunRecord) -> dict[str, str]:
    return dict(record.sweep.values) if record.sweep is not None else {}
