"""The arbiter's rule where ranks stop between two step ends (agreement.py), as a table over a store held in memory.

The whole protocol runs for real in test_stop_anywhere.py (two gloo ranks); here are its cases one by one.
"""

from __future__ import annotations

import threading

import pytest

from tests.conftest import wait_for
from trainer_plugin.plugin.agreement import RankAgreement


class MemoryStore:
    """The three calls of torch.distributed's Store the agreement makes."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)


def ranks(places: list[str]) -> tuple[RankAgreement, MemoryStore]:
    store = MemoryStore()
    zero = RankAgreement(store, 0, len(places), generation=0)
    for rank, place in enumerate(places):
        if place:
            store.set(f"obd-stop/0/at/{rank}", place)
    return zero, store


@pytest.mark.parametrize(
    ("places", "target", "stop"),
    [
        # every rank parked at the same micro-batch: stop there
        (["7:parked", "7:parked"], "7", "7"),
        # one rank ahead and parked: the other goes on to it
        (["9:parked", "7:parked"], "9", None),
        # a running rank's next point is where everyone meets (it may be in a collective that needs the others)
        (["7:parked", "7:run"], "8", None),
        # a rank whose thread has not seen the stop yet: nothing is decided
        (["7:parked", ""], None, None),
    ],
)
def test_the_target_is_the_furthest_point_any_rank_reaches_and_the_stop_needs_every_rank_parked_there(
    places: list[str], target: str | None, stop: str | None
) -> None:
    zero, store = ranks(places)
    given = zero.arbitrate()
    assert (store.values.get("obd-stop/0/target", b"").decode() or None) == target
    assert (store.values.get("obd-stop/0/stop", b"").decode() or None) == stop
    assert given == (stop is not None)


def test_a_parked_rank_behind_the_target_goes_on_and_one_at_the_verdict_stops() -> None:
    store = MemoryStore()
    one = RankAgreement(store, 1, 2, generation=0)
    store.set("obd-stop/0/target", "8")
    assert one.park(7) is False  # behind: it goes on to its next point
    answer: list[bool] = []
    waiting = threading.Thread(target=lambda: answer.append(one.park(8)))
    waiting.start()
    wait_for(lambda: store.values.get("obd-stop/0/at/1") == b"8:parked", 30, 0.01, "rank 1 parked")
    one.publish(3)  # its watch thread, with a stale position: a parked rank's place is not overwritten
    assert store.values["obd-stop/0/at/1"] == b"8:parked"
    store.set("obd-stop/0/stop", "8")
    waiting.join(timeout=30)
    assert answer == [True]
