"""The stop rules (daemon/service/stop.py) row by row against the contract (docs/contract.md), with no daemon and no process.

One row per line of SPEC's "Run states" and "Snapshot and stop", named by the rule it checks.
Three lines are not decided here and have no row: a launch that failed (the launcher fails the
run), `train stop` refusing a job without the plugin (the socket handler), and a read of the
target that hangs (the follow's timeout); tests/daemon/test_stop.py checks them under the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from daemon.service.models import RunRecord, RunState, Snapshot
from daemon.service.stop import Verdict, apply_probe, fallback_reason, final_state
from executors.base import JobState, JobStatus, RunProbe
from trainer_plugin import rundir


@dataclass
class Stop:
    proof_timeout: float = 1800.0
    end_timeout: float = 600.0


STOP = Stop()
RUNNING = JobStatus(state=JobState.running)
BEGIN = {"event": "begin", "time": 0.0, "max_steps": 100, "snapshots": True, "version": "test"}


def proof_text(step: int, reason: str = "requested") -> str:
    return rundir.proof_bytes(step, reason, 10.0).decode()


def probe(
    status: JobStatus = RUNNING,
    *,
    request: str | None = None,
    proof: str | None = None,
    checkpoints: tuple[str, ...] = (),
    begin: dict[str, Any] | None = BEGIN,
    **extra: Any,
) -> RunProbe:
    return RunProbe(
        remote_dir="/w/r1",
        status=status,
        request=request,
        proof=proof,
        checkpoints=list(checkpoints),
        begin=begin,
        **extra,
    )


def running(snapshots: bool = True) -> RunRecord:
    return RunRecord(id="r1", command=["train"], state=RunState.running, snapshots=snapshots)


def exited(code: int) -> JobStatus:
    return JobStatus(state=JobState.exited, exit_code=code)


CANCELLED = JobStatus(state=JobState.cancelled)
LOST = JobStatus(state=JobState.lost)


# --- "Run states": how a run ends ------------------------------------------------------------------


@dataclass
class End:
    """A run's life as probes at times, then how its job ended and which checkpoints are left."""

    probes: list[tuple[float, RunProbe]] = field(default_factory=list)
    cancel_by: str | None = None
    fallback: str | None = None
    status: JobStatus = field(default_factory=lambda: exited(0))
    checkpoints: tuple[str, ...] = ()


def proven(step: int = 4, reason: str = "requested") -> list[tuple[float, RunProbe]]:
    """A request seen at t=10, then the proof of `step` with its checkpoint at t=20."""
    return [
        (10.0, probe(request=reason)),
        (20.0, probe(request=reason, proof=proof_text(step, reason), checkpoints=(f"checkpoint-{step}",))),
    ]


RUN_STATES = [
    pytest.param(
        End(proven(), status=exited(0), checkpoints=("checkpoint-4",)),
        RunState.stopped,
        "snapshot output/checkpoint-4 at step 4 (requested)",
        True,
        id="stopped: a valid proof exists and the job exited 0",
    ),
    pytest.param(
        End(proven(), cancel_by="user", status=CANCELLED, checkpoints=("checkpoint-4",)),
        RunState.stopped,
        "then cancelled",
        True,
        id="stopped: the job was cancelled after it wrote the proof",
    ),
    pytest.param(
        End(
            proven(),
            cancel_by="fallback",
            fallback="the job still ran 10 min after its snapshot",
            status=CANCELLED,
            checkpoints=("checkpoint-4",),
        ),
        RunState.stopped,
        "then cancelled: the job still ran 10 min after its snapshot",
        True,
        id="stopped: the proof decides when the end_timeout fallback cancelled the job",
    ),
    pytest.param(
        End([(10.0, probe())], status=exited(0)),
        RunState.succeeded,
        "exit 0",
        False,
        id="succeeded: exit 0 and no proof",
    ),
    pytest.param(
        End([(10.0, probe())], status=exited(3)),
        RunState.failed,
        "exit 3; see `obd train logs r1`",
        False,
        id="failed: a non-zero exit says where to look",
    ),
    pytest.param(
        End(proven(), status=exited(1), checkpoints=("checkpoint-4",)),
        RunState.failed,
        "exit 1",
        True,
        id="failed: a non-zero exit keeps its proven snapshot to retry from",
    ),
    pytest.param(
        End([(10.0, probe())], status=LOST),
        RunState.failed,
        "lost: the job has no exit code and no process",
        False,
        id="failed: lost, no exit code and no process",
    ),
    pytest.param(
        End([(10.0, probe(request="requested", proof='{"checkpoint": "../../etc", "step": 3}'))], status=exited(0)),
        RunState.failed,
        "invalid snapshot proof: snapshot.json names a checkpoint other than output/checkpoint-3",
        False,
        id="failed: an invalid proof, though the job exited 0",
    ),
    pytest.param(
        End([(10.0, probe(request="requested", proof=proof_text(3)))], status=exited(0), checkpoints=("checkpoint-3",)),
        RunState.failed,
        "invalid snapshot proof: snapshot.json names output/checkpoint-3, which is not a real directory",
        False,
        id="failed: a proof whose checkpoint was not a real directory when it came",
    ),
    pytest.param(
        End(
            [(10.0, probe(request="requested", proof_not_regular="a FIFO"))],
            cancel_by="fallback",
            fallback="no snapshot within 30 min of the request",
            status=CANCELLED,
        ),
        RunState.failed,
        "invalid snapshot proof: snapshot.json is a FIFO, not a regular file",
        False,
        id="failed: an invalid proof, though the job was then cancelled",
    ),
    pytest.param(
        End(proven(), status=exited(0), checkpoints=()),
        RunState.failed,
        "the snapshot proof names output/checkpoint-4, which is not in the run directory",
        False,
        id="failed: the proven checkpoint is gone by the end, and no snapshot is shown",
    ),
    pytest.param(
        End(proven(), status=exited(2), checkpoints=("checkpoint-9",)),
        RunState.failed,
        "exit 2; see `obd train logs r1`; the snapshot proof names output/checkpoint-4, which is not in the run directory",
        False,
        id="failed: a failed run whose checkpoint is missing shows no snapshot",
    ),
    pytest.param(
        End([(10.0, probe())], cancel_by="user", status=CANCELLED),
        RunState.cancelled,
        "cancelled by the user",
        False,
        id="cancelled: by the user, saying so",
    ),
    pytest.param(
        End(
            [(10.0, probe(request="requested"))],
            cancel_by="fallback",
            fallback="no snapshot within 30 min of the request",
            status=CANCELLED,
        ),
        RunState.cancelled,
        "cancelled by the stop fallback: no snapshot within 30 min of the request",
        False,
        id="cancelled: by the stop fallback when no proof came, saying so",
    ),
    pytest.param(
        End([(10.0, probe())], status=CANCELLED),
        RunState.cancelled,
        "cancelled on the target",
        False,
        id="cancelled: on the target by someone else, saying so",
    ),
]


@pytest.mark.parametrize("end, state, message, snapshot_stands", RUN_STATES)
def test_a_run_ends_as_its_line_of_run_states_says(
    end: End, state: RunState, message: str, snapshot_stands: bool
) -> None:
    record = running()
    for now, seen in end.probes:
        apply_probe(record, seen, now, STOP)
    record.stop.cancel_by, record.stop.fallback = end.cancel_by, end.fallback
    final = apply_probe(record, probe(end.status, checkpoints=end.checkpoints), 30.0, STOP).final
    assert final == end.status  # a job that is no longer running is finished
    decision = final_state(record, end.status, list(end.checkpoints))
    assert decision.state == state
    assert message in decision.message
    assert decision.snapshot_stands == snapshot_stands


# --- "Snapshot and stop": requests, proofs and the fallback --------------------------------------


def follow(record: RunRecord, *probes: tuple[float, RunProbe]) -> Verdict:
    verdict = Verdict()
    for now, seen in probes:
        verdict = apply_probe(record, seen, now, STOP)
    return verdict


def test_a_request_is_one_reason_word_counted_from_when_it_was_first_seen() -> None:
    record = running()
    follow(record, (5.0, probe()), (12.0, probe(request="requested\n")))
    assert (record.stop.requested_at, record.stop.reason) == (12.0, "requested")
    assert [h.reason for h in record.history][-1] == "snapshot requested (requested)"


def test_asking_again_changes_only_the_reason() -> None:
    record = running()
    follow(record, (12.0, probe(request="requested")), (40.0, probe(request="disk")), (50.0, probe(request="disk")))
    assert (record.stop.requested_at, record.stop.reason) == (12.0, "disk")
    assert [h.reason for h in record.history].count("snapshot request reason changed to disk") == 1


@pytest.mark.parametrize(
    "written, reason",
    [
        pytest.param(None, None, id="a missing request is no request"),
        pytest.param("", None, id="an empty request is no request"),
        pytest.param(" \n", None, id="a blank request is no request"),
        *[pytest.param(word, word, id=f"{word} is a reason word") for word in rundir.REASONS],
        pytest.param("shutdown", "requested", id="any other word is requested"),
        pytest.param("COST", "requested", id="words match exactly"),
    ],
)
def test_a_request_file_means_the_reason_word_spec_gives_it(written: str | None, reason: str | None) -> None:
    record = running()
    follow(record, (12.0, probe(request=written)))
    assert record.stop.reason == reason
    assert record.stop.requested_at == (None if reason is None else 12.0)


def test_no_proof_proof_timeout_after_the_request_cancels_the_job_as_cancelled() -> None:
    record = running()
    assert follow(record, (100.0, probe(request="requested")), (1899.0, probe(request="requested"))).cancel is None
    verdict = follow(record, (1900.0, probe(request="requested")))
    assert verdict.cancel == "no snapshot within 30 min of the request"
    record.stop.cancel_by, record.stop.fallback = "fallback", verdict.cancel
    decision = final_state(record, CANCELLED, [])
    assert decision.state == RunState.cancelled and "no snapshot within 30 min of the request" in decision.message


def test_a_proof_and_the_job_still_running_end_timeout_later_cancels_it_and_the_proof_decides() -> None:
    record = running()
    follow(record, *proven())
    assert fallback_reason(record, 20.0 + 599.0, STOP) is None
    verdict = follow(record, (620.0, probe(request="requested", proof=proof_text(4), checkpoints=("checkpoint-4",))))
    assert verdict.cancel == "the job still ran 10 min after its snapshot"
    record.stop.cancel_by, record.stop.fallback = "fallback", verdict.cancel
    decision = final_state(record, CANCELLED, ["checkpoint-4"])
    assert decision.state == RunState.stopped and decision.snapshot_stands


def test_a_request_written_by_someone_else_runs_the_same_fallback_counted_from_when_it_was_seen() -> None:
    record = running()
    follow(record, (1000.0, probe(request="cost")))  # written earlier by the watchdog; seen now
    assert fallback_reason(record, 1000.0 + 1799.0, STOP) is None
    assert fallback_reason(record, 1000.0 + 1800.0, STOP) == "no snapshot within 30 min of the request"
    assert record.stop.reason == "cost"


def test_a_job_not_running_the_plugin_is_never_cancelled_for_a_request() -> None:
    record = running(snapshots=False)
    verdict = follow(
        record, (10.0, probe(request="requested", begin=None)), (10**6, probe(request="requested", begin=None))
    )
    assert verdict.cancel is None and verdict.final is None
    assert "cannot snapshot" in record.history[-1].reason


def test_a_begin_line_with_snapshots_true_announces_the_plugin() -> None:
    record = running(snapshots=False)
    follow(record, (10.0, probe(begin={"event": "begin", "snapshots": False})))
    assert not record.snapshots
    follow(record, (11.0, probe(begin=BEGIN)))
    assert record.snapshots


def test_a_request_at_the_last_step_lets_the_run_end_as_usual() -> None:
    record = running()
    verdict = follow(record, (10.0, probe(request="requested")), (11.0, probe(exited(0), request="requested")))
    assert verdict.final == exited(0) and verdict.cancel is None
    decision = final_state(record, exited(0), ["checkpoint-100"])
    assert (decision.state, decision.message, decision.snapshot_stands) == (RunState.succeeded, "exit 0", False)


# --- the proof rule, as the follow sees it ----------------------------------------------------------

PROOFS = [
    pytest.param(
        probe(proof=proof_text(4, "deadline"), checkpoints=("checkpoint-4",)),
        Snapshot(checkpoint="output/checkpoint-4", step=4, reason="deadline", time=10.0),
        id="a proof of a real checkpoint directory is taken",
    ),
    pytest.param(
        probe(proof=proof_text(4), checkpoints=("checkpoint-40",)),
        "which is not a real directory in the run's output/",
        id="a proof of a checkpoint that is missing, or a link, is invalid",
    ),
    pytest.param(
        probe(proof='{"checkpoint": "/etc", "step": 4}', checkpoints=("checkpoint-4",)),
        "other than output/checkpoint-4",
        id="a proof naming any other path is invalid",
    ),
    pytest.param(
        probe(proof=proof_text(4), proof_too_large=True, checkpoints=("checkpoint-4",)),
        "larger than 64 KiB",
        id="a proof larger than 64 KiB is invalid",
    ),
    pytest.param(
        probe(proof_not_regular="a symbolic link"),
        "snapshot.json is a symbolic link, not a regular file",
        id="a snapshot.json that is not a regular file is invalid",
    ),
    pytest.param(probe(proof="\ud800"), "not UTF-8", id="a proof that is not UTF-8 text is invalid"),
    pytest.param(probe(proof="  \n"), None, id="an empty snapshot.json is no proof yet"),
    pytest.param(probe(proof=proof_text(4), error="OSError: boom"), None, id="a partial probe judges no proof"),
]


@pytest.mark.parametrize("seen, expected", PROOFS)
def test_a_proof_is_taken_or_refused_as_the_proof_rule_says(seen: RunProbe, expected: Snapshot | str | None) -> None:
    record = running()
    follow(record, (10.0, seen))
    if isinstance(expected, Snapshot):
        assert record.snapshot == expected and record.stop.proof_at == 10.0 and record.stop.invalid_proof is None
    elif expected is None:
        assert record.snapshot is None and record.stop.invalid_proof is None
    else:
        assert record.snapshot is None and expected in (record.stop.invalid_proof or "")
        assert f"invalid snapshot proof: {record.stop.invalid_proof}" in record.history[-1].reason


def test_the_first_proof_decides() -> None:
    record = running()
    follow(record, *proven(4))
    follow(record, (30.0, probe(proof_not_regular="a FIFO", checkpoints=("checkpoint-4",))))
    follow(record, (31.0, probe(proof=proof_text(9), checkpoints=("checkpoint-4", "checkpoint-9"))))
    assert record.snapshot is not None and record.snapshot.step == 4 and record.stop.invalid_proof is None


def test_a_probe_that_changes_nothing_asks_for_no_save() -> None:
    record = running()
    follow(record, (10.0, probe(request="requested")))
    assert not follow(record, (11.0, probe(request="requested"))).changed
    assert follow(record, (12.0, probe(request="cost"))).changed
