"""Hints for failed runs: the causes a user meets most, recognised from the log and exit status."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.service.hints import MAY_BE_OOM, KernelLine, hint, last_lines, oom_finding, plain


@pytest.mark.parametrize(
    "code, log, expected",
    [
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "GPU ran out of memory"),
        (1, "RuntimeError: HIP out of memory. Tried to allocate", "GPU ran out of memory"),
        (1, "ModuleNotFoundError: No module named 'peft'", "install peft"),
        (1, "RuntimeError: No CUDA GPUs are available", "no GPU device is visible"),
        (1, "RuntimeError: Found no NVIDIA driver on your system.", "no GPU device is visible"),
        (137, "step 40 ...", "OOM killer"),
        (143, "", "killed by SIGTERM"),
        (127, "", "command was not found"),
        (2, "ValueError: bad config", None),
    ],
)
def test_a_failed_run_gets_a_hint_for_causes_it_recognises(code: int, log: str, expected: str | None) -> None:
    got = hint(code, log)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got


def test_last_lines_skips_blank_lines_and_cuts_long_ones() -> None:
    data = b"one\n\n" + b"x" * 1000 + b"\ntwo\n\n"
    lines = last_lines(data, count=2, width=50)
    assert lines == ["x" * 50, "two"]


def test_a_progress_bar_s_line_is_quoted_as_the_terminal_showed_it_last() -> None:
    bar = "\x1b[32mepoch 1\x1b[0m  10%|#  | 1/10\r 50%|#####  | 5/10\r\x1b[K100%|##########| 10/10\x1b]0;title\x07"
    assert plain(bar) == "100%|##########| 10/10"
    data = b"loading\r\n" + bar.encode() + b"\nTraceback \x1b[1m(most recent call last)\x1b[0m\n"
    assert last_lines(data) == ["loading", "100%|##########| 10/10", "Traceback (most recent call last)"]


def unreadable() -> list[KernelLine]:
    raise PermissionError("dmesg_restrict")


@pytest.mark.parametrize(
    ("lines", "events", "said"),
    [
        # The kernel's log has an OOM kill while it ran: quoted, with when.
        ([KernelLine(150.0, "Out of memory: Killed process 4242 (python)")], None, "OOM killer, as its log says at "),
        ([KernelLine(150.0, "eth0: link up")], None, "not the kernel's OOM killer, as far as its log goes"),
        (
            [KernelLine(10.0, "Out of memory: Killed process 1 (x)")],
            None,
            "not the kernel's OOM killer",
        ),  # before it ran
        (unreadable, None, MAY_BE_OOM),  # dmesg unreadable: only "may be"
        (unreadable, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n", "its cgroup's memory.events counts oom_kill 1"),
        (unreadable, "oom 0\noom_kill 0\n", "counts no oom_kill"),
    ],
)
def test_a_sigkill_is_blamed_on_the_oom_killer_only_as_far_as_its_cgroup_or_the_kernel_s_log_says(
    tmp_path: Path, lines: object, events: str | None, said: str
) -> None:
    paths = []
    if events is not None:
        (tmp_path / "memory.events").write_text(events)
        paths = [str(tmp_path / "nowhere"), str(tmp_path / "memory.events")]
    log = lines if callable(lines) else (lambda: lines)
    found = oom_finding(100.0, 200.0, paths, log)  # type: ignore[arg-type]
    assert said in found, found
    assert said in (hint(137, "step 40", found) or "")
