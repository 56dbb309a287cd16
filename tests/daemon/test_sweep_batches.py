"""A sweep's members taken out of the queue as one operation (issue 33, item 1): one edit, one trip
of the store's bulk lane, one pass of the queue; and the store's two lanes (another user's single
save never waits behind a bulk trip). Counted through test doubles, never timed."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from daemon.service import store as store_module
from daemon.service import turns
from daemon.service.models import RunRecord, RunState, SweepTag
from daemon.service.queue import Scheduler
from daemon.service.records import Records
from daemon.service.store import RunStore
from daemon.service.sweeps import CANCELLED_QUEUED, Sweep, Sweeps

MEMBERS = 1000


class Kicks:
    """The scheduler's wake-up event, counted: each set is one pass of the queue asked for."""

    def __init__(self) -> None:
        self.sets = 0

    def set(self) -> None:
        self.sets += 1


class Recovery:
    def attempt_to_come(self, record: RunRecord) -> bool:
        return False


class Host:
    """What `Sweeps` uses of the daemon, with the real store and the real scheduler's hold."""

    def __init__(self, state_dir: Path) -> None:
        self.store = RunStore(state_dir)
        self.store.ensure()
        self.records = Records()
        self.locks: dict[str, anyio.Lock] = {}
        self.finals: dict[str, anyio.Event] = {}
        self.scheduler = Scheduler(self)  # type: ignore[arg-type]
        self.kicks = Kicks()
        self.scheduler._kick = self.kicks  # type: ignore[assignment]
        self.recovery = Recovery()
        self.touched = 0
        self.tg: Any = None

    def start_soon(self, fn: Any, *args: Any) -> None:
        self.tg.start_soon(fn, *args)

    def lock(self, run_id: str) -> anyio.Lock:
        return self.locks.setdefault(run_id, anyio.Lock())

    def touch(self, record: RunRecord) -> None:
        self.touched += 1
        self.scheduler.on_change(record)  # the daemon's listener: a run that ended kicks the queue

    def final_event(self, run_id: str) -> anyio.Event:
        return self.finals.setdefault(run_id, anyio.Event())

    def save_quietly(self, record: RunRecord) -> None:
        self.store.save(record)


def _sweep(host: Host, size: int) -> Sweep:
    runs = []
    for index in range(1, size + 1):
        record = RunRecord(
            id=f"20260101-000000-{index:06x}",
            command=["sleep", "600", str(index)],
            state=RunState.queued,
            created=1000.0 + index * 1e-5,
            sweep=SweepTag(id="sweep-0000abcd", name="load", index=index, size=size, values={"a": str(index)}),
        )
        host.store.save(record)
        host.records[record.id] = record
        runs.append(record)
    return Sweep("sweep-0000abcd", "load", size, runs)


def test_a_cancel_of_a_sweep_of_1000_queued_members_is_one_edit_one_store_trip_and_one_queue_pass(
    tmp_path: Path,
) -> None:
    host = Host(tmp_path)
    sweep = _sweep(host, MEMBERS)
    one_by_one: list[str] = []

    async def cancel_one(run_id: str) -> dict[str, Any]:
        one_by_one.append(run_id)
        return {}

    async def main() -> dict[str, Any]:
        async with anyio.create_task_group() as host.tg:
            with host.scheduler.holding():  # as the handler holds it (daemon/service/handlers.py)
                return await Sweeps(host).cancel(sweep, cancel_one)  # type: ignore[arg-type]

    answer = anyio.run(main)
    assert len(answer["runs"]) == MEMBERS and not one_by_one and not answer["notes"]
    assert host.store.bulk.trips == 1  # every member's save in one trip (was one trip a slice of 100)
    assert host.store.express.trips == 0
    assert host.kicks.sets == 1  # one pass of the queue for the whole cancel
    assert host.touched == MEMBERS and all(e.is_set() for e in host.finals.values())
    assert not any(lock.locked() for lock in host.locks.values())
    for record in sweep.runs:  # each on disk as cancelled, whole
        saved = host.store.load(record.id)
        assert saved.state == RunState.cancelled and saved.message == CANCELLED_QUEUED


def test_a_single_save_goes_on_while_a_bulk_trip_is_under_way_and_a_record_is_written_by_one_trip_at_a_time(
    tmp_path: Path, monkeypatch: Any
) -> None:
    store = RunStore(tmp_path)
    store.ensure()
    bulk = [RunRecord(id=f"20260101-000000-{n:06x}", command=["true"]) for n in range(8)]
    other = RunRecord(id="20260101-000001-aaaaaa", command=["true"])
    held = threading.Event()  # the bulk trip waits on it, in its thread
    bulk_ids = {r.id for r in bulk}
    written: list[str] = []
    real_stage, real_write = RunStore._stage, RunStore._write

    def stage(self: RunStore, item: Any) -> Any:
        if item[0] in bulk_ids:
            assert held.wait(30)
        written.append(item[0])
        return real_stage(self, item)

    def write(self: RunStore, run_id: str, *args: Any) -> None:
        written.append(run_id)
        real_write(self, run_id, *args)

    monkeypatch.setattr(RunStore, "_stage", stage)
    monkeypatch.setattr(RunStore, "_write", write)
    monkeypatch.setattr(store_module, "WRITERS", 1)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            batch = None
            for record in bulk:
                batch = store.save_later(record)
            assert batch is not None
            tg.start_soon(store.written, batch)
            while store.bulk.writing is None:
                await anyio.lowlevel.checkpoint()
            # The bulk trip is under way, held in its thread until `held` is set.
            with anyio.fail_after(30):
                await store.save_async(other)  # not behind it
            assert store.load(other.id).id == other.id and not held.is_set()
            # A record the bulk trip holds: its express save waits for that trip, then is written.
            bulk[0].message = "newer"
            saving = anyio.Event()

            async def save_held() -> None:
                await store.save_async(bulk[0])
                saving.set()

            tg.start_soon(save_held)
            while store.express.writing is None:
                await anyio.lowlevel.checkpoint()
            await anyio.sleep(0.1)
            assert not saving.is_set()  # it cannot be: its trip waits for the held one
            held.set()
        assert store.load(bulk[0].id).message == "newer"

    anyio.run(main)
    assert written.index(other.id) < len(bulk)  # written while the bulk's records were held
    assert written.count(bulk[0].id) == 2 and written[-1] == bulk[0].id


def test_a_cancel_of_a_sweep_of_1000_lets_others_in_while_it_changes_its_members_and_still_saves_them_in_one_trip(
    tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setattr(turns, "SHARE", 0.0)  # a turn after every member
    host = Host(tmp_path)
    sweep = _sweep(host, MEMBERS)
    seen: set[int] = set()  # how many members another caller saw cancelled at each of its turns

    async def cancel_one(run_id: str) -> dict[str, Any]:
        raise AssertionError(f"{run_id} was left to the one-by-one way")

    async def main() -> dict[str, Any]:
        async with anyio.create_task_group() as host.tg:

            async def others() -> None:
                while len(seen) < 2 or max(seen) < MEMBERS:  # until every member is seen cancelled
                    seen.add(sum(r.state == RunState.cancelled for r in sweep.runs))
                    await anyio.lowlevel.checkpoint()

            host.tg.start_soon(others)
            with host.scheduler.holding():
                answer = await Sweeps(host).cancel(sweep, cancel_one)  # type: ignore[arg-type]
            return answer

    answer = anyio.run(main)
    assert len([n for n in seen if 0 < n < MEMBERS]) > MEMBERS // 2  # let in between members, not once at the end
    assert len(answer["runs"]) == MEMBERS and host.store.bulk.trips == 1 and host.kicks.sets == 1
    assert all(host.store.load(r.id).state == RunState.cancelled for r in sweep.runs)
