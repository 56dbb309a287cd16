"""Run files written out (docs/run-file.md): values as TOML text, or as JSON for `--json`.

Apart from the keys' checks (daemon/cli/runfile.py) because printing needs none of them: the
dry run, `status --as-file` (daemon/cli/runfile_record.py) and the Python API share it.
Standard library only, as every module the client imports.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable
from typing import Any

TABLES = ("env", "grid")  # the keys a run file holds as TOML tables (runfile.ENV, runfile.GRID)
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def dumps(values: dict[str, Any], comments: Iterable[str] = (), trailer: Iterable[str] = ()) -> str:
    """Values as a run file: comment lines, the keys in order, `env` and `grid` as tables at the end, then
    the trailer's comment lines (the names of env values that are not known)."""
    lines = [f"# {_comment(text)}" for text in comments]
    for name, value in values.items():
        if name not in TABLES:
            lines.append(f"{_key(name)} = {_value(value)}")
    for table in TABLES:  # tables after every plain key, as TOML wants
        if values.get(table):
            lines += ["", f"[{table}]", *(f"{_key(name)} = {_value(v)}" for name, v in values[table].items())]
    lines += [f"# {_comment(text)}" if text else "" for text in trailer]
    return "\n".join(lines) + "\n"


def _comment(text: str) -> str:
    return "".join(c if c.isprintable() else "?" for c in text)


def _key(name: str) -> str:
    return name if _BARE_KEY.match(name) else _string(name)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def _string(text: str) -> str:
    r"""A TOML basic string: JSON's escapes are TOML's, and every character a terminal would act
    on (controls, DEL, line separators, bidirectional overrides) is written as \uXXXX."""
    out = []
    for char in json.dumps(text, ensure_ascii=False)[1:-1]:
        category = unicodedata.category(char)
        if category == "Cs":
            out.append("\ufffd")  # a lone surrogate: no TOML string can hold it
        elif category in ("Cc", "Zl", "Zp", "Cf"):
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def as_json(values: dict[str, Any]) -> str:
    return json.dumps(values, indent=1)
