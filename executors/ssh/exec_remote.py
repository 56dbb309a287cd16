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


def remote_command(spec: ExecSpec) -> str:
    """The shell line run there: into the run directory, the run's variables, then the command
    (a login shell when there is none)."""
    exports = [f"export {k}={remote.q(v)}" for k, v in sorted(spec.env.items()) if _NAME.match(k)]
    if spec.tty is not None:
        exports.append(f"export TERM={remote.q(spec.tty.term)}")
    run = f"exec {remote.join(spec.command)}" if spec.command else 'exec "${SHELL:-/bin/sh}" -l'
    return "; ".join([f"cd -- {remote.q(spec.remote_dir)} || exit 126", *exports, run])


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
        return await _follow(proc, io, spec.tty is not None)
    finally:
        proc.close()


async def _follow(proc: asyncssh.SSHClientProcess, io: ExecIO, tty: bool) -> int:
    drained = anyio.Event()
    async with anyio.create_task_group() as tg:

        async def pump(reader: asyncssh.SSHReader, stream: str) -> None:
            with contextlib.suppress(*LOST, asyncssh.BreakReceived, asyncssh.TerminalSizeChanged):
                while data := await reader.read(65536):
                    await io.write(stream, data if isinstance(data, bytes) else str(data).encode())

        async def pump_all() -> None:
            async with anyio.create_task_group() as pumps:
                pumps.start_soon(pump, proc.stdout, "out")
                pumps.start_soon(pump, proc.stderr, "err")
            drained.set()

        async def pump_in() -> None:
            while True:
                item: ExecInput | None = await io.read()
                if item is None:  # the caller hung up: the channel closes, its terminal hangs up
                    proc.close()
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
    if done.exit_signal is not None:
        return 128 + _signal_number(done.exit_signal[0])
    return 255 if done.exit_status is None or done.exit_status < 0 else done.exit_status


def _signal_number(name: str) -> int:
    import signal

    try:
        return int(signal.Signals[f"SIG{name}"])
    except KeyError:
        return 127
