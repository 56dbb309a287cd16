"""Rank 0 decides, every rank learns: the one small collective the plugin runs per step under torch.distributed.

torch is imported only if the job already imported `torch.distributed`, so a job that never
uses it (and every job outside obd) pays nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class Decision:
    """What all ranks agree on at a step end: rank 0's request, whether any rank got SIGTERM, and new tokens."""

    code: int  # reason code of rank 0's request (runtime.reason_code), 0 for none
    preempted: bool  # some rank received SIGTERM (OBD_SNAPSHOT_ON_SIGTERM)
    tokens: int  # input tokens all ranks processed since the last step end


class Ranks:
    """This process's place in torch.distributed (rank 0 of 1 when it is not initialised)."""

    def __init__(self) -> None:
        self._dist: Any = None
        self._device_cache: Any = None  # where the per-step all-reduce runs, found on first use
        self.rank = 0
        self.world_size = 1
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            self._dist = dist
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self._dist is not None and self.world_size > 1

    def _device(self) -> Any:
        # NCCL (and RCCL on ROCm, same name) only reduces device tensors; gloo and mixed
        # "cpu:gloo,cuda:nccl" backends reduce CPU tensors.
        import torch

        backend = str(self._dist.get_backend()).lower()
        if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
            index = torch.cuda.current_device()
            # A loop that never called torch.cuda.set_device() is still on device 0 on every
            # rank; NCCL needs each rank on its own GPU, which torchrun names in LOCAL_RANK.
            local = os.environ.get("LOCAL_RANK", "")
            if index == 0 and local.isdigit() and int(local) < torch.cuda.device_count():
                index = int(local)
            return torch.device("cuda", index)
        return torch.device("cpu")

    def _sum(self, values: list[int]) -> list[int]:
        import torch

        # The device is looked up once per Ranks (one per training): by the first step end the
        # job has chosen its GPU, and the backend never changes under a process group.
        if self._device_cache is None:
            self._device_cache = self._device()
        tensor = torch.tensor(values, dtype=torch.int64, device=self._device_cache)
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM)
        return [int(v) for v in tensor.tolist()]

    def decide(self, code: int, preempted: bool, tokens: int) -> Decision:
        """Every rank calls this at the same step end; only rank 0's `code` counts, SIGTERM on any rank counts."""
        if not self.distributed:
            return Decision(code, preempted, tokens)
        total = self._sum([code if self.is_zero else 0, 1 if preempted else 0, tokens])
        return Decision(total[0], total[1] > 0, total[2])

    def barrier(self) -> None:
        """Wait until every rank got here (an all-reduce, so it works on NCCL without device ids)."""
        if self.distributed:
            self._sum([0])

    def zero_says(self, yes: bool) -> bool:
        """Every rank learns rank 0's `yes` (the others' is not counted); a barrier too, once per snapshot.

        After the proof: rank 0 says whether it wrote it, so every rank agrees on "proven", and
        none takes it for granted while rank 0 failed.
        """
        if not self.distributed:
            return yes
        return self._sum([1 if yes and self.is_zero else 0])[0] > 0


_teardown_registered = False


def _destroy_gloo_group() -> None:
    """At exit, destroy a still-initialised gloo-only default process group (see `tear_down_at_exit`)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return  # the script destroyed it itself, or never made one
    try:
        backend = str(dist.get_backend()).lower()
        if "gloo" in backend and "nccl" not in backend:
            dist.destroy_process_group()
    except Exception as exc:  # exit must go on: a failed teardown is only worth a line
        print(f"obd: could not destroy the process group at exit: {exc}", file=sys.stderr)


def tear_down_at_exit(ranks: Ranks) -> None:
    """After a clean train end under gloo, destroy the default process group at interpreter exit.

    A script that never calls `destroy_process_group()` (the stock Trainer does not) leaves
    gloo's worker threads holding the plugin's and DDP's reduced tensors; freeing them during
    interpreter finalisation aborts the process (SIGABRT, "terminate called without an active
    exception") now and then, which would turn a run with a verified snapshot into a failed
    one. An atexit handler runs while the interpreter is still whole. gloo's teardown is local
    to the process; NCCL's is collective and can hang when ranks diverge, so NCCL is left to
    the script.
    """
    global _teardown_registered
    if ranks.distributed and not _teardown_registered:
        atexit.register(_destroy_gloo_group)
        _teardown_registered = True
