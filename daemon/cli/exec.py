"""`obd train exec RUN -- COMMAND` and `obd train shell RUN`: the client's side (standard library only).

The request takes its connection over (daemon/service/exec_session.py): the daemon sends the command's
output as it comes (`{"out": B64}`, `{"err": B64}`) and its exit status (`{"exit": N}`), which
becomes obd's; this side sends what it reads on stdin (`{"in": B64}`, then `{"eof": true}`) and,
on a terminal, its size (`{"size": [ROWS, COLS]}`) now and on every SIGWINCH. A shell puts this
terminal in raw mode, so every key (Ctrl-C, Ctrl-D, arrows) reaches the shell there; it is put
back as it was when the shell ends, whatever ends it.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Iterator
from typing import Any

from daemon.cli.client import Client, DaemonUnreachable, RequestFailed, unreachable_message
from daemon.cli.common import UsageError
from daemon.common.wire import MAX_MESSAGE

CHUNK = 65536  # the most of stdin sent in one message


def exec_main(args: argparse.Namespace, command: list[str], client: Client) -> int:
    """Run the command (or a shell) in the run; the exit status of what ran there."""
    shell = args.action == "shell"
    command = [*getattr(args, "command", []), *command]
    if not shell and not command:
        raise UsageError(f"give the command to run after --: obd train exec {args.id} -- nvidia-smi")
    tty = shell or bool(getattr(args, "tty", False))
    rows, cols = terminal_size()
    request = {
        "op": "exec",
        "id": args.id,
        "command": None if shell else command,
        "tty": tty,
        "term": os.environ.get("TERM") or "xterm",
        "rows": rows,
        "cols": cols,
    }
    sock = connect(client)
    try:
        send(sock, request)
        with raw_terminal(tty):
            return Session(sock, tty).run()
    finally:
        sock.close()


def connect(client: Client) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(client.path))
    except OSError as exc:
        sock.close()
        raise DaemonUnreachable(unreachable_message(client.path, exc)) from exc
    return sock


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send one message; one the daemon no longer reads (it answered and hung up: a refusal, the
    command's end) is dropped, and its answer read."""
    line = json.dumps(message).encode() + b"\n"
    if len(line) > MAX_MESSAGE:
        raise UsageError(f"the command is over the daemon's limit of {MAX_MESSAGE >> 10} KiB; put it in a script")
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(line)


def terminal_size() -> tuple[int, int]:
    """This terminal's rows and columns (24x80 where there is none)."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            return size.lines or 24, size.columns or 80
    return 24, 80


@contextlib.contextmanager
def raw_terminal(wanted: bool) -> Iterator[None]:
    """This terminal in raw mode while a shell runs there, put back as it was after."""
    if not wanted or not os.isatty(0):
        yield
        return
    import termios
    import tty

    saved = termios.tcgetattr(0)
    try:
        # At once, not after a flush (setraw's default, TCSAFLUSH): what was typed ahead, before the
        # shell opened, is kept and reaches it, as ssh does.
        tty.setraw(0, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


class Session:
    """The streams of one command: the daemon's frames out, stdin and the terminal's size in."""

    def __init__(self, sock: socket.socket, tty: bool) -> None:
        self.sock = sock
        self.tty = tty
        self.buf = b""
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()

    def run(self) -> int:
        self.selector.register(self.sock, selectors.EVENT_READ, "daemon")
        try:
            self.selector.register(0, selectors.EVENT_READ, "stdin")
        except PermissionError:  # a file (or /dev/null), which cannot be waited on: it never blocks
            self._send_all_of_stdin()
        except (OSError, ValueError):  # no stdin at all
            send(self.sock, {"eof": True})
        old = None
        if self.tty:
            os.set_blocking(self.wake_w, False)
            self.selector.register(self.wake_r, selectors.EVENT_READ, "resized")
            old = signal.signal(signal.SIGWINCH, lambda *_: self._wake())
        try:
            while True:
                for key, _ in self.selector.select():
                    code = self._ready(key.data)
                    if code is not None:
                        return code
        finally:
            if old is not None:
                signal.signal(signal.SIGWINCH, old)
            self.selector.close()
            os.close(self.wake_r)
            os.close(self.wake_w)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"w")

    def _ready(self, what: str) -> int | None:
        if what == "daemon":
            return self._from_daemon()
        if what == "stdin":
            self._from_stdin()
        else:
            with contextlib.suppress(OSError):
                os.read(self.wake_r, 1024)
            rows, cols = terminal_size()
            send(self.sock, {"size": [rows, cols]})
        return None

    def _send_all_of_stdin(self) -> None:
        while data := os.read(0, CHUNK):
            send(self.sock, {"in": base64.b64encode(data).decode()})
        send(self.sock, {"eof": True})

    def _from_stdin(self) -> None:
        try:
            data = os.read(0, CHUNK)
        except OSError:
            data = b""
        if data:
            send(self.sock, {"in": base64.b64encode(data).decode()})
            return
        self.selector.unregister(0)
        send(self.sock, {"eof": True})

    def _from_daemon(self) -> int | None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise DaemonUnreachable("obd: the daemon closed the connection before the command ended; check its log")
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            code = self._frame(json.loads(line))
            if code is not None:
                return code
        return None

    def _frame(self, frame: dict[str, Any]) -> int | None:
        """One message of the daemon: output to pass on, the exit status, or an error."""
        for name, stream in (("out", sys.stdout.buffer), ("err", sys.stderr.buffer)):
            if name in frame:
                stream.write(base64.b64decode(frame[name]))
                stream.flush()
                return None
        if "exit" in frame:
            return int(frame["exit"])
        if frame.get("ok") is False:
            raise RequestFailed(str(frame.get("error", "unknown error")), str(frame.get("kind", "error")))
        return None
