"""The daemon's runs by id, with those not yet ended kept apart.

A record is never removed, so a box's history only grows; the queue, the GPUs' holders and
preemption look at the runs many times a second, and need only those that can still hold a GPU or
wait for one. A final state is never left (daemon/service/run_states.py), so a run found ended
leaves the live ones for good: a look at them costs what the live runs cost, not the history
(20,000 ended runs made each queue pass look at all 20,000, 46 ms of the event loop).
"""

from __future__ import annotations

from daemon.service.models import FINAL_STATES, RunRecord


class Records(dict[str, RunRecord]):
    """Every run the daemon knows, by id (a dict), and `live()`: those not found ended yet.
    `ended_since(n)`: the runs found ended, in the order they were found, from the n-th on, for a
    part that must look once at each run that ended (the GPUs a run's process may still hold)."""

    def __init__(self, records: dict[str, RunRecord] | None = None) -> None:
        super().__init__()
        self._live: dict[str, RunRecord] = {}
        self._ended: list[RunRecord] = []
        for record in (records or {}).values():
            self[record.id] = record

    def __setitem__(self, run_id: str, record: RunRecord) -> None:
        before = self.get(run_id)
        super().__setitem__(run_id, record)
        if record.state in FINAL_STATES:
            self._live.pop(run_id, None)
            if before is None or before.state not in FINAL_STATES:  # found ended once
                self._ended.append(record)
        else:
            self._live[run_id] = record

    def __delitem__(self, run_id: str) -> None:
        super().__delitem__(run_id)
        self._live.pop(run_id, None)

    def live(self) -> list[RunRecord]:
        """The runs not ended, in the order they were added (those that ended since the last look
        are moved to the ended ones here)."""
        ended = [r for r in self._live.values() if r.state in FINAL_STATES]
        for record in ended:
            del self._live[record.id]
            self._ended.append(record)
        return list(self._live.values())

    def ended_since(self, seen: int) -> list[RunRecord]:
        """The runs found ended after the first `seen` of them (call `live()` first to find those
        that ended since)."""
        return self._ended[seen:]
