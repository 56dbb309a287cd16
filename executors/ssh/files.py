"""Files on an SSH host over SFTP: reads, atomic writes, uploads and link-safe downloads.

A download never follows a symbolic link out of the run directory. The path asked for must be
reached without a link below the target's workdir (checked with one `realpath` of its parent),
and must not be a link itself. Inside a downloaded tree, a link is kept as a link only when its
target is relative with no `..` in it, so it can only point further down the tree; any other
link (to `/etc`, to `..`) is skipped and logged, never copied as what it points at.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import secrets as _secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import TypeVar

import anyio
import anyio.to_thread
import asyncssh
import structlog

from executors import remote
from executors.base import ExecutorError, LinkRefused
from executors.ssh.connection import Session, SshConnection, quietly, returncode, tail

log = structlog.get_logger()
T = TypeVar("T")
STREAM_CHUNK = 4 << 20  # a stream's reads: asyncssh asks for its blocks of one read in parallel
STREAM_TIMEOUT = 24 * 3600.0  # one file of a checkpoint, however large, over however slow a link


def link_stays_inside(target: str) -> bool:
    """Whether a link with this target, wherever it is in a tree, can only point further down it:
    relative, and with no `..` (which, through another link, could climb out)."""
    if not target or target.startswith("/"):
        return False
    return ".." not in PurePosixPath(target).parts


class SftpFiles:
    """Reads, writes and transfers of files on the host of one connection."""

    def __init__(self, connection: SshConnection, *, parallel: int = 8) -> None:
        self.conn = connection
        self._files = anyio.CapacityLimiter(parallel)

    @property
    def address(self) -> str:
        return self.conn.address

    async def _op(
        self,
        what: str,
        op: Callable[[asyncssh.SFTPClient, Session], Awaitable[T]],
        *,
        retry: bool = True,
        timeout: float | None = None,
    ) -> T:
        async def run(s: Session) -> T:
            return await op(await self.conn.sftp(s), s)

        return await self.conn.remote(what, run, channel=False, retry=retry, timeout=timeout)

    # --- small files ------------------------------------------------------------------------

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        """At most `limit` bytes of a regular file from `offset`; b"" if it is missing or not a file."""

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> bytes:
            try:
                self.conn.round_trips += 1
                attrs = await sftp.lstat(path)
            except asyncssh.SFTPNoSuchFile:
                return b""
            # Never open a FIFO or device: the server's SFTP process would block on it.
            if attrs.type != asyncssh.FILEXFER_TYPE_REGULAR or (attrs.size is not None and offset >= attrs.size):
                return b""
            try:
                self.conn.round_trips += 3  # open, read, close
                async with sftp.open(path, "rb") as f:
                    return await f.read(limit, offset)
            except asyncssh.SFTPNoSuchFile:
                return b""

        if limit <= 0:
            return b""
        try:
            return await self._op(f"a read of {path}", op)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(f"could not read {path} on {self.address}: {exc.reason}") from exc

    async def put_file(self, path: str, data: bytes) -> None:
        """Write a file atomically: a temporary file in the same directory, fsync, then rename."""
        parent = str(PurePosixPath(path).parent)

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
            tmp = f"{parent}/.{PurePosixPath(path).name}.tmp.{_secrets.token_hex(4)}"
            try:
                await self._write_new(sftp, tmp, data)
            except asyncssh.SFTPNoSuchFile:
                await self._mkdir(sftp, s, parent)
                await self._write_new(sftp, tmp, data)
            try:
                self.conn.round_trips += 1
                await sftp.posix_rename(tmp, path)
            except BaseException:
                await quietly(sftp.remove(tmp))
                raise

        try:
            await self._op(f"a write of {path}", op)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(
                f"could not write {path} on {self.address}: {exc.reason or type(exc).__name__}; the old file, if any, "
                f"is intact (a full disk? check `df -h {remote.q(parent)}` there)"
            ) from exc

    async def _write_new(self, sftp: asyncssh.SFTPClient, tmp: str, data: bytes) -> None:
        """Create `tmp` with `data` and flush it to disk; remove it again if any step fails."""
        self.conn.round_trips += 1
        f = await sftp.open(tmp, "wb")
        try:
            self.conn.round_trips += 2  # write, fsync
            await f.write(data)
            with contextlib.suppress(asyncssh.SFTPOpUnsupported):
                await f.fsync()
        except BaseException:
            await quietly(f.close())
            await quietly(sftp.remove(tmp))
            raise
        self.conn.round_trips += 1
        await f.close()

    async def _mkdir(self, sftp: asyncssh.SFTPClient, s: Session, path: str) -> None:
        """Create a directory whose parent exists with one SFTP request; else `mkdir -p`."""
        try:
            self.conn.round_trips += 1
            await sftp.mkdir(path)
            return
        except asyncssh.SFTPError:
            pass  # missing parent, exists already, or refused: `mkdir -p` sorts it out and says why
        await self.mkdirs(s, [path])

    async def mkdirs(self, s: Session, dirs: list[str]) -> None:
        """`mkdir -p` on the host, in as few commands as the line length allows."""
        chunk: list[str] = []
        size = 0
        for d in [*dirs, None]:
            if d is not None and size + len(d) < 60_000:
                chunk.append(d)
                size += len(d) + 3
                continue
            if chunk:
                async with self.conn.channels:
                    r = await self.conn.run(s, remote.mkdirs_command(chunk))
                if returncode(r) != 0:
                    raise ExecutorError(f"could not create {chunk[0]!r} on {self.address}: {tail(r.stderr)}")
            chunk, size = ([d], len(d)) if d is not None else ([], 0)

    # --- uploads ----------------------------------------------------------------------------

    async def upload(self, local: Path, remote_path: str) -> None:
        """Copy a local file or tree to the host, leaving out VCS, caches and virtual environments."""
        local = Path(local)
        if not local.exists() and not local.is_symlink():
            return
        if local.is_file():
            await self._upload_file(local, remote_path)
            return
        dirs, files, links = await anyio.to_thread.run_sync(remote.walk_upload, local)
        base = remote_path.rstrip("/") or "/"

        def dest(rel: Path) -> str:
            return f"{base}/{rel.as_posix()}"

        async def make_dirs(sftp: asyncssh.SFTPClient, s: Session) -> None:
            await self.mkdirs(s, [base, *(dest(d) for d in dirs)])

        await self._op(f"an upload to {base}", make_dirs)

        async def put(rel: Path) -> None:
            async with self._files:

                async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
                    self.conn.round_trips += 1
                    await sftp.put(str(local / rel), dest(rel), preserve=True)

                await self._op(f"an upload of {rel}", op, timeout=max(self.conn.op_timeout, 600))

        async def link(rel: Path) -> None:
            target = os.readlink(local / rel)

            async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
                await quietly(sftp.remove(dest(rel)))
                self.conn.round_trips += 2
                await sftp.symlink(target, dest(rel))

            await self._op(f"an upload of {rel}", op)

        try:
            async with anyio.create_task_group() as tg:
                for rel in files:
                    tg.start_soon(put, rel)
                for rel in links:
                    tg.start_soon(link, rel)
        except BaseExceptionGroup as group:
            raise transfer_error(
                f"upload of {local} to {base} on {self.address}", first_leaf(group), disk_hint(base)
            ) from None

    async def _upload_file(self, local: Path, remote_path: str) -> None:
        parent = str(PurePosixPath(remote_path).parent)

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
            tmp = f"{parent}/.{PurePosixPath(remote_path).name}.tmp.{_secrets.token_hex(4)}"
            await self.mkdirs(s, [parent])
            try:
                self.conn.round_trips += 2
                await sftp.put(str(local), tmp, preserve=True)
                await sftp.posix_rename(tmp, remote_path)
            except BaseException:
                await quietly(sftp.remove(tmp))
                raise

        try:
            await self._op(f"an upload to {remote_path}", op, timeout=max(self.conn.op_timeout, 600))
        except asyncssh.SFTPError as exc:
            hint = disk_hint(parent) if isinstance(exc, asyncssh.SFTPFailure) else ""
            raise ExecutorError(
                f"upload of {local} to {remote_path} on {self.address} failed: {exc.reason}{hint}"
            ) from exc

    # --- streams (a checkpoint carried between targets, daemon/service/carry.py) --------------

    async def write_from(self, remote_path: str, chunks: AsyncIterator[bytes], mode: int = 0o600) -> None:
        """Write a file whose bytes come from `chunks` (read once, so never retried) as a fresh file
        renamed into place, its directory made when missing."""
        parent = str(PurePosixPath(remote_path).parent)

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
            tmp = f"{parent}/.{PurePosixPath(remote_path).name}.tmp.{_secrets.token_hex(4)}"
            attrs = asyncssh.SFTPAttrs(permissions=mode & 0o777)
            try:
                f = await sftp.open(tmp, "wb", attrs)
            except asyncssh.SFTPNoSuchFile:
                await self._mkdir(sftp, s, parent)
                f = await sftp.open(tmp, "wb", attrs)
            try:
                async for chunk in chunks:
                    self.conn.round_trips += 1
                    await f.write(chunk)
                await f.close()
                await sftp.posix_rename(tmp, remote_path)
            except BaseException:
                await quietly(f.close())
                await quietly(sftp.remove(tmp))
                raise

        try:
            await self._op(f"a write of {remote_path}", op, retry=False, timeout=STREAM_TIMEOUT)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(
                f"could not write {remote_path} on {self.address}: {exc.reason or type(exc).__name__}"
                f"{disk_hint(parent) if isinstance(exc, asyncssh.SFTPFailure) else ''}"
            ) from exc

    async def read_into(self, remote_path: str, sink: Callable[[bytes], Awaitable[None]]) -> None:
        """Hand the bytes of the regular file `remote_path` to `sink`, chunk by chunk (never retried)."""

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
            attrs = await sftp.lstat(remote_path)
            if attrs.type != asyncssh.FILEXFER_TYPE_REGULAR:
                raise LinkRefused(f"{remote_path} on {self.address} is not a regular file: nothing was copied")
            async with sftp.open(remote_path, "rb") as f:
                while data := await f.read(STREAM_CHUNK):
                    self.conn.round_trips += 1
                    await sink(data if isinstance(data, bytes) else data.encode())

        try:
            await self._op(f"a read of {remote_path}", op, retry=False, timeout=STREAM_TIMEOUT)
        except asyncssh.SFTPError as exc:
            raise ExecutorError(f"could not read {remote_path} on {self.address}: {exc.reason}") from exc

    # --- downloads --------------------------------------------------------------------------

    async def download(self, remote_path: str, local: Path) -> None:
        """Copy a file or tree from the host; a missing path copies nothing.

        Refuses (LinkRefused) a path that is a symbolic link or is reached through one below the
        workdir; inside a tree, keeps only the links that point further down it (see the module).
        """
        local = Path(local)
        remote_path = posixpath.normpath(remote_path)

        async def stat(sftp: asyncssh.SFTPClient, s: Session) -> asyncssh.SFTPAttrs | None:
            try:
                self.conn.round_trips += 1
                attrs = await sftp.lstat(remote_path)
            except asyncssh.SFTPNoSuchFile:
                return None
            if attrs.type == asyncssh.FILEXFER_TYPE_SYMLINK:
                raise LinkRefused(
                    f"{remote_path} on {self.address} is a symbolic link: obd never follows a link out of the "
                    "run directory, so nothing was copied"
                )
            await self._refuse_links_above(sftp, s, remote_path)
            return attrs

        try:
            attrs = await self._op(f"a download of {remote_path}", stat)
            if attrs is None:
                return
            if attrs.type == asyncssh.FILEXFER_TYPE_DIRECTORY:
                await self._download_tree(remote_path, local)
            else:
                await self._download_file(remote_path, local)
        except BaseExceptionGroup as group:
            raise transfer_error(f"download of {remote_path} from {self.address}", first_leaf(group)) from None
        except (asyncssh.SFTPError, OSError) as exc:
            raise transfer_error(f"download of {remote_path} from {self.address}", exc) from exc

    async def _refuse_links_above(self, sftp: asyncssh.SFTPClient, s: Session, path: str) -> None:
        """Raise LinkRefused when a directory between the workdir and `path` is a symbolic link.

        The workdir itself may sit behind links (a home on another disk); below it, the resolved
        parent must be exactly the workdir's resolved path plus the same names. A path outside
        the workdir may have no link anywhere on it.
        """
        parent = posixpath.dirname(path)
        workdir = posixpath.normpath(s.workdir)
        if parent == workdir or parent.startswith(workdir.rstrip("/") + "/"):
            if s.real_workdir is None:
                self.conn.round_trips += 1
                s.real_workdir = posixpath.normpath(await sftp.realpath(workdir))
            expected = posixpath.normpath(s.real_workdir + parent[len(workdir) :])
        else:
            expected = parent
        self.conn.round_trips += 1
        real = posixpath.normpath(await sftp.realpath(parent))
        if real != expected:
            raise LinkRefused(
                f"{path} on {self.address} is reached through a symbolic link (its directory resolves to {real}): "
                "obd never follows a link out of the run directory, so nothing was copied"
            )

    async def _download_file(self, remote_path: str, local: Path) -> None:
        """Fetch one file into a temporary name beside `local`, then rename it into place."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.tmp.{_secrets.token_hex(4)}")

        async def op(sftp: asyncssh.SFTPClient, s: Session) -> None:
            self.conn.round_trips += 1
            await sftp.get(remote_path, str(tmp), preserve=True)

        async with self._files:
            try:
                await self._op(f"a download of {remote_path}", op, timeout=max(self.conn.op_timeout, 600))
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)

    async def _download_link(self, remote_path: str, local: Path) -> None:
        async def op(sftp: asyncssh.SFTPClient, s: Session) -> str:
            self.conn.round_trips += 1
            return await sftp.readlink(remote_path)

        target = await self._op(f"a download of {remote_path}", op)
        if not link_stays_inside(target):
            log.warning(
                "ssh.link_skipped",
                address=self.address,
                path=remote_path,
                link_to=target,
                why="it may point out of the run directory",
            )
            return
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.is_symlink() or local.is_file():
            local.unlink()
        os.symlink(target, local)

    async def _download_tree(self, remote_dir: str, local: Path) -> None:
        async def listing(sftp: asyncssh.SFTPClient, s: Session) -> list[asyncssh.SFTPName]:
            self.conn.round_trips += 1
            return [n for n in await sftp.readdir(remote_dir) if n.filename not in (".", "..")]

        entries = await self._op(f"a listing of {remote_dir}", listing)
        local.mkdir(parents=True, exist_ok=True)
        async with anyio.create_task_group() as tg:
            for entry in entries:
                name = entry.filename if isinstance(entry.filename, str) else entry.filename.decode()
                src, dst = f"{remote_dir}/{name}", local / name
                # readdir reports what each entry is without following it (lstat), so a link to
                # a directory is a link here, never a directory to walk into.
                kind = entry.attrs.type
                if kind == asyncssh.FILEXFER_TYPE_DIRECTORY:
                    tg.start_soon(self._download_tree, src, dst)
                elif kind == asyncssh.FILEXFER_TYPE_SYMLINK:
                    tg.start_soon(self._download_link, src, dst)
                elif kind == asyncssh.FILEXFER_TYPE_REGULAR:
                    tg.start_soon(self._download_file, src, dst)


# --- helpers ------------------------------------------------------------------------------------


def first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real exception inside (nested) exception groups."""
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def disk_hint(path: str) -> str:
    return f" (a full disk? check `df -h {remote.q(path)}` there)"


def transfer_error(what: str, exc: BaseException, hint: str = "") -> BaseException:
    """The one error to report for a failed transfer of many files; `hint` follows a generic
    SFTP failure (OpenSSH's sftp-server reports a full disk as just "Failure")."""
    if isinstance(exc, ExecutorError):
        return exc
    if isinstance(exc, asyncssh.SFTPError):
        extra = hint if isinstance(exc, asyncssh.SFTPFailure) else ""
        return ExecutorError(f"{what} failed: {exc.reason or type(exc).__name__}{extra}")
    if isinstance(exc, OSError):
        return ExecutorError(f"{what} failed on this machine: {exc}")
    return exc
