"""RequestWatch: a thread that waits on an inotify queue of the run directory and raises a flag when `snapshot.request` may be there.

The step end's check with no request is then one attribute read, with no system call: on a
short step the one `access()` per step end was the largest part of the plugin's cost. The
thread sleeps in `read()` (the GIL released) and wakes only when a name is created, renamed
in or closed after writing in the run directory, which during training is almost never. The
flag is a hint, never the request: the step end that sees it clears it and then reads the
file as ever (`runtime.read_request`). A writer the kernel does not see (another client of a
network filesystem, a writer that keeps the file open) is found by the caller's recheck, one
lookup at least every `REQUEST_RECHECK_SECONDS`. Linux only (ctypes and libc); elsewhere, or
with no inotify instance left, `start` returns None and the caller looks the name up at
every step end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
_MASK = IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_ONLYDIR | IN_DONT_FOLLOW
# With a watch, a step end still looks the request's name up once this long has passed since
# the last lookup: at every step end when steps are longer, as without a watch.
REQUEST_RECHECK_SECONDS = 0.1
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name
_READ_SIZE = 64 * 1024


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc if hasattr(libc, "inotify_init1") else None


class RequestWatch:
    """The run directory's inotify queue, read by a daemon thread; `seen` is set when the request may be there.

    `alive` turns False when the queue stops vouching (the watch went away, a read failed): the
    caller then looks the name up at every step end. `wakeups` counts the thread's reads of the
    queue (what it cost while training: one wake-up per batch of events). `on_raise`, when set, is
    called from the thread each time it raises `seen` (the stop points' thread is woken by it).
    """

    def __init__(self, libc: Any, fd: int, wd: int, name: str) -> None:
        # Raised from the start: a request made before the watch began is found by the first look.
        self.seen = True
        self.alive = True
        self.wakeups = 0
        self.on_raise: Callable[[], None] | None = None
        self._libc, self._fd, self._wd = libc, fd, wd
        self._name = os.fsencode(name)
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="obd-request-watch", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, request_path: str) -> RequestWatch | None:
        """A watch on the request's directory, or None where inotify is not to be had (not Linux, no instance left)."""
        libc = _libc()
        if libc is None:
            return None
        folder, name = os.path.split(request_path)
        fd = int(libc.inotify_init1(os.O_CLOEXEC))  # blocking: the thread sleeps in read()
        if fd < 0:
            return None  # e.g. fs.inotify.max_user_instances reached
        wd = int(libc.inotify_add_watch(fd, os.fsencode(folder or "."), _MASK))
        if wd < 0:
            os.close(fd)
            return None
        return cls(libc, fd, wd, name)

    def _run(self) -> None:
        while self._wake():
            pass

    def _wake(self) -> bool:
        """Sleep in one read of the queue, then handle what it brought; False once the watch ended."""
        try:
            data = os.read(self._fd, _READ_SIZE)
        except OSError:
            data = b""
        self.wakeups += 1
        if data and not self._read(data):
            return True
        # The queue can no longer vouch for anything (closed, the directory gone or unmounted,
        # a failed read): from now on the caller looks at every step end.
        self.alive = False
        self._raise()
        return False

    def _raise(self) -> None:
        self.seen = True
        on_raise = self.on_raise
        if on_raise is not None:
            on_raise()

    def _read(self, data: bytes) -> bool:
        """Raise `seen` for an event that names the request or lost events; True when the watch ended."""
        offset = 0
        while offset + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            start = offset + _EVENT.size
            offset = start + length
            if mask & IN_IGNORED:
                return True
            if mask & IN_Q_OVERFLOW or data[start:offset].rstrip(b"\0") == self._name:
                self._raise()
        return self._closing

    def close(self) -> None:
        """Stop the thread (removing the watch wakes it) and close the queue."""
        if self._closing:
            return
        self._closing = True
        self.alive = False  # at once: the thread may see the watch's end only later
        self._libc.inotify_rm_watch(self._fd, self._wd)
        self._thread.join(timeout=1.0)
        if not self._thread.is_alive():  # a thread still in read() keeps the descriptor
            with contextlib.suppress(OSError):
                os.close(self._fd)
