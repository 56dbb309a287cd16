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
import ipaddress
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.executors.slurm.conftest import run_processes
from tests.ray_cluster import API_PORT, HEAD_PORT, RayCluster, ray_cluster  # noqa: F401 - the module's cluster

pytestmark = pytest.mark.slow

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")


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
        # A placement group of two bundles, one a node: torchrun on each, one rank a node.
        + f'\n[targets.ray_pair]\n{common}nodes = 2\nlauncher = "torchrun"\n'
        + f"\n[targets.ray_three]\n{common}nodes = 3\n"
    )


class RayDaemon(DaemonProc):
    """A daemon in the cluster's namespace (for the type checker: `cluster` is set by the fixture)."""

    cluster: RayCluster


@pytest.fixture
def ray(
    make_daemon: Callable[..., RayDaemon],
    ray_cluster: RayCluster,  # noqa: F811
    short_tmp: Path,
) -> Iterator[RayDaemon]:
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


def test_the_clusters_namespace_has_only_loopback_and_the_jobs_api_answers_there(
    ray_cluster: RayCluster,  # noqa: F811
) -> None:
    links = ray_cluster.run("ip", "-o", "link", "show").stdout.splitlines()
    assert [line.split(":")[1].strip() for line in links] == ["lo"]
    addresses = ray_cluster.run("ip", "-o", "addr", "show").stdout
    assert {line.split()[3] for line in addresses.splitlines()} <= {"127.0.0.1/8", "::1/128"}
    assert ray_cluster.api("/api/version")["ray_version"]
    assert len(ray_cluster.alive_nodes()) == 2


def listening(tables: list[Path]) -> set[tuple[IP, int]]:
    """The (address, port) pairs listening in /proc/PID/net/tcp{,6} tables (state 0A: LISTEN), an
    IPv4 address mapped into IPv6 (::ffff:127.0.0.1) as the IPv4 one."""
    found = set()
    for table in tables:
        for line in table.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A":
                address, port = local.split(":")
                raw = bytes.fromhex(address)
                # The kernel writes each 32-bit word of the address in host (little-endian) order.
                ip = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                where = ipaddress.ip_address(ip)
                mapped = where.ipv4_mapped if isinstance(where, ipaddress.IPv6Address) else None
                found.add((mapped or where, int(port, 16)))
    return found


def tcp_inodes(tables: list[Path]) -> set[str]:
    return {line.split()[9] for table in tables for line in table.read_text().splitlines()[1:]}


def test_every_ray_process_is_in_the_clusters_namespace_and_listens_only_where_loopback_reaches(
    ray_cluster: RayCluster,  # noqa: F811
) -> None:
    # Ray's processes: every process with a file open in the cluster's temp dir (its logs, its session).
    ray_processes = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd).startswith(ray_cluster.temp) for fd in fd_dir.iterdir()):
                ray_processes.append(int(fd_dir.parent.name))
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in ray_processes}
    assert {"raylet", "gcs_server"} <= names, names
    assert set(ray_processes) <= set(ray_cluster.ray_pids()), "a Ray process runs outside the cluster's namespace"
    # None of them holds a TCP socket of the machine's own namespace.
    here = tcp_inodes([Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6")])
    held = set()
    for pid in ray_processes:
        with contextlib.suppress(OSError):
            held |= {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir() if "socket:" in os.readlink(fd)}
    assert not held & here
    # In the namespace (whose only interface is `lo`), every port listens on a loopback address:
    # the GCS and the Jobs API among them.
    holder = Path(f"/proc/{ray_cluster.holder.pid}/net")
    ports = listening([holder / "tcp", holder / "tcp6"])
    assert {HEAD_PORT, API_PORT} <= {port for _, port in ports}
    assert [(str(a), p) for a, p in ports if not a.is_loopback] == []
    # Both nodes know themselves by the loopback address.
    assert {n["raylet"]["nodeManagerAddress"] for n in ray_cluster.alive_nodes()} == {"127.0.0.1"}


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
    # No exec into a Ray job (the kind has no `exec` capability): refused saying why and what to use.
    refused = ray.cli("train", "exec", rid, "--", "pwd")
    assert refused.returncode != 0 and "not supported on Ray target ray" in refused.stderr, refused.stderr
    assert f"obd train logs {rid}" in refused.stderr
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


def losses(record: dict[str, Any]) -> dict[int, tuple[float, float]]:
    return {m["step"]: (m["loss"], m["grad_norm"]) for m in metrics(record) if m["event"] == "log" and "loss" in m}


def test_a_two_node_torchrun_stopped_with_wait_has_one_proof_every_rank_at_its_step_and_resumes_bitwise(
    ray: RayDaemon, short_tmp: Path
) -> None:
    command = [sys.executable, PLAIN, "--output_dir", "mine", "--max_steps", "12", "--save_steps", "12"]
    whole = start(ray, "ray_pair", *command, cwd=short_tmp)  # the uninterrupted reference, alongside
    # --hold-at: every rank trains past step 4 only once obd asked for the snapshot.
    rid = start(ray, "ray_pair", *command, "--hold-at", "4", cwd=short_tmp)
    wait_for(lambda: (ray.record(rid)["progress"]["step"] or 0) >= 4, 300, 0.3, "both ranks to train on Ray")
    out = ray.cli("train", "stop", rid, "--wait", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    record = ray.record(rid)
    assert record["state"] == "stopped" and record["snapshot"]["reason"] == "requested", record["message"]
    step = record["snapshot"]["step"]
    run_dir = Path(record["remote_dir"])
    log = (run_dir / "job.log").read_text()
    assert log.count("obd: snapshot at step") == 1, log[-3000:]  # one proof
    ended = sorted(line for line in log.splitlines() if line.startswith("train ended at step"))
    assert ended == [f"train ended at step {step} of 12 (rank {rank})" for rank in (0, 1)], log[-3000:]
    assert metrics(record)[0]["world_size"] == 2
    # One rank on each Ray node: the placement group put its two bundles on the two nodes.
    placed = [line.split("Ray node ")[1].split()[0] for line in log.splitlines() if " of 2: Ray node " in line]
    assert sorted(placed) == sorted(n["raylet"]["nodeId"] for n in ray.cluster.alive_nodes()), log[-3000:]
    state = json.loads((run_dir / "output" / f"checkpoint-{step}" / "trainer_state.json").read_text())
    assert state["global_step"] == step
    # The job ended on its own after its snapshot (Ray's stop never needed), nothing of it left on either node.
    assert ray.cluster.job(rid)["status"] == "SUCCEEDED"
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job, on both nodes, to be gone")

    out = ray.cli("train", "resume", rid, "--", *command)
    assert out.returncode == 0, out.stderr
    resumed_id = out.stdout.strip()
    resumed = ray.wait_state(resumed_id, "succeeded", "failed", "cancelled", "stopped", "lost", timeout=300)
    assert resumed["state"] == "succeeded", resumed["message"]
    reference = ray.wait_state(whole, "succeeded", "failed", "cancelled", "stopped", "lost", timeout=300)
    assert reference["state"] == "succeeded", reference["message"]
    after = losses(resumed)
    assert min(after) == step + 1 and after == {s: losses(reference)[s] for s in after}  # bitwise, step by step
    final = [Path(r["remote_dir"]) / "output" / "checkpoint-12" / "model.safetensors" for r in (resumed, reference)]
    assert final[0].read_bytes() == final[1].read_bytes()  # the same weights at the end
    assert metrics(resumed)[0]["start_step"] == step and metrics(resumed)[0]["world_size"] == 2
    wait_for(lambda: run_processes(resumed_id) == [], 30, 0.2, "the resumed job's processes to be gone")


def test_a_two_node_run_cancelled_while_it_trains_leaves_no_process_on_either_node(
    ray: RayDaemon, short_tmp: Path
) -> None:
    # --hold-at with no request ever: both ranks wait after step 2 until the cancel.
    command = [sys.executable, PLAIN, "--output_dir", "mine", "--max_steps", "12", "--hold-at", "2"]
    rid = start(ray, "ray_pair", *command, cwd=short_tmp)
    wait_for(lambda: (ray.record(rid)["progress"]["step"] or 0) >= 2, 300, 0.3, "both ranks to train on Ray")
    assert len(run_processes(rid)) >= 4  # at least a torchrun agent and a rank on each node
    out = ray.cli("train", "cancel", rid, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ray.record(rid)["state"] == "cancelled"
    assert ray.cluster.job(rid)["status"] == "STOPPED"
    assert "cancelled: ending every node's processes" in (Path(ray.record(rid)["remote_dir"]) / "job.log").read_text()
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job, on both nodes, to be gone")


def test_a_run_moved_from_this_machine_to_ray_and_back_trains_every_step_bitwise_as_one_chain(
    ray: RayDaemon, short_tmp: Path
) -> None:
    command = [sys.executable, PLAIN, "--output_dir", "mine", "--max_steps", "400"]
    reference = ray.wait_state(start(ray, "local", *command, cwd=short_tmp), "succeeded", "failed", timeout=300)
    assert reference["state"] == "succeeded", reference["message"]
    # Slow steps (the numbers are the same): the run is still training when each move is asked.
    rid = start(ray, "local", *command, "--step-sleep", "0.2", "--hold-at", "4", cwd=short_tmp)
    wait_for(lambda: (ray.record(rid)["progress"]["step"] or 0) >= 4, 240, 0.3, "the run to train here")
    chain = [rid]
    for to in ("ray_worker", "local"):
        out = ray.cli("train", "move", chain[-1], "--to", to, "--wait", timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        move = ray.record(chain[-1])["move"]
        assert move["state"] == "done" and move["to"] == to, move
        chain.append(move["run"])
        assert ray.record(chain[-1])["target"] == to and ray.record(chain[-1])["resumed_from"] == chain[-2]
    out = ray.cli("train", "stop", chain[-1], "--wait", timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    records = [ray.record(r) for r in chain]
    assert [r["state"] for r in records] == ["stopped", "stopped", "stopped"], [r["message"] for r in records]
    assert ray.cluster.job(chain[1])["status"] == "SUCCEEDED"  # the Ray leg ended on its own, at its snapshot
    trained = [losses(r) for r in records]
    for before, after, record in zip(trained, trained[1:], records, strict=False):
        assert min(after) == record["snapshot"]["step"] + 1 == max(before) + 1  # none twice, none skipped
    every = {step: value for leg in trained for step, value in leg.items()}
    assert every == {step: losses(reference)[step] for step in every}  # bitwise, on both targets
    assert len(every) > records[1]["snapshot"]["step"]  # the last leg trained here again


def test_a_ray_stop_by_hand_of_a_two_node_run_is_a_preempted_snapshot_taken_by_every_rank(
    ray: RayDaemon, short_tmp: Path
) -> None:
    command = [sys.executable, PLAIN, "--output_dir", "mine", "--max_steps", "12", "--hold-at", "3"]
    rid = start(ray, "ray_pair", *command, cwd=short_tmp)
    wait_for(lambda: (ray.record(rid)["progress"]["step"] or 0) >= 3, 300, 0.3, "both ranks to train on Ray")
    # Not obd's cancel (a cluster drained, an admin's `ray job stop`): Ray's TERM reaches the job's driver.
    ray.cluster.run("ray", "job", "stop", "--no-wait", f"--address=http://127.0.0.1:{API_PORT}", f"obd-{rid}")
    record = ray.wait_state(rid, "stopped", "failed", "cancelled", "lost", "succeeded", timeout=240)
    assert record["state"] == "stopped" and record["snapshot"]["reason"] == "preempted", record["message"]
    step = record["snapshot"]["step"]
    log = (Path(record["remote_dir"]) / "job.log").read_text()
    assert log.count("obd: snapshot at step") == 1, log[-3000:]
    ended = sorted(line for line in log.splitlines() if line.startswith("train ended at step"))
    assert ended == [f"train ended at step {step} of 12 (rank {rank})" for rank in (0, 1)], log[-3000:]
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job, on both nodes, to be gone")


def test_a_multi_node_run_the_cluster_cannot_place_says_why_it_waits_and_its_cancel_ends_the_wait(
    ray: RayDaemon,
) -> None:
    rid = start(ray, "ray_three", "sh", "-c", "echo never placed")  # three nodes wanted, two alive
    said = "3 bundles of {'CPU': 1.0} wanted, one a node; the cluster has 2 node(s) alive, 2 of them"
    wait_for(lambda: said in ray.cli("train", "logs", rid).stdout, 120, 0.5, "the driver to say why it waits")
    assert ray.record(rid)["state"] == "running"
    out = ray.cli("train", "cancel", rid, "--wait", timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert ray.record(rid)["state"] == "cancelled" and ray.cluster.job(rid)["status"] == "STOPPED"
    assert "never placed" not in ray.cli("train", "logs", rid).stdout
    wait_for(lambda: run_processes(rid) == [], 30, 0.2, "every process of the job to be gone")
