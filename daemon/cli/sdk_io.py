"""What the Python API does on its own rather than by a request: `Run.outputs`'s copy (as the
run's owner when root copies a user's run) and `Run.exec`'s session, which takes a connection
of its own over (docs/exec-and-shell.md). Shared by the sync and the async clients.

Standard library only.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from daemon.cli import client as wire_client
from daemon.cli.sdk_results import (
    BadRequest,
    DaemonUnreachable,
    ExecResult,
    ObdError,
    Outputs,
    RequestFailed,
    error_for,
)
from daemon.common.wire import MAX_MESSAGE


def copy_outputs(reply: Mapping[str, Any], to: str | os.PathLike[str] | None, which: str | int | None) -> Outputs:
    """`obd train outputs`: the run's output/ (or one checkpoint of it) copied into `to` (new or
    empty; default ./<name or id>), hard links where the filesystem allows. Root copying another
    user's run copies as that user, in a child process, as the command does."""
    owner = reply.get("owner_uid")
    if os.geteuid() == 0 and isinstance(owner, int) and owner != 0:
        return _as_owner(owner, lambda: _copy(reply, to, which))
    return _copy(reply, to, which)


def _copy(reply: Mapping[str, Any], to: str | os.PathLike[str] | None, which: str | int | None) -> Outputs:
    from daemon.cli.outputs import OutputsError, copy_tree, pick_source

    try:
        src, leave_out = pick_source(dict(reply), None if which is None else str(which))
        if not src.is_dir():
            raise OutputsError(f"run {reply['id']} has no outputs yet ({reply['state']}); nothing in {src}")
        dest = Path(to if to is not None else (reply.get("name") or reply["id"])).resolve()
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise OutputsError(f"{dest} exists and is not empty: choose a new directory with to=")
        dest.mkdir(parents=True, exist_ok=True)
        files, size, skipped = copy_tree(src, dest, leave_out)
    except (OutputsError, PermissionError) as exc:
        raise RequestFailed(f"cannot copy the outputs of run {reply['id']}: {exc}", "outputs") from None
    return Outputs(str(reply["id"]), src, dest, files, size, tuple(skipped))


def _as_owner(uid: int, copy: Callable[[], Outputs]) -> Outputs:
    """`copy` in a child that is the run's owner for good; its result back through a pipe."""
    import pwd

    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        raise RequestFailed(f"the run's owner (uid {uid}) has no account here; copy its files by hand") from None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            os.initgroups(pw.pw_name, pw.pw_gid)
            os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
            os.setresuid(uid, uid, uid)
            answer: dict[str, Any]
            try:
                done = copy()
                answer = {"ok": {**dataclasses.asdict(done), "source": str(done.source), "to": str(done.to)}}
            except ObdError as exc:
                answer = {"error": str(exc)}
            os.write(write_end, json.dumps(answer).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    answer = json.loads(data or b'{"error": "the copy as the run\'s owner ended with no answer"}')
    if "error" in answer:
        raise RequestFailed(f"{answer['error']} (root copies a run of {pw.pw_name}'s as {pw.pw_name})", "outputs")
    done = answer["ok"]
    return Outputs(
        done["id"], Path(done["source"]), Path(done["to"]), done["files"], done["bytes"], tuple(done["skipped_links"])
    )


# --- a command in a run (`obd train exec`) ------------------------------------------------------

EXEC_CHUNK = 65536  # the most of `input` sent in one message


def exec_frames(run_id: str, command: Sequence[str] | str, input: bytes | None) -> bytes:
    """The `exec` request (docs/exec-and-shell.md: no terminal), then `input` and its end, as
    the lines the daemon reads."""
    import shlex

    words = shlex.split(command) if isinstance(command, str) else [str(word) for word in command]
    if not words:
        raise BadRequest("exec(): no command: give one (a list of words or a string)", "usage")
    request = {"op": "exec", "id": run_id, "command": words, "tty": False, "term": "dumb", "rows": 24, "cols": 80}
    first = json.dumps(request).encode() + b"\n"
    if len(first) > MAX_MESSAGE:
        raise BadRequest(
            f"exec(): the command is over the daemon's limit of {MAX_MESSAGE >> 10} KiB; put it in a script"
        )
    data = input or b""
    chunks = (data[i : i + EXEC_CHUNK] for i in range(0, len(data), EXEC_CHUNK))
    rest = [{"in": base64.b64encode(chunk).decode()} for chunk in chunks] + [{"eof": True}]
    return first + b"".join(json.dumps(frame).encode() + b"\n" for frame in rest)


class ExecOutput:
    """The daemon's frames of one command, gathered: its output, then its exit status."""

    def __init__(self) -> None:
        self.buf = b""
        self.out = bytearray()
        self.err = bytearray()

    def feed(self, chunk: bytes) -> ExecResult | None:
        """The result once the exit status came; an error the daemon answered is raised."""
        if not chunk:
            raise DaemonUnreachable("the daemon closed the connection before the command ended; check its log")
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            frame = json.loads(line)
            if "out" in frame:
                self.out += base64.b64decode(frame["out"])
            elif "err" in frame:
                self.err += base64.b64decode(frame["err"])
            elif "exit" in frame:
                return ExecResult(int(frame["exit"]), bytes(self.out), bytes(self.err))
            elif frame.get("ok") is False:
                raise error_for(str(frame.get("error", "unknown error")), str(frame.get("kind", "error")))
        return None


def exec_in_run(
    path: Path, run_id: str, command: Sequence[str] | str, input: bytes | None, timeout: float | None
) -> ExecResult:
    """`obd train exec RUN -- COMMAND` on a connection of its own (the op takes it over)."""
    import contextlib
    import socket

    frames = exec_frames(run_id, command, input)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise DaemonUnreachable(wire_client.unreachable_message(path, exc), "unreachable") from None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused: its answer is read
            sock.sendall(frames)
        gathered = ExecOutput()
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except TimeoutError:
                raise ObdError(
                    f"exec(): the command ran over its timeout of {timeout} s; it was ended", "timeout"
                ) from None
            done = gathered.feed(chunk)
            if done is not None:
                return done
    finally:
        sock.close()  # a command still running there is hung up on, and ended
