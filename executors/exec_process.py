"""A command run on this machine for `obd train exec` and `obd train shell`, as a run's user.

Modelled on OpenSSH's privilege separation: the command never runs as root for a user's run.
The child is made with the standard library's `subprocess`, whose `user=`, `group=` and
`extra_groups=` are set in the child after fork and before exec (no `preexec_fn`, which is not
safe in a daemon with threads); the change of directory into the run directory is done by the
user's own `/bin/sh` (`cd -- DIR`), never with root's rights. A shell gets a pseudo-terminal
(`os.openpty`), made its controlling terminal by util-linux's `setsid --ctty` where it is
installed. Output is passed on as it comes; the exit status is the command's (128+N for a signal).

Given the run's cgroup (executors/containment.py), the command is moved into it before it runs
anything: its `/bin/sh` first waits for a byte on a pipe (`read`, a builtin: nothing forked), the
daemon moves it into the cgroup, then writes the byte. A run whose cgroup is gone has ended: the
command is ended unrun.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pwd
import shutil
import signal
import struct
import subprocess
import termios
from collections.abc import Mapping

import anyio
import anyio.to_thread

from executors.base import ExecInput, ExecIO, ExecSpec, ExecutorError, RunAs, TermSize
from trainer_plugin.tools import contain

# What of the daemon's environment a command gets (never its secrets): where Slurm's config is,
# the language and time zone. The user's own HOME, USER, LOGNAME and SHELL are added.
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "SLURM_CONF", "TMPDIR")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
CD_THEN_EXEC = 'cd -- "$1" || exit 126; shift; exec "$@"'  # run by the user's /bin/sh
# With a gate: wait for the daemon's byte on descriptor N (moved into the run's cgroup meanwhile).
# (By path: dash takes no descriptor above 9 in a redirection; `read` is a builtin, nothing forks.)
GATED = "IFS= read -r _ < /dev/fd/{fd} || exit 125; " + CD_THEN_EXEC
DRAIN_AFTER_EXIT = 0.5  # seconds the output of a command's leftover children is still read after it exited
KILL_GRACE = 2.0  # after a hang-up: SIGHUP, this long, then SIGKILL
USER_UMASK = 0o077  # what the command writes (in the run directory, mostly) is the user's alone


def login_shell(account: RunAs | None) -> str:
    """The user's shell from the account database; /bin/sh for an account with none (nologin)."""
    try:
        shell = pwd.getpwuid(account.uid if account else os.geteuid()).pw_shell
    except KeyError:
        shell = ""
    if not shell or os.path.basename(shell) in ("nologin", "false") or not os.access(shell, os.X_OK):
        return "/bin/sh"
    return shell


def login_env(
    account: RunAs | None, extra: Mapping[str, str], tty: TermSize | None, path_prepend: tuple[str, ...] = ()
) -> dict[str, str]:
    """The command's environment: a login's (the user's HOME, USER, LOGNAME, SHELL; PATH, locale
    and Slurm's config from the daemon's), PATH led as the job's is (the target's venv), then the
    run's variables (its GPUs, `OBD_*`)."""
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("LC_")}
    env["PATH"] = os.pathsep.join([*path_prepend, env.get("PATH") or DEFAULT_PATH])
    if account is not None:
        env.update(HOME=account.home, USER=account.user, LOGNAME=account.user)
    else:  # the daemon's own user: its HOME as the daemon has it
        with contextlib.suppress(KeyError):
            pw = pwd.getpwuid(os.geteuid())
            env.update(HOME=os.environ.get("HOME") or pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    env["SHELL"] = login_shell(account)
    if tty is not None:
        env["TERM"] = tty.term
    env.update(extra)
    return env


def command_line(spec: ExecSpec, account: RunAs | None, gate: int | None = None) -> list[str]:
    """The argv run: the user's /bin/sh changing into the run directory (after the gate's byte,
    with a gate), then the command (or a login shell), led by `setsid --ctty` on a terminal."""
    command = spec.command or [login_shell(account), "-l"]
    script = GATED.format(fd=gate) if gate is not None else CD_THEN_EXEC
    argv = ["/bin/sh", "-c", script, "obd-exec", spec.remote_dir, *command]
    if spec.tty is not None and (setsid := shutil.which("setsid")):
        argv = [setsid, "--ctty", *argv]
    return argv


def set_size(fd: int, rows: int, cols: int) -> None:
    """Give a terminal its size (the kernel tells its foreground processes with SIGWINCH)."""
    with contextlib.suppress(OSError):
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def _spawn(
    argv: list[str],
    env: dict[str, str],
    account: RunAs | None,
    fds: tuple[int, int, int],
    tty: bool,
    keep: tuple[int, ...] = (),
) -> subprocess.Popen[bytes]:
    who: dict = {}
    if account is not None and (os.geteuid() != account.uid or os.getegid() != account.gid):
        who = {"user": account.uid, "group": account.gid, "extra_groups": account.groups or [account.gid]}
    return subprocess.Popen(
        argv,
        stdin=fds[0],
        stdout=fds[1],
        stderr=fds[2],
        env=env,
        cwd="/",
        umask=USER_UMASK,
        # On a terminal `setsid --ctty` makes the session (it must not be a group leader already
        # to do so without forking); without one, its own session, so a hang-up ends all of it.
        start_new_session=not tty or argv[0] == "/bin/sh",
        close_fds=True,
        pass_fds=keep,
        **who,
    )


async def _pump_out(fd: int, stream: str, io: ExecIO) -> None:
    """Pass what the command writes on `fd` to the caller, until its end (EOF, or EIO on a
    terminal whose every other end closed)."""
    while True:
        await anyio.wait_readable(fd)
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            continue
        except OSError:
            return
        if not data:
            return
        await io.write(stream, data)


async def _write_all(fd: int, data: bytes) -> None:
    while data:
        await anyio.wait_writable(fd)
        try:
            data = data[os.write(fd, data) :]
        except BlockingIOError:
            continue


async def _pump_in(fd: int, io: ExecIO, tty: bool, hung_up: anyio.Event) -> None:
    """Pass the caller's input on: bytes to stdin, its end, the terminal's size; a caller that
    hung up ends the command. Without a terminal `fd` is stdin's pipe, this task's to close."""
    open_fd: int | None = fd
    try:
        while True:
            item: ExecInput | None = await io.read()
            if item is None:
                hung_up.set()
                return
            if item.size is not None and tty:
                set_size(fd, *item.size)
            if item.data and open_fd is not None:
                try:
                    await _write_all(open_fd, item.data)
                except OSError:
                    if not tty:
                        os.close(open_fd)
                    open_fd = None
            if item.eof and open_fd is not None:
                if tty:
                    with contextlib.suppress(OSError):
                        await _write_all(fd, b"\x04")  # ^D: the end of input on a terminal
                else:
                    os.close(open_fd)
                    open_fd = None
    finally:
        if not tty and open_fd is not None:
            os.close(open_fd)


async def _end(proc: subprocess.Popen[bytes]) -> None:
    """The caller hung up: SIGHUP to the command's session, then SIGKILL if it stays."""
    for sig, wait in ((signal.SIGHUP, KILL_GRACE), (signal.SIGKILL, KILL_GRACE)):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
        with anyio.move_on_after(wait):
            await _exited(proc)
            return


async def _exited(proc: subprocess.Popen[bytes]) -> int:
    """Wait for the command's exit (a pidfd: woken by the kernel); its status."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:
        return await anyio.to_thread.run_sync(proc.wait, abandon_on_cancel=True)
    try:
        if proc.poll() is None:
            await anyio.wait_readable(fd)
    finally:
        os.close(fd)
    code = proc.wait()
    return 128 - code if code < 0 else code


async def run_here(
    spec: ExecSpec,
    io: ExecIO,
    account: RunAs | None,
    path_prepend: tuple[str, ...] = (),
    cgroup: str | None = None,
) -> int:
    """Run `spec` on this machine as `account` (None: the daemon's own user), in the run's
    `cgroup` where it has one; its exit status."""
    gate_r, gate_w = os.pipe() if cgroup else (-1, -1)
    if cgroup and account is not None and os.geteuid() == 0:
        os.fchown(gate_r, account.uid, account.gid)  # its /bin/sh opens /dev/fd/N: a pipe is its maker's
    try:
        return await _run_gated(spec, io, account, path_prepend, cgroup, gate_r, gate_w)
    finally:
        for fd in (gate_r, gate_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _open_gate(proc: subprocess.Popen[bytes], cgroup: str, gate_w: int) -> None:
    """Move the waiting command into the run's cgroup, then let it go on; a run whose cgroup is
    gone (it ended) gets its command ended unrun."""
    try:
        contain.join(cgroup, proc.pid)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            proc.kill()
        proc.wait()
        raise ExecutorError(f"the run's job has ended (its cgroup {cgroup} cannot be joined: {exc.strerror})") from exc
    os.write(gate_w, b"\n")


async def _run_gated(
    spec: ExecSpec,
    io: ExecIO,
    account: RunAs | None,
    path_prepend: tuple[str, ...],
    cgroup: str | None,
    gate_r: int,
    gate_w: int,
) -> int:
    argv = command_line(spec, account, gate_r if cgroup else None)
    env = login_env(account, spec.env, spec.tty, path_prepend)
    if spec.tty is not None:
        master, slave = os.openpty()
        set_size(slave, spec.tty.rows, spec.tty.cols)
        fds, child, stdin, outs = (slave, slave, slave), [slave], master, [(master, "out")]
    else:
        in_r, stdin = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds, child, outs = (in_r, out_w, err_w), [in_r, out_w, err_w], [(out_r, "out"), (err_r, "err")]
    ours = [fd for fd, _ in outs]  # closed here; a pipe's stdin is closed by the input's task
    try:
        for fd in {stdin, *ours}:
            os.set_blocking(fd, False)
        try:
            keep = (gate_r,) if cgroup else ()
            proc = await anyio.to_thread.run_sync(_spawn, argv, env, account, fds, spec.tty is not None, keep)
        except (OSError, subprocess.SubprocessError) as exc:
            if spec.tty is None:
                os.close(stdin)
            who = f" as {account.user}" if account else ""
            raise ExecutorError(f"could not start {'the command' if spec.command else 'a shell'}{who}: {exc}") from exc
        finally:
            for fd in child:
                os.close(fd)
        if cgroup:
            try:
                _open_gate(proc, cgroup, gate_w)
            except ExecutorError:
                if spec.tty is None:
                    with contextlib.suppress(OSError):
                        os.close(stdin)
                raise
        return await _follow(proc, io, stdin, outs, spec.tty is not None)
    finally:
        for fd in ours:
            with contextlib.suppress(OSError):
                os.close(fd)


async def _follow(proc: subprocess.Popen[bytes], io: ExecIO, stdin: int, outs: list[tuple[int, str]], tty: bool) -> int:
    """Stream the command's output and the caller's input until it exited and its output ended
    (or `DRAIN_AFTER_EXIT` passed: a child it left may hold its output open)."""
    drained, hung_up = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:

        async def pump_all() -> None:
            async with anyio.create_task_group() as pumps:
                for fd, name in outs:
                    pumps.start_soon(_pump_out, fd, name, io)
            drained.set()

        async def on_hangup() -> None:
            await hung_up.wait()
            await _end(proc)

        tg.start_soon(pump_all)
        tg.start_soon(_pump_in, stdin, io, tty, hung_up)
        tg.start_soon(on_hangup)
        try:
            code = await _exited(proc)
        finally:
            if proc.poll() is None:  # cancelled (the daemon stops): the command does not outlive its caller
                with anyio.CancelScope(shield=True):
                    await _end(proc)
        with anyio.move_on_after(DRAIN_AFTER_EXIT):
            await drained.wait()
        tg.cancel_scope.cancel()
    return code
