"""Streaming CSV reading that survives bad files: one row at a time, errors counted, never raised.

Profiler output is often cut short (a job killed mid-write), carries preambles (amd-smi prints
warnings before its CSV), repeats its header (watch mode, concatenated files) or has fields
larger than Python's default limit (demangled kernel names). These helpers read such files as far
as they go and report what they skipped, so the parsers above them stay simple.
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

# Kernel names of heavily templated code run to tens of kilobytes; they are kept whole.
FIELD_LIMIT = 64 * 1024 * 1024
MAX_CSV_ERRORS = 1000  # past this many malformed lines a file is not CSV; stop reading it

_NON_ALNUM = re.compile(r"[^0-9a-z%]+")
_MISSING = frozenset({"", "n/a", "na", "nan", "-nan", "none", "null", "inf", "-inf", "+inf", "unknown"})


def _raise_field_limit() -> None:
    if csv.field_size_limit() < FIELD_LIMIT:
        csv.field_size_limit(FIELD_LIMIT)


def normalise(name: str) -> str:
    """A column name reduced to lower-case letters, digits and '%': `"Kernel_Name"` -> `kernelname`.

    rocprofv3, `rocpd convert` and amd-smi spell the same column with different case and
    separators across releases; matching on the reduced form accepts all of them.
    """
    return _NON_ALNUM.sub("", name.strip().lstrip("\ufeff").lower())


def open_text(path: Path) -> TextIO:
    """Open a profiler file as text; undecodable bytes become U+FFFD rather than an exception."""
    return open(path, encoding="utf-8", errors="replace", newline="")


def ends_with_newline(stream: object) -> bool | None:
    """Whether the file under `stream` ends with a line break (or is empty); None when it cannot be told.

    Reads the last byte with `os.pread`, so the stream's own position is left alone.
    """
    fileno = getattr(stream, "fileno", None)
    if fileno is None:
        return None
    try:
        fd = fileno()
        size = os.fstat(fd).st_size
        if size == 0:
            return True
        return os.pread(fd, 1, size - 1) in (b"\n", b"\r")
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class _TailWatch:
    """The lines of a stream, noting when one arrives without a line break (the file's last line, cut)."""

    def __init__(self, stream: Iterable[str]) -> None:
        self._stream = stream
        self.cut = False

    def __iter__(self) -> Iterator[str]:
        for line in self._stream:
            if not line.endswith(("\n", "\r")):
                self.cut = True
            yield line


class RowReader:
    """Iterate the rows of a CSV file, resuming after malformed lines and counting them; blank lines are skipped.

    A file that does not end with a line break may have been cut off mid-row (a job killed
    mid-write, a copy taken while the profiler was writing): its last row is dropped, never read
    as data (`"b",4,40` could be the first digits of 4096), and `cut_tail` is set so the caller
    can say so (`warn_cut_tail`).
    """

    def __init__(self, stream: Iterable[str]) -> None:
        _raise_field_limit()
        # Watching every line costs a little, so it is done only when the file does not
        # visibly end with a line break (or when that cannot be told).
        self._watch = _TailWatch(stream) if ends_with_newline(stream) is not True else None
        # A line csv cannot read (a NUL-padded tail left by a crash, a broken quote) raises
        # csv.Error; the loop below counts it and carries on with the next line.
        self._reader = csv.reader(self._watch if self._watch is not None else stream)
        self.errors = 0
        self.gave_up = False
        self.cut_tail = False

    def __iter__(self) -> Iterator[list[str]]:
        reader, watch = self._reader, self._watch
        while True:
            try:
                if watch is None:
                    # A blank line (rocprofv3 ends its files with one) is no row, not a bad one.
                    yield from filter(None, reader)
                    return
                for row in reader:
                    if watch.cut:
                        # The row that holds the unterminated last line: possibly cut short.
                        self.cut_tail = True
                        continue
                    if row:
                        yield row
                return
            except csv.Error:
                if watch is not None and watch.cut:
                    self.cut_tail = True  # the unreadable line is the cut-off last one
                    return
                self.errors += 1
                if self.errors > MAX_CSV_ERRORS:
                    self.gave_up = True
                    return

    def warn_cut_tail(self, label: str, warnings: list[str]) -> None:
        """Add the warning for a dropped last row to `warnings`, if a row was dropped."""
        if self.cut_tail:
            warnings.append(
                f"{label}: the file does not end with a newline, so its last row may be cut off; that row was dropped"
            )


def find_header(
    rows: Iterator[list[str]], wanted: dict[str, tuple[str, ...]], required: tuple[str, ...], max_lines: int = 200
) -> tuple[dict[str, int], list[str]] | None:
    """Scan for the first row that names every `required` column; return {key: index} and the row.

    `wanted` maps a key to the normalised spellings it may have. Lines before the header (a
    preamble) are skipped; `None` when no header turns up within `max_lines`.
    """
    for _ in range(max_lines):
        row = next(rows, None)
        if row is None:
            return None
        names = [normalise(cell) for cell in row]
        index: dict[str, int] = {}
        for key, spellings in wanted.items():
            for spelling in spellings:
                if spelling in names:
                    index[key] = names.index(spelling)
                    break
        if all(key in index for key in required):
            return index, row
    return None


@dataclass(frozen=True)
class TableSpec:
    """One kind of profiler CSV: the columns a parser reads, by every spelling each has had.

    `header` names the header in the warning for a file without one ("kernel-stats header (Name,
    TotalDurationNs)"); `skipped` names the rows in the `N unreadable <skipped> skipped` warning,
    or is None when the parser counts its bad rows itself.
    """

    columns: dict[str, tuple[str, ...]]
    required: tuple[str, ...]
    header: str
    skipped: str | None = "rows"


@dataclass
class Table:
    """A profiler CSV being read: where each column is, and the data rows as they stream past.

    `rows` is the one pass over the file after its header; a parser counts the rows it cannot use
    in `bad`, and `read_table` says how many were skipped when the file is done.
    """

    label: str
    index: dict[str, int]
    rows: Iterator[list[str]]
    reader: RowReader
    bad: int = 0
    width: int = field(init=False)

    def __post_init__(self) -> None:
        self.width = max(self.index.values()) + 1

    @property
    def errors(self) -> int:
        """Lines the csv module could not read (counted by the reader, not by the parser)."""
        return self.reader.errors

    def fits(self, row: list[str]) -> bool:
        """Whether the row reaches every column the header named (a shorter row is malformed)."""
        return len(row) >= self.width

    def cell(self, row: list[str], key: str) -> str:
        """The row's cell of column `key`; empty when the file has no such column or the row is short."""
        i = self.index.get(key, -1)
        return row[i] if 0 <= i < len(row) else ""

    def number(self, row: list[str], key: str) -> float | None:
        """The cell of `key` as a finite number (`parse_number`); None when missing or not a number."""
        return parse_number(self.cell(row, key))


@contextmanager
def read_table(path: Path, spec: TableSpec, warnings: list[str], label: str | None = None) -> Iterator[Table | None]:
    """Open a profiler CSV, find its header and hand its rows to the `with` block: the one row loop of runner/.

    Yields None (after adding a warning) when the file has no header `spec` accepts. Whatever
    the block does, the file ends with the same warnings: rows skipped, a read given up, a last
    row dropped as possibly cut off; a file that cannot be read adds `could not be read`
    instead of raising.
    """
    label = label or path.name
    handed = False
    try:
        with open_text(path) as stream:
            reader = RowReader(stream)
            rows = iter(reader)
            found = find_header(rows, spec.columns, spec.required)
            if found is None:
                warnings.append(f"{label}: no {spec.header} found; file skipped")
                reader.warn_cut_tail(label, warnings)
                handed = True
                yield None
                return
            table = Table(label=label, index=found[0], rows=rows, reader=reader)
            handed = True
            yield table
            _close(table, spec, warnings)
    except OSError as exc:
        warnings.append(f"{label}: could not be read ({exc.strerror or exc})")
        if not handed:
            yield None


def _close(table: Table, spec: TableSpec, warnings: list[str]) -> None:
    """The warnings of a file read to its end (or as far as the parser went)."""
    skipped = table.bad + table.errors
    if spec.skipped is not None and skipped:
        warnings.append(f"{table.label}: {skipped} unreadable {spec.skipped} skipped")
    if table.reader.gave_up:
        warnings.append(f"{table.label}: too many malformed lines; read stopped early")
    table.reader.warn_cut_tail(table.label, warnings)


def parse_number(text: str | None) -> float | None:
    """A finite number from a cell, tolerating units and thousands separators; None for N/A or NaN.

    `"87 %"` -> 87.0, `"1,024"` -> 1024.0, `"N/A"` -> None, `"nan"` -> None.
    """
    if text is None:
        return None
    cell = text.strip()
    if cell.lower() in _MISSING:
        return None
    try:
        value = float(cell)
    except ValueError:
        match = re.match(r"^\s*([-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?)", cell)
        if not match:
            return None
        try:
            value = float(match.group(1).replace(",", ""))
        except ValueError:
            return None
    return value if math.isfinite(value) else None


def unit_of(text: str | None) -> str | None:
    """The unit written after a number in a cell (`"12 GB"` -> `"gb"`), lower-case; None if bare."""
    if not text:
        return None
    match = re.match(r"^\s*[-+]?[\d.,eE+-]+\s*([A-Za-z%/°]+)\s*$", text)
    return match.group(1).lower() if match else None
