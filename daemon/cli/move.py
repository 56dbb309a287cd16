"""`obd train move RUN --to T [--gpus N] [--wait]`: the client's side (the daemon's: daemon/service/move.py).

Without --wait it asks and says so; with --wait it shows one line of progress (the snapshot, then
the bytes of the checkpoint arrived on T and their rate, then the new run's first step there)
until the move is done or failed. Exit codes: 0 the new run trained a step on T; 4 the run ended
without a snapshot (nothing moved); 6 the carry or the start on T failed (the run stays stopped
and resumable where it was); 7 its job never loaded obd's plugin (no snapshot can come).
"""

from __future__ import annotations

import sys
import time

from daemon.cli import render
from daemon.cli.common import EXIT_FAILED, EXIT_NO_PLUGIN, EXIT_NO_SNAPSHOT, EXIT_OK

TYPE_CHECKING = False
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from daemon.cli.client import Client

POLL = 1.0  # seconds each look at the run waits for a change


def move(
    args: argparse.Namespace,
    client: Client,
    env: dict[str, str],
    secrets: dict[str, str],
    environ: dict[str, str] | None,
    umask: int,
) -> int:
    record = client.call(
        "move",
        id=args.id,
        to=args.to,
        gpus=args.gpus,
        env=env or None,
        secrets=secrets,
        environ=environ,
        env_clear=args.env_clear,
        umask=umask,
    )
    cannot = render.no_plugin_text(record)
    if not args.wait:
        said = (
            f"{record['id']}: moving to target {args.to}: a snapshot is asked here first, then its checkpoint is "
            f"carried and it continues there; `obd train status {record['id']}` follows it"
        )
        if cannot:
            said = f"{said}; {cannot}"
        _show(record, args.json, said)
        return EXIT_OK
    if cannot:
        if args.json:
            _show(record, True, "")
        print(f"obd: {cannot}", file=sys.stderr)
        return EXIT_NO_PLUGIN
    return _follow(client, record, args.json)


def _follow(client: Client, record: dict[str, Any], as_json: bool) -> int:
    """One line of progress until the move ends; the exit code of its end."""
    terminal = sys.stderr.isatty()
    shown = ""
    source = record
    while True:
        source = client.call("wait", id=source["id"], timeout=POLL)
        m = source.get("move") or {}
        new = client.call("wait", id=m["run"], timeout=POLL) if m.get("run") else None
        line = progress_line(source, new)
        if line != shown:
            print(("\r\033[K" if terminal else "") + line, end="" if terminal else "\n", file=sys.stderr, flush=True)
            shown = line
        if m.get("state") in ("done", "failed"):
            break
        if source["state"] in ("stopped", "succeeded", "failed", "cancelled") and new is None:
            time.sleep(POLL / 4)  # a wait on a final run answers at once
    if terminal:
        print(file=sys.stderr)
    if m["state"] == "done":
        _show(new or source, as_json, f"{source['id']} moved to target {m['to']}: it continues as run {m['run']}")
        return EXIT_OK
    if as_json:
        _show(source, True, "")
    print(render.printable(f"obd: the move of {source['id']} to target {m['to']} failed: {m['why']}"), file=sys.stderr)
    snapshot = source["state"] == "stopped" and source.get("snapshot")
    return EXIT_FAILED if snapshot else EXIT_NO_SNAPSHOT


def progress_line(source: dict[str, Any], new: dict[str, Any] | None) -> str:
    """Where the move stands, in one line: the snapshot, the carry (bytes, rate), the first step."""
    m = source.get("move") or {}
    state = m.get("state")
    if state == "snapshot":
        step = (source.get("progress") or {}).get("step")
        return f"moving {source['id']} to {m['to']}: snapshot asked (at step {step if step is not None else '-'})"
    if new is None:
        return f"moving {source['id']} to {m['to']}: {render.move_text(source)}"
    carried = render.carry_text(new.get("progress"))
    step = (new.get("progress") or {}).get("step")
    if state == "done":
        return f"moved {source['id']} to {m['to']}: run {new['id']} at step {step}"
    if state == "failed":
        return f"move of {source['id']} to {m['to']} failed"
    if new["state"] == "preparing":
        return f"moving {source['id']} to {m['to']}: run {new['id']} " + (carried or "preparing")
    return f"moving {source['id']} to {m['to']}: run {new['id']} {new['state']}, waiting for its first step"


def _show(record: dict[str, Any], as_json: bool, text: str) -> None:
    import json

    print(json.dumps(record, indent=1) if as_json else text)
