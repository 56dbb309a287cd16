"""A checkpoint's files on this machine, read and written as the run's user (docs/security.md).

Under the root service a run's checkpoint is as hostile as its owner: a link in it may name
`/etc/shadow` or another user's file. So the daemon never opens one itself: a small helper
(`HELPER`, standard library only, run with the target's python) does, in a child process that
is the user for good (`subprocess`'s `user=`, `group=`, `extra_groups=`, set before exec, as for
Slurm's commands, executors/slurm/as_user.py), with umask 077 and none of the daemon's
environment. `pack` reads the checkpoint as the source run's owner, opening every entry relative
to its directory without following a link, and refuses a link, a FIFO or a device anywhere in it
(nothing carried); `unpack` writes what it is sent into the new run's `resume/` as the new run's
owner, each file a fresh one renamed into place, its sha256 checked against the sender's. Between
two targets of this machine the two are joined by a pipe: the bytes never pass through the
daemon. To or from an SSH host or a pod, the daemon moves the stream between the helper and SFTP
(the target's configured account, docs/security.md). A daemon that is not root runs the helper
as itself: it has no one else's rights to take.

The stream: for each file `F`, a 4-byte length and a JSON header (`path`, `size`, `mode`), its
bytes, and the 32 bytes of their sha256; then `E` (and a JSON manifest), or `X` and a JSON error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread

from executors.base import ExecutorError
from trainer_plugin.tools import creds

Manifest = dict[str, tuple[int, str]]
CHUNK = 1 << 20
UMASK = 0o077
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TZ")

HELPER = r"""
import hashlib, json, os, stat, struct, sys
CHUNK = 1 << 20
D = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
R = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

def frame(out, kind, obj):
    data = json.dumps(obj).encode()
    out.write(kind + struct.pack(">I", len(data)) + data)

def fail(out, msg):
    frame(out, b"X", {"error": msg})
    out.flush()
    sys.exit(3)

def pack(root, excluded):
    out = sys.stdout.buffer
    sent = {}
    try:
        top = os.open(root, D)
    except OSError as exc:
        fail(out, f"{root} cannot be opened as a directory by {os.getuid()}: {exc.strerror}")
    def walk(fd, rel):
        for name in sorted(os.listdir(fd)):
            path = f"{rel}/{name}" if rel else name
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                fail(out, f"{path} is a symbolic link (to {os.readlink(name, dir_fd=fd)}): a checkpoint carried "
                          "to another target holds regular files only, so nothing was carried")
            if stat.S_ISDIR(st.st_mode):
                if name in excluded:
                    continue
                sub = os.open(name, D, dir_fd=fd)
                try:
                    if "pyvenv.cfg" in os.listdir(sub):
                        continue
                    walk(sub, path)
                finally:
                    os.close(sub)
                continue
            if not stat.S_ISREG(st.st_mode):
                fail(out, f"{path} is not a regular file (a FIFO, socket or device): nothing was carried")
            f = os.open(name, R, dir_fd=fd)
            try:
                st = os.fstat(f)
                frame(out, b"F", {"path": path, "size": st.st_size, "mode": stat.S_IMODE(st.st_mode)})
                h, left = hashlib.sha256(), st.st_size
                while left:
                    chunk = os.read(f, min(CHUNK, left))
                    if not chunk:
                        fail(out, f"{path} shrank while it was read: nothing was carried")
                    h.update(chunk)
                    out.write(chunk)
                    left -= len(chunk)
                out.write(h.digest())
                sent[path] = [st.st_size, h.hexdigest()]
            finally:
                os.close(f)
    try:
        walk(top, "")
    except OSError as exc:
        fail(out, f"{exc.filename or root}: {exc.strerror} (read as uid {os.getuid()})")
    frame(out, b"E", sent)
    out.flush()

def read_exact(inp, n):
    data = inp.read(n)
    if len(data) != n:
        raise EOFError("the stream ended early")
    return data

def unpack(dest):
    inp = sys.stdin.buffer
    wrote = {}
    os.makedirs(dest, mode=0o700, exist_ok=True)
    while True:
        kind = read_exact(inp, 1)
        head = json.loads(read_exact(inp, struct.unpack(">I", read_exact(inp, 4))[0]))
        if kind == b"E":
            json.dump({"manifest": wrote}, sys.stdout)
            return
        if kind == b"X":
            json.dump({"error": head["error"]}, sys.stdout)
            sys.exit(3)
        path, size = head["path"], int(head["size"])
        parts = path.split("/")
        if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
            json.dump({"error": f"{path!r} is not a path inside the checkpoint"}, sys.stdout)
            sys.exit(3)
        target = os.path.join(dest, *parts)
        os.makedirs(os.path.dirname(target), mode=0o700, exist_ok=True)
        tmp = os.path.join(os.path.dirname(target), f".{parts[-1]}.tmp.{os.getpid()}")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        h, left = hashlib.sha256(), size
        with os.fdopen(out, "wb") as f:
            while left:
                chunk = inp.read(min(CHUNK, left))
                if not chunk:
                    raise EOFError("the stream ended early")
                h.update(chunk)
                f.write(chunk)
                left -= len(chunk)
            os.fchmod(f.fileno(), int(head.get("mode", 0o600)) & 0o777)
        digest = read_exact(inp, 32)
        if digest != h.digest():
            os.unlink(tmp)
            json.dump({"error": f"{path}'s sha256 differs from the sender's"}, sys.stdout)
            sys.exit(3)
        os.replace(tmp, target)
        wrote[path] = [size, h.hexdigest()]

if sys.argv[1] == "pack":
    pack(sys.argv[2], set(json.loads(sys.argv[3])))
else:
    try:
        unpack(sys.argv[2])
    except (OSError, EOFError, ValueError) as exc:
        json.dump({"error": f"{getattr(exc, 'filename', None) or sys.argv[2]}: {getattr(exc, 'strerror', None) or exc}"}, sys.stdout)
        sys.exit(3)
"""


@dataclass(frozen=True)
class Who:
    """Whose process a helper is: a uid with its login's gid and groups, None for the daemon's own."""

    account: creds.Account | None
    name: str


def who_owns(uid: int | None) -> Who:
    """The account a run's files are read or written as: its owner's, or the daemon's own."""
    if uid is None or uid == os.geteuid() or os.geteuid() != 0:
        return Who(None, "the daemon's own user")
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise ExecutorError(
            f"the run's owner (uid {uid}) has no account on this machine, so its checkpoint is neither read "
            "nor written as anyone else: restore the account, or carry it by hand as root"
        ) from None
    return Who(creds.account(uid, pw.pw_gid), pw.pw_name)


def _env(who: Who) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEPT_ENV or k.startswith("LC_")}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    if who.account is not None:
        with contextlib.suppress(KeyError):
            pw = pwd.getpwuid(who.account.uid)
            env.update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name)
    return env


def spawn(who: Who, argv: list[str], stdin: int | None, stdout: int | None) -> subprocess.Popen[bytes]:
    """The helper as `who`, for good (set in the child before exec)."""
    extra: dict[str, object] = {}
    if who.account is not None:
        a = who.account
        extra = {"user": a.uid, "group": a.gid, "extra_groups": list(a.groups or (a.gid,))}
    return subprocess.Popen(  # type: ignore[call-overload]
        argv,
        stdin=stdin,
        stdout=stdout,
        stderr=subprocess.PIPE,
        env=_env(who),
        cwd="/",
        umask=UMASK,
        start_new_session=True,
        **extra,
    )


def pack_argv(python: str, root: str, excluded: list[str]) -> list[str]:
    return [python, "-I", "-c", HELPER, "pack", root, json.dumps(excluded)]


def unpack_argv(python: str, dest: str) -> list[str]:
    return [python, "-I", "-c", HELPER, "unpack", dest]


def _killed(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(5)


def _error_frame(data: bytes) -> str | None:
    """The error a helper's stream ended with, if its tail holds an `X` frame."""
    at = data.rfind(b"X")
    while at >= 0:
        with contextlib.suppress(ValueError, struct.error):
            (n,) = struct.unpack(">I", data[at + 1 : at + 5])
            if at + 5 + n == len(data):
                return str(json.loads(data[at + 5 :])["error"])
        at = data.rfind(b"X", 0, at)
    return None


def listing(python: str, root: str, who: Who, script: str, excluded: list[str]) -> Manifest:
    """`python -c SCRIPT ROOT EXCLUDED` (carry.py's LISTING) as `who`: what is at `root` read back."""
    proc = spawn(who, [python, "-I", "-c", script, root, json.dumps(excluded)], None, subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=3600)
    finally:
        _killed(proc)
    if proc.returncode != 0:
        raise CarryRefused(f"listing {root} as {who.name} failed: {err.decode(errors='replace').strip()[-300:]}")
    try:
        return {str(p): (int(s), str(d)) for p, (s, d) in json.loads(out).items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise CarryRefused(f"the listing of {root} is not what it prints: {exc}") from exc


def _answer(out: bytes, err: bytes, who: Who, what: str) -> Manifest:
    """The manifest an `unpack` printed, or CarryRefused saying why it wrote nothing whole."""
    try:
        answer = json.loads(out or b"{}")
    except ValueError:
        answer = {}
    if "manifest" in answer:
        return {p: (int(s), str(d)) for p, (s, d) in answer["manifest"].items()}
    why = answer.get("error") or err.decode(errors="replace").strip()[-300:] or "it ended without a word"
    raise CarryRefused(f"{what} as {who.name} failed: {why}")


class CarryRefused(ExecutorError):
    """A helper refused or failed: nothing, or nothing whole, was carried."""


def local_to_local(
    python_src: str, src: str, src_who: Who, python_dst: str, dest: str, dst_who: Who, excluded: list[str]
) -> Manifest:
    """`pack` as the source's owner piped into `unpack` as the destination's: the bytes never pass
    through the daemon. What was written (each file's sha256 the sender's); CarryRefused when
    either refused."""
    r, w = os.pipe()
    try:
        packer = spawn(src_who, pack_argv(python_src, src, excluded), None, w)
        try:
            unpacker = spawn(dst_who, unpack_argv(python_dst, dest), r, subprocess.PIPE)
        except BaseException:
            _killed(packer)
            raise
    finally:
        os.close(r)
        os.close(w)
    try:
        out, err_u = unpacker.communicate()
        err_p = packer.stderr.read() if packer.stderr else b""
        packer.wait()
    finally:
        _killed(packer, unpacker)
    try:
        written = _answer(out, err_u, dst_who, f"writing {dest}")
    except CarryRefused:
        if packer.returncode != 0:  # the sender said why first (a link refused, a file unreadable)
            raise CarryRefused(f"reading {src} as {src_who.name} refused: {_said(out, err_p)}") from None
        raise
    if packer.returncode != 0:
        raise CarryRefused(f"reading {src} as {src_who.name} failed: {_said(out, err_p)}")
    return written


def stream_entry(head: dict[str, Any]) -> tuple[str, int, int]:
    """A file's (path, size, mode) as the user's helper announced it, checked here: that process is
    the user's (they may trace it and write what they like), and the daemon writes the path on a
    target with the target's own account. A path that leaves the checkpoint is refused; the mode
    keeps only the permission bits (no setuid, setgid or sticky bit is carried)."""
    path = str(head["path"])
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise CarryRefused(f"{path!r} is not a path inside the checkpoint: nothing was carried")
    size = int(head["size"])
    if size < 0:
        raise CarryRefused(f"{path}: a size of {size} bytes: nothing was carried")
    return path, size, int(head.get("mode", 0o600)) & 0o777


def _said(out: bytes, err: bytes) -> str:
    with contextlib.suppress(ValueError):
        answer = json.loads(out or b"{}")
        if "error" in answer:
            return str(answer["error"])
    return err.decode(errors="replace").strip()[-300:] or "it ended without a word"


async def pack_stream(
    python: str, src: str, who: Who, excluded: list[str]
) -> AsyncIterator[tuple[str, int, int, AsyncIterator[bytes]]]:
    """The files `pack` (as `who`) sends: (path, size, mode, its chunks), each to be read whole
    before the next; CarryRefused when it refuses, or a file's sha256 differs from what it read."""
    proc = await anyio.to_thread.run_sync(spawn, who, pack_argv(python, src, excluded), None, subprocess.PIPE)
    assert proc.stdout is not None
    pipe = proc.stdout

    async def read(n: int) -> bytes:
        data = await anyio.to_thread.run_sync(pipe.read, n)
        if len(data) != n:
            err = await anyio.to_thread.run_sync(_stderr_of, proc)
            raise CarryRefused(f"reading {src} as {who.name} failed: {err or 'the stream ended early'}")
        return data

    try:
        while True:
            kind = await read(1)
            head = json.loads(await read(struct.unpack(">I", await read(4))[0]))
            if kind == b"E":
                return
            if kind == b"X":
                raise CarryRefused(f"reading {src} as {who.name} refused: {head['error']}")
            path, size, mode = stream_entry(head)
            digest = hashlib.sha256()

            async def chunks(size: int = size, digest: Any = digest) -> AsyncIterator[bytes]:
                left = size
                while left:
                    chunk = await read(min(CHUNK * 4, left))
                    digest.update(chunk)
                    left -= len(chunk)
                    yield chunk

            yield path, size, mode, chunks()
            if (await read(32)) != digest.digest():
                raise CarryRefused(f"{path} changed while it was read as {who.name}: nothing was carried")
    finally:
        await anyio.to_thread.run_sync(_killed, proc)


def _stderr_of(proc: subprocess.Popen[bytes]) -> str:
    with contextlib.suppress(Exception):
        proc.wait(5)
    return (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip()[-300:]


class Unpacker:
    """`unpack` as `who` into `dest`, fed file by file (`send`) from another target's stream."""

    def __init__(self, python: str, dest: str, who: Who) -> None:
        self.python, self.dest, self.who = python, dest, who
        self.proc: subprocess.Popen[bytes] | None = None

    async def __aenter__(self) -> Unpacker:
        self.proc = await anyio.to_thread.run_sync(
            spawn, self.who, unpack_argv(self.python, self.dest), subprocess.PIPE, subprocess.PIPE
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.proc is not None:
            await anyio.to_thread.run_sync(_killed, self.proc)

    async def _write(self, data: bytes) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        stdin = self.proc.stdin
        try:
            await anyio.to_thread.run_sync(stdin.write, data)
        except (BrokenPipeError, OSError):
            await self.finish()  # says why it stopped reading
            raise CarryRefused(f"writing {self.dest} as {self.who.name} stopped") from None

    async def send(
        self, path: str, size: int, mode: int, feed: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]
    ) -> None:
        """One file: its header, the bytes `feed` hands to the sink it is given, and their sha256."""
        digest = hashlib.sha256()
        head = json.dumps({"path": path, "size": size, "mode": mode}).encode()
        await self._write(b"F" + struct.pack(">I", len(head)) + head)
        got = 0

        async def sink(chunk: bytes) -> None:
            nonlocal got
            digest.update(chunk)
            got += len(chunk)
            await self._write(chunk)

        await feed(sink)
        if got != size:
            raise CarryRefused(f"{path} had {got} bytes where {size} were listed: nothing whole was carried")
        await self._write(digest.digest())

    async def finish(self) -> Manifest:
        """The end of the stream; what `unpack` wrote (CarryRefused if it wrote nothing whole)."""
        assert self.proc is not None
        proc = self.proc
        end = json.dumps({}).encode()
        with contextlib.suppress(OSError):
            if proc.stdin is not None and not proc.stdin.closed:
                await anyio.to_thread.run_sync(proc.stdin.write, b"E" + struct.pack(">I", len(end)) + end)
        out, err = await anyio.to_thread.run_sync(_communicate, proc)
        return _answer(out, err, self.who, f"writing {self.dest}")


def _communicate(proc: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    with contextlib.suppress(OSError):
        if proc.stdin is not None and not proc.stdin.closed:
            proc.stdin.close()
    out = proc.stdout.read() if proc.stdout else b""
    err = proc.stderr.read() if proc.stderr else b""
    proc.wait()
    return out, err
