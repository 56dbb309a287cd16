"""The run store: atomic saves, clear errors for broken records, a full disk that loses nothing."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anyio
import pytest

from daemon.service import store as store_module
from daemon.service.models import RunRecord, RunState
from daemon.service.store import BULK_NICE, FSYNCERS, WRITERS, RunStore, StoreError, _Threads
from tests.conftest import FAST_CONFIG


def _record(rid: str = "20260101-000000-aaaaaa") -> RunRecord:
    r = RunRecord(id=rid, command=["true"])
    r.transition(RunState.preparing, "created")
    return r


def test_a_saved_record_reads_back_the_same(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    r = _record()
    r.transition(RunState.running, "started")
    store.save(r)
    assert store.load(r.id) == r
    assert oct(store.record_path(r.id).stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize(
    "content, where",
    [
        ('{"id": "x",\n  "state": ', "line 2"),
        ("", "line 1 column 1"),
        ('{"id": "20260101-000000-aaaaaa", "state": "exploded"}', "state"),
        ("[1, 2]", "(top level)"),
        (b"\xff\xfe{}", "byte 0"),
    ],
)
def test_a_malformed_record_is_reported_by_position(tmp_path: Path, content: str | bytes, where: str) -> None:
    store = RunStore(tmp_path)
    good = _record("20260101-000000-good00")
    store.save(good)
    bad_dir = store.runs_dir / "20260101-000000-aaaaaa"
    bad_dir.mkdir()
    (bad_dir / "run.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    records, bad = store.load_all()
    assert list(records) == [good.id]
    assert len(bad) == 1 and where in bad[0].error


def test_a_directory_with_a_hostile_name_is_not_loaded_as_a_run(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.ensure()
    (store.runs_dir / "weird name;rm").mkdir()
    records, bad = store.load_all()
    assert records == {} and len(bad) == 1 and "invalid run id" in bad[0].error


@pytest.fixture
def tiny_disk(tmp_path: Path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("needs root to mount a tiny tmpfs (CI runs as root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)])


def test_a_full_disk_during_a_save_raises_and_leaves_the_old_record_intact(tiny_disk: Path) -> None:
    store = RunStore(tiny_disk)
    r = _record()
    store.save(r)
    before = store.record_path(r.id).read_bytes()
    with open(tiny_disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * (1 << 20))
    r.command = ["x" * 200_000]  # bigger than what is left
    with pytest.raises(StoreError, match=r"previous record .* is intact"):
        store.save(r)
    assert store.record_path(r.id).read_bytes() == before
    assert json.loads(before)["command"] == ["true"]
    assert not [p for p in store.run_dir(r.id).iterdir() if p.name.startswith(".run.json.tmp")]


def test_a_record_nested_too_deeply_is_reported_not_fatal(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    bad_dir = store.runs_dir / "20260101-000000-nested"
    bad_dir.mkdir(parents=True)
    (bad_dir / "run.json").write_text("[" * 100000)
    records, bad = store.load_all()
    assert records == {} and "nested too deeply" in bad[0].error


def test_an_atomic_write_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path) -> None:
    from trainer_plugin.tools.jobctl import atomic_write

    victim = tmp_path / "victim"
    victim.write_text("precious")
    link = tmp_path / "snapshot.request"
    link.symlink_to(victim)
    atomic_write(str(link), b"requested\n")
    assert victim.read_text() == "precious"
    assert not link.is_symlink() and link.read_text() == "requested\n"


def test_the_temporary_files_of_saves_cut_short_are_cleared_at_load(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.ensure()
    store.save(RunRecord(id="20260101-000000-aaaaaa"))
    directory = store.run_dir("20260101-000000-aaaaaa")
    leftovers = [directory / f".{name}.tmp.123.abcdef" for name in ("run.json", "launch.json", "notify.json")]
    for leftover in leftovers:
        leftover.write_text('{"half": ')
        os.utime(leftover, (time.time() - 60, time.time() - 60))
    under_way = directory / ".run.json.tmp.456.abcdef"  # a write of this process, after its start
    under_way.write_text('{"half": ')
    records, bad = store.load_all(started=time.time() - 30)
    assert list(records) == ["20260101-000000-aaaaaa"] and not bad
    assert not any(leftover.exists() for leftover in leftovers)
    assert under_way.exists()


def test_a_record_directory_holding_only_what_a_start_cut_short_left_is_removed_at_load(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    store.ensure()
    for name, files in (("20260101-000000-aaaaaa", ["launch.json"]), ("20260101-000000-bbbbbb", [])):
        (store.runs_dir / name).mkdir()
        for file in files:
            (store.runs_dir / name / file).write_text("{}")
    (store.runs_dir / "20260101-000000-cccccc").mkdir()
    (store.runs_dir / "20260101-000000-cccccc" / "retrieved").mkdir()  # more than a start leaves
    records, bad = store.load_all()
    assert records == {} and [b.run_id for b in bad] == ["20260101-000000-cccccc"]
    assert sorted(os.listdir(store.runs_dir)) == ["20260101-000000-cccccc"]


def test_a_record_larger_than_the_limit_is_reported_and_one_at_the_limit_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(tmp_path)
    small, padded = _record("20260101-000000-aaaaaa"), _record("20260101-000000-bbbbbb")
    store.save(small)
    store.save(padded)
    path = store.record_path(padded.id)
    text = path.read_text()
    limit = len(text) + 100
    monkeypatch.setattr("daemon.service.store.RECORD_LIMIT", limit)
    path.write_text(text + " " * 100)  # exactly at the limit: JSON allows the trailing spaces
    records, bad = store.load_all()
    assert set(records) == {small.id, padded.id} and bad == []
    path.write_text(text + " " * 101)
    records, bad = store.load_all()
    assert set(records) == {small.id}
    assert [b.run_id for b in bad] == [padded.id] and f"larger than {limit} bytes" in bad[0].error


# --- saves off the event loop (issue 33 item 1) -------------------------------------------------


def test_saves_made_together_are_all_on_disk_and_a_newer_save_is_never_overwritten_by_an_older(
    tmp_path: Path,
) -> None:
    store = RunStore(tmp_path)
    records = [_record(f"20260101-000000-{i:06x}") for i in range(300)]
    late = _record("20260101-000000-1a7e00")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for r in records:
                tg.start_soon(store.save_async, r)
        late.transition(RunState.running, "started")
        store.save_later(late)  # taken for the next trip: older bytes
        late.transition(RunState.cancelled, "cancelled")
        store.save(late)  # newer bytes, written now
        await store.flush()

    anyio.run(main)
    loaded, bad = RunStore(tmp_path).load_all()
    assert bad == [] and len(loaded) == 301
    assert all(loaded[r.id] == r for r in records)
    assert loaded[late.id].state == RunState.cancelled


def test_a_trips_parallel_steps_give_every_items_result_in_order_and_raise_only_once_all_threads_stopped() -> None:
    seen: list[int] = []

    def square(n: int) -> int:
        seen.append(n)
        return n * n

    with ThreadPoolExecutor(max_workers=4) as pool:
        threads = _Threads(pool, 4)
        assert threads.each(square, list(range(1000))) == [n * n for n in range(1000)]
        assert sorted(seen) == list(range(1000))  # each item taken once
        assert threads.each(square, []) == []

        def fails_on_7(n: int) -> int:
            if n == 7:
                raise OSError("disk gone")
            return n

        done: list[int] = []

        def slow_others(n: int) -> int:
            done.append(fails_on_7(n))
            return n

        with pytest.raises(OSError, match="disk gone"):
            threads.each(slow_others, list(range(50)))
        assert len(done) == 49  # the other threads went on to the end before the error was raised


def test_trips_of_many_saves_reuse_their_lanes_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = RunStore(tmp_path)
    started: list[str] = []
    start = threading.Thread.start

    def counted(thread: threading.Thread) -> None:
        started.append(thread.name)
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted)

    async def trip(first: int) -> None:
        for i in range(first, first + 40):
            store.save_later(_record(f"20260101-000000-{i:06x}"))
        await store.flush()

    for first in (0, 40, 80):
        anyio.run(trip, first)
    ours = [name for name in started if name.startswith(("obd-store", "obd-fsync"))]
    assert 0 < len(ours) <= WRITERS + FSYNCERS  # one lane's threads, made once (each trip made them all again)
    loaded, bad = RunStore(tmp_path).load_all()
    assert bad == [] and len(loaded) == 120


def test_a_bulk_trips_threads_yield_the_cpu_and_a_single_saves_do_not(tmp_path: Path) -> None:
    store = RunStore(tmp_path)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def main() -> None:
        for i in range(40):  # a sweep's members: the bulk lane
            store.save_later(_record(f"20260101-000000-{i:06x}"))
        await store.flush()
        async with anyio.create_task_group() as tg:  # starts at the same moment: the express lane
            for i in range(40, 60):
                tg.start_soon(store.save_async, _record(f"20260101-000000-{i:06x}"))

    anyio.run(main)
    nice: dict[str, set[int]] = {"bulk": set(), "express": set()}
    for thread in threading.enumerate():
        lane = thread.name.removeprefix("obd-store-").removeprefix("obd-fsync-").split("_")[0]
        if thread.name.startswith(("obd-store-", "obd-fsync-")) and thread.native_id is not None:
            nice[lane].add(os.getpriority(os.PRIO_PROCESS, thread.native_id))
    assert nice["bulk"] == {min(base + BULK_NICE, 19)}
    assert nice["express"] == {base}


def test_a_bulk_trips_threads_take_no_item_while_a_gate_is_closed_and_wait_at_most_the_yield(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Gate(threading.Event):
        """An Event that counts the threads waiting on it."""

        def __init__(self) -> None:
            super().__init__()
            self.arrived = threading.Semaphore(0)

        def wait(self, timeout: float | None = None) -> bool:
            self.arrived.release()
            return super().wait(timeout)

    done: list[int] = []
    gate = Gate()
    monkeypatch.setattr(store_module, "BULK_YIELD_SECONDS", 3600.0)  # only the gate's opening lets them on
    with ThreadPoolExecutor(max_workers=4) as pool, ThreadPoolExecutor(max_workers=1) as caller:
        answer = caller.submit(_Threads(pool, 4, gate).each, done.append, list(range(100)))
        for _ in range(4):
            assert gate.arrived.acquire(timeout=60), "a thread never reached the gate"
        assert done == []  # each of the 4 threads took its item and waits with it
        gate.set()
        assert len(answer.result(timeout=60)) == 100 and sorted(done) == list(range(100))
        # A gate that stays closed holds each item BULK_YIELD_SECONDS at most: the trip ends all the same.
        monkeypatch.setattr(store_module, "BULK_YIELD_SECONDS", 0.001)
        gate.clear()
        assert len(_Threads(pool, 4, gate).each(done.append, list(range(20)))) == 20


def test_the_bulk_lane_waits_while_an_express_trip_writes_and_goes_on_after_it_even_when_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(tmp_path)
    open_while_writing: list[bool] = []
    write = store._write

    def watched(run_id: str, seq: int, data: bytes, beside: dict[str, bytes]) -> None:
        open_while_writing.append(store.express.idle.is_set())
        if run_id.endswith("bad"):
            raise StoreError("disk full")
        write(run_id, seq, data, beside)

    monkeypatch.setattr(store, "_write", watched)
    assert store.bulk.threads().writers.gate is store.express.idle  # the bulk lane's threads wait on it
    assert store.express.threads().writers.gate is None

    async def main() -> None:
        await store.save_async(_record())
        with pytest.raises(StoreError):
            await store.save_async(_record("20260101-000000-000bad"))

    anyio.run(main)
    assert open_while_writing == [False, False]  # closed while each express trip wrote
    assert store.express.idle.is_set()  # and open again after each, the failed one too


def _held_writes(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> dict[str, threading.Event]:
    """Each express save of a record named in the answer waits in its worker thread until its
    event is set; every save is written as before."""
    holds: dict[str, threading.Event] = {}
    write = store._write

    def held(run_id: str, seq: int, data: bytes, beside: dict[str, bytes]) -> None:
        if run_id in holds:
            assert holds[run_id].wait(60), "the test never let this save on"
        write(run_id, seq, data, beside)

    monkeypatch.setattr(store, "_write", held)
    return holds


def test_a_start_s_save_is_written_while_another_run_s_save_is_still_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(tmp_path)
    slow, start = _record("20260101-000000-00000a"), _record("20260101-000000-00000b")
    holds = _held_writes(store, monkeypatch)
    holds[slow.id] = threading.Event()

    async def main() -> None:
        written = anyio.Event()

        async def save_start() -> None:
            await store.save_async(start)
            written.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(store.save_async, slow)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(save_start)
            with anyio.move_on_after(30):
                await written.wait()  # not behind the save still under way
            in_time, still_held = written.is_set(), not store.record_path(slow.id).exists()
            bulk_waits = not store.express.idle.is_set()  # the bulk lane waits for the one under way
            holds[slow.id].set()
        assert in_time and still_held and bulk_waits
        assert store.load(start.id) == start and store.load(slow.id) == slow and store.express.idle.is_set()

    anyio.run(main)


def test_two_saves_of_one_record_are_never_written_by_two_trips_at_once_and_the_newest_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(tmp_path)
    record = _record()
    holds = _held_writes(store, monkeypatch)
    holds[record.id] = threading.Event()
    newer = record.model_copy(deep=True)
    newer.transition(RunState.running, "started")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(store.save_async, record)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(store.save_async, newer)
            await anyio.wait_all_tasks_blocked()
            trips = len(store.express.running)  # the newer save waits for the trip holding its record
            holds[record.id].set()
        assert trips == 1
        assert store.load(record.id) == newer

    anyio.run(main)


def test_a_burst_of_saves_goes_in_a_few_trips_not_one_thread_a_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RunStore(tmp_path)
    holds = _held_writes(store, monkeypatch)
    records = [_record(f"20260101-000000-{i:06x}") for i in range(40)]
    first = [r.id for r in records[: store_module.EXPRESS_TRIPS]]
    for rid in first:
        holds[rid] = threading.Event()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            for record in records:
                tg.start_soon(store.save_async, record)
            await anyio.wait_all_tasks_blocked()
            under_way = sorted(rid for b in store.express.running for rid in b.items)
            for rid in first:
                holds[rid].set()
        assert under_way == sorted(first)

    anyio.run(main)
    assert store.express.trips == store_module.EXPRESS_TRIPS + 1  # the other 36 together
    assert all(store.load(r.id) == r for r in records)


ONE_GPU = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'


def test_a_sweep_made_and_cancelled_is_on_disk_the_moment_the_daemon_answers_even_under_sigkill(
    make_daemon,  # type: ignore[no-untyped-def]
) -> None:
    d = make_daemon(ONE_GPU)
    d.start()
    holder = d.call("start", command=["sleep", "600"], gpus="1")["id"]
    d.wait_state(holder, "running")
    grid = [{"name": "a", "values": [str(i) for i in range(300)]}]
    made = d.call("sweep", command=["sleep", "{a}"], gpus="1", grid=grid)
    d.kill()  # the moment it answered: every member it named must be on disk
    d.start()
    rows = d.call("list", sweep=made["sweep"])
    assert sorted(r["id"] for r in rows) == sorted(r["id"] for r in made["runs"])
    assert {r["state"] for r in rows} == {"queued"}  # whole: none cancelled as a sweep cut short

    cancelled = d.call("cancel", id=made["sweep"])
    d.kill()
    d.start()
    assert len(cancelled["runs"]) == 300
    rows = d.call("list", sweep=made["sweep"])
    assert len(rows) == 300 and {r["state"] for r in rows} == {"cancelled"}
    d.call("cancel", id=holder)


def test_a_full_disk_during_a_trip_of_many_saves_keeps_every_old_record_whole(tiny_disk: Path) -> None:
    store = RunStore(tiny_disk)
    records = [_record(f"20260101-000000-{i:06x}") for i in range(8)]
    for r in records:
        store.save(r)
    before = {r.id: store.record_path(r.id).read_bytes() for r in records}
    with open(tiny_disk / "filler", "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * (1 << 20))
    for r in records:
        r.command = ["x" * 20_000]  # none fits in what is left

    async def main() -> list[BaseException]:
        failed: list[BaseException] = []

        async def save(r: RunRecord) -> None:
            try:
                await store.save_async(r, beside={"launch.json": b"{}"})
            except StoreError as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:  # one trip of the writer: saves made together
            for r in records:
                tg.start_soon(save, r)
        return failed

    failed = anyio.run(main)
    assert len(failed) == len(records) and all("previous record" in str(e) and "intact" in str(e) for e in failed)
    for r in records:
        assert store.record_path(r.id).read_bytes() == before[r.id]
        assert sorted(p.name for p in store.run_dir(r.id).iterdir()) == ["run.json"]  # no temporary file left


def test_a_list_shows_each_run_as_last_saved_and_new_runs_in_their_place(make_daemon) -> None:  # type: ignore[no-untyped-def]
    d = make_daemon(ONE_GPU)
    d.start()
    holder = d.call("start", command=["sleep", "600"], gpus="1")["id"]
    d.wait_state(holder, "running")
    grid = [{"name": "a", "values": [str(i) for i in range(30)]}]
    made = [r["id"] for r in d.call("sweep", command=["sleep", "{a}"], gpus="1", grid=grid)["runs"]]
    assert [r["id"] for r in d.call("list")] == [holder, *made]
    assert [r["id"] for r in d.call("list")] == [holder, *made]  # asked again, nothing changed

    d.call("cancel", id=made[3])  # the answers kept are of before: each says the run as saved now
    assert {r["id"]: r["state"] for r in d.call("list", all=True)}[made[3]] == "cancelled"
    late = d.call("start", command=["sleep", "600"], gpus="1")["id"]
    rows = d.call("list")
    assert [r["id"] for r in rows] == [holder, *made, late]
    assert {r["id"]: r["state"] for r in rows}[made[3]] == "cancelled"
    d.call("cancel", id=holder)


def test_a_flush_is_not_held_up_by_other_callers_saves_one_after_another(tmp_path: Path) -> None:
    """A flush waits for the saves taken before it only: a sweep being made (which flushes its
    members) ends while other users start runs one after another, each save the express lane's."""
    store = RunStore(tmp_path)
    store.ensure()
    ids = iter(range(1, 10**6))
    longest = 300  # starts at most: the stream ends, so a flush it held up ends too (and the test fails)

    def record() -> RunRecord:
        return RunRecord(id=f"20261207-000000-{next(ids):06d}", state=RunState.queued, command=["true"])

    async def main() -> tuple[int, list[str]]:
        members = [record() for _ in range(50)]
        flushed = anyio.Event()
        starts = 0

        async def starting() -> None:  # as other users' starts: each waits for its save, then the next
            nonlocal starts
            while not flushed.is_set() and starts < longest:
                await store.save_async(record(), beside={"launch.json": b"{}\n"})
                starts += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(starting)
            await anyio.sleep(0)
            for member in members:
                store.save_later(member)
            await store.flush()
            at_flush = starts  # a flush held up by the stream returns only once it ran dry
            flushed.set()
        return at_flush, [m.id for m in members]

    at_flush, made = anyio.run(main)
    assert all(store.record_path(run_id).is_file() for run_id in made)
    assert at_flush < longest
