"""The Ray executor: a run is one Ray job, submitted, read and stopped through Ray's Jobs API.

The job's entrypoint is obd's job wrapper (the Slurm batch wrapper, `slurm_batch.py batch`, run
from the run's `plugin/`): it writes `job.pid`, the end marker and `exit_code` into the run
directory, turns a TERM that is not obd's cancel into a `preempted` snapshot request, and starts
the command in the run's working directory. The run directory is on a filesystem the daemon and
the Ray nodes share (one machine, or a shared volume): files move through this machine's
executor, and a snapshot request reaches the job as a file there, as on every other target.

A run's handle names the Ray job (`ray job obd-<run id>`, its submission id). A probe of every run
of the executor is one `GET /api/jobs/` and a read of each run directory.

A target with `nodes` > 1 is Ray placement for a multi-node run: the wrapper's command is then
obd's Ray driver (`nodes.py`, copied into the run directory), which runs the command on one
bundle a node of a placement group, under torchrun where the target says so.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from executors.base import (
    CommandResult,
    ExecIO,
    ExecSpec,
    ExecutorError,
    JobHandle,
    JobSpec,
    JobStatus,
    LaunchUncertain,
    Reached,
    RunAs,
    RunEvents,
    RunProbe,
    TargetUnreachable,
)
from executors.local import LocalExecutor
from executors.ray import nodes, states
from executors.ray.api import JobsApi
from executors.ray.config import RayTarget
from trainer_plugin import rundir
from trainer_plugin.tools import jobctl, slurm_batch

log = structlog.get_logger("obd.ray")

SUBMIT_RECORD = "ray_submit.json"  # in the run directory: the submission id, and when it was submitted
NODES_SCRIPT = "ray_nodes.py"  # in a multi-node run's directory: obd's Ray driver (executors/ray/nodes.py)


def entrypoint(python: str, run_dir: str) -> str:
    """The Ray job's entrypoint (a shell command): exec the job wrapper from the run's plugin/, its
    output and the command's appended to the run's job.log."""
    paths = rundir.RunPaths(run_dir.rstrip("/"))
    wrapper = paths.tool("slurm_batch.py")
    argv = " ".join(shlex.quote(a) for a in (python, wrapper, "batch", paths.run_dir))
    return f"exec {argv} >> {shlex.quote(paths.job_log)} 2>&1"


def submit_body(target: RayTarget, job: JobSpec, python: str) -> dict[str, Any]:
    """What `POST /api/jobs/` is given for a run: the entrypoint, its submission id, the target's
    resources and runtime_env, with obd's values among its env_vars and Ray's stop wait set."""
    runtime_env = json.loads(json.dumps(target.runtime_env))  # a copy, never the config's own
    env_vars = dict(runtime_env.get("env_vars") or {})
    env_vars.update(job.env)
    env_vars.update(job.secrets)
    # Read by the job's supervisor actor, which runs with the job's runtime_env: how long Ray
    # waits between its SIGTERM and its SIGKILL when the job is stopped (Ray's default is 3 s).
    env_vars["RAY_JOB_STOP_WAIT_TIME_S"] = str(max(1, math.ceil(target.stop_wait)))
    runtime_env["env_vars"] = env_vars
    body: dict[str, Any] = {
        "entrypoint": entrypoint(python, job.remote_dir),
        "submission_id": states.submission_id(job.remote_dir),
        "runtime_env": runtime_env,
        "metadata": {"obd_run_id": job.run_id, "obd_run_dir": job.remote_dir.rstrip("/")},
    }
    if target.nodes > 1:
        return body  # the driver asks nothing: the placement group's bundles ask the resources
    optional = {
        "entrypoint_num_cpus": target.num_cpus,
        "entrypoint_num_gpus": target.num_gpus,
        "entrypoint_memory": target.memory,
        "entrypoint_resources": dict(target.resources) or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def headers(target: RayTarget) -> dict[str, str]:
    """The headers of every request: the target's own, and its token (from the daemon's environment)."""
    out = dict(target.headers)
    if target.token_env:
        token = os.environ.get(target.token_env)
        if not token:
            raise ExecutorError(
                f"token_env names {target.token_env}, which is not set in the daemon's environment: set it where "
                "the daemon starts (its systemd unit's Environment=, or the shell that runs `obd daemon`)"
            )
        out["Authorization"] = f"Bearer {token}"
    return out


def per_node(target: RayTarget) -> int:
    """torchrun's processes on each node: `nproc_per_node`, else one a GPU asked for, else one."""
    return target.nproc_per_node or int(target.num_gpus or 0) or 1


def launch_plan(target: RayTarget, python: str) -> dict[str, Any]:
    """What the job wrapper launches (its `slurm_launch.json`): the command on the node the Ray job
    runs on, as given or under a standalone torchrun; a multi-node run's command is obd's driver."""
    torchrun = target.launcher == "torchrun" and target.nodes == 1
    launcher = "torchrun" if torchrun else "srun"  # `srun` with one node: the command as given
    return {"nodes": 1, "launcher": launcher, "nproc_per_node": per_node(target), "python": python, "time_limit": None}


def nodes_plan(target: RayTarget, job: JobSpec) -> dict[str, Any]:
    """What obd's Ray driver (executors/ray/nodes.py) runs: the command on `nodes` bundles, each
    with the target's resources (CPU 1 where it names none)."""
    bundle: dict[str, float] = {"CPU": target.num_cpus if target.num_cpus is not None else 1.0}
    if target.num_gpus:
        bundle["GPU"] = target.num_gpus
    if target.memory:
        bundle["memory"] = float(target.memory)
    bundle.update(target.resources)
    return {
        "nodes": target.nodes,
        "launcher": target.launcher,
        "nproc_per_node": per_node(target),
        "python": target.python,
        "command": job.command,
        "run_id": job.run_id,
        # Each node's torchrun logs there (a folder a node), not in a `/tmp/torchelastic_*` left behind.
        "torchrun_logs": [rundir.RunPaths(job.remote_dir.rstrip("/")).torchrun_logs(i) for i in range(target.nodes)],
        "bundle": bundle,
        "grace": target.stop_wait / 2,
    }


def read_run(run_dir: str, job: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """One run directory's probe, its status from its files and Ray's view of its job."""
    result = jobctl.probe_dir(run_dir, with_job=False)
    facts = slurm_batch.file_facts(run_dir)
    record = read_submit(run_dir)
    submitting = record.get("submitting") if not record.get("submitted") else None
    settled = slurm_batch.settled(facts)
    result["status"] = states.combine(
        facts, settled, job, submitting if isinstance(submitting, (int, float)) else None, now
    )
    known = job is not None or bool(record)
    result["handle"] = states.ray_handle(states.submission_id(run_dir)) if known else None
    return result


def read_submit(run_dir: str) -> dict[str, Any]:
    data = rundir.read_regular(os.path.join(run_dir, SUBMIT_RECORD), 4096)
    try:
        value = json.loads(data) if data else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class RayExecutor:
    """Runs jobs on a Ray cluster; see the module docstring for how."""

    events: RunEvents | None = None
    # The daemon's files are the cluster's (docs/ray.md): a run's working directory is used where it is.
    shares_filesystem = True

    def __init__(self, name: str, target: RayTarget, *, settle_poll: float = 0.2) -> None:
        self.name = name
        self.target = target
        self.host = LocalExecutor(name, Path(target.workdir).expanduser(), target.python)
        self.api = JobsApi(target.address, headers(target), timeout=target.request_timeout)
        self.settle_poll = settle_poll

    # --- the cluster ------------------------------------------------------------------------------

    @property
    def workdir(self) -> str:
        return self.host.workdir

    async def resolve_workdir(self) -> str:
        return await self.host.resolve_workdir()

    async def reach(self) -> Reached:
        """Ask the Jobs API its version, and the dashboard the cluster's nodes and resources."""
        version = await self.api.version()
        where = f"the Ray cluster at {self.target.address} (Ray {version.get('ray_version', '?')}"
        try:
            found = await self.cluster_resources()
        except ExecutorError as exc:
            where += f"; its nodes could not be read: {exc})"
        else:
            have = ", ".join(
                f"{k} {v:g}" for k, v in sorted(found["resources"].items()) if not k.lower().endswith("memory")
            )
            where += f"; {found['nodes']} node(s) alive with {have or 'no resources'})"
        trust = "a bearer token" if self.target.token_env else "none (plain HTTP to the Jobs API)"
        return Reached(where=where, trust=trust, workdir=await self.resolve_workdir())

    async def cluster_resources(self) -> dict[str, Any]:
        """The cluster's nodes and resources as its dashboard reports them (for `obd targets check`)."""
        answer = await self.api.call("GET", "/nodes?view=summary")
        nodes = ((answer or {}).get("data") or {}).get("summary") or []
        total: dict[str, float] = {}
        alive = 0
        for node in nodes:
            raylet = node.get("raylet") or {}
            if raylet.get("state") != "ALIVE":
                continue
            alive += 1
            for key, value in (raylet.get("resourcesTotal") or {}).items():
                if not key.startswith("node:") and isinstance(value, (int, float)):
                    total[key] = total.get(key, 0.0) + float(value)
        return {"nodes": alive, "resources": total}

    async def python(self) -> str:
        return self.target.python

    async def run_command(self, argv: list[str], *, stdin: bytes = b"", timeout: float = 60.0) -> CommandResult:
        """A command on this machine, which shares the run directories with the cluster."""
        return await self.host.run_command(argv, stdin=stdin, timeout=timeout)

    async def aclose(self) -> None:
        await self.host.aclose()

    # --- jobs ------------------------------------------------------------------------------------

    def _check_run_as(self, job: JobSpec) -> None:
        """A Ray job runs as the user its Ray node runs as: never submitted for another user."""
        if job.run_as is not None and job.run_as.uid != os.geteuid():
            raise ExecutorError(
                f"run {job.run_id} is {job.run_as.user}'s, but a Ray target's jobs run as the user the Ray nodes "
                "run as: nothing was submitted; run a daemon of your own for this target (docs/ray.md)"
            )

    async def spawn(self, job: JobSpec) -> JobHandle:
        """Write the run's job files, then submit the job once under the run's submission id (a
        submit whose answer was lost is found by it, never made twice)."""
        self._check_run_as(job)
        rd = job.remote_dir.rstrip("/")
        paths = rundir.RunPaths(rd)
        python = await self.python()
        spec: dict[str, Any] = {
            "command": job.command,
            "cwd": job.cwd,
            "pythonpath": [paths.plugin],
            # An interpreter given by its path leads the job's PATH, so `python` is that one.
            "path_prepend": [str(Path(python).parent)] if os.path.isabs(python) else [],
            "umask": job.umask,
            "output_to": job.output_to,
        }
        if self.target.nodes > 1:  # the wrapper runs obd's Ray driver, which runs the command on each node
            await self.host.put_file(os.path.join(rd, nodes.PLAN), json.dumps(nodes_plan(self.target, job)).encode())
            await self.host.put_file(os.path.join(rd, NODES_SCRIPT), Path(nodes.__file__).read_bytes())
            spec["command"] = [python, os.path.join(rd, NODES_SCRIPT), rd]
        await self.host.put_file(paths.job_spec, json.dumps(spec).encode())
        plan = launch_plan(self.target, python)
        await self.host.put_file(paths.slurm_launch, json.dumps(plan).encode())
        sid = states.submission_id(rd)
        record_path = os.path.join(rd, SUBMIT_RECORD)
        try:
            if await self.api.job(sid) is None:
                await self.host.put_file(
                    record_path, json.dumps({"submission_id": sid, "submitting": time.time()}).encode()
                )
                answer = await self.api.submit(submit_body(self.target, job, python))
                log.info(
                    "ray.submitted", target=self.name, run_id=job.run_id, submission_id=answer.get("submission_id")
                )
            else:
                log.info("ray.submit_found", target=self.name, run_id=job.run_id, submission_id=sid)
        except TargetUnreachable as exc:
            # The submit may have gone through: never submitted again; the probe finds the job by its id.
            raise LaunchUncertain(f"{exc}; whether Ray took the job is not known yet") from exc
        except ExecutorError as exc:
            if "already exists" in str(exc):
                log.info("ray.submit_found", target=self.name, run_id=job.run_id, submission_id=sid)
            else:
                raise ExecutorError(f"{exc}; `obd targets check {self.name}` checks the target") from exc
        record = {"submission_id": sid, "submitting": None, "submitted": time.time()}
        await self.host.put_file(record_path, json.dumps(record).encode())
        return JobHandle.model_validate(states.ray_handle(sid))

    async def status(self, handle: JobHandle, remote_dir: str) -> JobStatus:
        return (await self.probe([(handle, remote_dir)]))[0].status

    async def probe(self, runs: list[tuple[JobHandle | None, str]]) -> list[RunProbe]:
        """Every run directory, and one `GET /api/jobs/` for all their jobs."""
        if not runs:
            return []
        jobs = {str(j.get("submission_id")): j for j in await self.api.jobs()}
        now = time.time()

        def read() -> list[dict[str, Any]]:
            return [read_run(d, jobs.get(states.submission_id(d)), now) for _, d in runs]

        found = await anyio.to_thread.run_sync(read, abandon_on_cancel=True)
        return [RunProbe.model_validate(p) for p in found]

    async def cancel(self, handle: JobHandle, remote_dir: str, grace: float) -> JobStatus:
        """Mark the run cancelling, stop its Ray job (Ray's SIGTERM to every process of it, SIGKILL
        `stop_wait` later), wait for Ray's end of it, then mark it cancelled. Idempotent."""
        rd = remote_dir.rstrip("/")
        paths = rundir.RunPaths(rd)
        facts = await anyio.to_thread.run_sync(slurm_batch.file_facts, rd)
        if facts["cancelled"] or (facts["exit_code"] is not None and not facts["cancelling"]):
            state = "cancelled" if facts["cancelled"] else "exited"
            return JobStatus.model_validate({"state": state, "exit_code": facts["exit_code"]})
        # Written first: the wrapper then takes Ray's TERM for the cancel it is, not a preemption.
        await self.host.put_file(paths.cancelling, f"{time.time()}\n".encode())
        sid = states.submission_id(rd)
        stopped = await self.api.stop(sid)
        # Ray's stop returns at once; its SIGKILL comes `stop_wait` after its SIGTERM at the latest.
        with anyio.move_on_after(self.target.stop_wait + 60):
            while True:
                job = await self.api.job(sid)
                if job is None or job.get("status") in states.ENDED:
                    break
                await anyio.sleep(self.settle_poll)
        record = {"time": time.time(), "ray_stopped": stopped, "submission_id": sid}
        await self.host.put_file(paths.cancelled, json.dumps(record).encode())
        log.info("ray.cancelled", target=self.name, submission_id=sid, stopped=stopped)
        code = await anyio.to_thread.run_sync(jobctl.read_int, paths.exit_code)
        return JobStatus.model_validate({"state": "cancelled", "exit_code": code})

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        raise ExecutorError(
            f"`obd train exec` and `obd train shell` are not supported on Ray target {self.name}: Ray's Jobs API "
            "has no way into a running job (no command beside it, no input, no terminal); `obd train logs "
            f"{spec.run_id}` shows its output and {spec.remote_dir} (on the shared filesystem) its files (docs/ray.md)"
        )

    # --- files: on the filesystem this machine shares with the cluster ------------------------------

    async def make_run_dir(self, remote_dir: str, owner: RunAs | None) -> None:
        await self.host.make_run_dir(remote_dir, None)

    async def read_from(self, path: str, offset: int, limit: int) -> bytes:
        return await self.host.read_from(path, offset, limit)

    async def checkpoint_sizes(self, remote_dir: str) -> dict[str, int]:
        return await self.host.checkpoint_sizes(remote_dir)

    async def remove_checkpoint(self, remote_dir: str, name: str) -> int:
        return await self.host.remove_checkpoint(remote_dir, name)

    async def put_file(self, path: str, data: bytes) -> None:
        await self.host.put_file(path, data)

    async def upload(self, local: Path, remote: str) -> None:
        await self.host.upload(local, remote)

    async def download(self, remote: str, local: Path) -> None:
        await self.host.download(remote, local)

    async def logs(self, remote_dir: str) -> str:
        """What Ray kept of the job's own output (its runtime_env setup, a wrapper that never ran)."""
        with contextlib.suppress(ExecutorError):
            return await self.api.logs(states.submission_id(remote_dir))
        return ""
