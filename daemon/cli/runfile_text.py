"""A run file's TOML text read before (and beside) the parser: where each key is set, for the
messages that name a line, and how deep its arrays and inline tables nest, so that a file the
parser would recurse on without end is refused with its line (docs/run-file.md).
Standard library only, as every module the client imports.
"""

from __future__ import annotations

import json
import re

MAX_NESTING = 64  # arrays and inline tables inside each other; a run file needs 3


def nested_too_deep(text: str) -> int | None:
    """The line (from 1) where TOML `text` nests arrays or inline tables past MAX_NESTING, else None:
    counted before the parser, which recurses once a level and would fail with a RecursionError.
    Strings (with their escapes, multi-line ones too) and comments are skipped."""
    depth, line, i, size = 0, 1, 0, len(text)
    while i < size:
        char = text[i]
        if char == "\n":
            line += 1
        elif char == "#":
            end = text.find("\n", i)
            i = size if end < 0 else end
            continue
        elif char in "\"'":
            quote = text[i : i + 3] if text[i : i + 3] in ('"""', "'''") else char
            i += len(quote)
            while i < size and not text.startswith(quote, i):
                if text[i] == "\\" and quote[0] == '"':
                    i += 1  # what it escapes, a line break included
                if i < size and text[i] == "\n":
                    line += 1
                i += 1
            i += len(quote)
            continue
        elif char in "[{":
            depth += 1
            if depth > MAX_NESTING:
                return line
        elif char in "]}":
            depth = max(depth - 1, 0)
        i += 1
    return None


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The line (from 1) where each key of a TOML text is set or its table opens, by its path:
    `("gpus",)`, `("env", "WANDB_PROJECT")`. tomllib keeps no positions, and an error has to name
    the line; multi-line strings are skipped, so a `key = ...` inside one is not taken for a key."""
    found: dict[tuple[str, ...], int] = {}
    table: tuple[str, ...] = ()
    quote = ""  # the multi-line string the line is in, if any
    part = r"""(?:[A-Za-z0-9_-]+|"(?:[^"\\]|\\.)*"|'[^']*')"""
    dotted = rf"{part}(?:\s*\.\s*{part})*"
    for number, line in enumerate(text.splitlines(), start=1):
        if quote:
            if line.count(quote) % 2 == 1:
                quote = ""
            continue
        header = re.match(rf"^\s*\[\[?\s*({dotted})\s*\]\]?", line)
        assign = None if header else re.match(rf"^\s*({dotted})\s*=", line)
        if header:
            table = _parts(header.group(1), part)
            found.setdefault(table, number)
        elif assign:
            found.setdefault(table + _parts(assign.group(1), part), number)
            rest = line[assign.end() :]
            for mark in ('"""', "'''"):
                if rest.count(mark) % 2 == 1:
                    quote = mark
    return found


def _parts(dotted: str, part: str) -> tuple[str, ...]:
    names = []
    for piece in re.findall(part, dotted):
        if piece.startswith('"'):
            names.append(json.loads(piece))
        elif piece.startswith("'"):
            names.append(piece[1:-1])
        else:
            names.append(piece)
    return tuple(names)
