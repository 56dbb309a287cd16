"""Preemption that loses nothing, and drain (issue 25): a waiting run of higher priority takes GPUs
from lower ones through a verified snapshot, and the paused runs come back on their own.

The rule is table-tested (`choose_victims`); the rest runs real daemons and real processes with
GPUs given by config (`tests/daemon/fake_plugin_job.py` speaks the snapshot protocol in 0.05 s
steps; the bitwise resume with a real Trainer is in test_preemption_trainer.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daemon.service.preempt import Candidate, choose_victims
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
FAKE = str(REPO / "tests" / "daemon" / "fake_plugin_job.py")


def config(gpus: int = 2, min_runtime: str = "1s", proof_timeout: str = "60s") -> str:
    ids = ", ".join(f'"{i}"' for i in range(gpus))
    return FAST_CONFIG.replace('proof_timeout = "60s"', f'proof_timeout = "{proof_timeout}"') + (
        f'\n[targets.local]\nkind = "local"\ngpus = [{ids}]\nmin_runtime = "{min_runtime}"\n'
    )


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def snapshotting(d: DaemonProc, rid: str) -> dict:
    """Wait until a run's job runs and announced the plugin, past a second (the tests' min_runtime)."""
    record = wait_for(lambda: (r := d.record(rid))["state"] == "running" and r["snapshots"] and r, 30, 0.05, rid)
    time.sleep(1.2)
    return record


def when(record: dict, state: str) -> float:
    return next(h["time"] for h in record["history"] if h["state"] == state)


# --- the rule ------------------------------------------------------------------------------------


def c(run_id: str, gpus: int, priority: int = 0, lost: float = 0.0, started: float = 0.0) -> Candidate:
    return Candidate(run_id, tuple(f"{run_id}{i}" for i in range(gpus)), priority, lost, started)


@pytest.mark.parametrize(
    ("candidates", "free", "wanted", "chosen"),
    [
        # The fewest GPUs that suffice: one run of 1 rather than one of 2.
        ([c("big", 2), c("small", 1)], [], 1, ["small"]),
        # Never more runs than needed: one run of 2 rather than two of 1 (both free 2 GPUs).
        ([c("a", 1), c("b", 1), c("pair", 2)], [], 2, ["pair"]),
        # Then the lowest priority.
        ([c("p3", 1, priority=3), c("p1", 1, priority=1)], [], 1, ["p1"]),
        # Then the least work a failed snapshot would cost.
        ([c("costly", 1, lost=500.0), c("cheap", 1, lost=20.0)], [], 1, ["cheap"]),
        # Then the most recently started.
        ([c("old", 1, started=100.0), c("new", 1, started=200.0)], [], 1, ["new"]),
        # A free GPU counts: one more is needed, not two.
        ([c("a", 1), c("b", 1)], ["free0"], 2, ["a"]),
        # Nothing when freeing every candidate would still not be enough.
        ([c("a", 1), c("b", 1)], [], 3, []),
        # Devices asked for by id: only the run holding them frees them.
        ([c("a", 1), c("b", 1)], [], ["b0"], ["b"]),
        ([c("a", 1)], [], ["b0"], []),
    ],
)
def test_victims_are_chosen_by_the_documented_rule(
    candidates: list[Candidate], free: list[str], wanted: int | list[str], chosen: list[str]
) -> None:
    assert [v.run_id for v in choose_victims(candidates, free, wanted)] == chosen


# --- a daemon's queue ----------------------------------------------------------------------------


def test_an_urgent_run_takes_one_gpu_through_a_verified_snapshot_and_the_victim_comes_back(make_daemon) -> None:
    d = make_daemon(config())
    d.start()
    first = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    snapshotting(d, first)
    second = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    snapshotting(d, second)
    urgent = start(d, "sh", "-c", "sleep 2; echo urgent done", opts=("--gpus", "1", "--priority", "5"))

    done = d.wait_state(urgent, "succeeded", "failed", timeout=60)
    assert done["state"] == "succeeded", done["message"]
    victims = [r for r in (d.record(first), d.record(second)) if r["preemption"]["preempt"]]
    assert [v["id"] for v in victims] == [second]  # the one started last: the least work to lose
    victim = victims[0]
    assert victim["state"] == "stopped" and victim["snapshot"]["reason"] == "preempted", victim["message"]
    assert d.record(first)["state"] == "running"
    reason = f"preempted for run {urgent} (priority 5), which needed 1 GPU"
    assert any(h["reason"] == reason for h in victim["history"])
    assert done["gpus"] == victim["gpus"]  # the victim's device went to the urgent run...
    assert when(done, "preparing") >= when(victim, "stopped")  # ...only once its job had ended

    resumed_id = victim["retried_by"]
    resumed = d.wait_state(resumed_id, "running", timeout=30)  # back on its own once the GPU is free
    assert resumed["resumed_from"] == second and resumed["attempt"] == 2
    assert resumed["preemption"]["paused"]["by"] == urgent and resumed["preemption"]["preemptions"] == 1
    status = d.record(resumed_id)
    assert status["pauses"]["preemptions"] == 1 and status["pauses"]["lost_steps"] == 0
    assert status["pauses"]["paused_seconds"] > 0
    said = f"resumed from step {victim['snapshot']['step']}"
    job_log = Path(resumed["remote_dir"]) / "job.log"
    wait_for(lambda: said in job_log.read_text(), 20, 0.1, said)  # running comes before the job's first line
    for rid in (first, resumed_id):
        d.call("cancel", id=rid)


def test_an_urgent_run_wanting_two_gpus_pauses_both_runs(make_daemon) -> None:
    d = make_daemon(config())
    d.start()
    runs = []
    for _ in range(2):
        runs.append(start(d, PY, FAKE, "snapshot", opts=("--gpus", "1")))
        snapshotting(d, runs[-1])
    urgent = start(d, "sh", "-c", "echo urgent", opts=("--gpus", "2", "--priority", "1"))
    assert d.wait_state(urgent, "succeeded", timeout=60)["state"] == "succeeded"
    for rid in runs:
        record = d.record(rid)
        assert record["state"] == "stopped" and record["snapshot"]["reason"] == "preempted"
        assert d.wait_state(record["retried_by"], "running", timeout=30)["preemption"]["paused"]["by"] == urgent
        d.call("cancel", id=record["retried_by"])


def test_runs_that_may_not_be_paused_are_never_chosen_and_nothing_is_when_it_would_not_suffice(
    make_daemon,
) -> None:
    d = make_daemon(config(gpus=4, min_runtime="30s"))
    d.start()
    kept = [
        start(d, PY, FAKE, "snapshot", opts=("--gpus", "1", "--no-preemptible")),
        start(d, PY, FAKE, "no-plugin", opts=("--gpus", "1")),
        start(d, PY, FAKE, "snapshot", opts=("--gpus", "1", "--priority", "5")),  # equal priority
        start(d, PY, FAKE, "snapshot", opts=("--gpus", "1")),  # younger than min_runtime (30 s)
    ]
    for rid in kept:
        d.wait_state(rid, "running")
    wait_for(lambda: all(d.record(r)["snapshots"] for r in (kept[0], kept[2], kept[3])), 20)
    urgent = start(d, "sh", "-c", "echo urgent", opts=("--gpus", "1", "--priority", "5"))
    time.sleep(3)  # many passes of the queue
    assert d.record(urgent)["state"] == "queued"
    for rid in kept:
        record = d.record(rid)
        assert record["state"] == "running" and not record["preemption"]["preempt"], rid
        assert record["stop"]["requested_at"] is None
    for rid in [*kept, urgent]:
        d.call("cancel", id=rid)


def test_a_victim_that_ignores_the_request_is_cancelled_and_requeued_with_its_lost_steps_shown(make_daemon) -> None:
    d = make_daemon(config(gpus=1, proof_timeout="3s"))
    d.start()
    victim = start(d, PY, FAKE, "ignore-steps", opts=("--gpus", "1"))
    snapshotting(d, victim)
    urgent = start(d, "sh", "-c", "echo urgent", opts=("--gpus", "1", "--priority", "5"))
    assert d.wait_state(urgent, "succeeded", timeout=60)["state"] == "succeeded"
    ended = d.record(victim)
    assert ended["state"] == "cancelled" and "no snapshot within 3 s" in ended["message"]
    again = d.wait_state(ended["retried_by"], "running", timeout=30)
    assert again["resumed_from"] is None  # no complete checkpoint: from the start
    lost = d.record(again["id"])["pauses"]["lost_steps"]
    assert lost > 0 and lost == ended["progress"]["step"]
    assert f"{lost} steps lost" in d.cli("train", "status", again["id"]).stdout
    d.call("cancel", id=again["id"])


def test_a_drain_pauses_every_run_that_can_snapshot_starts_nothing_and_survives_a_restart(make_daemon) -> None:
    d = make_daemon(config(proof_timeout="3s"))
    d.start()
    pausable = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    stuck = start(d, PY, FAKE, "no-plugin", opts=("--gpus", "1"))
    snapshotting(d, pausable)
    d.wait_state(stuck, "running")
    out = d.cli("targets", "drain", "local", "--wait", "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    # A job that never announces the plugin is asked all the same; the stop fallback ends it.
    assert sorted(answer["paused"]) == sorted([pausable, stuck]) and answer["unannounced"] == [stuck]
    assert f"waiting for {stuck}: its job has not announced" in out.stderr
    paused = d.record(pausable)
    assert paused["state"] == "stopped" and paused["snapshot"]["reason"] == "preempted"
    assert any(h["reason"] == "target local drained" for h in paused["history"])
    ended = d.record(stuck)  # --wait returned once nothing ran on the target
    assert ended["state"] == "cancelled" and "no snapshot within 3 s" in ended["message"]
    ended = wait_for(lambda: (r := d.record(stuck))["retried_by"] and r, 30, 0.05, "the stuck run requeued")
    paused = wait_for(lambda: (r := d.record(pausable))["retried_by"] and r, 30, 0.05, "the paused run requeued")
    later = start(d, "sh", "-c", "echo later", opts=("--gpus", "1"))

    d.kill()  # a drain survives the daemon
    d.start()
    time.sleep(2)
    assert d.record(later)["state"] == "queued" and d.record(paused["retried_by"])["state"] == "queued"
    assert d.record(ended["retried_by"])["state"] == "queued"
    assert d.call("targets")[0]["drained"] is True
    listed = {r["id"]: r for r in d.call("list")}  # what the list and the web view show
    assert listed[paused["retried_by"]]["paused"]["by"] is None and listed[later].get("paused") is None
    assert d.cli("targets", "undrain", "local").returncode == 0
    assert d.wait_state(paused["retried_by"], "running", timeout=30)["preemption"]["paused"]["by"] is None
    for rid in (ended["retried_by"], paused["retried_by"], later):
        d.call("cancel", id=rid)


def gated(gate: Path, *command: str) -> tuple[str, ...]:
    """A job that loads until `gate` exists (a model still loading: no plugin announced), then runs `command`."""
    return ("sh", "-c", f'while [ ! -e "{gate}" ]; do sleep 0.05; done; exec "$@"', "gated", *command)


def test_a_drain_pauses_a_just_started_job_at_its_first_step_and_wait_returns_only_once_it_ended(
    make_daemon, tmp_path: Path
) -> None:
    d = make_daemon(config())
    d.start()
    gate = tmp_path / "loaded"
    loading = start(d, *gated(gate, PY, FAKE, "snapshot"), opts=("--gpus", "1"))
    d.wait_state(loading, "running")
    assert not d.record(loading)["snapshots"]
    drain = subprocess.Popen(
        [PY, "-m", "daemon.cli", "targets", "drain", "local", "--wait"],
        env=d.env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: d.record(loading)["preemption"]["preempt"], 30, 0.05, "the drain to ask the loading run")
        assert drain.poll() is None  # its job cannot end before the gate: --wait must still wait
        gate.touch()  # the model loaded: the plugin announces itself and takes the request at its first step
        out, err = drain.communicate(timeout=60)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.communicate()
    assert drain.returncode == 0, err
    assert f"paused through a snapshot, back in the queue: {loading}" in out
    ended = d.record(loading)
    assert ended["state"] == "stopped" and ended["snapshot"]["reason"] == "preempted", ended["message"]
    assert ended["snapshot"]["step"] == 1  # at its first step
    again = wait_for(lambda: d.record(loading)["retried_by"], 30, 0.05, "the paused run to be requeued")
    assert d.wait_state(again, "queued")["preemption"]["paused"]["by"] is None
    d.call("cancel", id=again)


def test_an_urgent_run_pauses_a_resumed_run_still_loading_whose_chain_snapshotted_before(
    make_daemon, tmp_path: Path
) -> None:
    d = make_daemon(config(gpus=1))
    d.start()
    gate = tmp_path / "loaded"
    gate.touch()
    first = start(d, *gated(gate, PY, FAKE, "snapshot"), opts=("--gpus", "1"))
    snapshotting(d, first)
    assert d.cli("train", "stop", first, "--wait").returncode == 0
    gate.unlink()  # the resumed job loads until the test says so
    out = d.cli("train", "resume", first)
    assert out.returncode == 0, out.stderr
    resumed = out.stdout.strip()
    d.wait_state(resumed, "running")
    time.sleep(1.2)  # the tests' min_runtime
    urgent = start(d, "sh", "-c", "echo urgent", opts=("--gpus", "1", "--priority", "5"))
    asked = wait_for(lambda: d.record(resumed)["preemption"]["preempt"], 30, 0.05, "the loading run to be asked")
    assert asked["for_run"] == urgent and not d.record(resumed)["snapshots"]
    gate.touch()
    assert d.wait_state(urgent, "succeeded", timeout=60)["state"] == "succeeded"
    victim = d.record(resumed)
    assert victim["state"] == "stopped" and victim["snapshot"]["reason"] == "preempted", victim["message"]
    victim = wait_for(lambda: (r := d.record(resumed))["retried_by"] and r, 30, 0.05, "the victim requeued")
    d.wait_state(victim["retried_by"], "running", timeout=30)
    d.call("cancel", id=victim["retried_by"])


def test_the_queue_of_a_drained_target_says_the_drain_and_the_command_that_undrains_it(make_daemon) -> None:
    d = make_daemon(config())
    d.start()
    pausable = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    snapshotting(d, pausable)
    assert d.cli("targets", "drain", "local", "--wait").returncode == 0
    paused = wait_for(lambda: d.record(pausable)["retried_by"], 30, 0.05, "the paused run requeued")
    later = start(d, "sh", "-c", "echo later", opts=("--gpus", "1"))
    said = "target local is drained, nothing starts on it until `obd targets undrain local`"
    for rid in (paused, later):
        record = wait_for(lambda rid=rid: (r := d.record(rid))["message"].endswith(said) and r, 30, 0.05, said)
        assert "free" not in record["message"] and "of 1" not in record["message"], record["message"]
    assert d.record(paused)["message"].startswith("paused (target local drained) since ")
    assert said in d.cli("train", "status", later).stdout
    for rid in (paused, later):
        d.call("cancel", id=rid)


@pytest.mark.parametrize(
    ("attempt", "retries", "preemptions", "said"),
    [
        (2, 1, 0, "attempt 2 of 2"),
        (3, 1, 1, "attempt 3 of 3"),  # a pause's attempt uses no retry: counted among the attempts
        (1, 1, 0, None),
    ],
)
def test_a_queued_attempt_is_counted_among_every_attempt_its_chain_may_make(
    attempt: int, retries: int, preemptions: int, said: str | None
) -> None:
    from daemon.service.models import PreemptionPart, RunRecord
    from daemon.service.queue import queued_why

    assert (
        queued_why(
            RunRecord(id="r", attempt=attempt, retries=retries, preemption=PreemptionPart(preemptions=preemptions))
        )
        == said
    )


def test_only_root_or_the_daemons_user_may_drain(make_daemon) -> None:
    d = make_daemon(config())
    d.start()
    assert d.call("undrain", target="local")["drained"] is False  # the daemon's own user (root here)
    bad = d.cli("targets", "drain", "nowhere")
    assert bad.returncode != 0 and "nowhere" in bad.stderr


KILL_POINTS = {
    "the pause recorded": lambda r: r["preemption"]["preempt"],
    "the proof seen": lambda r: r.get("snapshot"),
    "the job ended": lambda r: r["state"] == "stopped",
}


@pytest.mark.parametrize("moment", KILL_POINTS)
def test_a_daemon_killed_during_a_preemption_finishes_the_pause_and_the_requeue_exactly_once(
    make_daemon, moment: str
) -> None:
    d = make_daemon(config(gpus=1))
    d.start()
    victim = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    snapshotting(d, victim)
    urgent = start(d, "sh", "-c", "sleep 1; echo urgent", opts=("--gpus", "1", "--priority", "5"))
    wait_for(lambda: KILL_POINTS[moment](d.record(victim)), 20, 0.005, moment)
    d.kill()
    time.sleep(1)
    d.start()
    assert d.wait_state(urgent, "succeeded", timeout=60)["state"] == "succeeded"
    ended = d.record(victim)
    assert ended["state"] == "stopped" and ended["snapshot"]["reason"] == "preempted", ended["history"]
    resumed = d.wait_state(ended["retried_by"], "running", timeout=30)
    attempts = [r for r in d.call("list", all=True) if r["id"] != urgent]
    assert len(attempts) == 2, attempts  # one victim, one requeued attempt: never two
    d.kill()  # and again after the requeue: nothing is made twice
    d.start()
    time.sleep(1)
    assert len([r for r in d.call("list", all=True) if r["id"] != urgent]) == 2
    d.call("cancel", id=resumed["id"])


@pytest.mark.parametrize("asked", [False, True], ids=["nothing asked", "asked in the record, no file written"])
def test_a_pause_recorded_by_a_daemon_killed_before_the_job_was_asked_is_asked_for_at_the_next_start(
    make_daemon, asked: bool
) -> None:
    # The moments between the pause's record, its request's record and the request's file cannot
    # be hit by a kill from outside reliably, so the record is left as such a kill leaves it. The
    # stop fallback waits far longer than the test: only a request the job sees ends it stopped.
    d = make_daemon(config(gpus=1, proof_timeout="30m"))
    d.start()
    victim = start(d, PY, FAKE, "snapshot", opts=("--gpus", "1"))
    snapshotting(d, victim)
    d.kill()
    path = d.state_dir / "runs" / victim / "run.json"
    record = json.loads(path.read_text())
    assert record["stop"]["requested_at"] is None and record["preemption"]["preempt"] is None
    record["preemption"]["preempt"] = {
        "for_run": None,
        "needed": 1,
        "asked_at": time.time(),
        "why": "drained (the test)",
    }
    if asked:
        record["stop"].update(requested_at=time.time(), reason="preempted", asked_by="obd's preemption")
    path.write_text(json.dumps(record))
    d.start()
    ended = d.wait_state(victim, "stopped", timeout=60)
    assert ended["snapshot"]["reason"] == "preempted" and ended["stop"]["asked_by"] == "obd's preemption"


def test_among_equal_victims_the_one_whose_stop_is_quickest_goes_first() -> None:
    slow = Candidate("slow", ("a",), 0, lost_work=0.0, started=0.0, stop_seconds=90.0)  # a long save
    quick = Candidate("quick", ("b",), 0, lost_work=50.0, started=0.0, stop_seconds=3.0)
    assert [v.run_id for v in choose_victims([slow, quick], [], 1)] == ["quick"]
    # A lower priority still goes before a quicker stop.
    low = Candidate("low", ("c",), -1, lost_work=0.0, started=0.0, stop_seconds=90.0)
    assert [v.run_id for v in choose_victims([slow, quick, low], [], 1)] == ["low"]
