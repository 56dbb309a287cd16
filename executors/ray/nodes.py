"""obd's multi-node launcher on Ray: the command of a run whose Ray target has `nodes` > 1.

A Ray driver, started by obd's job wrapper inside the run's Ray job: it reserves one bundle per
node in a placement group (`STRICT_SPREAD`: never two on one Ray node), starts one actor in each,
and runs the run's command on every node, as given or under torchrun with its c10d rendezvous on
the first bundle's node. It ends with the worst exit code of the nodes. On obd's cancel (the run's
`cancelling` file, then Ray's TERM) it ends every node's processes, Ray's TERM alone (a stop by
hand, a drained node) being the wrapper's snapshot request that the ranks honour on their own.

The executor copies this file into the run directory (`ray_nodes.py`, next to its plan,
`ray_nodes.json`) and the job runs it from there: it imports only Ray, which every Ray node has,
and the standard library; obd never imports it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

PLAN = "ray_nodes.json"
NOT_PLACED_FIRST, NOT_PLACED_EVERY = 10, 300  # seconds: when a placement group still waiting is said
# Run before the node's command (which it execs): a TERM to it when the actor's process dies, Ray
# having killed it (PR_SET_PDEATHSIG, kept across exec), so nothing of a node outlives its actor.
TERM_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, int(signal.SIGTERM)); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def torchrun_argv(plan: dict[str, Any], rendezvous: str, index: int) -> list[str]:
    """Node `index`'s torchrun around the command: every node's agent meets at the first node's
    rendezvous; its logs go to the node's folder of the run directory (the plan's `torchrun_logs`)."""
    logs = plan.get("torchrun_logs") or []
    return [
        plan.get("python") or sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={int(plan['nodes'])}",
        f"--nproc-per-node={int(plan.get('nproc_per_node') or 1)}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous}",
        f"--rdzv-id=obd-{plan.get('run_id', 'run')}",
        f"--rdzv-conf=is_host={1 if index == 0 else 0}",
        *([f"--log-dir={logs[index]}"] if index < len(logs) else []),
        "--no-python",
        *plan["command"],
    ]


class Node:
    """One node's part of the run (a Ray actor in its bundle): says where it is, runs the node's
    command in a session of its own, ends that session when told."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None

    def where(self) -> dict[str, Any]:
        ray = importlib.import_module("ray")
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), "port": port}

    def run(self, argv: list[str], env: dict[str, str], cwd: str, log: str) -> int:
        # The devices Ray gave this bundle, where it gave any.
        env = {**env, **{k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES",) if k in os.environ}}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", TERM_WITH_PARENT, *argv],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        code = self.proc.wait()
        return 128 - code if code < 0 else code

    def end(self, grace: float) -> None:
        """TERM the node's session, KILL what is left of it after `grace` seconds."""
        proc = self.proc
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(proc.pid):
                time.sleep(0.1)
            if not _group_alive(proc.pid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)  # the node's session is the actor's user's: no PermissionError
        return True
    except ProcessLookupError:
        return False


def main(run_dir: str) -> int:
    with open(os.path.join(run_dir, PLAN)) as f:
        plan = json.load(f)
    ray = importlib.import_module("ray")
    placement = importlib.import_module("ray.util.placement_group")
    strategies = importlib.import_module("ray.util.scheduling_strategies")
    ray.init(log_to_driver=False)  # the job's cluster (RAY_ADDRESS, set by Ray's job supervisor)
    cancelled: list[bool] = []

    def on_term(signum: int, frame: object) -> None:
        # ray.init replaced any handler of ours: this one is installed after it.
        if os.path.lexists(os.path.join(run_dir, "cancelling")):
            cancelled.append(True)

    signal.signal(signal.SIGTERM, on_term)
    nodes = int(plan["nodes"])
    bundle = {k: float(v) for k, v in (plan.get("bundle") or {}).items() if v}
    group = placement.placement_group([dict(bundle) for _ in range(nodes)], strategy="STRICT_SPREAD")
    say(f"waiting for {nodes} Ray nodes with {bundle or 'nothing'} each (a placement group, one bundle a node)")
    waited = 0
    while not cancelled:
        ready, _ = ray.wait([group.ready()], timeout=1.0)
        if ready:
            break
        waited += 1
        if waited % NOT_PLACED_EVERY == NOT_PLACED_FIRST:
            say(not_placed(nodes, bundle, [n for n in ray.nodes() if n.get("Alive")], waited))
    if cancelled:
        return 143
    actor = ray.remote(Node)
    nodes_of: list[Any] = []
    for index in range(nodes):
        strategy = strategies.PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=index
        )
        resources = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")}
        options = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0), "resources": resources}
        if bundle.get("memory"):
            options["memory"] = bundle["memory"]
        nodes_of.append(actor.options(scheduling_strategy=strategy, max_concurrency=2, **options).remote())
    places = ray.get([n.where.remote() for n in nodes_of])
    rendezvous = f"{places[0]['ip']}:{places[0]['port']}"
    for index, place in enumerate(places):
        say(f"node {index} of {nodes}: Ray node {place['node_id']} ({place['ip']})")
    log = os.path.join(run_dir, "job.log")
    env, cwd = dict(os.environ), os.getcwd()
    runs = []
    for index, node in enumerate(nodes_of):
        argv = torchrun_argv(plan, rendezvous, index) if plan.get("launcher") == "torchrun" else plan["command"]
        runs.append(node.run.remote(argv, env, cwd, log))
    grace = float(plan.get("grace") or 10)
    pending, first_failure = list(runs), 0
    while pending and not cancelled:
        ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        failed = [code for code in ray.get(ready) if int(code) != 0]
        if failed and not first_failure:
            first_failure = int(failed[0])
            say(f"a node's command ended with exit code {first_failure}: ending the other nodes'")
            ray.get([n.end.remote(grace) for n in nodes_of])
    if cancelled:
        say("cancelled: ending every node's processes")
        ray.get([n.end.remote(grace) for n in nodes_of])
        return 143
    codes = [int(c) for c in ray.get(runs)]
    say(f"the nodes' exit codes: {codes}")
    return first_failure or max(codes)


def not_placed(nodes: int, bundle: dict[str, float], alive: list[dict[str, Any]], waited: int) -> str:
    """Why the run has not started after `waited` seconds: the nodes alive, and how many of them
    have what one bundle asks (a bundle a node: fewer such nodes than `nodes` wait for more)."""
    fit = [n for n in alive if all(float((n.get("Resources") or {}).get(k, 0)) >= v for k, v in bundle.items())]
    return (
        f"not placed after {waited} s: {nodes} bundles of {bundle} wanted, one a node; the cluster has "
        f"{len(alive)} node(s) alive, {len(fit)} of them with that much in all (busy or not); the run waits for "
        "them (an autoscaler may add nodes; `obd train cancel RUN` ends the wait)"
    )


def say(line: str) -> None:
    print(f"obd: {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
