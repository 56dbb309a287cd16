"""GPU discovery through nvidia-smi (NVML's tool): names, memory and UUIDs, and the device order jobs get."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from executors import gpus
from executors.gpus import Gpu, parse_nvidia_query, visible_devices

# As nvidia-smi 580 prints it for `--query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits`.
TWO_H200 = (
    "0, NVIDIA H200, 143771, GPU-5f1c6a1e-0b1d-4c55-9e0a-2f6d1c3b4a11\n"
    "1, NVIDIA H200, 143771, GPU-77aa0c2e-61b0-4f1e-8d3c-0a9b8c7d6e22\n"
)


def test_each_nvidia_gpu_comes_with_its_index_name_memory_and_uuid() -> None:
    assert parse_nvidia_query(TWO_H200) == [
        Gpu("0", "nvidia", "NVIDIA H200", 143771, "GPU-5f1c6a1e-0b1d-4c55-9e0a-2f6d1c3b4a11"),
        Gpu("1", "nvidia", "NVIDIA H200", 143771, "GPU-77aa0c2e-61b0-4f1e-8d3c-0a9b8c7d6e22"),
    ]


def test_a_name_with_a_comma_stays_whole_and_memory_nvidia_smi_cannot_read_is_none() -> None:
    text = "3, Acme GPU, rev 2, [N/A], MIG-1234\n"
    assert parse_nvidia_query(text) == [Gpu("3", "nvidia", "Acme GPU, rev 2", None, "MIG-1234")]


def test_lines_that_are_not_a_gpu_are_skipped() -> None:
    text = "WARNING: infoROM is corrupted at gpu 0000:00:05.0\n\n0, NVIDIA H200, 143771, GPU-1\nNo devices were found\n"
    assert [g.id for g in parse_nvidia_query(text)] == ["0"]


def test_a_job_given_nvidia_gpus_counts_devices_in_nvidia_smis_pci_order() -> None:
    env = visible_devices([Gpu("1", "nvidia", "NVIDIA H200", 143771)])
    assert env == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_gpus_the_config_names_without_a_vendor_get_no_device_order() -> None:
    env = visible_devices([Gpu("0"), Gpu("1")])
    assert "CUDA_DEVICE_ORDER" not in env and env["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_discovery_runs_nvidia_smi_with_the_memory_and_uuid_query(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tool = tmp_path / "nvidia-smi"
    calls = tmp_path / "calls"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nprintf "%s" "{TWO_H200}"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    found = gpus.discover()
    assert [(g.id, g.name, g.memory_mib) for g in found] == [("0", "NVIDIA H200", 143771), ("1", "NVIDIA H200", 143771)]
    assert calls.read_text().split() == gpus.NVIDIA_QUERY[1:]
