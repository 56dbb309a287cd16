"""The toy kind's registered class: what it is and can do, and the one hook it changes."""

from __future__ import annotations

from executors.kinds import Capability, Kind, register
from tests.executors.toy_kind.config import ToyTarget


class ToyKind(Kind[ToyTarget]):
    name = "toy"
    config = ToyTarget
    capabilities = frozenset({Capability.SHARED_MACHINE, Capability.EXEC})

    def gpus_counted(self, target: ToyTarget, held: int) -> int | None:
        return target.slots


TOY = register(ToyKind())
