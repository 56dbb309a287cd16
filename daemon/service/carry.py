"""Carrying a checkpoint to another target, for a run resumed there (`obd train resume RUN --target T`).

Only the checkpoint's directory travels, through the executors' own file operations (streamed,
file by file). Every file's size and sha256 is known before it leaves: read where the bytes are
(this machine: hashed here, in chunks; another target: listed there by one command) and checked
again on the copy brought here, if one was needed, and where it arrives (one command on the
destination, with the target's python), before the job starts. A file that differs fails the
launch saying which, and nothing is ever deleted at the source: the run stays resumable there.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.to_thread
import structlog

from daemon.service.carry_local import Unpacker, Who, listing, local_to_local, pack_stream, who_owns
from daemon.service.models import RunRecord
from daemon.service.ports import Runs
from daemon.service.targets import Targets
from executors.base import Executor, ExecutorError
from trainer_plugin import rundir

if TYPE_CHECKING:
    from executors.ssh.files import SftpFiles

log = structlog.get_logger("obd")

Manifest = dict[str, tuple[int, str]]  # a file's path under the checkpoint -> (size, sha256)
CHUNK = 1 << 20
LIST_TIMEOUT = 3600.0  # hashing a checkpoint of hundreds of GB on a slow disk

# The listing run on a target: `python -c LISTING DIR EXCLUDED_JSON` prints {path: [size, sha256]}
# of every regular file under DIR, as `walk_upload` chooses what an upload carries (links are
# carried as links, never followed; caches and virtual environments stay behind). Standard
# library only, any Python 3: nothing need be installed there.
LISTING = r"""
import hashlib, json, os, sys
root, excluded = sys.argv[1], set(json.loads(sys.argv[2]))
found = {}
for top, dirs, files in os.walk(root):
    keep = []
    for d in dirs:
        p = os.path.join(top, d)
        if not os.path.islink(p) and d not in excluded and not os.path.isfile(os.path.join(p, "pyvenv.cfg")):
            keep.append(d)
    dirs[:] = keep
    for name in files:
        p = os.path.join(top, name)
        if os.path.islink(p) or not os.path.isfile(p):
            continue
        h, n = hashlib.sha256(), 0
        with open(p, "rb") as f:
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                h.update(chunk)
                n += len(chunk)
        found[os.path.relpath(p, root).replace(os.sep, "/")] = [n, h.hexdigest()]
json.dump(found, sys.stdout)
"""


# The size arrived so far: `python -c ARRIVED DIR` prints the bytes of the regular files under DIR.
ARRIVED = r"""
import os, sys
n = 0
for top, dirs, files in os.walk(sys.argv[1]):
    for name in files:
        p = os.path.join(top, name)
        if not os.path.islink(p):
            try:
                n += os.path.getsize(p)
            except OSError:
                pass
print(n)
"""
PROGRESS_EVERY = 1.0  # seconds between two looks at what arrived


class CarryHost(Runs, Protocol):
    """What a carry uses of the daemon: its records (and store), and its targets."""

    @property
    def targets(self) -> Targets: ...


class CarryFailed(ExecutorError):
    """A checkpoint did not arrive whole: the launch fails, and nothing was deleted at the source."""


@dataclass(frozen=True)
class Carried:
    """What a carry moved, for the new run's history."""

    files: int
    size: int


def manifest_here(root: Path) -> Manifest:
    """Size and sha256 of every file an upload of `root` carries (`walk_upload`'s), read in chunks."""
    from executors.remote import walk_upload  # tarfile and jobctl: when a carry comes, not at the daemon's start

    _, files, _ = walk_upload(root)
    found: Manifest = {}
    for rel in files:
        digest, size = hashlib.sha256(), 0
        fd = os.open(root / rel, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
                size += len(chunk)
        found[rel.as_posix()] = (size, digest.hexdigest())
    return found


def sizes_here(root: Path) -> dict[str, int]:
    """The size of every file an upload of `root` carries, from one stat each."""
    from executors.remote import walk_upload

    _, files, _ = walk_upload(root)
    return {rel.as_posix(): os.lstat(root / rel).st_size for rel in files}


async def manifest_there(executor: Executor, root: str) -> Manifest:
    """The same listing, of `root` on the executor's machine, by one command with its python."""
    from executors.remote import EXCLUDED_NAMES

    python = await executor.python()
    argv = [python, "-c", LISTING, root, json.dumps(sorted(EXCLUDED_NAMES))]
    result = await executor.run_command(argv, timeout=LIST_TIMEOUT)
    if result.returncode != 0:
        raise CarryFailed(
            f"listing {root} on target {executor.name} with {python} failed (exit {result.returncode}): "
            f"{result.stderr.decode(errors='replace')[-300:].strip()}"
        )
    try:
        raw = json.loads(result.stdout)
        return {str(path): (int(size), str(digest)) for path, (size, digest) in raw.items()}
    except (ValueError, TypeError, AttributeError) as exc:
        raise CarryFailed(f"the listing of {root} on target {executor.name} is not what it prints: {exc}") from exc


def differences(sent: Manifest, got: Manifest) -> list[str]:
    """Each file whose copy differs from what was sent, said in a few words."""
    said = []
    for path, (size, digest) in sorted(sent.items()):
        if path not in got:
            said.append(f"{path} is missing")
        elif got[path][0] != size:
            said.append(f"{path} has {got[path][0]} bytes, not {size}")
        elif got[path][1] != digest:
            said.append(f"{path}'s sha256 differs")
    said += [f"{path} was not sent" for path in sorted(set(got) - set(sent))]
    return said


async def carry_checkpoint(
    host: CarryHost,
    source: RunRecord,
    name: str,
    executor: Executor,
    dest: str,
    stage: Path,
    into: RunRecord | None = None,
) -> Carried:
    """Carry `source`'s checkpoint `name` to `dest` on `executor`'s machine, every file verified
    on arrival. Read in place when it is on this machine and the daemon may read it as itself;
    else from the copy obd retrieved (a pod's), else brought into `stage` first (removed after).
    The bytes arrived so far are shown on `into`'s progress while it uploads (`carry_bytes`)."""
    targets = host.targets
    where = rundir.RunPaths(source.remote_dir).in_output(name)
    retrieved = Path(rundir.RunPaths(host.store.run_dir(source.id) / "retrieved").in_output(name))
    on_this_machine = files_here(targets, source)
    dest_here = into is not None and files_here(targets, into)
    if on_this_machine or dest_here or retrieved.is_dir():
        # An end on this machine: its files read or written by a helper that is the run's user
        # (daemon/service/carry_local.py), never by the daemon itself.
        went = await _carry_as_users(host, source, name, executor, dest, into, retrieved, on_this_machine, dest_here)
        if went is not None:
            size = sum(s for s, _ in went.values())
            log.info(
                "checkpoint_carried", run_id=source.id, checkpoint=name, to=executor.name, files=len(went), size=size
            )
            return Carried(files=len(went), size=size)
    wanted: Manifest | None = None
    staged = False
    if retrieved.is_dir():
        local = retrieved
    elif on_this_machine and source.owner_uid in (None, os.geteuid()):
        local = Path(where)
    else:
        source_executor = targets.executor(source)
        if not on_this_machine:  # what the source holds, to check the copy brought here against
            wanted = await manifest_there(source_executor, where)
        await anyio.to_thread.run_sync(shutil.rmtree, stage, True)
        staged = True
        await source_executor.download(where, stage / name)
        local = stage / name
    try:
        sizes = await anyio.to_thread.run_sync(sizes_here, local)
        if not sizes:
            raise CarryFailed(f"{where} of run {source.id} holds no file to carry")
        sent: Manifest = {}

        async def hash_here() -> None:
            sent.update(await anyio.to_thread.run_sync(manifest_here, local))

        # The hashing here reads what the upload reads, at the same time (the page cache serves
        # one of them): a carry costs the upload and the check on arrival, not a pass more.
        async with anyio.create_task_group() as tg:
            tg.start_soon(hash_here)
            await _upload_watched(host, executor, local, dest, into, sum(sizes.values()))
        if wanted is not None and (bad := differences(wanted, sent)):
            raise CarryFailed(_refusal(source, name, f"the copy brought from target {source.target}", bad))
        arrived = await manifest_there(executor, dest)
        if bad := differences(sent, arrived):
            raise CarryFailed(_refusal(source, name, f"the copy on target {executor.name}", bad))
    finally:
        if staged:
            await anyio.to_thread.run_sync(shutil.rmtree, stage, True)
    size = sum(s for s, _ in sent.values())
    log.info("checkpoint_carried", run_id=source.id, checkpoint=name, to=executor.name, files=len(sent), size=size)
    return Carried(files=len(sent), size=size)


def files_here(targets: Targets, record: RunRecord) -> bool:
    """Whether the run's directory is in this machine's files: a target of this machine, or one
    whose machines see them (a Slurm cluster whose `sbatch` is here, a Ray cluster of this
    machine's files), so its end of a carry is the helper's that is the run's user."""
    return targets.of(record).answers_at_once() or targets.executor(record).shares_filesystem


async def _upload_watched(
    host: CarryHost, executor: Executor, local: Path, dest: str, into: RunRecord | None, total: int
) -> None:
    """The upload, with what has arrived shown on `into`'s progress (bytes, of the total, and the
    rate) once a second, read on the destination by one small command: the upload is the
    executor's own (a copy here, SFTP over SSH), which counts nothing itself."""
    if into is None:
        await executor.upload(local, dest)
        return
    began = time.monotonic()

    def show(done: int) -> None:
        elapsed = max(time.monotonic() - began, 1e-6)
        into.progress.carry_bytes, into.progress.carry_total = min(done, total), total
        into.progress.carry_rate = round(min(done, total) / elapsed, 1)
        host.touch(into)

    async def watch() -> None:
        python = await executor.python()
        while True:
            await anyio.sleep(PROGRESS_EVERY)
            with anyio.move_on_after(PROGRESS_EVERY * 5):
                result = await executor.run_command([python, "-c", ARRIVED, dest], timeout=PROGRESS_EVERY * 5)
                if result.returncode == 0 and result.stdout.strip().isdigit():
                    show(int(result.stdout.strip()))

    show(0)
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await executor.upload(local, dest)
        tg.cancel_scope.cancel()
    show(total)
    log.info("carry_progress", run_id=into.id, bytes=total, seconds=round(time.monotonic() - began, 2))


def sftp_of(executor: Executor) -> SftpFiles | None:
    """The SFTP files of an SSH host's or a pod's executor (or a Slurm login node's), if it has them."""
    from executors.ssh.files import SftpFiles  # asyncssh: when a carry comes, not at the daemon's start

    for candidate in (executor, getattr(executor, "host", None)):
        files = getattr(candidate, "files", None)
        if isinstance(files, SftpFiles):
            return files
    return None


async def _carry_as_users(
    host: CarryHost,
    source: RunRecord,
    name: str,
    executor: Executor,
    dest: str,
    into: RunRecord | None,
    retrieved: Path,
    on_this_machine: bool,
    dest_here: bool,
) -> Manifest | None:
    """A carry with an end on this machine: the source read as its run's owner (the copy obd
    retrieved of a pod's outputs, the daemon's own, as the daemon), the destination written as
    the new run's owner, by the helper of carry_local.py; SFTP for the end that is an SSH host or
    a pod (its configured account). What arrived, checked; None where no helper serves (an end
    that is neither this machine nor SFTP): the carry goes on through the daemon's stage."""
    from executors.remote import EXCLUDED_NAMES

    excluded = sorted(EXCLUDED_NAMES)
    targets = host.targets
    src_here = retrieved.is_dir() or on_this_machine
    src_path = str(retrieved) if retrieved.is_dir() else rundir.RunPaths(source.remote_dir).in_output(name)
    src_who = Who(None, "the daemon's own user") if retrieved.is_dir() else who_owns(source.owner_uid)
    dst_who = who_owns(into.owner_uid if into is not None else None)
    source_executor = targets.executor(source) if not retrieved.is_dir() else None
    src_python = await source_executor.python() if source_executor is not None and on_this_machine else sys.executable
    dst_python = await executor.python()
    if src_here and dest_here:
        if src_python == sys.executable and dst_who.account is not None:
            src_python = dst_python  # the retrieved copy read by the daemon, with the Python the user runs
        written = await anyio.to_thread.run_sync(
            local_to_local, src_python, src_path, src_who, dst_python, dest, dst_who, excluded
        )
        _show(host, into, sum(s for s, _ in written.values()), None)
        arrived = await anyio.to_thread.run_sync(listing, dst_python, dest, dst_who, LISTING, excluded)
        if bad := differences(written, arrived):
            raise CarryFailed(_refusal(source, name, f"the copy on target {executor.name}", bad))
        return written
    if src_here:  # to an SSH host or a pod
        files = sftp_of(executor)
        if files is None:
            return None
        sent: Manifest = {}
        began, done = time.monotonic(), 0
        _show(host, into, 0, None)
        async for path, size, mode, chunks in pack_stream(src_python, src_path, src_who, excluded):

            async def counted(
                chunks: AsyncIterator[bytes] = chunks, path: str = path, size: int = size
            ) -> AsyncIterator[bytes]:
                nonlocal done
                digest = hashlib.sha256()
                async for chunk in chunks:
                    digest.update(chunk)
                    done += len(chunk)
                    _show(host, into, done, began)
                    yield chunk
                sent[path] = (size, digest.hexdigest())

            await files.write_from(f"{dest}/{path}", counted(), mode)
        if not sent:
            raise CarryFailed(f"{src_path} of run {source.id} holds no file to carry")
        _show(host, into, done, began, last=True)
    else:  # from an SSH host or a pod, to this machine
        assert source_executor is not None
        files = sftp_of(source_executor)
        if files is None:
            return None
        where = rundir.RunPaths(source.remote_dir).in_output(name)
        sent = await manifest_there(source_executor, where)  # what the source holds
        if not sent:
            raise CarryFailed(f"{where} of run {source.id} holds no file to carry")
        began, done = time.monotonic(), 0
        _show(host, into, 0, None)
        async with Unpacker(dst_python, dest, dst_who) as unpacker:
            for path, (size, _) in sorted(sent.items()):

                async def feed(sink: Any, path: str = path) -> None:
                    async def counted(chunk: bytes) -> None:
                        nonlocal done
                        done += len(chunk)
                        _show(host, into, done, began)
                        await sink(chunk)

                    await files.read_into(f"{where}/{path}", counted)

                await unpacker.send(path, size, 0o600, feed)
            written = await unpacker.finish()
        _show(host, into, done, began, last=True)
        if bad := differences(sent, written):
            raise CarryFailed(_refusal(source, name, f"the copy written on target {executor.name}", bad))
    if dest_here:
        arrived = await anyio.to_thread.run_sync(listing, dst_python, dest, dst_who, LISTING, excluded)
    else:
        arrived = await manifest_there(executor, dest)
    if bad := differences(sent, arrived):
        raise CarryFailed(_refusal(source, name, f"the copy on target {executor.name}", bad))
    return sent


def _show(host: CarryHost, into: RunRecord | None, done: int, began: float | None, last: bool = False) -> None:
    """What arrived so far on `into`'s progress (bytes, and the rate), at most a few times a second;
    `last`: the whole carry's figure, shown whenever it comes (a carry quicker than a showing's
    interval shows it all the same)."""
    if into is None:
        return
    now = time.monotonic()
    if not last and began is not None and now - getattr(into, "_carry_shown", 0.0) < PROGRESS_EVERY / 4:
        return
    object.__setattr__(into, "_carry_shown", now)
    into.progress.carry_bytes = done
    into.progress.carry_total = max(done, into.progress.carry_total or 0)
    if began is not None:
        into.progress.carry_rate = round(done / max(now - began, 1e-6), 1)
    host.touch(into)


def _refusal(source: RunRecord, name: str, which: str, bad: list[str]) -> str:
    more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
    return (
        f"{name} of run {source.id} did not arrive whole ({which}: {'; '.join(bad[:5])}{more}), so the job was not "
        f"started; nothing was deleted on target {source.target}, where the run stays resumable: "
        f"`obd train resume {source.id} --target TARGET` tries again"
    )
