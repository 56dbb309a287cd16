"""The `events` capability of a Slurm target whose run directories the daemon sees (no login node).

A job's wrapper writes its end marker (`slurm_end.json`, then `exit_code`) into the run directory
on the shared filesystem the moment the command ends. The daemon learns of it here, as it learns
of a local run's files: inotify on each run directory, which sees writes made through this
machine's view, and a scan for `exit_code` every `scan` seconds, since a write made on a compute
node of a network filesystem (NFS, Lustre, GPFS) raises no inotify event on another machine.
Slurm's queue is still read at every poll (`SlurmSupervision.sweeps_every_poll`).
"""

from __future__ import annotations

import os

import anyio
import anyio.to_thread

from executors.base import JobHandle
from executors.local import DirWatch
from trainer_plugin import rundir

MARKER_SCAN = 0.25  # seconds between two looks for end markers written on other machines


class SlurmEvents:
    """inotify on the run directories, and a scan for their end markers."""

    def __init__(self, scan: float = MARKER_SCAN, inotify: bool = True) -> None:
        # None: the scan alone (as where every marker is written from another machine).
        self.dir_watch: DirWatch | None = DirWatch() if inotify else None
        self.scan = scan
        self._dirs: set[str] = set()
        self._reported: set[str] = set()  # run directories whose end marker was reported already

    def watch(self, remote_dir: str) -> None:
        self._dirs.add(remote_dir)
        if self.dir_watch is not None:
            self.dir_watch.add(remote_dir)

    def unwatch(self, remote_dir: str) -> None:
        self._dirs.discard(remote_dir)
        self._reported.discard(remote_dir)
        if self.dir_watch is not None:
            self.dir_watch.remove(remote_dir)

    async def changed_files(self) -> set[str]:
        """Paths written in watched run directories, and the end markers the scan found."""
        while True:
            paths: set[str] = set()
            with anyio.move_on_after(self.scan):
                if self.dir_watch is not None and self.dir_watch.available:
                    paths = await self.dir_watch.paths()
                else:
                    await anyio.sleep_forever()
            paths |= await self._scan()
            if paths:
                return paths

    async def _scan(self) -> set[str]:
        dirs = sorted(self._dirs - self._reported)
        if not dirs:
            return set()

        def ended() -> list[str]:
            return [d for d in dirs if os.path.lexists(rundir.RunPaths(d).exit_code)]

        # In a thread, abandoned if a network filesystem hangs: the follow's polling goes on.
        found = await anyio.to_thread.run_sync(ended, abandon_on_cancel=True)
        self._reported.update(found)
        return {rundir.RunPaths(d).exit_code for d in found}

    async def wait_exit(self, handle: JobHandle) -> None:
        """The job runs on a compute node: its end is its marker (above), never a process here."""
        return
