"""Every process of a run, found and ended: its cgroup where obd made one, else its identity (standard library only).

A run's job forks, daemonizes (`setsid` and a double fork) and may be joined by `obd train exec`
sessions; its process group and the wrapper's descendants are not all of it. Where the local
target's daemon could make one (a cgroup v2 directory, executors/containment.py), the job and
each exec session of the run are put in the run's cgroup before they run anything, which no
process of theirs can leave (moving out needs write access to an ancestor the daemon owns), and
`cgroup.kill` ends all of it at once. Elsewhere (no cgroup v2, not root) the run's processes are
found by the identity obd gives them: `OBD_RUN_ID=<run id>` in the environment they were
started with (`/proc/PID/environ`), among the processes of the run's user only, so no one can
make obd end, or wait for, anyone else's process. A notify command the daemon runs about the run
carries its id too, beside `OBD_EVENT_ID`: it is the daemon's, not the run's, and is left alone
(a process can as well drop `OBD_RUN_ID` from its environment: the identity binds only what keeps
it; the cgroup binds everything).
"""

from __future__ import annotations

import contextlib
import os
import signal

RUN_ID_VAR = "OBD_RUN_ID"
HOOK_VAR = "OBD_EVENT_ID"  # set only in the daemon's notify commands (daemon/service/notify.py)
_RUN_ID_ITEM, _HOOK_ITEM = f"{RUN_ID_VAR}=".encode(), f"{HOOK_VAR}=".encode()
ENVIRON_LIMIT = 1 << 20  # how much of a process's initial environment is looked at


def join(cgroup: str, pid: int = 0) -> None:
    """Move `pid` (0: the calling process) into the cgroup; OSError when it cannot be done."""
    fd = os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, f"{pid}\n".encode())
    finally:
        os.close(fd)


def cgroup_pids(cgroup: str) -> set[int]:
    """The processes in the cgroup and those below it (none when it is gone)."""
    found: set[int] = set()
    for where, dirs, _ in os.walk(cgroup):
        with contextlib.suppress(OSError), open(os.path.join(where, "cgroup.procs"), "rb") as f:
            found.update(int(line) for line in f.read().split() if line.isdigit())
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(where, d))]
    return found


def identity(environ: bytes) -> str | None:
    """The run a process belongs to by the environment it was started with (NUL-separated, as in
    /proc/PID/environ): its `OBD_RUN_ID`, unless it is a notify command about that run."""
    data = b"\0" + environ  # substring searches: the wrapper's sweep looks at every process of the user
    if b"\0" + _HOOK_ITEM in data:
        return None
    at = data.find(b"\0" + _RUN_ID_ITEM)  # the first, as getenv reads it
    if at < 0:
        return None
    start = at + 1 + len(_RUN_ID_ITEM)
    end = data.find(b"\0", start)
    return data[start : end if end >= 0 else len(data)].decode("utf-8", "replace")


def _identity_of(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return identity(f.read(ENVIRON_LIMIT))
    except OSError:
        return None


def carrying(run_id: str, uid: int | None) -> set[int]:
    """The live processes of `uid` (None: of any user) started with `OBD_RUN_ID=<run_id>`."""
    found: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            if uid is not None and os.stat(f"/proc/{entry}").st_uid != uid:
                continue
        except OSError:
            continue
        if _identity_of(int(entry)) == run_id:
            found.add(int(entry))
    return found


def members(cgroup: str | None, run_id: str | None, uid: int | None, exclude: frozenset[int] = frozenset()) -> set[int]:
    """The run's live processes: its cgroup's, and those carrying its identity, less `exclude`."""
    found = cgroup_pids(cgroup) if cgroup else set()
    if run_id:
        found |= carrying(run_id, uid)
    found.discard(os.getpid())
    return found - exclude


def _still_ours(pid: int, cgroup: str | None, run_id: str | None) -> bool:
    """Whether `pid` (held by a pidfd) is still the run's, so a reused pid is never signalled."""
    if cgroup and pid in cgroup_pids(cgroup):
        return True
    return bool(run_id) and _identity_of(pid) == run_id


def signal_all(
    cgroup: str | None, run_id: str | None, uid: int | None, sig: int, exclude: frozenset[int] = frozenset()
) -> None:
    """Send `sig` to every process of the run (see `members`); a KILL of a cgroup is one write to
    its `cgroup.kill`, which also takes what forks meanwhile."""
    if sig == signal.SIGKILL and cgroup and not exclude & cgroup_pids(cgroup):
        with contextlib.suppress(OSError), open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
            f.write("1\n")
    for pid in members(cgroup, run_id, uid, exclude):
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            continue
        try:
            if _still_ours(pid, cgroup, run_id):
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)


def remove(cgroup: str | None) -> bool:
    """Remove the run's cgroup once it is empty (its children first); whether it is gone."""
    if not cgroup or not os.path.isdir(cgroup):
        return True
    for where, dirs, _ in sorted(os.walk(cgroup), key=lambda w: -len(w[0])):
        del dirs
        with contextlib.suppress(FileNotFoundError):
            try:
                os.rmdir(where)
            except OSError:
                return False
    return not os.path.isdir(cgroup)
