"""Where a stop is taken inside a step (interrupt.py's StopPoints), as the main thread sees it: a micro-batch
end takes it only when the boundary kept every RNG state; a stalled fetch's interruption always does.

A short step's end copies nothing: what a stop inside the next step needs is kept at the step end only
where a stop could come after something moved (a request seen, several micro-batches, long steps, a
data path seen drawing), at an epoch's end and an evaluation's start; from a step's begin (its batches
fetched) that found nothing kept, a stop waits for the step end.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy  # noqa: F401  (imported: its RNG is one a data pipeline may draw from)
import pytest
import torch

from tests.conftest import wait_for
from trainer_plugin.plugin import interrupt
from trainer_plugin.plugin.interrupt import LOADING_DATA, TRAINING, StopAtBoundary, StopPoints
from trainer_plugin.plugin.request_watch import RequestWatch
from trainer_plugin.rundir import request_bytes


class State:
    """The counters of a TrainerState a boundary keeps."""

    def __init__(self) -> None:
        self.num_input_tokens_seen = 0
        self.total_flos = 0.0


class Trainer:
    """What StopPoints reads of a Trainer: its state, and its FLOPs not yet added to the state."""

    def __init__(self) -> None:
        self.state = State()
        self.current_flos = 0.0


def points_after(step_seconds: float) -> StopPoints:
    """Points past a step of `step_seconds`, a request seen inside the next one (before its begin)."""
    points = StopPoints(request_path=None)
    points.boundary(1, 100.0)
    points.step_begins()
    points.boundary(2, 100.0 + step_seconds)  # a step of `step_seconds`
    points.reason = "requested"
    return points


def fetching_points(trainer: Trainer, step_seconds: float = 0.01) -> StopPoints:
    """Points of a Trainer's loop past its steps 1 and 2, the second of `step_seconds`, before step 3 begins."""
    points = StopPoints(request_path=None, trainer=weakref.ref(trainer))
    points.step_begins()  # step 1 begins, its batches fetched
    points.boundary(1, 100.0, trainer.state)
    points.step_begins()
    points.boundary(2, 100.0 + step_seconds, trainer.state)
    return points


def rng() -> torch.Tensor:
    return torch.random.default_generator.get_state()


def test_inside_a_short_step_a_micro_batch_end_leaves_the_stop_to_the_near_step_end() -> None:
    points = points_after(0.05)
    points.step_begins()
    assert points.phase == TRAINING and not points.last.kept  # type: ignore[union-attr]
    points.passed()  # a micro-batch end: nothing raised
    assert not points.taken
    points = points_after(0.05)
    with pytest.raises(StopAtBoundary):  # a fetch that stalls is interrupted all the same
        points.check(interrupted=True)


def test_inside_a_long_step_a_micro_batch_end_takes_the_stop_with_every_rng_state_kept() -> None:
    points = points_after(interrupt.FULL_RNG_STEP_SECONDS + 0.1)
    points.step_begins()
    last = points.last
    assert last is not None and last.full and last.numpy_rng is not None and last.python_rng is not None
    with pytest.raises(StopAtBoundary) as stop:
        points.passed()
    assert stop.value.step == 2 and points.taken


def test_a_short_step_end_copies_nothing_and_a_stall_in_the_next_fetch_saves_the_live_state() -> None:
    trainer = Trainer()
    points = fetching_points(trainer)
    last = points.last
    assert last is not None and not last.kept and points.exact  # no request yet, one micro-batch, short steps
    assert points.phase == LOADING_DATA  # the next step's fetch
    points.reason = "requested"  # seen while the fetch stalls
    trainer.state.num_input_tokens_seen, trainer.current_flos = 64, 5.0
    with pytest.raises(StopAtBoundary) as stop:
        points.check(interrupted=True)
    assert stop.value.step == 2 and stop.value.phase == LOADING_DATA
    last.restore(trainer.state, trainer)  # nothing kept, nothing moved: the live state stays
    assert (trainer.state.num_input_tokens_seen, trainer.current_flos) == (64, 5.0)


def test_inside_a_short_step_past_its_fetch_a_stop_waits_for_the_step_end() -> None:
    points = fetching_points(Trainer())
    points.step_begins()  # the forward passes may draw from here on
    points.reason = "requested"
    points.check(interrupted=True)  # inside the step: nothing raised
    assert not points.taken and not points.exact
    points.boundary(3, 100.03)  # the step end takes it (callback.py), with the live state exact
    assert points.exact


def test_an_interruption_inside_the_optimizer_step_of_a_long_step_waits_for_its_end() -> None:
    """Through the callback's hooks, as the Trainer calls them: a long step keeps its boundary, so a
    stop inside it is exact up to its optimizer step, and from there on waits for the step end."""
    from trainer_plugin.plugin.callback import SnapshotCallback
    from trainer_plugin.plugin.runtime import RunEnv

    hooks: Any = SnapshotCallback(env=RunEnv.from_environ({}))  # Any: the Trainer's arguments are not needed here
    hooks._points = points = points_after(interrupt.KEEP_RNG_STEP_SECONDS + 0.1)  # step 2 was long: kept
    points.reason = None
    hooks.on_step_begin(None, None, None)  # step 3 begins
    points.reason = "requested"
    before = points.safe, points.exact
    hooks.on_pre_optimizer_step(None, None, None)
    points.check(interrupted=True)  # a signal in the optimizer step: nothing raised
    assert before == (True, True) and not points.taken
    points.boundary(3, 200.0)  # the step end takes it with the state after the optimizer step
    with pytest.raises(StopAtBoundary) as stop:
        points.check(interrupted=True)
    assert stop.value.step == 3


@pytest.mark.parametrize(
    "why",
    ["a request seen", "several micro-batches", "long steps"],
)
def test_a_step_end_keeps_torchs_rng_and_the_counters_where_a_stop_could_follow_a_draw(why: str) -> None:
    trainer = Trainer()
    points = StopPoints(request_path=None, trainer=weakref.ref(trainer))
    points.several = why == "several micro-batches"
    points.step_begins()
    points.boundary(1, 100.0, trainer.state)
    points.step_begins()
    if why == "a request seen":
        points.reason = "requested"
    trainer.state.num_input_tokens_seen, trainer.state.total_flos, trainer.current_flos = 640, 10.0, 3.0
    before = rng()
    points.boundary(2, 100.0 + (interrupt.KEEP_RNG_STEP_SECONDS + 0.01 if why == "long steps" else 0.01))
    assert points.last is not None and points.last.kept
    torch.rand(4)  # the data path's random masking
    points.step_begins()
    torch.rand(8)  # a forward pass's dropout
    trainer.state.num_input_tokens_seen, trainer.current_flos = 704, 4.0  # its tokens and FLOPs
    points.reason = "requested"
    with pytest.raises(StopAtBoundary):
        points.check(interrupted=True)
    points.last.restore(trainer.state, trainer)
    assert torch.equal(rng(), before)
    # Step 2's FLOPs not yet stored stay (the save adds them), the abandoned micro-batch's go.
    assert (trainer.state.num_input_tokens_seen, trainer.state.total_flos, trainer.current_flos) == (640, 10.0, 3.0)


def test_a_data_path_that_draws_from_torchs_rng_is_seen_and_every_later_step_end_keeps_it() -> None:
    trainer = Trainer()
    points = fetching_points(trainer)  # its first step end was probed: step 2's fetch drew nothing
    assert not points.fetch_draws
    assert points.last is not None and not points.last.kept
    while points.steps % interrupt.PROBE_EVERY_STEPS != 0:  # to the step end before the next probe
        points.step_begins()
        points.boundary(3, 100.03, trainer.state)
    points.step_begins()
    points.boundary(3, 100.03, trainer.state)  # probed: kept
    torch.rand(4)  # a collator's random masking
    points.step_begins()
    assert points.fetch_draws
    points.boundary(4, 100.04, trainer.state)  # every step end keeps it from now on
    before = rng()
    torch.rand(4)
    points.reason = "requested"
    with pytest.raises(StopAtBoundary):  # stalled after its draw
        points.check(interrupted=True)
    points.last.restore(trainer.state, trainer)
    assert torch.equal(rng(), before)


def test_an_epochs_end_keeps_torchs_rng_before_the_next_epochs_data_loader_draws_its_seed() -> None:
    trainer = Trainer()
    points = fetching_points(trainer)
    before = rng()
    points.epoch_ends(trainer.state)
    torch.empty((), dtype=torch.int64).random_()  # iter(DataLoader): its base seed
    points.reason = "requested"  # stalled in the new epoch's first fetch
    with pytest.raises(StopAtBoundary):
        points.check(interrupted=True)
    points.last.restore(trainer.state, trainer)  # type: ignore[union-attr]
    assert torch.equal(rng(), before)


def test_a_cut_evaluation_puts_back_its_start_and_a_completed_one_keeps_the_state_after_it() -> None:
    trainer = Trainer()
    points = fetching_points(trainer)
    before = rng()
    points.evaluation_begins()
    last = points.last
    assert last is not None and last.kept and last.full
    torch.rand(2)  # the evaluation's loader draws its seed
    points.reason = "requested"
    with pytest.raises(StopAtBoundary) as stop:
        points.passed()  # an evaluation batch's end
    assert stop.value.phase == "evaluating"
    last.restore(trainer.state, trainer)
    assert torch.equal(rng(), before)
    points = fetching_points(trainer)
    points.epoch_ends(trainer.state)  # an evaluation at an epoch's end
    points.evaluation_begins()
    torch.rand(2)
    points.evaluation_ended(completed=True)
    after = rng()
    torch.empty((), dtype=torch.int64).random_()  # the next epoch's data loader draws its seed
    points.reason = "requested"
    with pytest.raises(StopAtBoundary):  # a stall in the new epoch's first fetch
        points.check(interrupted=True)
    points.last.restore(trainer.state, trainer)  # type: ignore[union-attr]
    assert torch.equal(rng(), after)


def test_the_thread_says_a_long_fetch_once_and_the_training_phase_after_it() -> None:
    said: list[str] = []

    def write_phase(phase: str, step: Any, **fields: Any) -> None:
        said.append(phase)

    points = StopPoints(request_path=None, write_phase=write_phase)
    points.step_begins()
    points.boundary(1, 100.0)  # the next step's fetch begins
    points._say_quiet_phase(200.0)  # the thread's first look at this fetch
    points._say_quiet_phase(200.0 + interrupt.QUIET_PHASE_SECONDS / 2)
    assert said == []
    points._say_quiet_phase(200.0 + interrupt.QUIET_PHASE_SECONDS)
    points._say_quiet_phase(201.0 + interrupt.QUIET_PHASE_SECONDS)
    assert said == [LOADING_DATA]
    points.step_begins()
    assert said == [LOADING_DATA, TRAINING]
    points.boundary(2, 101.0)  # a quick fetch: the thread sees it once, says nothing
    points._say_quiet_phase(300.0)
    points.step_begins()
    points._say_quiet_phase(300.0 + interrupt.QUIET_PHASE_SECONDS)
    assert said == [LOADING_DATA, TRAINING]
    points.boundary(3, 102.0)  # a long one cut by an evaluation: its line after the thread's
    points._say_quiet_phase(400.0)
    points._say_quiet_phase(400.0 + interrupt.QUIET_PHASE_SECONDS)
    points.evaluation_begins()
    assert said == [LOADING_DATA, TRAINING, LOADING_DATA, "evaluating"]


def test_the_callbacks_inlined_step_begin_and_end_mark_what_step_begins_and_boundary_mark(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """callback.py inlines the common case of StopPoints.step_begins and boundary: driven through the
    same steps (short ones, probes, a long one, a fetch that draws, a request), both leave the same marks."""
    from trainer_plugin.plugin import callback as callback_module
    from trainer_plugin.plugin.callback import SnapshotCallback
    from trainer_plugin.plugin.runtime import RunEnv

    clock = [100.0]
    monkeypatch.setattr(callback_module, "_monotonic", lambda: clock[0])
    trainer = Trainer()
    hooks = SnapshotCallback(env=RunEnv.from_environ({}))  # outside obd: the step end stops at its marks
    hooks._points = inlined = StopPoints(request_path=None, trainer=weakref.ref(trainer))
    reference = StopPoints(request_path=None, trainer=weakref.ref(trainer))

    class State:
        global_step = 0
        max_steps = 1000
        num_input_tokens_seen = 0
        total_flos = 0.0

    state = State()

    def marks(points: StopPoints) -> tuple[Any, ...]:
        last = points.last
        kept = None if last is None else (last.step, last.kept, last.full)
        return (
            *(points.phase, points.exact, points.safe, points.steps, points.step_seconds, points.position),
            *(points.fetches, points._begin_watch, points._probing, points.fetch_draws, kept),
        )

    common = 0  # step ends that copied nothing
    for step in range(1, 140):
        seconds = 0.2 if step == 70 else 0.01
        if step == 100:
            inlined.reason = reference.reason = "requested"
        if step == 101:
            inlined.reason = reference.reason = None
        before = rng()
        if step == 130:  # the fetch after the step end probed last draws (a collator's masking)
            torch.rand(2)
        after = rng()
        hooks.on_step_begin(None, state, None)
        torch.random.default_generator.set_state(before)
        if step == 130:
            torch.rand(2)
        assert torch.equal(rng(), after)
        reference.step_begins()
        assert marks(inlined) == marks(reference), step
        hooks.on_pre_optimizer_step(None, state, None)
        reference.unsafe()
        clock[0] += seconds
        state.global_step = step
        hooks.on_step_end(None, state, None)
        reference.boundary(step, clock[0], state)
        assert marks(inlined) == marks(reference), step
        common += not inlined.last.kept  # type: ignore[union-attr]
    assert inlined.fetch_draws  # the probe after step 129 saw the draw
    # All but the probes (1, 65, 129), the long step (70), the one with a request (100), and 130-139 after the draw.
    assert common == 139 - 3 - 1 - 1 - 10


def test_with_the_request_watch_the_thread_looks_seldom_and_a_written_request_wakes_it_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Looks an hour apart unless woken: only the watch's wake-up can make the thread see the request.
    monkeypatch.setattr(interrupt, "WATCHED_POLL_SECONDS", 3600.0)
    looks: list[str | None] = []
    turn = StopPoints._turn

    def counted_turn(self: StopPoints, now: float) -> None:
        turn(self, now)
        looks.append(self.reason)

    monkeypatch.setattr(StopPoints, "_turn", counted_turn)
    request = tmp_path / "snapshot.request"
    watch = RequestWatch.start(str(request))
    assert watch is not None
    points = StopPoints(str(request))
    points.watched(watch)
    try:
        points.start()
        assert points._interval() == interrupt.WATCHED_POLL_SECONDS
        request.write_bytes(request_bytes("requested"))
        wait_for(lambda: points.reason == "requested", what="the stop thread seeing the request")
        # Seen: from now on it looks every POLL_SECONDS, to interrupt once the grace is over.
        assert points._interval() == interrupt.POLL_SECONDS
        # Woken by the watch alone: the file's creation (its content may not be written yet), then its close.
        assert looks.index("requested") <= 1
    finally:
        points.close()
        watch.close()
    # A closed watch vouches for nothing: a thread of later points would look every POLL_SECONDS.
    assert not watch.alive
    later = StopPoints(str(request))
    later.watched(watch)
    assert later._interval() == interrupt.POLL_SECONDS
