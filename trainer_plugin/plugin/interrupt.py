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
- At each boundary it keeps what moves before the next one although it belongs to step N: the
  RNG states (torch's always, a microsecond or two; numpy's and Python's when a step takes longer
  than `FULL_RNG_STEP_SECONDS`, where their 10-100 µs cost nothing, and at an evaluation's
  start), the token and FLOP counts. Inside a shorter training step, whose end is near, a
  micro-batch end does not take a stop (numpy's or Python's RNG may have moved since the
  boundary): the step end does; only a fetch that stalls is interrupted there.
- A thread looks for the request every `POLL_SECONDS`. Once one is there and no safe point of the
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
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from .agreement import PARKED_POLL_SECONDS, RankAgreement
from .runtime import log_error, read_request

# How often the thread looks for a request (an access() each time; the GIL is released between).
POLL_SECONDS = 0.2
# How long a request may wait for a safe point of the main thread's own before it is interrupted.
GRACE_SECONDS = 0.8
# Steps at least this long keep numpy's and Python's RNG states at every boundary too.
FULL_RNG_STEP_SECONDS = 0.5
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


@dataclass
class Boundary:
    """What a checkpoint at the end of optimizer step `step` holds that moves before the next one."""

    step: int
    torch_rng: Any = None
    cuda_rng: Any = None
    numpy_rng: Any = None
    python_rng: Any = None
    counters: dict[str, Any] = field(default_factory=dict)
    at: float = 0.0  # time.monotonic() when it was taken
    full: bool = False  # numpy's and Python's RNG states were kept too (or neither was imported)

    @classmethod
    def take(cls, step: int, full: bool, counters: dict[str, Any]) -> Boundary:
        b = cls(step, counters=counters, at=time.monotonic())
        b.take_rng(FULL_RNG_STEP_SECONDS if full else 0.0)
        return b

    def take_rng(self, step_seconds: float) -> None:
        """Keep the RNG states as they are now: torch's always, numpy's and Python's for slow steps."""
        torch = sys.modules.get("torch")
        if torch is not None:
            self.torch_rng = torch.random.default_generator.get_state()
            self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        if step_seconds < FULL_RNG_STEP_SECONDS:
            self.numpy_rng = self.python_rng = None
            self.full = "numpy" not in sys.modules and "random" not in sys.modules
            return
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        random = sys.modules.get("random")
        self.python_rng = random.getstate() if random is not None else None
        self.full = True

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

    The main thread calls `boundary()` at each step end, `unsafe()` before an optimizer step or a
    save, `enter(phase)` as phases change, and `check()` at its own safe points (a micro-batch's
    end, an evaluation batch's). `taken` is set once the request is being acted on, by a step end
    or here, so it is acted on once.
    """

    def __init__(
        self,
        request_path: str | None,
        write_phase: Any = None,
        agreement: RankAgreement | None = None,
    ) -> None:
        self.request_path = request_path
        self.write_phase = write_phase  # callable(phase, step, **fields): a metrics line, or None
        # Under torch.distributed: where the ranks agree to stop (None: one process).
        self.agreement = agreement
        self.is_zero = agreement is None or agreement.rank == 0
        # Positions passed (step ends, micro-batch ends, evaluation batch ends): the ranks' common count.
        self.position = 0
        self._verdict = False
        # A phase too frequent to write at each change (loading data: every step), said by the
        # thread only once it lasted QUIET_PHASE_SECONDS: when it began, and whether it was said.
        self._quiet_lock = threading.Lock()
        self._quiet_since: float | None = None
        self._quiet_said = False
        self.phase = TRAINING
        self.safe = False
        self.taken = False
        self.reason: str | None = None
        self.last: Boundary | None = None
        self.step_seconds = 0.0
        self._seen_at = 0.0
        self._signalled_at = 0.0
        self._main = threading.main_thread().ident
        self._previous_handler: Any = None
        self._handler_installed = False
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._cut_written = False

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
        self._closing.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        if self._handler_installed and threading.current_thread() is threading.main_thread():
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler or signal.SIG_DFL)  # type: ignore[arg-type]
            self._handler_installed = False

    # --- the main thread's marks -------------------------------------------------------------

    def boundary(self, step: int, counters: dict[str, Any]) -> None:
        """Optimizer step `step` ended: its state is the one to save from now until the next one."""
        now = time.monotonic()
        self.position += 1
        last = self.last
        if last is None:  # one Boundary a training, updated in place: no object made a step
            last = self.last = Boundary(step)
        else:
            self.step_seconds = now - last.at
        last.step, last.counters, last.at = step, counters, now
        last.take_rng(self.step_seconds)
        if self.phase != TRAINING:
            self.enter(TRAINING)
        self.safe = not self.taken

    def unsafe(self) -> None:
        self.safe = False

    def enter(self, phase: str, **fields: Any) -> None:
        """A new phase; said in metrics.jsonl for `status` (evaluating, saving, after_train, training)."""
        if phase == self.phase:
            return
        self.phase = phase
        if self.write_phase is not None:
            step = self.last.step if self.last is not None else None
            with contextlib.suppress(Exception):
                self.write_phase(phase, step, **fields)

    def loading(self, begun: bool) -> None:
        """The main thread fetches the next batches (begun) or has them: `loading_data` while it lasts long."""
        if begun:
            if self.phase == TRAINING:
                self.phase, self._quiet_since = LOADING_DATA, time.monotonic()
            return
        if self.phase != LOADING_DATA:
            return
        with self._quiet_lock:
            said, self._quiet_said, self._quiet_since = self._quiet_said, False, None
            if said:
                self.enter(TRAINING)
            else:
                self.phase = TRAINING

    def passed(self) -> None:
        """The main thread is at one of its own safe points (a micro-batch's end, an evaluation batch's)."""
        self.position += 1
        if self.reason is not None:
            self.check()

    def check(self, interrupted: bool = False) -> None:
        """At one of the main thread's own safe points (or `interrupted` in a stalled fetch): act on
        a request seen, if it is safe now.

        Inside a short training step (a boundary without numpy's and Python's RNG states) only an
        interruption acts: the step end, which is near, takes the stop with every state exact.
        Under torch.distributed the rank parks here until the ranks agree: it stops only where all do.
        """
        if self.reason is not None and self.safe and not self.taken:
            last = self.last
            if not interrupted and self.phase == TRAINING and last is not None and not last.full:
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

    def _watch(self) -> None:
        while not self._closing.wait(self._interval()):
            try:
                self._turn(time.monotonic())
            except Exception as exc:  # the thread must never take the job down
                log_error(f"obd: the stop watch failed ({exc!r}); stops wait for the next step end")
                return

    def _interval(self) -> float:
        agreeing = self.agreement is not None and self.reason is not None and not self._verdict
        return PARKED_POLL_SECONDS if agreeing else POLL_SECONDS

    def _say_quiet_phase(self, now: float) -> None:
        """Say `loading_data` once the fetch lasted long enough for `status` to show it."""
        since = self._quiet_since
        if since is None or self._quiet_said or now - since < QUIET_PHASE_SECONDS:
            return
        with self._quiet_lock:
            if self.phase == LOADING_DATA and not self._quiet_said and self.write_phase is not None:
                self._quiet_said = True
                step = self.last.step if self.last is not None else None
                with contextlib.suppress(Exception):
                    self.write_phase(LOADING_DATA, step)

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
