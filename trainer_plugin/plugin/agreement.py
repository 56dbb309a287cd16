"""Where every rank of a torch.distributed job stops between two step ends (issue 32, item 5).

A rank cannot save alone: the snapshot's save runs collectives (the Trainer sums FLOPs, the
plugin waits for every rank's share), so all ranks must stop at the same point, and no rank may
wait for the others while one of them is blocked in a collective that needs it. The ranks agree
through the job's own key-value store (torch.distributed's default store, out of band of the
collectives, so a rank blocked in a collective still answers through its thread):

- Each rank counts its *positions*: every step end, micro-batch end and evaluation batch end.
  Ranks pass the same positions in the same order (same accumulation, same evaluation batches),
  and at a position a rank has finished every collective before it.
- Rank 0's thread reads the request file and posts the stop; every rank's thread then publishes
  its position; at a micro-batch or evaluation batch end a rank that knows of the stop *parks*
  (waits, outside any collective) and says so.
- Rank 0's thread is the arbiter. The *target* is the furthest position any rank has reached or
  will reach next (a running rank's next position: it may be blocked in a collective that needs
  the others to go on). A parked rank behind the target goes on to its next position; once every
  rank is parked at the target, the verdict is to stop there, and each rank raises the stop.
  Nobody waits for a rank that needs it, so there is no deadlock; a rank stalled in its data
  loader holds the stop until its fetch returns (it cannot be interrupted: the others are inside
  a collective with it).

A step end is a position but never a parking place: the step end's own collective (dist.py)
already makes every rank take a request there together.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any

# How often a parked rank looks for the verdict, and the arbiter for new positions, once a stop is out.
PARKED_POLL_SECONDS = 0.02

_generations = itertools.count()


class RankAgreement:
    """One training's agreement among its ranks, over the job's store (keys under a per-training prefix)."""

    def __init__(self, store: Any, rank: int, world_size: int, generation: int) -> None:
        self._store = store
        self.rank = rank
        self.world_size = world_size
        self._prefix = f"obd-stop/{generation}/"
        self._lock = threading.Lock()  # the store's client is shared by the main thread and the watch
        self._parked = False
        self._target = -1

    @classmethod
    def for_job(cls, rank: int, world_size: int) -> RankAgreement | None:
        """The agreement of this process's default process group, or None without one (or a store)."""
        c10d = sys.modules.get("torch.distributed.distributed_c10d")
        getter = getattr(c10d, "_get_default_store", None)
        if getter is None or world_size < 2:
            return None
        try:
            store = getter()
        except Exception:  # a group made without a store: stops wait for the next step end
            return None
        # Every rank makes its trainings in the same order, so the n-th training's keys are the same on all.
        return cls(store, rank, world_size, next(_generations))

    # --- the store, under one lock ----------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _get(self, name: str) -> str | None:
        key = self._key(name)
        with self._lock:
            if not self._store.check([key]):
                return None
            return bytes(self._store.get(key)).decode()

    def _set(self, name: str, value: str) -> None:
        with self._lock:
            self._store.set(self._key(name), value)

    # --- the stop -----------------------------------------------------------------------------

    def post_stop(self, reason: str) -> None:
        """Rank 0: a stop was asked (the request file); every rank's thread reads it from the store."""
        self._set("reason", reason)

    def posted_stop(self) -> str | None:
        return self._get("reason")

    def publish(self, position: int) -> None:
        """The watch thread: where this rank's main thread is, while it runs (not while parked)."""
        with self._lock:
            if not self._parked:
                self._store.set(self._key(f"at/{self.rank}"), f"{position}:run")

    def park(self, position: int) -> bool:
        """The main thread, at a micro-batch or evaluation batch end: True to stop here, False to go on."""
        with self._lock:
            self._parked = True
            self._store.set(self._key(f"at/{self.rank}"), f"{position}:parked")
        try:
            while True:
                stop = self._get("stop")
                if stop is not None and int(stop) == position:
                    return True
                target = self._get("target")
                if target is not None and int(target) > position:
                    return False
                time.sleep(PARKED_POLL_SECONDS)
        finally:
            with self._lock:
                self._parked = False

    def arbitrate(self) -> bool:
        """Rank 0's thread: move the target on, or give the verdict to stop; True once it is given."""
        places = [self._get(f"at/{rank}") for rank in range(self.world_size)]
        if any(place is None for place in places):
            return False  # a rank whose thread has not seen the stop yet
        parsed = [(int(p), s == "parked") for p, s in (str(place).split(":") for place in places)]
        furthest = max(p if parked else p + 1 for p, parked in parsed)
        if furthest > self._target:
            self._target = furthest
            self._set("target", str(furthest))
        if all(parked and p == self._target for p, parked in parsed):
            self._set("stop", str(self._target))
            return True
        return False
