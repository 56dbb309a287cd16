"""Stop anywhere: a stop request noticed within about a second whatever the job is doing, and taken
at the nearest safe point with the state of the last completed optimizer step (issue 32).

A Trainer step end takes a request as it always did (callback.py). What this adds is for the time
between two step ends that is not a short training step: an evaluation, a long gradient
accumulation, a data loader stalled in one sample, the script's code after `train()`.

- `StopPoints` follows which *phase* the job is in and whether it is *safe*: between the end of
  optimizer step N (the *boundary*, whose state the Trainer would have saved) and the start of
  step N+1's optimizer step, the model, optimizer and scheduler are still exactly step N's, so
  abandoning what runs then loses nothing but work that is simply done again. The Trainer's own
  checkpoint save and the optimizer step are never safe.
- A step end marks the boundary with a few attribute stores, inlined in callback.py's hook (what
  it costs a step: docs/stop-latency.md). What moves before the next one although it belongs to step N (the RNG
  states, the token and FLOP counts) is copied only where a stop inside the next step could come
  after it moved: at the step end when a request is already seen, the steps have several
  micro-batches, steps take `KEEP_RNG_STEP_SECONDS` or more (the copy's ~10 µs are then under
  1e-4 of a step), or the data path was seen drawing from torch's RNG (looked at every
  `PROBE_EVERY_STEPS` steps); at an epoch's end (before the next epoch's data loader draws its
  seed); at an evaluation's start and end. Where nothing was copied nothing moved until the next
  step begins (the Trainer's `on_step_begin`, after its fetch, before its forward passes): a stop
  until then (a stalled fetch's) saves the live state; after it, a stop waits for the step end.
  numpy's and Python's RNG states (10-100 µs) are copied with torch's when steps take
  `FULL_RNG_STEP_SECONDS` or more, and at an evaluation's start. Inside a shorter training step,
  whose end is near, a micro-batch end does not take a stop (numpy's or Python's RNG may have
  moved since the boundary): the step end does; only an interruption (a fetch that stalls) acts there.
- A thread looks for the request every `POLL_SECONDS` (every `WATCHED_POLL_SECONDS` where the
  request's inotify watch wakes it as soon as a request is written). Once one is there and no safe point of the
  main thread (a step end, a micro-batch end, an evaluation batch) took it within `GRACE_SECONDS`,
  it interrupts the main thread with a real signal (`INTERRUPT_SIGNAL`), so a blocking read or
  sleep in a data loader returns too; the handler raises `StopAtBoundary` only while safe.
- `StopAtBoundary` is a BaseException: the script's and the libraries' `except Exception` let it
  through to obd's patched `train()`, which puts the boundary's state back and saves it as the
  snapshot (callback.py `snapshot_at_boundary`).
- After `train()` returned no snapshot can come: on a request the thread writes an `after_train`
  line naming the code the stop cuts short, and the daemon ends the job at once.

Under torch.distributed every rank must stop at the same point: the ranks agree on it through
the job's store (agreement.py) and stop only at the points they all reach (a micro-batch's end,
an evaluation batch's end); no signal interrupts a rank there, since its peers may be inside a
collective with it. Standard library only; torch, numpy and Python's `random` are read only if
imported.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from .agreement import PARKED_POLL_SECONDS, RankAgreement
from .runtime import log_error, read_request

if TYPE_CHECKING:
    from .request_watch import RequestWatch

# How often the thread looks for a request (an access() each time; the GIL is released between).
POLL_SECONDS = 0.2
# How often it looks while the request's inotify watch (request_watch.py) wakes it as a request is
# written: a writer the kernel does not see (another client of a network filesystem) is still seen
# within about a second, and a stalled fetch's `loading_data` said within two. Each look is a
# wake-up of a thread that wants the GIL, some 40 µs of the job's CPU: five a second were half of
# what the plugin added to a short step.
WATCHED_POLL_SECONDS = 1.0
# How long a request may wait for a safe point of the main thread's own before it is interrupted.
GRACE_SECONDS = 0.8
# Steps at least this long keep numpy's and Python's RNG states at every boundary too.
FULL_RNG_STEP_SECONDS = 0.5
# Steps at least this long copy torch's RNG state at each step end whatever else holds: ~10 µs
# inside a job, under 1e-4 of such a step, and a stop inside the step is then exact wherever it comes.
KEEP_RNG_STEP_SECONDS = 0.1
# Every this many steps one keeps torch's RNG state at its end and looks at the next step's begin
# (after its fetch) whether the data path drew from it (a collator's random masking, an
# augmentation in the job's own process): once seen, every step end keeps it.
PROBE_EVERY_STEPS = 64
# How long the job must be in a phase said only when it lasts (loading data) before it is said.
QUIET_PHASE_SECONDS = 1.0
# A real-time signal, never sent by anyone else, so the job's own handlers (SIGUSR1 from Slurm's
# --signal, SIGTERM) are left alone. Its default action would end the process: it is sent only
# while obd's handler is installed.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else None

TRAINING, EVALUATING, SAVING, LOADING_DATA, AFTER_TRAIN = (
    "training",
    "evaluating",
    "saving",
    "loading_data",
    "after_train",
)
# What the marker file in an interrupted snapshot's checkpoint is called: the phase that was cut
# short, so a resumed run performs an interrupted evaluation first.
INTERRUPTED_MARKER = "obd-interrupted.json"


class StopAtBoundary(BaseException):
    """Raised in the main thread at a safe point: the work since the last optimizer step is
    abandoned and that step's state becomes the snapshot."""

    def __init__(self, reason: str, phase: str, step: int) -> None:
        super().__init__(f"obd: stop ({reason}) during {phase}: the snapshot is the state at step {step}")
        self.reason, self.phase, self.step = reason, phase, step


# torch's default CPU generator, `torch.cuda.is_initialized` and `torch.cuda`, found once torch is
# imported: a copy at an epoch's end, after a step's compute, looks nothing up (a few µs a copy
# cold). The copy itself (`get_state`, ~8 µs cold) is what it is: `clone_state` was no faster in a job.
_torch_rng: tuple[Any, Callable[[], bool], Any] | None = None


def _find_torch_rng() -> tuple[Any, Callable[[], bool], Any] | None:
    global _torch_rng
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    version = getattr(torch, "version", None)
    cpu_only = getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None
    # A torch built without CUDA never initializes it: no look at each copy.
    _torch_rng = (torch.random.default_generator, _never if cpu_only else torch.cuda.is_initialized, torch.cuda)
    return _torch_rng


def _never() -> bool:
    return False


class Boundary:
    """What a checkpoint at the end of optimizer step `step` holds that moves before the next one.

    `kept`: the copies below are this boundary's (taken since it, before anything moved); when
    False, nothing that moves was copied and a stop puts nothing back (the live state is the
    boundary's, StopPoints.exact says so). Slots, not a dict: a step end stores into it.
    """

    __slots__ = (  # noqa: RUF023 (in the order a step end touches them)
        "step",
        "kept",
        "full",  # numpy's and Python's RNG states were kept too (or neither was imported)
        "torch_rng",
        "cuda_rng",
        "numpy_rng",
        "python_rng",
        "tokens",  # state.num_input_tokens_seen when kept
        "total_flos",  # state.total_flos when kept
        "current_flos",  # the Trainer's FLOPs not yet added to total_flos, when kept
        "counters",  # loop.py's boundary(): none
        "at",  # time.monotonic() when it was taken (loop.py's)
    )

    def __init__(self, step: int, counters: dict[str, Any] | None = None, at: float = 0.0) -> None:
        self.step = step
        self.kept = False
        self.full = False
        self.torch_rng: Any = None
        self.cuda_rng: Any = None
        self.numpy_rng: Any = None
        self.python_rng: Any = None
        self.tokens: Any = None
        self.total_flos: Any = None
        self.current_flos: Any = None
        self.counters: dict[str, Any] = counters if counters is not None else {}
        self.at = at

    @classmethod
    def take(cls, step: int, full: bool, counters: dict[str, Any]) -> Boundary:
        b = cls(step, counters=counters, at=time.monotonic())
        b.take_rng(FULL_RNG_STEP_SECONDS if full else 0.0)
        return b

    def keep(self, full: bool, state: Any, trainer: Any) -> None:
        """Copy what moves now: the RNG states (numpy's and Python's too when `full`) and the
        Trainer's counters (the FLOPs not yet stored included, so the save's sum is step N's)."""
        self.take_rng(FULL_RNG_STEP_SECONDS if full else 0.0)
        self.tokens = getattr(state, "num_input_tokens_seen", None)
        self.total_flos = getattr(state, "total_flos", None)
        self.current_flos = getattr(trainer, "current_flos", None)
        self.kept = True

    def take_rng(self, step_seconds: float) -> None:
        """Keep the RNG states as they are now: torch's always, numpy's and Python's for slow steps."""
        torch = _torch_rng or _find_torch_rng()
        if torch is not None:
            generator, cuda_initialized, cuda = torch
            self.torch_rng = generator.get_state()
            self.cuda_rng = cuda.get_rng_state_all() if cuda_initialized() else None
        if step_seconds < FULL_RNG_STEP_SECONDS:
            self.numpy_rng = self.python_rng = None
            self.full = "numpy" not in sys.modules and "random" not in sys.modules
            return
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        random = sys.modules.get("random")
        self.python_rng = random.getstate() if random is not None else None
        self.full = True

    def torch_moved(self) -> bool:
        """Whether torch's RNG (CPU, and CUDA where used) is no longer the copy kept."""
        torch = sys.modules.get("torch")
        if torch is None or self.torch_rng is None:
            return False
        if not torch.equal(torch.random.default_generator.get_state(), self.torch_rng):
            return True
        if self.cuda_rng is None or not torch.cuda.is_initialized():
            return False
        now = torch.cuda.get_rng_state_all()
        kept = self.cuda_rng
        return len(now) != len(kept) or any(not torch.equal(now[i], kept[i]) for i in range(len(now)))

    def restore(self, state: Any, trainer: Any) -> None:
        """Before a stop's save: put back what was kept (nothing when nothing was: it did not move)."""
        if not self.kept:
            return
        self.restore_rng()
        if self.tokens is not None:
            state.num_input_tokens_seen = self.tokens
        if self.total_flos is not None:
            state.total_flos = self.total_flos
        if trainer is not None:  # the abandoned micro-batches' FLOPs go; step N's not yet stored stay
            trainer.current_flos = self.current_flos if self.current_flos is not None else 0

    def restore_rng(self) -> None:
        """Put the RNG states back as they were at the boundary (those that were kept)."""
        torch = sys.modules.get("torch")
        if torch is not None and self.torch_rng is not None:
            torch.random.default_generator.set_state(self.torch_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state_all(self.cuda_rng)
        if self.numpy_rng is not None:
            sys.modules["numpy"].random.set_state(self.numpy_rng)
        if self.python_rng is not None:
            sys.modules["random"].setstate(self.python_rng)


class StopPoints:
    """One training's phase, safety and last boundary, and the thread that interrupts it for a stop.

    The main thread calls `boundary()` at each step end, `step_begins()` at the next step's begin
    (its batches fetched), `unsafe()` before an optimizer step or a save, `enter(phase)` as phases
    change, `epoch_ends()`, `evaluation_begins()`/`evaluation_ended()`, and `check()` at its own
    safe points (a micro-batch's end, an evaluation batch's). `taken` is set once the request is
    being acted on, by a step end or here, so it is acted on once. `exact`: a stop now saves
    exactly the last boundary's state (what moved since was kept); False from a step's begin that
    found nothing kept until its end. Between a step end and the next step's begin the phase is
    `loading_data`, said only once it lasts (the fetch, or whatever else holds the next step back).

    The step's own marks (a step end that copies nothing, a step begin, the optimizer step's) are a
    few stores into this object's first slots, with no call beyond the hook's own: callback.py
    inlines the step begin's and the optimizer step's (`step_begins` is the same, as a method).
    """

    # The attributes a step touches first (one or two cache lines after a step's compute), then the rest.
    __slots__ = (  # noqa: RUF023 (the order is the layout: what a step touches first)
        "phase",
        "exact",
        "safe",
        "taken",
        "reason",
        "steps",
        "last",
        "step_seconds",
        "_boundary_at",
        "_keep_every",
        "_begin_watch",
        "_quiet_said",
        "_probing",
        "_several",
        "fetch_draws",
        "_passes",
        "_stretches",
        "request_path",
        "_trainer",
        "write_phase",
        "agreement",
        "is_zero",
        "_verdict",
        "_quiet_lock",
        "_quiet_fetch",
        "_quiet_since",
        "_seen_at",
        "_signalled_at",
        "_main",
        "_previous_handler",
        "_handler_installed",
        "_closing",
        "_nudge",
        "watch",
        "_thread",
        "_cut_written",
        "__weakref__",
    )

    def __init__(
        self,
        request_path: str | None,
        write_phase: Any = None,
        agreement: RankAgreement | None = None,
        trainer: Callable[[], Any] | None = None,
    ) -> None:
        self.phase = TRAINING
        self.exact = True
        self.safe = False
        self.taken = False
        self.reason: str | None = None
        self.steps = 0  # boundaries passed
        self.last: Boundary | None = None
        self.step_seconds = 0.0
        self._boundary_at = math.nan  # the last boundary's time.monotonic() (none yet: NaN)
        # A step end keeps what moves whatever the step's length: its steps have several
        # micro-batches, or a probed fetch drew from torch's RNG (`several` or `fetch_draws`).
        self._keep_every = False
        # The next step's begin does more than mark the phase: the boundary was kept or is probed
        # (or none was marked yet).
        self._begin_watch = True
        self._quiet_said = False
        self._probing = False
        self._several = False
        self.fetch_draws = False  # a probed fetch moved torch's RNG: every step end keeps it
        self._passes = 0  # micro-batch and evaluation batch ends (`position`)
        self._stretches = 0  # evaluations and saves ended (`fetches`)
        self.request_path = request_path
        # The Trainer (a weakref.ref): its FLOPs not yet stored are kept with the boundary.
        self._trainer = trainer
        self.write_phase = write_phase  # callable(phase, step, **fields): a metrics line, or None
        # Under torch.distributed: where the ranks agree to stop (None: one process).
        self.agreement = agreement
        self.is_zero = agreement is None or agreement.rank == 0
        self._verdict = False
        # A phase too frequent to write at each change (loading data: every step), said by the
        # thread only once it lasted QUIET_PHASE_SECONDS: the fetch the thread first saw, when, and
        # whether it was said (the thread claims it under the lock before it writes).
        self._quiet_lock = threading.Lock()
        self._quiet_fetch = -1
        self._quiet_since = 0.0
        self._seen_at = 0.0
        self._signalled_at = 0.0
        self._main = threading.main_thread().ident
        self._previous_handler: Any = None
        self._handler_installed = False
        self._closing = False
        self._nudge = threading.Event()  # wakes the thread: close(), or the watch saw a request
        # The request's inotify watch, when the job has one (callback.py): the thread then looks
        # less often, woken by it (`watched`).
        self.watch: RequestWatch | None = None
        self._thread: threading.Thread | None = None
        self._cut_written = False

    @property
    def position(self) -> int:
        """Positions passed (step ends, micro-batch ends, evaluation batch ends): the ranks' common count."""
        return self.steps + self._passes

    @property
    def fetches(self) -> int:
        """Stretches between a step end (or an evaluation or save after it) and the next step's begin (the thread's timing)."""
        return self.steps + self._stretches

    @property
    def several(self) -> bool:
        """A step has several micro-batches (set from the Trainer's arguments): every step end keeps what moves."""
        return self._several

    @several.setter
    def several(self, several: bool) -> None:
        self._several = several
        self._keep_every = several or self.fetch_draws

    # --- started and stopped with a training --------------------------------------------------

    def start(self) -> StopPoints:
        """Install the signal handler (main thread, signal free) and start the watching thread."""
        if self.request_path is None:
            return self
        interruptible = self.agreement is None  # a rank's peers may be in a collective with it
        if interruptible and INTERRUPT_SIGNAL is not None and threading.current_thread() is threading.main_thread():
            current = signal.getsignal(INTERRUPT_SIGNAL)
            if current in (signal.SIG_DFL, None):
                self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._handler)
                self._handler_installed = True
            else:
                log_error(f"obd: signal {INTERRUPT_SIGNAL} is the job's own; a stop waits for a safe point of the loop")
        self._thread = threading.Thread(target=self._watch, name="obd-stop-points", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread and give the signal back (after training, or once the snapshot is proven)."""
        self._closing = True
        self._nudge.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler or signal.SIG_DFL)  # type: ignore[arg-type]
            self._handler_installed = False

    # --- the main thread's marks -------------------------------------------------------------

    def boundary(self, step: int, now: float, state: Any = None) -> None:
        """Optimizer step `step` ended (at `now`, time.monotonic()): its state is the one to save
        until the next one. Attribute stores, and a copy of what moves only where needed.

        The common step end (a short step after its begin, nothing to keep, no probe due, no
        request) is the first branch's stores; anything else is `_boundary`."""
        steps = self.steps = self.steps + 1
        seconds = self.step_seconds = now - self._boundary_at
        self._boundary_at = now
        last = self.last
        if (
            last is None
            or self.phase != TRAINING
            or self.reason is not None
            or self._keep_every
            or seconds >= KEEP_RNG_STEP_SECONDS
            or steps % PROBE_EVERY_STEPS == 1
        ):
            self._boundary(step, seconds, state)
            return
        last.step = step
        last.kept = False
        self.exact = True
        self._begin_watch = False
        self.phase = LOADING_DATA  # the thread says it once it lasts
        self.safe = not self.taken

    def _boundary(self, step: int, seconds: float, state: Any) -> None:
        """`boundary()` where something is kept, probed or said, or for the first time."""
        last = self.last
        if last is None:  # one Boundary a training, updated in place: no object made a step
            last = self.last = Boundary(step)
            seconds = self.step_seconds = 0.0
        last.step, last.kept = step, False
        self.exact = True
        self._begin_watch = self._probing  # a probe whose step never began: looked at if one does
        if self.reason is not None or self._keep_every or seconds >= KEEP_RNG_STEP_SECONDS:
            self._keep(seconds >= FULL_RNG_STEP_SECONDS, state)
        elif self.steps % PROBE_EVERY_STEPS == 1:  # the first boundary, then every N
            self._keep(False, state)
            self._probing = True
        if self.phase == LOADING_DATA:  # a loop that says no step's begin
            self._leave_quiet_phase(TRAINING)
        elif self.phase != TRAINING:
            self.enter(TRAINING)
        self.phase = LOADING_DATA
        self.safe = not self.taken

    def _back_to_training(self) -> None:
        """From an evaluation or a save to the stretch before the next step's begin: `training`
        said, the phase `loading_data` (said by the thread only once it lasts)."""
        self.enter(TRAINING)
        self._stretches += 1
        self.phase = LOADING_DATA

    def _keep(self, full: bool, state: Any = None) -> None:
        """Copy what moves (Boundary.keep), the Trainer's counters with it."""
        last = self.last
        if last is None:
            return
        trainer = self._trainer() if self._trainer is not None else None
        if state is None:
            state = getattr(trainer, "state", None)
        last.keep(full, state, trainer)
        self._begin_watch = True

    def counted(self, tokens: int) -> None:
        """The step end summed the ranks' tokens after the boundary was marked: a copy kept takes the sum."""
        last = self.last
        if last is not None and last.kept:
            last.tokens = tokens

    def step_begins(self) -> None:
        """A step begins, its batches fetched: its forward passes move the RNG from now on.

        callback.py's `on_step_begin` is this, inlined: in the common case (the phase
        `loading_data`, nothing kept or probed, nothing said by the thread) two stores. The phase
        is changed before `_quiet_said` is read (see _leave_quiet_phase)."""
        if self.phase == LOADING_DATA:
            self.phase = TRAINING
            if self._quiet_said or self._begin_watch:
                self.began(True)
            else:
                self.exact = False  # a stop waits for the step end, which saves the live state
        else:
            self.began(False)

    def began(self, left_loading: bool) -> None:
        """`step_begins()` past its common case (`left_loading`: it changed the phase from
        `loading_data` to `training`): the phase said, the fetch probed, or a boundary kept."""
        if left_loading and self._quiet_said:
            self._leave_quiet_phase(TRAINING)
        last = self.last
        if last is None:
            return
        if self._probing:  # what moved since the step end is the fetch's doing
            self._probing = False
            self.fetch_draws = last.torch_moved()
            self._keep_every = self._several or self.fetch_draws
        if not last.kept:
            self.exact = False  # a stop waits for the step end, which saves the live state

    def epoch_ends(self, state: Any = None) -> None:
        """An epoch ended: the next one's data loader draws its seed from torch's RNG before its first fetch."""
        self._probing = False
        last = self.last
        if last is not None and self.exact and not last.kept:
            self._keep(self.step_seconds >= FULL_RNG_STEP_SECONDS, state)

    def evaluation_begins(self) -> None:
        """An evaluation begins (at a boundary: nothing drew since): every RNG state is kept, numpy's
        and Python's too, so a stop between two of its batches is exact whatever the step's length."""
        self._probing = False
        self.enter(EVALUATING)
        last = self.last
        if last is not None and self.exact and not (last.kept and last.full):
            self._keep(True)

    def evaluation_ended(self, completed: bool) -> None:
        """An evaluation ended. A completed one moved the RNG (its DataLoader drew a seed), as it does
        before the Trainer's own save at this step: the state after it is the one to save from now
        on, kept again (an evaluation at an epoch's end is followed by the next epoch's seed)."""
        if completed and self.last is not None and self.exact:
            self._keep(self.step_seconds >= FULL_RNG_STEP_SECONDS)
        self._back_to_training()

    def saved(self, step: int | None) -> None:
        """The Trainer's checkpoint save ended: safe again if the state is still the boundary's (a save at `step`)."""
        self.safe = not self.taken and self.last is not None and self.last.step == step
        self._back_to_training()

    def unsafe(self) -> None:
        self.safe = False

    def enter(self, phase: str, **fields: Any) -> None:
        """A new phase; said in metrics.jsonl for `status` (evaluating, saving, after_train, training)."""
        if phase == self.phase:
            return
        if self.phase == LOADING_DATA:
            self._leave_quiet_phase(phase, False)
        self.phase = phase
        self._say(phase, **fields)

    def _say(self, phase: str, **fields: Any) -> None:
        if self.write_phase is not None:
            step = self.last.step if self.last is not None else None
            with contextlib.suppress(Exception):
                self.write_phase(phase, step, **fields)

    def _leave_quiet_phase(self, phase: str, say: bool = True) -> None:
        """Leave `loading_data` for `phase`; say `phase` (when `say`) only if the thread said `loading_data`.

        The thread claims `_quiet_said` before it looks at the phase, under the lock (_say_quiet_phase),
        so once the phase is changed either it sees that and says nothing, or this sees its claim and
        waits for its line to be written first."""
        self.phase = phase
        if not self._quiet_said:
            return
        with self._quiet_lock:
            if self._quiet_said:
                self._quiet_said = False
                if say:
                    self._say(phase)

    def passed(self) -> None:
        """The main thread is at one of its own safe points (a micro-batch's end, an evaluation batch's)."""
        self._passes += 1
        if self.reason is not None:
            self.check()

    def check(self, interrupted: bool = False) -> None:
        """At one of the main thread's own safe points (or `interrupted` in a stalled fetch): act on
        a request seen, if it is safe now.

        Inside a short training step (a boundary without numpy's and Python's RNG states) only an
        interruption acts: the step end, which is near, takes the stop with every state exact.
        Past a fetch that kept nothing (`exact` False) nothing acts: the step end takes it.
        Under torch.distributed the rank parks here until the ranks agree: it stops only where all do.
        """
        if self.reason is not None and self.safe and not self.taken and self.exact:
            last = self.last
            if not interrupted and self.phase == TRAINING and last is not None and not (last.kept and last.full):
                return
            if self.agreement is not None and not self.agreement.park(self.position):
                return
            self._raise()

    def take(self) -> None:
        """The request is being acted on elsewhere (a step end's snapshot): nothing more to do here."""
        self.taken = True
        self.safe = False

    def _raise(self) -> None:
        last = self.last
        if last is None or self.reason is None:
            return
        self.taken = True
        self.safe = False
        raise StopAtBoundary(self.reason, self.phase, last.step)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.check(interrupted=True)

    # --- the thread ---------------------------------------------------------------------------

    def watched(self, watch: RequestWatch | None) -> None:
        """The request's inotify watch (request_watch.RequestWatch) wakes the thread when it sees a
        request, so the thread looks only every WATCHED_POLL_SECONDS otherwise."""
        self.watch = watch
        if watch is not None:
            watch.on_raise = self._nudge.set

    def _watch(self) -> None:
        while True:
            self._nudge.wait(self._interval())
            # Cleared before the look: a request written after it wakes the next wait at once.
            self._nudge.clear()
            if self._closing:
                return
            try:
                self._turn(time.monotonic())
            except Exception as exc:  # the thread must never take the job down
                log_error(f"obd: the stop watch failed ({exc!r}); stops wait for the next step end")
                return

    def _interval(self) -> float:
        agreeing = self.agreement is not None and self.reason is not None and not self._verdict
        if agreeing:
            return PARKED_POLL_SECONDS
        watch = self.watch
        if self.reason is None and watch is not None and watch.alive:
            return WATCHED_POLL_SECONDS
        return POLL_SECONDS  # a request waiting for its grace, or nothing that wakes the thread

    def _say_quiet_phase(self, now: float) -> None:
        """Say `loading_data` once one fetch lasted long enough for `status` to show it (timed from
        the thread's first look at it: the main thread reads no clock for it)."""
        if self.phase != LOADING_DATA or self._quiet_said:
            return
        fetch = self.fetches
        if fetch != self._quiet_fetch:
            self._quiet_fetch, self._quiet_since = fetch, now
            return
        if now - self._quiet_since < QUIET_PHASE_SECONDS:
            return
        with self._quiet_lock:
            self._quiet_said = True  # claimed first: see _fetch_phase_ended
            if self.phase == LOADING_DATA and self.fetches == fetch:
                self._say(LOADING_DATA)
            else:
                self._quiet_said = False

    def _turn(self, now: float) -> None:
        self._say_quiet_phase(now)
        if self.taken and self.phase != AFTER_TRAIN:
            return
        if self.reason is None:
            self.reason = self._look()
            if self.reason is None:
                return
            self._seen_at = now
        if self.phase == AFTER_TRAIN:
            self._say_cut()
            return
        if self.agreement is not None:
            self._agree(self.agreement)
            return
        if not self.safe or now - self._seen_at < GRACE_SECONDS or now - self._signalled_at < GRACE_SECONDS:
            return
        self._signalled_at = now
        if self._handler_installed and self._main is not None:
            signal.pthread_kill(self._main, INTERRUPT_SIGNAL)  # type: ignore[arg-type]

    def _look(self) -> str | None:
        """The stop asked, if any: the request file (one process, rank 0), or what rank 0 posted."""
        agreement = self.agreement
        if agreement is not None and not self.is_zero:
            return agreement.posted_stop()
        reason = read_request(self.request_path)
        if reason is not None and agreement is not None:
            agreement.post_stop(reason)
        return reason

    def _agree(self, agreement: RankAgreement) -> None:
        """Say where this rank is; rank 0 also moves the target on or gives the verdict."""
        agreement.publish(self.position)
        if self.is_zero and not self._verdict:
            self._verdict = agreement.arbitrate()

    def _say_cut(self) -> None:
        """After train(): say once what the stop cuts short (the script's line and the call it is in)."""
        if self._cut_written:
            return
        self._cut_written = True
        where = _main_thread_place(self._main)
        log_error(f"obd: stop asked after training ended; the daemon ends the job, cutting short {where}")
        if self.write_phase is not None:
            step = self.last.step if self.last is not None else None
            with contextlib.suppress(Exception):
                self.write_phase(AFTER_TRAIN, step, cut=where, stop=self.reason)


def _main_thread_place(ident: int | None) -> str:
    """`train.py:88 in save_model`: the script's line the main thread is at, and the innermost call."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "the script's code after train()"
    innermost = frame.f_code.co_name
    script = None
    while frame is not None:
        if frame.f_globals.get("__name__") == "__main__":
            script = frame
            break
        frame = frame.f_back
    if script is None:
        return f"the script's code after train() (in {innermost})"
    place = f"{os.path.basename(script.f_code.co_filename)}:{script.f_lineno}"
    return place if innermost == script.f_code.co_name else f"{place} in {innermost}"
