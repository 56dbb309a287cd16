"""Where a stop is taken inside a step (interrupt.py's StopPoints), as the main thread sees it: a micro-batch
end takes it only when the boundary kept every RNG state; a stalled fetch's interruption always does."""

from __future__ import annotations

import numpy  # noqa: F401  (imported: its RNG is one a data pipeline may draw from)
import pytest

from trainer_plugin.plugin import interrupt
from trainer_plugin.plugin.interrupt import TRAINING, StopAtBoundary, StopPoints


def points_after(step_seconds: float, monkeypatch: pytest.MonkeyPatch) -> StopPoints:
    points = StopPoints(request_path=None)
    now = [100.0]
    monkeypatch.setattr(interrupt.time, "monotonic", lambda: now[0])
    points.boundary(1, {})
    now[0] += step_seconds
    points.boundary(2, {})  # a step of `step_seconds`
    monkeypatch.undo()
    points.reason = "requested"
    return points


def test_inside_a_short_step_a_micro_batch_end_leaves_the_stop_to_the_near_step_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    points = points_after(0.05, monkeypatch)
    assert points.phase == TRAINING and not points.last.full  # type: ignore[union-attr]
    points.passed()  # a micro-batch end: nothing raised
    assert not points.taken
    with pytest.raises(StopAtBoundary):  # a fetch that stalls is interrupted all the same
        points.check(interrupted=True)


def test_inside_a_long_step_a_micro_batch_end_takes_the_stop_with_every_rng_state_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    points = points_after(interrupt.FULL_RNG_STEP_SECONDS + 0.1, monkeypatch)
    last = points.last
    assert last is not None and last.full and last.numpy_rng is not None and last.python_rng is not None
    with pytest.raises(StopAtBoundary) as stop:
        points.passed()
    assert stop.value.step == 2 and points.taken
