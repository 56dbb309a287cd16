"""The client's side of sweeps (`obd train sweep`, and a sweep given to status, stop, cancel and
resume): the --grid flags, and what is printed of the daemon's answers. Standard library only,
like every module the client imports; docs/dependencies-and-sweeps.md says what a sweep is.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from daemon.cli import render
from daemon.cli.client import Client, RequestFailed
from daemon.cli.common import EXIT_CANCELLED, EXIT_ERROR, EXIT_NO_SNAPSHOT, EXIT_OK, STATE_EXIT, UsageError
from daemon.cli.follow import Patient, _Feedback, _wait
from daemon.common.wire import FINAL


def parse_grid(texts: list[str]) -> list[dict[str, Any]]:
    """`--grid NAME=V1,V2` flags as the daemon takes them; the daemon checks the names and values."""
    grid = []
    for text in texts:
        name, sep, values = text.partition("=")
        if not sep or not name.strip() or not values:
            raise UsageError(f"--grid {text!r}: expected NAME=V1,V2 (e.g. --grid lr=1e-4,2e-4)")
        grid.append({"name": name.strip(), "values": values.split(",")})
    return grid


# `{NAME}` in a word of the command: a placeholder, unless a shell's `${NAME}`.
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")


def check_placeholders(command: list[str], grid: list[dict[str, Any]]) -> None:
    """Refuse a `{NAME}` that names no grid key (`{lrr}` for `{lr}`): every member would run the
    same command. Only in a word without spaces, as an argument is (`--lr={lrr}`, `out/{lrr}`): a
    script given whole (`python -c '...{x}...'`, `sh -c`) keeps its own braces."""
    names = [axis["name"] for axis in grid]
    for word in command:
        if any(space in word for space in " \t\n"):
            continue
        for found in _PLACEHOLDER.findall(word):
            if found not in names:
                keys = ", ".join("{" + n + "}" for n in names)
                raise UsageError(
                    f"the command's {{{found}}} names no key of the grid ({keys}): every run would get the same "
                    f"command; write one of the grid's keys, or add --grid {found}=V1,V2"
                )


def title(answer: dict[str, Any]) -> str:
    """`sweep ID (NAME)`, or `sweep ID` when its name is its id."""
    name = answer.get("name")
    return f"sweep {answer['sweep']}" + (f" ({name})" if name and name != answer["sweep"] else "")


def is_sweep(answer: Any) -> bool:
    """Whether the daemon answered for a sweep (the reference named one) rather than for a run."""
    return isinstance(answer, dict) and "sweep" in answer and ("runs" in answer or "members" in answer)


def print_created(answer: dict[str, Any], as_json: bool) -> int:
    """The sweep's id on stdout (for `SWEEP=$(obd train sweep ...)`), and each run on stderr."""
    if as_json:
        print(json.dumps(answer, indent=1))
        return EXIT_OK
    print(answer["sweep"])
    runs = answer.get("runs") or []
    print(f"{title(answer)}: {len(runs)} runs queued", file=sys.stderr)
    for run in runs:
        words = " ".join(run.get("command") or [])
        print(render.printable(f"  {run['id']}  {run.get('name') or '-'}  {words}"), file=sys.stderr)
    return EXIT_OK


def resume_source(client: Client, ref: str) -> dict[str, Any]:
    """What `obd train resume` needs of what it resumes, at once (its target, the names of its
    --env values): a run's record, or for a sweep its first member's (with `named_sweep`)."""
    try:
        return dict(client.call("wait", id=ref, timeout=0.0))
    except RequestFailed as exc:
        if exc.kind != "not_found":
            raise
        view = client.call("status", id=ref)
        if not is_sweep(view) or not view.get("members"):
            raise
        first = dict(view["members"][0])
        first.setdefault("env_names", [])
        first["named_sweep"] = view["sweep"]  # `ref` named the sweep, not this run
        return first


def acted(client: Client, answer: dict[str, Any], as_json: bool, wait: bool = False, want: str = "") -> int:
    """What a sweep's stop, cancel or resume did: each run it acted on (with `wait`, as each ended,
    `wait_all`), and on stderr what it left and why."""
    for note in answer.get("notes") or []:
        print(render.printable_lines(f"obd: {note}"), file=sys.stderr)
    if not as_json:
        print(render.printable(f"{title(answer)}: {len(answer['runs'])} runs"))
    if wait:
        return wait_all(client, answer, want, as_json)
    if as_json:
        print(json.dumps(answer, indent=1))
    else:
        for run in answer["runs"]:
            print("  " + _line(run, want))
    return EXIT_OK


def _line(run: dict[str, Any], want: str) -> str:
    """A run a sweep's command acted on: for a stop, the request as `obd train stop` says it."""
    if want != "stopped" or run.get("state") in FINAL:
        return render.outcome(run)
    said = f"{run['id']}: snapshot requested ({(run.get('stop') or {}).get('reason') or 'requested'})"
    if not run.get("snapshots"):
        said += "; its job has not announced obd's snapshot plugin yet (still loading?): it is asked at its first step"
    return render.printable(said)


def wait_all(client: Client, answer: dict[str, Any], want: str, as_json: bool) -> int:
    """`stop --wait` or `cancel --wait` of a sweep: each run acted on waited for in turn, a line
    each as it ends; 0 when every one ended as asked (`want`: stopped with a snapshot, or
    cancelled), else the code of the first that did not."""
    code = EXIT_OK
    ended = []
    for run in answer["runs"]:
        final = _wait(Patient(client), run, _Feedback.for_terminal(lambda: client.call("targets")))
        ended.append(final)
        if not as_json:
            print("  " + render.outcome(final))
        if code != EXIT_OK:
            continue
        if want == "stopped" and not (final["state"] == "stopped" and final.get("snapshot")):
            if final["state"] == "cancelled" and final.get("message", "").startswith("cancelled while queued"):
                continue  # taken out of the queue by the stop: as asked
            code = EXIT_CANCELLED if final["state"] == "cancelled" else EXIT_NO_SNAPSHOT
        elif want == "cancelled" and final["state"] != "cancelled":
            code = STATE_EXIT.get(final["state"], EXIT_ERROR)
    if as_json:
        print(json.dumps({**answer, "runs": ended}, indent=1))
    return code
