"""The GPUs of this machine: found with the vendors' tools, or given by the config.

NVIDIA's are listed with `nvidia-smi` (NVML's own tool: index, name, memory and UUID of each),
AMD's with `amd-smi` (or `rocm-smi`); a machine without them has none. The config may name them
instead (`gpus = ["0", "1"]`, or `gpus = 0` for none), which is also how a machine without GPUs
tests the queue.

An NVIDIA device's id is its `nvidia-smi` index, which numbers the GPUs in PCI bus order. CUDA
numbers them fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so on a machine with GPUs of
different kinds `CUDA_VISIBLE_DEVICES=1` alone could give a job another card than the one obd
handed it: `visible_devices` sets the order with the ids.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

VENDORS = ("nvidia", "amd")


@dataclass(frozen=True)
class Gpu:
    """One device as jobs name it (`CUDA_VISIBLE_DEVICES`/`HIP_VISIBLE_DEVICES` take `id`)."""

    id: str
    vendor: str | None = None  # None: given by the config without a vendor
    name: str = ""
    memory_mib: int | None = None  # total device memory as the vendor's tool reports it; None: not reported
    uuid: str | None = None  # NVIDIA's GPU-... identifier, stable across reboots and renumbering


def _run(argv: list[str], timeout: float = 10.0) -> str | None:
    if not shutil.which(argv[0]):
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


NVIDIA_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"]


def parse_nvidia_query(text: str) -> list[Gpu]:
    """The GPUs in `nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits` output.

    The index comes first and the memory (MiB) and UUID last, so a name holding a comma stays
    whole; a memory of `[N/A]` (some MIG and vGPU setups) is None. Lines that do not start with
    an index (a warning nvidia-smi printed) are skipped.
    """
    gpus = []
    for line in text.splitlines():
        index, _, rest = line.partition(",")
        fields = rest.rsplit(",", 2)
        if not index.strip().isdigit() or len(fields) != 3:
            continue
        name, memory, uuid = (field.strip() for field in fields)
        gpus.append(
            Gpu(
                index.strip(),
                "nvidia",
                name,
                int(memory) if memory.isdigit() else None,
                uuid if uuid.startswith(("GPU-", "MIG-")) else None,
            )
        )
    return gpus


NVIDIA_APPS = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader,nounits"]


def parse_compute_apps(text: str) -> dict[str, set[int]]:
    """Device UUID -> the pids of its compute processes, from `nvidia-smi --query-compute-apps=gpu_uuid,pid`."""
    out: dict[str, set[int]] = {}
    for line in text.splitlines():
        uuid, _, pid = (part.strip() for part in line.partition(","))
        if uuid.startswith(("GPU-", "MIG-")) and pid.isdigit():
            out.setdefault(uuid, set()).add(int(pid))
    return out


def compute_pids(gpus: list[Gpu]) -> dict[str, set[int]]:
    """Device id -> the pids of the compute processes the vendor's tool lists on it (NVIDIA devices
    known by their UUID; {} where no tool can say)."""
    uuids = {g.uuid: g.id for g in gpus if g.vendor == "nvidia" and g.uuid}
    if not uuids:
        return {}
    apps = parse_compute_apps(_run(NVIDIA_APPS) or "")
    return {uuids[u]: pids for u, pids in apps.items() if u in uuids}


def nvidia_gpus() -> list[Gpu]:
    return parse_nvidia_query(_run(NVIDIA_QUERY) or "")


def amd_gpus() -> list[Gpu]:
    text = _run(["amd-smi", "list", "--json"])
    if text:
        try:
            items = json.loads(text)
        except ValueError:
            items = []
        gpus = [
            Gpu(str(i["gpu"]), "amd", str(i.get("market_name") or ""))
            for i in items
            if isinstance(i, dict) and "gpu" in i
        ]
        if gpus:
            return gpus
    text = _run(["rocm-smi", "--showid", "--json"])
    try:
        cards = json.loads(text) if text else {}
    except ValueError:
        cards = {}
    return [Gpu(key.removeprefix("card"), "amd") for key in sorted(cards) if key.startswith("card")]


def discover() -> list[Gpu]:
    """This machine's GPUs, NVIDIA's first; none where no vendor tool answers."""
    return nvidia_gpus() or amd_gpus()


def configured(value: list[str] | int | None, vendor: str | None) -> list[Gpu] | None:
    """The GPUs a target's config names (None: discover them)."""
    if value is None:
        return None
    if isinstance(value, int):
        if value == 0:
            return []
        return [Gpu(str(i), vendor) for i in range(value)]
    return [Gpu(str(v), vendor) for v in value]


def visible_devices(gpus: list[Gpu]) -> dict[str, str]:
    """The variables that give a job exactly these devices, as each vendor expects."""
    ids = ",".join(g.id for g in gpus)
    vendors = {g.vendor for g in gpus}
    env = {"CUDA_VISIBLE_DEVICES": ids}
    if "nvidia" in vendors:
        # The ids are nvidia-smi's indices (PCI bus order); CUDA must count the same way.
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if "amd" in vendors or None in vendors or not gpus:
        # ROCm reads HIP_VISIBLE_DEVICES (and ROCR_VISIBLE_DEVICES below the runtime); PyTorch on
        # ROCm also honours CUDA_VISIBLE_DEVICES. An empty list hides every device.
        env["HIP_VISIBLE_DEVICES"] = ids
        env["ROCR_VISIBLE_DEVICES"] = ids
    return env
