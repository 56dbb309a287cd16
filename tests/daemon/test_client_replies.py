"""A large reply (root's list of thousands of runs) is decoded without the caller's cycle collector
running over its heap mid-decode (issue 33: the tail of root's list under load)."""

from __future__ import annotations

import gc
import itertools
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from daemon.cli.aio import _Connection
from daemon.cli.client import LARGE_REPLY, OK_PREFIX, Client, decode


def _summaries(count: int) -> list[dict]:
    return [
        {"id": f"20261207-000000-{n:06d}", "state": "queued", "progress": {"step": None, "loss": None}, "tags": [n]}
        for n in range(count)
    ]


@pytest.fixture
def collections() -> Iterator[list[int]]:
    """The collector's passes while the test runs, with thresholds low enough that a decode of
    thousands of objects would set off several."""
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    before = gc.get_threshold()
    gc.set_threshold(100, 2, 2)
    gc.callbacks.append(count)
    try:
        yield seen
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*before)
        gc.enable()


def test_a_large_reply_is_decoded_with_no_collection_and_the_collector_is_on_after(collections: list[int]) -> None:
    runs = _summaries(5_000)
    data = json.dumps(runs).encode()
    assert len(data) > LARGE_REPLY
    json.loads(data)
    assert collections, "the thresholds set off no collection: the test shows nothing"
    collections.clear()
    decoded = decode(data)
    during = len(collections)  # no object made: the collector may run at the next one, not in the decode
    assert during == 0
    assert decoded == runs
    assert gc.isenabled()


def test_a_caller_that_paused_the_collector_finds_it_paused(collections: list[int]) -> None:
    gc.disable()
    assert decode(json.dumps(_summaries(3_000)))[-1]["tags"] == [2_999]
    assert not gc.isenabled()


@pytest.fixture
def replying(short_tmp: Path) -> Iterator[Path]:
    """A socket that answers every request line with a successful list of 5,000 runs."""
    path = short_tmp / "s"
    reply = OK_PREFIX + json.dumps(_summaries(5_000)).encode() + b"}\n"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                while conn.recv(1 << 16):
                    conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    yield path
    server.close()


def test_the_client_and_the_async_client_decode_a_list_of_thousands_with_no_collection(
    replying: Path, collections: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    during: list[int] = []  # collections during each decode (the event loop's own may come between)
    loads = json.loads

    def timed_loads(*args: object, **kwargs: object) -> object:
        before = len(collections)
        try:
            return loads(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            during.append(len(collections) - before)

    monkeypatch.setattr(json, "loads", timed_loads)
    client = Client(replying, timeout=60)
    try:
        assert len(client.call("list")) == 5_000
    finally:
        client.close()

    async def listed() -> int:
        connection = _Connection(replying, timeout=60)
        try:
            return len(await connection.call("list"))
        finally:
            await connection.aclose()

    assert anyio.run(listed) == 5_000
    assert len(during) == 2 and during == [0, 0]


def test_replies_are_read_whole_however_they_are_cut_and_joined(short_tmp: Path) -> None:
    """A reply in pieces of any size (its line's end alone in the last), and two replies in one
    piece (the second kept for the next call), each come back whole to their own call."""
    path = short_tmp / "s"
    first = OK_PREFIX + json.dumps(_summaries(2_000)).encode() + b"}\n"
    second = OK_PREFIX + b'"pong"}\n'
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def serve() -> None:
        with server.accept()[0] as conn:
            conn.recv(1 << 16)
            cuts = [0, 1, 2, 7, 4096, 70_000, len(first) - 1, len(first)]
            for lo, hi in itertools.pairwise(cuts):
                conn.sendall(first[lo:hi])
            conn.recv(1 << 16)
            conn.sendall(first + second)  # both at once: the second call is answered from what is kept
            conn.recv(1 << 16)
            conn.recv(1 << 16)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = Client(path, timeout=60)
    try:
        assert client.call("list") == _summaries(2_000)
        assert client.call("list") == _summaries(2_000)
        assert client.call("ping") == "pong"
    finally:
        client.close()
        server.close()
    thread.join(60)
