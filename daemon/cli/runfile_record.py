"""`obd train status RUN --as-file` and `status SWEEP --as-file`: a run's record (or a
sweep's first run with the sweep's command and grid) as the run file that starts one like it.

Apart from the run file's checks (daemon/cli/runfile.py): it reads records, which the checks
never see. Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from daemon.cli.runfile import ARGS, COMMAND, DOC, ENV_NOTE, GRID, SCRIPT, Key, RunFileError, schema
from daemon.cli.runfile_toml import as_json, dumps

# Keys read from a record field of another name, or shaped otherwise; any other key is read
# from the record's field of its own name, when the record has one (an option added later).
_FROM_RECORD = {
    "command",
    "target",
    "name",
    "cwd",
    "secrets",
    "env",
    "gpus",
    "priority",
    "preemptible",
    "retry",
    "profile",
    "snapshot_on_sigterm",
    "env_clear",
    "output_to",
    "resume_from",
    "checkpoint",
}
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def from_record(record: dict[str, Any], keys: dict[str, Key] | None = None) -> dict[str, Any]:
    """The run file that starts a run like this one again: its command and every option it was
    started with, as the record keeps them (env's names only: no value is in a record)."""
    keys = schema() if keys is None else keys
    # Its targets as given (`a,b`, a pool: docs/placement.md), not only the one it was placed on.
    target = (record.get("placement") or {}).get("given") or record.get("target", "local")
    values: dict[str, Any] = {COMMAND: list(record.get("command") or []), "target": target}
    for name in ("name", "cwd", "output_to"):
        if record.get(name):
            values[name] = record[name]
    if record.get("secret_names"):
        values["secrets"] = list(record["secret_names"])
    if record.get("env_clear"):
        values["env_clear"] = True
    wanted = record.get("gpus_wanted")
    if wanted is not None:
        values["gpus"] = list(wanted) if isinstance(wanted, list) else wanted
    if record.get("priority"):
        values["priority"] = record["priority"]
    preemptible = _part(record, "preemption").get("preemptible")
    if preemptible is not None:
        values["preemptible"] = preemptible
    values["retry"] = record.get("retries", 0)
    for name in ("profile", "snapshot_on_sigterm"):
        if record.get(name):
            values[name] = True
    if record.get("resumed_from"):
        values["resume_from"] = record["resumed_from"]
        point = str(record.get("resume_checkpoint") or "")
        named = _CHECKPOINT_NAME.match(point)
        if named:
            values["checkpoint"] = int(named.group(1))
        elif point:
            values["checkpoint"] = point
    for name, key in keys.items():
        if name not in _FROM_RECORD and key.kind not in (SCRIPT, ARGS):
            value = _RECORD_FORMS[name](record) if name in _RECORD_FORMS else _field(record, name)
            if value is not None:
                values[name] = value
    return {name: values[name] for name in keys if name in values}


def _part(record: dict[str, Any], name: str) -> dict[str, Any]:
    """One of the record's parts (`preemption`, `dependencies`, `retention`); the record itself
    for one of a daemon before the parts, which kept their fields at the top under the same names."""
    part = record.get(name)
    return part if isinstance(part, dict) else record


def _field(record: dict[str, Any], name: str) -> Any:
    """A key's value in a record field of its name, at the top or in one of its parts (an option
    added later may keep its value in a part, as `limits`); None when unset or not a plain value."""
    for where in (record, *(v for v in record.values() if isinstance(v, dict))):
        value = where.get(name)
        plain = isinstance(value, str | int | float) or (
            isinstance(value, list) and all(isinstance(v, str | int | float) for v in value)
        )
        if plain and value not in (False, [], ""):
            return value
    return None


def _deadline(record: dict[str, Any]) -> str | None:
    """`--deadline` takes a date and time, and a record keeps unix time: the local time, to the second."""
    value = _field(record, "deadline")
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    from datetime import datetime

    return datetime.fromtimestamp(value).isoformat(timespec="seconds")


def _after(record: dict[str, Any]) -> list[str] | None:
    """`--after RUN[:STATE,...]` from the record's dependencies, each by the run it was resolved to."""
    found = _part(record, "dependencies").get("after")
    if not isinstance(found, list) or not found:
        return None
    words = []
    for dep in found:
        if isinstance(dep, dict) and dep.get("run"):
            states = dep.get("states") or []
            words.append(f"{dep['run']}:{','.join(states)}" if states else str(dep["run"]))
        elif isinstance(dep, str):
            words.append(dep)
    return words or None


# Keys whose record keeps them otherwise than their flag takes them.
_RECORD_FORMS: dict[str, Callable[[dict[str, Any]], Any]] = {"deadline": _deadline, "after": _after}


def record_as_file(record: dict[str, Any], values: dict[str, Any] | None = None, what: str = "") -> str:
    """`obd train status RUN --as-file`: the run's start as a run file (`values`, else the
    record's), with a comment naming the env values it needs again (a record has their names only)."""
    name = f" ({record['name']})" if record.get("name") else ""
    what = what or f"run {record.get('id')}{name}, as a run file: `obd train start -f FILE` starts one like it"
    comments = [f"{what} ({DOC})"]
    env_names = list(record.get("env_names") or [])
    trailer: list[str] = []
    if env_names:
        comments.append(ENV_NOTE)
        trailer = ["", "[env]", *(f'{n} = "..."' for n in env_names)]
    return dumps(from_record(record) if values is None else values, comments, trailer)


def sweep_values(member: dict[str, Any], sweep: dict[str, Any]) -> dict[str, Any]:
    """A sweep's start as a run file's values: its first member's, with the sweep's command
    before its values were put in, its name, and its grid."""
    template = sweep.get("template")
    if not isinstance(template, list) or not template:
        raise RunFileError(
            f"sweep {sweep.get('sweep')} was made before obd kept a sweep's command: --as-file of one of its runs prints that run"
        )
    values = from_record(member)
    values = {COMMAND: list(template), **{k: v for k, v in values.items() if k not in (COMMAND, SCRIPT, ARGS)}}
    values["name"] = sweep.get("name") or values.get("name")
    values[GRID] = {name: list(given) for name, given in (sweep.get("grid") or {}).items()}
    return values


def sweep_as_file_text(member: dict[str, Any], sweep: dict[str, Any], as_json_too: bool = False) -> str:
    """`obd train status SWEEP --as-file`: the sweep as a run file `obd train sweep -f` takes."""
    values = sweep_values(member, sweep)
    if as_json_too:
        return as_json(values) + "\n"
    what = f"sweep {sweep.get('sweep')}, as a run file: `obd train sweep -f FILE` starts one like it"
    return record_as_file(member, values, what)


def as_file_text(record: dict[str, Any], as_json_too: bool = False) -> str:
    """`status --as-file`: the run file, or with `--json` its values as JSON (no env note there:
    `env` is absent, and `env_names` of the record says which it had)."""
    if not isinstance(record.get("command"), list):
        raise RunFileError(f"{record.get('id')} is not one run (a sweep?): --as-file prints the start of one run")
    if as_json_too:
        return as_json(from_record(record)) + "\n"
    return record_as_file(record)
