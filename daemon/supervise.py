"""The names the daemon imported from here before the stop rules moved to `daemon.stop_rules`.

Kept only while `daemon/` switches over (then deleted). `final_state(record, status)` keeps its
old two-argument form and tuple result, without the checkpoint check that
`stop_rules.final_state(record, status, checkpoints)` adds.
"""

from __future__ import annotations

from daemon.models import RunRecord, RunState
from daemon.progress import update_progress
from daemon.stop_rules import (
    FinalDecision,
    StopTimes,
    Verdict,
    apply_probe,
    fallback_reason,
    format_duration,
    judge_proof,
    state_from_exit,
    validate_proof,
)
from executors.base import JobStatus
from trainer_plugin.rundir import PROOF_LIMIT

__all__ = [
    "PROOF_LIMIT",
    "FinalDecision",
    "StopTimes",
    "Verdict",
    "apply_probe",
    "fallback_reason",
    "final_state",
    "format_duration",
    "judge_proof",
    "update_progress",
    "validate_proof",
]


def final_state(record: RunRecord, status: JobStatus) -> tuple[RunState, str]:
    """The run's final state and message from how the job ended and what proof it left (the old form)."""
    return state_from_exit(record, status)
