"""Where the per-step collective's tensor lives: CPU for gloo, each rank's own GPU for NCCL."""

from __future__ import annotations

import sys

import pytest
import torch

from trainer_plugin.plugin.dist import Ranks


class FakeDist:
    def __init__(self, backend: str) -> None:
        self.backend = backend

    def get_backend(self) -> str:
        return self.backend


def ranks_on(backend: str) -> Ranks:
    ranks = Ranks()
    ranks._dist, ranks.world_size = FakeDist(backend), 2
    return ranks


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_gloo_and_mixed_backends_reduce_on_the_cpu(two_gpus: None) -> None:
    assert ranks_on("gloo")._device() == torch.device("cpu")
    assert ranks_on("cpu:gloo,cuda:nccl")._device() == torch.device("cpu")


def test_nccl_reduces_on_the_gpu_of_the_ranks_local_rank_when_none_was_set(
    two_gpus: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks_on("nccl")._device() == torch.device("cuda", 1)


def test_nccl_keeps_a_device_the_job_chose(monkeypatch: pytest.MonkeyPatch, two_gpus: None) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert ranks_on("nccl")._device() == torch.device("cuda", 1)


def test_without_torch_distributed_a_process_is_rank_0_of_1_and_decides_alone() -> None:
    ranks = Ranks()
    assert (ranks.rank, ranks.world_size, ranks.distributed) == (0, 1, False)
    decision = ranks.decide(3, True, 17)
    assert (decision.code, decision.preempted, decision.tokens) == (3, True, 17)


class GroupAtExit:
    """A torch.distributed stand-in for the exit teardown: a default group on one backend."""

    def __init__(self, backend: str) -> None:
        self.backend, self.initialized = backend, True

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def get_backend(self) -> str:
        return self.backend

    def destroy_process_group(self) -> None:
        self.initialized = False


@pytest.mark.parametrize(("backend", "destroyed"), [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", False)])
def test_the_exit_teardown_destroys_a_gloo_group_and_leaves_nccl_to_the_script(
    monkeypatch: pytest.MonkeyPatch, backend: str, destroyed: bool
) -> None:
    from trainer_plugin.plugin import dist

    group = GroupAtExit(backend)
    monkeypatch.setitem(sys.modules, "torch.distributed", group)
    dist._destroy_gloo_group()
    assert group.initialized is not destroyed
