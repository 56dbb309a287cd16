# Over 600 lines on purpose for now: one handler per subcommand, each short, all dispatched from one
# table; the machinery's commands left through daemon/cli/machinery.py (issue 35); a split by verb
# (train, targets) is the next step.
"""The `obd` command. Client commands import only the standard library (no torch, no pydantic).

The exit codes are one table (`EXIT_CODES`, printed by `obd --help` and kept in the README):
the commands that wait for a run to end (`logs --follow`, `stop --wait`, `cancel --wait`) exit
with the code of the state it ended in, the state the command asked for being 0.
"""

from __future__ import annotations

import os
import sys

from daemon.cli.common import (
    EXIT_BUSY,
    EXIT_CANCELLED,
    EXIT_DENIED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_NO_PLUGIN,
    EXIT_NO_SNAPSHOT,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    LOCAL_TARGET,
    STATE_EXIT,
    UsageError,
    on_this_machine,
)
from daemon.common.wire import FINAL

# What a command needs beyond this is imported where it is used (the parser, json, the client,
# rendering, sweeps, following, run files, pathlib, typing...): each module costs the command's
# start, and `obd train list --json` imports none of them (tests/bench/bench_client_imports.py).
TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed

# Fields of the control API, as the flags that set them: a daemon's usage error names the flag.
FIELD_FLAGS = {
    "tail_lines": "--tail",
    "retry": "--retry",
    "priority": "--priority",
    "name": "--name",
    "limit": "--limit",
    "since": "--since",
    "states": "--state",
    "target": "--target",
    "gpus": "--gpus",
    "checkpoint": "--checkpoint",
    "reason": "--reason",
    "env": "--env",
    "secrets": "--secret",
    "command": "COMMAND",
    "output_to": "--output-to",
    "cwd": "--cwd",
    "resume_from": "--resume-from",
    "after": "--after",
    "after_any": "--after-any",
    "grid": "--grid",
    "time_limit": "--time-limit",
    "deadline": "--deadline",
    "max_gpu_hours": "--max-gpu-hours",
    "max_cost_usd": "--max-cost-usd",
    "keep_checkpoints": "--keep-checkpoints",
    "keep": "--keep",
    "id": "RUN",
}


# --- argument types: each error names its flag (argparse adds `argument --tail:`) -------------


# --- the parser ---------------------------------------------------------------------------------


# --- main -------------------------------------------------------------------------------------


def _parser(path: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The command line's parser (daemon/cli/parser.py): the whole, or the command `path` names."""
    from daemon.cli.parser import _parser as parser_of

    return parser_of(path)


def main(argv: list[str] | None = None) -> int:
    try:
        words = list(sys.argv[1:] if argv is None else argv)
        code = _list_json(words)
        if code is None:
            code = _main(words)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing, and let nothing flush into the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


# `obd train list --json`, with `--all` or not: the form a script polls with.
LIST_JSON_FLAGS = frozenset({"--json", "--all"})
OK_PREFIX = b'{"ok": true, "result": '  # how the daemon begins every answer that succeeded (client.py)


def list_json_request(argv: list[str]) -> tuple[dict[str, str], bytes] | None:
    """`obd [--socket S] [--config C] [--state-dir D] train list --json [--all]` (any order of the
    two flags) as the global options given and the request line `Client` would send for it; None
    for any other command line (the parser takes it). tests/daemon/test_start_imports.py checks
    that each one taken here is the parser's."""
    given: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("--"):
        name, eq, value = argv[i].partition("=")
        if name not in ("--socket", "--config", "--state-dir") or name in given:
            return None
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                return None
            value = argv[i + 1]
            i += 1
        given[name] = value
        i += 1
    rest = argv[i:]
    flags = rest[2:]
    if rest[:2] != ["train", "list"] or "--json" not in flags or len(set(flags)) != len(flags):
        return None
    if not set(flags) <= LIST_JSON_FLAGS:
        return None
    return given, b'{"op": "list", "all": %s}\n' % (b"true" if "--all" in flags else b"false")


def _list_json(argv: list[str]) -> int | None:
    """`obd train list --json` through the interpreter's own C socket module, printing the runs as
    the daemon encoded them: no parser, json or client imported (the command's start is most of its
    time). None when the command is another, or anything but a plain answer came back (no daemon,
    busy, an error): the whole command then runs, and asks again (a list acts on nothing)."""
    found = list_json_request(argv)
    if found is None:
        return None
    given, line = found
    import _socket

    from daemon.common.paths import client_socket_str

    path = client_socket_str(given.get("--socket"), given.get("--config"), given.get("--state-dir"))
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.settimeout(120.0)
        sock.connect(path)
        sock.sendall(line)
        chunks: list[bytes] = []
        while True:
            chunk = sock.recv(1 << 20)
            if not chunk:
                return None
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                break
    except OSError:
        return None
    finally:
        sock.close()
    reply = b"".join(chunks)
    if not (reply.startswith(OK_PREFIX) and reply.endswith(b"}\n")) or reply.count(b"\n") != 1:
        return None
    sys.stdout.buffer.write(reply[len(OK_PREFIX) : -2] + b"\n")
    return EXIT_OK


def _untranslated_argparse() -> None:
    """argparse passes every help string through gettext, which looks for a catalogue on disk
    each time: nearly half of building the parser, which every command does. Python ships no
    argparse translations, so the command skips the lookups, in its own process only (the Python
    API, `import obd`, leaves argparse as it is)."""
    import argparse

    argparse._ = str  # type: ignore[attr-defined]


def _main(argv: list[str]) -> int:
    from daemon.cli.parser import command_path

    head, command = _split_command(argv)
    _untranslated_argparse()
    parser = _parser(command_path(head))  # only the parser of the command asked for
    try:
        args, unknown = parser.parse_known_args(head)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    try:
        _check_command(parser, args, head, command, unknown)
        if args.cmd == "train" and args.action in ("start", "sweep") and not (args.file or args.set or args.dry_run):
            _check_start(args, list(args.command) + command)
        elif args.cmd == "train" and args.action in ("start", "sweep"):
            from daemon.cli.runfile import resolve_start  # a run file, --set, --dry-run (docs/run-file.md)

            command, dry_run = resolve_start(args, head, list(args.command) + command)
            _check_start(args, command)
            if dry_run is not None:
                sys.stdout.write(dry_run)
                return EXIT_OK
    except UsageError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cmd == "daemon":
        from daemon.cli import machinery

        return int(machinery.entry("daemon")(args))
    if args.cmd == "completion":
        return _completion(args.shell)
    if args.cmd == "profile":
        from daemon.cli import machinery

        return int(machinery.entry("profile")([args.dir] + (["--json"] if args.json else [])))
    if args.cmd == "targets" and args.action == "list":
        return _targets_list(args)
    from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed

    if args.cmd == "targets" and args.action in ("drain", "undrain"):
        try:
            return _drain(args)
        except (DaemonUnreachable, DaemonBusy, RequestFailed) as exc:  # a denied drain: exit 77
            return _said(exc)
    if args.cmd in ("targets", "pods"):
        args.unknown = unknown
        from daemon.cli import machinery

        return int(machinery.entry("admin")(args))
    client = Client(_socket_path(args))
    try:
        if getattr(args, "view", None) is not None:
            return int(args.view(args, client))
        return _train(args, command, client)
    except (UsageError, DaemonUnreachable, DaemonBusy, RequestFailed) as exc:
        return _said(exc)
    finally:
        client.close()


def _socket_path(args: argparse.Namespace) -> str:
    """The daemon's socket, found as the daemon finds it (daemon/common/paths.py: as a string, without pathlib)."""
    from daemon.common.paths import client_socket_str

    return client_socket_str(args.socket, args.config, args.state_dir)


def _said(exc: UsageError | DaemonUnreachable | DaemonBusy | RequestFailed) -> int:
    """A command's error as `obd: ...` on stderr (never a traceback), and its exit code."""
    from daemon.cli import render
    from daemon.cli.client import DaemonBusy, DaemonUnreachable

    if isinstance(exc, UsageError):
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, DaemonUnreachable):
        print(exc, file=sys.stderr)
        return EXIT_UNREACHABLE
    if isinstance(exc, DaemonBusy):
        print(exc, file=sys.stderr)
        return EXIT_BUSY
    text = flag_names(str(exc)) if exc.kind == "usage" else str(exc)
    print(render.printable_lines(f"obd: {text}"), file=sys.stderr)
    return {"usage": EXIT_USAGE, "too_large": EXIT_USAGE, "denied": EXIT_DENIED}.get(exc.kind, EXIT_ERROR)


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _check_command(
    parser: argparse.ArgumentParser, args: argparse.Namespace, head: list[str], command: list[str], unknown: list[str]
) -> None:
    """A job's command given without `--` is taken only while none of its words looks like an option:
    `obd train start python train.py --lr 2e-4` is refused with the line that works. An option obd
    does not know before the job's command is refused as obd's, with the flag it may have meant."""
    if args.cmd == "pods":
        return  # `obd pods` options (--help, --force...) are its own
    takes_command = args.cmd == "train" and args.action in ("start", "resume", "sweep", "exec")
    before = list(args.command) if takes_command else []
    flags = [word for word in unknown if word.startswith("-")]
    # start and sweep take every word from the command's first on as the command: an unknown
    # option came before it. exec and resume take RUN first: one after the command may be the job's.
    if flags and (command or not before or args.action in ("start", "sweep")):
        raise UsageError(
            f"unrecognized option {' '.join(flags)}{_meant(parser, args, flags)} "
            f"(obd {_where(args)} --help lists the options)"
        )
    if takes_command and before:
        if command:
            raise UsageError(
                f"obd train {args.action}: the command is given twice ({' '.join(before)} and, after --, "
                f"{' '.join(command)}); give it once, after --"
            )
        if unknown or any(word.startswith("-") for word in before[1:]):
            at = max(i for i in range(len(head) - len(before) + 1) if head[i : i + len(before)] == before)
            import shlex

            line = shlex.join(["obd", *head[:at], "--", *before, *unknown])
            raise UsageError(f"put the job's command after `--`, so its options are not read as obd's:\n  {line}")
    if unknown:
        hint = ""
        if takes_command:
            run = " RUN" if args.action in ("resume", "exec") else ""
            hint = f"; if they are the job's, put the command after `--`: obd train {args.action}{run} [OPTIONS] -- COMMAND"
        raise UsageError(
            f"unrecognized arguments: {' '.join(unknown)}{hint} (obd {_where(args)} --help lists the options)"
        )


def _check_start(args: argparse.Namespace, command: list[str]) -> None:
    """What a start or a sweep would take and ignore: `--checkpoint` with no `--resume-from`, and a
    sweep's `{NAME}` that names no key of its grid (every run the same)."""
    if args.checkpoint is not None and not args.resume_from:
        raise UsageError(
            f"--checkpoint {args.checkpoint} picks a checkpoint of the run given by --resume-from, and none is "
            f"given: add --resume-from RUN (or run `obd train resume RUN --checkpoint {args.checkpoint}`)"
        )
    if args.action == "sweep" and args.grid:
        from daemon.cli import sweeps

        sweeps.check_placeholders(command, sweeps.parse_grid(args.grid))


def _meant(parser: argparse.ArgumentParser, args: argparse.Namespace, flags: list[str]) -> str:
    """`; did you mean --gpus?` for the flags that begin a flag of the command (or are close to one)."""
    import difflib

    from daemon.cli.parser import command_parser

    own = command_parser(parser, [args.cmd, getattr(args, "action", None)])
    known = [o for a in own._actions for o in a.option_strings if o.startswith("--")]
    meant = []
    for flag in flags:
        name = flag.partition("=")[0]
        found = [o for o in known if o.startswith(name)] or difflib.get_close_matches(name, known, 1)
        meant += [o for o in found[:3] if o not in meant]
    return f"; did you mean {' or '.join(meant)}? (obd takes no abbreviated option)" if meant else ""


def _where(args: argparse.Namespace) -> str:
    action = getattr(args, "action", None)
    return f"{args.cmd} {action}" if isinstance(action, str) else str(args.cmd)


def flag_names(message: str) -> str:
    """A daemon's `bad request: tail_lines: Input should be ...` as `--tail: Input should be ...`."""
    import re

    match = re.match(r"^bad request: ([A-Za-z_][\w.]*): (?:Value error, )?(.*)$", message, re.DOTALL)
    if not match:
        return message
    field, text = match.group(1), match.group(2)
    flag = FIELD_FLAGS.get(field.split(".")[0])
    if flag is None:
        return message
    return text if text.startswith(flag) else f"{flag}: {text}"


def _completion(shell: str) -> int:
    from pathlib import Path

    name = {"bash": "obd.bash", "zsh": "_obd", "fish": "obd.fish"}[shell]
    sys.stdout.write((Path(__file__).with_name("completions") / name).read_text())
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


def _drain(args: argparse.Namespace) -> int:
    """`obd targets drain|undrain NAME`: through the daemon; `--wait` until every paused job ended."""
    import json

    from daemon.cli.client import Client
    from daemon.cli.follow import Patient, _Feedback, _wait

    client = Client(_socket_path(args))
    try:
        if args.action == "undrain":
            answer = client.call("undrain", target=args.name)
            print(json.dumps(answer) if args.json else f"target {args.name}: undrained; its queue starts runs again")
            return EXIT_OK
        answer = client.call("drain", target=args.name, cancel=args.cancel)
        if args.wait:  # every run the drain found ends (paused, cancelled, or its own stop) before this returns
            for rid in answer.get("unannounced", []):
                print(
                    f"obd: waiting for {rid}: its job has not announced obd's snapshot plugin yet; it snapshots at its "
                    f"first step, or the stop fallback ends it (`obd targets drain {args.name} --cancel` ends it now)",
                    file=sys.stderr,
                )
            for rid in answer.get("paused", []) + answer.get("cancelled", []) + answer.get("stopping", []):
                _wait(Patient(client), client.call("status", id=rid), _Feedback.for_terminal())
    finally:
        client.close()
    if args.json:
        print(json.dumps(answer))
        return EXIT_OK
    unannounced = answer.get("unannounced", [])
    print(f"target {args.name}: drained; nothing starts on it until `obd targets undrain {args.name}`")
    for rid in answer.get("paused", []):
        more = " (asked before its job announced obd's plugin: it snapshots at its first step)"
        print(f"  paused through a snapshot, back in the queue: {rid}{more if rid in unannounced else ''}")
    for rid in answer.get("cancelled", []):
        print(f"  cancelled (it had not announced obd's snapshot plugin): {rid}")
    for rid in answer.get("stopping", []):
        print(f"  already being stopped or cancelled: {rid}")
    return EXIT_OK


def _targets_list(args: argparse.Namespace) -> int:
    """The targets and their GPUs (with what holds each), from the daemon; from the config file
    alone when no daemon answers. Standard library only: this must stay fast."""
    import json

    from daemon.cli import render
    from daemon.cli.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed

    client = Client(_socket_path(args), timeout=10)
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
        queued += ", drained" if row.get("drained") else ""
        # Where runs may also go (docs/placement.md): its pools, and its overflow after its wait.
        queued += f", pools {', '.join(row['pools'])}" if row.get("pools") else ""
        if row.get("overflow"):
            queued += f", overflow to {row['overflow']} after {render.duration(row.get('overflow_after'))}"
        print(render.printable(f"{row['name']:20} {row['kind']:8} {detail}{queued}".rstrip()))
    return 0


def _targets_from_config(config: str | None) -> list[dict[str, Any]]:
    import tomllib
    from pathlib import Path

    from daemon.common.paths import default_config_path

    path = Path(config) if config else default_config_path()
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        raw = {}
    found = raw.get("targets")
    targets: dict[str, Any] = found if isinstance(found, dict) else {}
    rows = [{"name": LOCAL_TARGET, "kind": "local"}] if LOCAL_TARGET not in targets else []
    rows += [
        {"name": n, "kind": str(t.get("kind", "?")) if isinstance(t, dict) else "?"} for n, t in sorted(targets.items())
    ]
    return rows


def _environ_for(client: Client, target: str, env_clear: bool) -> dict[str, str] | None:
    """This shell's environment, sent only for a run whose job starts from it: a local target's.

    SSH, Slurm and pod jobs never use it, so it is not sent for them (nor kept by the daemon).
    `local`, the default when --target is absent, is always this machine (the config may not
    give that name to another kind), so the usual start costs no extra request; another name is
    looked up in the daemon's own list of targets, whose config this client may not be able to
    read (one round trip on the same connection)."""
    if env_clear:
        return None  # the job starts from an empty environment: nothing of this one is needed
    if on_this_machine(target, lambda: client.call("targets")):
        return dict(os.environ)
    return None


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _print_record(record: dict[str, Any], as_json: bool, text: str) -> None:
    import json

    print(json.dumps(record, indent=1) if as_json else text)


def _train(args: argparse.Namespace, command: list[str], client: Client) -> int:
    action = args.action
    if action == "list":  # first: it imports none of what the others need
        return _list(args, client)
    import json

    from daemon.cli import render, sweeps
    from daemon.cli.client import RequestFailed
    from daemon.cli.follow import _logs, _metrics, _width

    if action == "start":
        return _start(args, list(args.command) + command, client)
    if action == "sweep":
        if not args.grid:
            raise UsageError("obd train sweep: no grid: give --grid NAME=V1,V2 (or -f a run file with a [grid] table)")
        return _start(args, list(args.command) + command, client, "sweep", grid=sweeps.parse_grid(args.grid))
    if action == "resume":
        source = sweeps.resume_source(client, args.id)  # its record at once (no wait): its target
        if _finished(source) and not args.again and "named_sweep" not in source:
            print(
                f"obd: run {source['id']} already ended (succeeded): it finished its training, so there is "
                f"nothing to resume; `obd train resume {source['id']} --again` starts it again from its last "
                "checkpoint (its after-train code runs again)",
                file=sys.stderr,
            )
            return EXIT_ERROR
        if source.get("env_names") and not args.env:
            print(
                f"obd: note: {source['id']} was started with --env {', '.join(source['env_names'])}; a resume never "
                "takes those values (they are not kept): give them again with --env NAME=VALUE if the job needs them",
                file=sys.stderr,
            )
        record = client.call(
            "resume",
            id=args.id,
            checkpoint=args.checkpoint,
            target=args.target,
            gpus=args.gpus,
            command=(list(args.command) + command) or None,
            env=_env_pairs(args.env) if args.env else None,
            secrets=_secrets(args.secret),
            environ=_environ_for(client, args.target or source["target"], args.env_clear),
            env_clear=args.env_clear,
            umask=_umask(),
            retry=args.retry,
            **_limits(args),
        )
        if sweeps.is_sweep(record):
            return sweeps.acted(client, record, args.json)
        _print_record(record, args.json, record["id"])
        return 0
    if action == "prune":
        answer = client.call("prune", id=args.id, keep=args.keep)
        print(json.dumps(answer) if args.json else render.pruned_text(answer))
        return 0
    if action in ("exec", "shell"):
        from daemon.cli.exec import exec_main  # a command where the run's job runs (docs/exec-and-shell.md)

        return exec_main(args, command, client)
    if action == "outputs":
        from daemon.cli.outputs import copy_outputs

        return copy_outputs(client.call("outputs", id=args.id), args.to, args.checkpoint, args.json)
    if action == "status":
        record = client.call("status", id=args.id)
        if sweeps.is_sweep(record) and args.as_file and record.get("members"):
            from daemon.cli.runfile_record import sweep_as_file_text

            first = client.call("status", id=record["members"][0]["runs"][0])  # the member as it was started
            sys.stdout.write(sweep_as_file_text(first, record, args.json))
            return 0
        if sweeps.is_sweep(record):  # a sweep's table
            _print_record(record, args.json, render.sweep_table(record, width=_width()))
            return 0
        if args.as_file:
            from daemon.cli.runfile_record import as_file_text

            sys.stdout.write(as_file_text(record, args.json))
            return 0
        _print_record(record, args.json, render.status(record))
        if not args.json and sys.stdout.isatty():  # a person is looking: the recent loss at a glance
            from daemon.cli.view import status_sparkline

            line = status_sparkline(client, record)
            if line:
                print(line)
        return 0
    if action == "metrics":
        return _metrics(client.call("metrics", id=args.id), args.json)
    if action == "logs":
        try:
            return _logs(client, args.id, args.follow, args.tail, args.json)
        except RequestFailed as exc:
            if exc.kind != "not_found":
                raise
            return _sweep_logs(client, args.id, exc)
    if action == "stop":
        return _stop(args, client)
    if action == "move":  # daemon/cli/move.py
        from daemon.cli.move import move

        environ = _environ_for(client, args.to, args.env_clear)
        return move(args, client, _env_pairs(args.env), _secrets(args.secret), environ, _umask())
    if action == "cancel":
        return _cancel(args, client)
    raise UsageError(f"unknown action {action}")


def _finished(record: dict[str, Any]) -> bool:
    """A run that succeeded, short of its max steps only if its progress says so (a job that
    transformers' own SIGTERM handler saved and ended is `succeeded` mid-training: it resumes)."""
    progress = record.get("progress") or {}
    step, most = progress.get("step"), progress.get("max_steps")
    short = isinstance(step, int) and isinstance(most, int) and step < most
    return record.get("state") == "succeeded" and not short


def _sweep_logs(client: Client, ref: str, exc: RequestFailed) -> int:
    """`obd train logs SWEEP`: a sweep has no log of its own; each of its members has one. Say so,
    with the command for each member (exit 2); a reference that names no sweep either is the
    daemon's `no run` error as it was."""
    from daemon.cli import render, sweeps

    view = client.call("status", id=ref)  # a sweep's name or id; else `no run`, as the read said
    if not sweeps.is_sweep(view):
        raise exc
    members = view.get("members") or []
    lines = [f"obd: {sweeps.title(view)} has no log of its own: each of its {len(members)} runs has one:"]
    for member in members:
        values = " ".join(f"{k}={v}" for k, v in (member.get("values") or {}).items())
        lines.append(f"  obd train logs {member['id']}    # {member.get('name') or '-'} {values} ({member['state']})")
    print(render.printable_lines("\n".join(lines)), file=sys.stderr)
    return EXIT_USAGE


def _start(args: argparse.Namespace, command: list[str], client: Client, op: str = "start", **extra: Any) -> int:
    from pathlib import Path

    from daemon.cli import sweeps

    if not command:
        raise UsageError(f"no command: obd train {op} [OPTIONS] -- COMMAND [ARG]...")
    cwd = str(Path(args.cwd).resolve()) if args.cwd else None
    record = client.call(
        op,
        command=command,
        target=args.target,
        name=args.name,
        cwd=cwd,
        client_cwd=os.getcwd(),
        env=_env_pairs(args.env),
        secrets=_secrets(args.secret),
        environ=_environ_for(client, args.target, args.env_clear),
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
        preemptible=args.preemptible,
        keep_checkpoints=args.keep_checkpoints,
        **_limits(args),
        after=args.after,
        after_any=args.after_any,
        **extra,
    )
    if op == "sweep":
        return sweeps.print_created(record, args.json)
    _print_record(record, args.json, record["id"])
    return 0


def _limits(args: argparse.Namespace) -> dict[str, float]:
    """The limits given (docs/limits.md), as the start and resume messages take them; none sent when none given."""
    names = ("time_limit", "deadline", "max_gpu_hours", "max_cost_usd")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _stop(args: argparse.Namespace, client: Client) -> int:
    from daemon.cli import render, sweeps
    from daemon.cli.follow import Patient, _Feedback, _wait

    record = client.call("stop", id=args.id, reason=args.reason)
    if sweeps.is_sweep(record):  # every member that runs (docs/dependencies-and-sweeps.md)
        return sweeps.acted(client, record, args.json, args.wait, "stopped")
    cannot = render.no_plugin_text(record)  # its job never loaded obd's plugin (`sleep`, a shell script)
    if not args.wait:
        said = f"{record['id']}: snapshot requested ({record['stop']['reason']})"
        if cannot:
            said = f"{said}; {cannot}"
        elif not record.get("snapshots"):
            said += (
                "; its job has not announced obd's snapshot plugin yet (still loading?): it is asked at its first step"
            )
        _print_record(record, args.json, said)
        return 0
    if cannot:  # no wait until the job ends: said now (exit 7)
        if args.json:
            _print_record(record, True, "")
        print(f"obd: {cannot}", file=sys.stderr)
        return EXIT_NO_PLUGIN
    final = _wait(Patient(client), record, _Feedback.for_terminal(lambda: client.call("targets")))
    _print_record(final, args.json, render.status(final))
    if final["state"] == "stopped" and final.get("snapshot"):
        return 0
    if final["state"] == "cancelled" and not (final.get("stop") or {}).get("after_train"):
        return EXIT_CANCELLED
    return EXIT_NO_SNAPSHOT  # it finished (also: its training had, and the stop cut the code after it) or failed


def _cancel(args: argparse.Namespace, client: Client) -> int:
    from daemon.cli import render, sweeps
    from daemon.cli.follow import Patient, _Feedback, _wait

    ended = _chain_ended(client, args.id)
    if ended is not None:  # as `obd train stop` says it: nothing to cancel
        print(
            render.printable_lines(f"obd: run {ended['id']} already ended ({ended['state']}): {ended.get('message')}"),
            file=sys.stderr,
        )
        return EXIT_ERROR
    record = client.call("cancel", id=args.id)
    if sweeps.is_sweep(record):  # every member
        return sweeps.acted(client, record, args.json, args.wait, "cancelled")
    if not args.wait:
        said = render.outcome(record)
        if record["state"] not in FINAL:  # asked: its job is being ended
            said = render.printable(
                f"{record['id']}: cancelling (TERM to its processes, KILL after the grace); "
                f"`obd train cancel {record['id']} --wait` waits until it ended"
            )
        _print_record(record, args.json, said)
        return 0
    record = _wait(Patient(client), record, _Feedback.for_terminal(lambda: client.call("targets")))
    _print_record(record, args.json, render.outcome(record))
    return EXIT_OK if record["state"] == "cancelled" else STATE_EXIT.get(record["state"], EXIT_ERROR)


def _chain_ended(client: Client, ref: str) -> dict[str, Any] | None:
    """The run `ref` names when it and its chain have ended (no retry or way back to come), so a
    cancel has nothing to act on; None otherwise, and for a sweep (each member is its own)."""
    from daemon.cli.client import RequestFailed

    try:
        record = client.call("wait", id=ref, timeout=0.0)
    except RequestFailed as exc:
        if exc.kind == "not_found":
            return None  # a sweep's name, or no such run: the cancel says which
        raise
    ended = record.get("state") in FINAL and not record.get("attempt_to_come")
    return dict(record) if ended else None


def _list(args: argparse.Namespace, client: Client) -> int:
    params: dict[str, Any] = {"all": args.all}
    for key, value in (
        ("states", args.state),
        ("target", args.target),
        ("name", args.name),
        ("since", args.since),
        ("limit", args.limit),
        ("sweep", args.sweep),
    ):
        if value is not None:
            params[key] = value
    if not (args.json or args.expand or args.sweep is not None):
        params["fold"] = True  # a sweep's queued members as one row (daemon/service/run_list.py `fold`)
    if args.watch:
        if args.json or not sys.stdout.isatty():
            raise UsageError("--watch redraws a terminal; for a script, run `obd train list --json` when you need it")
        from daemon.cli.follow import _watch_list

        return _watch_list(client, params)
    if args.json:  # as the daemon encoded it: nothing decoded and encoded again
        sys.stdout.buffer.write(client.call_raw("list", **params) + b"\n")
        return 0
    from daemon.cli import render
    from daemon.cli.follow import _width

    if args.sweep is not None:  # its members as the sweep's table
        rows = client.call("list", **params)
        print(render.sweep_table({"sweep": args.sweep, "members": rows}, width=_width()))
        return 0
    print(render.table(client.call("list", **params), width=_width()))
    return 0


# --- waiting for a run: the daemon may restart meanwhile --------------------------------------


# --- logs -------------------------------------------------------------------------------------


if __name__ == "__main__":
    sys.exit(main())
