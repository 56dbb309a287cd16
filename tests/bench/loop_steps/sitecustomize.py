"""The daemon's event loop timed step by step, for tests/bench/bench_fairness.py: with
OBD_BENCH_STEPS=FILE in the environment of an `obd daemon` whose path holds this directory,
each step of the loop (a callback: most often a task's run up to its next await) that used 5 ms
of the loop thread's CPU or more is written to FILE, a JSON line each: when it ended, its wall
and CPU time, and the task's coroutine where it stopped. CPU time, not wall: a box busy with
other work does not count, only what the daemon's code holds the loop for. Any other process
(the wrappers the daemon starts) is left alone."""

from __future__ import annotations

import os
import sys

_FILE = os.environ.pop("OBD_BENCH_STEPS", "")  # popped: the daemon's children do not inherit it

if _FILE and sys.argv[1:2] == ["daemon"]:  # `python -m daemon.cli daemon` (argv[0] is "-m" until then)
    import asyncio.events
    import json
    import time
    from typing import Any

    _run = asyncio.events.Handle._run
    _out = open(_FILE, "a", buffering=1)  # the daemon's life long, closed by its exit

    def _where(handle: Any) -> str:
        task = getattr(handle._callback, "__self__", None)
        coro = task.get_coro() if isinstance(task, asyncio.Task) else None
        if coro is None:
            return repr(handle._callback)[:120]
        places = []
        while coro is not None and len(places) < 16:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is None:
                places.append(getattr(coro, "__qualname__", "?") + " (ended)")
                break
            if "/anyio/" not in frame.f_code.co_filename and "/asyncio/" not in frame.f_code.co_filename:
                places.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}:{frame.f_lineno}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return " > ".join(places[-4:])

    def _timed(self: Any) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            _run(self)
        finally:
            used = time.thread_time() - cpu
            if used >= 0.005:
                step = {"at": time.time(), "wall": time.perf_counter() - wall, "cpu": used, "where": _where(self)}
                _out.write(json.dumps(step) + "\n")

    asyncio.events.Handle._run = _timed  # type: ignore[method-assign]
