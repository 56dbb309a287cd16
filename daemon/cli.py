"""The `obd` command. Client commands import only the standard library (no torch, no pydantic).

Exit codes: 0 success; 1 an error the daemon reported; 2 bad usage; 69 the daemon cannot be
reached. `obd train stop --wait` also exits 3 when the stop fell back to a cancel (no snapshot
came in time) and 4 when the run ended some other way (finished, failed) without a snapshot.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from daemon import render
from daemon.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.paths import client_socket

EXIT_ERROR, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_BUSY, EXIT_DENIED = 1, 2, 69, 75, 77
EXIT_STOP_FELL_BACK, EXIT_STOP_NO_SNAPSHOT = 3, 4
FINAL = {"stopped", "succeeded", "failed", "cancelled"}


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="obd", description="Supervise fine-tuning runs; stop them with a verified checkpoint."
    )
    p.add_argument("--socket", help="control socket (default: OBD_SOCKET, the config, or the XDG/system default)")
    p.add_argument("--config", help="config file (for the client: only to find the socket)")
    p.add_argument("--state-dir", help="the daemon's state directory (the client looks for STATE_DIR/obd.sock)")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("daemon", help="run the daemon in the foreground")
    # Accepted after `daemon` too, as SPEC's `obd daemon [--config FILE] [--socket PATH]` has them.
    d.add_argument("--config", default=argparse.SUPPRESS)
    d.add_argument("--socket", default=argparse.SUPPRESS)
    d.add_argument("--state-dir", default=argparse.SUPPRESS)
    d.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="what the daemon logs (default: info)"
    )

    train = sub.add_parser("train", help="start, stop and follow runs").add_subparsers(dest="action", required=True)
    s = train.add_parser("start", help="start a run: obd train start [OPTIONS] -- COMMAND [ARG]...")
    s.add_argument("--target", default="local")
    s.add_argument("--name")
    s.add_argument("--cwd")
    s.add_argument("--env", action="append", default=[], metavar="K=V")
    s.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="pass $NAME from this environment, never on a command line",
    )
    s.add_argument(
        "--env-clear",
        action="store_true",
        help="start the job from an empty environment (HOME, USER, PATH), not this shell's",
    )
    s.add_argument(
        "--output-to",
        metavar="DIR",
        help="when the job succeeds, put its outputs in DIR (`asked`: the output_dir the script asked for); "
        "never into a directory that is not empty",
    )
    s.add_argument("--resume-from", metavar="RUN", help="resume RUN's snapshot, or its newest complete checkpoint")
    s.add_argument("--checkpoint", metavar="WHICH", help="with --resume-from: latest, a step number, or a path")
    s.add_argument(
        "--gpus", metavar="N|IDS", help="how many GPUs (2), or which (0,2 or device=1); default: all of the target's"
    )
    s.add_argument(
        "--priority", type=int, default=0, metavar="P", help="higher starts first from the queue (-100..100)"
    )
    s.add_argument(
        "--retry",
        type=int,
        metavar="N",
        help="start it again up to N times from its checkpoint if it fails or is preempted",
    )
    s.add_argument("--profile", action="store_true")
    s.add_argument(
        "--snapshot-on-sigterm", action="store_true", help="a SIGTERM to the job becomes a snapshot request (preempted)"
    )
    s.add_argument("--json", action="store_true")
    s.add_argument("command", nargs="*")

    rs = train.add_parser(
        "resume", help="start a new run like RUN from its snapshot or newest complete checkpoint: obd train resume RUN"
    )
    rs.add_argument("id", metavar="RUN")
    rs.add_argument("--checkpoint", metavar="WHICH", help="latest, a step number, or a path on the target")
    rs.add_argument("--env", action="append", default=[], metavar="K=V", help="replaces the old run's --env values")
    rs.add_argument("--secret", action="append", default=[], metavar="NAME", help="pass $NAME from this environment")
    rs.add_argument("--env-clear", action="store_true", help="start the job from an empty environment")
    rs.add_argument("--retry", type=int, metavar="N", help="start it again up to N times if it fails or is preempted")
    rs.add_argument("--json", action="store_true")
    rs.add_argument("command", nargs="*", help="a new command (after --); the old run's by default")

    st = train.add_parser("stop", help="ask the run for a snapshot, then stop")
    st.add_argument("id")
    st.add_argument("--reason", default="requested")
    st.add_argument("--wait", action="store_true")
    st.add_argument("--json", action="store_true")

    c = train.add_parser("cancel", help="TERM the job, then KILL after the grace")
    c.add_argument("id")
    c.add_argument("--wait", action="store_true")
    c.add_argument("--json", action="store_true")

    for name in ("status", "metrics"):
        x = train.add_parser(name)
        x.add_argument("id")
        x.add_argument("--json", action="store_true")
    ls = train.add_parser("list")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--all", action="store_true", help="every run, of every user and any age")

    out = train.add_parser("outputs", help="copy a run's outputs (model, checkpoints) into a directory of yours")
    out.add_argument("id")
    out.add_argument(
        "--to", metavar="DIR", help="where to put them (default: ./<run name or id>); must be new or empty"
    )
    out.add_argument(
        "--checkpoint",
        metavar="WHICH",
        help="latest, a step number, or final (what the trainer saved outside its checkpoints); default: everything",
    )
    out.add_argument("--json", action="store_true")

    lg = train.add_parser("logs")
    lg.add_argument("id")
    lg.add_argument("--follow", "-f", action="store_true")
    lg.add_argument("--tail", type=int, metavar="N")

    prof = sub.add_parser("profile").add_subparsers(dest="action", required=True)
    pp = prof.add_parser("parse")
    pp.add_argument("rest", nargs=argparse.REMAINDER)

    tg = sub.add_parser("targets").add_subparsers(dest="action", required=True)
    tg.add_parser("list").add_argument("--json", action="store_true")
    tc = tg.add_parser("check")
    tc.add_argument("name")
    tc.add_argument("--json", action="store_true")

    # `obd pods` has its own parser (daemon/pods_cli.py): list, rm, retrieve and their options.
    pods = sub.add_parser("pods", add_help=False)
    pods.add_argument("rest", nargs=argparse.REMAINDER)

    # Commands that look at runs (plot, the web view): daemon/view_cli.py adds them. Each sets
    # `view` to a function (args, client) -> exit code.
    from daemon import view_cli

    view_cli.add_commands(train, sub)
    return p


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    head, command = _split_command(argv)
    parser = _parser()
    try:
        args, unknown = parser.parse_known_args(head)
        if unknown and args.cmd != "pods":  # `obd pods` options (--help, --force...) are its own
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    if args.cmd == "daemon":
        return _daemon(args)
    if args.cmd == "profile":
        from runner.cli import profile_parse_main

        return profile_parse_main(args.rest + command)
    if args.cmd == "targets" and args.action == "list":
        return _targets_list(args)
    if args.cmd in ("targets", "pods"):
        from daemon.admin import admin_main

        args.unknown = unknown
        return admin_main(args)
    client = Client(client_socket(args.socket, args.config, args.state_dir))
    try:
        if getattr(args, "view", None) is not None:
            return int(args.view(args, client))
        return _train(args, command, client)
    except UsageError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnreachable as exc:
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    except DaemonBusy as exc:
        print(exc, file=sys.stderr)
        return EXIT_BUSY
    except RequestFailed as exc:
        print(render.printable_lines(f"obd: {exc}"), file=sys.stderr)
        return {"usage": EXIT_USAGE, "too_large": EXIT_USAGE, "denied": EXIT_DENIED}.get(exc.kind, EXIT_ERROR)
    except KeyboardInterrupt:
        return 130
    finally:
        client.close()


def _daemon(args: argparse.Namespace) -> int:
    import anyio

    from daemon.config import ConfigError, load_config
    from daemon.log import configure
    from daemon.service import Daemon

    try:
        config = load_config(
            Path(args.config) if args.config else None,
            state_dir=Path(args.state_dir) if args.state_dir else None,
            socket=Path(args.socket) if args.socket else None,
        )
    except ConfigError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        configure(args.log_level or config.daemon.log_level)
    except ValueError as exc:
        print(f"obd: [daemon] {exc}", file=sys.stderr)
        return EXIT_USAGE
    anyio.run(Daemon(config).run)
    return 0


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--env {pair!r}: expected K=V")
        if key in env:
            raise UsageError(f"--env {key} is given twice: give each name once")
        env[key] = value
    return env


def _secrets(names: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in names:
        if name in out:
            raise UsageError(f"--secret {name} is given twice: give each name once")
        if name not in os.environ:
            raise UsageError(f"--secret {name}: ${name} is not set in this environment")
        out[name] = os.environ[name]
    return out


def _targets_list(args: argparse.Namespace) -> int:
    """The targets and their GPUs (with what holds each), from the daemon; from the config file
    alone when no daemon answers. Standard library only: this must stay fast."""
    client = Client(client_socket(args.socket, args.config, args.state_dir), timeout=10)
    try:
        rows = client.call("targets")
    except (DaemonUnreachable, DaemonBusy, RequestFailed) as exc:
        rows = _targets_from_config(args.config)
        if not args.json:
            print(f"(the daemon did not answer: {str(exc).splitlines()[0]}; GPUs and queues unknown)", file=sys.stderr)
    finally:
        client.close()
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        gpus = row.get("gpus")
        if gpus is None:
            detail = ""
        elif not gpus:
            detail = "no GPUs"
        else:
            detail = "GPUs " + ", ".join(f"{g['id']}:{g.get('held_by') or 'free'}" for g in gpus)
        queued = f", {row['queued']} queued" if row.get("queued") else ""
        print(render.printable(f"{row['name']:20} {row['kind']:8} {detail}{queued}".rstrip()))
    return 0


def _targets_from_config(config: str | None) -> list[dict[str, Any]]:
    import tomllib

    from daemon.paths import default_config_path

    path = Path(config) if config else default_config_path()
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        raw = {}
    found = raw.get("targets")
    targets: dict[str, Any] = found if isinstance(found, dict) else {}
    rows = [{"name": "local", "kind": "local"}] if "local" not in targets else []
    rows += [
        {"name": n, "kind": str(t.get("kind", "?")) if isinstance(t, dict) else "?"} for n, t in sorted(targets.items())
    ]
    return rows


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _train(args: argparse.Namespace, command: list[str], client: Client) -> int:
    action = args.action
    if action == "start":
        command = args.command + command
        if not command:
            raise UsageError("no command: obd train start [OPTIONS] -- COMMAND [ARG]...")
        cwd = str(Path(args.cwd).resolve()) if args.cwd else None
        record = client.call(
            "start",
            command=command,
            target=args.target,
            name=args.name,
            cwd=cwd,
            client_cwd=os.getcwd(),
            env=_env_pairs(args.env),
            secrets=_secrets(args.secret),
            environ=dict(os.environ),
            env_clear=args.env_clear,
            umask=_umask(),
            output_to=args.output_to,
            resume_from=args.resume_from,
            checkpoint=args.checkpoint,
            gpus=args.gpus,
            priority=args.priority,
            retry=args.retry,
            profile=args.profile,
            snapshot_on_sigterm=args.snapshot_on_sigterm,
        )
        print(json.dumps(record, indent=1) if args.json else record["id"])
        return 0
    if action == "resume":
        record = client.call(
            "resume",
            id=args.id,
            checkpoint=args.checkpoint,
            command=(args.command + command) or None,
            env=_env_pairs(args.env) if args.env else None,
            secrets=_secrets(args.secret),
            environ=dict(os.environ),
            env_clear=args.env_clear,
            umask=_umask(),
            retry=args.retry,
        )
        print(json.dumps(record, indent=1) if args.json else record["id"])
        return 0
    if action == "outputs":
        from daemon.outputs import copy_outputs

        return copy_outputs(client.call("outputs", id=args.id), args.to, args.checkpoint, args.json)
    if action == "list":
        if args.json:  # as the daemon encoded it: nothing decoded and encoded again
            sys.stdout.buffer.write(client.call_raw("list", all=args.all) + b"\n")
            return 0
        print(render.table(client.call("list", all=args.all)))
        return 0
    if action == "status":
        record = client.call("status", id=args.id)
        print(json.dumps(record, indent=1) if args.json else render.status(record))
        if not args.json and sys.stdout.isatty():  # a person is looking: the recent loss at a glance
            from daemon.view_cli import status_sparkline

            line = status_sparkline(client, record)
            if line:
                print(line)
        return 0
    if action == "metrics":
        result = client.call("metrics", id=args.id)
        return _metrics(result, args.json)
    if action == "logs":
        return _logs(client, args.id, args.follow, args.tail)
    if action == "stop":
        record = client.call("stop", id=args.id, reason=args.reason)
        if not args.wait:
            print(
                json.dumps(record, indent=1)
                if args.json
                else f"{record['id']}: snapshot requested ({record['stop']['reason']})"
            )
            return 0
        final = _wait(client, args.id)
        print(json.dumps(final, indent=1) if args.json else render.status(final))
        if final["state"] == "stopped" and final.get("snapshot"):
            return 0
        return EXIT_STOP_FELL_BACK if final["state"] == "cancelled" else EXIT_STOP_NO_SNAPSHOT
    if action == "cancel":
        record = client.call("cancel", id=args.id)
        if args.wait:
            record = _wait(client, args.id)
        print(
            json.dumps(record, indent=1)
            if args.json
            else render.printable(f"{record['id']}: {record['state']} {record['message']}")
        )
        return 0
    raise UsageError(f"unknown action {action}")


def _wait(client: Client, run_id: str) -> dict[str, Any]:
    while True:
        record = client.call("wait", id=run_id, timeout=20)
        if record["state"] in FINAL:
            return record


def _metrics(result: dict[str, Any], as_json: bool) -> int:
    metrics = result.get("metrics")
    if as_json:
        print(json.dumps(metrics, indent=1))
        return 0
    if metrics is None:
        hint = "" if result.get("profile") else " (it was not started with --profile)"
        print(f"run {result['id']} has no metrics yet{hint}; state {result['state']}")
        return 0
    from runner.format import format_metrics

    print(render.printable_lines(format_metrics(metrics)))
    return 0


def _read(client: Client, run_id: str, offset: int, follow: bool, waiting: list[str], **extra: Any) -> dict[str, Any]:
    """One `read`; while following, a target that cannot be reached is waited for, not fatal."""
    while True:
        try:
            reply = client.call("read", id=run_id, offset=offset, **extra)
        except RequestFailed as exc:
            if not follow or exc.kind != "unavailable":
                raise
            if not waiting:
                sys.stderr.write(f"obd: {exc}; waiting for the target, the follow goes on where it was\n")
                sys.stderr.flush()
                waiting.append(str(exc))
            time.sleep(1.0)
            continue
        if waiting:
            sys.stderr.write("obd: the target answers again\n")
            sys.stderr.flush()
            waiting.clear()
        return reply


def _logs(client: Client, run_id: str, follow: bool, tail: int | None) -> int:
    out = sys.stdout.buffer
    live = follow and sys.stdout.isatty()
    waiting: list[str] = []
    first = {"tail_lines": tail} if tail is not None else {}
    reply = _read(client, run_id, 0, follow, waiting, **first)
    shown_progress = False
    while True:
        data = base64.b64decode(reply.get("data", ""))
        if data:
            if shown_progress:
                sys.stderr.write("\r\033[K")
                shown_progress = False
            out.write(data)
            out.flush()
        offset = reply.get("next", reply.get("offset", 0))
        if not follow:
            if not data or len(data) < 65536:
                return 0
        elif not data:
            if reply.get("state") in FINAL:
                # One more read: the job may have written its last lines before it ended.
                reply = _read(client, run_id, offset, follow, waiting)
                if not reply.get("data"):
                    return 0
                continue
            if live:
                sys.stderr.write("\r\033[K" + render.progress_line(reply.get("progress") or {}))
                sys.stderr.flush()
                shown_progress = True
            time.sleep(0.25)
        reply = _read(client, run_id, offset, follow, waiting)


if __name__ == "__main__":
    sys.exit(main())
