"""A long loop's share of the event loop: a loop over thousands of runs (a sweep of 1,000 made or
cancelled, 5,000 `list` entries encoded, a queue pass) lets others in once it has held the loop
for SHARE seconds, however slow the box is just then, rather than after so many runs: on a busy
2-core box a count of runs that takes 3 ms when quiet takes 30 ms, and every caller waits for it
(issue 33: others answered within 100 ms while one member queues and cancels thousands)."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio.lowlevel

# Seconds a loop holds the event loop at most (but for the run it is on) before others' turn: a
# few loops at once (a sweep made, a queue pass, root's list) still leave each caller's step
# a wait of tens of milliseconds at most on a busy box. A turn costs ~20 µs: 1 % of the loop's time.
SHARE = 0.003


class Share:
    """One loop's share: `await share.turn()` after each item; True when it let others in (what
    the loop looked at before may have changed meanwhile)."""

    def __init__(self, seconds: float | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.seconds = SHARE if seconds is None else seconds
        self._clock = clock
        self._since = clock()
        self.turns = 0

    def due(self) -> bool:
        """Whether the loop has held the event loop for its share since it began or last turned."""
        return self._clock() - self._since >= self.seconds

    async def turn(self) -> bool:
        if not self.due():
            return False
        await anyio.lowlevel.checkpoint()
        self._since = self._clock()
        self.turns += 1
        return True
