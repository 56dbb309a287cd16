"""A hand-written torch training loop that uses obd's custom-loop helpers (a test fixture).

Runs alone or under torchrun (gloo on CPU, DDP). Resumes from `loop.resume_from()`, polls
`loop.snapshot_requested()` every step, saves `checkpoint_dir(step)` and writes the proof.
The "test" options stand in for the outside world at an exact step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from trainer_plugin import loop


def say(line: str) -> None:
    """One line to stdout in one write(): the ranks share the job log and leave their loops together."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--max_steps", type=int, default=10)
    p.add_argument("--write-at", type=int, default=0, help="test: rank 0 writes --write-file at this step")
    p.add_argument("--write-file", default="", help="test: PATH=TEXT")
    p.add_argument("--sigterm-at", type=int, default=0, help="test: SIGTERM one rank at this step")
    p.add_argument("--sigterm-rank", type=int, default=0)
    opts = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    resume = loop.resume_from()
    if resume:
        state = torch.load(os.path.join(resume, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]

    loop.begin(max_steps=opts.max_steps, start_step=start)
    step = start
    stopped = None
    for step in range(start + 1, opts.max_steps + 1):
        if opts.write_at == step and rank == 0:
            path, _, text = opts.write_file.partition("=")
            with open(path, "w") as f:
                f.write(text)
        if opts.sigterm_at == step and rank == opts.sigterm_rank:
            os.kill(os.getpid(), signal.SIGTERM)
        x = torch.randn(8, 4)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), x.sum(dim=1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loop.log_metrics(step, loss=loss.item(), learning_rate=0.05, tokens=8 * step)
        reason = loop.snapshot_requested()
        if reason and step < opts.max_steps:
            path = loop.checkpoint_dir(step)
            if rank == 0:
                os.makedirs(path, exist_ok=True)
                torch.save(
                    {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                    os.path.join(path, "state.pt"),
                )
            loop.write_proof(step, path, reason=reason)
            stopped = reason
            break
    loop.end(step)
    say(f"rank {rank} stopped at step {step} reason {stopped}")
    # What the code after a loop asks before a final save: did the run stop mid-way?
    say(f"rank {rank} marker: {loop.stopped_for_snapshot()}")
    if distributed:
        # DDP keeps its own reference to the gloo group: freed during interpreter finalisation,
        # after a peer has gone, gloo can abort the process (torch's, not obd's). A tidy loop
        # lets every rank finish, drops the model, then destroys the group.
        dist.barrier()
        del model, optimizer
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
