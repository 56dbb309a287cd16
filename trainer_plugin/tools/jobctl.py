"""The target-side control of a run directory and its job (standard library only).

obd copies this file, with the `rundir.py` it imports (the run directory's contract), the job
wrapper (`supervisor.py`, `creds.py`, `contain.py`) and the SSH helper (`jobserve.py`), into every
run's `plugin/trainer_plugin/` (and, for SSH targets and pods, flat into
`<workdir>/.obd/tools-<hash>/`) and runs it *on the target*, so the same code watches and cancels
jobs on this machine, over SSH and on a pod:

    python3 jobctl.py cancel RUN_DIR [--grace S]         # TERM the job's processes, grace, KILL
    python3 jobctl.py probe < [{"dir": ..., "handle": ...}, ...]   # one read of many runs
    python3 jobctl.py checkpoints RUN_DIR                # bytes held by each output/checkpoint-<step>
    python3 jobctl.py remove-checkpoint RUN_DIR NAME     # delete one (checkpoint retention), say what it freed

The job is started by the wrapper's own command (`python3 supervisor.py start RUN_DIR ...`) and an
SSH connection's helper is `python3 -S jobserve.py`: both use this module's functions, and this
module imports neither. Doing the pid checks on the target itself means a pid is never checked on
one round trip and signalled on another, and a reused pid (start time differs) is never mistaken
for the job. With a facts directory (`--facts DIR`: where the wrapper records the job's handle
and end, a place of the daemon's own), how the job ends is read there and never from the run
directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import sys
import time
from typing import Any

try:  # imported as trainer_plugin.tools.jobctl
    from .. import rundir
    from . import contain
except ImportError:  # run by path, or imported by bare name (tools/__init__.py: the two layouts)
    # rundir.py is beside this file in a flat copy, in the folder above in a copy of the package.
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import contain  # type: ignore[no-redef, import-not-found]
    import rundir  # type: ignore[no-redef, import-not-found]

# Kept importable from here for the callers that knew them as jobctl's.
atomic_write = rundir.atomic_write
fsync_dir = rundir.fsync_dir
read_regular = rundir.read_regular
PROOF_LIMIT = rundir.PROOF_LIMIT
REQUEST_LIMIT = rundir.REQUEST_LIMIT
METRICS_HEAD = rundir.METRICS_HEAD
METRICS_TAIL = rundir.METRICS_TAIL


def file_size(path: str) -> int:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


# --- process identity -------------------------------------------------------------------


_BOOT_ID: str | None = None


def boot_id() -> str:
    """This boot's id (read once: it cannot change while this process lives)."""
    global _BOOT_ID
    if _BOOT_ID is None:
        data = read_regular("/proc/sys/kernel/random/boot_id", 64)
        _BOOT_ID = data.decode().strip() if data else ""
    return _BOOT_ID


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of /proc/PID/stat from the state on (field 3), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    return data[data.rfind(b")") + 2 :].split()


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process, or None."""
    rest = _stat_fields(pid)
    try:
        return (rest[0].decode(), int(rest[19])) if rest else None
    except (IndexError, ValueError):
        return None


def process_start_time(pid: int) -> int | None:
    info = _proc_stat(pid)
    return info[1] if info else None


def _handle_ids(handle: dict[str, Any] | None) -> tuple[int, int] | None:
    """(pid, start time) of a handle from this boot, or None for a handle that names nothing here."""
    if not handle:
        return None
    try:
        pid, start = int(handle["pid"]), int(handle["start_time"])
    except (KeyError, TypeError, ValueError):
        return None
    if pid <= 1 or (handle.get("boot_id") and handle["boot_id"] != boot_id()):
        return None
    return pid, start


def handle_alive(handle: dict[str, Any] | None) -> bool:
    """True only if the very process that started the job is still alive (not a reused pid)."""
    ids = _handle_ids(handle)
    if ids is None:
        return False
    info = _proc_stat(ids[0])
    return info is not None and info[1] == ids[1] and info[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int] | None:
    """Live (not zombie) processes of a process group, or None when /proc cannot be read."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = []
    for entry in entries:
        rest = _stat_fields(entry) if entry.isdigit() else None
        if rest and len(rest) > 2 and rest[2] == str(pgid).encode() and rest[0] not in (b"Z", b"X"):
            members.append(int(entry))
    return members


def group_exists(pgid: int) -> bool:
    """True while a process of the group is alive (zombies waiting to be reaped do not count).

    Linux never hands out a pid that is still some group's id, so a live group is ours.
    """
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    members = group_members(pgid)
    return True if members is None else bool(members)


def group_alive(handle: dict[str, Any] | None) -> bool:
    """True while any process of the job's process group lives, even if its wrapper died.

    The group is ours only if its leader is the job's wrapper or gone: a leader with another
    start time is a reused pid, which the kernel hands out only once the old group emptied.
    """
    ids = _handle_ids(handle)
    if ids is None:
        return False
    pgid, start = ids
    leader = _proc_stat(pgid)
    if leader is not None and leader[1] != start:
        return False
    return group_exists(pgid)


def read_handle(run_dir: str, facts: str | None = None) -> dict[str, Any] | None:
    """The wrapper's handle: from the facts directory where there is one, else from job.pid."""
    path = rundir.FactPaths(facts).handle if facts else rundir.RunPaths(run_dir).job_pid
    data = read_regular(path, rundir.JOB_PID_LIMIT)
    if not data:
        return None
    try:
        handle = rundir.load_json(data)
    except ValueError:
        return None
    return handle if isinstance(handle, dict) else None


def read_int(path: str) -> int | None:
    data = read_regular(path, rundir.EXIT_CODE_LIMIT)
    if data is None:
        return None
    try:
        return int(data.strip())
    except ValueError:
        return None


def job_status(run_dir: str, handle: dict[str, Any] | None = None, facts: str | None = None) -> dict[str, Any]:
    """{state: running|exited|cancelled|lost, exit_code} from /proc and the end the wrapper recorded.

    With a facts directory, the end and the cancel marks are read there only: nothing in the
    run directory is looked at. The wrapper outlives every process of its job, so the job runs
    while it lives."""
    marks = end_marks(run_dir, facts)
    code = read_int(marks.exit_code)
    if os.path.lexists(marks.cancelled):
        return {"state": "cancelled", "exit_code": code}
    handle = handle or read_handle(run_dir, facts)
    # A job whose wrapper died but whose processes live on is still running (and cancellable).
    if code is None and (handle_alive(handle) or group_alive(handle)):
        return {"state": "running", "exit_code": None}
    # The wrapper may have just written exit_code and exited: read once more.
    code = read_int(marks.exit_code)
    if os.path.lexists(marks.cancelling):
        # A cancel was under way (its canceller may have died before writing `cancelled`).
        return {"state": "cancelled", "exit_code": code}
    if code is not None:
        return {"state": "exited", "exit_code": code}
    return {"state": "lost", "exit_code": None}


def planted(run_dir: str) -> list[str]:
    """The end marks found in a run directory whose job's end is recorded elsewhere (a facts
    directory): nobody but the job's user can have put them there, and they change nothing."""
    paths = rundir.RunPaths(run_dir)
    return [n for n in (rundir.CANCELLING, rundir.CANCELLED) if os.path.lexists(paths.file(n))]


def end_marks(run_dir: str, facts: str | None) -> rundir.RunPaths | rundir.FactPaths:
    """Where the job's end and the cancel marks are (`exit_code`, `cancelling`, `cancelled`): the
    facts directory where there is one, else the run directory."""
    return rundir.FactPaths(facts) if facts else rundir.RunPaths(run_dir)


# --- the job's processes ------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, int]] | None:
    """{pid: (parent pid, process group)} of every live process, or None when /proc cannot be read."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    table = {}
    for entry in entries:
        rest = _stat_fields(entry) if entry.isdigit() else None
        if rest and len(rest) > 2 and rest[0] not in (b"Z", b"X"):
            with contextlib.suppress(ValueError):
                table[int(entry)] = (int(rest[1]), int(rest[2]))
    return table


def job_processes(root: int) -> set[int]:
    """The live processes of the job whose wrapper is `root`: its process group and every
    descendant of the wrapper (a subreaper: orphans of the job come back to it), not the wrapper."""
    table = _process_table()
    if table is None:
        return set()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found = {pid for pid, (_, pgid) in table.items() if pgid == root}
    stack, seen = list(children.get(root, [])), set()
    while stack:
        pid = stack.pop()
        if pid not in seen:
            seen.add(pid)
            found.add(pid)
            stack.extend(children.get(pid, []))
    found.discard(root)
    return found


# Executables obd's plugin loads into (its sitecustomize), and shells, which may still start one
# (`bash train.sh` between its steps): a job running none of them cannot take a snapshot request.
PYTHON_NAMES = ("python", "pypy")
SHELL_NAMES = frozenset({"sh", "bash", "dash", "zsh", "ksh", "mksh", "fish", "busybox"})


def runs_python(handle: dict[str, Any]) -> bool:
    """Whether a Python interpreter, or a shell that may still start one, runs among the job's
    processes: obd's plugin loads only into Python, so a job with neither (`sleep 120`) cannot
    take a snapshot request. A process whose program cannot be read (another user's) counts."""
    ids = _handle_ids(handle)
    if ids is None:
        return False
    for pid in job_processes(ids[0]):
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile (or a kernel's own)
        except OSError:
            return True
        if exe.endswith(" (deleted)"):  # upgraded under it: still the program it runs
            exe = exe[: -len(" (deleted)")]
        name = os.path.basename(exe)
        if name.startswith(PYTHON_NAMES) or name in SHELL_NAMES:
            return True
    return False


def python_seen(result: dict[str, Any], handle: dict[str, Any] | None) -> bool | None:
    """`runs_python` for a probe's `python`, read only while a stop waits on a job that has not
    announced obd's plugin (running, a request, no `begin` line): a look at every process costs
    too much for each poll of each run. None when not read."""
    status = result.get("status") or {}
    if status.get("state") != "running" or result.get("request") is None or result.get("begin") is not None:
        return None
    return runs_python(handle) if handle else None


def _belongs(pid: int, root: int) -> bool:
    """Whether `pid` is, right now, in the group of `root` or below it in the process tree."""
    seen = 0
    while pid > 1 and seen < 4096:
        rest = _stat_fields(pid)
        if not rest or len(rest) < 3 or rest[0] in (b"Z", b"X"):
            return False
        ppid, pgid = int(rest[1]), int(rest[2])
        if root in (pgid, ppid):
            return True
        pid, seen = ppid, seen + 1
    return False


def signal_job(root: int, sig: int) -> None:
    """Send `sig` to every process of the job whose wrapper is `root` (never to the wrapper).

    Each process is held by a pidfd before it is checked to be the job's, and signalled through
    it, so a pid that ended and was handed to another process is never signalled."""
    for pid in job_processes(root):
        try:
            fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else -1
        except OSError:
            continue  # gone already
        try:
            if not _belongs(pid, root):
                continue
            with contextlib.suppress(ProcessLookupError):
                if fd >= 0:
                    signal.pidfd_send_signal(fd, sig)
                else:
                    os.kill(pid, sig)
        finally:
            if fd >= 0:
                os.close(fd)


# --- start ------------------------------------------------------------------------------


def become(run_as: dict[str, Any]) -> None:
    """Drop to the run's user for good (groups, gid, then uid), as a login would.

    Done first thing in the wrapper, before it touches the run directory, so every file the
    job and the wrapper write there is the user's, and nothing the user planted there is ever
    written through with root's rights.
    """
    uid, gid = int(run_as["uid"]), int(run_as["gid"])
    groups = [int(g) for g in run_as.get("groups") or [gid]]
    if (os.getuid(), os.geteuid()) == (uid, uid):
        return
    os.setgroups(groups)
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def job_environment(spec: dict[str, Any], values: dict[str, str], clean_env: bool) -> dict[str, str]:
    """The job's environment: its base (the wrapper's own, or what came on stdin) and obd's additions."""
    base = {} if clean_env else dict(os.environ)
    env = {**base, **(spec.get("env") or {}), **values}
    run_as = spec.get("run_as") or {}
    for key, value in (("HOME", run_as.get("home")), ("USER", run_as.get("user")), ("LOGNAME", run_as.get("user"))):
        if value and key not in env:
            env[key] = value
    # The run's plugin/ leads PYTHONPATH; whatever the job would have had follows it.
    lead = [p for p in (spec.get("pythonpath") or []) if p]
    if lead:
        had = (values.get("PYTHONPATH") if clean_env else os.environ.get("PYTHONPATH")) or ""
        env["PYTHONPATH"] = os.pathsep.join(lead + [p for p in had.split(os.pathsep) if p])
    path_prepend = [p for p in (spec.get("path_prepend") or []) if p]
    if path_prepend:
        env["PATH"] = os.pathsep.join([*path_prepend, env.get("PATH") or os.defpath])
    if "PATH" not in env:
        env["PATH"] = "/usr/local/bin:/usr/bin:/bin"
    return env


def wrapper_handle(command: list[str], env: dict[str, str], cwd: str) -> dict[str, Any]:
    """What a job wrapper writes to job.pid: itself (pid, start time, boot id: a reused pid is
    never taken for it), and what the job got, for `obd train status`: its program and the
    Python on its PATH."""
    me = os.getpid()
    return {
        "pid": me,
        "start_time": process_start_time(me),
        "boot_id": boot_id(),
        "uid": os.getuid(),
        "cwd": cwd,
        "executable": which(command[0], env, cwd) if command else None,
        "python": env_python(env, cwd),
    }


def env_python(env: dict[str, str], cwd: str) -> str | None:
    """The Python a job's `python3` (or `python`) runs, on its PATH."""
    return which("python3", env, cwd) or which("python", env, cwd)


def shell_exit_code(code: int) -> int:
    """A child's return code as a shell reports it: 128 + the signal number for one killed by a signal."""
    return 128 - code if code < 0 else code


def asked_output_dir(run_dir: str) -> str | None:
    """The output_dir the script asked for, as the plugin's `begin` line recorded it."""
    head = read_regular(rundir.RunPaths(run_dir).metrics, rundir.METRICS_HEAD) or b""
    begin = _parse_json_line(head.split(b"\n", 1)[0]) or {}
    asked = begin.get("output_dir_requested")
    return asked if isinstance(asked, str) and asked else None


def place_outputs(run_dir: str, output_to: str, cwd: str, log_fd: int) -> None:
    """Put a finished run's outputs where the user asked (`--output-to`), as the job's user: hard
    links where the filesystem allows, else copies. An existing directory that is not empty is
    never written into; the log says so and the outputs stay in the run directory."""
    dest = asked_output_dir(run_dir) if output_to == "asked" else output_to
    source = rundir.RunPaths(run_dir).output
    if not dest:
        os.write(log_fd, b"obd: --output-to asked: the script's output_dir is unknown; outputs stay in the run\n")
        return
    dest = os.path.join(cwd, dest)
    try:
        if os.path.lexists(dest) and (not os.path.isdir(dest) or os.path.islink(dest) or os.listdir(dest)):
            os.write(log_fd, f"obd: outputs not placed in {dest}: it exists and is not empty\n".encode())
            return
        shutil.copytree(source, dest, symlinks=True, copy_function=_link_or_copy, dirs_exist_ok=True)
        os.write(log_fd, f"obd: outputs placed in {dest}\n".encode())
    except OSError as exc:
        os.write(log_fd, f"obd: outputs not placed in {dest}: {exc}\n".encode())


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def which(program: str, env: dict[str, str], cwd: str) -> str | None:
    """The program a job's command runs, as its user named it (absolute, links kept: a venv's
    `bin/python` stays the venv's, not the base Python it links to); None when it cannot run."""
    if "/" in program:
        path = os.path.normpath(os.path.join(cwd, program))
        return path if os.access(path, os.X_OK) else None
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    return os.path.abspath(found) if found else None


LEFT_BEHIND = "obd: the job left"


def write_exit_code(run_dir: str, code: int) -> None:
    """The job wrapper's last word: the job's exit status, in `exit_code`."""
    atomic_write(rundir.RunPaths(run_dir).exit_code, f"{code}\n".encode())


# --- cancel -----------------------------------------------------------------------------


def cancel(
    run_dir: str, grace: float, handle: dict[str, Any] | None = None, facts: str | None = None
) -> dict[str, Any]:
    """TERM the job's processes, wait `grace` seconds, then KILL; idempotent.

    A job that already ended is never signalled; a second cancel only reports. The wrapper is
    left to record the exit status once its job's processes are gone, and waited for briefly.
    With a facts directory the cancel marks are written there, not in the run directory.
    """
    status = job_status(run_dir, handle, facts)
    if status["state"] in ("exited", "cancelled"):
        return status
    marks = end_marks(run_dir, facts)
    handle = handle or read_handle(run_dir, facts)
    atomic_write(marks.cancelling, f"{time.time()}\n".encode(), 0o600)
    killed = False
    if handle is not None and (handle_alive(handle) or group_alive(handle)):
        root = int(handle["pid"])
        held = _contained(facts)

        def left() -> set[int]:
            return job_processes(root) | (contain.members(*held) if held else set())

        def send(sig: int) -> None:
            signal_job(root, sig)
            if held:
                contain.signal_all(*held, sig)

        send(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and left():
            time.sleep(0.05)
        if left():
            send(signal.SIGKILL)
            killed = True
            while left() and time.monotonic() < deadline + 5:
                time.sleep(0.02)
        while handle_alive(handle) and time.monotonic() < deadline + 5:
            time.sleep(0.02)  # the wrapper records the end, then exits
    record = {"time": time.time(), "killed": killed}
    atomic_write(marks.cancelled, json.dumps(record).encode(), 0o600)
    return {"state": "cancelled", "exit_code": read_int(marks.exit_code)}


def _contained(facts: str | None) -> tuple[str | None, str | None, int | None] | None:
    """The run's cgroup, id and user as its wrapper recorded them in the facts directory (the
    daemon's own; never job.pid, which the run's user may rewrite); None without facts."""
    handle = read_handle("", facts) if facts else None
    if not handle or not (handle.get("cgroup") or handle.get("run_id")):
        return None
    uid = handle.get("uid")
    cgroup, run_id = handle.get("cgroup"), handle.get("run_id")
    return (
        cgroup if isinstance(cgroup, str) else None,
        run_id if isinstance(run_id, str) and rundir.is_run_id(run_id) else None,
        uid if isinstance(uid, int) else None,
    )


# --- probe ------------------------------------------------------------------------------


def _parse_json_line(line: bytes) -> dict[str, Any] | None:
    try:
        value = rundir.load_json(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# How the plugin's `save` lines begin (compact JSON, `event` first): the tail's other lines before
# the last `log` one are not parsed while the last save is looked for.
_SAVE_LINE = b'{"event":"save"'
_PHASE_LINE = b'{"event":"phase"'


def _metrics_summary(path: str) -> dict[str, Any]:
    """The `begin` line, the last `log` line, the last `save` and `phase` lines in the tail, whether
    `end` was written, and the file's size."""
    out: dict[str, Any] = {
        "begin": None,
        "last_log": None,
        "last_save": None,
        "phase": None,
        "ended": False,
        "metrics_size": 0,
    }
    head = read_regular(path, METRICS_HEAD)
    if not head:
        return out
    first = _parse_json_line(head.split(b"\n", 1)[0])
    if first and first.get("event") == "begin":
        out["begin"] = first
    size = out["metrics_size"] = file_size(path)
    tail = read_regular(path, METRICS_TAIL, max(0, size - METRICS_TAIL)) or b""
    for line in reversed(tail.split(b"\n")):
        if out["last_log"] is not None and not line.startswith((_SAVE_LINE, _PHASE_LINE)):
            continue  # past the last log: only the last save and phase are still looked for
        event = _parse_json_line(line) if line.strip() else None
        if not event:
            continue
        kind = event.get("event")
        if kind == "end" and out["last_log"] is None:
            out["ended"] = True
        elif kind == "save" and out["last_save"] is None:
            out["last_save"] = event
        elif kind == "phase" and out["phase"] is None:
            out["phase"] = event
        elif kind == "log" and out["last_log"] is None:
            out["last_log"] = event
        if out["last_log"] is not None and out["last_save"] is not None and out["phase"] is not None:
            break
    return out


def _proof_text(data: bytes) -> str:
    """snapshot.json as text for the daemon: bytes that are not UTF-8 arrive as `\\xNN` escapes,
    which no JSON parser takes, so such a proof is invalid there as it is in `rundir.parse_proof`."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "backslashreplace")


def _read_proof(run_dir: str, result: dict[str, Any]) -> None:
    path = rundir.RunPaths(run_dir).proof
    kind = rundir.non_regular(path)
    if kind is not None:  # never opened: a FIFO or device would block, a link leads out
        result["proof_not_regular"] = kind
        result["proof"] = None
        return
    proof = read_regular(path, PROOF_LIMIT + 1)
    if proof is not None and len(proof) > PROOF_LIMIT:
        result["proof_too_large"] = True
        proof = proof[:PROOF_LIMIT]
    result["proof"] = _proof_text(proof) if proof is not None else None


def probe_dir(run_dir: str, handle: dict[str, Any] | None = None, with_job: bool = True) -> dict[str, Any]:
    """One read of a run directory: job status, request, proof, metrics summary, file sizes, checkpoints.

    Never raises: whatever a run directory holds, the probe of the others goes on. The proof
    is read before the checkpoints are listed, so a checkpoint written before its proof is listed.
    `with_job=False` leaves the job's status and handle to the caller (a scheduler knows them).
    """
    result: dict[str, Any] = {"remote_dir": run_dir}
    paths = rundir.RunPaths(run_dir)
    try:
        if with_job:
            result["status"] = job_status(run_dir, handle)
        request = read_regular(paths.request, REQUEST_LIMIT)
        result["request"] = request.decode("utf-8", "replace") if request is not None else None
        _read_proof(run_dir, result)
        result.update(_metrics_summary(paths.metrics))
        result["log_size"] = file_size(paths.job_log)
        if with_job:
            result["handle"] = read_handle(run_dir)
            result["python"] = python_seen(result, handle or result["handle"])
        result["checkpoints"] = rundir.real_checkpoints(run_dir)
    except Exception as exc:
        result.setdefault("status", {"state": "running", "exit_code": None})
        result["error"] = f"{type(exc).__name__}: {exc}"
    return result


class CheckpointRefused(Exception):
    """A checkpoint that may not be removed: not a `checkpoint-<step>` name, or a link on its path."""


def _open_output(run_dir: str) -> int:
    """A descriptor of the run's `output/`, opened without following a link (of it or of the run
    directory's last part): what is removed is found through it, so nothing outside is reached."""
    if not os.path.isabs(run_dir) or ".." in run_dir.split("/"):
        raise CheckpointRefused(f"{run_dir}: not an absolute run directory")
    run = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        return os.open(rundir.OUTPUT, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=run)
    finally:
        os.close(run)


def _tree_bytes(dir_fd: int) -> int:
    """The bytes of the regular files under a directory descriptor; links are never followed, and
    a directory that cannot be entered (mode 0) counts for nothing rather than hiding the rest."""
    total = 0
    for entry in os.scandir(dir_fd):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
        elif stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            except PermissionError:
                continue
            try:
                total += _tree_bytes(sub)
            finally:
                os.close(sub)
    return total


def _open_dir(parent: int, name: str, owner: int, where: str) -> int:
    """Open `name` (a real directory under `parent`, never a link) to empty it: one of `owner`'s
    that its owner could not enter, list or write (mode 0, read-only) is first given u+rwx, as
    its owner may; a directory of anyone else's is refused, naming it (nothing is removed)."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        st = os.fstat(fd)
        if st.st_uid != owner:
            raise CheckpointRefused(
                f"{where} is a directory of uid {st.st_uid}, not of the run directory's owner (uid {owner}), "
                "who cannot empty it: nothing was removed; its owner (or root) may remove it"
            )
        if st.st_mode & 0o700 != 0o700:
            os.chmod(f"/proc/self/fd/{fd}", stat.S_IMODE(st.st_mode) | 0o700)  # the very directory opened
        return os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    finally:
        os.close(fd)


def _removable(fd: int, owner: int, where: str) -> int:
    """Make every directory under `fd` one its owner can empty (see `_open_dir`), refusing before
    anything is removed; the bytes of its regular files."""
    total = 0
    for entry in os.scandir(fd):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
        elif stat.S_ISDIR(st.st_mode):
            sub = _open_dir(fd, entry.name, owner, f"{where}/{entry.name}")
            try:
                total += _removable(sub, owner, f"{where}/{entry.name}")
            finally:
                os.close(sub)
    return total


def _remove_tree(parent: int, name: str) -> None:
    """Remove `name` under the directory descriptor `parent`, links removed as links, never followed."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    try:
        for entry in os.scandir(fd):
            if entry.is_dir(follow_symlinks=False):
                _remove_tree(fd, entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def checkpoint_sizes(run_dir: str) -> dict[str, int]:
    """The bytes each real `output/checkpoint-<step>` of a run directory holds ({} when none); one
    holding a directory that cannot be entered is listed too, with what could be counted."""
    try:
        out = _open_output(run_dir)
    except (OSError, CheckpointRefused):
        return {}
    sizes = {}
    try:
        for name in os.listdir(out):
            if rundir.checkpoint_step(name) is None:
                continue
            try:
                st = os.stat(name, dir_fd=out, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue  # a link, a file
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=out)
            except PermissionError:
                sizes[name] = 0  # its owner made it unreadable: still a checkpoint retention judges
                continue
            except OSError:  # gone
                continue
            try:
                sizes[name] = _tree_bytes(sub)
            except OSError:
                continue
            finally:
                os.close(sub)
    finally:
        os.close(out)
    return sizes


def remove_checkpoint(run_dir: str, name: str) -> dict[str, Any]:
    """Delete the run directory's `output/<name>` (a `checkpoint-<step>` that is a real directory).

    First every directory in it is made one the run directory's owner can empty (u+rwx: a mode-0
    or read-only directory of theirs), and one of anyone else's refuses the removal before
    anything is removed. Then it is renamed out of the checkpoint names in one step, so no
    half-deleted copy ever looks like a checkpoint, and removed without following a link. Should
    the removal still fail, what is left is renamed back with its trainer_state.json removed
    first (never again a complete checkpoint), and the error says what is left.
    {"name", "freed": bytes, "removed": bool}."""
    if rundir.checkpoint_step(name) is None:
        raise CheckpointRefused(f"{name!r} is not a checkpoint-<step> name")
    owner = os.stat(run_dir, follow_symlinks=False).st_uid
    where = f"{rundir.OUTPUT}/{name}"
    out = _open_output(run_dir)
    try:
        try:
            sub = _open_dir(out, name, owner, where)
        except FileNotFoundError:
            return {"name": name, "freed": 0, "removed": False}
        except OSError as exc:
            raise CheckpointRefused(f"{where} is not a real directory ({exc.strerror})") from exc
        try:
            freed = _removable(sub, owner, where)
        finally:
            os.close(sub)
        trash = f".obd-pruned-{name}-{os.getpid()}"
        os.rename(name, trash, src_dir_fd=out, dst_dir_fd=out)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{trash}/trainer_state.json", dir_fd=out)
            _remove_tree(out, trash)
        except OSError as exc:
            left = _put_back(out, trash, name)
            raise CheckpointRefused(
                f"{where} could not be removed whole ({exc.strerror or exc}: {exc.filename or ''}); "
                f"what is left is {left}, no longer a complete checkpoint"
            ) from exc
        return {"name": name, "freed": freed, "removed": True}
    finally:
        os.close(out)


def _put_back(out: int, trash: str, name: str) -> str:
    """After a removal that failed part way: the leftover back under its checkpoint name (unless
    a new one took it meanwhile); where it is now, for the error."""
    try:
        os.rename(trash, name, src_dir_fd=out, dst_dir_fd=out)
    except OSError:
        return f"{rundir.OUTPUT}/{trash}"
    return f"{rundir.OUTPUT}/{name}"


# The commands of the previous release's `jobctl.py` that are now commands of their own files.
MOVED = {"start": "python3 supervisor.py start RUN_DIR ...", "serve": "python3 -S jobserve.py"}


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    command = argv[0]
    if command in MOVED:
        print(f"obd: `jobctl.py {command}` is now `{MOVED[command]}`, beside this file", file=sys.stderr)
        return 2
    if command == "cancel" and len(argv) >= 2:
        grace = float(argv[argv.index("--grace") + 1]) if "--grace" in argv else 10.0
        handle = json.loads(argv[argv.index("--handle") + 1]) if "--handle" in argv else None
        facts = argv[argv.index("--facts") + 1] if "--facts" in argv else None
        print(json.dumps(cancel(argv[1], grace, handle, facts)), flush=True)
        return 0
    if command == "status" and len(argv) >= 2:
        print(json.dumps(job_status(argv[1])), flush=True)
        return 0
    if command == "probe":
        items = json.loads(sys.stdin.read() or "[]")
        print(json.dumps([probe_dir(i["dir"], i.get("handle")) for i in items]), flush=True)
        return 0
    if command == "checkpoints" and len(argv) >= 2:
        print(json.dumps(checkpoint_sizes(argv[1])), flush=True)
        return 0
    if command == "remove-checkpoint" and len(argv) >= 3:
        try:
            print(json.dumps(remove_checkpoint(argv[1], argv[2])), flush=True)
        except (OSError, CheckpointRefused) as exc:
            print(f"remove-checkpoint: {exc}", file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
