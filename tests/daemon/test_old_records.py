"""Records written by main a91c419 (the release before the run state machine) load unchanged.

The fixtures in records_a91c419/ were written by that release's own RunStore
(tests/daemon/make_old_records.py says how): one record a kind of run, every feature field
set. They must load with every field's value kept, save again to the same meaning, and go on
through the state machine as a run in that state would.
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
        new = records[path.stem].model_dump(mode="json")
        assert kept(old, new) == [], path.name


def test_an_old_record_saved_again_reads_back_the_same(store: RunStore) -> None:
    records, _ = store.load_all(started=0.0)
    for record in records.values():
        store.save(record)
        assert store.load(record.id) == record
        again = json.loads(store.record_path(record.id).read_text())
        assert kept(json.loads((OLD / f"{record.id}.json").read_text()), again) == []


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
