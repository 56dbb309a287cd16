"""`obd train list`'s answer as the handlers make it (daemon/service/handlers.py), in this process:
root's default list (every active run and the latest ends) is found from the live runs without a
look at the whole history, and must be the very list a look at every run gives; the runs kept in
age order are put in place as runs are added, never sorted again."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import anyio

from daemon.service.api import ListRequest, ListRunsRequest, Peer
from daemon.service.config import Config
from daemon.service.daemon import Daemon
from daemon.service.handlers import Handlers
from daemon.service.models import FINAL_STATES, Paused, RunRecord, RunState, SweepTag
from daemon.service.run_list import index_ranges
from daemon.service.run_states import EDGES

STATES = [RunState.queued, RunState.preparing, RunState.running, *FINAL_STATES]
ROOT, BOB = Peer(uid=0, gid=0), Peer(uid=1002, gid=1002)


def daemon_with_runs(tmp_path: Path, count: int, seed: int) -> Daemon:
    daemon = Daemon(
        Config.model_validate({"daemon": {"state_dir": str(tmp_path / "state"), "socket": str(tmp_path / "s")}})
    )
    rng = random.Random(seed)
    for n in range(count):
        state = rng.choice(STATES)
        record = RunRecord(
            id=f"20260101-000000-{n:06x}",
            command=["true"],
            state=state,
            created=1000.0 + rng.random() * 100,  # added in no order of age
            owner_uid=rng.choice([0, 1001, 1002]),
            job={"pid": 1} if state == RunState.running else None,
        )
        if state in FINAL_STATES and rng.random() < 0.2:
            record.retried_by = "20260101-000000-ffffff"  # an earlier attempt of a chain: not listed
        daemon.records[record.id] = record
    return daemon


def listed(handlers: Handlers, peer: Peer, **request: object) -> list[str]:
    answer = anyio.run(handlers.list_runs, ListRunsRequest.model_validate({"op": "list", **request}), peer)
    return [entry["id"] for entry in json.loads(answer)]


def every_run_looked_at(daemon: Daemon, recent: int) -> list[str]:
    """Root's default list, by its definition: a look at every run."""
    runs = sorted((r for r in daemon.records.values() if r.retried_by is None), key=lambda r: (r.created, r.id))
    ended = [r for r in runs if r.state in FINAL_STATES]
    shown = {r.id for r in ended[len(ended) - recent :]} if recent else set()
    return [r.id for r in runs if r.state not in FINAL_STATES or r.id in shown]


def test_roots_default_list_is_every_active_run_and_the_latest_ends_as_a_look_at_every_run_finds(
    tmp_path: Path,
) -> None:
    for seed in range(5):
        daemon = daemon_with_runs(tmp_path / str(seed), 400, seed)
        handlers = Handlers(daemon)
        for recent in (0, 1, 10, 1000):
            assert listed(handlers, ROOT, recent=recent) == every_run_looked_at(daemon, recent), (seed, recent)
        running = next(r for r in daemon.records.values() if r.state == RunState.running and r.retried_by is None)
        running.transition(RunState.succeeded, "exited 0")  # ended in place, among the others by its age
        daemon.touch(running)
        assert listed(handlers, ROOT, recent=10) == every_run_looked_at(daemon, 10)


def test_runs_added_in_any_order_of_age_are_listed_oldest_first(tmp_path: Path) -> None:
    daemon = daemon_with_runs(tmp_path, 50, seed=7)
    handlers = Handlers(daemon)
    assert listed(handlers, ROOT, all=True) == [
        r.id for r in sorted(daemon.records.values(), key=lambda r: (r.created, r.id))
    ]
    rng = random.Random(8)
    for n in range(30):  # newer and older than those listed, a member's among them
        record = RunRecord(
            id=f"20260102-000000-{n:06x}",
            command=["true"],
            state=RunState.succeeded,
            created=rng.choice([900.0, 1050.0, 2000.0]) + n,
            owner_uid=rng.choice([0, 1002]),
        )
        daemon.records[record.id] = record
        by_age = sorted(daemon.records.values(), key=lambda r: (r.created, r.id))
        assert listed(handlers, ROOT, all=True) == [r.id for r in by_age]
        assert listed(handlers, BOB, all=True, states=["succeeded"]) == [
            r.id for r in by_age if r.state == RunState.succeeded
        ]  # a member sees every run with --all (others' entries without their messages)
    assert anyio.run(handlers.ping, ListRequest(op="ping"), BOB)["runs"] == sum(
        1 for r in daemon.records.values() if r.owner_uid == 1002
    )


def test_roots_default_list_follows_runs_leaving_and_rejoining_the_queue_and_ending(
    tmp_path: Path,
) -> None:
    """The default list is the queue's own order with the active runs and latest ends put in place:
    it stays the look at every run while runs start, go back to the queue and end, by every edge
    of the state machine, whether the records were told of the change or find it at the next look."""
    daemon = daemon_with_runs(tmp_path, 600, seed=11)
    handlers = Handlers(daemon)
    rng = random.Random(12)
    for n in range(300):
        record = rng.choice([r for r in daemon.records.values() if r.state not in FINAL_STATES])
        state = rng.choice(sorted(EDGES[record.state.value]))
        if state == "running":
            record.job = {"pid": 1}
        elif state == "preparing" or (state == "queued" and record.state == RunState.preparing):
            record.job = None  # a launch, or one cut short: waiting in obd's queue again
        record.transition(RunState(state), "changed")
        # Told, or found at the next look (another run's change is what the list is asked after).
        daemon.touch(record if rng.random() < 0.5 else rng.choice(list(daemon.records.values())))
        recent = rng.choice([0, 3, 20, 1000])
        assert listed(handlers, ROOT, recent=recent) == every_run_looked_at(daemon, recent), (n, state, recent)


def test_roots_list_keeps_its_queued_runs_entries_while_other_runs_come_and_go(tmp_path: Path) -> None:
    """Thousands of queued runs' entries are encoded once: a run that starts and ends elsewhere
    changes root's list (it is in it, in its place) but not them; a queued run's change does."""
    daemon = daemon_with_runs(tmp_path, 400, seed=5)
    handlers = Handlers(daemon)
    assert listed(handlers, ROOT) == every_run_looked_at(daemon, 10)
    piece = handlers.lists._queued
    queued = list(piece.runs)
    entries = [daemon.summary_json(r) for r in queued]
    assert len(queued) > 50
    middle = queued[len(queued) // 2]
    record = RunRecord(id="20260103-000000-000001", command=["true"], state=RunState.queued, created=middle.created)
    daemon.records[record.id] = record  # waits in the queue among the others, then starts and ends
    for state in (RunState.preparing, RunState.running, RunState.succeeded):
        record.job = {"pid": 1} if state == RunState.running else None
        record.transition(state, "changed")
        daemon.touch(record)
        assert listed(handlers, ROOT) == every_run_looked_at(daemon, 10), state
        assert piece.runs == queued and all(
            daemon.summary_json(r) is e for r, e in zip(queued, entries, strict=True)
        ), state
    middle.message = "waiting for 2 GPUs"
    daemon.touch(middle)
    answer = anyio.run(handlers.list_runs, ListRunsRequest(op="list"), ROOT)
    assert [e["message"] for e in json.loads(answer) if e["id"] == middle.id] == ["waiting for 2 GPUs"]
    assert daemon.summary_json(middle) is not entries[queued.index(middle)]


def in_sweeps(daemon: Daemon, seed: int) -> None:
    """Put most runs in one of three sweeps (one of them on two targets), some of the queued ones
    a retry, a resume or a paused run's next attempt: those are never folded."""
    rng = random.Random(seed)
    for n, record in enumerate(list(daemon.records.values())):
        if rng.random() < 0.8:
            name = rng.choice(["a", "b", "c"])
            record.sweep = SweepTag(id=f"sweep-{name}", name=name, index=n + 1, size=len(daemon.records))
            record.target = rng.choice(["local", "box"]) if name == "c" else "local"
        if record.state == RunState.queued and rng.random() < 0.15:
            change = rng.choice(["retry", "resume", "pause"])
            if change == "retry":
                record.attempt = 2
            elif change == "resume":
                record.resumed_from = "20251231-000000-000001"
            else:
                record.preemption.paused = Paused(by="20251231-000000-000002", why="made way")
        daemon.records[record.id] = record  # as made: a run is made in its sweep, not put in one later


def foldable(record: RunRecord) -> bool:
    return (
        record.sweep is not None
        and record.state == RunState.queued
        and record.job is None
        and record.attempt == 1
        and record.resumed_from is None
        and record.preemption.paused is None
    )


def folded_by_definition(daemon: Daemon, ids: list[str]) -> list[str]:
    """A list folded: each sweep's queued members that never ran, two or more on one target, as the
    sweep's id in the place of its oldest."""
    runs = [daemon.records[i] for i in ids]
    counts = Counter((r.sweep.id, r.target) for r in runs if foldable(r) and r.sweep is not None)
    shown, seen = [], set()
    for r in runs:
        key = (r.sweep.id, r.target) if r.sweep is not None else None
        if not foldable(r) or counts[key] < 2:
            shown.append(r.id)
        elif key not in seen:
            seen.add(key)
            shown.append(key[0])
    return shown


def test_a_folded_list_is_each_sweeps_queued_members_that_never_ran_as_one_entry_in_its_oldests_place(
    tmp_path: Path,
) -> None:
    """The table's list (`obd train list`, not --json) folds a sweep's queued members, as squeue
    folds a job array's pending tasks; whatever ran, paused, retried or was resumed stays a row of
    its own. It must be the unfolded list, folded, for root's default list and every filter,
    while runs start, end and go back to the queue."""
    daemon = daemon_with_runs(tmp_path, 600, seed=21)
    in_sweeps(daemon, seed=22)
    handlers = Handlers(daemon)
    rng = random.Random(23)
    for n in range(120):
        recent = rng.choice([0, 3, 1000])
        assert listed(handlers, ROOT, recent=recent, fold=True) == folded_by_definition(
            daemon, every_run_looked_at(daemon, recent)
        ), n
        for peer, request in ((ROOT, {"all": True}), (BOB, {}), (BOB, {"all": True}), (ROOT, {"states": ["queued"]})):
            assert listed(handlers, peer, fold=True, **request) == folded_by_definition(
                daemon, listed(handlers, peer, **request)
            ), (n, request)
        record = rng.choice([r for r in daemon.records.values() if r.state not in FINAL_STATES])
        if record.state == RunState.queued and record.sweep is not None and rng.random() < 0.2:
            record.target = "box" if record.target == "local" else "local"  # moved while it waits
            daemon.touch(record)
            continue
        state = rng.choice(sorted(EDGES[record.state.value]))
        record.job = {"pid": 1} if state == "running" else None if state in ("preparing", "queued") else record.job
        record.transition(RunState(state), "changed")
        # Told, or found at the next look (another run's change is what the list is asked after).
        daemon.touch(record if rng.random() < 0.5 else rng.choice(list(daemon.records.values())))


def test_a_folded_sweep_says_how_many_members_wait_which_and_why_to_whom_may_read_it(tmp_path: Path) -> None:
    daemon = daemon_with_runs(tmp_path, 0, seed=0)
    for n in range(1, 8):
        record = RunRecord(
            id=f"20260104-000000-{n:06x}",
            command=["true"],
            state=RunState.running if n == 4 else RunState.queued,
            job={"pid": 1} if n == 4 else None,
            created=2000.0 + n,
            owner_uid=1001,
            message="waiting for 1 GPU" if n != 4 else "",
            sweep=SweepTag(id="sweep-lr", name="lr", index=n, size=7),
        )
        daemon.records[record.id] = record
    handlers = Handlers(daemon)

    def entries(peer: Peer, **request: object) -> list[dict[str, object]]:
        answer = anyio.run(handlers.list_runs, ListRunsRequest.model_validate({"op": "list", **request}), peer)
        return json.loads(answer)

    folded, running = entries(ROOT, fold=True)
    assert running["id"] == "20260104-000000-000004"  # it ran: a row of its own, after the oldest member
    assert (folded["id"], folded["name"], folded["folded"], folded["indexes"]) == (
        "sweep-lr",
        "lr-[1-3,5-7]",
        6,
        "1-3,5-7",
    )
    assert (folded["state"], folded["owner"], folded["message"], folded["created"]) == (
        "queued",
        daemon.records["20260104-000000-000001"].owner,
        "waiting for 1 GPU",
        2001.0,
    )
    assert entries(BOB, all=True, fold=True)[0]["message"] == ""  # another member's: no message, as unfolded
    assert len(entries(ROOT)) == 7  # unfolded unless asked: what `--json` and the Python API read


def test_index_ranges_are_written_as_squeue_writes_a_job_arrays() -> None:
    assert index_ranges([3, 1, 2, 5, 7, 8]) == "1-3,5,7-8"
    assert index_ranges([9]) == "9"
    assert index_ranges([1, 3, 5, 7, 9, 10]) == "1,3,5,…,9-10"
