"""A target's `python` as the `python` and `python3` of its jobs' PATH.

A target's `python` key names the interpreter obd's job wrapper runs with; a job's own
`python train.py` would otherwise run whatever its PATH finds first. So each run of a target
whose config sets `python` (and no `venv`, whose `bin/` already leads the PATH) gets
`plugin/bin/python` and `plugin/bin/python3`, first on its PATH.

They are small shell scripts that `exec` the interpreter, not symbolic links: a link to a
virtual environment's `bin/python` would run Python without that environment (Python looks for
`pyvenv.cfg` beside the path it was started by, not beside the link's target), and its
`sys.executable` would be the link. Through the script, `sys.executable` is the configured
interpreter itself. A path is written into the script; a name (`python3.11`) is looked up when
the script runs, on the job's PATH without the script's own directory, as the wrapper's start
looked it up. The local executor writes them as the run's owner; the SSH executor through its
connection (the helper's writes and one SFTP request: no shell).
"""

from __future__ import annotations

import os
import posixpath
import shlex

from trainer_plugin import rundir

BIN = f"{rundir.PLUGIN}/bin"  # in the run directory (`bin_dir`); first on the job's PATH
NAMES = ("python", "python3")
MODE = 0o755
_HEAD = "#!/bin/sh\n# obd: the python of this target, first on the PATH of its jobs\n"


def bin_dir(run_dir: str) -> str:
    """Where a run's shims are: `<run dir>/plugin/bin`, first on its job's PATH."""
    return posixpath.join(rundir.RunPaths(run_dir).plugin, "bin")


def shim(interpreter: str) -> bytes:
    """The script that runs `interpreter` (an absolute path) with the arguments it was given."""
    return f'{_HEAD}exec {shlex.quote(interpreter)} "$@"\n'.encode()


def looking_up(name: str, bin_dir: str) -> bytes:
    """The script that runs the program `name` found on the PATH without `bin_dir` (where the
    script itself is: it would find itself), with the arguments it was given."""
    here, program = shlex.quote(bin_dir), shlex.quote(name)
    return (
        f"{_HEAD}rest=\nset -f\nIFS=:\n"
        f'for d in $PATH; do [ "$d" = {here} ] || rest="$rest${{rest:+:}}$d"; done\n'
        "unset IFS\nset +f\n"
        f'p="$(PATH="$rest"; command -v {program})" || {{\n'
        f'  echo "obd: the target\'s python" {program} "is not on the PATH" >&2\n  exit 127\n}}\n'
        'exec "$p" "$@"\n'
    ).encode()


def write_local(bin_dir: str, interpreter: str) -> None:
    """Write the shims in `bin_dir` on this machine (called with the run's owner's rights)."""
    os.makedirs(bin_dir, mode=MODE, exist_ok=True)
    for name in NAMES:
        rundir.atomic_write(os.path.join(bin_dir, name), shim(interpreter), MODE)
