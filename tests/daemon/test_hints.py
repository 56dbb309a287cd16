"""Hints for failed runs: the causes a user meets most, recognised from the log and exit status."""

from __future__ import annotations

import pytest

from daemon.hints import hint, last_lines


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
