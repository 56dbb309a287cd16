"""A user's Trainer script whose time goes where real jobs' time goes (a test fixture that knows nothing of obd).

A small regression model with dropout (so the RNG matters), trained with gradient accumulation
and evaluated every few steps. Each slow phase is slow only while a file exists, so one
configuration trains the same numbers fast (a reference run) or slowly (a run stopped there):
- `--slow-eval FILE`: every evaluation sample takes 0.3 s while FILE exists (a long evaluation);
- `--slow-micro FILE`: every training sample takes 0.2 s while FILE exists (a long accumulation);
- `--stall-fetch N --stall-file FILE`: the Nth training sample fetched blocks while FILE exists (a stalled loader);
- `--after-train SECONDS`: the script's code after train() takes that long (a final push);
- `--slow-forward FILE`: every training forward takes 0.2 s while FILE exists (a long accumulation
  whose time is in the compute, not in the data: the micro-batches are fetched at the step's start);
- `--say-steps`: print `step N ended (rank R)` at each step end (a test's event to wait for);
- `--slow-from-step N`: the script itself makes the files of --slow-forward and --slow-micro at the
  end of step N, so step N+1 is slow from its start however fast the machine runs the steps before
  (a test that made them on seeing step N's end could find the training over);
- `--slow-rank R`: under torchrun, only rank R is slow (the others wait for it in a collective).
Each prints one line when it begins, so a test waits for that event, never for a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments


class Regression(torch.nn.Module):
    def __init__(self, slow_forward: str = "") -> None:
        super().__init__()
        self.slow_forward = slow_forward
        self.said: dict[str, bool] = {}
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
        )

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.training and self.slow_forward and os.path.exists(self.slow_forward):
            said_once(self.said, "forward", "slow forward passes began")
            time.sleep(0.2)
        return {"loss": torch.nn.functional.mse_loss(self.net(input_ids.float()).squeeze(-1), labels)}

    def num_parameters(self, exclude_embeddings: bool = True) -> int:
        """As a transformers model says it: the Trainer counts 6 FLOPs a parameter and input number of a micro-batch."""
        return sum(p.numel() for p in self.parameters())


def said_once(flag: dict[str, bool], key: str, line: str) -> None:
    if not flag.get(key):
        flag[key] = True
        print(line, flush=True)


class Points(torch.utils.data.Dataset):
    """Points of a fixed seed; slow or stalled on the test's word (files)."""

    def __init__(self, n: int, seed: int, opts: argparse.Namespace, kind: str) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(dim=1)
        self.opts, self.kind, self.said = opts, kind, {}
        self.fetched = 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        o = self.opts
        if o.slow_rank >= 0 and int(os.environ.get("RANK", "0")) != o.slow_rank:
            return {"input_ids": self.x[i], "labels": self.y[i]}
        if self.kind == "eval" and o.slow_eval and os.path.exists(o.slow_eval):
            said_once(self.said, "eval", "slow evaluation began")
            time.sleep(0.3)
        if self.kind == "train":
            if o.slow_micro and os.path.exists(o.slow_micro):
                said_once(self.said, "micro", "slow micro-batches began")
                time.sleep(0.2)
            self.fetched += 1
            if self.fetched == o.stall_fetch and o.stall_file:
                while os.path.exists(o.stall_file):
                    said_once(self.said, "stall", f"stalled in sample {i}")
                    time.sleep(0.5)
        return {"input_ids": self.x[i], "labels": self.y[i]}


class SaySteps(TrainerCallback):
    def __init__(self, slow_from: int = -1, files: tuple[str, ...] = ()) -> None:
        self.slow_from, self.files = slow_from, [f for f in files if f]

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.slow_from:
            for name in self.files:
                open(name, "a").close()
        print(f"step {state.global_step} ended (rank {os.environ.get('RANK', '0')})", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=30)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--eval_steps", type=int, default=10)
    p.add_argument("--slow-eval", default="")
    p.add_argument("--slow-micro", default="")
    p.add_argument("--stall-fetch", type=int, default=-1)
    p.add_argument("--stall-file", default="")
    p.add_argument("--after-train", type=float, default=0.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-forward", default="")
    p.add_argument("--say-steps", action="store_true")
    p.add_argument("--slow-from-step", type=int, default=-1)
    opts = p.parse_args()
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir="mine",
        max_steps=opts.max_steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=opts.accumulation,
        learning_rate=1e-2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=opts.eval_steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=Regression(opts.slow_forward),
        args=args,
        train_dataset=Points(512, 0, opts, "train"),
        eval_dataset=Points(40, 1, opts, "eval"),
        callbacks=[SaySteps(opts.slow_from_step, (opts.slow_forward, opts.slow_micro))] if opts.say_steps else None,
    )
    trainer.train()
    print(f"train() returned at step {trainer.state.global_step}", flush=True)
    # A test compares a resumed run's count. One write with its newline: two ranks print it to one log.
    print(f"total_flos {trainer.state.total_flos!r}\n", end="", flush=True)
    if opts.after_train:
        print("after-train code began", flush=True)
        time.sleep(opts.after_train)
    trainer.save_model()
    print("the script ended", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
