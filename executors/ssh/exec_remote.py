"""A command run in a run's directory on an SSH host (or a pod), for `obd train exec` and `shell`.

It runs over the executor's own connection (its host key checked, its login: the run's user
there), one channel for its life: `cd -- RUN_DIR`, the run's variables exported, then the
command, every word quoted with `shlex.quote` (executors/remote.py). A shell gets a
pseudo-terminal of the caller's size (asyncssh's `term_type`/`term_size`), resized as the
caller's is; a caller that hangs up closes the channel (sshd then hangs up the terminal's shell).
"""

from __future__ import annotations

import contextlib
import re

import anyio
import asyncssh

from executors import remote
from executors.base import ExecInput, ExecIO, ExecSpec, ExecutorError, TargetUnreachable
from executors.ssh.connection import LOST, SshConnection, why

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DRAIN_AFTER_EXIT = 0.5
KILL_GRACE = 2.0  # after a hang-up: SIGHUP, this long, then SIGKILL
PID_MARK = "obd-exec-pid "
MARK_WINDOW = 65536  # how much of stderr's start is looked through for it
MAX_OPEN = 4  # commands and shells at once on one connection (sshd's MaxSessions is 10 by default)


def remote_command(spec: ExecSpec) -> str:
    """The shell line run there: into the run directory, the run's variables, then the command
    (a login shell when there is none)."""
    exports = [f"export {k}={remote.q(v)}" for k, v in sorted(spec.env.items()) if _NAME.match(k)]
    if spec.tty is not None:
        exports.append(f"export TERM={remote.q(spec.tty.term)}")
    run = f"exec {remote.join(spec.command)}" if spec.command else 'exec "${SHELL:-/bin/sh}" -l'
    # Without a terminal, the command's pid first, on stderr (taken off there): the session
    # leader sshd made, for a hang-up where sshd will not pass a signal on (a root login).
    said = [] if spec.tty is not None else [f"printf '{PID_MARK}%s\\n' $$ >&2"]
    return "; ".join([*said, f"cd -- {remote.q(spec.remote_dir)} || exit 126", *exports, run])


async def run_there(connection: SshConnection, spec: ExecSpec, io: ExecIO) -> int:
    """Run `spec` on the connection's host; its exit status (255 when none came, as ssh(1) says)."""
    session = await connection.ensure()
    extra = {}
    if spec.tty is not None:
        extra = {"term_type": spec.tty.term, "term_size": (spec.tty.cols, spec.tty.rows)}
    try:
        proc = await session.conn.create_process(remote_command(spec), encoding=None, **extra)
    except asyncssh.ChannelOpenError as exc:
        raise ExecutorError(f"{connection.address} refused a new SSH channel for the command: {exc.reason}") from exc
    except LOST as exc:
        raise TargetUnreachable(f"lost the connection to {connection.address}: {why(exc)}") from exc
    try:
        return await _follow(Remote(proc, session.conn), io, spec.tty is not None)
    finally:
        proc.close()


class Remote:
    """The command's channel, and its pid there once it said it."""

    def __init__(self, proc: asyncssh.SSHClientProcess, conn: asyncssh.SSHClientConnection) -> None:
        self.proc = proc
        self.conn = conn
        self.pid: int | None = None

    def scan(self, head: bytes) -> tuple[bytes, bytes, bool]:
        """Look for the line `PID_MARK<pid>` in the start of stderr (the login's dotfiles may
        write before it): what to pass on now, what to keep looking at, and whether it is over
        (found, or not there in the first `MARK_WINDOW` bytes)."""
        out = b""
        while b"\n" in head:
            line, _, head = head.partition(b"\n")
            text = line.decode(errors="replace")
            if text.startswith(PID_MARK) and text[len(PID_MARK) :].isdigit():
                self.pid = int(text[len(PID_MARK) :])
                return out + head, b"", True
            out += line + b"\n"
        if len(out) + len(head) > MARK_WINDOW:
            return out + head, b"", True
        return out, head, False

    async def hang_up(self) -> None:
        """The caller went: SIGHUP to the command (SSH's `signal` request; its session by pid where
        sshd refuses it), then SIGKILL, then the channel closed, whatever answered."""
        for sig in ("HUP", "KILL"):
            with contextlib.suppress(Exception):
                self.proc.send_signal(sig)
            if self.pid is not None:
                with contextlib.suppress(Exception), anyio.move_on_after(KILL_GRACE):
                    await self.conn.run(f"kill -{sig} -- -{self.pid} 2>/dev/null", check=False)
            with anyio.move_on_after(KILL_GRACE):
                await self.proc.wait(check=False)
                break
        self.proc.close()


async def _follow(remote_proc: Remote, io: ExecIO, tty: bool) -> int:
    """Stream the command's output and the caller's input until it exited and its output ended;
    a caller that hangs up ends it (255 then: nothing is told to anyone)."""
    proc = remote_proc.proc
    drained = anyio.Event()
    done: asyncssh.SSHCompletedProcess | None = None
    async with anyio.create_task_group() as tg:

        async def pump(reader: asyncssh.SSHReader, stream: str, marked: bool) -> None:
            head = b""
            with contextlib.suppress(*LOST, asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
                while data := await reader.read(65536):
                    chunk = data if isinstance(data, bytes) else str(data).encode()
                    if marked:  # the pid's line is taken off; what came before it passes on
                        chunk, head, over = remote_proc.scan(head + chunk)
                        marked = not over
                    if chunk:
                        await io.write(stream, chunk)
            if head:
                await io.write(stream, head)

        async def pump_all() -> None:
            async with anyio.create_task_group() as pumps:
                pumps.start_soon(pump, proc.stdout, "out", False)
                pumps.start_soon(pump, proc.stderr, "err", not tty)
            drained.set()

        async def pump_in() -> None:
            while True:
                item: ExecInput | None = await io.read()
                if item is None:
                    await remote_proc.hang_up()
                    tg.cancel_scope.cancel()
                    return
                with contextlib.suppress(*LOST, BrokenPipeError, OSError):
                    if item.size is not None and tty:
                        proc.change_terminal_size(item.size[1], item.size[0])
                    if item.data:
                        proc.stdin.write(item.data)
                    if item.eof:
                        proc.stdin.write_eof()

        tg.start_soon(pump_all)
        tg.start_soon(pump_in)
        done = await proc.wait(check=False)
        with anyio.move_on_after(DRAIN_AFTER_EXIT):
            await drained.wait()
        tg.cancel_scope.cancel()
    if done is None:
        return 255
    if done.exit_signal is not None:
        return 128 + _signal_number(done.exit_signal[0])
    return 255 if done.exit_status is None or done.exit_status < 0 else done.exit_status


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(signal.Signals[f"SIG{name}"])
    except KeyError:
        return 127
