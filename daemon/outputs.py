"""`obd train outputs`: copy a run's outputs into a directory of the caller's (standard library only).

The client copies them itself, as the user who runs it, so the copy is theirs; files are hard
linked where the filesystem allows (same device, and theirs), else copied. A directory that
exists and is not empty is never written into, and symbolic links are never followed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
from pathlib import Path
from typing import Any

CHECKPOINT_PREFIX = "checkpoint-"


class OutputsError(Exception):
    pass


def pick_source(reply: dict[str, Any], which: str | None) -> tuple[Path, set[str]]:
    """The directory to copy and the names to leave out of it, for `--checkpoint WHICH`."""
    output = Path(reply["output"])
    checkpoints: list[str] = reply.get("checkpoints") or []
    if which is None:
        return output, set()
    if which == "final":
        return output, {n for n in _names(output) if n.startswith(CHECKPOINT_PREFIX)}
    if which == "latest":
        if not checkpoints:
            raise OutputsError(f"run {reply['id']} has no checkpoint (its output is {output})")
        newest = max(checkpoints, key=lambda n: int(n[len(CHECKPOINT_PREFIX) :]))
        return output / newest, set()
    if which.isdigit():
        name = f"{CHECKPOINT_PREFIX}{int(which)}"
        if name not in checkpoints:
            have = ", ".join(checkpoints) or "none"
            raise OutputsError(f"run {reply['id']} has no {name} (it has: {have})")
        return output / name, set()
    raise OutputsError(f"--checkpoint {which!r}: use latest, a step number, or final")


def _names(path: Path) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def copy_tree(src: Path, dest: Path, leave_out: set[str]) -> tuple[int, int, list[str]]:
    """Copy src into dest (hard links where possible): (files, bytes, links skipped)."""
    files = size = 0
    skipped: list[str] = []
    for root, dirs, found in os.walk(src):
        rel = Path(root).relative_to(src)
        top = rel == Path(".")
        if top:
            dirs[:] = [d for d in dirs if d not in leave_out]
        names = [n for n in found if not (top and n in leave_out)]
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in [*names, *[d for d in dirs if (Path(root) / d).is_symlink()]]:
            path = Path(root) / name
            if path.is_symlink():
                skipped.append(str(rel / name))
                continue
            target = dest / rel / name
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
            files += 1
            size += path.stat().st_size
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
    return files, size, skipped


def copy_outputs(reply: dict[str, Any], to: str | None, which: str | None, as_json: bool) -> int:
    """Copy the outputs as `obd train outputs` does; root copying another user's run does it as
    that user (see `_as_owner`)."""
    owner = reply.get("owner_uid")
    if os.geteuid() == 0 and isinstance(owner, int) and owner != 0:
        return _as_owner(owner, lambda: _copy_outputs(reply, to, which, as_json))
    return _copy_outputs(reply, to, which, as_json)


def _as_owner(uid: int, copy: Any) -> int:
    """Run `copy` in a child that is the run's owner for good: a run's files are as hostile as
    their owner, so root never reads through a link of theirs or writes through one (`--to`)."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        print(f"obd: the run's owner (uid {uid}) has no account here; copy its files by hand", file=sys.stderr)
        return 1
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.initgroups(pw.pw_name, pw.pw_gid)
            os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
            os.setresuid(uid, uid, uid)
            code = copy()
            if code != 0:
                print(
                    f"obd: root copies a run of {pw.pw_name}'s as {pw.pw_name}, so --to must be a directory "
                    f"{pw.pw_name} can write (copy on from there as root if you need them elsewhere)",
                    file=sys.stderr,
                )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _copy_outputs(reply: dict[str, Any], to: str | None, which: str | None, as_json: bool) -> int:
    try:
        src, leave_out = pick_source(reply, which)
        if not src.is_dir():
            raise OutputsError(f"run {reply['id']} has no outputs yet ({reply['state']}); nothing in {src}")
        dest = Path(to or (reply.get("name") or reply["id"])).resolve()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise OutputsError(f"{dest} exists and is not empty: choose a new directory with --to")
        dest.mkdir(parents=True, exist_ok=True)
        files, size, skipped = copy_tree(src, dest, leave_out)
    except PermissionError as exc:
        print(f"obd: cannot copy the outputs of run {reply['id']}: {exc}", file=sys.stderr)
        return 1
    except OutputsError as exc:
        print(f"obd: {exc}", file=sys.stderr)
        return 1
    result = {
        "id": reply["id"],
        "from": str(src),
        "to": str(dest),
        "files": files,
        "bytes": size,
        "skipped_links": skipped,
    }
    if as_json:
        print(json.dumps(result))
    else:
        print(f"{files} files ({size / 1e6:.1f} MB) of run {reply['id']} in {dest}")
        for link in skipped:
            print(f"  skipped (a symbolic link): {link}")
    return 0
