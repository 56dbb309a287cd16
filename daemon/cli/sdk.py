# Over 600 lines on purpose: the Python API's one public surface (Client, Run, Sweep), each method
# a few lines over steps shared with the async client (aio.py); results and I/O are apart already.
"""The Python API (`from obd import Client`): what the `obd` command does, from a program.

    from obd import Client

    with Client() as obd:
        run = obd.start(["python", "train.py", "--lr", "2e-4"], name="sft", gpus=2)
        run.wait("running")
        run.stop(wait=True)           # a snapshot at the end of the step, then stopped
        again = run.resume()
        for line in again.logs(follow=True):
            print(line)

Same socket protocol as the command, same options (`start`'s keywords are the run file's keys,
docs/run-file.md, checked by the same code), same errors: each exception carries the exit code
`obd` gives for it (`exit_code`). `AsyncClient` (daemon/cli/aio.py) is the same API for async
code, over the same socket.

Results are small frozen dataclasses (`RunStatus`, `Progress`, `Snapshot`, `Outputs`) made from
the record the daemon sends, which each keeps whole as `.record` for the fields they do not name:
the client may not import pydantic (the service's models, daemon/service/models.py), and a dataclass of
the standard library costs nothing at import.

What the sync and the async clients do is written once, here, as generators that yield the
requests they need (`_Call`), the pauses (`_Sleep`) and, for logs, the lines (`_Emit`); each
client runs them with its own socket and its own sleep. Standard library only.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from daemon.cli import client as wire_client
from daemon.cli.common import (
    EXIT_CANCELLED,
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_NO_PLUGIN,
    EXIT_NO_SNAPSHOT,
    LOCAL_TARGET,
    RECONNECT_FOR,
    STATE_EXIT,
    reaches_this_machine,
)
from daemon.cli.sdk_io import copy_outputs, exec_in_run
from daemon.cli.sdk_results import (
    BadRequest,
    DaemonBusy,
    DaemonUnreachable,
    ExecResult,
    Outputs,
    RequestFailed,
    RunError,
    RunStatus,
    SweepStarted,
    WaitTimeout,
    translated,
)
from daemon.common.wire import FINAL, MAX_OFFSET, READ_LIMIT, STATES

T = TypeVar("T")

# --- what the clients do, as steps ----------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """A request; `patient` ones wait out a daemon restart (up to RECONNECT_FOR) and a target
    that does not answer, as the command's waits do."""

    op: str
    params: dict[str, Any]
    patient: bool = False


@dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclass(frozen=True)
class _Emit:
    value: Any


Step = _Call | _Sleep | _Emit
Steps = Generator[Step, Any, T]


def patience(error: Exception, lost_since: float | None, now: float) -> bool:
    """Whether a patient call goes on after `error`: a daemon that went away (a restart) for up to
    RECONNECT_FOR, a target that does not answer for as long as it takes."""
    if isinstance(error, DaemonUnreachable | DaemonBusy):
        return lost_since is None or now - lost_since <= RECONNECT_FOR
    return isinstance(error, RequestFailed) and error.kind == "unavailable"


def wanted_states(states: str | Iterable[str] | None, what: str = "wait") -> frozenset[str]:
    """The states a wait (or a list, `what`) asks for: one name, several, or (None) any final state."""
    if states is None:
        return FINAL
    chosen = frozenset([states] if isinstance(states, str) else states)
    unknown = sorted(chosen - set(STATES))
    if unknown or not chosen:
        given = ", ".join(map(str, unknown)) or "none given"
        raise BadRequest(f"{what}(states=...): {given}: the states are {', '.join(STATES)}")
    return chosen


def ended_text(record: Mapping[str, Any]) -> str:
    return f"run {record['id']} ended {record['state']}: {record.get('message') or 'no message'}"


def wait_steps(run_id: str, states: str | Iterable[str] | None, timeout: float | None) -> Steps[RunStatus]:
    """Until the run is in one of `states` (a RunError if it ends otherwise, a WaitTimeout after
    `timeout` seconds). Final states are awaited with the daemon's `wait` long poll; others
    (queued, running...) with its `watch` of the caller's runs."""
    wanted = wanted_states(states)
    deadline = None if timeout is None else time.monotonic() + timeout
    version = None
    if not wanted <= FINAL:
        version = (yield _Call("watch", {"since": MAX_OFFSET, "timeout": 0}, patient=True))["version"]
    record = yield _Call("wait", {"id": run_id, "timeout": 0}, patient=True)
    while True:
        if record["state"] in wanted:
            return RunStatus.of(record)
        if record["state"] in FINAL:
            status = RunStatus.of(record)
            # The command's code for how it ended; a run that succeeded instead is still an error (1).
            raise RunError(
                f"{ended_text(record)} (waited for {', '.join(sorted(wanted))})",
                status,
                STATE_EXIT.get(status.state) or EXIT_ERROR,
            )
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise WaitTimeout(
                f"run {record['id']} is still {record['state']} after {timeout:g} s "
                f"(waited for {', '.join(sorted(wanted))})",
                RunStatus.of(record),
            )
        span = 20.0 if left is None else min(20.0, left)
        if version is None:
            record = yield _Call("wait", {"id": run_id, "timeout": span}, patient=True)
            continue
        # A restarted daemon counts its versions from 0 again: a short watch notices soon.
        answer = yield _Call("watch", {"since": version, "timeout": min(span, 5.0)}, patient=True)
        version = answer["version"]
        record = yield _Call("wait", {"id": run_id, "timeout": 0}, patient=True)


def stop_steps(run_id: str, reason: str, wait: bool, timeout: float | None) -> Steps[RunStatus]:
    """`obd train stop RUN [--wait]`, recorded as asked through the API. With `wait`, the run once
    it ended; a RunError (exit code 3 or 4) unless it stopped with a snapshot."""
    record = yield _Call("stop", {"id": run_id, "reason": reason, "via": "api"})
    if not wait:
        return RunStatus.of(record)
    final = yield from wait_steps(record["id"], None, timeout)
    if final.state == "stopped" and final.snapshot is not None:
        return final
    code = EXIT_CANCELLED if final.state == "cancelled" else EXIT_NO_SNAPSHOT
    raise RunError(f"{ended_text(final.record)} (no snapshot)", final, code)


def cancel_steps(run_id: str, wait: bool, timeout: float | None) -> Steps[RunStatus]:
    """`obd train cancel RUN [--wait]`: with `wait`, the run once it ended; a RunError where the
    command exits non-zero (it ended failed or stopped before the cancel reached it)."""
    record = yield _Call("cancel", {"id": run_id})
    if not wait:
        return RunStatus.of(record)
    final = yield from wait_steps(record["id"], None, timeout)
    code = STATE_EXIT.get(final.state, EXIT_ERROR)
    if final.state != "cancelled" and code != 0:
        raise RunError(f"{ended_text(final.record)} before the cancel", final, code)
    return final


def on_this_machine_steps(target: str) -> Steps[bool]:
    """Whether a target is the daemon's own machine (whose jobs start from the caller's environment)."""
    if target == LOCAL_TARGET:
        return True
    targets = yield _Call("targets", {})
    return reaches_this_machine(target, targets)


def start_steps(
    command: Sequence[str] | str | None,
    file: str | os.PathLike[str] | None,
    options: Mapping[str, Any],
    op: str = "start",
) -> Steps[dict[str, Any]]:
    """`obd train start` (or `obd train sweep`, `op`): the run file (if any), the options over it
    as flags are, the command over both; the request made as the command makes it. The new run's
    record (a sweep's: its id and its runs)."""
    from daemon.cli import runfile

    keys = runfile.schema()
    origin = runfile.Origin("start()", Path.cwd())
    try:
        values = runfile.load(file) if file is not None else {}
        given = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in options.items()}
        if command is not None:
            given = {**given, runfile.COMMAND: command}
        values = merged(values, runfile.check(given, origin, keys, whole=False), keys)
        runfile.check_command_keys(values, origin)
    except runfile.RunFileError as exc:
        raise BadRequest(str(exc), "usage") from None
    words = runfile.command_of(values)
    if not words:
        raise BadRequest(f"{op}(): no command: give one (a list of words or a string), or a run file with one")
    params: dict[str, Any] = {"command": words, "client_cwd": os.getcwd(), "umask": _umask()}
    grid = values.get(runfile.GRID)
    if op == "sweep":
        if not grid:
            raise BadRequest("sweep(): no grid: give grid={'lr': ['1e-4', '2e-4']} or a run file with a [grid] table")
        params["grid"] = [{"name": name, "values": given} for name, given in grid.items()]
    elif grid:
        raise BadRequest("start(): a grid makes a sweep: call sweep(...) with it, not start(...)")
    for name, value in values.items():
        key = keys[name]
        if key.dest is None:
            continue
        if key.kind == runfile.ENV:
            params["env"] = dict(value)
        elif key.kind == runfile.NAMES:
            params["secrets"] = secret_values(value)
        else:
            params[key.dest] = runfile.to_argument(key, value)
    target = params.get("target", LOCAL_TARGET)
    env_clear = bool(params.get("env_clear"))
    here = False if env_clear else (yield from on_this_machine_steps(target))
    params["environ"] = dict(os.environ) if here else None
    record: dict[str, Any] = yield _Call(op, params)
    return record


def with_grid(options: Mapping[str, Any], grid: Mapping[str, Sequence[Any]] | None) -> dict[str, Any]:
    """`sweep(grid=...)` as the run file's `grid` key, which a file's [grid] is checked as."""
    return {**options, "grid": {name: list(values) for name, values in grid.items()}} if grid else dict(options)


def sweep_started(answer: Mapping[str, Any]) -> SweepStarted:
    return SweepStarted(answer["sweep"], answer["name"], tuple(run["id"] for run in answer["runs"]))


_COMMAND_KEYS = ("command", "script", "args")


def merged(values: dict[str, Any], over: dict[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    """Options over a run file's values, as flags go over it: a value replaced, a list added to,
    env set name by name."""
    from daemon.cli import runfile

    out = dict(values)
    if runfile.COMMAND in over or runfile.SCRIPT in over:  # a command replaces the file's, args included
        out = {k: v for k, v in out.items() if k not in _COMMAND_KEYS}
    for name, value in over.items():
        kind = keys[name].kind
        if kind == runfile.ENV:
            out[name] = {**out.get(name, {}), **value}
        elif kind in (runfile.NAMES, runfile.LIST):
            out[name] = list(dict.fromkeys([*out.get(name, []), *value]))
        else:
            out[name] = value
    return out


def secret_values(names: Iterable[str]) -> dict[str, str]:
    """`--secret NAME`s: each value from this process's environment, never written anywhere."""
    missing = [name for name in names if name not in os.environ]
    if missing:
        raise BadRequest(f"secrets: ${missing[0]} is not set in this process's environment", "usage")
    return {name: os.environ[name] for name in names}


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def resume_steps(
    run_id: str,
    checkpoint: str | int | None,
    command: Sequence[str] | None,
    env: Mapping[str, str] | None,
    secrets: Iterable[str],
    env_clear: bool,
    retry: int | None,
    target: str | None = None,
    gpus: str | int | None = None,
) -> Steps[dict[str, Any]]:
    """`obd train resume RUN`: a new run like RUN from its snapshot (or `checkpoint`), with this
    process's environment, env and secrets (RUN's values are not kept); on `target`, with `gpus`,
    when given. The new run's record."""
    source = yield _Call("wait", {"id": run_id, "timeout": 0})
    where = target or source.get("target", LOCAL_TARGET)
    here = False if env_clear else (yield from on_this_machine_steps(where))
    params = {
        "id": run_id,
        "target": target,
        "gpus": None if gpus is None else str(gpus),
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "command": list(command) if command else None,
        "env": dict(env) if env else None,
        "secrets": secret_values(secrets),
        "environ": dict(os.environ) if here else None,
        "env_clear": env_clear,
        "umask": _umask(),
        "retry": retry,
    }
    record: dict[str, Any] = yield _Call("resume", params)
    return record


def move_steps(
    run_id: str,
    to: str,
    gpus: str | int | None,
    env: Mapping[str, str] | None,
    secrets: Iterable[str],
    env_clear: bool,
    wait: bool,
) -> Steps[dict[str, Any]]:
    """`obd train move RUN --to T [--wait]`: the moved run's record; with `wait`, the record of
    the run that continues it on T once it trained a step there, else a RunError (exit code 4:
    no snapshot came, nothing moved; 6: the carry or the start failed, the run stays resumable;
    7: its job never loaded obd's plugin)."""
    here = False if env_clear else (yield from on_this_machine_steps(to))
    params = {
        "id": run_id,
        "to": to,
        "gpus": None if gpus is None else str(gpus),
        "env": dict(env) if env else None,
        "secrets": secret_values(secrets),
        "environ": dict(os.environ) if here else None,
        "env_clear": env_clear,
        "umask": _umask(),
        "via": "api",
    }
    record: dict[str, Any] = yield _Call("move", params)
    if not wait:
        return record
    if (record.get("stop") or {}).get("no_plugin"):
        raise RunError(f"run {record['id']}: {record['stop']['no_plugin']}", RunStatus.of(record), EXIT_NO_PLUGIN)
    while True:
        move = record.get("move") or {}
        if move.get("state") == "done":
            new: dict[str, Any] = yield _Call("wait", {"id": move["run"], "timeout": 0})
            return new
        if move.get("state") == "failed":
            code = EXIT_FAILED if record["state"] == "stopped" and record.get("snapshot") else EXIT_NO_SNAPSHOT
            raise RunError(
                f"the move of {record['id']} to target {to} failed: {move.get('why')}", RunStatus.of(record), code
            )
        if move.get("run"):  # a wait on the new run blocks while it is not final
            yield _Call("wait", {"id": move["run"], "timeout": 1.0})
        elif record["state"] in FINAL:
            yield _Sleep(0.2)  # the async client's event loop goes on meanwhile
        record = yield _Call("wait", {"id": record["id"], "timeout": 1.0})


def logs_steps(run_id: str, follow: bool, tail: int | None) -> Steps[None]:
    """The lines of the run's job.log (each without its newline); with `follow`, until the run
    ended and its last line was read, as `obd train logs --follow`."""
    first = {"tail_lines": tail} if tail is not None else {}
    reply = yield _Call("read", {"id": run_id, "offset": 0, "limit": READ_LIMIT, **first}, patient=True)
    pending = b""
    while True:
        data = base64.b64decode(reply.get("data", ""))
        if data:
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                yield _Emit(line.decode("utf-8", "replace"))
        offset = reply.get("next", reply.get("offset", 0))
        if not follow:
            if len(data) < READ_LIMIT:
                break
        elif not data:
            if reply.get("state") in FINAL:
                # One more read: the job may have written its last lines before it ended.
                reply = yield _Call("read", {"id": run_id, "offset": offset, "limit": READ_LIMIT}, patient=True)
                if not reply.get("data"):
                    break
                continue
            yield _Sleep(0.25)
        reply = yield _Call("read", {"id": run_id, "offset": offset, "limit": READ_LIMIT}, patient=True)
    if pending:
        yield _Emit(pending.decode("utf-8", "replace"))


def list_params(
    all: bool,
    states: str | Iterable[str] | None,
    target: str | None,
    name: str | None,
    since: float | str | None,
    limit: int | None,
) -> dict[str, Any]:
    """`obd train list`'s filters as the request takes them (`since`: unix time, or 2h, 3d, a date)."""
    params: dict[str, Any] = {"all": all}
    if states is not None:
        params["states"] = sorted(wanted_states(states, "runs"))
    if isinstance(since, str):
        import argparse

        from daemon.cli.parser import since_time

        try:
            since = since_time(since)
        except argparse.ArgumentTypeError as exc:
            raise BadRequest(f"runs(since=...): {exc}") from None
    for key, value in (("target", target), ("name", name), ("since", since), ("limit", limit)):
        if value is not None:
            params[key] = value
    return params


# --- the sync client ------------------------------------------------------------------------------


def default_socket(socket: str | os.PathLike[str] | None) -> Path:
    """The socket as the command finds it: this one, else OBD_SOCKET, the config's, the default."""
    from daemon.common.paths import client_socket

    return client_socket(os.fspath(socket) if socket is not None else None)


class Client:
    """A connection to the obd daemon (one socket, kept between calls; not for several threads at once).

    `socket`: the daemon's control socket; by default found as `obd` finds it (OBD_SOCKET, the
    config's `socket`, STATE_DIR/obd.sock). Usable as a context manager, which closes it.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, timeout: float = 120.0) -> None:
        self.socket = default_socket(socket)
        self._wire = wire_client.Client(self.socket, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self._wire.close()

    # --- the steps, run here

    def _call(self, call: _Call) -> Any:
        lost_since: float | None = None
        while True:
            try:
                return self._wire.call(call.op, **call.params)
            except (wire_client.DaemonUnreachable, wire_client.DaemonBusy, wire_client.RequestFailed) as exc:
                error = translated(exc)
                now = time.monotonic()
                if not call.patient or not patience(error, lost_since, now):
                    raise error from None
                if isinstance(error, DaemonUnreachable | DaemonBusy):
                    lost_since = lost_since or now
            except BaseException:
                # Interrupted mid-request (Ctrl-C in a notebook, a signal's exception): its reply
                # may still come and would be read as the next request's; a fresh connection instead.
                self._wire.close()
                raise
            time.sleep(0.5)

    def _run(self, steps: Steps[T]) -> T:
        try:
            step = next(steps)
            while True:
                step = steps.send(self._do(step))
        except StopIteration as done:
            return done.value

    def _iterate(self, steps: Steps[None]) -> Iterator[Any]:
        try:
            step = next(steps)
            while True:
                if isinstance(step, _Emit):
                    yield step.value
                    step = next(steps)
                else:
                    step = steps.send(self._do(step))
        except StopIteration:
            return
        finally:
            steps.close()

    def _do(self, step: Step) -> Any:
        if isinstance(step, _Call):
            return self._call(step)
        if isinstance(step, _Sleep):
            time.sleep(step.seconds)
            return None
        raise TypeError(f"a step no client runs here: {step!r}")

    # --- the API

    def start(
        self,
        command: Sequence[str] | str | None = None,
        *,
        file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> Run:
        """Start a run of `command` (a list of words, or a string split as a shell would); the
        options are the run file's keys (docs/run-file.md: target, name, cwd, env, secrets, gpus,
        priority, preemptible, retry, profile, output_to, resume_from, checkpoint...). With
        `file`, a run file's, which the options and the command override."""
        return Run(self, self._run(start_steps(command, file, options)))

    def sweep(
        self,
        command: Sequence[str] | str | None = None,
        *,
        grid: Mapping[str, Sequence[Any]] | None = None,
        file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> SweepStarted:
        """`obd train sweep`: one run per combination of `grid` ({NAME: values}, over a run
        file's [grid]), each with {NAME} in its command replaced by its value."""
        return sweep_started(self._run(start_steps(command, file, with_grid(options, grid), "sweep")))

    def run(self, ref: str) -> Run:
        """The run `ref` names now: an id, a unique prefix of one, a name (its newest run), or `last`."""
        return Run(self, self._call(_Call("wait", {"id": ref, "timeout": 0})))

    def runs(
        self,
        all: bool = False,
        states: str | Iterable[str] | None = None,
        target: str | None = None,
        name: str | None = None,
        since: float | str | None = None,
        limit: int | None = None,
    ) -> list[RunStatus]:
        """`obd train list`: by default your active runs and the 10 most recent that ended."""
        return [
            RunStatus.of(r) for r in self._call(_Call("list", list_params(all, states, target, name, since, limit)))
        ]

    def targets(self) -> list[dict[str, Any]]:
        """The daemon's targets, with their GPUs and what holds each (`obd targets list --json`)."""
        found: list[dict[str, Any]] = self._call(_Call("targets", {}))
        return found


class Run:
    """One run, by its id; each method asks the daemon (nothing is cached but the id)."""

    def __init__(self, client: Client, record: Mapping[str, Any]) -> None:
        self.client = client
        self.id: str = record["id"]
        self.name: str | None = record.get("name")

    def __repr__(self) -> str:
        return f"Run({self.id!r})"

    def status(self) -> RunStatus:
        """`obd train status`: its state, progress, snapshot..."""
        return RunStatus.of(self.client._call(_Call("status", {"id": self.id})))

    def wait(self, states: str | Iterable[str] | None = None, timeout: float | None = None) -> RunStatus:
        """Until it is in one of `states` (default: any final state). A RunError when it ends in
        another (its exit_code that state's), a WaitTimeout after `timeout` seconds."""
        return self.client._run(wait_steps(self.id, states, timeout))

    def stop(self, wait: bool = False, reason: str = "requested", timeout: float | None = None) -> RunStatus:
        """Ask for a snapshot at the end of its step, then stop (recorded as asked through the API).
        With `wait`: once it ended; a RunError (3 or 4) unless it stopped with a snapshot."""
        return self.client._run(stop_steps(self.id, reason, wait, timeout))

    def cancel(self, wait: bool = False, timeout: float | None = None) -> RunStatus:
        """End it now: TERM to its processes, KILL after the grace; a queued run leaves the queue."""
        return self.client._run(cancel_steps(self.id, wait, timeout))

    def resume(
        self,
        checkpoint: str | int | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Iterable[str] = (),
        env_clear: bool = False,
        retry: int | None = None,
        target: str | None = None,
        gpus: str | int | None = None,
    ) -> Run:
        """A new run like this one from its snapshot (or `checkpoint`: latest, a step, a path); on
        `target` (its checkpoint carried there, verified) with `gpus`, when given."""
        steps = resume_steps(self.id, checkpoint, command, env, secrets, env_clear, retry, target, gpus)
        return Run(self.client, self.client._run(steps))

    def move(
        self,
        to: str,
        gpus: str | int | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Iterable[str] = (),
        env_clear: bool = False,
        wait: bool = False,
    ) -> Run:
        """Move this running run to target `to` (`obd train move`): a snapshot here, its checkpoint
        carried and verified there, and the training continued as a new run. Without `wait`, this
        run (its `status()["move"]` says where the move stands); with `wait`, the new run once it
        trained a step there, else a RunError (4: no snapshot came; 6: the carry or start failed,
        this run stays resumable where it was)."""
        record = self.client._run(move_steps(self.id, to, gpus, env, secrets, env_clear, wait))
        return Run(self.client, record) if wait else self

    def logs(self, follow: bool = False, tail: int | None = None) -> Iterator[str]:
        """Its job.log's lines, each without its newline; `follow`: until it ended; `tail`: from the last N."""
        return self.client._iterate(logs_steps(self.id, follow, tail))

    def metrics(self) -> dict[str, Any] | None:
        """Its RunMetrics (docs/contract.md) as a dict, once a profiled run ended; else None."""
        found: dict[str, Any] | None = self.client._call(_Call("metrics", {"id": self.id})).get("metrics")
        return found

    def outputs(self, to: str | os.PathLike[str] | None = None, checkpoint: str | int | None = None) -> Outputs:
        """Copy its output/ (or a checkpoint: latest, a step, final) into `to`, a new or empty directory."""
        return copy_outputs(self.client._call(_Call("outputs", {"id": self.id})), to, checkpoint)

    def exec(
        self, command: Sequence[str] | str, input: bytes | None = None, timeout: float | None = None
    ) -> ExecResult:
        """`obd train exec`: run `command` where its job runs (its target, as its user, in its run
        directory, with its GPUs visible), `input` on its stdin; its exit status and output. Only
        a running run, by its owner or root (docs/exec-and-shell.md). After `timeout` seconds
        the command is ended and an ObdError raised."""
        return exec_in_run(self.client.socket, self.id, command, input, timeout)

    def prune(self, keep: int | None = None) -> dict[str, Any]:
        """`obd train prune`: delete its chain's older checkpoints now, keeping the newest `keep`
        complete ones (default: its keep_checkpoints) and any a resume needs (docs/checkpoints.md);
        what was removed (run, name, bytes), kept (and why), `freed` in bytes, and `errors`."""
        found: dict[str, Any] = self.client._call(_Call("prune", {"id": self.id, "keep": keep}))
        return found
