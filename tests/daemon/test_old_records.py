"""Records written by main a91c419 (the release before the run state machine) load unchanged.

The fixtures in records_a91c419/ were written by that release's own RunStore
(tests/daemon/make_old_records.py says how): one record a kind of run, every feature field
set. They must load with every field's value kept, save again to the same meaning, and go on
through the state machine as a run in that state would.

Since then the feature fields those records keep flat moved into the record's typed parts
(`preemption`, `dependencies`, `retention`: daemon/service/models.py), each under its own name:
MOVED below says where, written out here rather than read from the model, so the model's fold of
the old keys is checked against it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from daemon.service.models import RunRecord, RunState
from daemon.service.store import RunStore

OLD = Path(__file__).parent / "records_a91c419"
FILES = sorted(OLD.glob("*.json"))


# The flat keys of a91c419's records, and the part each is in now (under the same name).
MOVED = {
    **dict.fromkeys(
        ("preemptible", "preempt", "paused", "preemptions", "paused_seconds", "lost_steps", "queue_since"),
        "preemption",
    ),
    **dict.fromkeys(("after", "after_any"), "dependencies"),
    **dict.fromkeys(("keep_checkpoints", "pruned", "pruned_bytes"), "retention"),
}


def now_shape(old: dict[str, Any]) -> dict[str, Any]:
    """An old record as the record keeps it now: its flat keys in their parts."""
    new = {k: v for k, v in old.items() if k not in MOVED}
    for key, part in MOVED.items():
        if key in old:
            new.setdefault(part, {})[key] = old[key]
    return new


def kept(old: Any, new: Any, where: str = "") -> list[str]:
    """Where `new` lost or changed a value of `old` (every key of old, recursively)."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{where}: {new!r} is not a mapping"]
        return [miss for key, value in old.items() for miss in kept(value, new.get(key, KeyError), f"{where}.{key}")]
    return [] if old == new else [f"{where}: {old!r} became {new!r}"]


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    s = RunStore(tmp_path / "state")
    s.ensure()
    for path in FILES:
        (s.runs_dir / path.stem).mkdir()
        shutil.copy(path, s.runs_dir / path.stem / "run.json")
    return s


def test_there_is_an_old_record_of_each_kind_of_run() -> None:
    states = {json.loads(p.read_text())["state"] for p in FILES}
    assert states == {"succeeded", "stopped", "failed", "queued", "cancelled", "preparing"}


def test_every_old_record_loads_with_every_field_kept(store: RunStore) -> None:
    records, bad = store.load_all(started=0.0)
    assert bad == [] and sorted(records) == [p.stem for p in FILES]
    for path in FILES:
        old = json.loads(path.read_text())
        assert set(MOVED) <= set(old), f"{path.name} is not a record of the flat shape"
        new = records[path.stem].model_dump(mode="json")
        assert kept(now_shape(old), new) == [], path.name


def test_an_old_record_saved_again_reads_back_the_same(store: RunStore) -> None:
    records, _ = store.load_all(started=0.0)
    for record in records.values():
        store.save(record)
        assert store.load(record.id) == record
        again = json.loads(store.record_path(record.id).read_text())
        assert kept(now_shape(json.loads((OLD / f"{record.id}.json").read_text())), again) == []
        assert not set(MOVED) & set(again), "saved again in the new shape: no flat key left"


def test_old_records_go_on_through_the_state_machine_as_their_state_allows(store: RunStore) -> None:
    records, _ = store.load_all(started=0.0)
    queued = records["20251201-000000-aaaaa6"]
    queued.transition(RunState.preparing, "its dependency ended")
    assert queued.state == RunState.preparing and queued.history[-1].reason == "its dependency ended"
    preparing = records["20251201-000000-aaaaa8"]
    preparing.transition(RunState.running, "started (pid 1)")
    for final in ("20251201-000000-aaaaa1", "20251201-000000-aaaaa2", "20251201-000000-aaaaa4"):
        record: RunRecord = records[final]
        with pytest.raises(ValueError):
            record.transition(RunState.running, "a final state is never left")
        assert record.state.final


def test_a_record_with_the_last_release_s_flat_feature_fields_loads_them_into_its_parts(store: RunStore) -> None:
    old = json.loads((OLD / "20251201-000000-aaaaa6.json").read_text())  # a91c419's shape, as its store wrote it
    old.update(
        id="20251201-000000-aaaaa9",
        preemptible=False,
        preempt={"for_run": "r-urgent", "for_priority": 3, "needed": 2, "asked_at": 1764547300.0, "why": "preempted"},
        paused={"by": None, "since": 1764547250.0, "why": "target local drained"},
        preemptions=2,
        paused_seconds=40.5,
        lost_steps=7,
        queue_since=1764547100.0,
        after=[{"run": "r-prep", "given": "prep", "name": "prep", "states": ["succeeded"]}],
        after_any=True,
        keep_checkpoints=3,
        pruned=["checkpoint-10", "checkpoint-20"],
        pruned_bytes=4096,
    )
    (store.runs_dir / old["id"]).mkdir()
    store.record_path(old["id"]).write_text(json.dumps(old))

    record = store.load(old["id"])
    p, d, r = record.preemption, record.dependencies, record.retention
    assert (p.preemptible, p.preemptions, p.paused_seconds, p.lost_steps, p.queue_since) == (
        False,
        2,
        40.5,
        7,
        1764547100.0,
    )
    assert p.preempt is not None and (p.preempt.for_run, p.preempt.needed) == ("r-urgent", 2)
    assert p.paused is not None and (p.paused.by, p.paused.why) == (None, "target local drained")
    assert [(dep.run, dep.given, dep.states) for dep in d.after] == [("r-prep", "prep", ["succeeded"])] and d.after_any
    assert (r.keep_checkpoints, r.pruned, r.pruned_bytes) == (3, ["checkpoint-10", "checkpoint-20"], 4096)
    summary = record.summary()  # what `obd train list --json` prints keeps its keys
    assert summary["preemptions"] == 2 and summary["attempts"] == record.retries + 1 + 2
    assert summary["paused"] == {"by": None, "since": 1764547250.0, "why": "target local drained"}  # queued

    store.save(record)
    saved = json.loads(store.record_path(record.id).read_text())
    assert not set(MOVED) & set(saved)  # the new shape: each value in its part, none left flat
    assert saved["preemption"] == {key: old[key] for key in MOVED if MOVED[key] == "preemption"}
    assert saved["dependencies"] == {"after": old["after"], "after_any": True}
    assert saved["retention"] == {
        "keep_checkpoints": 3,
        "pruned": ["checkpoint-10", "checkpoint-20"],
        "pruned_bytes": 4096,
    }
    assert store.load(record.id) == record
