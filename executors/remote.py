"""Pure helpers for running things on a POSIX target: quoting, shell snippets, upload filters.

Kept apart from the SSH executor so the exact remote command lines can be unit-tested without a
server (and reused by the Runpod executor). Every path and argument goes through
`shlex.quote`; nothing here ever puts a secret on a command line.
"""

from __future__ import annotations

import hashlib
import io
import posixpath
import re
import shlex
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

from trainer_plugin import rundir
from trainer_plugin.tools import contain, creds, jobctl, jobserve, supervisor

# The files a target needs to start, watch and cancel jobs, installed flat into one directory:
# jobctl.py, the job wrapper (supervisor.py, creds.py, contain.py), the helper (jobserve.py) and
# the contract they import (trainer_plugin/tools/__init__.py: the tools' two layouts).
TOOL_FILES: tuple[Path, ...] = (
    Path(jobctl.__file__),
    Path(rundir.__file__),
    Path(contain.__file__),
    Path(jobserve.__file__),
    Path(supervisor.__file__),
    Path(creds.__file__),
)


def tools_hash(files: Sequence[Path]) -> str:
    """A short digest of the files' names and contents: the name of the directory they are installed in."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def _tools_tar(files: Sequence[Path]) -> bytes:
    """A ustar archive of the tool files, the same bytes for the same files (no time, owner or host in it)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path in files:
            data = path.read_bytes()
            info = tarfile.TarInfo(path.name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


# What `setup_script` reads on stdin (the name is older than the tar): the tool files as a tar,
# unpacked once per content into `<workdir>/.obd/tools-<JOBCTL_HASH>/`.
JOBCTL_SOURCE: bytes = _tools_tar(TOOL_FILES)
# The content hash over every tool file, so a change to either gives a new directory.
JOBCTL_HASH: str = tools_hash(TOOL_FILES)

# Directory names never uploaded with a job's working directory (caches, VCS, environments).
EXCLUDED_NAMES = frozenset({".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".mypy_cache", "node_modules"})

_TILDE_USER = re.compile(r"^~([A-Za-z0-9._-]+)(/.*)?$")


def q(value: str) -> str:
    """One shell word, taken literally by any POSIX shell."""
    return shlex.quote(value)


def join(argv: Sequence[str]) -> str:
    """A command line whose words are exactly `argv`."""
    return " ".join(q(a) for a in argv)


def path_expr(path: str) -> str:
    """A shell expression for a configured remote path: `~`, `~/x`, `~user/x` and relative paths
    are expanded by the remote shell (relative means relative to the home); the rest is quoted."""
    if "\n" in path or "\0" in path:
        raise ValueError(f"a remote path cannot hold a newline or NUL: {path!r}")
    if path in ("~", ""):
        return '"$HOME"'
    if path.startswith("~/"):
        rest = path[2:]
        return '"$HOME"/' + q(rest) if rest else '"$HOME"'
    match = _TILDE_USER.match(path)
    if match:  # a bare ~name (safe characters only) is expanded by the shell itself
        rest = (match.group(2) or "").lstrip("/")
        return f"~{match.group(1)}/" + q(rest) if rest else f"~{match.group(1)}"
    if not path.startswith("/"):
        return '"$HOME"/' + q(path)
    return q(path)


def tools_remote_dir(workdir: str) -> str:
    """The content-addressed directory of the tool files under a resolved workdir."""
    return f"{workdir.rstrip('/')}/.obd/tools-{JOBCTL_HASH}"


def jobctl_remote_path(workdir: str) -> str:
    """Where jobctl.py (beside the rundir.py it imports) lives under a resolved workdir."""
    return f"{tools_remote_dir(workdir)}/jobctl.py"


def beside(jobctl_path: str, name: str) -> str:
    """Another tool file of the same flat directory as `jobctl_path` (the wrapper, the helper)."""
    return posixpath.join(posixpath.dirname(jobctl_path), name)


def setup_script(workdir: str, python: str | None, venv: str | None) -> str:
    """One shell script run once per connection: resolve the workdir, create `.obd/`, install
    the tool files from the tar on stdin unless that exact version is there, and report the
    Python version.

    The tar is unpacked into a temporary directory renamed into place whole, so a directory
    `tools-<hash>` always holds every file; a connection that loses the race to another one
    keeps the winner's (same content). Needs `tar` on the target, as every Linux has.
    Output lines: `workdir=<abs>`, `python=<exe>` (may be relative, resolved through PATH),
    then `python-version=<x.y.z>` or `python-missing=<exit code>`.
    Exit codes: 3 the workdir cannot be created, 4 the tool files cannot be written.
    """
    py = python_expr(python, venv)
    names = " ".join(q(p.name) for p in TOOL_FILES)
    return f"""
W={path_expr(workdir)}
case "$W" in /*) ;; *) W="$(pwd)/$W" ;; esac
mkdir -p -- "$W/.obd" || exit 3
[ -w "$W/.obd" ] || {{ echo "$W/.obd is not writable" >&2; exit 3; }}
D="$W/.obd/tools-{JOBCTL_HASH}"
complete() {{ for f in {names}; do [ -f "$1/$f" ] || return 1; done; }}
if complete "$D"; then
  cat >/dev/null
else
  T="$W/.obd/.tools-{JOBCTL_HASH}.$$.tmp"
  rm -rf -- "$T"
  if mkdir -- "$T" && tar -xf - -C "$T" && complete "$T"; then :; else rm -rf -- "$T"; exit 4; fi
  # A broken copy (files deleted by hand) is moved aside; a complete one won a race: keep it.
  if [ -e "$D" ] && ! complete "$D"; then mv -- "$D" "$T.broken" && rm -rf -- "$T.broken"; fi
  [ -e "$D" ] || mv -- "$T" "$D" 2>/dev/null
  rm -rf -- "$T" "$D/${{T##*/}}"
  complete "$D" || {{ echo "could not install $D" >&2; exit 4; }}
fi
printf 'workdir=%s\\n' "$W"
P={py}
printf 'python=%s\\n' "$P"
V="$("$P" -c 'import platform; print(platform.python_version())' 2>/dev/null)"
rc=$?
if [ $rc -eq 0 ]; then printf 'python-version=%s\\n' "$V"; else printf 'python-missing=%s\\n' "$rc"; fi
"""


def python_expr(python: str | None, venv: str | None) -> str:
    """Shell expression for the interpreter: `<venv>/bin/python` when a venv is set, else
    the configured python (a name found through PATH, or a path)."""
    if venv:
        return path_expr(venv.rstrip("/") + "/bin/python")
    name = python or "python3"
    if "/" in name:
        return path_expr(name)
    return q(name)


def parse_setup(stdout: str) -> dict[str, str]:
    """The key=value lines printed by `setup_script`."""
    out: dict[str, str] = {}
    for line in stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("workdir", "python", "python-version", "python-missing"):
            out[key] = value
    return out


def start_command(python: str, jobctl_path: str, remote_dir: str) -> str:
    """`setsid nohup PY supervisor.py start DIR --secrets-stdin` (the wrapper, beside jobctl.py),
    with stdin (the secrets) passed on.

    The launcher runs as a background child of a non-interactive shell, so it is not a
    process-group leader and `setsid` acts in place instead of forking and returning at once;
    stdin is handed over explicitly through fd 3 (a background job's stdin would be /dev/null).
    Where `setsid` is missing (not Linux), the wrapper's own setsid() still detaches the job.
    """
    launch = join([python, beside(jobctl_path, "supervisor.py"), "start", remote_dir, "--secrets-stdin"])
    return (
        "exec 3<&0\n"
        "if command -v setsid >/dev/null 2>&1; then\n"
        f"  setsid nohup {launch} 0<&3 3<&- &\n"
        "else\n"
        f"  nohup {launch} 0<&3 3<&- &\n"
        "fi\n"
        'wait "$!"\n'
    )


def helper_command(python: str, jobctl_path: str) -> str:
    """`exec PY -S jobserve.py` (beside jobctl.py): the persistent helper of a connection (executors/ssh/helper.py).

    As little as can be for the shell sshd runs it with: that shell replaces itself with the
    helper at once. (It still reads ~/.bashrc first: bash does for any command under sshd.)
    `-S`: the helper needs only the standard library, and starts faster without site-packages.
    """
    return "exec " + join([python, "-S", beside(jobctl_path, "jobserve.py")])


def jobctl_command(python: str, jobctl_path: str, *args: str) -> str:
    """`exec PY jobctl ARGS...`, every word quoted."""
    return "exec " + join([python, jobctl_path, *args])


def mkdirs_command(paths: Iterable[str]) -> str:
    """`mkdir -p -- P...` for remote directories."""
    return join(["mkdir", "-p", "--", *paths])


def is_excluded_dir(path: Path) -> bool:
    """True for a directory an upload leaves out: VCS, caches, virtual environments."""
    return path.name in EXCLUDED_NAMES or (path / "pyvenv.cfg").is_file()


def walk_upload(root: Path) -> tuple[list[Path], list[Path], list[Path]]:
    """(directories, files, symlinks) under `root` to upload, relative to it, parents first.

    Symbolic links are kept as links (like the local executor), never followed, so a link to
    a large or private tree outside the directory uploads nothing of it.
    """
    dirs: list[Path] = []
    files: list[Path] = []
    links: list[Path] = []
    stack = [Path()]
    while stack:
        rel = stack.pop()
        for entry in sorted((root / rel).iterdir(), key=lambda p: p.name):
            sub = rel / entry.name
            if entry.is_symlink():
                links.append(sub)
            elif entry.is_dir():
                if is_excluded_dir(entry):
                    continue
                dirs.append(sub)
                stack.append(sub)
            elif entry.is_file():
                files.append(sub)
    dirs.sort(key=lambda p: len(p.parts))
    return dirs, files, links
