"""How the daemon waits on its child processes (daemon/service/children.py): from pidfds read by
the event loop, not a thread started, and waited for, per child (10-50 ms of every caller's time
for each run launched on a busy box, issue 33)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

# A child that runs a moment and one killed; the threads alive while they run, and their ends.
CHILDREN = r"""
import json, signal, sys, threading
import anyio
if sys.argv[1] == "pidfd":
    from daemon.service.children import wait_on_children_by_pidfd
    assert wait_on_children_by_pidfd()

async def main():
    ran = await anyio.open_process(["sh", "-c", "exit 3"])
    killed = await anyio.open_process(["sleep", "30"])
    threads = [t.name for t in threading.enumerate()]
    killed.send_signal(signal.SIGKILL)
    print(json.dumps({"threads": threads, "codes": [await ran.wait(), await killed.wait()]}))
    await ran.aclose()
    await killed.aclose()

anyio.run(main)
"""


def children(how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILDREN, how], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="asyncio uses pidfds by itself from Python 3.12")
def test_the_daemon_learns_of_its_childrens_ends_without_a_thread_for_each() -> None:
    plain = children("plain")
    assert any("waitpid" in name for name in plain["threads"])  # what this Python does alone
    by_pidfd = children("pidfd")
    assert not any("waitpid" in name for name in by_pidfd["threads"]), by_pidfd["threads"]
    assert by_pidfd["codes"] == plain["codes"] == [3, -9]  # each child's end, as before


def test_obd_daemon_waits_on_its_children_by_pidfd_before_its_event_loop_starts() -> None:
    source = (REPO / "daemon/service/commands.py").read_text()
    run_daemon = source[source.index("def run_daemon") : source.index("def admin_main")]
    assert run_daemon.index("wait_on_children_by_pidfd()") < run_daemon.index("anyio.run(")
