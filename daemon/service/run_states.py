"""The run state machine: which state may follow which, and why each edge exists (issue 35, item 3).

One table, consulted by `RunRecord.transition()`, so a bug elsewhere cannot send a run backwards
or out of a final state: a run that ended stays as it ended (a retry, a pause or a resume is a
new attempt, a new record). A transition to the same state is a new message for it (a queued
run whose reason to wait changed), allowed where the state can say more than once why it is so.
"""

from __future__ import annotations

from daemon.common.wire import CANCELLED, FAILED, PREPARING, QUEUED, RUNNING, STOPPED, SUCCEEDED

# state -> {next state: why this edge exists}
EDGES: dict[str, dict[str, str]] = {
    PREPARING: {
        QUEUED: "a new run waits for its GPUs, its time or its dependencies; a launch cut short by a daemon restart goes back to the queue",
        PREPARING: "a new record (created preparing) is launched now",
        RUNNING: "its job started (or was found started after a daemon restart)",
        FAILED: "the launch failed, or the daemon stopped while launching and the job never started",
        CANCELLED: "cancelled by the user before the job started",
    },
    QUEUED: {
        QUEUED: "still waiting, for another reason (the scheduler's, the queue's)",
        PREPARING: "it left the queue: its GPUs, time and dependencies are there",
        RUNNING: "the target's scheduler started its job",
        FAILED: "it can never start (its target is gone, its settings no longer hold)",
        CANCELLED: "cancelled while queued: by the user, a failed dependency, or its sweep",
    },
    RUNNING: {
        QUEUED: "the target's scheduler holds its job pending again (requeued)",
        STOPPED: "it stopped with a proven snapshot",
        SUCCEEDED: "its job ended with exit 0",
        FAILED: "its job failed, or the daemon lost it",
        CANCELLED: "it was cancelled (by the user, a limit, or the stop fallback)",
    },
    STOPPED: {},
    SUCCEEDED: {},
    FAILED: {},
    CANCELLED: {},
}


class IllegalTransition(ValueError):
    """A state change the table does not allow: a bug in the daemon, never the user's doing."""


def check_transition(run_id: str, current: str, new: str) -> None:
    """Raise IllegalTransition unless `new` may follow `current`."""
    if new in EDGES.get(current, {}):
        return
    if not EDGES.get(current, {}):
        raise IllegalTransition(f"run {run_id} ended {current}; it cannot become {new} (a final state is kept)")
    raise IllegalTransition(f"run {run_id} is {current}; it cannot become {new} (daemon/service/run_states.py)")
