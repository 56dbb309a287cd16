"""A root process acting on a user's files with that user's rights (standard library only).

Linux keeps credentials per thread, and what it checks when a thread opens, creates, lists or
renames a file are the thread's filesystem ids (fsuid, fsgid) and supplementary groups. A root
daemon sets them to a run's owner around each operation on that run's directory, in the thread
doing it, so a link or a file planted there is followed only as far as its owner could follow
it: nothing root-only is read, nothing is written where the owner could not write. Changing
the fsuid from 0 also drops the thread's filesystem capabilities (CAP_DAC_OVERRIDE, ...) until
it is set back. glibc's setfsuid/setfsgid act on the calling thread only; the groups are set
with the raw system call, since glibc's setgroups() changes every thread of the process.

Used by the local executor (in its worker threads, never the event loop's), by the job
wrapper, which stays root to supervise the job it starts as the user (cf. slurmstepd), and by
the daemon, which hands the outputs it gathered over to their owner (`hand_over`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pwd
import stat
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple, TypeVar

# setgroups(2)'s number where glibc's wrapper would change every thread.
_SETGROUPS = {"x86_64": 116, "amd64": 116, "aarch64": 159, "arm64": 159, "ppc64le": 81, "ppc64": 81}
T = TypeVar("T")
_GROUPS_TTL = 60.0  # how long a user's group list is reused before it is looked up again


class CredsError(OSError):
    """The thread's credentials could not be switched: the operation was not done."""


# A named tuple and a plain class, not dataclasses: the job wrapper imports this module at each
# start, and `dataclasses` (with the `inspect` it imports) was a quarter of its imports' time.
class Account(NamedTuple):
    """Whose rights an operation runs with: a uid, its primary gid and its supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


_libc: ctypes.CDLL | None = None
_groups_cache: dict[tuple[int, int], tuple[float, tuple[int, ...]]] = {}
_groups_lock = threading.Lock()


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def groups_of(uid: int, gid: int) -> tuple[int, ...]:
    """The supplementary groups a login of `uid` gets (cached for a minute)."""
    now = time.monotonic()
    with _groups_lock:
        hit = _groups_cache.get((uid, gid))
        if hit is not None and now - hit[0] < _GROUPS_TTL:
            return hit[1]
    try:
        groups = tuple(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except (KeyError, OSError):
        groups = (gid,)
    with _groups_lock:
        _groups_cache[(uid, gid)] = (now, groups)
    return groups


def account(uid: int, gid: int, groups: list[int] | tuple[int, ...] | None = None) -> Account:
    """An account from its ids; its groups as a login would have them when none are given."""
    return Account(uid, gid, tuple(groups) if groups else groups_of(uid, gid))


def owner_of(path: str) -> Account | None:
    """The account that owns `path` (not followed if a link), or None when it is this process's own
    effective user or `path` is missing: then there is no one else's rights to take."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if st.st_uid == os.geteuid():
        return None
    return account(st.st_uid, st.st_gid)


def _thread_setgroups(groups: tuple[int, ...]) -> None:
    number = _SETGROUPS.get(os.uname().machine)
    if number is None:
        raise CredsError(f"obd cannot set a thread's groups on {os.uname().machine}: run the daemon as its user")
    array = (ctypes.c_uint * max(1, len(groups)))(*groups)
    if _lib().syscall(ctypes.c_long(number), ctypes.c_size_t(len(groups)), array) != 0:
        err = ctypes.get_errno()
        raise CredsError(err, f"setgroups: {os.strerror(err)}")


def _set_fs_ids(uid: int, gid: int) -> None:
    lib = _lib()
    lib.setfsgid(ctypes.c_uint(gid))
    lib.setfsuid(ctypes.c_uint(uid))
    # Both return the previous id and report no error: ask again to see that the change took.
    if lib.setfsuid(ctypes.c_uint(0xFFFFFFFF)) != uid or lib.setfsgid(ctypes.c_uint(0xFFFFFFFF)) != gid:
        raise CredsError(f"could not take the filesystem ids {uid}:{gid}")


@contextlib.contextmanager
def acting_as(who: Account | None) -> Iterator[None]:
    """Run the body with `who`'s filesystem rights in this thread; nothing changes for None, or
    when this process is not root (it has no one else's rights to take, and no more than its own)."""
    if who is None or os.geteuid() != 0 or who.uid == 0:
        yield
        return
    saved_groups = tuple(os.getgroups())
    _thread_setgroups(who.groups or (who.gid,))
    try:
        _set_fs_ids(who.uid, who.gid)
        try:
            yield
        finally:
            _set_fs_ids(0, os.getegid())
    finally:
        _thread_setgroups(saved_groups)


def call_as(who: Account | None, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` with `who`'s filesystem rights (a function to hand to a worker thread)."""
    with acting_as(who):
        return fn(*args)


# --- copying across two accounts --------------------------------------------------------------

_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class Copied:
    """What a copy did: files and bytes written, and the entries it left out (links, FIFOs, ...)."""

    __slots__ = ("bytes", "files", "left_out")

    def __init__(self) -> None:
        self.files = 0
        self.bytes = 0
        self.left_out: list[str] = []


def hand_over(directory: str | os.PathLike[str], uid: int, gid: int) -> None:
    """Give a directory the daemon made (and all in it) to a user, links not followed: the last
    step before a tree gathered with the daemon's rights is renamed into the user's place."""
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), uid, gid)
    os.lchown(directory, uid, gid)


def copy_tree(
    src: str,
    dst: str,
    *,
    read_as: Account | None,
    write_as: Account | None,
    keep_links: bool = False,
    skip: Callable[[str, str], bool] | None = None,
) -> Copied:
    """Copy the file or directory `src` to `dst`, reading with `read_as`'s rights and writing with
    `write_as`'s: every entry of `src` is opened relative to its directory without following a
    link, so a link swapped in anywhere leads nowhere. Links are recreated as links only with
    `keep_links` (never into a place of the daemon's own, which a link must not lead out of); FIFOs, sockets and devices are
    left out. `skip(directory, name)` leaves out entries by name (caches, venvs)."""
    done = Copied()
    with acting_as(read_as):
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            return done
        fd = os.open(src, _OPEN_DIR if stat.S_ISDIR(st.st_mode) else _OPEN_FILE)
    try:
        if stat.S_ISDIR(st.st_mode):
            _copy_dir(fd, src, dst, read_as, write_as, keep_links, skip, done)
        elif stat.S_ISREG(os.fstat(fd).st_mode):
            _write_file(fd, dst, write_as, done)
        else:
            done.left_out.append(src)
    finally:
        os.close(fd)
    return done


def _copy_dir(
    dir_fd: int,
    where: str,
    dst: str,
    read_as: Account | None,
    write_as: Account | None,
    keep_links: bool,
    skip: Callable[[str, str], bool] | None,
    done: Copied,
) -> None:
    with acting_as(write_as):
        _make_dir(dst)
    with acting_as(read_as):
        names = sorted(os.listdir(dir_fd))
    for name in names:
        path, target = os.path.join(where, name), os.path.join(dst, name)
        with acting_as(read_as):
            if skip is not None and skip(where, name):
                continue
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                is_dir, is_file = stat.S_ISDIR(st.st_mode), stat.S_ISREG(st.st_mode)
                link = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
                fd = os.open(name, _OPEN_DIR if is_dir else _OPEN_FILE, dir_fd=dir_fd) if is_dir or is_file else -1
            except OSError:
                done.left_out.append(path)
                continue
        if fd < 0:
            if link is not None and keep_links:
                with acting_as(write_as):
                    _replace_with_link(link, target)
            else:
                done.left_out.append(path)
            continue
        try:
            if is_dir:
                _copy_dir(fd, path, target, read_as, write_as, keep_links, skip, done)
            else:
                _write_file(fd, target, write_as, done)
        finally:
            os.close(fd)


def _make_dir(path: str) -> None:
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(
                f"{path} exists and is not a directory (a link is never written through)"
            ) from None


def _replace_with_link(link: str, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(target).st_mode):
            os.unlink(target)
    os.symlink(link, target)


def _write_file(src_fd: int, target: str, write_as: Account | None, done: Copied) -> None:
    """Write what `src_fd` holds to `target` whole (a fresh file renamed over it), with its mode and times."""
    st = os.fstat(src_fd)
    with acting_as(write_as):
        directory, base = os.path.split(target)
        tmp = os.path.join(directory, f".{base}.tmp.{os.getpid()}.{os.urandom(6).hex()}")
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            size = _pump(src_fd, out)
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o777)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        except BaseException:
            os.close(out)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(out)
        os.replace(tmp, target)
    done.files += 1
    done.bytes += size


def _pump(src: int, out: int) -> int:
    total = 0
    os.lseek(src, 0, os.SEEK_SET)
    while chunk := os.read(src, 1 << 20):
        view = memoryview(chunk)
        while view:
            view = view[os.write(out, view) :]
        total += len(chunk)
    return total
