"""A user's plain transformers.Trainer script that knows nothing of obd (a test fixture).

A small regression model (a torch module, not a PreTrainedModel) trained with the stock
Trainer. The options marked "test" stand in for things that happen outside the script
(someone writes the request file, the pod gets a SIGTERM) at an exact step, so the tests
need no timing; none of them mention obd.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import sys
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.mse_loss(self.net(input_ids.float()).squeeze(-1), labels)
        return {"loss": loss}


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def say(line: str) -> None:
    """One line to stdout in one write(): the ranks share the job log and end their training together."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


class Outside(TrainerCallback):
    """test: at the start of a given step, write a file or send ourselves SIGTERM, as the outside world would."""

    def __init__(self, opts: argparse.Namespace) -> None:
        self.opts = opts
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if self.trainer is not None:  # after obd's patched train() kept one SnapshotCallback
            print(f"callbacks: {[type(cb).__name__ for cb in self.trainer.callback_handler.callbacks]}", flush=True)

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        # Inside train(): printed whether or not the script's code after train() runs.
        rank = os.environ.get("RANK", "0")
        say(f"train ended at step {state.global_step} of {state.max_steps} (rank {rank})")

    def _hangs(self) -> bool:
        """Whether to hang: always, or with --hang-marker only where the marker is not there yet (it
        is made as the job hangs: a later attempt of the run trains on)."""
        marker = self.opts.hang_marker
        if not marker:
            return True
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return False
        return True

    def on_step_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        step = state.global_step + 1  # the step about to run
        rank = int(os.environ.get("RANK", "0"))
        if self.opts.hang_after and step == self.opts.hang_after + 1 and self._hangs():
            # A Trainer that hangs after a logged step (a stuck collective, a data loader that
            # never yields): no later step end, no later write, ever.
            print(f"hanging after step {self.opts.hang_after}", flush=True)
            time.sleep(3600)
        if self.opts.hold_at and step == self.opts.hold_at + 1:
            # test: train on only once obd asked for a snapshot (a preemption, a drain): the pause
            # comes while the run still has steps to train, however slow the machine.
            while not os.path.exists(os.environ["OBD_SNAPSHOT_REQUEST"]):
                time.sleep(0.05)
        if self.opts.write_at == step and rank == 0:
            path, _, text = self.opts.write_file.partition("=")
            with open(path, "w") as f:
                f.write(text)
            # A step longer than the plugin's recheck time (0.1 s): its end looks the name up,
            # so the snapshot is at this very step however the plugin comes to see the request.
            time.sleep(0.2)
        if self.opts.sigterm_at == step and rank == self.opts.sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        if self.opts.step_sleep:
            time.sleep(self.opts.step_sleep)

    def on_step_end(self, args, state, control, model=None, **kwargs):  # type: ignore[no-untyped-def]
        if self.opts.report_hooks and state.global_step == 1:
            print(f"forward pre-hooks on the model while training: {len(model._forward_pre_hooks)}", flush=True)


class MyTrainer(Trainer):
    """A subclass, as TRL and axolotl make them."""

    def __init__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self.made_by_subclass = True


class OwnTracker(MyTrainer):
    """A subclass with its own _track_num_input_tokens: obd counts with a forward pre-hook instead."""

    def _track_num_input_tokens(self, inputs):  # type: ignore[no-untyped-def]
        self.tracked = getattr(self, "tracked", 0) + 1
        return super()._track_num_input_tokens(inputs)


def finish(trainer: Trainer, folder: str) -> None:
    """test: what scripts do after train(): save the final model, say it finished, push it (a stub that writes a file)."""
    try:
        from trainer_plugin import stopped_for_snapshot  # on the path under obd
    except ImportError:  # a plugin without the helper
        helper = None
    else:
        helper = stopped_for_snapshot(trainer)
    marker = getattr(trainer.state, "obd_snapshot", None)
    print(f"after train: marker {marker!r}; helper {helper!r}", flush=True)
    trainer.save_model()
    with open(os.path.join(folder, "finished"), "w") as f:
        f.write(f"training finished at step {trainer.state.global_step}\n")

    def push_to_hub(*args, **kwargs):  # type: ignore[no-untyped-def]
        with open(os.path.join(folder, "pushed"), "w") as f:
            f.write("pushed\n")

    trainer.push_to_hub = push_to_hub  # type: ignore[method-assign]
    trainer.push_to_hub()


def report_process_group() -> None:
    import torch.distributed as dist

    up = dist.is_available() and dist.is_initialized()
    say(f"process group at exit: {'initialised' if up else 'destroyed'} (rank {os.environ.get('RANK', '0')})")


def touch(folder: str, name: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write("ran\n")


class _Teardown:
    """test: an object whose __del__ runs when the interpreter tears its module down."""

    def __init__(self, folder: str) -> None:
        # Taken now: at teardown the builtins and `os` may be gone from the module's namespace.
        self.path, self.open = os.path.join(folder, "teardown"), open

    def __del__(self) -> None:
        with self.open(self.path, "w") as f:
            f.write("ran\n")


_kept: list[_Teardown] = []


def probe_exit(folder: str) -> None:
    """test: say which of the ways out ran: an atexit handler, and the teardown of module objects."""
    atexit.register(touch, folder, "atexit")
    _kept.append(_Teardown(folder))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=8)
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--logging_steps", type=int, default=1)
    p.add_argument(
        "--resume", choices=("none", "true"), default="none", help="resume_from_checkpoint passed to train()"
    )
    p.add_argument("--subclass", action="store_true")
    p.add_argument("--own-tracker", action="store_true", help="a subclass with its own _track_num_input_tokens")
    p.add_argument("--report-hooks", action="store_true", help="test: print the model's forward pre-hooks at step 1")
    p.add_argument("--callback-by-hand", action="store_true", help="pass SnapshotCallback and add another one")
    p.add_argument("--write-at", type=int, default=0, help="test: write --write-file at this step")
    p.add_argument("--write-file", default="", help="test: PATH=TEXT")
    p.add_argument("--sigterm-at", type=int, default=0, help="test: SIGTERM ourselves at this step")
    p.add_argument("--sigterm-rank", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--stages", type=int, default=1, help="train this many times in a row, a new Trainer each")
    p.add_argument(
        "--report-exit", action="store_true", help="test: print at exit whether the process group is still up"
    )
    p.add_argument("--freeze-first", action="store_true", help="freeze the first layer, as LoRA freezes the base model")
    p.add_argument("--hold-at", type=int, default=0, help="test: after this step, wait for a snapshot request")
    p.add_argument("--hang-after", type=int, default=0, help="test: hang (sleep an hour) after this step is logged")
    p.add_argument(
        "--hang-marker", default="", help="test: with --hang-after, hang only if this file is not there (made)"
    )
    p.add_argument(
        "--finish", default="", help="test: after train(), save_model(), write DIR/finished, push (to DIR/pushed)"
    )
    p.add_argument(
        "--exit-probe",
        default="",
        help="test: write DIR/finally, DIR/atexit and DIR/teardown (a module object's __del__) as each runs",
    )
    p.add_argument("--catch-exit", type=int, default=None, help="test: catch train()'s SystemExit and sys.exit(N)")
    p.add_argument("--report_to", default="none", help="the Trainer's report_to, comma-separated (wandb,tensorboard)")
    opts = p.parse_args()
    if opts.exit_probe:
        probe_exit(opts.exit_probe)
    if opts.report_exit:
        atexit.register(report_process_group)  # registered first, so it runs after any handler added later

    torch.manual_seed(0)
    outside = Outside(opts)
    callbacks: list[TrainerCallback] = [outside]
    if opts.callback_by_hand:
        from trainer_plugin import SnapshotCallback

        callbacks.append(SnapshotCallback())
    args = TrainingArguments(
        output_dir=opts.output_dir,
        max_steps=opts.max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        logging_steps=opts.logging_steps,
        save_strategy="steps" if opts.save_steps else "no",
        save_steps=opts.save_steps or 500,
        report_to=opts.report_to.split(",") if opts.report_to != "none" else "none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    cls = OwnTracker if opts.own_tracker else MyTrainer if opts.subclass else Trainer
    model = Regression()
    if opts.freeze_first:
        model.net[0].requires_grad_(False)
    for stage in range(opts.stages):
        trainer = cls(model=model, args=args, train_dataset=Points(), callbacks=list(callbacks))
        outside.trainer = trainer
        if opts.callback_by_hand:
            from trainer_plugin import SnapshotCallback

            trainer.add_callback(SnapshotCallback())
        resume = True if opts.resume == "true" and stage == 0 else None
        try:
            result = trainer.train(resume_from_checkpoint=resume)
        except SystemExit:
            if opts.catch_exit is None:
                raise
            sys.exit(opts.catch_exit)
        finally:
            if opts.exit_probe:
                touch(opts.exit_probe, "finally")
        # The script's code after train(): under obd it runs only when training finished, or
        # when the script opted out of the job ending at a snapshot (OBD_SNAPSHOT_RETURNS=1).
        say(
            f"trained to step {trainer.state.global_step} of {trainer.state.max_steps} (rank {os.environ.get('RANK', '0')})"
        )
        print(f"train_loss {result.training_loss}", flush=True)
        if opts.finish:
            finish(trainer, opts.finish)
    return 0


if __name__ == "__main__":
    sys.exit(main())
