"""Ray targets under the real daemon, against a real two-node Ray cluster (issue 37).

The cluster (a head and a worker node, `ray start` from the tests' venv) runs in a network
namespace of the test module's own with only `lo` up: `ray start --head` listens on every
interface and rewrites --node-ip-address, so nothing of it may run in the machine's own. The
daemon runs in that namespace too (it reaches the Jobs API on 127.0.0.1:8265); the tests talk to
the daemon over its unix socket, which no namespace separates. Starting the cluster costs about a
minute on a loaded machine, so the module is `slow` (`pytest -m slow tests/daemon/test_ray_target.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.executors.slurm.conftest import run_processes

pytestmark = pytest.mark.slow

PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
VENV_BIN = str(Path(sys.executable).parent)
CLONE_NEWNET = 0x40000000
HEAD_PORT, API_PORT = 6379, 8265


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


class RayCluster:
    """A head and a worker node in a network namespace held by one `sleep` (loopback only)."""

    def __init__(self) -> None:
        self.temp = tempfile.mkdtemp(prefix="ray-obd-", dir="/tmp")
        self.env = {**os.environ, "PATH": f"{VENV_BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
        self.env["RAY_USAGE_STATS_ENABLED"] = "0"
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
        common = ("--disable-usage-stats", "--num-cpus=2")
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
        libc = ctypes.CDLL(None, use_errno=True)
        path = self.netns

        def setns() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)

        return setns

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.run("ray", "stop", "--force", timeout=120, check=False)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.holder.pid, signal.SIGKILL)
        self.holder.wait(30)
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def ray_config(workdir: Path) -> str:
    common = (
        f'kind = "ray"\naddress = "http://127.0.0.1:{API_PORT}"\nworkdir = "{workdir}"\npython = "{sys.executable}"\n'
    )
    common += 'num_cpus = 1\nstop_wait = "20s"\n'
    return (
        FAST_CONFIG
        + f"\n[targets.ray]\n{common}"
        # Only the worker node has the `second_node` resource: this target's jobs run there.
        + f"\n[targets.ray_worker]\n{common}resources = {{ second_node = 1 }}\n"
    )


class RayDaemon(DaemonProc):
    """A daemon in the cluster's namespace (for the type checker: `cluster` is set by the fixture)."""

    cluster: RayCluster


@pytest.fixture
def ray(make_daemon: Callable[..., RayDaemon], ray_cluster: RayCluster, short_tmp: Path) -> Iterator[RayDaemon]:
    d = make_daemon(ray_config(short_tmp / "shared"))
    d.cluster = ray_cluster
    d.start(preexec_fn=ray_cluster.enter())
    yield d
    d.stop()


def start(d: DaemonProc, target: str, *command: str, cwd: Path | None = None) -> str:
    opts = ("--cwd", str(cwd)) if cwd is not None else ()
    out = d.cli("train", "start", "--target", target, *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def metrics(record: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(record["remote_dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_steps(record: dict[str, Any]) -> list[int]:
    return [m["step"] for m in metrics(record) if m["event"] == "log" and "loss" in m]


def test_the_clusters_namespace_has_only_loopback_and_the_jobs_api_answers_there(ray_cluster: RayCluster) -> None:
    links = ray_cluster.run("ip", "-o", "link", "show").stdout.splitlines()
    assert [line.split(":")[1].strip() for line in links] == ["lo"]
    addresses = ray_cluster.run("ip", "-o", "addr", "show").stdout
    assert {line.split()[3] for line in addresses.splitlines()} <= {"127.0.0.1/8", "::1/128"}
    assert ray_cluster.api("/api/version")["ray_version"]
    assert len(ray_cluster.alive_nodes()) == 2


def test_targets_check_says_the_jobs_api_answers_and_what_the_cluster_has(ray: RayDaemon) -> None:
    # `targets check` runs the checks in the command's own process: in the cluster's namespace too.
    argv = ["nsenter", f"--net={ray.cluster.netns}", sys.executable, "-m", "daemon.cli", "targets", "check", "ray"]
    out = subprocess.run(argv, env=ray.env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Ray 2." in out.stdout and "2 node(s) alive" in out.stdout and "CPU 4" in out.stdout
    # The dashboard's node summary spells resource names in camelCase (second_node: secondNode).
    assert "secondNode 1" in out.stdout


def test_a_run_succeeds_and_a_failing_one_is_failed_with_its_exit_code_and_its_output(
    ray: RayDaemon, short_tmp: Path
) -> None:
    ok = start(ray, "ray_worker", "sh", "-c", 'echo "ran in $PWD as run $OBD_RUN_ID"', cwd=short_tmp)
    bad = start(ray, "ray", "sh", "-c", "echo about to fail; exit 3")
    record = ray.wait_state(ok, "succeeded", "failed", "cancelled", "lost", timeout=120)
    assert record["state"] == "succeeded", record["message"]
    assert f"ran in {short_tmp} as run {ok}" in ray.cli("train", "logs", ok).stdout
    failed = ray.wait_state(bad, "succeeded", "failed", "cancelled", "lost", timeout=120)
    assert failed["state"] == "failed" and failed["exit_code"] == 3, failed["message"]
    assert "about to fail" in ray.cli("train", "logs", bad).stdout
    # One Ray job each, named for its run; the worker-only one ran on the worker node.
    assert ray.cluster.job(ok)["status"] == "SUCCEEDED"
    assert ray.cluster.job(bad)["status"] == "FAILED"
    head = next(n for n in ray.cluster.alive_nodes() if n["raylet"].get("isHeadNode"))
    assert ray.cluster.job(ok)["driver_node_id"] != head["raylet"]["nodeId"]


def test_a_trainer_run_stopped_with_wait_has_a_proven_snapshot_and_resume_continues_it(
    ray: RayDaemon, short_tmp: Path
) -> None:
    command = [sys.executable, PLAIN, "--output_dir", "mine", "--max_steps", "400", "--step-sleep", "0.2"]
    rid = start(ray, "ray_worker", *command, cwd=short_tmp)
    wait_for(lambda: (ray.record(rid)["progress"]["step"] or 0) >= 3, 240, 0.3, "the Trainer to train on Ray")
    out = ray.cli("train", "stop", rid, "--wait", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    record = ray.record(rid)
    assert record["state"] == "stopped", record["message"]
    assert record["snapshot"]["reason"] == "requested"
    step = record["snapshot"]["step"]
    run_dir = Path(record["remote_dir"])
    checkpoint = run_dir / "output" / f"checkpoint-{step}"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step
    assert json.loads((run_dir / "snapshot.json").read_text())["step"] == step
    # The job ended on its own after its snapshot: Ray's stop (the fallback) was never needed.
    job = ray.cluster.job(rid)
    assert job["status"] == "SUCCEEDED", job
    assert not (run_dir / "cancelling").exists()
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job to be gone")

    out = ray.cli("train", "resume", rid, "--", *command[:-4], "--max_steps", str(step + 3))
    assert out.returncode == 0, out.stderr
    resumed_id = out.stdout.strip()
    resumed = ray.wait_state(resumed_id, "succeeded", "failed", "cancelled", "stopped", "lost", timeout=240)
    assert resumed["state"] == "succeeded", resumed["message"]
    assert resumed["resumed_from"] == rid
    assert log_steps(resumed) == [step + 1, step + 2, step + 3]
    assert metrics(resumed)[0]["start_step"] == step


def test_a_cancel_ends_the_ray_job_and_leaves_no_process(ray: RayDaemon) -> None:
    rid = start(ray, "ray", "sh", "-c", "sleep 300 & sleep 300 & echo children started; wait")
    ray.wait_state(rid, "running", timeout=120)
    wait_for(lambda: "children started" in ray.cli("train", "logs", rid).stdout, 60, 0.2, "the job's children")
    out = ray.cli("train", "cancel", rid, "--wait", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    record = ray.record(rid)
    assert record["state"] == "cancelled", record["message"]
    assert ray.cluster.job(rid)["status"] == "STOPPED"
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job to be gone")


def test_a_restarted_daemon_follows_its_ray_jobs_from_the_jobs_api(ray: RayDaemon, short_tmp: Path) -> None:
    gate = short_tmp / "gate"
    waiting = start(ray, "ray", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; echo through the gate")
    ended = start(ray, "ray", "sh", "-c", f"while [ ! -e {gate} ]; do sleep 0.1; done; exit 4")
    ray.wait_state(waiting, "running", timeout=120)
    ray.wait_state(ended, "running", timeout=120)
    ray.kill()
    gate.write_text("")
    wait_for(lambda: ray.cluster.job(ended)["status"] == "FAILED", 60, 0.2, "the job to end while no daemon runs")
    ray.start(preexec_fn=ray.cluster.enter())
    assert ray.wait_state(ended, "failed", timeout=120)["exit_code"] == 4
    record = ray.wait_state(waiting, "succeeded", "failed", "lost", timeout=120)
    assert record["state"] == "succeeded", record["message"]
    assert "through the gate" in ray.cli("train", "logs", waiting).stdout
