"""SnapshotCallback: the Trainer side of obd's snapshot contract (request → save at this step → proof → stop).

At every step end it looks for `snapshot.request`: a flag that a thread raises when inotify sees
the name written (request_watch.py), with one access() at least every tenth of a second (at
every step end where there is no inotify); on a request it makes the Trainer save `output/checkpoint-<step>` and stop, and once the checkpoint is on disk rank 0
writes `snapshot.json`. It also writes `metrics.jsonl`. Outside obd every hook returns at once.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import weakref
from typing import Any

from transformers import TrainerCallback

from ..rundir import PREEMPTED, checkpoint_name, checkpoint_relpath
from . import trainer_args
from .agreement import RankAgreement
from .dist import Ranks, tear_down_at_exit
from .interrupt import (
    AFTER_TRAIN,
    EVALUATING,
    INTERRUPTED_MARKER,
    KEEP_RNG_STEP_SECONDS,
    LOADING_DATA,
    PROBE_EVERY_STEPS,
    SAVING,
    TRAINING,
    StopAtBoundary,
    StopPoints,
)
from .metrics_file import MetricsWriter
from .request_watch import REQUEST_RECHECK_SECONDS, RequestWatch
from .runtime import (
    SNAPSHOT_ATTRIBUTE,
    VERSION,
    IncompleteCheckpoint,
    RunEnv,
    SigtermFlag,
    StoppedForSnapshot,
    log_error,
    note_snapshot,
    read_request,
    reason_code,
    reason_from_code,
    write_proof,
    write_request,
)
from .trackers import tracker_ids

# The Trainer writes trainer_state.json last in _save_checkpoint: its presence marks a
# checkpoint the Trainer can resume from.
REQUIRED_FILES = ("trainer_state.json",)

# Set once this process has written its proof. A script that goes on training (a second
# stage, a second Trainer) must not overwrite that proof with another checkpoint: the
# request still stands, so every later training stops after its first step, unsaved. A
# resumed run re-runs the script from the proven checkpoint and reaches the later stages.
# (By default the job ends when the training that wrote the proof returns, see inject.py; a
# later training happens only in a script that opted out, or that caught the SystemExit.)
_process_snapshot: StoppedForSnapshot | None = None

# The stop points of a training that ended (not for a snapshot): they watch the script's code
# after train() until the next training begins or the process ends.
_after_train: StopPoints | None = None

# Bound once: the step end with no request is at most these two calls and nothing else.
_access = os.access
_EXISTS = os.F_OK
_monotonic = time.monotonic


class SnapshotCallback(TrainerCallback):
    """Adds obd snapshots and metrics to a transformers Trainer; inert outside obd (no OBD_RUN_DIR).

    obd's sitecustomize adds one to every Trainer; passing one yourself
    (`Trainer(..., callbacks=[SnapshotCallback()])`) is fine: a Trainer keeps only one.
    """

    obd_snapshot_callback = True  # how inject recognises any copy of this class

    def __init__(self, env: RunEnv | None = None, *, auto: bool = False) -> None:
        self.env = env if env is not None else RunEnv.from_environ()
        self.auto = auto  # True when injected by obd rather than added by the script
        self._ranks = Ranks()
        self._metrics = MetricsWriter(None)
        self._sigterm = SigtermFlag()
        self._hook: Any = None  # how tokens are counted: a forward pre-hook's handle, or an _InstanceMethod
        # The Trainer that runs this callback (a weak reference), set by obd's patched Trainer.train.
        self.trainer: weakref.ref[Any] | None = None
        self._count_tokens = False
        self._local_tokens = 0  # counted by the forward pre-hook since the last step end (distributed)
        self._token_state: Any = None  # the TrainerState the pre-hook adds to directly (one process)
        # The request's name while a step end with no request may be quick (one process, no
        # profiler, no SIGTERM or proof yet in this training); None: every step end takes the
        # full path.
        self._quick_request: str | None = None
        # The run directory, open: the quick check looks up one name in it, not the whole path.
        self._run_dir_fd: int | None = None
        # While the quick step end is the watch's flag (inotify), not a lookup; _watcher is the
        # same watch, kept to be closed after the quick path is left.
        self._quick_watch: RequestWatch | None = None
        # Where a stop is taken between two step ends (interrupt.py; agreement.py under torch.distributed).
        self._points: StopPoints | None = None
        # The sooner of the heartbeat and the write of step logs that wait: one comparison a step.
        # (What a step's hooks read is made together, so it lies together in the instance's values.)
        self._due = math.inf
        self._watcher: RequestWatch | None = None
        self._recheck_due = math.inf  # when a step end with a watch next looks the name up
        self._pending: tuple[int, str] | None = None  # (step, reason) of a snapshot under way
        self._proven = False
        # This training began after the process's snapshot: it stops after one step, and its
        # state gets that snapshot's marker.
        self._after_snapshot = False
        self._profiler: Any = None
        self._progress_interval = self.env.progress_interval
        # time.monotonic() from which a heartbeat is due: progress_interval after the last `log` line.
        self._heartbeat_due = math.inf
        self._heartbeats = True
        # time.monotonic() when the Trainer's checkpoint save under way began (set by inject's
        # wrapper of Trainer._save_checkpoint); its `on_save` writes the save's duration.
        self.save_began: float | None = None

    # --- lifecycle ----------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.env.active:
            trainer_args.redirect_output_dir(args, self.env)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.env.active:
            return
        trainer_args.redirect_output_dir(args, self.env)  # in case the script changed it after __init__
        self._ranks = Ranks()
        self._metrics.close()
        self._metrics = MetricsWriter(self.env.metrics_path if self._ranks.is_zero else None)
        self._pending, self._proven, self._local_tokens = None, False, 0
        self._after_snapshot = _process_snapshot is not None
        self._progress_interval = self.env.progress_interval
        self._heartbeat_due, self._heartbeats = time.monotonic() + self._progress_interval, True
        self._due = self._heartbeat_due
        if _process_snapshot is not None:
            log_error(
                f"obd: this job already saved its snapshot ({checkpoint_relpath(_process_snapshot.step)}); "
                "training stops after one step"
            )
        self._start_token_count(args, model)
        # One process: the pre-hook counts straight into the state (no collective to sum ranks).
        self._token_state = state if self._count_tokens and not self._ranks.distributed else None
        self._start_profiler(model)
        self._metrics.write(
            "begin",
            max_steps=state.max_steps,
            snapshots=True,
            version=VERSION,
            run_id=self.env.run_id,
            output_dir_requested=trainer_args.requested_output_dir(args),
            output_dir=args.output_dir,
            start_step=state.global_step,
            resume_from=self.env.resume_from,
            world_size=self._ranks.world_size,
            tokens=state.num_input_tokens_seen,
            snapshot_on_sigterm=self.env.snapshot_on_sigterm,
            **parameter_counts(model),
            **tracker_ids(),  # the runs the Trainer's trackers opened: the daemon hands MLflow's on
        )
        # After the begin line: the watch's thread does not wake for metrics.jsonl being made.
        quick = not self._ranks.distributed and self._profiler is None and _process_snapshot is None
        self._quick_request = self._open_quick_check() if quick else None
        if self.env.snapshot_on_sigterm:  # after the quick check is set: a SIGTERM from now on leaves it
            self._sigterm.install(on_signal=self._leave_quick_path)
        self._start_points(args, state)
        self._redo_interrupted_evaluation()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.env.active:
            return
        snapshot = self._pending is not None and self._proven
        self._metrics.write(
            "end",
            step=state.global_step,
            max_steps=state.max_steps,
            tokens=state.num_input_tokens_seen,
            snapshot=checkpoint_relpath(self._pending[0]) if snapshot and self._pending else None,
            reason=self._pending[1] if self._pending else None,
        )
        self._metrics.close()
        self._quick_request, self._token_state = None, None
        self._close_quick_check()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
            self.__dict__.pop("on_step_begin", None)  # the class's again
        self._sigterm.restore()
        self._end_points(state)
        if self._pending is not None and not self._proven:
            # Training stopped for a snapshot that was never saved: exiting 0 would read as
            # "succeeded", so fail loudly instead.
            raise RuntimeError(
                f"obd: training stopped for a snapshot at step {self._pending[0]} but no checkpoint was saved"
            )
        # The marker obd's patched train() reads to end the job (or that the script reads, when
        # it opted out): this training's own snapshot, or the one that cut a later training short.
        marker = _process_snapshot if self._proven or self._after_snapshot else None
        if marker is not None:
            setattr(state, SNAPSHOT_ATTRIBUTE, marker)
        tear_down_at_exit(self._ranks)

    # --- the request --------------------------------------------------------------------

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The step's batches are fetched: its forward passes may move the RNG. StopPoints.step_begins,
        # inlined for its common case (two stores; the phase first, see its docstring).
        points = self._points
        if points is not None:
            if points.phase == LOADING_DATA:
                points.phase = TRAINING
                if points._quiet_said or points._begin_watch:
                    points.began(True)
                else:
                    points.exact = False
            else:
                points.began(False)

    def _profiled_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """`on_step_begin` while a profiler runs (an instance attribute over the class's, for this training only)."""
        SnapshotCallback.on_step_begin(self, args, state, control, **kwargs)
        if self._profiler is not None:
            self._profiler.step_begin(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Almost every step end is one of the two quick checks and one clock read that says
        # nothing is due (the recheck of the name, step logs to write, a heartbeat). With one
        # process there is no decision to share and the token count goes straight into the
        # state; a SIGTERM or a proof leaves the quick path.
        now = _monotonic()
        points = self._points
        if points is not None:  # the state of this step is what a stop before the next one saves
            # StopPoints.boundary, inlined for its common case (keep the two alike): a short step
            # after its begin, nothing to keep, no probe due, no request: a few stores.
            steps = points.steps = points.steps + 1
            seconds = points.step_seconds = now - points._boundary_at
            points._boundary_at = now
            last = points.last
            if (
                last is None
                or points.phase != TRAINING
                or points.reason is not None
                or points._keep_every
                or seconds >= KEEP_RNG_STEP_SECONDS
                or steps % PROBE_EVERY_STEPS == 1
            ):
                points._boundary(state.global_step, seconds, state)
            else:
                last.step = state.global_step
                last.kept = False
                points.exact = True
                points._begin_watch = False
                points.phase = LOADING_DATA
                points.safe = not points.taken
        watch = self._quick_watch
        if watch is not None:
            if not watch.seen:  # no system call: inotify saw nothing named like the request
                if now < self._due:
                    return
                if not self._recheck_finds_request():
                    self._on_time(state, control)
                    return
            watch.seen = False  # before the look: a request written after it raises the flag again
            if not watch.alive:  # the queue stopped vouching: a lookup at every step end
                self._quick_watch, self._recheck_due = None, math.inf
        else:
            quick = self._quick_request
            if quick is not None and not _access(quick, _EXISTS, dir_fd=self._run_dir_fd):
                if now >= self._due:
                    self._on_time(state, control)
                return
        self._step_end(state, control)

    def _open_quick_check(self) -> str | None:
        """The request's name in the run directory, now open and watched; None (the full path every step) if it cannot be opened."""
        self._close_quick_check()
        if not self.env.request_path:
            return None
        folder, name = os.path.split(self.env.request_path)
        try:
            self._run_dir_fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            return None
        self._watcher = self._quick_watch = RequestWatch.start(self.env.request_path)
        if self._watcher is not None:
            self._recheck_due = _monotonic() + REQUEST_RECHECK_SECONDS
            self._due = min(self._due, self._recheck_due)
        return name

    def _close_quick_check(self) -> None:
        self._leave_quick_path()
        fd, self._run_dir_fd = self._run_dir_fd, None
        if fd is not None:
            os.close(fd)
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.close()

    def _leave_quick_path(self) -> None:
        """From the SIGTERM handler, or once proven: every later step end takes the full path."""
        self._quick_request = None
        self._quick_watch = None
        self._recheck_due = math.inf

    def _step_end(self, state: Any, control: Any) -> None:
        """A step end that may stop training: a request or a SIGTERM is there, or other ranks or a profiler are."""
        if not self.env.active:
            return
        if self._profiler is not None:
            self._profiler.step_end(state.global_step)
        if _process_snapshot is not None:
            control.should_training_stop = True
            return
        # Rank 0 alone looks at the file (the run directory is on its node).
        reason = read_request(self.env.request_path) if self._ranks.is_zero else None
        preempted = self._sigterm.consume()
        tokens, self._local_tokens = self._local_tokens, 0
        # Under torch.distributed this is one all-reduce every step, on every rank, request or
        # not: only rank 0 sees the file and any rank may get a SIGTERM, so no rank can know
        # without it whether to stop at this step (see dist.py).
        decision = self._ranks.decide(reason_code(reason), preempted, tokens)
        if self._count_tokens and self._token_state is None:
            state.num_input_tokens_seen += decision.tokens
            points = self._points
            if points is not None:  # the boundary's count is the one with this step's tokens, summed just now
                points.counted(state.num_input_tokens_seen)
        if decision.code != 0 or decision.preempted:
            self._arm_snapshot(state, control, decision.code, preempted)
        if _monotonic() >= self._due:
            self._on_time(state, control)

    def _arm_snapshot(self, state: Any, control: Any, code: int, preempted: bool) -> None:
        """A request or a SIGTERM reached this step end: make the Trainer save now and stop."""
        if state.global_step >= state.max_steps:
            # A request at the last step lets the run end as usual (no proof); a SIGTERM
            # stays pending and keeps its usual meaning once training is over.
            if preempted:
                self._sigterm.pending = True
            return
        if self._pending is not None:
            return
        reason = reason_from_code(code) or PREEMPTED
        if code == 0 and self._ranks.is_zero:
            write_request(self.env, PREEMPTED)  # so the daemon sees the preemption too
        self._pending = (state.global_step, reason)
        if self._points is not None:
            self._points.take()
        control.should_log = True  # the last log line is then the snapshot's step
        control.should_save = True
        control.should_training_stop = True

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # A save asked for at the step end can be cancelled when an evaluation in the same
        # step decides it (save_strategy="best"); the epoch-end save of the same step is the
        # second chance, before training ends.
        if self.env.active and self._pending is not None and not self._proven:
            control.should_save = True
        points = self._points
        if points is not None and state.global_step < state.max_steps:  # the last epoch's end: no seed follows
            points.epoch_ends(state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.env.active:
            return
        self._report_save(state)
        self._save_is_snapshot(state, control)
        if self._pending is None or self._proven:
            return
        step, reason = self._pending
        if state.global_step != step:
            return
        self._ranks.barrier()  # every rank has written its share of the checkpoint (rng state, shards)
        written = False
        try:
            if self._ranks.is_zero:
                self._check_output_dir(args)
                self._metrics.flush(_monotonic())  # the snapshot step's log line is in the file before its proof
                proof = write_proof(self.env, step, reason, required=REQUIRED_FILES)
                log_error(f"obd: snapshot at step {step} ({reason}): {proof['checkpoint']}")
            written = True
        finally:
            # Every rank waits for rank 0's word (also when it failed), so "proven" means the
            # same on all of them: no rank ends the job at its train() end without a proof on disk.
            written = self._ranks.zero_says(written)
        if not written:  # a rank > 0 whose rank 0 failed: the job fails on every rank
            raise IncompleteCheckpoint(f"obd: rank 0 wrote no snapshot proof for step {step} (see its log)")
        self._proven = True
        self._leave_quick_path()
        global _process_snapshot
        checkpoint = os.path.join(str(self.env.output_dir), checkpoint_name(step))
        _process_snapshot = note_snapshot(StoppedForSnapshot(step, state.max_steps, reason, checkpoint))

    def _report_save(self, state: Any) -> None:
        """Rank 0: a `save` line with how long the Trainer's checkpoint save just took (from the start
        of its `_save_checkpoint` to this `on_save`), periodic or a snapshot's; the daemon learns a
        limit's lead from it (docs/limits.md). Nothing when the start was not seen."""
        began, self.save_began = self.save_began, None
        if began is None or self._metrics.path is None:
            return
        pending = self._pending
        self._metrics.write(
            "save",
            step=state.global_step,
            seconds=round(max(0.0, _monotonic() - began), 3),
            checkpoint=checkpoint_relpath(state.global_step),
            snapshot=pending is not None and not self._proven and pending[0] == state.global_step,
        )

    def _check_output_dir(self, args: Any) -> None:
        actual = os.path.realpath(str(args.output_dir))
        expected = os.path.realpath(str(self.env.output_dir))
        if actual != expected:
            raise IncompleteCheckpoint(
                f"obd: the Trainer saved to {actual}, not the run's {expected}; no snapshot proof written"
            )

    # --- stop anywhere (interrupt.py) ------------------------------------------------------

    def _start_points(self, args: Any, state: Any) -> None:
        """Where a stop between two step ends is taken: one process, and not after this process's snapshot."""
        global _after_train
        if _after_train is not None:
            _after_train.close()
            _after_train = None
        if self._points is not None:
            self._points.close()
        self._points = None
        if _process_snapshot is not None or not self.env.request_path:
            return
        agreement = None
        if self._ranks.distributed:
            agreement = RankAgreement.for_job(self._ranks.rank, self._ranks.world_size)
            if agreement is None:  # no store to agree through: a request waits for the next step end
                return
        write_phase = self._write_phase if self._ranks.is_zero else None
        points = StopPoints(self.env.request_path, write_phase, agreement, self.trainer)
        points.several = (getattr(args, "gradient_accumulation_steps", 1) or 1) > 1
        points.watched(self._watcher)
        self._points = points.start()

    def _end_points(self, state: Any) -> None:
        """Training ended: after a full training the points watch the script's code after train()."""
        global _after_train
        points, self._points = self._points, None
        if points is None:
            return
        if self._pending is not None or state.global_step < state.max_steps or not self._ranks.is_zero:
            points.close()
            return
        points.take()
        points.taken = False  # after training a request is still said (interrupt.StopPoints._say_cut)
        # No line of its own: the `end` line says training ended (the daemon's "after training"),
        # and metrics.jsonl ends with it unless a stop comes (its `after_train` line then).
        points.phase = AFTER_TRAIN
        if read_request(self.env.request_path) is not None:
            points.close()  # a request at the last step lets the run end as usual: nothing to cut
            return
        _after_train = points

    def _write_phase(self, phase: str, step: int | None, **fields: Any) -> None:
        self._metrics.write("phase", phase=phase, step=step, **fields)

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        points = self._points
        if points is not None:  # a count and one attribute read a micro-batch
            points.passed()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        points = self._points
        if points is not None:
            points.passed()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        points = self._points
        if points is not None:  # the optimizer step is never interrupted
            points.safe = False

    def evaluating(self, begun: bool, completed: bool = False) -> None:
        """From inject's wrapper of Trainer.evaluate: an evaluation begins (True) or ended (False);
        StopPoints.evaluation_begins/evaluation_ended say what is kept."""
        points = self._points
        if points is None:
            return
        if begun:
            points.evaluation_begins()
        else:
            points.evaluation_ended(completed)

    def saving(self, begun: bool, step: int | None = None) -> None:
        """From inject's wrapper of Trainer._save_checkpoint: a save is never interrupted; after it,
        the state is still the boundary's (a save at step `step`)."""
        points = self._points
        if points is None:
            return
        if begun:
            points.unsafe()
            points.enter(SAVING)
        else:
            points.saved(step)

    def _save_is_snapshot(self, state: Any, control: Any) -> None:
        """A save the Trainer made while a request waited: that save, once complete, is the snapshot."""
        if self._pending is not None or self._proven or _process_snapshot is not None:
            return
        if state.global_step >= state.max_steps or self._ranks.distributed:
            # Under torch.distributed the ranks learn of a request at different times: one that
            # ends training after this save while another goes on would leave it in a collective.
            return
        points = self._points
        reason = points.reason if points is not None else None
        if reason is None and self._ranks.is_zero and not self._ranks.distributed:
            reason = read_request(self.env.request_path)
        if reason is None:
            return
        self._pending = (state.global_step, reason)
        if points is not None:
            points.take()
        control.should_training_stop = True

    def snapshot_at_boundary(self, trainer: Any, stop: StopAtBoundary) -> None:
        """The main thread was stopped at a safe point: save the last boundary's state as the snapshot, prove it, end training.

        The model, optimizer and scheduler are still that step's (no optimizer step since); what
        moved is put back (Boundary.restore): the RNG states and the counters, the FLOPs of the
        abandoned micro-batches dropped. The Trainer's own `_save_checkpoint` then writes the usual
        checkpoint, which a resume takes as it takes any other.
        """
        points = self._points
        boundary = points.last if points is not None else None
        state = trainer.state
        if boundary is None or boundary.step != state.global_step:
            raise RuntimeError(f"obd: a stop at step {stop.step} found the training at step {state.global_step}")
        boundary.restore(state, trainer)
        self._pending = (state.global_step, stop.reason)
        self.saving(True)
        trainer._save_checkpoint(trainer.model, trial=None)
        self._mark_interrupted(state.global_step, stop)
        self.on_save(trainer.args, state, trainer.control)
        log_error(f"obd: the stop came during {stop.phase}; the snapshot is the state at the end of step {stop.step}")
        self.on_train_end(trainer.args, state, trainer.control)

    def _mark_interrupted(self, step: int, stop: StopAtBoundary) -> None:
        """Say in the checkpoint what the stop cut short: a resumed run performs an interrupted evaluation first."""
        if not self._ranks.is_zero:
            return
        path = os.path.join(str(self.env.output_dir), checkpoint_name(step), INTERRUPTED_MARKER)
        with open(path, "w") as f:
            json.dump({"phase": stop.phase, "step": step, "reason": stop.reason}, f)

    def _redo_interrupted_evaluation(self) -> None:
        """A run resumed from a snapshot taken during an evaluation performs that evaluation first, at the same step."""
        source = self.env.resume_from
        trainer = self.trainer() if self.trainer is not None else None
        if not source or trainer is None or not trainer_args.resumed_from_obd():
            return
        try:
            with open(os.path.join(source, INTERRUPTED_MARKER)) as f:
                marker = json.load(f)
        except (OSError, ValueError):
            return
        if not isinstance(marker, dict) or marker.get("phase") != EVALUATING:
            return
        if getattr(trainer, "eval_dataset", None) is None:
            return
        # At the first step begin, not now: the Trainer puts the checkpoint's RNG state back just
        # before it, and an evaluation draws from that RNG (each DataLoader iterator takes a seed),
        # so the step after it sees the RNG an uninterrupted run's step saw.
        previous = self.__dict__.get("on_step_begin")

        def redo_first(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if previous is not None:
                self.__dict__["on_step_begin"] = previous
            else:
                self.__dict__.pop("on_step_begin", None)
            log_error(f"obd: the snapshot cut short the evaluation at step {marker.get('step')}; performing it first")
            trainer.evaluate()
            (previous or functools.partial(SnapshotCallback.on_step_begin, self))(args, state, control, **kwargs)

        self.__dict__["on_step_begin"] = redo_first

    # --- metrics ------------------------------------------------------------------------

    def _recheck_finds_request(self) -> bool:
        """With a watch, at or past `_recheck_due`: one lookup of the name, for writers inotify does not see.

        Those are another client of a network filesystem and a writer that keeps the file open;
        when steps take longer than REQUEST_RECHECK_SECONDS this is every step end, as without
        a watch.
        """
        now = _monotonic()
        if now < self._recheck_due or self._quick_request is None:
            return False
        self._recheck_due = now + REQUEST_RECHECK_SECONDS
        self._due = self._next_due()
        return _access(self._quick_request, _EXISTS, dir_fd=self._run_dir_fd)

    def _on_time(self, state: Any, control: Any) -> None:
        """A step end at or past `_due`: write the step logs that wait, and a heartbeat if one is due."""
        now = _monotonic()
        if now >= self._metrics.write_due():
            self._metrics.flush(now)
        self._heartbeat(state, control, now)
        self._due = self._next_due()

    def _next_due(self) -> float:
        return min(self._heartbeat_due, self._metrics.write_due(), self._recheck_due)

    def _heartbeat(self, state: Any, control: Any, now: float) -> None:
        """Rank 0: a `log` line without `loss` when no `log` line came for `progress_interval` seconds.

        It keeps the daemon's step and ETA fresh between Trainer logs (`logging_steps` is 500 by
        default). One monotonic-clock comparison per step; nothing when the Trainer is about to
        log this step anyway (`should_log`: its line, with the loss, follows at once). Never
        raises into training: a failure is said once in the job log and heartbeats stop.
        """
        if not self._heartbeats or not self._metrics.path:
            self._heartbeat_due = math.inf  # none will come (rank > 0, metrics given up): no step end waits for one
            return
        if now < self._heartbeat_due or control.should_log:
            return
        try:
            self._metrics.write(
                "log", step=state.global_step, epoch=state.epoch, tokens=state.num_input_tokens_seen, heartbeat=True
            )
            self._heartbeat_due = now + self._progress_interval
        except Exception as exc:
            self._heartbeats = False
            log_error(f"obd: progress heartbeat failed ({exc!r}); no more heartbeat lines from this job")

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        metrics = self._metrics
        if metrics.path is None:  # outside obd, rank > 0, or metrics given up after a write failed
            return
        # Training-step logs (they carry "loss") are "log" lines, the daemon's progress source.
        # Evaluation results and the end-of-training summary are "metrics" lines, so they never
        # replace the last training loss with a null.
        if logs and "loss" in logs:
            # Kept as it is (a copy: later callbacks may change the dict) and made a line when
            # written; the Trainer's keys land in the slots laid out first (step_log_lines).
            now = _monotonic()
            due = metrics.write_soon(now, state.global_step, state.num_input_tokens_seen, logs.copy())
            self._heartbeat_due = now + self._progress_interval  # later than before: _due may stay early
            self._due = min(self._due, due)
            return
        fields = {"step": state.global_step, "tokens": state.num_input_tokens_seen}
        if logs:
            fields.update(logs)
        metrics.write_record("metrics", fields)

    def _start_token_count(self, args: Any, model: Any) -> None:
        """Count input tokens unless the Trainer already does: in the Trainer's own call per micro-batch where it has one, else with a forward pre-hook.

        The Trainer's own count (include_num_input_tokens_seen) gathers across ranks on every
        micro-batch. With that count off, the Trainer's loop still calls its
        `_track_num_input_tokens(inputs)` once per training micro-batch, which then does
        nothing: where the class has the stock one, this Trainer's call counts for obd instead
        (no hook on the model, no extra call). Other Trainers (older transformers, a subclass
        with its own) get a forward pre-hook on the model. Both read only tensor shapes (no
        device sync); under torch.distributed the per-step collective that carries the snapshot
        decision sums the ranks. Padding counts, like the Trainer's "all" mode. The total lives
        in state.num_input_tokens_seen, so a checkpoint carries it and a resumed run continues it.
        """
        self._count_tokens = getattr(args, "include_num_input_tokens_seen", "no") in ("no", False, None)
        if not self._count_tokens or self._hook is not None:
            return
        trainer = self.trainer() if self.trainer is not None else None
        if trainer is not None and _stock_token_tracker(trainer):
            self._hook = _InstanceMethod(trainer, "_track_num_input_tokens", self._count_inputs)
            return
        register = getattr(model, "register_forward_pre_hook", None)
        if register is not None:
            self._hook = register(self._count_forward, with_kwargs=True)

    def _start_profiler(self, model: Any) -> None:
        """With OBD_TORCH_PROFILE=1, time every step and profile a few with torch_profile.StepProfiler."""
        if self._profiler is not None or not (self.env.torch_profile and self.env.profile_dir):
            return
        try:
            from .torch_profile import StepProfiler
        except ImportError as exc:  # profiling is optional; training goes on without it
            log_error(f"obd: torch profiling unavailable ({exc})")
            return
        self._profiler = StepProfiler(self.env.profile_dir)
        self.__dict__["on_step_begin"] = self._profiled_step_begin  # an instance hook, for this training only
        if model is not None:
            self._profiler.note_model(model)

    def _count_inputs(self, inputs: Any) -> None:
        """The Trainer's `_track_num_input_tokens` while its own count is off: one training micro-batch's tokens."""
        try:
            count = int(inputs["input_ids"].numel())
        except (KeyError, TypeError, AttributeError, IndexError):  # no input_ids: the embeddings' positions
            count = _positions(inputs.get("inputs_embeds") if hasattr(inputs, "get") else None)
        if self._token_state is not None:
            self._token_state.num_input_tokens_seen += count
        else:
            self._local_tokens += count

    def _count_forward(self, module: Any, args: tuple, kwargs: dict) -> None:
        """The forward pre-hook, for Trainers without the stock per-micro-batch call."""
        if not module.training:
            return  # evaluation batches are not training tokens
        ids: Any = kwargs.get("input_ids")
        if ids is None and args:
            ids = args[0]
        try:
            count = int(ids.numel())
        except AttributeError:  # no input_ids: count the embeddings' positions instead
            count = _positions(kwargs.get("inputs_embeds"))
        if self._token_state is not None:
            self._token_state.num_input_tokens_seen += count
        else:
            self._local_tokens += count


def _positions(embeds: Any) -> int:
    """The token positions of an `inputs_embeds` tensor (all but its last dimension); 0 for anything else."""
    shape = getattr(embeds, "shape", None)
    if shape is None or len(shape) < 2:
        return 0
    return int(embeds.numel() // shape[-1])


def _stock_token_tracker(trainer: Any) -> bool:
    """Whether this Trainer's class calls transformers' own `_track_num_input_tokens` once per micro-batch."""
    from transformers import Trainer

    stock = getattr(Trainer, "_track_num_input_tokens", None)
    return stock is not None and getattr(type(trainer), "_track_num_input_tokens", None) is stock


class _InstanceMethod:
    """`function` set as `name` on one object, over its class's method, until `remove()`: the handle of the in-loop token count."""

    def __init__(self, target: Any, name: str, function: Any) -> None:
        self._target, self._name = target, name
        setattr(target, name, function)

    def remove(self) -> None:
        vars(self._target).pop(self._name, None)


def parameter_counts(model: Any) -> dict[str, int | None]:
    """`model_params` and `trainable_params` of the model (what MFU needs); None when unknown.

    One pass over `model.parameters()` summing `numel()`, at train begin only. A parameter
    partitioned by DeepSpeed ZeRO-3 counts its full size (`ds_numel`), as the Trainer counts it.
    Never raises into training.
    """
    if model is None:
        return {"model_params": None, "trainable_params": None}
    try:
        total = trainable = 0
        for p in model.parameters():
            n = getattr(p, "ds_numel", None)
            n = int(n) if isinstance(n, int) and n > 0 else int(p.numel())
            total += n
            if getattr(p, "requires_grad", False):
                trainable += n
    except Exception as exc:
        log_error(f"obd: model parameters not counted ({type(exc).__name__}: {exc}); MFU will need them from elsewhere")
        return {"model_params": None, "trainable_params": None}
    if total <= 0:
        return {"model_params": None, "trainable_params": None}
    return {"model_params": total, "trainable_params": trainable}
