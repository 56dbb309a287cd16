"""A conversation with a program on a pseudo-terminal of the test's own (`obd train shell`,
`obd train exec -t`): what it shows is read, one line is typed once a prompt shows."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import time


def converse(
    pid: int, fd: int, typed: bytes, timeout: float = 30, resize: tuple[int, int] | None = None
) -> tuple[int, bytes]:
    """The child `pid` forked on the terminal `fd` (pty.fork): `typed` typed once a prompt shows
    (or after 3 s), the terminal first resized to `resize` (rows, cols) if given; its exit status
    and everything it showed. Closes `fd`."""
    shown, sent, started = b"", False, time.monotonic()
    try:
        while time.monotonic() < started + timeout:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                shown += chunk
            if not sent and (b"$ " in shown or b"# " in shown or time.monotonic() > started + 3):
                if resize is not None:  # the kernel sends the program SIGWINCH
                    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", *resize, 0, 0))
                    time.sleep(0.5)
                os.write(fd, typed)
                sent = True
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), shown
