"""What the `obd` command's parts share: the exit codes, the run states, usage errors.

Standard library only, like every module the client imports.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing (every command imports this)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

DIST = "obd-train"  # the distribution's name on the package index; the command is `obd`

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2

EXIT_CANCELLED, EXIT_NO_SNAPSHOT, EXIT_STOPPED, EXIT_FAILED = 3, 4, 5, 6

EXIT_NO_PLUGIN = 7  # stop --wait: no snapshot can come, the job has not loaded obd's plugin (it runs on)

EXIT_UNREACHABLE, EXIT_BUSY, EXIT_DENIED, EXIT_INTERRUPTED, EXIT_PIPE = 69, 75, 77, 130, 141


# The code of each final state, for the commands that wait for a run to end.
STATE_EXIT = {"succeeded": EXIT_OK, "stopped": EXIT_STOPPED, "cancelled": EXIT_CANCELLED, "failed": EXIT_FAILED}

RECONNECT_FOR = 600.0  # how long a follow or a wait waits out a daemon that went away (a restart)

# The target that is always this machine, and the default of `--target`: the config gives the
# name to no other kind, so a run on it needs no question to the daemon.
LOCAL_TARGET = "local"


def on_this_machine(target: str | None, targets: Callable[[], list[dict[str, Any]]]) -> bool:
    """Whether `target` is the daemon's own machine, whose run directories are files here and whose
    jobs start from their caller's environment. `local` always is; of another name the daemon's
    list of targets says so (`targets()`, asked only then: its `this_machine`, which the service
    fills from the kind's capability), since this client may not be able to read the config."""
    if target is None or target == LOCAL_TARGET:
        return target == LOCAL_TARGET
    return reaches_this_machine(target, targets())


def reaches_this_machine(target: str, targets: list[dict[str, Any]]) -> bool:
    """Whether a run of `--target` (one target, a pool, or `a,b` in order of preference) may run
    on the daemon's machine: any target it names, a pool's or their overflows (docs/placement.md)."""
    names = {part.strip() for part in target.split(",")}
    named = [t for t in targets if t.get("name") in names or names & set(t.get("pools") or ())]
    overflows = {t.get("overflow") for t in named}
    return any(t.get("this_machine") for t in named) or any(
        t.get("this_machine") for t in targets if t.get("name") in overflows
    )


SHELLS = ("bash", "zsh", "fish")

EXIT_CODES = """\
exit codes:
  0    success (for the commands that wait: the run ended as they asked)
  1    an error the daemon reported; the message says what to do next
  2    bad usage
  3    the run was cancelled (stop --wait: no snapshot came in time)
  4    stop --wait: no snapshot (the run or its training finished, or it failed)
  5    the run stopped with a snapshot (obd train resume RUN continues it)
  6    the run failed (obd train status RUN says why, with its exit code)
  7    stop --wait: no snapshot can come (the job has no obd plugin; runs on)
  69   the daemon cannot be reached (the message says how to start it)
  75   the daemon is busy with other callers: retry in a moment
  77   refused: the run is another user's
  130  interrupted (Ctrl-C)
  141  the output was closed before it was all written (| head)

logs --follow exits with the code of the state the run ended in (succeeded: 0).
stop --wait exits 0 when the run stopped with a valid snapshot, else 3, 4 or 7.
cancel --wait exits 0 when the run was cancelled, else its state's code.
exec and shell exit with the status of the command they ran."""


class UsageError(Exception):
    pass
