"""Where `obd train logs --tail N` starts reading: the last N lines of a log, on a target or in a retrieved copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.service import handlers
from daemon.service.handlers import newlines_back, tail_start


async def tail_of(data: bytes, lines: int) -> bytes:
    async def read(start: int, size: int) -> bytes:
        return data[start : start + size]

    return data[await tail_start(read, len(data), lines) :]


@pytest.mark.parametrize(
    ("data", "lines", "tail"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),  # no newline after the last line
        (b"a\nb\nc\n", 3, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 10, b"a\nb\nc\n"),  # more lines asked than there are
        (b"a\nb\nc\n", 0, b""),
        (b"", 3, b""),
        (b"\n\n\n", 2, b"\n\n"),  # empty lines count
        (b"one line, no newline", 1, b"one line, no newline"),
    ],
)
async def test_the_tail_is_the_last_lines_whatever_the_file_ends_with(data: bytes, lines: int, tail: bytes) -> None:
    assert await tail_of(data, lines) == tail


async def test_lines_that_straddle_the_read_blocks_are_counted_once() -> None:
    lines = [f"line {i} ".encode() * (i % 7 + 1) + b"\n" for i in range(20_000)]
    data = b"".join(lines)
    assert len(data) > 10 * handlers.TAIL_BLOCK
    for n in (1, 5, 1_000, 19_999):
        assert await tail_of(data, n) == b"".join(lines[-n:])


def test_newlines_back_reports_how_many_it_found_when_a_block_runs_out() -> None:
    # The bytes 10..15 of a 16-byte file ending in a newline: one line start in them, none past the end.
    assert newlines_back(b"xx\nyy\n", 10, 16, 3) == (None, 1)
    assert newlines_back(b"xx\nyy\n", 10, 16, 1) == (13, 1)


async def test_a_retrieved_log_over_16_mib_tails_from_its_end(tmp_path: Path) -> None:
    # A pod's run: its log was brought home, and --tail reads the copy. It once read only the
    # first 16 MiB, so a bigger log showed lines from its middle.
    log = tmp_path / "job.log"
    line = b"x" * 1023 + b"\n"
    with log.open("wb") as f:
        for _ in range(17 * 1024):
            f.write(line)
        f.write(b"the end, line 1\nthe end, line 2\n")
    offset = await handlers._tail_local(log, 2)
    assert log.read_bytes()[offset:] == b"the end, line 1\nthe end, line 2\n"
