"""RequestWatch: the step end's look for `snapshot.request` as one poll of an inotify queue.

A request is made by creating `snapshot.request` in the run directory (obd renames a temporary
file into place; a person may `echo` into it). Linux queues an inotify event inside the very
call that creates or renames the file, so a zero-timeout `poll()` of that queue at the next step
end sees it as surely as a path lookup would, for less (no path walk, no permission check).
Anything the queue cannot vouch for (an overflow, an event for the name, an unreadable queue)
answers "look at the file", and a writer the kernel does not see (another NFS client) is found
by the caller's slow recheck. Linux only (ctypes and libc); elsewhere `open` returns None and the
caller looks the name up at every step end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import sys
from collections.abc import Callable
from typing import Any

IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
# With a watch, how often a step end still looks the request's name up: a writer the kernel does
# not see (another client of a network filesystem) is found within this.
REQUEST_RECHECK_SECONDS = 0.5
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name
_READ_SIZE = 64 * 1024


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc if hasattr(libc, "inotify_init1") else None
    except OSError:
        return None


class RequestWatch:
    """An inotify queue on one run directory, for names created or renamed into it."""

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self._name = name.encode()
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)
        # The step end's whole check: a list, empty while nothing was created in the directory.
        self.poll: Callable[[int], list[tuple[int, int]]] = self._poller.poll

    @classmethod
    def open(cls, request_path: str) -> RequestWatch | None:
        """A watch on the request's directory, or None where inotify is not to be had (not Linux, no instance left)."""
        libc = _libc()
        if libc is None:
            return None
        folder, name = os.path.split(request_path)
        fd = int(libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            return None  # e.g. fs.inotify.max_user_instances reached
        mask = IN_CREATE | IN_MOVED_TO | IN_ONLYDIR | IN_DONT_FOLLOW
        if libc.inotify_add_watch(fd, os.fsencode(folder or "."), mask) < 0:
            os.close(fd)
            return None
        return cls(fd, name)

    def request_may_be_there(self) -> bool:
        """Read the queued events: True if one names the request, or the queue lost events; False if none do."""
        try:
            data = os.read(self._fd, _READ_SIZE)
        except BlockingIOError:
            return False
        except OSError:
            return True  # the queue can no longer vouch for anything
        offset = 0
        while offset + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & (IN_Q_OVERFLOW | IN_IGNORED) or name == self._name:
                return True  # IN_IGNORED: the directory itself went away or was unmounted
        return False

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
