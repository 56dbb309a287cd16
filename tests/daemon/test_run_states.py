"""The run state machine (daemon/service/run_states.py): every allowed edge is taken, every other one refused, and a
final state is never left (issue 35, item 3)."""

from __future__ import annotations

import itertools

import pytest

from daemon.common import wire
from daemon.service.models import RunRecord, RunState
from daemon.service.run_states import EDGES, IllegalTransition

PAIRS = list(itertools.product(wire.STATES, repeat=2))


def record_in(state: str) -> RunRecord:
    record = RunRecord(id="r1")
    record.state = RunState(state)  # set directly: the walk starts anywhere
    return record


def test_the_table_names_every_state_and_only_states() -> None:
    assert set(EDGES) == set(wire.STATES)
    assert all(set(nexts) <= set(wire.STATES) for nexts in EDGES.values())
    assert all(why for nexts in EDGES.values() for why in nexts.values())  # each edge says why it exists


@pytest.mark.parametrize(("current", "new"), [p for p in PAIRS if p[1] in EDGES[p[0]]])
def test_an_allowed_edge_changes_the_state_and_is_in_the_history(current: str, new: str) -> None:
    record = record_in(current)
    record.transition(RunState(new), "because")
    assert record.state.value == new and record.message == "because"
    assert record.history[-1].state == RunState(new)


@pytest.mark.parametrize(("current", "new"), [p for p in PAIRS if p[1] not in EDGES[p[0]]])
def test_a_forbidden_edge_is_refused_and_the_record_is_unchanged(current: str, new: str) -> None:
    record = record_in(current)
    before = record.model_dump()
    with pytest.raises(IllegalTransition, match=f"cannot become {new}"):
        record.transition(RunState(new), "because")
    assert record.model_dump() == before


@pytest.mark.parametrize("final", sorted(wire.FINAL))
def test_a_final_state_is_never_left(final: str) -> None:
    assert EDGES[final] == {}
    record = record_in(final)
    for new in wire.STATES:
        with pytest.raises(IllegalTransition, match="a final state is kept"):
            record.transition(RunState(new), "again")
    assert record.state.value == final


def test_a_new_record_goes_from_preparing_to_the_queue_or_its_launch() -> None:
    for first in (RunState.queued, RunState.preparing):
        record = RunRecord(id="r2")
        record.transition(first, "created")
        assert record.state == first
