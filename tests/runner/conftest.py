"""Shared fixtures of the runner tests: the fixture-file directory and the numbers it encodes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"

# Every kernel-trace fixture holds 4 steps of: a bf16 GEMM (100 us), an RCCL kernel (30 us,
# overlapping the GEMM by 10 us), CK flash attention (50 us), 3 elementwise kernels (5 us each),
# an fp32 GEMM (20 us). Per step: 215 us of kernel time, 205 us busy.
STEPS = 4
KERNEL_NS_PER_STEP = 215_000
BUSY_NS_PER_STEP = 205_000
GEMM_SHARE = 400_000 / 860_000 * 100


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def copy_fixture(tmp_path: Path):
    """Copy a fixture directory into tmp_path (tests that alter files never touch the originals)."""

    def copy(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(FIXTURES / name, target)
        return target

    return copy
