"""Hints for failed runs: what a job's exit status and the end of its log say went wrong."""

from __future__ import annotations

import re
import signal

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"(CUDA|HIP) out of memory|OutOfMemoryError|torch\.OutOfMemoryError|hipErrorOutOfMemory", re.I),
        "the GPU ran out of memory: lower the batch size or sequence length, or enable gradient checkpointing",
    ),
    (
        re.compile(r"ModuleNotFoundError: No module named '([^']+)'"),
        "a Python module is missing on the target: install {0} in the job's environment "
        "(or set the target's python/venv)",
    ),
    (
        re.compile(
            r"no CUDA GPUs are available|Found no NVIDIA driver|No HIP GPUs are available|"
            r"CUDA driver initialization failed|torch\.cuda\.is_available\(\) is False|"
            r"no ROCm-capable device|CUDA_VISIBLE_DEVICES.*no devices",
            re.I,
        ),
        "no GPU device is visible to the job: check CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES "
        "and the driver (`nvidia-smi` or `amd-smi list`)",
    ),
    (
        re.compile(r"obd: could not start .*No such file or directory"),
        "the command does not exist on the target: check its spelling and PATH",
    ),
]


def signal_name(code: int) -> str | None:
    if 128 < code < 128 + 65:
        try:
            return signal.Signals(code - 128).name
        except ValueError:
            return f"signal {code - 128}"
    return None


def hint(exit_code: int | None, log_tail: str) -> str | None:
    """A one-line hint for a failed run, or None when nothing is recognised."""
    for pattern, text in _PATTERNS:
        match = pattern.search(log_tail)
        if match:
            return text.format(*match.groups())
    if exit_code == 127:
        return "the command was not found: check its spelling and PATH on the target"
    name = signal_name(exit_code or 0)
    if name == "SIGKILL":
        return "killed by SIGKILL: often the kernel's OOM killer (check `dmesg` or `journalctl -k` for 'Out of memory')"
    if name:
        return f"killed by {name}"
    return None


def last_lines(data: bytes, count: int = 5, width: int = 300) -> list[str]:
    text = data.decode("utf-8", "replace")
    lines = [line.rstrip()[:width] for line in text.splitlines() if line.strip()]
    return lines[-count:]
