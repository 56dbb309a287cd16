"""Snapshot helpers for custom training loops (no transformers.Trainer): the same contract, called by hand.

A loop under obd does, in order::

    from trainer_plugin import loop
    loop.begin(max_steps=N, start_step=start)          # first line of metrics.jsonl
    for step in range(start + 1, N + 1):
        ...train one step...
        loop.log_metrics(step, loss=loss, learning_rate=lr)
        reason = loop.snapshot_requested()              # one access(); a collective under torch.distributed
        if reason and step < N:
            path = loop.checkpoint_dir(step)            # <run>/output/checkpoint-<step>
            ...save model, optimizer, scheduler into path...
            loop.write_proof(step, path, reason=reason)
            break
    loop.end(step)
    if loop.stopped_for_snapshot():                     # stopped mid-run: no final save, push or report
        return 0
    ...save the final model...

Resume from `loop.resume_from()` (OBD_RESUME_FROM) when it is set. Outside obd every helper is
a no-op (`snapshot_requested()` is None, `write_proof()` returns None). Standard library only;
torch is used only if the job already initialised torch.distributed.

Unlike a Trainer's train(), nothing here ends the job after a snapshot: the loop's own code
decides what follows its proof (under DDP, the tidy teardown of dist.py's notes comes after
`end()`), and `stopped_for_snapshot()` tells it that the run stopped mid-way, on every rank.
"""

from __future__ import annotations

import os
from typing import Any

from .. import rundir
from . import runtime
from .dist import Ranks, tear_down_at_exit
from .interrupt import Boundary
from .metrics_file import MetricsWriter
from .runtime import RunEnv, SigtermFlag, StoppedForSnapshot, note_snapshot
from .runtime import stopped_for_snapshot as _process_snapshot

_sigterm = SigtermFlag()
_max_steps: int | None = None  # what begin() was told, for the snapshot's marker
_metrics: MetricsWriter | None = None
_metrics_key: tuple[str | None, int] | None = None


def _env() -> RunEnv:
    return RunEnv.from_environ()


def _writer() -> MetricsWriter:
    """The process's metrics writer: the run's metrics.jsonl on rank 0 under obd, else a no-op."""
    global _metrics, _metrics_key
    env, ranks = _env(), Ranks()
    path = env.metrics_path if env.active and ranks.is_zero else None
    key = (path, os.getpid())
    if _metrics is None or _metrics_key != key:
        if _metrics is not None:
            _metrics.close()
        _metrics, _metrics_key = MetricsWriter(path), key
    return _metrics


def snapshot_requested(sync: bool = True) -> str | None:
    """The reason of a pending snapshot request (`requested`, `deadline`, ...), or None.

    Costs one access() when there is no request. Under an initialised torch.distributed with
    `sync=True` it is a collective: every rank must call it at the same step, rank 0 reads the
    file, and every rank gets rank 0's answer (a SIGTERM on any rank counts, see begin()).
    A SIGTERM turned into a request also writes `snapshot.request` so the daemon sees it.
    """
    env = _env()
    if not env.active:
        return None
    ranks = Ranks()
    reason = runtime.read_request(env.request_path) if ranks.is_zero else None
    preempted = _sigterm.consume()
    if sync:
        decision = ranks.decide(runtime.reason_code(reason), preempted, 0)
        reason, preempted = runtime.reason_from_code(decision.code), decision.preempted
    if reason is None and preempted:
        reason = rundir.PREEMPTED
        if ranks.is_zero:
            runtime.write_request(env, reason)
    return reason


_boundary: Boundary | None = None


def boundary(step: int) -> None:
    """Call right after each optimizer step: keeps what a stop before the next step must put back.

    The RNG states (torch's, and numpy's and Python's when imported) as they are at the end of
    `step`. A loop that finds a stop pending inside a step (between two micro-batches of a
    gradient accumulation, between two evaluation batches: `stop_pending()`) abandons the rest of
    it, calls `restore_boundary()` and saves: the model and optimizer are still that step's (no
    optimizer step ran since), so the checkpoint is exactly step `step`'s (README, "A stop
    wherever the job's time goes"). About 50 µs a call with numpy imported.
    """
    global _boundary
    if _env().active:
        _boundary = Boundary.take(step, True, {})


def stop_pending() -> str | None:
    """Inside a step (between micro-batches, evaluation batches): the reason of a pending request, or None.

    One access() when there is none, and no collective: for one process, or a loop that makes
    its ranks agree itself. Between two steps use `snapshot_requested()`, which agrees across ranks.
    """
    env = _env()
    if not env.active or not Ranks().is_zero:
        return None
    return runtime.read_request(env.request_path)


def restore_boundary() -> int | None:
    """Put back the RNG states `boundary()` kept, before saving a stop taken inside a step; returns
    that boundary's step (the checkpoint to save and prove), or None when `boundary()` was never called."""
    if _boundary is None:
        return None
    _boundary.restore_rng()
    return _boundary.step


def checkpoint_dir(step: int, output_dir: str = "output") -> str:
    """Where to save the checkpoint of `step`: `<OBD_OUTPUT_DIR>/checkpoint-<step>` under obd, else under `output_dir`."""
    base = _env().output_dir or output_dir
    return os.path.join(base, rundir.checkpoint_name(step))


def resume_from() -> str | None:
    """The checkpoint directory a resumed run starts from (OBD_RESUME_FROM), or None."""
    return _env().resume_from


def write_proof(step: int, checkpoint_dir: str | None = None, reason: str = rundir.REQUESTED) -> dict[str, Any] | None:
    """Write `snapshot.json` for `output/checkpoint-<step>` once your loop saved everything there.

    `checkpoint_dir`, if given, must be that directory (anything else raises ValueError: a
    proof can only name `output/checkpoint-<step>`). The directory must exist; it is fsynced
    before the proof is renamed into place. Under torch.distributed every rank calls this after
    writing its part (it waits for all), and rank 0 writes. Returns the proof on rank 0 under
    obd, else None. Raises runtime.IncompleteCheckpoint if the directory is missing.
    """
    env = _env()
    if not env.active:
        return None
    expected = os.path.join(str(env.output_dir), rundir.checkpoint_name(step))
    if checkpoint_dir is not None and os.path.realpath(checkpoint_dir) != os.path.realpath(expected):
        raise ValueError(f"obd: a proof for step {step} can only name {expected}, not {checkpoint_dir}")
    ranks = Ranks()
    ranks.barrier()
    proof = None
    written = False
    try:
        if ranks.is_zero:
            proof = runtime.write_proof(env, step, reason)
        written = True
    finally:
        # Every rank waits for rank 0's word (also when it failed): then stopped_for_snapshot()
        # says the same on all of them, and only once the proof is on disk.
        written = ranks.zero_says(written)
    if not written:  # a rank > 0 whose rank 0 failed
        raise runtime.IncompleteCheckpoint(f"obd: rank 0 wrote no snapshot proof for step {step} (see its log)")
    note_snapshot(StoppedForSnapshot(step, _max_steps, reason, expected))
    return proof


def stopped_for_snapshot() -> StoppedForSnapshot | None:
    """This process's snapshot once `write_proof` wrote it (every rank), else None: the run stopped mid-way.

    Code after the loop that would save, push or report the model as final should skip that
    when this is set; a resumed run (`obd train resume`) finishes the training.
    """
    return _process_snapshot()


def begin(max_steps: int | None, start_step: int = 0, snapshots: bool = True, **fields: Any) -> None:
    """Write the `begin` line (rank 0) and, with OBD_SNAPSHOT_ON_SIGTERM=1, start turning SIGTERM into a request.

    `snapshots=True` tells the daemon this loop polls snapshot_requested() and writes proofs.
    Extra keyword fields are recorded as they are.
    """
    global _max_steps
    env = _env()
    if not env.active:
        return
    if max_steps is not None:  # log_metrics' own begin (every log on a rank > 0, which writes none) says None
        _max_steps = max_steps
    if env.snapshot_on_sigterm and snapshots:
        _sigterm.install()
    _writer().write(
        "begin",
        max_steps=max_steps,
        snapshots=snapshots,
        version=runtime.VERSION,
        run_id=env.run_id,
        start_step=start_step,
        resume_from=env.resume_from,
        world_size=Ranks().world_size,
        **fields,
    )


def log_metrics(step: int, **values: Any) -> None:
    """Append a `log` line (rank 0): `step`, `loss`, `learning_rate`, `grad_norm`, `epoch` (null when not given), plus `values`.

    Tensors and numpy scalars are converted; NaN and infinities are written as null. A loop
    that logs before calling begin() gets a `begin` line with `snapshots: false` first, since
    the daemon requires `begin` to be the first line.
    """
    if not _env().active:
        return
    writer = _writer()
    if not writer.began:
        begin(max_steps=None, snapshots=False)
    fields: dict[str, Any] = {"step": step}
    fields.update({name: values.pop(name, None) for name in ("loss", "learning_rate", "grad_norm", "epoch")})
    fields.update(values)
    writer.write("log", **fields)


def end(step: int, **fields: Any) -> None:
    """Write the `end` line (rank 0) and stop handling SIGTERM (a SIGTERM never handled is re-delivered).

    Under gloo it also destroys a process group the loop left initialised, at exit (see dist.py).
    """
    if not _env().active:
        return
    _writer().write("end", step=step, **fields)
    _sigterm.restore()
    tear_down_at_exit(Ranks())
