"""What obd gives sbatch for a run: the options, the batch script and the launch plan (pure functions).

Kept apart from the executor so the exact sbatch line can be checked without a cluster. The
batch script only execs obd's job wrapper (`trainer_plugin/tools/slurm_batch.py batch`) from the run's
`plugin/`, which is on the shared workdir, so compute nodes need nothing of obd installed.
"""

from __future__ import annotations

import math
from typing import Any

from executors import remote
from executors.slurm.config import SlurmTarget, slurm_time_seconds
from trainer_plugin import rundir


def job_name(run_id: str) -> str:
    """The Slurm job name of a run: how a submit whose answer was lost is found again."""
    return f"obd-{run_id}"


def job_time(target: SlurmTarget, time_limit: float | None, stop_lead: float | None) -> tuple[str | None, float]:
    """The job's `--time` and how long before it Slurm signals for the `deadline` snapshot.

    The target's `time` and `signal_margin`, unless the run's own limit (its chain's time limit or
    deadline, docs/limits.md) is shorter: then that limit, in whole minutes as Slurm counts them
    (rounded up), with the signal `stop_lead` before the run's own limit, not the rounded one."""
    own = target.time_limit()
    if time_limit is None or (own is not None and own <= time_limit):
        return target.time, target.signal_margin
    minutes = max(1, math.ceil(time_limit / 60))
    return str(minutes), min(65535.0, minutes * 60.0, minutes * 60.0 - time_limit + (stop_lead or 0.0))


def sbatch_arguments(
    target: SlurmTarget,
    run_id: str,
    remote_dir: str,
    time_limit: float | None = None,
    stop_lead: float | None = None,
) -> list[str]:
    """The sbatch options of a run (without the script): obd's own, then the target's; a run with a
    time limit of its own shorter than the target's gets it (`job_time`)."""
    rd = remote_dir.rstrip("/")
    time, signal_margin = job_time(target, time_limit, stop_lead)
    args = [
        f"--job-name={job_name(run_id)}",
        f"--comment={run_id}",
        f"--output={rundir.RunPaths(rd).job_log}",
        "--open-mode=append",
        f"--chdir={rd}",
        f"--nodes={target.nodes}",
        "--ntasks-per-node=1",
        # The environment sbatch runs with reaches the job (obd builds it: never the daemon's own).
        "--export=ALL",
        # obd resumes a run as a new job from its snapshot (--retry); a Slurm requeue would start
        # the same run directory over, its exit code and proof already there.
        "--no-requeue",
    ]
    optional = {
        "--partition": target.partition,
        "--account": target.account,
        "--qos": target.qos,
        "--time": time,
        "--gpus-per-node": target.gpus_per_node,
        "--cpus-per-task": target.cpus_per_task,
        "--mem": target.mem,
        "--constraint": target.constraint,
    }
    args += [f"{option}={value}" for option, value in optional.items() if value is not None]
    if signal_margin > 0:
        # To the batch shell only (B:): the wrapper turns it into a `deadline` snapshot request.
        args.append(f"--signal=B:USR1@{max(1, round(signal_margin))}")
    return [*args, *target.sbatch_options]


def batch_script(python: str, remote_dir: str, run_id: str) -> str:
    """The batch script: exec the job wrapper from the run's plugin/, so it gets Slurm's signals itself."""
    rd = remote_dir.rstrip("/")
    wrapper = rundir.RunPaths(rd).tool("slurm_batch.py")
    return (
        "#!/bin/sh\n"
        f"# obd run {run_id}: obd's job wrapper writes job.pid and exit_code, turns Slurm's signals\n"
        "# into snapshot requests and starts the command (on every node with srun).\n"
        f"exec {remote.join([python, wrapper, 'batch', rd])}\n"
    )


def launch_plan(target: SlurmTarget, python: str, time_limit: float | None = None) -> dict[str, Any]:
    """How the wrapper launches the command: on how many nodes, with which launcher and Python, and
    the job's time limit in seconds (a TERM near it asks for a `deadline` snapshot)."""
    per_node = target.nproc_per_node or target.gpus_per_node or 1
    time, _ = job_time(target, time_limit, None)
    return {
        "nodes": target.nodes,
        "launcher": target.launcher,
        "nproc_per_node": per_node,
        "python": python,
        "time_limit": slurm_time_seconds(time) if time else None,
    }
