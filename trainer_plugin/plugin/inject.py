"""Zero-change injection: patches `transformers.Trainer` so every Trainer (and subclass) runs SnapshotCallback.

`install()` never imports transformers itself: if `transformers.trainer` is not imported yet,
it puts an import hook on `sys.meta_path` that patches the class the moment the module
finishes loading, so a job that never trains (or trains without transformers) pays nothing.
Standard library only at import time.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, NoReturn

from . import trainer_args
from .dist import Ranks
from .interrupt import StopAtBoundary
from .runtime import SNAPSHOT_RETURNS, RunEnv, log_error, stopped_for_snapshot
from .trackers import continue_in_args

TARGET = "transformers.trainer"
MARKER = "_obd_patched"  # set on the patched functions, so patching twice is a no-op
CALLBACK_MARKER = "obd_snapshot_callback"  # class attribute of SnapshotCallback, whichever copy defines it

_snapshot_exit = False  # train() ended the job for a snapshot: the interpreter's teardown is skipped


def _skip_teardown() -> None:
    """The last atexit handler (registered before any other): once a snapshot's SystemExit(0) has
    run every other handler (the gloo teardown, a tracker's) and the `finally` clauses, the job
    ends, without the teardown of every module's objects, which in a process holding torch and
    a model takes a second or more while its GPU stays held (a preemption waits on it)."""
    if _snapshot_exit:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(0)


def _not_ours(*args: Any) -> None:
    """The job went on to end otherwise (an uncaught error, its own sys.exit): its exit stands."""
    global _snapshot_exit
    _snapshot_exit = False


def _exit_for_snapshot() -> NoReturn:
    global _snapshot_exit
    _snapshot_exit = True
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def excepthook(*args: Any) -> None:
        _not_ours()
        previous_hook(*args)

    def exit_otherwise(code: str | int | None = None) -> NoReturn:
        _not_ours()
        previous_exit(code)

    sys.excepthook, sys.exit = excepthook, exit_otherwise
    raise SystemExit(0)


def install() -> None:
    """Under obd, patch Trainer now if transformers.trainer is loaded, else when it gets imported."""
    if not RunEnv.from_environ().active:
        return
    if not getattr(atexit, "_obd_skip_teardown", False):
        atexit.register(_skip_teardown)  # first registered, so it runs last
        atexit._obd_skip_teardown = True  # type: ignore[attr-defined]
    module = sys.modules.get(TARGET)
    if module is not None and getattr(module, "Trainer", None) is not None:
        patch_module(module)
        return
    if not any(getattr(finder, "_obd_trainer_finder", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, TrainerImportHook())


class TrainerImportHook:
    """A meta path finder that wraps the loader of `transformers.trainer` so the module is patched once loaded."""

    _obd_trainer_finder = True

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or getattr(finder, "_obd_trainer_finder", False):
                continue
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = PatchingLoader(spec.loader)
                return spec
        return None

    def invalidate_caches(self) -> None:
        pass


class PatchingLoader:
    """Delegates everything to the real loader and patches the module after it executed."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch_module(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, is_package...: what inspect/linecache ask the real loader.
        return getattr(self._loader, name)


def patch_module(module: ModuleType) -> None:
    """Patch `module.Trainer`; a failure is reported in the job log and never breaks the user's import."""
    trainer = getattr(module, "Trainer", None)
    if trainer is None:
        return
    try:
        patch_trainer_class(trainer)
    except Exception as exc:
        log_error(f"obd: could not patch transformers.Trainer ({type(exc).__name__}: {exc}); no snapshots")


def patch_trainer_class(cls: Any) -> None:
    """Wrap `cls.__init__` (output_dir, callback), `cls.train` (resume, one callback, the job's end
    after a snapshot) and `cls._save_checkpoint` (when each save began, for its duration); idempotent."""
    if not getattr(cls.__init__, MARKER, False):
        cls.__init__ = _wrap_init(cls.__init__)
    if not getattr(cls.train, MARKER, False):
        cls.train = _wrap_train(cls.train)
    evaluate = getattr(cls, "evaluate", None)
    if evaluate is not None and not getattr(evaluate, MARKER, False):
        cls.evaluate = _wrap_evaluate(evaluate)
    save = getattr(cls, "_save_checkpoint", None)
    if save is not None and not getattr(save, MARKER, False):
        cls._save_checkpoint = _wrap_save(save)


def _wrap_init(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        env = RunEnv.from_environ()
        if env.active:
            args, kwargs = trainer_args.with_training_args(args, kwargs, env)
        original(self, *args, **kwargs)
        if env.active:
            trainer_args.redirect_output_dir(self.args, env)
            continue_in_args(self.args, trainer_args.requested_output_dir(self.args))  # the chain's tracker run
            ensure_callback(self, env)

    setattr(__init__, MARKER, True)
    return __init__


def _wrap_train(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        env = RunEnv.from_environ()
        if env.active:
            trainer_args.redirect_output_dir(self.args, env)
            dedupe_callbacks(self)
            for callback in _snapshot_callbacks(self):
                callback.trainer = weakref.ref(self)  # it counts tokens in this Trainer's loop
            args, kwargs = trainer_args.with_resume(args, kwargs, env)
        try:
            result = original(self, *args, **kwargs)
        except StopAtBoundary as stop:  # a stop between two step ends (interrupt.py)
            _snapshot_at_boundary(self, stop)
            raise  # not reached: the job ends at its snapshot, or the save failed
        finally:
            trainer_args.train_returned()
        if env.active:
            _end_job_if_stopped(self)
        return result

    setattr(train, MARKER, True)
    return train


def _wrap_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Note when the Trainer's checkpoint save begins on its SnapshotCallback, whose `on_save` (called
    right after the save) writes the save's duration in metrics.jsonl: the lead of a limit is learned
    from it (docs/limits.md). One clock read a save; nothing at the step ends."""

    @functools.wraps(original)
    def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
        began = time.monotonic()
        callbacks = _snapshot_callbacks(self)
        for callback in callbacks:
            callback.save_began = began
            callback.saving(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            for callback in callbacks:
                callback.saving(False, self.state.global_step)

    setattr(_save_checkpoint, MARKER, True)
    return _save_checkpoint


def _wrap_evaluate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Say the evaluation's phase on the SnapshotCallback: `status` shows it, and a stop during it is
    taken between two evaluation batches (interrupt.py)."""

    @functools.wraps(original)
    def evaluate(self: Any, *args: Any, **kwargs: Any) -> Any:
        callbacks = _snapshot_callbacks(self)
        for callback in callbacks:
            callback.evaluating(True)
        completed = False
        try:
            result = original(self, *args, **kwargs)
            completed = True
            return result
        finally:
            for callback in callbacks:
                callback.evaluating(False, completed)

    setattr(evaluate, MARKER, True)
    return evaluate


def _snapshot_at_boundary(trainer: Any, stop: StopAtBoundary) -> None:
    """A stop taken between two step ends: the boundary's state saved and proven, then the job's end as after any snapshot."""
    callbacks = _snapshot_callbacks(trainer)
    if not callbacks:
        return
    callbacks[0].snapshot_at_boundary(trainer, stop)
    _end_job_if_stopped(trainer)


def _end_job_if_stopped(trainer: Any) -> None:
    """After a train() that stopped for a snapshot (its proof on disk), end the job: exit 0, here.

    The script's code after train() would otherwise treat a half-trained model as the result:
    save it as final (`save_model()`), push it, evaluate it, report "done". SystemExit rather
    than os._exit: the interpreter ends as usual, so `finally` clauses and `with` blocks around
    train() close what they opened, atexit handlers run (the gloo teardown in dist.py, a
    tracker's own), and buffered output reaches the job log. Every rank gets here (each saw
    the same decision, and the proof's barrier), so a torchrun job exits 0 on all of them. Then the
    interpreter's teardown of every object is skipped (`_skip_teardown`), unless the job went on
    to end otherwise. With OBD_SNAPSHOT_RETURNS=1 train() returns instead, its
    `state.obd_snapshot` saying why.
    """
    marker = stopped_for_snapshot(trainer)
    if marker is None:
        return
    env = RunEnv.from_environ()
    if env.snapshot_returns:
        log_error(f"obd: {marker}; train() returns to the script ({SNAPSHOT_RETURNS}=1)")
        return
    if Ranks().is_zero:
        log_error(
            f"obd: {marker}; the job ends here with exit 0, without the script's code after train(). "
            f"`obd train resume {env.run_id or 'RUN'}` finishes the training (a script that handles a stop "
            f"itself sets {SNAPSHOT_RETURNS}=1)"
        )
    _exit_for_snapshot()


def _snapshot_callbacks(trainer: Any) -> list[Any]:
    handler = getattr(trainer, "callback_handler", None)
    return [cb for cb in getattr(handler, "callbacks", ()) if getattr(cb, CALLBACK_MARKER, False)]


def ensure_callback(trainer: Any, env: RunEnv) -> None:
    """Add the SnapshotCallback unless the script already passed one."""
    if _snapshot_callbacks(trainer):
        return
    # Imported when a Trainer is made (callback.py imports transformers), so installing the patch
    # imports nothing heavy. One way only: the callback never imports this module.
    from .callback import SnapshotCallback

    trainer.add_callback(SnapshotCallback(env=env, auto=True))


def dedupe_callbacks(trainer: Any) -> None:
    """Keep exactly one SnapshotCallback: the script's own if it added one after __init__, else ours."""
    found = _snapshot_callbacks(trainer)
    if len(found) <= 1:
        return
    keep = next((cb for cb in found if not getattr(cb, "auto", False)), found[0])
    for cb in found:
        if cb is not keep:
            trainer.callback_handler.remove_callback(cb)
