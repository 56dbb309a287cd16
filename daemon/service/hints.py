"""Hints for failed runs: what a job's exit status and the end of its log say went wrong.

A job killed by SIGKILL is not blamed on the kernel's OOM killer without a look: on the machine
the job ran on (a local target), the cgroup its scope left (`memory.events`'s `oom_kill`) and the
kernel's log (/dev/kmsg, what `dmesg` reads) are searched for an OOM kill while it ran, and the
hint says what was found; where neither can be read it says the OOM killer *may* be the cause.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


def hint(exit_code: int | None, log_tail: str, oom: str | None = None) -> str | None:
    """A one-line hint for a failed run, or None when nothing is recognised. `oom`: what a look for
    an OOM kill found (`oom_finding`), for a job killed by SIGKILL; None when none could be made."""
    for pattern, text in _PATTERNS:
        match = pattern.search(log_tail)
        if match:
            return text.format(*match.groups())
    if exit_code == 127:
        return "the command was not found: check its spelling and PATH on the target"
    name = signal_name(exit_code or 0)
    if name == "SIGKILL":
        return f"killed by SIGKILL: {oom or MAY_BE_OOM}"
    if name:
        return f"killed by {name}"
    return None


MAY_BE_OOM = (
    "it may be the kernel's OOM killer (its log could not be read here: check `sudo dmesg` or "
    "`journalctl -k` for 'Out of memory' on the machine it ran on)"
)

# Escape sequences of terminals (CSI: colours, cursor moves, line erases; OSC: titles, links;
# and the two-byte ones), and the other control characters but the tab.
_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[@-_]?|\x9b[0-?]*[ -/]*[@-~]")
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def plain(line: str) -> str:
    """A log line as a terminal showed it at the end: a progress bar's carriage returns keep only
    what was written last, and terminal escapes and control characters are dropped."""
    line = _ESCAPES.sub("", line)
    shown = [part for part in line.split("\r") if part.strip()]
    return _CONTROLS.sub("", shown[-1] if shown else "")


def last_lines(data: bytes, count: int = 5, width: int = 300) -> list[str]:
    """The last `count` non-blank lines of a log's end, as a terminal showed them (`plain`), cut at `width`."""
    text = data.decode("utf-8", "replace")
    lines = [plain(line).rstrip()[:width] for line in text.split("\n")]
    return [line for line in lines if line.strip()][-count:]


# --- was it the OOM killer? ------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelLine:
    """One line of the kernel's log: when (unix time) and what."""

    time: float
    text: str


OOM_LINE = re.compile(r"Out of memory|oom-kill|Killed process \d+|Memory cgroup out of memory", re.I)
SLACK = 5.0  # seconds around the run in which a kernel line is taken as its


def read_kmsg(path: str = "/dev/kmsg") -> list[KernelLine]:
    """The kernel's log as /dev/kmsg holds it now (what `dmesg` reads), each line's time made unix
    time. Raises OSError when it cannot be read (`kernel.dmesg_restrict`, a container)."""
    with open(path, "rb", buffering=0) as f:
        os.set_blocking(f.fileno(), False)
        raw: list[bytes] = []
        while True:
            try:
                record = f.read(8192)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # a record overwritten while read: go on with the next
                    continue
                raise
            if not record:
                break
            raw.append(record)
    boot = time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)
    out = []
    for record in raw:
        head, _, text = record.decode("utf-8", "replace").partition(";")
        fields = head.split(",")
        if len(fields) >= 3 and fields[2].isdigit():
            out.append(KernelLine(boot + int(fields[2]) / 1e6, text.splitlines()[0] if text else ""))
    return out


def cgroup_oom_kills(events_path: str) -> int | None:
    """`oom_kill` of a cgroup's memory.events, or None when it cannot be read."""
    try:
        with open(events_path) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill" and value.strip().isdigit():
                    return int(value)
    except OSError:
        return None
    return None


def scope_events(run_id: str) -> list[str]:
    """Where the memory.events of the systemd scope a local job ran in would be (executors/local.py
    names it `obd-run-<id>.scope`), while it still exists."""
    uid = os.geteuid()
    scope = f"obd-run-{run_id}.scope"
    return [
        f"/sys/fs/cgroup/system.slice/{scope}/memory.events",
        f"/sys/fs/cgroup/user.slice/user-{uid}.slice/user@{uid}.service/app.slice/{scope}/memory.events",
    ]


def oom_finding(
    started: float,
    ended: float,
    cgroup_events: Sequence[str] = (),
    kernel_log: Callable[[], list[KernelLine]] = read_kmsg,
) -> str:
    """What a look for an OOM kill of a job that ran from `started` to `ended` on this machine found,
    in words: its cgroup's `oom_kill` count where the cgroup still exists, else an OOM line of the
    kernel's log while it ran (quoted), else that there was none; `MAY_BE_OOM` when neither can be read."""
    for path in cgroup_events:
        kills = cgroup_oom_kills(path)
        if kills is not None:
            if kills:
                return f"the kernel's OOM killer killed it (its cgroup's memory.events counts oom_kill {kills})"
            return "not the kernel's OOM killer (its cgroup's memory.events counts no oom_kill): something else sent it"
    try:
        lines = kernel_log()
    except OSError:
        return MAY_BE_OOM
    found = [x for x in lines if started - SLACK <= x.time <= ended + SLACK and OOM_LINE.search(x.text)]
    if found:
        killed = next((x for x in found if "Killed process" in x.text or "oom-kill" in x.text), found[-1])
        when = time.strftime("%H:%M:%S", time.localtime(killed.time))
        return f"the kernel's OOM killer, as its log says at {when}: {plain(killed.text).strip()[:200]!r}"
    return (
        "not the kernel's OOM killer, as far as its log goes (no 'Out of memory' while it ran): "
        "a person or another program sent it"
    )
