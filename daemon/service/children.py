"""How the daemon's event loop learns that a child process (a job's wrapper, ssh, sbatch) ended.

Python 3.11's asyncio starts a thread for each child it waits on (`ThreadedChildWatcher`), and the
event loop waits until that thread runs: on a busy box (two cores, a member's sweep of 1,000 being
written) that wait held every caller up by 10-50 ms for each run launched (issue 33). A pidfd, where
the kernel has them (Linux 5.3), is read by the event loop itself like any socket: no thread, no wait.
Python 3.12 and later choose pidfds on their own.
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings


def wait_on_children_by_pidfd() -> bool:
    """Have asyncio learn of its children's ends from pidfds, where this Python would not and the
    kernel can; whether it now does. Call before the event loop starts."""
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:  # a kernel before 5.3, or a seccomp filter that refuses it
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_child_watcher(asyncio.PidfdChildWatcher())
    return True
