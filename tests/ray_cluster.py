"""A real two-node Ray cluster for the tests (issue 37): a head and a worker node, `ray start` from
the tests' venv, in a network namespace of the cluster's own with only `lo` up.

`ray start --head` listens on every interface and rewrites --node-ip-address, so nothing of it may
run in the machine's own namespace. What runs in the cluster's namespace (the nodes, a daemon made
with `enter()`) reaches the Jobs API at 127.0.0.1:8265; a test process outside it reaches it
through `jobs_api_here()`, a loopback port of its own namespace forwarded into the cluster's by a
thread of the test process (no process, no traffic off loopback). Starting the cluster costs about
a minute on a loaded machine: the modules that use it are `slow`.

Used by tests/daemon/test_ray_target.py and tests/executors/conformance (the `ray_cluster` fixture,
one cluster per test module, torn down with it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for

VENV_BIN = str(Path(sys.executable).parent)
CLONE_NEWNET = 0x40000000
HEAD_PORT, API_PORT = 6379, 8265
NODE_CPUS = 2  # each node's --num-cpus


def missing_reason() -> str | None:
    """Why a real Ray cluster cannot be had here, or None."""
    if os.geteuid() != 0:
        return "a Ray cluster of the test's own needs a network namespace: run the tests as root"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (util-linux, iproute2): no network namespace for the Ray cluster"
    if not (Path(VENV_BIN) / "ray").exists():
        return "ray is not installed in the tests' venv: `.venv/bin/pip install -c constraints.txt -e '.[test]'`"
    return None


def enter_netns(path: str) -> None:
    """Move the calling thread (a whole process, when called in a child before exec) into a network namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


class Forward:
    """A loopback port of this process's namespace whose connections are carried to a port on the
    loopback of another namespace: one thread accepts (moved into the other namespace after its
    listening socket was made here), two threads carry each connection's bytes."""

    def __init__(self, netns: str, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.netns, self.target = netns, port
        self.thread = threading.Thread(target=self._accept, name="ray-jobs-api-forward", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        enter_netns(self.netns)  # this thread only: its later sockets are the cluster's
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=30)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._carry, args=(a, b), daemon=True).start()

    @staticmethod
    def _carry(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(10)


class RayCluster:
    """A head and a worker node in a network namespace held by one `sleep` (loopback only)."""

    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="ray-obd-", dir="/tmp")
        self.env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.env["RAY_USAGE_STATS_ENABLED"] = "0"
        self.forward: Forward | None = None
        self.holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo up && exec sleep infinity"],
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        assert self.holder.stdout is not None
        assert self.holder.stdout.readline().strip() == b"up", "the network namespace could not be made"
        self.netns = f"/proc/{self.holder.pid}/ns/net"

    def run(self, *argv: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A command inside the cluster's namespace."""
        out = subprocess.run(
            ["nsenter", f"--net={self.netns}", *argv],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.temp,
        )
        if check and out.returncode != 0:
            raise AssertionError(f"{argv} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        return out

    def start(self) -> None:
        common = ("--disable-usage-stats", f"--num-cpus={NODE_CPUS}")
        self.run(
            "ray", "start", "--head", f"--port={HEAD_PORT}", "--node-ip-address=127.0.0.1",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={API_PORT}", "--include-dashboard=true",
            f"--temp-dir={self.temp}", *common,
        )  # fmt: skip
        self.run("ray", "start", f"--address=127.0.0.1:{HEAD_PORT}", '--resources={"second_node": 1}', *common)
        wait_for(lambda: len(self.alive_nodes()) == 2, 120, 0.5, "both Ray nodes to be alive")

    def api(self, path: str) -> Any:
        """GET on the Jobs API, from inside the namespace (None for a 404)."""
        code = (
            "import json,sys,urllib.request,urllib.error\n"
            "try:\n"
            f" print(urllib.request.urlopen('http://127.0.0.1:{API_PORT}' + sys.argv[1], timeout=30).read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            " print('null' if e.code == 404 else sys.exit(str(e)))\n"
        )
        return json.loads(self.run(sys.executable, "-c", code, path).stdout)

    def alive_nodes(self) -> list[dict[str, Any]]:
        try:
            summary = self.api("/nodes?view=summary")["data"]["summary"]
        except AssertionError:
            return []  # the dashboard is not up yet
        return [n for n in summary if (n.get("raylet") or {}).get("state") == "ALIVE"]

    def job(self, run_id: str) -> dict[str, Any] | None:
        return self.api(f"/api/jobs/obd-{run_id}")

    def enter(self) -> Callable[[], None]:
        """A preexec_fn that puts a child into the cluster's namespace (the daemon)."""
        path = self.netns
        return lambda: enter_netns(path)

    def jobs_api_here(self) -> str:
        """The Jobs API's address as this process reaches it (a forwarded loopback port)."""
        if self.forward is None:
            self.forward = Forward(self.netns, API_PORT)
        return f"http://127.0.0.1:{self.forward.port}"

    def ray_pids(self) -> list[int]:
        """The processes in the cluster's namespace but its holder: Ray's own, and the jobs'."""
        mine = os.readlink(self.netns)
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != self.holder.pid:
                with contextlib.suppress(OSError):
                    if os.readlink(entry / "ns" / "net") == mine:
                        pids.append(int(entry.name))
        return pids

    def stop(self) -> None:
        """End every process in the cluster's namespace (TERM, KILL what is left 30 s later), then the
        namespace. Never `ray stop`: it ends the Ray processes of the whole machine, by name, and so
        another module's cluster in a namespace of its own (pytest-xdist runs modules side by side)."""
        if self.forward is not None:
            self.forward.close()
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            for pid in self.ray_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(AssertionError):
                wait_for(lambda: not self.ray_pids(), grace, 0.2, "the cluster's processes to end")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.holder.pid, signal.SIGKILL)
        self.holder.wait(30)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    """The module's two-node Ray cluster (skipped, saying why, where none can be had)."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
