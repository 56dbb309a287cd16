"""The `events` capability of an SSH target, fed by the pushes of its helper (helper.py).

The follow tells it which run directories to watch; each helper that starts is told them all
again, and pushes at once the exit, cancel, request and proof files that are already there, so
nothing written while no helper watched is missed. While no helper can push (none could start,
or they keep dying), a job's exit cannot be waited for and `changed_files` asks the follow to
read every run at the rate it would have polled (`poll_hint`), so a target without a helper is
followed as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import anyio

from executors.base import JobHandle


class HelperChannel(Protocol):
    """The connection's helper as the events see it (executors/ssh/helper.py's HelperChannel):
    whether it lives, and a request sent without waiting."""

    @property
    def alive(self) -> bool: ...

    def notify(
        self, op: str, fields: dict[str, Any], on_answer: Callable[[dict[str, Any]], None] | None = None
    ) -> None: ...


JobIds = tuple[int, int]  # (pid, start time) of a job's wrapper


class SshEvents:
    """Run directories watched through the helper of an SSH target, and what it pushed."""

    def __init__(self, poll_hint: float = 3.0) -> None:
        self.poll_hint = poll_hint
        self._dirs: dict[str, JobIds | None] = {}  # watched run dir -> its job, once the helper said
        self._helper: HelperChannel | None = None
        self._changed: set[str] = set()
        self._wakeup: anyio.Event | None = None
        self._exited: set[JobIds] = set()
        self._exit_waiters: dict[JobIds, anyio.Event] = {}
        self._unavailable = False  # the last attempt at a helper failed: nothing will be pushed
        self._next_read_all = 0.0  # while none pushes: when the follow is next asked to read every run

    @property
    def live(self) -> bool:
        """Whether a helper watches the directories now."""
        return self._helper is not None and self._helper.alive

    # --- the follow's side (RunEvents) -------------------------------------------------------

    def watch(self, remote_dir: str) -> None:
        """Report what is written in this run directory from now on (and what is there already)."""
        if remote_dir in self._dirs:
            return
        self._dirs[remote_dir] = None
        if self._helper is not None and self.live:
            self._send_watch(self._helper, remote_dir)
        self._wake()

    def unwatch(self, remote_dir: str) -> None:
        job = self._dirs.pop(remote_dir, None)
        if self._helper is not None and self.live:
            self._helper.notify("unwatch", {"dir": remote_dir})
        if job is not None:
            self._exited.discard(job)
            self._release(job)

    async def changed_files(self) -> set[str]:
        """Paths (`<run dir>/<name>`) written in watched directories; blocks until there are some.

        While no helper pushes, returns `{""}` (every run) once every `poll_hint` seconds instead,
        however often it is woken meanwhile.
        """
        while not self._changed:
            self._wakeup = anyio.Event()
            if self.live or not self._dirs:
                await self._wakeup.wait()
                continue
            now = anyio.current_time()
            if not self._next_read_all:
                self._next_read_all = now + self.poll_hint
            if now < self._next_read_all:
                with anyio.move_on_after(self._next_read_all - now):
                    await self._wakeup.wait()
                continue
            self._next_read_all = now + self.poll_hint
            return {""}
        changed, self._changed = self._changed, set()
        return changed

    async def wait_exit(self, handle: JobHandle) -> None:
        """Return once the helper pushed that this job ended, or its directory is no longer
        watched; at once while no helper can push (the follow's polling sees the exit)."""
        job = (handle.pid, handle.start_time)
        if job in self._exited or self._unavailable:
            return
        event = self._exit_waiters.get(job)
        if event is None:
            event = self._exit_waiters[job] = anyio.Event()
        await event.wait()

    # --- the helper's side -------------------------------------------------------------------

    def attach(self, helper: HelperChannel) -> None:
        """A new helper pushes from now on: tell it every directory."""
        self._helper = helper
        self._unavailable = False
        for remote_dir in list(self._dirs):
            self._send_watch(helper, remote_dir)
        self._wake()

    def detach(self, helper: HelperChannel) -> None:
        """That helper ended (with its connection, or on its own)."""
        if self._helper is helper:
            self._helper = None
            self._wake()

    def unavailable(self) -> None:
        """No helper could be had: nobody will push, so nobody may wait for a push."""
        if self._unavailable:
            return
        self._unavailable = True
        for event in self._exit_waiters.values():
            event.set()
        self._exit_waiters.clear()
        self._wake()

    def push(self, message: dict[str, Any]) -> None:
        """A message the helper sent unasked."""
        kind = message.get("event")
        if kind == "overflow":  # the helper's inotify lost events: every run
            self._changed.add("")
        elif kind == "files":
            remote_dir = message.get("dir")
            if not isinstance(remote_dir, str) or remote_dir not in self._dirs:
                return  # no longer watched
            for name in message.get("names") or []:
                self._changed.add(f"{remote_dir}/{name}")
            job = _job_ids(message.get("job"))
            if job is not None:
                self._dirs[remote_dir] = job
                self._exited.add(job)
                self._release(job)
        else:
            return
        self._wake()

    # --- inside ------------------------------------------------------------------------------

    def _send_watch(self, helper: HelperChannel, remote_dir: str) -> None:
        def answered(answer: dict[str, Any]) -> None:
            job = _job_ids((answer.get("result") or {}).get("job")) if answer.get("ok") else None
            if job is not None and remote_dir in self._dirs and self._dirs[remote_dir] is None:
                self._dirs[remote_dir] = job

        helper.notify("watch", {"dir": remote_dir}, answered)

    def _release(self, job: JobIds) -> None:
        event = self._exit_waiters.pop(job, None)
        if event is not None:
            event.set()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()


def _job_ids(value: object) -> JobIds | None:
    if isinstance(value, list) and len(value) == 2 and all(isinstance(n, int) for n in value):
        return (value[0], value[1])
    return None
