"""What a carry shows on the new run's progress while it goes and once it is whole
(daemon/service/carry.py): the figures `obd train status` prints as "N of its checkpoint arrived".
No process: the progress is set on a record, as the carry sets it."""

from __future__ import annotations

import time

from daemon.service.carry import _show
from daemon.service.models import RunRecord


class _Host:
    """The one thing a carry's progress uses of the daemon: telling watchers a run changed."""

    def __init__(self) -> None:
        self.touched = 0

    def touch(self, record: RunRecord) -> None:
        self.touched += 1


def test_a_carry_quicker_than_one_showing_still_shows_it_arrived_whole() -> None:
    host, into = _Host(), RunRecord(id="r1")
    began = time.monotonic()
    _show(host, into, 0, None)  # type: ignore[arg-type]
    for done in (4096, 8192, 10000):  # chunks within a showing's interval (on a quiet machine): not shown
        _show(host, into, done, began)  # type: ignore[arg-type]
    _show(host, into, 10000, began, last=True)  # type: ignore[arg-type]
    assert (into.progress.carry_bytes, into.progress.carry_total) == (10000, 10000)
    assert into.progress.carry_rate is not None and into.progress.carry_rate > 0
    assert host.touched >= 2
