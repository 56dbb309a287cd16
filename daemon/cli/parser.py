# Over 600 lines on purpose: every command's flags, help and examples in one place, which the
# completions and the run-file keys are generated from; each command builds only its own parser.
"""The `obd` command's parsers: every command and flag, with its help and examples.

Standard library only, like every module the client imports; the reason words of a stop come
from the run directory's contract (`trainer_plugin/rundir.py`, standard library only too).
A command builds only its own parser (`_parser(command_path(argv))`: `obd train list` makes the
list's and nothing else, and imports nothing the others need); help, completions and run files
use the whole one (`_parser()`).

Over 600 lines on purpose: it is one declaration, the whole command line in the order `obd --help`
shows it; the commands' own code lives elsewhere (main.py, follow.py, sweeps.py, exec.py...), and
the run file (runfile.py) and the completions read this parser as the one source of the flags.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from daemon.cli.common import (
    DIST,
    EXIT_CODES,
    SHELLS,
)
from daemon.common.wire import STATES

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (a few ms of every command)
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

# The commands, and the actions of `obd train`, as `obd --help` lists them: a command line that
# names one gets a parser of that one only (`command_path`).
COMMANDS = ("daemon", "train", "profile", "targets", "pods", "completion", "ui")
TRAIN_ACTIONS = (
    "start",
    "sweep",
    "resume",
    "move",
    "stop",
    "cancel",
    "status",
    "metrics",
    "logs",
    "outputs",
    "exec",
    "shell",
    "prune",
    "list",
    "plot",
)
# The options of `obd` itself that take a value, which may come before the command.
GLOBAL_VALUED = ("--socket", "--config", "--state-dir")

START_EXAMPLES = """\
examples:
  obd train start --name sft -- python train.py --lr 2e-4
  obd train start --gpus 2 --retry 3 --snapshot-on-sigterm -- torchrun \\
      --nproc-per-node 2 train.py
  obd train start --target gpu1 --cwd . --secret HF_TOKEN -- python train.py
  obd train start --resume-from sft -- python train.py --lr 1e-4
  obd train start -f run.toml --set gpus=2 --name sft2
  obd train start -f run.toml --dry-run    the run it would start, as a run file

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
  obd train resume sft --target box     on target box (its checkpoint carried)

The new run has the old one's target, name (suffixed -r2, -r3...), GPUs and
working directory; its environment, --env values and secrets are yours, given
now as for a start (RUN's are not kept). With --target, its checkpoint is
carried there (each file's sha256 checked on arrival) and the directory rule is
that target's (uploaded where it does not see this machine's files)."""

SWEEP_EXAMPLES = """\
examples:
  obd train sweep --gpus 1 --grid lr=1e-4,2e-4 --grid seed=1,2 -- \\
      python train.py --lr {lr} --seed {seed}
  obd train sweep --name lr --after pretrain --grid lr=1e-5,3e-5 -- python ft.py --lr {lr}
  obd train status SWEEP      the sweep's table: state, step, loss, best loss
  obd train stop SWEEP        a snapshot of every member that runs; resume SWEEP goes on

One run per combination, named <name>-<n>, each with {NAME} replaced in its command
and OBD_SWEEP_<NAME> in its environment; all queued at once (or none), then started
through the queue (with --gpus 1 on a box of 4 GPUs: 4 at a time). Every option of
`obd train start` applies to each run."""

COMPLETION_HELP = """\
install:
  bash  obd completion bash > ~/.local/share/bash-completion/completions/obd
  zsh   obd completion zsh > ~/.zfunc/_obd   (with fpath+=(~/.zfunc) before
        compinit in ~/.zshrc)
  fish  obd completion fish > ~/.config/fish/completions/obd.fish"""


class _Formatter(argparse.HelpFormatter):
    """Text of several lines (the exit codes, examples) kept as written; a paragraph, like every
    option's help, wrapped to the terminal."""

    def __init__(self, prog: str) -> None:
        # The width argparse would take (shutil.get_terminal_size's, less 2), found without
        # importing shutil, which every parser would otherwise import for its first argument.
        super().__init__(prog, max_help_position=30, width=_columns() - 2)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _columns() -> int:
    """The terminal's width as `shutil.get_terminal_size()` gives it: $COLUMNS, else stdout's
    terminal, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 80
    return columns or 80


class _Parser(argparse.ArgumentParser):
    """Every parser of `obd`, its subcommands' included: help laid out alike (`_Formatter`), and
    no abbreviated flag taken (`--gpu` for `--gpus`), which run files and the API refuse."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class _VersionAction(argparse.Action):
    """`obd --version`: worked out only when asked (the metadata look-up costs a few ms)."""

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        print(version_text())
        parser.exit()


def version_text() -> str:
    """obd's version, the trainer plugin's (what jobs run) and the Python obd runs on."""
    from importlib import metadata

    from trainer_plugin.plugin.runtime import VERSION as PLUGIN_VERSION

    version = "unknown (not installed: run from a source tree)"
    for dist in (DIST, "obd"):  # an install from before the rename is still named obd
        try:
            version = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            continue
    python = ".".join(str(part) for part in sys.version_info[:3])
    return f"obd {version} (package {DIST})\ntrainer_plugin {PLUGIN_VERSION}\nPython {python}"


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


def duration_seconds(text: str) -> float:
    """`--time-limit`: a duration (`90s`, `45m`, `2h`, `1.5d`; a bare number is seconds) as seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 45m, 2h or 1.5d, not {text!r}")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2) or "s"]


_CLOCK = re.compile(r"^\s*(\d{1,2}):(\d{2})(?::(\d{2}))?\s*$")


def deadline_time(text: str, now: float | None = None) -> float:
    """`--deadline`: a clock time, `HH:MM` (or `HH:MM:SS`: the next such time, today or tomorrow), or
    an ISO 8601 date and time (`2025-06-01T14:00`, local time unless it names its offset) as unix
    seconds; a time that has passed is refused."""
    from datetime import datetime, timedelta

    now = time.time() if now is None else now
    match = _CLOCK.match(text)
    try:
        if match:
            hour, minute, second = int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)
            today = datetime.fromtimestamp(now).replace(hour=hour, minute=minute, second=second, microsecond=0)
            at = today if today.timestamp() > now else today + timedelta(days=1)
        else:
            at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a clock time (14:00, the next one) or a date and time (2025-06-01T14:00), not {text!r}"
        ) from None
    when = at.timestamp()
    if when <= now:
        raise argparse.ArgumentTypeError(f"{text} has passed; give a time to come (14:00, or 2025-06-01T14:00)")
    return when


def positive_number(text: str) -> float:
    """`--max-gpu-hours`, `--max-cost-usd`: a number above 0 (a leading `$` is allowed)."""
    try:
        value = float(text.strip().removeprefix("$"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number above 0, not {text}")
    return value


def command_path(argv: Sequence[str]) -> tuple[str, ...]:
    """The command a command line names, as far as its leading words say: ("train", "list") for
    `obd --socket S train list --all`, ("targets",) for `obd targets check gpu1`, () for
    `obd --help` or a word that is no command (the whole parser then says what is wrong)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in GLOBAL_VALUED:
            i += 2
        elif argv[i].partition("=")[0] in GLOBAL_VALUED:
            i += 1
        else:
            return ()  # --help, --version, or an option obd does not know
    words = argv[i : i + 2]
    if not words or words[0] not in COMMANDS:
        return ()
    if words[0] == "train" and len(words) == 2 and words[1] in TRAIN_ACTIONS:
        return (words[0], words[1])
    return (words[0],)


def _parser(path: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The command line's parser: the whole of it, or (`path`, from `command_path`) only the
    command it names, whose parse, help and errors are the same as in the whole one."""
    command = path[0] if path else None
    action = path[1] if len(path) > 1 else None

    def wanted(name: str, *actions: str) -> bool:
        return command in (None, name) and (not actions or action is None or action in actions)

    p = _Parser(
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
    if wanted("daemon"):
        _add_daemon(sub)
    train = None
    if wanted("train"):
        train_parser = sub.add_parser(
            "train",
            help="start, stop, resume and follow runs",
            description="Start, stop, resume and follow runs. RUN is a run id, a unique prefix of one, "
            "a run name (its newest run) or `last` (your newest run).",
        )
        train = train_parser.add_subparsers(dest="action", required=True, metavar="ACTION", title="actions")
        if wanted("train", "start", "sweep"):
            start = _add_start(train)
            if wanted("train", "sweep"):
                _add_sweep(train, start)
        for actions, add in (
            (("resume",), _add_resume),
            (("move",), _add_move),
            (("stop", "cancel"), _add_stop_and_cancel),
            (("status", "metrics", "logs", "outputs"), _add_reading),
            (("exec", "shell"), _add_exec),
            (("prune",), _add_prune),
            (("list",), _add_list),
        ):
            if wanted("train", *actions):
                add(train)
    if wanted("profile"):
        _add_profile(sub)
    if wanted("targets"):
        _add_targets(sub)
    if wanted("pods"):
        _add_pods(sub)
    if wanted("completion"):
        _add_completion(sub)
    # Commands that look at runs (plot, the web view): daemon/cli/view.py adds them. Each sets
    # `view` to a function (args, client) -> exit code.
    if wanted("train", "plot") or wanted("ui"):
        from daemon.cli import view  # its commands, and what they import, only when a parser is made

        # Each into the parser asked for; the other, into one thrown away.
        spare = _Parser(prog="obd").add_subparsers()
        view.add_commands(
            train if train is not None and wanted("train", "plot") else spare, sub if wanted("ui") else spare
        )
    _format_all(p)
    return p


def _add_daemon(sub: Any) -> None:
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


def _add_profile(sub: Any) -> None:
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


def _add_targets(sub: Any) -> None:
    tg = sub.add_parser(
        "targets",
        help="list the configured targets, or check that one works",
        description="The targets of the daemon's config: where jobs run.",
    ).add_subparsers(dest="action", required=True, metavar="ACTION", title="actions")
    tl = tg.add_parser(
        "list", help="the targets, with their GPUs and what holds each", description="The targets and their GPUs."
    )
    tl.add_argument("--json", action="store_true", help="print them as a JSON list")
    td = tg.add_parser(
        "drain",
        help="pause every run of a target through a verified snapshot and start nothing (maintenance)",
        description="Drain a target: nothing new starts on it, and every run of it is paused through a verified "
        "snapshot and put back in the queue (a job that has not announced obd's plugin yet is asked as a stop "
        "asks: at its first step; the stop fallback ends one that never does); `obd targets undrain NAME` lets "
        "them resume. Root (or the daemon's own user) only.",
    )
    td.add_argument("name", metavar="NAME", help="the target's name in the config")
    td.add_argument("--wait", action="store_true", help="wait until no run's job is left on the target")
    td.add_argument(
        "--cancel", action="store_true", help="cancel the runs that have not announced obd's plugin, instead of asking"
    )
    td.add_argument("--json", action="store_true", help="print what was paused, cancelled and already stopping as JSON")
    tu = tg.add_parser("undrain", help="let a drained target start runs again", description="Undrain a target.")
    tu.add_argument("name", metavar="NAME", help="the target's name in the config")
    tu.add_argument("--json", action="store_true", help="print the answer as JSON")
    tc = tg.add_parser(
        "check",
        help="check a target: reachable, workdir writable, Python, torch, disk",
        description="Check that a target can run jobs: reachable, host key, workdir writable, Python, torch, disk.",
    )
    tc.add_argument("name", metavar="NAME", help="the target's name in the config")
    tc.add_argument("--json", action="store_true", help="print the checks as a JSON list")


def _add_pods(sub: Any) -> None:
    # `obd pods` has its own parser (daemon/service/pods_admin.py): list, rm, retrieve and their options.
    pods = sub.add_parser(
        "pods",
        add_help=False,
        help="the Runpod pods obd created: list, rm POD, retrieve RUN (obd pods --help)",
        description="The Runpod pods obd created; works without the daemon.",
    )
    pods.add_argument("rest", nargs=argparse.REMAINDER, metavar="...", help="list | rm POD_ID | retrieve RUN_ID")


def _add_completion(sub: Any) -> None:
    comp = sub.add_parser(
        "completion",
        help="print the shell completion script for bash, zsh or fish",
        description="Print the completion script for SHELL (a static script: completing costs no Python start).",
        epilog=COMPLETION_HELP,
    )
    comp.add_argument("shell", choices=SHELLS, metavar="SHELL", help="bash, zsh or fish")


def _format_all(parser: argparse.ArgumentParser) -> None:
    """Every command's help laid out alike (`_Formatter`), those of daemon/cli/view.py included; and
    no parser takes an abbreviated flag (`--gpu` for `--gpus`), which run files and the API refuse."""
    parser.formatter_class = _Formatter
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _format_all(sub)


def command_parser(parser: argparse.ArgumentParser, path: list[str | None]) -> argparse.ArgumentParser:
    """The parser of `obd train start` (path ["train", "start"]): as deep as the path names one."""
    for name in path:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or name not in subs[0].choices:
            break
        parser = subs[0].choices[name]
    return parser


def _run_arg(parser: argparse.ArgumentParser, what: str = "the run") -> None:
    parser.add_argument("id", metavar="RUN", help=f"{what}: an id, a unique id prefix, a name, or `last`")


def _add_environment(parser: argparse.ArgumentParser, for_resume: bool = False) -> None:
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="set K=V in the job's environment"
        + (" (RUN's --env values are not kept: give them again)" if for_resume else ""),
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


def _add_limits(parser: argparse.ArgumentParser, for_resume: bool = False) -> None:
    """The chain's limits (docs/limits.md): obd asks for a snapshot ahead of each, so the run stops."""
    own = " (RUN's are not carried: a resumed run has its own)" if for_resume else ""
    parser.add_argument(
        "--time-limit",
        type=duration_seconds,
        metavar="DURATION",
        help="stop it with a snapshot before it ran this long (90m, 2h), summed over its retries and pauses" + own,
    )
    parser.add_argument(
        "--deadline",
        type=deadline_time,
        metavar="TIME",
        help="stop it with a snapshot before this clock time: HH:MM (the next one) or 2025-06-01T14:00",
    )
    parser.add_argument(
        "--max-gpu-hours",
        type=positive_number,
        metavar="H",
        help="stop it with a snapshot before its GPUs × running hours reach H, over all its attempts",
    )
    parser.add_argument(
        "--max-cost-usd",
        type=positive_number,
        metavar="D",
        help="stop it with a snapshot before it costs D dollars (a pod's rate, or the target's price_per_gpu_hour)",
    )


def _add_start(train: Any) -> argparse.ArgumentParser:
    s = train.add_parser(
        "start",
        help="start a run: obd train start [OPTIONS] -- COMMAND [ARG]...",
        description="Start a run of COMMAND on a target; print its id.",
        epilog=START_EXAMPLES,
    )
    s.add_argument(
        "--target",
        default="local",
        help="where to run it: a target of the config (default: local), a pool of them, or targets in order "
        "of preference (a,b,c: it starts on the first with free GPUs; docs/placement.md)",
    )
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
        help="higher starts first from the queue, and may pause runs of lower priority (-100..100)",
    )
    pre = s.add_mutually_exclusive_group()
    pre.add_argument(
        "--preemptible",
        dest="preemptible",
        action="store_true",
        default=None,
        help="it may be paused (through a verified snapshot) for a run of higher priority; the target's default",
    )
    pre.add_argument(
        "--no-preemptible", dest="preemptible", action="store_false", help="it is never paused for another run"
    )
    s.add_argument(
        "--retry",
        type=_count(0, 100),
        metavar="N",
        help="start it again up to N times from its checkpoint if it fails or is preempted",
    )
    s.add_argument(
        "--keep-checkpoints",
        type=_count(1, 100000),
        metavar="N",
        help="keep its chain's newest N complete checkpoints (and any a resume needs), deleting older ones "
        "on the target; default: the target's keep_checkpoints, else all",
    )
    _add_limits(s)
    s.add_argument("--profile", action="store_true", help="run it under the profiler; see obd train metrics")
    s.add_argument(
        "--snapshot-on-sigterm", action="store_true", help="a SIGTERM to the job becomes a snapshot request (preempted)"
    )
    s.add_argument(
        "-f",
        "--file",
        metavar="RUN.toml",
        help="take the run from a run file (docs/run-file.md); the flags given here override it",
    )
    s.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a key of the run file (--set gpus=2, --set env.NAME=VALUE), before the flags",
    )
    s.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved run as a run file (--json: as JSON) and start nothing",
    )
    s.add_argument(
        "--after",
        action="append",
        default=[],
        metavar="RUN[:STATE,...]",
        help="wait queued until RUN (and its retries) ended succeeded or stopped (or the STATEs given); if it "
        "ends otherwise, this run is cancelled; repeatable. Its outputs: $OBD_AFTER_1_OUTPUT",
    )
    s.add_argument(
        "--after-any", action="store_true", help="with --after: start once those runs ended, whatever their end"
    )
    s.add_argument("--json", action="store_true", help="print the new run's record, not just its id")
    s.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="the job's command, after --")
    return s


# Options of `obd train start` that a sweep does not take from it (it has its own --help).
START_ONLY = frozenset({"help"})


def _add_sweep(train: Any, start: argparse.ArgumentParser) -> None:
    """`obd train sweep`: every option of `obd train start` (the same actions, so the two never
    differ), and --grid."""
    sw = train.add_parser(
        "sweep",
        help="start one run per combination of --grid values: obd train sweep [OPTIONS] --grid NAME=V1,V2 -- COMMAND",
        description="Start one run per combination of the --grid values, each with {NAME} in its command "
        "replaced by its value; print the sweep's id.",
        epilog=SWEEP_EXAMPLES,
    )
    sw.add_argument(
        "--grid",
        action="append",
        metavar="NAME=V1,V2",
        help="the values of NAME, one run each (with every value of the other --grid); repeatable; "
        "over a run file's [grid] (-f)",
    )
    groups = {id(a): g for g in start._mutually_exclusive_groups for a in g._group_actions}
    made: dict[int, Any] = {}
    for action in start._actions:
        if action.dest in START_ONLY:
            continue
        group = groups.get(id(action))
        if group is None:
            sw._add_action(action)
            continue
        if id(group) not in made:
            made[id(group)] = sw.add_mutually_exclusive_group()
        made[id(group)]._add_action(action)


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
    rs.add_argument("--target", help="continue on this target instead of RUN's (its checkpoint carried there)")
    rs.add_argument(
        "--gpus", metavar="N|IDS", help="as for a start; default: RUN's on its target, the new target's elsewhere"
    )
    _add_environment(rs, for_resume=True)
    rs.add_argument(
        "--retry", type=_count(0, 100), metavar="N", help="start it again up to N times if it fails or is preempted"
    )
    _add_limits(rs, for_resume=True)
    rs.add_argument(
        "--again",
        action="store_true",
        help="resume RUN even though it succeeded (its script's after-train code runs again)",
    )
    rs.add_argument("--json", action="store_true", help="print the new run's record, not just its id")
    rs.add_argument(
        # Not REMAINDER: the options after RUN (`resume sft --checkpoint 400`) are resume's own.
        "command",
        nargs="*",
        metavar="-- COMMAND",
        help="a new command, after --; default: RUN's",
    )


MOVE_EXAMPLES = """\
examples:
  obd train move sft --to box          snapshot here, carry, continue on box
  obd train move sft --to box --wait   and wait until it trained a step there

exit codes with --wait: 0 it trained a step on the new target; 4 the run ended without a
snapshot (nothing moved); 6 the carry or the start there failed (the run stays stopped and
resumable where it was); 7 its job never loaded obd's plugin (it runs on)."""


def _add_move(train: Any) -> None:
    mv = train.add_parser(
        "move",
        help="snapshot a running run, carry its checkpoint to another target and continue there",
        description="Move a running run to another target: a snapshot here (as stop), then the same as "
        "`resume RUN --target T` (its checkpoint carried, every file verified on arrival). Nothing is "
        "deleted here: a move that fails leaves the run stopped and resumable where it was.",
        epilog=MOVE_EXAMPLES,
    )
    _run_arg(mv, "the running run to move")
    mv.add_argument("--to", required=True, metavar="TARGET", help="the target it continues on")
    mv.add_argument("--gpus", metavar="N|IDS", help="as for a start; default: the new target's")
    _add_environment(mv, for_resume=True)
    mv.add_argument("--wait", action="store_true", help="show the carry's progress; wait until it trained a step there")
    mv.add_argument("--json", action="store_true", help="print the run's record")


def _add_stop_and_cancel(train: Any) -> None:
    from trainer_plugin.rundir import DEFAULT_REASON, REASONS  # the stop's reason words, only when asked

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
        default=DEFAULT_REASON,
        choices=REASONS,
        help=f"the reason word written in the request (default: {DEFAULT_REASON})",
    )
    st.add_argument("--wait", action="store_true", help="wait until the run ended; exit 0 only with a snapshot")
    st.add_argument("--json", action="store_true", help="print the run's record")

    c = train.add_parser(
        "cancel",
        help="end the run now: TERM to its processes, KILL after the grace",
        description="Cancel the run: TERM to the job's process group, KILL after cancel_grace. A queued run "
        "leaves the queue. A run that ended is left as it is: said as by stop (`already ended`, exit 1).",
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
    x.add_argument(
        "--as-file",
        action="store_true",
        help="print the run's start as a run file (obd train start -f FILE starts one like it)",
    )

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


def _add_prune(train: Any) -> None:
    pr = train.add_parser(
        "prune",
        help="delete a run's older checkpoints now, keeping the newest N complete (and any a resume needs)",
        description="Delete the checkpoints of RUN's chain that checkpoint retention would (docs/checkpoints.md), "
        "on its target, and say what that freed.",
    )
    _run_arg(pr)
    pr.add_argument(
        "--keep", type=_count(1, 100000), metavar="N", help="how many complete checkpoints to keep (default: RUN's)"
    )
    pr.add_argument("--json", action="store_true", help="print what was removed and kept as JSON")


EXEC_EXAMPLES = """\
examples:
  obd train exec last -- nvidia-smi
  obd train exec sft -- sh -c 'ls -l output/; tail -n 3 metrics.jsonl'
  obd train exec -t sft -- top
  obd train shell sft

The command runs where the run's job runs (its target; a Slurm job's node, through
srun --jobid --overlap), as the run's user, in its run directory, with the job's GPUs
(CUDA_VISIBLE_DEVICES...) and OBD_* variables. exec exits with the command's exit status;
an error before it ran exits as any obd error (obd --help lists the codes).
See docs/exec-and-shell.md."""


def _add_exec(train: Any) -> None:
    ex = train.add_parser(
        "exec",
        help="run a command where the run's job runs (its target, user, run directory and GPUs)",
        description="Run a command where RUN's job runs: its target, as its user, in its run directory, "
        "with its GPUs visible. Output is streamed; obd exits with the command's exit status.",
        epilog=EXEC_EXAMPLES,
    )
    ex.add_argument("--tty", "-t", action="store_true", help="run it on a terminal (for top, htop, an editor)")
    _run_arg(ex)
    ex.add_argument("command", nargs="*", metavar="COMMAND", help="the command and its arguments, after --")

    sh = train.add_parser(
        "shell",
        help="an interactive shell where the run's job runs",
        description="Open a login shell where RUN's job runs: its target, as its user, in its run directory, "
        "with its GPUs visible, on a terminal. obd exits with the shell's exit status.",
        epilog=EXEC_EXAMPLES,
    )
    _run_arg(sh)


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
    ls.add_argument(
        "--sweep", metavar="SWEEP", help="the runs of this sweep (its id or name), with their values and best loss"
    )
    ls.add_argument(
        "--expand",
        action="store_true",
        help="a row for each queued member of a sweep (by default one row for a sweep's queued members, "
        "as squeue folds a job array; --json always lists each run)",
    )
    ls.add_argument("--json", action="store_true", help="print the runs as a JSON list")
