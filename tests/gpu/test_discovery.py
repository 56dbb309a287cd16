"""Discovery and assignment on a real GPU machine: the local target finds the GPUs, `--gpus 1` gives a job exactly one.

What each test proves:
- obd's discovery (executors/gpus.py, nvidia-smi or amd-smi/rocm-smi) finds as many GPUs as torch
  sees, each with its name and, on NVIDIA, its memory, and NVML itself (pynvml, where installed)
  agrees with every figure;
- a run started with `--gpus 1` gets one device: inside the job `torch.cuda.device_count()` is 1
  and it is the card obd recorded for the run; `obd targets list` shows that card held by the run
  while it runs and free once it ended.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from executors.gpus import Gpu, discover
from tests.conftest import wait_for
from tests.gpu import harness

pytestmark = pytest.mark.gpu
CHECK = "discovery and assignment"

# The job: what torch sees inside it, then wait (so the test can look at the target) until told to end.
JOB = r"""
import json, os, sys, time
import torch
seen = {
    "device_count": torch.cuda.device_count(),
    "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER"),
    "HIP_VISIBLE_DEVICES": os.environ.get("HIP_VISIBLE_DEVICES"),
    "name": torch.cuda.get_device_name(0) if torch.cuda.device_count() else None,
    "total_memory": torch.cuda.get_device_properties(0).total_memory if torch.cuda.device_count() else None,
}
print("SEEN " + json.dumps(seen), flush=True)
end = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < end:
    time.sleep(0.1)
"""


def _requires_hardware() -> None:
    if harness.DRY_RUN:
        pytest.skip("dry run on the CPU: discovery needs the GPUs themselves")


def _nvml_view() -> list[dict[str, Any]] | None:
    """Each GPU as NVML reports it (pynvml), or None when pynvml is not installed or NVML does not start."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            out.append(
                {
                    "index": str(i),
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_mib": pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024),
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                }
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def test_the_local_target_finds_every_gpu_torch_sees_with_its_name_and_memory(probe: harness.Probe) -> None:
    _requires_hardware()
    found = discover()
    assert len(found) == probe.device_count, f"obd found {found}, torch sees {probe.torch}"
    for gpu in found:
        assert gpu.vendor == probe.vendor and gpu.name, gpu
        if gpu.vendor == "nvidia":
            assert gpu.memory_mib and gpu.memory_mib > 1024, gpu
            assert gpu.uuid and gpu.uuid.startswith("GPU-"), gpu
        tool = "nvidia-smi --query-gpu" if gpu.vendor == "nvidia" else "amd-smi list --json / rocm-smi"
        memory = f", {gpu.memory_mib} MiB" if gpu.memory_mib else ""
        harness.record(CHECK, f"GPU {gpu.id}", f"{gpu.name}{memory}", "", f"obd's discovery ({tool})")
    # torch reports the same memory (it counts bytes; nvidia-smi MiB, rounded down).
    for gpu, total in zip(found, probe.torch.get("memory_bytes") or [], strict=False):
        if gpu.memory_mib:
            assert abs(gpu.memory_mib - total / 2**20) <= 1024, (gpu, total)
    nvml = _nvml_view() if probe.vendor == "nvidia" else None
    if nvml is not None:
        assert [(g["index"], g["name"], g["uuid"]) for g in nvml] == [(g.id, g.name, g.uuid) for g in found]
        for view, gpu in zip(nvml, found, strict=True):
            assert gpu.memory_mib is not None and abs(view["memory_mib"] - gpu.memory_mib) <= 1024, (view, gpu)
        harness.record(
            CHECK,
            "NVML agrees",
            True,
            "",
            "pynvml: the same index, name and UUID of every GPU, total memory within 1 GiB",
        )


def _targets(daemon: Any) -> dict[str, Any]:
    out = daemon.cli("targets", "list", "--json")
    assert out.returncode == 0, out.stderr
    return next(row for row in json.loads(out.stdout) if row["name"] == "local")


def _seen(record: dict[str, Any]) -> dict[str, Any] | None:
    text = harness.job_log_tail(record, 20000)
    for line in text.splitlines():
        if line.startswith("SEEN "):
            seen: dict[str, Any] = json.loads(line[5:])
            return seen
    return None


def test_gpus_1_gives_the_job_exactly_one_device_which_targets_list_shows_held_while_it_runs(
    gpu_daemon: Any, probe: harness.Probe, tmp_path: Path
) -> None:
    _requires_hardware()
    local = _targets(gpu_daemon)
    assert [g["id"] for g in local["gpus"]] == [g.id for g in discover()]
    assert all(g["held_by"] is None for g in local["gpus"]), local
    release = tmp_path / "release"
    run_id = harness.start_run(gpu_daemon, [harness.training_python(), "-c", JOB, str(release)], "--gpus", "1")
    try:
        record = gpu_daemon.wait_state(run_id, "running", timeout=60)
        seen = wait_for(lambda: _seen(gpu_daemon.record(run_id)), 120, 0.2, "the job to report its devices")
        held = _targets(gpu_daemon)
        listing = gpu_daemon.cli("targets", "list").stdout
    finally:
        release.touch()
    final = harness.wait_final(gpu_daemon, run_id, timeout=120)
    assert final["state"] == "succeeded", f"{final['message']}\n{harness.job_log_tail(final)}"
    given = record["gpus"]
    assert isinstance(given, list) and len(given) == 1, record
    assert seen["device_count"] == 1, seen
    visible = seen["HIP_VISIBLE_DEVICES"] if probe.vendor == "amd" else seen["CUDA_VISIBLE_DEVICES"]
    assert visible == given[0], (seen, given)
    if probe.vendor == "nvidia":
        assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", seen  # nvidia-smi's numbering, which obd's ids are
    card: Gpu = next(g for g in discover() if g.id == given[0])
    assert seen["name"] == card.name or card.vendor != "nvidia", (seen, card)
    holders = {g["id"]: g["held_by"] for g in held["gpus"]}
    assert holders[given[0]] == run_id and all(h is None for i, h in holders.items() if i != given[0]), held
    assert f"{given[0]}:{run_id}" in listing, listing
    time.sleep(0.5)  # the record is final; the inventory is read from the records
    assert all(g["held_by"] is None for g in _targets(gpu_daemon)["gpus"])
    harness.record(
        CHECK, "--gpus 1: device_count in the job", seen["device_count"], "", "torch.cuda.device_count() inside the job"
    )
    harness.record(
        CHECK,
        "--gpus 1: the job's device",
        f"{visible} ({seen['name']})",
        "",
        "CUDA_VISIBLE_DEVICES and torch.cuda.get_device_name(0) inside the job; the run record's gpus",
    )
    harness.record(CHECK, "targets list while running", f"{given[0]}:{run_id}", "", "`obd targets list` (held_by)")
