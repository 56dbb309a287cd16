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
import stat
import sys
from pathlib import Path
from typing import Any

from trainer_plugin import rundir

CHECKPOINT_PREFIX = "checkpoint-"
# A checkpoint's trainer_state.json is read for its max_steps only up to this size (its log
# history grows with the run); past it the total is left unsaid.
STATE_READ_LIMIT = 8 * 1024 * 1024


class OutputsError(Exception):
    pass


def pick_source(reply: dict[str, Any], which: str | None) -> tuple[Path, set[str]]:
    """The directory to copy and the names to leave out of it, for `--checkpoint WHICH`."""
    output = Path(reply["output"])
    checkpoints: list[str] = reply.get("checkpoints") or []
    if which is None:
        return output, set()
    if which == "final":
        stopped = stopped_text(reply)
        if stopped:
            # Whatever the script saved after its train() (nothing, under obd's plugin) is a
            # half-trained model: never handed over as the run's final output.
            rid = reply["id"]
            step = (reply.get("snapshot") or {}).get("step")
            snapshot = f"`obd train outputs {rid} --checkpoint {step}`" if step is not None else "`--checkpoint latest`"
            raise OutputsError(
                f"run {rid} {stopped}: `obd train resume {rid}` trains it to the end, then `obd train outputs "
                f"<that run> --checkpoint final` copies its final model. This run has no final model, only its "
                f"snapshot: {snapshot} copies that"
            )
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


def stopped_text(reply: dict[str, Any]) -> str | None:
    """The words "stopped at step N of M; resume to finish" for a run that stopped for a snapshot, else None.

    Such a run (state `stopped`, or any run with a proven snapshot) ended before its last step:
    its outputs are a partial run's. M comes from the reply's progress when it carries one,
    else from the snapshot's own `trainer_state.json`; left out when neither says.
    """
    snapshot = reply.get("snapshot") or {}
    if reply.get("state") != "stopped" and not snapshot:
        return None
    step = snapshot.get("step")
    if not isinstance(step, int):
        return "stopped before its last step; resume to finish"
    total = (reply.get("progress") or {}).get("max_steps")
    if not isinstance(total, int):
        total = _max_steps(Path(reply["output"]) / f"{CHECKPOINT_PREFIX}{step}")
    of = f" of {total}" if total else ""
    return f"stopped at step {step}{of}; resume to finish"


def _max_steps(checkpoint: Path) -> int | None:
    """`max_steps` of a Trainer checkpoint's trainer_state.json (a custom loop's has none): None when unknown."""
    try:
        # Never through a link, never blocked by a FIFO planted there: only a regular file is read.
        fd = os.open(checkpoint / "trainer_state.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = f.read(STATE_READ_LIMIT + 1)
        if len(data) > STATE_READ_LIMIT:
            return None
        state = rundir.load_json(data)
        value = state.get("max_steps") if isinstance(state, dict) else None
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


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
        stopped = stopped_text(reply)
        if stopped:
            print(
                f"  run {reply['id']} {stopped} (`obd train resume {reply['id']}`): "
                "these are its checkpoints, not a final model"
            )
    return 0
