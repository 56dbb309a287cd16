"""The `obd` command. Client commands import only the standard library (no torch, no pydantic).

The exit codes are one table (`EXIT_CODES`, printed by `obd --help` and kept in the README):
the commands that wait for a run to end (`logs --follow`, `stop --wait`, `cancel --wait`) exit
with the code of the state it ended in, the state the command asked for being 0.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from daemon import render
from daemon.client import Client, DaemonBusy, DaemonUnreachable, RequestFailed
from daemon.paths import client_socket

DIST = "obd-train"  # the distribution's name on the package index; the command is `obd`
EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2
EXIT_CANCELLED, EXIT_NO_SNAPSHOT, EXIT_STOPPED, EXIT_FAILED = 3, 4, 5, 6
EXIT_UNREACHABLE, EXIT_BUSY, EXIT_DENIED, EXIT_INTERRUPTED, EXIT_PIPE = 69, 75, 77, 130, 141
EXIT_STOP_FELL_BACK, EXIT_STOP_NO_SNAPSHOT = EXIT_CANCELLED, EXIT_NO_SNAPSHOT  # the names they had
FINAL = {"stopped", "succeeded", "failed", "cancelled"}
STATES = ("queued", "preparing", "running", "stopped", "succeeded", "failed", "cancelled")
# The code of each final state, for the commands that wait for a run to end.
STATE_EXIT = {"succeeded": EXIT_OK, "stopped": EXIT_STOPPED, "cancelled": EXIT_CANCELLED, "failed": EXIT_FAILED}
RECONNECT_FOR = 600.0  # how long a follow or a wait waits out a daemon that went away (a restart)
SHELLS = ("bash", "zsh", "fish")

EXIT_CODES = """\
exit codes:
  0    success (for the commands that wait: the run ended as they asked)
  1    an error the daemon reported; the message says what to do next
  2    bad usage
  3    the run was cancelled (stop --wait: no snapshot came in time)
  4    stop --wait: the run ended without a snapshot (it finished or failed)
  5    the run stopped with a snapshot (obd train resume RUN continues it)
  6    the run failed (obd train status RUN says why, with its exit code)
  69   the daemon cannot be reached (the message says how to start it)
  75   the daemon is busy with other callers: retry in a moment
  77   refused: the run is another user's
  130  interrupted (Ctrl-C)
  141  the output was closed before it was all written (| head)

logs --follow exits with the code of the state the run ended in (succeeded: 0).
stop --wait exits 0 when the run stopped with a valid snapshot, else 3 or 4.
cancel --wait exits 0 when the run was cancelled, else its state's code."""

START_EXAMPLES = """\
examples:
  obd train start --name sft -- python train.py --lr 2e-4
  obd train start --gpus 2 --retry 3 --snapshot-on-sigterm -- torchrun \\
      --nproc-per-node 2 train.py
  obd train start --target gpu1 --cwd . --secret HF_TOKEN -- python train.py
  obd train start --resume-from sft -- python train.py --lr 1e-4

Everything after `--` is the job's command, its options included."""

STOP_EXAMPLES = """\
examples:
  obd train stop sft --wait      snapshot at the end of this step, wait for it
  obd train stop last            ask, and return at once
  obd train stop 20250101-1 --reason deadline

The job saves output/checkpoint-<step>, writes its proof and exits 0: the run is
`stopped`. With no proof within proof_timeout (30 min) the job is cancelled."""

RESUME_EXAMPLES = """\
examples:
  obd train resume sft                  the same command, from its snapshot
  obd train resume sft --checkpoint 400 from output/checkpoint-400
  obd train resume last -- python train.py --lr 1e-4   a new command

The new run has the old one's target, name (suffixed -r2, -r3...), GPUs and
working directory."""

COMPLETION_HELP = """\
install:
  bash  obd completion bash > ~/.local/share/bash-completion/completions/obd
  zsh   obd completion zsh > ~/.zfunc/_obd   (with fpath+=(~/.zfunc) before
        compinit in ~/.zshrc)
  fish  obd completion fish > ~/.config/fish/completions/obd.fish"""

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
    "id": "RUN",
}


class UsageError(Exception):
    pass


class _Formatter(argparse.HelpFormatter):
    """Text of several lines (the exit codes, examples) kept as written; a paragraph, like every
    option's help, wrapped to the terminal."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


class _VersionAction(argparse.Action):
    """`obd --version`: worked out only when asked (the metadata look-up costs a few ms)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version_text())
        parser.exit()


def version_text() -> str:
    """obd's version, the trainer plugin's (what jobs run) and the Python obd runs on."""
    from importlib import metadata

    from trainer_plugin.runtime import VERSION as PLUGIN_VERSION

    version = "unknown (not installed: run from a source tree)"
    for dist in (DIST, "obd"):  # an install from before the rename is still named obd
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"obd {version} (package {DIST})\ntrainer_plugin {PLUGIN_VERSION}\nPython {python}"


# --- argument types: each error names its flag (argparse adds `argument --tail:`) -------------


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f"from {low} to {high}" if high is not None else f"of {low} or more"
            raise argparse.ArgumentTypeError(f"expected a whole number {span}, not {text}")
        return value

    parse.__name__ = "number"
    return parse


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def since_time(text: str, now: float | None = None) -> float:
    """`--since`: a duration back from now (90s, 30m, 2h, 3d, 1w) or a date (2025-05-01, 2025-05-01T14:00,
    local time) as unix seconds."""
    match = _DURATION.match(text)
    if match:
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]
        return (time.time() if now is None else now) - seconds
    from datetime import datetime

    try:
        return datetime.fromisoformat(text.strip()).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a duration (30m, 2h, 3d) or a date (2025-05-01, 2025-05-01T14:00), not {text!r}"
        ) from None


# --- the parser ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="obd",
        description="Supervise fine-tuning runs; stop them at a step boundary with a verified checkpoint.",
        epilog=EXIT_CODES + "\n\nEach command has its own help: obd train start --help.",
        formatter_class=_Formatter,
    )
    p.add_argument("--version", action=_VersionAction, nargs=0, help="print obd's and its plugin's versions")
    p.add_argument("--socket", help="the daemon's control socket (default: OBD_SOCKET, the config, the default)")
    p.add_argument("--config", help="config file (the client reads it only to find the socket)")
    p.add_argument("--state-dir", help="the daemon's state directory (the client looks for STATE_DIR/obd.sock)")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", title="commands")

    d = sub.add_parser(
        "daemon",
        help="run the daemon in the foreground (systemd runs this)",
        description="Run the daemon: load the records, re-attach to every job, serve the control socket.",
    )
    # Accepted after `daemon` too, as `obd daemon [--config FILE] [--socket PATH]` has them.
    d.add_argument("--config", default=argparse.SUPPRESS, help="config file (default: OBD_CONFIG, then the XDG path)")
    d.add_argument("--socket", default=argparse.SUPPRESS, help="where to serve the control socket")
    d.add_argument("--state-dir", default=argparse.SUPPRESS, help="where to keep run records and local run dirs")
    d.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="what the daemon logs (default: info)"
    )

    train_parser = sub.add_parser(
        "train",
        help="start, stop, resume and follow runs",
        description="Start, stop, resume and follow runs. RUN is a run id, a unique prefix of one, "
        "a run name (its newest run) or `last` (your newest run).",
    )
    train = train_parser.add_subparsers(dest="action", required=True, metavar="ACTION", title="actions")
    _add_start(train)
    _add_resume(train)
    _add_stop_and_cancel(train)
    _add_reading(train)
    _add_list(train)

    prof = sub.add_parser(
        "profile",
        help="parse profiler output into RunMetrics, without the daemon",
        description="Profiling without the daemon.",
    ).add_subparsers(dest="action", required=True, metavar="ACTION", title="actions")
    pp = prof.add_parser(
        "parse",
        help="parse a run directory, its profile/ or a rocprofv3 output directory",
        description="Parse a run directory (profile/ and metrics.jsonl), a profile/ directory or any "
        "directory rocprofv3 wrote into, and print its RunMetrics.",
    )
    pp.add_argument("dir", metavar="DIR", help="the directory to parse")
    pp.add_argument("--json", action="store_true", help="print the RunMetrics as JSON")

    tg = sub.add_parser(
        "targets",
        help="list the configured targets, or check that one works",
        description="The targets of the daemon's config: where jobs run.",
    ).add_subparsers(dest="action", required=True, metavar="ACTION", title="actions")
    tl = tg.add_parser(
        "list", help="the targets, with their GPUs and what holds each", description="The targets and their GPUs."
    )
    tl.add_argument("--json", action="store_true", help="print them as a JSON list")
    tc = tg.add_parser(
        "check",
        help="check a target: reachable, workdir writable, Python, torch, disk",
        description="Check that a target can run jobs: reachable, host key, workdir writable, Python, torch, disk.",
    )
    tc.add_argument("name", metavar="NAME", help="the target's name in the config")
    tc.add_argument("--json", action="store_true", help="print the checks as a JSON list")

    # `obd pods` has its own parser (daemon/pods_cli.py): list, rm, retrieve and their options.
    pods = sub.add_parser(
        "pods",
        add_help=False,
        help="the Runpod pods obd created: list, rm POD, retrieve RUN (obd pods --help)",
        description="The Runpod pods obd created; works without the daemon.",
    )
    pods.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="list | rm POD_ID | retrieve RUN_ID")

    comp = sub.add_parser(
        "completion",
        help="print the shell completion script for bash, zsh or fish",
        description="Print the completion script for SHELL (a static script: completing costs no Python start).",
        epilog=COMPLETION_HELP,
    )
    comp.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")

    # Commands that look at runs (plot, the web view): daemon/view_cli.py adds them. Each sets
    # `view` to a function (args, client) -> exit code.
    from daemon import view_cli

    view_cli.add_commands(train, sub)
    _format_all(p)
    return p


def _format_all(parser: argparse.ArgumentParser) -> None:
    """Every command's help laid out alike (`_Formatter`), those of daemon/view_cli.py included."""
    parser.formatter_class = _Formatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _format_all(sub)


def _run_arg(parser: argparse.ArgumentParser, what: str = "the run") -> None:
    parser.add_argument("id", metavar="RUN", help=f"{what}: an id, a unique id prefix, a name, or `last`")


def _add_environment(parser: argparse.ArgumentParser, replaces: bool = False) -> None:
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="set K=V in the job's environment" + (" (replaces the old run's --env values)" if replaces else ""),
    )
    parser.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME",
        help="pass $NAME from this shell to the job, never on a command line or in a record",
    )
    parser.add_argument(
        "--env-clear",
        action="store_true",
        help="start the job from an empty environment (HOME, USER, PATH), not this shell's",
    )


def _add_start(train: Any) -> None:
    s = train.add_parser(
        "start",
        help="start a run: obd train start [OPTIONS] -- COMMAND [ARG]...",
        description="Start a run of COMMAND on a target; print its id.",
        epilog=START_EXAMPLES,
    )
    s.add_argument("--target", default="local", help="where to run it: a target of the config (default: local)")
    s.add_argument("--name", help="a name to find the run by (obd train status NAME)")
    s.add_argument(
        "--cwd", metavar="DIR", help="the job's directory (local: default here; ssh/pods: uploaded into src/)"
    )
    _add_environment(s)
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
        "--priority",
        type=_count(-100, 100),
        default=0,
        metavar="P",
        help="higher starts first from the queue (-100..100)",
    )
    s.add_argument(
        "--retry",
        type=_count(0, 100),
        metavar="N",
        help="start it again up to N times from its checkpoint if it fails or is preempted",
    )
    s.add_argument("--profile", action="store_true", help="run it under the profiler; see obd train metrics")
    s.add_argument(
        "--snapshot-on-sigterm", action="store_true", help="a SIGTERM to the job becomes a snapshot request (preempted)"
    )
    s.add_argument("--json", action="store_true", help="print the new run's record, not just its id")
    s.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the job's command, after --")


def _add_resume(train: Any) -> None:
    rs = train.add_parser(
        "resume",
        help="start a new run like RUN from its snapshot or newest complete checkpoint",
        description="Start a new run like RUN (target, command, name, GPUs, directory) from its proven "
        "snapshot, else its newest complete checkpoint.",
        epilog=RESUME_EXAMPLES,
    )
    _run_arg(rs, "the run to resume")
    rs.add_argument("--checkpoint", metavar="WHICH", help="latest, a step number, or a path on the target")
    _add_environment(rs, replaces=True)
    rs.add_argument(
        "--retry", type=_count(0, 100), metavar="N", help="start it again up to N times if it fails or is preempted"
    )
    rs.add_argument("--json", action="store_true", help="print the new run's record, not just its id")
    rs.add_argument(
        "command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="a new command, after --; default: RUN's"
    )


def _add_stop_and_cancel(train: Any) -> None:
    st = train.add_parser(
        "stop",
        help="ask the run for a snapshot at the end of its step, then stop",
        description="Ask the run's job for a snapshot: it saves output/checkpoint-<step> at the end of the "
        "current step, proves it and exits.",
        epilog=STOP_EXAMPLES,
    )
    _run_arg(st)
    st.add_argument(
        "--reason",
        default="requested",
        choices=("requested", "deadline", "cost", "disk", "preempted"),
        help="the reason word written in the request (default: requested)",
    )
    st.add_argument("--wait", action="store_true", help="wait until the run ended; exit 0 only with a snapshot")
    st.add_argument("--json", action="store_true", help="print the run's record")

    c = train.add_parser(
        "cancel",
        help="end the run now: TERM to its processes, KILL after the grace",
        description="Cancel the run: TERM to the job's process group, KILL after cancel_grace. A queued run "
        "leaves the queue. A run that ended is left as it is.",
    )
    _run_arg(c)
    c.add_argument("--wait", action="store_true", help="wait until the run ended")
    c.add_argument("--json", action="store_true", help="print the run's record")


def _add_reading(train: Any) -> None:
    x = train.add_parser(
        "status",
        help="a run's state, progress, snapshot, outputs and history",
        description="Show a run: state, progress, snapshot, outputs, history.",
    )
    _run_arg(x)
    x.add_argument("--json", action="store_true", help="print the run's record")

    m = train.add_parser(
        "metrics",
        help="a profiled run's RunMetrics (throughput, MFU, memory, kernels)",
        description="Show the RunMetrics of a run started with --profile.",
    )
    _run_arg(m)
    m.add_argument("--json", action="store_true", help="print them as JSON (an object that says why when none)")

    lg = train.add_parser(
        "logs",
        help="print a run's log (stdout and stderr), or follow it",
        description="Print the run's job.log; with --follow, stream it until the run ends and exit with its "
        "state's code (obd --help lists them).",
    )
    _run_arg(lg)
    lg.add_argument("--follow", "-f", action="store_true", help="stream new lines until the run ends")
    lg.add_argument("--tail", type=_count(0), metavar="N", help="start with the last N lines")
    lg.add_argument("--json", action="store_true", help="one JSON object a line: offset (bytes), text")

    out = train.add_parser(
        "outputs",
        help="copy a run's outputs (model, checkpoints) into a directory of yours",
        description="Copy a run's output/ (model, checkpoints) into a directory you own.",
    )
    _run_arg(out)
    out.add_argument(
        "--to", metavar="DIR", help="where to put them (default: ./<run name or id>); must be new or empty"
    )
    out.add_argument(
        "--checkpoint",
        metavar="WHICH",
        help="latest, a step number, or final (what the trainer saved outside its checkpoints); default: everything",
    )
    out.add_argument("--json", action="store_true", help="print what was copied as JSON")


def _add_list(train: Any) -> None:
    ls = train.add_parser(
        "list",
        help="your active runs and the 10 most recent that ended",
        description="List runs: by default your active runs and the 10 most recent that ended; the filters "
        "show any others.",
    )
    ls.add_argument("--all", action="store_true", help="every run, of every user and any age")
    ls.add_argument(
        "--state",
        action="append",
        choices=STATES,
        metavar="STATE",
        help=f"only runs in STATE, repeatable ({', '.join(STATES)})",
    )
    ls.add_argument("--target", help="only runs on this target")
    ls.add_argument("--name", help="only runs of this name")
    ls.add_argument("--since", type=since_time, metavar="WHEN", help="only runs started since: 2h, 3d, 2025-05-01")
    ls.add_argument("--limit", type=_count(1), metavar="N", help="at most the N newest")
    ls.add_argument("--watch", "-w", action="store_true", help="redraw every second (on a terminal)")
    ls.add_argument("--json", action="store_true", help="print the runs as a JSON list")


# --- main -------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): say nothing, and let nothing flush into the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _main(argv: list[str]) -> int:
    head, command = _split_command(argv)
    parser = _parser()
    try:
        args, unknown = parser.parse_known_args(head)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code else 0
    try:
        _check_command(args, head, command, unknown)
    except UsageError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cmd == "daemon":
        return _daemon(args)
    if args.cmd == "completion":
        return _completion(args.shell)
    if args.cmd == "profile":
        from runner.cli import profile_parse_main

        return profile_parse_main([args.dir] + (["--json"] if args.json else []))
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
        text = flag_names(str(exc)) if exc.kind == "usage" else str(exc)
        print(render.printable_lines(f"obd: {text}"), file=sys.stderr)
        return {"usage": EXIT_USAGE, "too_large": EXIT_USAGE, "denied": EXIT_DENIED}.get(exc.kind, EXIT_ERROR)
    finally:
        client.close()


def _split_command(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _check_command(args: argparse.Namespace, head: list[str], command: list[str], unknown: list[str]) -> None:
    """A job's command given without `--` is taken only while none of its words looks like an option:
    `obd train start python train.py --lr 2e-4` is refused with the line that works."""
    if args.cmd == "pods":
        return  # `obd pods` options (--help, --force...) are its own
    takes_command = args.cmd == "train" and args.action in ("start", "resume")
    before = list(args.command) if takes_command else []
    if takes_command and before:
        if command:
            raise UsageError(
                f"obd train {args.action}: the command is given twice ({' '.join(before)} and, after --, "
                f"{' '.join(command)}); give it once, after --"
            )
        if unknown or any(word.startswith("-") for word in before[1:]):
            obd_part = head[: len(head) - len(before)]
            import shlex

            line = shlex.join(["obd", *obd_part, "--", *before, *unknown])
            raise UsageError(f"put the job's command after `--`, so its options are not read as obd's:\n  {line}")
    if unknown:
        flags = " ".join(unknown)
        hint = ""
        if takes_command:
            hint = f"; if they are the job's, put the command after `--`: obd train {args.action} [OPTIONS] -- COMMAND"
        raise UsageError(f"unrecognized arguments: {flags}{hint} (obd {_where(args)} --help lists the options)")


def _where(args: argparse.Namespace) -> str:
    action = getattr(args, "action", None)
    return f"{args.cmd} {action}" if isinstance(action, str) else str(args.cmd)


def flag_names(message: str) -> str:
    """A daemon's `bad request: tail_lines: Input should be ...` as `--tail: Input should be ...`."""
    match = re.match(r"^bad request: ([A-Za-z_][\w.]*): (?:Value error, )?(.*)$", message, re.DOTALL)
    if not match:
        return message
    field, text = match.group(1), match.group(2)
    flag = FIELD_FLAGS.get(field.split(".")[0])
    if flag is None:
        return message
    return text if text.startswith(flag) else f"{flag}: {text}"


def _completion(shell: str) -> int:
    name = {"bash": "obd.bash", "zsh": "_obd", "fish": "obd.fish"}[shell]
    sys.stdout.write((Path(__file__).with_name("completions") / name).read_text())
    return 0


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


def _print_record(record: dict[str, Any], as_json: bool, text: str) -> None:
    print(json.dumps(record, indent=1) if as_json else text)


def _train(args: argparse.Namespace, command: list[str], client: Client) -> int:
    action = args.action
    if action == "start":
        return _start(args, list(args.command) + command, client)
    if action == "resume":
        record = client.call(
            "resume",
            id=args.id,
            checkpoint=args.checkpoint,
            command=(list(args.command) + command) or None,
            env=_env_pairs(args.env) if args.env else None,
            secrets=_secrets(args.secret),
            environ=dict(os.environ),
            env_clear=args.env_clear,
            umask=_umask(),
            retry=args.retry,
        )
        _print_record(record, args.json, record["id"])
        return 0
    if action == "outputs":
        from daemon.outputs import copy_outputs

        return copy_outputs(client.call("outputs", id=args.id), args.to, args.checkpoint, args.json)
    if action == "list":
        return _list(args, client)
    if action == "status":
        record = client.call("status", id=args.id)
        _print_record(record, args.json, render.status(record))
        if not args.json and sys.stdout.isatty():  # a person is looking: the recent loss at a glance
            from daemon.view_cli import status_sparkline

            line = status_sparkline(client, record)
            if line:
                print(line)
        return 0
    if action == "metrics":
        return _metrics(client.call("metrics", id=args.id), args.json)
    if action == "logs":
        return _logs(client, args.id, args.follow, args.tail, args.json)
    if action == "stop":
        return _stop(args, client)
    if action == "cancel":
        return _cancel(args, client)
    raise UsageError(f"unknown action {action}")


def _start(args: argparse.Namespace, command: list[str], client: Client) -> int:
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
    _print_record(record, args.json, record["id"])
    return 0


def _stop(args: argparse.Namespace, client: Client) -> int:
    record = client.call("stop", id=args.id, reason=args.reason)
    if not args.wait:
        _print_record(record, args.json, f"{record['id']}: snapshot requested ({record['stop']['reason']})")
        return 0
    final = _wait(Patient(client), record, _Feedback.for_terminal())
    _print_record(final, args.json, render.status(final))
    if final["state"] == "stopped" and final.get("snapshot"):
        return 0
    return EXIT_CANCELLED if final["state"] == "cancelled" else EXIT_NO_SNAPSHOT


def _cancel(args: argparse.Namespace, client: Client) -> int:
    record = client.call("cancel", id=args.id)
    if not args.wait:
        _print_record(record, args.json, render.outcome(record))
        return 0
    record = _wait(Patient(client), record, _Feedback.for_terminal())
    _print_record(record, args.json, render.outcome(record))
    return EXIT_OK if record["state"] == "cancelled" else STATE_EXIT.get(record["state"], EXIT_ERROR)


def _list(args: argparse.Namespace, client: Client) -> int:
    params: dict[str, Any] = {"all": args.all}
    for key, value in (
        ("states", args.state),
        ("target", args.target),
        ("name", args.name),
        ("since", args.since),
        ("limit", args.limit),
    ):
        if value is not None:
            params[key] = value
    if args.watch:
        if args.json or not sys.stdout.isatty():
            raise UsageError("--watch redraws a terminal; for a script, run `obd train list --json` when you need it")
        return _watch_list(client, params)
    if args.json:  # as the daemon encoded it: nothing decoded and encoded again
        sys.stdout.buffer.write(client.call_raw("list", **params) + b"\n")
        return 0
    print(render.table(client.call("list", **params), width=_width()))
    return 0


def _width() -> int | None:
    """The terminal's width for tables: COLUMNS, else the terminal's; None (no limit) when piped."""
    if os.environ.get("COLUMNS", "").isdigit():
        return int(os.environ["COLUMNS"])
    if sys.stdout.isatty():
        import shutil

        return shutil.get_terminal_size().columns
    return None


def _watch_list(client: Client, params: dict[str, Any]) -> int:
    """Redraw the list every second until Ctrl-C; a daemon restart is waited out."""
    import shutil

    patient = Patient(client)
    out = sys.stdout
    try:
        while True:
            runs = patient.call("list", **params)
            size = shutil.get_terminal_size()
            header = f"obd train list, every 1s (Ctrl-C to quit)  {time.strftime('%H:%M:%S')}"
            lines = [render.shorten_middle(header, size.columns), *render.table(runs, width=size.columns).split("\n")]
            out.write("\033[H\033[2J" + "\n".join(lines[: max(size.lines - 1, 3)]) + "\n")
            out.flush()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0


# --- waiting for a run: the daemon may restart meanwhile --------------------------------------


class Patient:
    """Calls for a command that waits on a run: a daemon that went away (a restart) is waited for
    up to RECONNECT_FOR, and a target that cannot be read is waited for, each said once on stderr.
    Until the first call succeeds, errors are the caller's as usual."""

    def __init__(self, client: Client, answered: bool = True) -> None:
        self.client = client
        self.answered = answered

    def call(self, op: str, **params: Any) -> Any:
        lost_since: float | None = None
        waiting = ""  # what is waited for: "the target", "the daemon"
        while True:
            try:
                reply = self.client.call(op, **params)
            except RequestFailed as exc:
                if exc.kind != "unavailable" or not self.answered:
                    raise
                if not waiting:
                    waiting = "the target"
                    self._say(f"obd: {exc}; waiting for the target, the follow goes on where it was")
            except (DaemonUnreachable, DaemonBusy) as exc:
                if not self.answered:
                    raise
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_FOR:
                    raise
                if not waiting:
                    waiting = "the daemon"
                    first = str(exc).splitlines()[0].removeprefix("obd: ")
                    self._say(
                        f"obd: lost the daemon ({first}); waiting up to {RECONNECT_FOR / 60:.0f} min for it to "
                        "come back, the follow goes on where it was"
                    )
            else:
                if waiting:
                    self._say(f"obd: {waiting} answers again")
                self.answered = True
                return reply
            time.sleep(0.5)

    @staticmethod
    def _say(text: str) -> None:
        sys.stderr.write(render.printable(text) + "\n")
        sys.stderr.flush()


class _Feedback:
    """What a `--wait` waits for, on a terminal: one line per stage, the current one kept up to date."""

    def __init__(self) -> None:
        self.stage = ""
        self.sizes: dict[str, str] = {}

    @classmethod
    def for_terminal(cls) -> _Feedback | None:
        return cls() if sys.stderr.isatty() else None

    def show(self, record: dict[str, Any]) -> None:
        import shutil

        stage, text = render.wait_stage(record, time.time(), self._size(record))
        if not text:
            return
        if self.stage and stage != self.stage:
            sys.stderr.write("\n")  # the stage that passed stays on the screen
        self.stage = stage
        width = shutil.get_terminal_size().columns - 1
        sys.stderr.write("\r\033[K" + render.shorten_middle(text, width))
        sys.stderr.flush()

    def done(self) -> None:
        if self.stage:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _size(self, record: dict[str, Any]) -> str | None:
        """The checkpoint's size on disk, for a local run whose directory this user can read."""
        snapshot = record.get("snapshot") or {}
        if not snapshot or record.get("target") != "local" or not record.get("remote_dir"):
            return None
        path = os.path.join(record["remote_dir"], snapshot["checkpoint"])
        if path not in self.sizes:
            self.sizes[path] = render.size_text(_disk_usage(path))
        return self.sizes[path] or None


def _disk_usage(path: str, limit: int = 10000) -> int | None:
    """Bytes under `path` (links not followed, at most `limit` entries); None when it cannot be read."""
    total, seen = 0, 0
    stack = [path]
    try:
        while stack:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    seen += 1
                    if seen > limit:
                        return total
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return None
    return total


def _wait(patient: Patient, record: dict[str, Any], feedback: _Feedback | None) -> dict[str, Any]:
    """The run's record once it is final; on a terminal, what is awaited is shown as it goes."""
    run_id = record["id"]
    try:
        if feedback is not None:
            feedback.show(record)
        while record["state"] not in FINAL:
            record = patient.call("wait", id=run_id, timeout=1 if feedback is not None else 20)
            if feedback is not None:
                feedback.show(record)
    finally:
        if feedback is not None:
            feedback.done()
    return record


def _metrics(result: dict[str, Any], as_json: bool) -> int:
    metrics = result.get("metrics")
    if metrics is None:
        why = (
            "it was not started with --profile"
            if not result.get("profile")
            else "they come once the run has ended and its profile is parsed"
        )
        message = f"run {result['id']} has no metrics: {why}"
        if as_json:
            print(json.dumps({**result, "metrics": None, "message": message}, indent=1))
        else:
            print(f"{message}; state {result['state']}")
        return 0
    if as_json:
        print(json.dumps(metrics, indent=1))
        return 0
    from runner.format import format_metrics

    print(render.printable_lines(format_metrics(metrics)))
    return 0


# --- logs -------------------------------------------------------------------------------------


class _Ndjson:
    """`logs --json`: one object a line, {"offset": where the line starts in job.log, "text": ...}."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.pending = b""

    def write(self, data: bytes) -> None:
        self.pending += data
        lines = self.pending.split(b"\n")
        self.pending = lines.pop()
        out = []
        for line in lines:
            out.append(self._line(line))
            self.offset += len(line) + 1
        if out:
            sys.stdout.write("".join(out))
            sys.stdout.flush()

    def close(self) -> None:
        """The last line, when the log does not end with a newline."""
        if self.pending:
            sys.stdout.write(self._line(self.pending))
            self.offset += len(self.pending)
            self.pending = b""
        sys.stdout.flush()

    def _line(self, line: bytes) -> str:
        return json.dumps({"offset": self.offset, "text": line.decode("utf-8", "replace")}) + "\n"


class _Raw:
    def __init__(self) -> None:
        self.out = sys.stdout.buffer

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()

    def close(self) -> None:
        self.out.flush()


def _logs(client: Client, ref: str, follow: bool, tail: int | None, as_json: bool) -> int:
    """Print the log (or follow it until the run ends: the exit code is its final state's)."""
    patient = Patient(client, answered=False)
    run_id = patient.call("wait", id=ref, timeout=0)["id"]  # `last` or a name: the run it names now
    first = {"tail_lines": tail} if tail is not None else {}
    reply = patient.call("read", id=run_id, offset=0, **first)
    sink: _Ndjson | _Raw = _Ndjson(reply.get("offset", 0)) if as_json else _Raw()
    live = follow and sys.stdout.isatty() and not as_json
    shown_progress = False
    while True:
        data = base64.b64decode(reply.get("data", ""))
        if data:
            if shown_progress:
                sys.stderr.write("\r\033[K")
                shown_progress = False
            sink.write(data)
        offset = reply.get("next", reply.get("offset", 0))
        if not follow:
            if not data or len(data) < 65536:
                sink.close()
                return 0
        elif not data:
            if reply.get("state") in FINAL:
                # One more read: the job may have written its last lines before it ended.
                reply = patient.call("read", id=run_id, offset=offset)
                if not reply.get("data"):
                    break
                continue
            if live:
                sys.stderr.write("\r\033[K" + render.progress_line(reply.get("progress") or {}))
                sys.stderr.flush()
                shown_progress = True
            time.sleep(0.25)
        reply = patient.call("read", id=run_id, offset=offset)
    sink.close()
    record = patient.call("wait", id=run_id, timeout=0)
    if record["state"] != "succeeded":
        print(f"obd: {render.outcome(record)}", file=sys.stderr)  # its message names the exit code
    return STATE_EXIT.get(record["state"], EXIT_ERROR)


if __name__ == "__main__":
    sys.exit(main())
