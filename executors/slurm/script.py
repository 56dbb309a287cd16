"""What obd gives sbatch for a run: the options, the batch script and the launch plan (pure functions).

Kept apart from the executor so the exact sbatch line can be checked without a cluster. The
batch script only execs obd's job wrapper (`trainer_plugin/slurm_batch.py batch`) from the run's
`plugin/`, which is on the shared workdir, so compute nodes need nothing of obd installed.
"""

from __future__ import annotations

from typing import Any

from executors import remote
from executors.config import SlurmTarget
from trainer_plugin import rundir


def job_name(run_id: str) -> str:
    """The Slurm job name of a run: how a submit whose answer was lost is found again."""
    return f"obd-{run_id}"


def sbatch_arguments(target: SlurmTarget, run_id: str, remote_dir: str) -> list[str]:
    """The sbatch options of a run (without the script): obd's own, then the target's."""
    rd = remote_dir.rstrip("/")
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
        "--time": target.time,
        "--gpus-per-node": target.gpus_per_node,
        "--cpus-per-task": target.cpus_per_task,
        "--mem": target.mem,
        "--constraint": target.constraint,
    }
    args += [f"{option}={value}" for option, value in optional.items() if value is not None]
    if target.signal_margin > 0:
        # To the batch shell only (B:): the wrapper turns it into a `deadline` snapshot request.
        args.append(f"--signal=B:USR1@{max(1, round(target.signal_margin))}")
    return [*args, *target.sbatch_options]


def batch_script(python: str, remote_dir: str, run_id: str) -> str:
    """The batch script: exec the job wrapper from the run's plugin/, so it gets Slurm's signals itself."""
    rd = remote_dir.rstrip("/")
    wrapper = rundir.RunPaths(rd).plugin_module("slurm_batch.py")
    return (
        "#!/bin/sh\n"
        f"# obd run {run_id}: obd's job wrapper writes job.pid and exit_code, turns Slurm's signals\n"
        "# into snapshot requests and starts the command (on every node with srun).\n"
        f"exec {remote.join([python, wrapper, 'batch', rd])}\n"
    )


def launch_plan(target: SlurmTarget, python: str) -> dict[str, Any]:
    """How the wrapper launches the command: on how many nodes, with which launcher and Python."""
    per_node = target.nproc_per_node or target.gpus_per_node or 1
    return {
        "nodes": target.nodes,
        "launcher": target.launcher,
        "nproc_per_node": per_node,
        "python": python,
        "time_limit": target.time_limit(),
    }
