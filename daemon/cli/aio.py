"""The Python API for async code (`from obd import AsyncClient`): `Client`'s methods as coroutines,
over the same socket protocol, on anyio (so under asyncio or trio).

It is the one module of the client that imports anyio, named in the client's import contract
(pyproject.toml): the `obd` command never imports it, and `import obd` does not either; only
asking for `obd.AsyncClient` does. What it does is daemon/cli/sdk.py's steps, run here with an
anyio socket and anyio's sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from daemon.cli import sdk, sdk_io, sdk_results
from daemon.cli.client import BUSY_RETRY_FOR, IDEMPOTENT, MAX_REPLY, decode, unreachable_message
from daemon.common.wire import MAX_MESSAGE

T = TypeVar("T")


class _Closed(Exception):
    """The connection closed before a reply came."""


class _Connection:
    """One connection to the daemon, kept between calls; one request at a time on it (a lock), as
    the daemon answers a connection's requests in order. Busy answers are retried for a while,
    and a request that cannot act twice is sent again on a fresh connection when the daemon had
    closed the idle one (as daemon/cli/client.py does)."""

    def __init__(self, path: Path, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._stream: SocketStream | None = None
        self._reader: BufferedByteReceiveStream | None = None
        self._lock = anyio.Lock()

    async def call(self, op: str, **params: Any) -> Any:
        line = json.dumps({"op": op, **params}).encode() + b"\n"
        if len(line) > MAX_MESSAGE:
            raise sdk_results.BadRequest(
                f"the request is {len(line) >> 10} KiB, over the daemon's limit of {MAX_MESSAGE >> 10} KiB "
                "(large env values?); pass large values in a file instead",
                "too_large",
            )
        async with self._lock:
            deadline = time.monotonic() + BUSY_RETRY_FOR
            reused = self._stream is not None
            while True:
                try:
                    reply = await self._exchange(line)
                except _Closed as exc:
                    if reused and op in IDEMPOTENT:
                        reused = False
                        continue
                    raise sdk_results.DaemonUnreachable(
                        f"obd: the daemon closed the connection ({exc}); check its log", "unreachable"
                    ) from None
                decoded = decode(reply)
                if decoded.get("kind") == "busy" and not decoded.get("ok"):
                    await self.aclose()
                    if time.monotonic() >= deadline:
                        raise sdk_results.DaemonBusy(
                            f"obd: the daemon at {self.path} is busy with other callers: {decoded.get('error')}; "
                            "retry in a moment",
                            "busy",
                        )
                    await anyio.sleep(0.2)
                    continue
                break
        if not decoded.get("ok"):
            raise sdk_results.error_for(decoded.get("error", "unknown error"), decoded.get("kind", "error"))
        return decoded.get("result")

    async def _exchange(self, line: bytes) -> bytes:
        if self._stream is None:
            try:
                self._stream = await anyio.connect_unix(self.path)
            except OSError as exc:
                raise sdk_results.DaemonUnreachable(unreachable_message(self.path, exc), "unreachable") from None
            self._reader = BufferedByteReceiveStream(self._stream)
        stream, reader = self._stream, self._reader
        assert reader is not None
        try:
            with anyio.fail_after(self.timeout):
                # The daemon may have answered already (busy, too large): read what it said.
                with contextlib.suppress(anyio.BrokenResourceError, BrokenPipeError, ConnectionResetError):
                    await stream.send(line)
                return await reader.receive_until(b"\n", MAX_REPLY)
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError) as exc:
            await self.aclose()
            raise _Closed(str(exc) or "no reply") from None
        except anyio.DelimiterNotFound:
            await self.aclose()
            raise sdk_results.DaemonUnreachable("obd: the daemon's reply is too large", "unreachable") from None
        except TimeoutError:
            await self.aclose()
            raise sdk_results.DaemonUnreachable(
                f"obd: the daemon at {self.path} did not answer within {self.timeout:g} s", "unreachable"
            ) from None
        except OSError as exc:
            await self.aclose()
            raise sdk_results.DaemonUnreachable(f"obd: lost the daemon at {self.path}: {exc}", "unreachable") from None
        except BaseException:
            # Cancelled mid-request (the caller's timeout): its reply may still come and would be
            # read as the next request's, so this connection is closed, not kept.
            with anyio.CancelScope(shield=True):
                await self.aclose()
            raise

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream, self._reader = self._stream, None, None
            await stream.aclose()


class AsyncClient:
    """`Client` for async code: the same methods, awaited (`AsyncRun.logs` is an async iterator).

    Connections are kept between calls: one while calls come one at a time, one more for each
    call made while the others are busy (a wait's long poll holds its connection for up to 20 s,
    and must not hold up another task's status). Usable as an async context manager, which
    closes them.
    """

    def __init__(self, socket: str | os.PathLike[str] | None = None, timeout: float = 120.0) -> None:
        self.socket = sdk.default_socket(socket)
        self._timeout = timeout
        self._idle: list[_Connection] = []

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            await connection.aclose()

    # --- the steps, run here

    async def _call(self, call: sdk._Call) -> Any:
        lost_since: float | None = None
        while True:
            try:
                return await self._request(call)
            except sdk_results.ObdError as error:
                now = time.monotonic()
                if not call.patient or not sdk.patience(error, lost_since, now):
                    raise
                if isinstance(error, sdk_results.DaemonUnreachable | sdk_results.DaemonBusy):
                    lost_since = lost_since or now
            await anyio.sleep(0.5)

    async def _request(self, call: sdk._Call) -> Any:
        """One request on an idle connection, or on a new one when every one is busy."""
        connection = self._idle.pop() if self._idle else _Connection(self.socket, self._timeout)
        try:
            return await connection.call(call.op, **call.params)
        finally:
            self._idle.append(connection)

    async def _do(self, step: sdk.Step) -> Any:
        if isinstance(step, sdk._Call):
            return await self._call(step)
        if isinstance(step, sdk._Sleep):
            await anyio.sleep(step.seconds)
            return None
        raise TypeError(f"a step no client runs here: {step!r}")

    async def _run(self, steps: sdk.Steps[T]) -> T:
        try:
            step = next(steps)
            while True:
                step = steps.send(await self._do(step))
        except StopIteration as done:
            return done.value

    async def _iterate(self, steps: sdk.Steps[None]) -> AsyncIterator[Any]:
        try:
            step = next(steps)
            while True:
                if isinstance(step, sdk._Emit):
                    yield step.value
                    step = next(steps)
                else:
                    step = steps.send(await self._do(step))
        except StopIteration:
            return
        finally:
            steps.close()

    # --- the API

    async def start(
        self,
        command: Sequence[str] | str | None = None,
        *,
        file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> AsyncRun:
        """`Client.start`: a run of `command`, with the run file's keys as options."""
        return AsyncRun(self, await self._run(sdk.start_steps(command, file, options)))

    async def sweep(
        self,
        command: Sequence[str] | str | None = None,
        *,
        grid: Mapping[str, Sequence[Any]] | None = None,
        file: str | os.PathLike[str] | None = None,
        **options: Any,
    ) -> sdk_results.SweepStarted:
        """`Client.sweep`: one run per combination of `grid`."""
        steps = sdk.start_steps(command, file, sdk.with_grid(options, grid), "sweep")
        return sdk.sweep_started(await self._run(steps))

    async def run(self, ref: str) -> AsyncRun:
        """The run `ref` names now: an id, a unique prefix of one, a name, or `last`."""
        return AsyncRun(self, await self._call(sdk._Call("wait", {"id": ref, "timeout": 0})))

    async def runs(
        self,
        all: bool = False,
        states: str | Iterable[str] | None = None,
        target: str | None = None,
        name: str | None = None,
        since: float | str | None = None,
        limit: int | None = None,
    ) -> list[sdk_results.RunStatus]:
        """`obd train list`: by default your active runs and the 10 most recent that ended."""
        params = sdk.list_params(all, states, target, name, since, limit)
        return [sdk_results.RunStatus.of(r) for r in await self._call(sdk._Call("list", params))]

    async def targets(self) -> list[dict[str, Any]]:
        """The daemon's targets, with their GPUs and what holds each."""
        found: list[dict[str, Any]] = await self._call(sdk._Call("targets", {}))
        return found


class AsyncRun:
    """`Run` for async code."""

    def __init__(self, client: AsyncClient, record: Mapping[str, Any]) -> None:
        self.client = client
        self.id: str = record["id"]
        self.name: str | None = record.get("name")

    def __repr__(self) -> str:
        return f"AsyncRun({self.id!r})"

    async def status(self) -> sdk_results.RunStatus:
        return sdk_results.RunStatus.of(await self.client._call(sdk._Call("status", {"id": self.id})))

    async def wait(
        self, states: str | Iterable[str] | None = None, timeout: float | None = None
    ) -> sdk_results.RunStatus:
        """`Run.wait`: until it is in one of `states` (default: any final state)."""
        return await self.client._run(sdk.wait_steps(self.id, states, timeout))

    async def stop(
        self, wait: bool = False, reason: str = "requested", timeout: float | None = None
    ) -> sdk_results.RunStatus:
        """`Run.stop`: a snapshot at the end of its step, then stopped (recorded as asked through the API)."""
        return await self.client._run(sdk.stop_steps(self.id, reason, wait, timeout))

    async def cancel(self, wait: bool = False, timeout: float | None = None) -> sdk_results.RunStatus:
        return await self.client._run(sdk.cancel_steps(self.id, wait, timeout))

    async def resume(
        self,
        checkpoint: str | int | None = None,
        command: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Iterable[str] = (),
        env_clear: bool = False,
        retry: int | None = None,
        target: str | None = None,
        gpus: str | int | None = None,
    ) -> AsyncRun:
        """`Run.resume`: a new run like this one from its snapshot (or `checkpoint`), on `target`."""
        steps = sdk.resume_steps(self.id, checkpoint, command, env, secrets, env_clear, retry, target, gpus)
        return AsyncRun(self.client, await self.client._run(steps))

    async def move(
        self,
        to: str,
        gpus: str | int | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Iterable[str] = (),
        env_clear: bool = False,
        wait: bool = False,
    ) -> AsyncRun:
        """`Run.move`: a snapshot here, the checkpoint carried to target `to`, the training continued
        there; with `wait`, the new run once it trained a step there."""
        steps = sdk.move_steps(self.id, to, gpus, env, secrets, env_clear, wait)
        record = await self.client._run(steps)
        return AsyncRun(self.client, record) if wait else self

    def logs(self, follow: bool = False, tail: int | None = None) -> AsyncIterator[str]:
        """`Run.logs`, as an async iterator: `async for line in run.logs(follow=True)`."""
        return self.client._iterate(sdk.logs_steps(self.id, follow, tail))

    async def metrics(self) -> dict[str, Any] | None:
        found: dict[str, Any] | None = (await self.client._call(sdk._Call("metrics", {"id": self.id}))).get("metrics")
        return found

    async def exec(
        self, command: Sequence[str] | str, input: bytes | None = None, timeout: float | None = None
    ) -> sdk_results.ExecResult:
        """`Run.exec`, on a connection of its own; cancelled (or past `timeout`), it hangs up,
        which ends the command there."""
        frames = sdk_io.exec_frames(self.id, command, input)
        path = self.client.socket
        try:
            stream = await anyio.connect_unix(path)
        except OSError as exc:
            raise sdk_results.DaemonUnreachable(unreachable_message(path, exc), "unreachable") from None
        async with stream:
            with contextlib.suppress(anyio.BrokenResourceError, ConnectionResetError):  # refused: its answer is read
                await stream.send(frames)
            gathered = sdk_io.ExecOutput()
            with anyio.move_on_after(timeout) as scope:
                while True:
                    try:
                        chunk = await stream.receive(1 << 20)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                        chunk = b""
                    done = gathered.feed(chunk)
                    if done is not None:
                        return done
        assert scope.cancelled_caught
        raise sdk_results.ObdError(f"exec(): the command ran over its timeout of {timeout} s; it was ended", "timeout")

    async def prune(self, keep: int | None = None) -> dict[str, Any]:
        """`Run.prune`."""
        found: dict[str, Any] = await self.client._call(sdk._Call("prune", {"id": self.id, "keep": keep}))
        return found

    async def outputs(
        self, to: str | os.PathLike[str] | None = None, checkpoint: str | int | None = None
    ) -> sdk_results.Outputs:
        """`Run.outputs`: the copy runs in a worker thread, so the event loop goes on."""
        reply = await self.client._call(sdk._Call("outputs", {"id": self.id}))
        return await anyio.to_thread.run_sync(sdk_io.copy_outputs, reply, to, checkpoint)
