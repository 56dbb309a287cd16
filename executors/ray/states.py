"""What Ray's job states mean to obd, and a run's status from its run directory and Ray's view (pure).

The job wrapper (the Slurm batch wrapper, `trainer_plugin/tools/slurm_batch.py batch`, which needs
nothing of Slurm on one node) writes the end marker and `exit_code` into the run directory on the
shared filesystem; Ray says whether the job is queued, running, or ended and why. The run
directory decides where it can (`slurm_batch.settled`), Ray where it cannot.
"""

from __future__ import annotations

import os
from typing import Any

# Ray's JobStatus values (ray.job_submission.JobStatus).
PENDING = "PENDING"
RUNNING = "RUNNING"
ACTIVE = frozenset({PENDING, RUNNING})
ENDED = frozenset({"STOPPED", "SUCCEEDED", "FAILED"})
SUBMIT_GRACE = 120.0  # a submit younger than this whose job Ray does not know yet may still be under way


def submission_id(run_dir: str) -> str:
    """The Ray job of a run: `obd-<run id>`, the run id being its directory's name. Given at the
    submit, so a submit whose answer was lost is found again, and never made twice."""
    return "obd-" + os.path.basename(os.path.normpath(run_dir))


def ray_handle(sid: str | None) -> dict[str, Any]:
    """A run's handle as the daemon records it: the Ray job's submission id stands where a pid would."""
    return {"pid": 0, "start_time": 0, "boot_id": "", "host": f"ray job {sid}" if sid else "ray"}


def _said(job: dict[str, Any]) -> str:
    message = str(job.get("message") or "").strip().splitlines()
    return f"Ray: {job.get('status')}" + (f" ({message[-1][:300]})" if message else "")


def combine(
    facts: dict[str, Any],
    settled: dict[str, Any] | None,
    job: dict[str, Any] | None,
    submitting: float | None,
    now: float,
) -> dict[str, Any]:
    """{state, exit_code, detail} of a run: `settled` (the run directory alone settles it) first;
    an exit code with Ray's job still running waits for Ray's end; with no exit code, Ray's state
    (queued, running, or ended without the wrapper's word: killed or never started)."""
    if settled is not None:
        return settled
    code = facts["exit_code"]
    state = job.get("status") if job is not None else None
    if code is not None:
        if state in ACTIVE:
            return {"state": "running", "exit_code": None, "detail": f"exit {code}: waiting for Ray's end of the job"}
        return {"state": "exited", "exit_code": code, "detail": _said(job) if job is not None else None}
    if job is None:
        if submitting is not None and now - submitting < SUBMIT_GRACE:
            return {"state": "pending", "exit_code": None, "detail": "being submitted to Ray"}
        if facts["cancelling"]:
            return {"state": "cancelled", "exit_code": None, "detail": None}
        return {
            "state": "lost",
            "exit_code": None,
            "detail": "the Ray cluster does not know the run's job and it left no exit code (a cluster restarted "
            "or replaced forgets its jobs)",
        }
    if state == PENDING:
        return {"state": "pending", "exit_code": None, "detail": _said(job)}
    if state == RUNNING:
        return {"state": "running", "exit_code": None, "detail": None}
    if facts["cancelling"] or (state == "STOPPED" and facts.get("cancelled")):
        return {"state": "cancelled", "exit_code": None, "detail": _said(job)}
    # Ended with no exit code from the wrapper: killed (a stop outside obd, a node lost), or the
    # wrapper never ran (the runtime_env could not be set up, python not found on the node).
    return {"state": "lost", "exit_code": None, "detail": _said(job)}
