"""Run files: everything `obd train start` takes, in a TOML file (docs/run-file.md).

`obd train start -f run.toml [--set KEY=VALUE]... [FLAGS] [-- COMMAND ...]` reads the file,
applies each `--set` to it, then the flags given on the command line, then the command after
`--`; `--dry-run` prints the result (as a run file, or JSON) and starts nothing.
`obd train status RUN --as-file` prints a run's start as a run file (daemon/cli/runfile_record.py;
the TOML writing is daemon/cli/runfile_toml.py). The Python API
(`daemon/cli/sdk.py`) validates `client.start(**options)` with the same keys.

The keys are the start command's flags, by the name of their value (`--output-to` is
`output_to`, `--secret` is `secrets`), found in the parser itself: a flag added to
`obd train start` is a key of the run file with nothing to change here (its value goes through
the flag's own type). A handful of keys have a TOML shape of their own (`command`, `script`,
`args`, `env`, `secrets`, `gpus`, `cwd`, `checkpoint`). Validation is plain code: the client
is standard library only (no pydantic), and every error names the file, the line and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.cli.common import UsageError
from daemon.cli.runfile_text import MAX_NESTING, key_lines, nested_too_deep
from daemon.cli.runfile_toml import as_json, dumps

# Flags of `obd train start` that say what the command does, not what the run is.
NOT_KEYS = frozenset({"help", "json", "file", "set", "dry_run", "command"})
RENAMED = {"secret": "secrets"}  # a flag given once per name is a list of names in a file

# The kinds of value a key holds (what TOML shape is accepted, and what it becomes).
COMMAND, SCRIPT, ARGS = "command", "script", "args"  # the job's command (not flags)
ENV, NAMES, GPUS, CWD, CHECKPOINT = "env", "names", "gpus", "cwd", "checkpoint"  # flags of a shape of their own
BOOL, LIST, TYPED, TEXT = "bool", "list", "typed", "text"  # any other flag, by its argparse action
TARGETS = "targets"  # `--target`: one target or pool, or several in order of preference
SHAPES = {"env": ENV, "secret": NAMES, "gpus": GPUS, "cwd": CWD, "checkpoint": CHECKPOINT, "target": TARGETS}
GRID = "grid"  # a sweep's grid: `obd train sweep -f` (no flag of `obd train start`)

DOC = "docs/run-file.md"
ENV_NOTE = (
    "env values are not kept in run records, only their names: give each again (in [env] below, "
    "or with --env NAME=VALUE)"
)
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_INT_RE = re.compile(r"^[+-]?\d+$")
_FLOAT_RE = re.compile(r"^[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?$")


class RunFileError(UsageError):
    """A run file, a `--set` or an API option that is not valid: the message says where and why."""


@dataclass(frozen=True)
class Key:
    """One key of a run file: the flag it stands for and how its value is checked."""

    name: str
    kind: str
    flag: str  # as people know it: `--gpus`, `-- COMMAND`
    dest: str | None = None  # the start parser's attribute; None for command, script and args
    convert: Callable[[str], Any] | None = None  # the flag's own type (a whole number, a duration...)
    choices: tuple[Any, ...] | None = None
    help: str = ""


_COMMAND_KEYS = (
    Key(
        "command",
        COMMAND,
        "-- COMMAND",
        help="the job's command: a list of words, or one string split as a shell would",
    ),
    Key(
        "script", SCRIPT, "-- python SCRIPT", help="instead of command: a Python script, run as `python SCRIPT ARGS...`"
    ),
    Key("args", ARGS, "-- ... ARGS", help="words added after command or script"),
)
# Last in a printed file: a table, and TOML puts tables after the plain keys.
_GRID_KEY = Key(
    "grid",
    GRID,
    "obd train sweep --grid",
    help="a sweep (obd train sweep -f): a table of NAME = [values], one run per combination",
)


def schema() -> dict[str, Key]:
    """Every key a run file may hold, in the order a run file is printed: the command's, then
    those of `obd train start`'s flags, in the parser's order."""
    keys = {key.name: key for key in _COMMAND_KEYS}
    flags: dict[str, list[str]] = {}
    for action in start_parser()._actions:
        if action.dest in NOT_KEYS or not action.option_strings:
            continue
        name = RENAMED.get(action.dest, action.dest)
        flags.setdefault(name, []).append(max(action.option_strings, key=len))
        if name in keys:
            keys[name] = dataclasses.replace(keys[name], flag="/".join(flags[name]))
            continue
        keys[name] = Key(
            name=name,
            kind=SHAPES.get(action.dest) or _kind(action),
            flag=flags[name][0],
            dest=action.dest,
            convert=action.type if callable(action.type) else None,
            choices=tuple(action.choices) if action.choices else None,
            help=action.help or "",
        )
    keys[GRID] = _GRID_KEY
    return keys


def _kind(action: argparse.Action) -> str:
    if action.nargs == 0:
        return BOOL  # --profile, --preemptible/--no-preemptible
    if isinstance(action, argparse._AppendAction) or action.nargs in ("*", "+"):
        return LIST
    return TYPED if callable(action.type) else TEXT


def start_parser() -> argparse.ArgumentParser:
    """`obd train start`'s own parser (a fresh one, which the caller may change)."""
    from daemon.cli.parser import _parser

    return _subparser(_subparser(_parser(), "train"), "start")


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found: argparse.ArgumentParser = action.choices[name]
            return found
    raise LookupError(name)


# --- where a value came from, for messages --------------------------------------------------


@dataclass
class Origin:
    """Where the values being checked came from: a file (its keys' lines), `--set`, or the API."""

    label: str  # `run.toml`, `--set`, `start()`
    base: Path  # what a relative cwd is relative to
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    sets: dict[str, str] = field(default_factory=dict)  # a key given by --set: the words given

    def error(self, path: tuple[str, ...], problem: str) -> RunFileError:
        dotted = ".".join(path)
        keys = tuple(part.split("[")[0] for part in path)  # `args[1]` is on the line of `args`
        if keys and keys[0] in self.sets:
            return RunFileError(f"--set {self.sets[keys[0]]}: {dotted}: {problem}")
        for size in range(len(keys), 0, -1):
            line = self.lines.get(keys[:size])
            if line is not None:
                return RunFileError(f"{self.label}:{line}: {dotted}: {problem}")
        return RunFileError(f"{self.label}: {dotted}: {problem}")


# --- checking values --------------------------------------------------------------------------


NEST_TOO_DEEP = f"arrays or tables nested more than {MAX_NESTING} deep: no key of a run file takes that ({DOC})"


def load(path: str | os.PathLike[str], sets: Iterable[str] = ()) -> dict[str, Any]:
    """A run file's values, checked, with each `--set KEY=VALUE` applied first (a `--set` edits
    the file: it replaces a key's value, or sets one name of `env` with `env.NAME=VALUE`)."""
    import tomllib

    label = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RunFileError(f"-f {label}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RunFileError(f"-f {label}: cannot read it ({exc})") from None
    deep = nested_too_deep(text)
    if deep is not None:
        raise RunFileError(f"{label}:{deep}: {NEST_TOO_DEEP}")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RunFileError(f"{label}: not valid TOML: {exc}") from None
    except RecursionError:  # nested in a way the count above does not see: still a message
        raise RunFileError(f"{label}: {NEST_TOO_DEEP}") from None
    origin = Origin(label, Path(path).resolve().parent, key_lines(text))
    apply_sets(raw, sets, origin)
    return check(raw, origin)


def apply_sets(raw: dict[str, Any], sets: Iterable[str], origin: Origin) -> None:
    """`--set KEY=VALUE` into the raw values: VALUE is read as a TOML value where it is one
    (`--set gpus=2`, `--set 'args=["--lr", "1e-4"]'`), else taken as a string (`--set name=sft`)."""
    import tomllib

    for given in sets:
        key, sep, text = given.partition("=")
        key = key.strip()
        if not sep or not key:
            raise RunFileError(f"--set {given!r}: expected KEY=VALUE, e.g. --set gpus=2")
        if nested_too_deep(text) is not None:
            raise RunFileError(f"--set {key}=...: {NEST_TOO_DEEP}")
        try:
            value: Any = tomllib.loads(f"value = {text}")["value"]
        except tomllib.TOMLDecodeError:
            value = text
        except RecursionError:
            raise RunFileError(f"--set {key}=...: {NEST_TOO_DEEP}") from None
        first, _, name = key.partition(".")
        origin.sets[first] = given
        if first in (ENV, GRID) and name:
            table = raw.setdefault(first, {})
            if not isinstance(table, dict):
                raise origin.error((first,), f"is not a table, so {first}.NAME cannot be set in it")
            table[name] = value
        elif name:
            raise RunFileError(f"--set {given}: only env and grid take a name after a dot (env.NAME=VALUE)")
        else:
            raw[first] = value
            if first in (COMMAND, SCRIPT):  # a command from --set replaces the file's, its args included
                for other in (COMMAND, SCRIPT, ARGS):
                    if other != first:
                        raw.pop(other, None)


def check(
    raw: dict[str, Any], origin: Origin, keys: dict[str, Key] | None = None, whole: bool = True
) -> dict[str, Any]:
    """The values of a run file (or of the API's options), each checked for its key; an unknown
    key or a wrong value is an error naming where it is and what is expected, every one of them
    in one RunFileError (a line each). `whole`: the
    values are a whole run, whose command keys go together (not options laid over a file)."""
    keys = schema() if keys is None else keys
    values: dict[str, Any] = {}
    errors: list[RunFileError] = []
    for name, value in raw.items():
        key = keys.get(name)
        try:
            if key is None:
                raise origin.error((name,), _unknown(name, keys))
            values[name] = _checked(key, value, origin)
        except RunFileError as exc:
            errors.append(exc)  # and the next key: every error of the file is said at once
    if whole:
        try:
            check_command_keys(values, origin)
        except RunFileError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        said = "\n".join(f"  {exc}" for exc in errors)
        raise RunFileError(f"{origin.label}: {len(errors)} errors, each to fix:\n{said}")
    return values


def check_command_keys(values: dict[str, Any], origin: Origin) -> None:
    """`command` or `script`, not both; `args` only after one of them."""
    if COMMAND in values and SCRIPT in values:
        raise origin.error((SCRIPT,), "give command or script, not both")
    if ARGS in values and COMMAND not in values and SCRIPT not in values:
        raise origin.error((ARGS,), "args are added to command or script: give one of them")


def _unknown(name: str, keys: dict[str, Key]) -> str:
    import difflib

    guess = name.replace("-", "_").lower()
    close = [guess] if guess in keys else difflib.get_close_matches(name, list(keys), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"unknown key{hint}; the keys are the start flags' names ({', '.join(keys)}), see {DOC}"


def _shown(value: Any) -> str:
    """A value as the message shows it, with its TOML type."""
    if isinstance(value, bool):
        return f"{str(value).lower()} (true or false)"
    if isinstance(value, int | float):
        return f"{value} (a number)"
    if isinstance(value, str):
        return f"{json.dumps(value)} (a string)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return f"{value} (a date or time)"


def _checked(key: Key, value: Any, origin: Origin) -> Any:
    """One value, checked against its key; what it is as a run file holds it."""
    path = (key.name,)

    def wrong(expected: str, at: tuple[str, ...] = path, given: Any = value) -> RunFileError:
        return origin.error(at, f"expected {expected}, not {_shown(given)}")

    kind = key.kind
    if kind == BOOL:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if kind in (TEXT, SCRIPT, CWD):
        if not isinstance(value, str) or not value.strip():
            raise wrong("a string" if not isinstance(value, str) else "a string that is not empty")
        if kind == CWD:
            base = Path.cwd() if key.name in origin.sets else origin.base
            return str((base / Path(value).expanduser()).resolve())
        return _choice(key, value, origin)
    if kind == TYPED:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise wrong(f"a value of {key.flag} (a string or a number)")
        _convert(key, str(value), origin, path)
        return value
    if kind == COMMAND:
        if isinstance(value, str):
            try:
                words = shlex.split(value)
            except ValueError as exc:
                raise origin.error(path, f"cannot split it into words as a shell would ({exc})") from None
            if not words:
                raise wrong("a command")
            return words
        return _strings(key, value, origin, nonempty=True)
    if kind == ARGS:
        return _strings(key, value, origin)
    if kind == LIST:
        words = _strings(key, value, origin)
        for i, word in enumerate(words):
            _convert(key, word, origin, (f"{key.name}[{i}]",))
        return words
    if kind == NAMES:
        names = _strings(key, value, origin)
        for i, name in enumerate(names):
            if not _NAME_RE.match(name):
                raise origin.error((f"{key.name}[{i}]",), f"{json.dumps(name)} is not an environment variable name")
        return list(dict.fromkeys(names))
    if kind == ENV:
        if not isinstance(value, dict):
            raise wrong('a table of NAME = "value"')
        env: dict[str, str] = {}
        for name, text in value.items():
            at = (ENV, name)
            if not _NAME_RE.match(name):
                raise origin.error(at, "not an environment variable name (letters, digits and _)")
            if isinstance(text, bool) or not isinstance(text, str | int):
                raise wrong(f'a string (quote it: {name} = "...")', at, text)
            env[name] = str(text)
        return env
    if kind == GPUS:
        return _gpus(value, origin, wrong)
    if kind == TARGETS:  # "box", "a,b", or ["a", "b"]: targets in order of preference (docs/placement.md)
        if isinstance(value, str) and value.strip():
            return value
        if isinstance(value, list) and value and all(isinstance(v, str) and v.strip() and "," not in v for v in value):
            return list(value)
        raise wrong('a target or pool ("box"), or targets in order of preference (["a", "b"] or "a,b")')
    if kind == GRID:
        return _grid(value, origin, wrong)
    if kind == CHECKPOINT:
        if isinstance(value, bool) or not isinstance(value, str | int) or (isinstance(value, int) and value < 0):
            raise wrong("a step number, latest, or a path")
        return value
    raise AssertionError(f"no check for the kind {kind}")


def _strings(key: Key, value: Any, origin: Origin, nonempty: bool = False) -> list[str]:
    if not isinstance(value, list):
        raise origin.error((key.name,), f'expected a list of strings, e.g. {key.name} = ["..."], not {_shown(value)}')
    for i, word in enumerate(value):
        if not isinstance(word, str):
            raise origin.error((f"{key.name}[{i}]",), f"expected a string (quote it), not {_shown(word)}")
    if nonempty and not value:
        raise origin.error((key.name,), "expected a command, not an empty list")
    return list(value)


def _convert(key: Key, text: str, origin: Origin, path: tuple[str, ...]) -> Any:
    """A value through its flag's own type, as argparse would: its error is the message."""
    if key.convert is None:
        return _choice(key, text, origin)
    try:
        converted = key.convert(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
        raise origin.error(path, str(exc) or f"not a valid value of {key.flag}") from None
    return _choice(key, converted, origin)


def _choice(key: Key, value: Any, origin: Origin) -> Any:
    if key.choices is not None and value not in key.choices:
        raise origin.error((key.name,), f"expected one of {', '.join(map(str, key.choices))}, not {_shown(value)}")
    return value


def _gpus(value: Any, origin: Origin, wrong: Callable[..., RunFileError]) -> int | str | list[str]:
    """`gpus = 2` (how many), `gpus = ["0", "2"]` (which), or `gpus = "0,2"` / `"all"` as the flag takes it."""
    if isinstance(value, bool):
        raise wrong('a number of GPUs (2), device ids (["0", "2"]) or "all"')
    if isinstance(value, int):
        if value < 0:
            raise wrong("a number of GPUs of 0 or more")
        return value
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(v, str | int) and not isinstance(v, bool) for v in value):
        ids = [str(v) for v in value]
        if len(set(ids)) != len(ids):
            raise origin.error(("gpus",), "name each device once")
        return ids
    raise wrong('a number of GPUs (2), device ids (["0", "2"]) or "all"')


def _grid(value: Any, origin: Origin, wrong: Callable[..., RunFileError]) -> dict[str, list[str]]:
    """`[grid]` with `NAME = [values]`: each value a string or a number, kept as its text (a
    number as Python writes it: quote `"1e-4"` to keep that spelling in the command)."""
    if not isinstance(value, dict) or not value:
        raise wrong('a table of NAME = [values], e.g. [grid] then lr = ["1e-4", "2e-4"]')
    grid: dict[str, list[str]] = {}
    for name, values in value.items():
        at = (GRID, name)
        if not _NAME_RE.match(name):
            raise origin.error(at, "not a grid name (letters, digits and _, not starting with a digit)")
        if not isinstance(values, list) or not values:
            raise wrong('a list of values, e.g. ["1e-4", "2e-4"]', at, values)
        for i, one in enumerate(values):
            if isinstance(one, bool) or not isinstance(one, str | int | float):
                raise wrong("a string or a number", (GRID, f"{name}[{i}]"), one)
        grid[name] = [str(one) for one in values]
    return grid


def grid_of(values: dict[str, Any], flags: Iterable[str] | None) -> dict[str, list[str]]:
    """A sweep's grid: the file's, with each `--grid NAME=V1,V2` given replacing NAME's values."""
    grid = dict(values.get(GRID) or {})
    for text in flags or ():
        name, sep, given = text.partition("=")
        if not sep or not name.strip() or not given:
            raise RunFileError(f"--grid {text!r}: expected NAME=V1,V2 (e.g. --grid lr=1e-4,2e-4)")
        grid[name.strip()] = given.split(",")
    return grid


# --- the command line: file, --set, flags, command ---------------------------------------------


def given_flags(argv: list[str]) -> dict[str, Any]:
    """The start flags given on this command line, by their attribute, as they were typed
    (no defaults, no conversion): those override the file. argparse keeps no record of which
    values are defaults, so the line is parsed again by a parser that has none."""
    from daemon.cli.parser import _parser

    parser = _parser()
    start = _subparser(_subparser(parser, "train"), "start")
    dests = set()
    for action in start._actions:
        if action.option_strings and action.dest not in NOT_KEYS:
            action.default, action.type, action.choices = argparse.SUPPRESS, None, None
            dests.add(action.dest)
    args, _ = parser.parse_known_args(argv)
    return {dest: value for dest, value in vars(args).items() if dest in dests}


def with_flags(values: dict[str, Any], flags: dict[str, Any], keys: dict[str, Key]) -> dict[str, Any]:
    """The flags given over the file's values: a flag replaces a value, adds to a list, and sets
    one name of env (`--env NAME=VALUE` over the file's NAME)."""
    out = dict(values)
    by_dest = {key.dest: key for key in keys.values() if key.dest}
    for dest, given in flags.items():
        key = by_dest[dest]
        if key.kind == ENV:
            env = dict(out.get(ENV, {}))
            for pair in given:
                name, sep, text = pair.partition("=")
                if not sep or not name:
                    raise RunFileError(f"--env {pair!r}: expected NAME=VALUE")
                env[name] = text
            out[ENV] = env
        elif key.kind in (NAMES, LIST):
            out[key.name] = list(dict.fromkeys([*out.get(key.name, []), *given]))
        elif key.kind == CWD:
            out[key.name] = str(Path(given).expanduser().resolve())
        elif key.kind in (GPUS, CHECKPOINT, TYPED) and _INT_RE.match(given.strip()):
            out[key.name] = int(given)
        elif key.kind == TYPED and _FLOAT_RE.match(given.strip()):
            out[key.name] = float(given)
        else:
            out[key.name] = given
    return out


def command_of(values: dict[str, Any]) -> list[str]:
    """The job's command a run file says: `command`, or `python SCRIPT`, then `args`."""
    head = values.get(COMMAND) or (["python", values[SCRIPT]] if values.get(SCRIPT) else [])
    return [*head, *values.get(ARGS, [])] if head else []


def resolve(args: argparse.Namespace, argv: list[str], command: list[str]) -> dict[str, Any]:
    """`obd train start` with a run file (`-f`), `--set`s or `--dry-run`: the run it starts, as
    a run file's values (the file, then each --set, the flags, the command after --), also put
    into `args` for the start to send as for flags alone."""
    keys = schema()
    sets = list(args.set or [])
    if args.file:
        values = load(args.file, sets)
    else:
        origin = Origin("--set", Path.cwd())
        raw: dict[str, Any] = {}
        apply_sets(raw, sets, origin)
        values = check(raw, origin, keys)
    values = with_flags(values, given_flags(argv), keys)
    if command:
        values = {k: v for k, v in values.items() if k not in (COMMAND, SCRIPT, ARGS)}
        values = {COMMAND: command, **values}
    if not command_of(values):
        where = f"{args.file} has no command" if args.file else "no command"
        raise RunFileError(f'{where}: add command = [...] or script = "..." to the file, or give it after --')
    values = {name: values[name] for name in keys if name in values}  # the schema's order
    for name, value in values.items():
        key = keys[name]
        if key.dest is not None:
            setattr(args, key.dest, to_argument(key, value))
    args.command = []
    return values


def resolve_start(args: argparse.Namespace, argv: list[str], command: list[str]) -> tuple[list[str], str | None]:
    """For `obd train start` and `obd train sweep`: the job's command, and with `--dry-run` the
    text to print instead of starting (the resolved run as a run file, or JSON with --json). A
    sweep's grid (the file's, then --grid) is left in `args.grid` as --grid flags."""
    values = resolve(args, argv, command)
    sweep = args.action == "sweep"
    if sweep:
        grid = grid_of(values, args.grid)
        if not grid:
            raise RunFileError(
                "no grid: add a [grid] table to the run file (NAME = [values]) or give --grid NAME=V1,V2"
            )
        values[GRID] = grid
        args.grid = [f"{name}={','.join(given)}" for name, given in grid.items()]
    elif GRID in values:
        where = args.file or "--set grid"
        raise RunFileError(
            f"{where} holds a grid, so it is a sweep: start it with obd train sweep -f {args.file or 'FILE'}"
        )
    if not args.dry_run:
        return command_of(values), None
    # As it goes to the daemon: the command in full, and the target even when it is the default.
    shown = {COMMAND: command_of(values), "target": args.target}
    values = {**shown, **{k: v for k, v in values.items() if k not in (COMMAND, SCRIPT, ARGS)}}
    missing = [name for name in values.get("secrets", []) if name not in os.environ]
    if missing:
        raise RunFileError(f"secrets: ${missing[0]} is not set in this environment (a start would need it)")
    if args.json:
        return command_of(values), as_json(values) + "\n"
    what = "the sweep `obd train sweep`" if sweep else "the run `obd train start`"
    note = f"{what} would start (--dry-run: nothing was started); a run file as it is"
    return command_of(values), dumps(values, [note])


def to_argument(key: Key, value: Any) -> Any:
    """A run file's value as the start parser would have made it from the flag."""
    if key.kind == ENV:
        return [f"{name}={text}" for name, text in value.items()]
    if key.kind == GPUS:
        return gpus_text(value)
    if key.kind == TARGETS:
        return ",".join(value) if isinstance(value, list) else value
    if key.kind == TYPED:
        return key.convert(str(value)) if key.convert else value
    if key.kind == LIST and key.convert is not None:
        return [key.convert(word) for word in value]
    if key.kind == CHECKPOINT:
        return str(value)
    return value


def gpus_text(value: int | str | list[str]) -> str:
    """`--gpus` as the daemon reads it: `2`, `0,2`, and one device as `1,` (not one GPU's count)."""
    if isinstance(value, list):
        return ",".join(value) + ("," if len(value) == 1 else "")
    return str(value)
