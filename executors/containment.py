"""Where a local run's processes are kept together: a cgroup v2 directory per run, under the daemon's own.

On a shared box every process a run started must end with it (docs/security.md, "A run is every
process it started"). Where the daemon can (cgroup v2 mounted, and the daemon's own cgroup
writable: root, or a delegated subtree), each local run gets `<the daemon's cgroup>/obd-runs/<run
id>`: the job wrapper moves the job into it before the job runs anything, and each `obd train
exec`/`shell` session of the run is moved into it before its command runs (the command waits
on a pipe until then). No process there can move itself out (that needs write access to the
daemon's cgroup), so a `setsid` and double fork stays in; the wrapper ends all of it at the
run's end (`cgroup.kill`) and removes the directory. Elsewhere the run's processes are found by
their identity, `OBD_RUN_ID` among the processes of the run's user (trainer_plugin/tools/contain.py).

`Containment.lingering` tells the GPU inventory which ended runs still have a process, so a
device is never handed out while a process of its previous holder remains.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import structlog

from trainer_plugin import rundir
from trainer_plugin.tools import contain

log = structlog.get_logger("obd.containment")

SUBTREE = "obd-runs"


def _cgroup2_mount(mountinfo: str) -> str | None:
    """Where the cgroup v2 hierarchy is mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on
    a hybrid machine), from /proc/self/mountinfo's text; None where it is not."""
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if sep and right.split(" ", 1)[0] == "cgroup2":
            fields = left.split(" ")
            if len(fields) > 4:
                return fields[4].replace("\\040", " ")
    return None


def _own_cgroup(proc_cgroup: str) -> str | None:
    """This process's cgroup v2 path (`0::/PATH` of /proc/self/cgroup)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def find_base() -> str | None:
    """The directory under which this daemon makes its runs' cgroups, made if missing; None where
    cgroup v2 is not mounted or the daemon may not write its own cgroup (not root, nothing
    delegated): its runs then fall back on their identity."""
    if os.environ.get("OBD_NO_CGROUP"):
        return None
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mount = _cgroup2_mount(f.read())
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = _own_cgroup(f.read())
    except OSError:
        return None
    if mount is None or own is None or ".." in own.split("/"):
        return None
    base = os.path.join(mount, own.lstrip("/"), SUBTREE)
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(base, 0o755)
        probe = os.path.join(base, f".probe-{os.getpid()}")
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        log.info("cgroup_unavailable", where=base, error=str(exc))
        return None
    return base


class Containment:
    """A local target's runs' cgroups (or none: `base` is None), for its executor and the GPUs."""

    def __init__(self, base: str | None) -> None:
        self.base = base

    def path(self, run_id: str) -> str | None:
        """The run's cgroup directory (whether made or not); None without cgroups."""
        if self.base is None or not rundir.is_run_id(run_id):
            return None
        return os.path.join(self.base, run_id)

    def make(self, run_id: str) -> str | None:
        """Make the run's cgroup for its job to join; None where there is none to make (the job's
        processes are then found by their identity)."""
        path = self.path(run_id)
        if path is None:
            return None
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
        except OSError as exc:
            log.warning("cgroup_not_made", run_id=run_id, where=path, error=str(exc))
            return None
        return path

    def live(self, run_id: str) -> str | None:
        """The run's cgroup while it exists (its job runs, or has not been cleaned up), else None."""
        path = self.path(run_id)
        return path if path is not None and os.path.isdir(path) else None

    def lingering(self, runs: Mapping[str, int | None]) -> set[str]:
        """Which of these ended runs (run id -> its user's uid) still have a process: in their
        cgroup, or carrying their identity (one sweep of /proc for them all)."""
        out: set[str] = set()
        for rid in runs:
            if (cg := self.live(rid)) is not None:
                if contain.cgroup_pids(cg):
                    out.add(rid)
                else:  # ended and empty, but left (its wrapper was killed before it removed it)
                    contain.remove(cg)
        rest = {rid: uid for rid, uid in runs.items() if rid not in out}
        if rest:
            out |= carrying_any(rest)
        return out

    def remove(self, run_id: str) -> None:
        """Remove the cgroup of an ended run once it is empty (the wrapper normally has)."""
        contain.remove(self.live(run_id))


def carrying_any(runs: Mapping[str, int | None]) -> set[str]:
    """Which runs (run id -> uid) have a live process of that uid started with their OBD_RUN_ID."""
    found: set[str] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            uid = os.stat(f"/proc/{entry}").st_uid
            with open(f"/proc/{entry}/environ", "rb") as f:
                data = f.read(contain.ENVIRON_LIMIT)
        except OSError:
            continue
        rid = contain.identity(data)
        if rid is not None and rid in runs and runs[rid] in (None, uid):
            found.add(rid)
    return found


__all__ = ["Containment", "carrying_any", "find_base"]
