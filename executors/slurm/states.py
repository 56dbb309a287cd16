"""What Slurm's end states mean for a run: a message that says what happened and what to do next.

The wrapper's end marker (its exit code) and the proof decide a run's final state, as on every
target; Slurm's own end state (from squeue, `scontrol show job` or sacct) explains an end the
wrapper could not record (the job killed at its time limit, with its node, for its memory) and
is added to the run's message, and wins over a marker's exit 0 where the marker shows Slurm's
hand (`trainer_plugin/tools/slurm_batch.py`'s `contested`; docs/slurm.md).
"""

from __future__ import annotations

from pydantic import BaseModel

# Slurm's end states worth telling the user about even when the wrapper recorded an exit code.
NOTABLE = frozenset({"TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


class SlurmJob(BaseModel):
    """One Slurm job as obd last saw it."""

    job_id: str | None = None
    name: str | None = None  # obd's jobs are named `obd-<run id>`
    state: str | None = None  # squeue's %T / scontrol's JobState: PENDING, RUNNING, TIMEOUT, ...
    reason: str | None = None
    nodes: str | None = None
    exit_code: str | None = None  # Slurm's "code:signal" of the batch script, when known
    source: str | None = None  # squeue, scontrol or sacct


def parse_scontrol(text: str) -> SlurmJob | None:
    """`scontrol show job --oneliner ID` as a SlurmJob; None when it printed no job."""
    fields: dict[str, str] = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in fields:
            fields[key] = value
    if "JobId" not in fields:
        return None
    return SlurmJob(
        job_id=fields["JobId"],
        state=fields.get("JobState"),
        reason=fields.get("Reason"),
        nodes=fields.get("NodeList"),
        exit_code=fields.get("ExitCode"),
        source="scontrol",
    )


def parse_sacct(text: str) -> SlurmJob | None:
    """The job's own line of `sacct -n -P -X -o JobID,State,ExitCode,NodeList,Reason`."""
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) >= 3 and parts[0]:
            state = parts[1].split()[0] if parts[1] else None  # "CANCELLED by 0" -> CANCELLED
            return SlurmJob(
                job_id=parts[0],
                state=state,
                exit_code=parts[2] or None,
                nodes=parts[3] if len(parts) > 3 else None,
                reason=parts[4] if len(parts) > 4 else None,
                source="sacct",
            )
    return None


def end_message(job: SlurmJob, run_id: str, *, time_limit: str | None, signal_margin: float) -> str:
    """Why Slurm ended the job, and what to do; empty for an end that needs no word (COMPLETED, FAILED)."""
    state = (job.state or "").split("+")[0]
    jid = f"Slurm job {job.job_id}" if job.job_id else "the Slurm job"
    resume = f"`obd train resume {run_id}` continues from its newest checkpoint"
    if state == "TIMEOUT":
        limit = (
            f" ({time_limit} min)" if time_limit and time_limit.isdigit() else f" ({time_limit})" if time_limit else ""
        )
        margin = (
            f"signal_margin ({signal_margin:g}s) was too short for a step and a checkpoint"
            if signal_margin > 0
            else "signal_margin is 0, so no deadline snapshot was asked for"
        )
        return f"{jid} reached its time limit{limit} and Slurm ended it (TIMEOUT): {margin}; raise `time` or `signal_margin`; {resume}"
    if state == "NODE_FAIL":
        where = f" ({job.nodes})" if job.nodes else ""
        return f"a node of {jid} failed{where} and Slurm ended the job (NODE_FAIL); {resume}, or start with --retry N"
    if state == "PREEMPTED":
        return (
            f"Slurm preempted {jid} (PREEMPTED); start runs with --snapshot-on-sigterm so a preemption snapshots, "
            f"and --retry N to resume automatically; {resume}"
        )
    if state == "OUT_OF_MEMORY":
        return f"{jid} ran out of memory (OUT_OF_MEMORY); raise the target's `mem` or lower the batch size; see `obd train logs {run_id}`"
    if state == "BOOT_FAIL":
        return f"the nodes of {jid} failed to boot (BOOT_FAIL); start the run again, and tell the cluster's admins"
    if state == "DEADLINE":
        return f"{jid} passed its --deadline (DEADLINE) and Slurm ended it; remove --deadline from sbatch_options or move it"
    if state == "CANCELLED":
        return f"{jid} was cancelled in Slurm (scancel outside obd)"
    return ""


def lost_message(
    job: SlurmJob | None,
    run_id: str,
    *,
    time_limit: str | None,
    signal_margin: float,
    command_exit: int | None = None,
) -> str:
    """The message of a run whose job left no exit code, or whose end marker said its command
    exited `command_exit` but Slurm ended the job for a reason of its own, with what Slurm says."""
    logs = f"see `obd train logs {run_id}`"
    if command_exit is not None and job is not None and job.state:
        said = end_message(job, run_id, time_limit=time_limit, signal_margin=signal_margin) or f"Slurm says {job.state}"
        return (
            f"{said}; its command had exited {command_exit} (the job's end marker), but Slurm ended the job "
            f"itself ({job.state.split()[0]}), and Slurm's end state wins; {logs}"
        )
    if job is None or not job.state:
        return f"lost: Slurm no longer knows its job and the job wrapper left no exit code; {logs}"
    said = end_message(job, run_id, time_limit=time_limit, signal_margin=signal_margin)
    if said:
        return f"{said}; {logs}"
    return (
        f"lost: Slurm says {job.state} and the job wrapper left no exit code (killed with its node or by Slurm); {logs}"
    )
