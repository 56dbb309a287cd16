"""What a careless user or an attacker can do to the daemon, and what it must do about it (issue 11)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.conftest import FAST_CONFIG, DaemonProc, wait_for

FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
PY = __import__("sys").executable
SLOW_POLL = FAST_CONFIG.replace("poll_interval = 0.2", "poll_interval = 30")


def begun(d: DaemonProc, rid: str) -> bool:
    metrics = d.state_dir / "jobs" / rid / "metrics.jsonl"
    return metrics.exists() and b'"begin"' in metrics.read_bytes()


def test_a_stop_the_moment_the_job_announces_the_plugin_is_taken(make_daemon) -> None:
    d = make_daemon(SLOW_POLL)  # the follow would not read metrics.jsonl for 30 s
    d.start()
    proof = '{"checkpoint": "output/checkpoint-STEP", "step": STEP, "reason": "requested"}'
    rid = d.call("start", command=[PY, FAKE, "proof=" + proof])["id"]
    wait_for(lambda: begun(d, rid), 30, 0.02, "the begin line")
    out = d.cli("train", "stop", rid)
    assert out.returncode == 0, out.stderr
    assert (d.state_dir / "jobs" / rid / "snapshot.request").read_text().strip() == "requested"
    record = d.wait_state(rid, "stopped", timeout=60)
    assert record["snapshot"]["checkpoint"].startswith("output/checkpoint-")


def test_a_stop_of_a_job_that_never_announced_the_plugin_is_kept_and_written_for_it(make_daemon) -> None:
    d = make_daemon(SLOW_POLL)
    d.start()
    rid = d.call("start", command=[PY, FAKE, "no-plugin"])["id"]
    wait_for(lambda: (d.state_dir / "jobs" / rid / "job.log").exists(), 30, 0.05, "the job")
    time.sleep(0.5)
    out = d.cli("train", "stop", rid)
    assert out.returncode == 0, out.stderr
    assert (d.state_dir / "jobs" / rid / "snapshot.request").read_text().strip() == "requested"
    assert d.record(rid)["stop"]["asked_by"] == "`obd train stop`"
    d.call("cancel", id=rid)


def test_every_final_state_is_logged_once_as_run_finished(daemon: DaemonProc) -> None:
    ok = daemon.call("start", command=["true"])["id"]
    bad = daemon.call("start", command=["false"])["id"]
    cancelled = daemon.call("start", command=["sleep", "30"])["id"]
    daemon.wait_state(cancelled, "running")
    daemon.call("cancel", id=cancelled)
    missing = daemon.call("start", command=["/no/such/program"])["id"]
    for rid in (ok, bad, cancelled, missing):
        daemon.wait_state(rid, "succeeded", "failed", "cancelled", timeout=30)

    def finished() -> list[str]:
        lines = [json.loads(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{")]
        return [line["run_id"] for line in lines if line.get("event") == "run_finished"]

    # The line comes once the final state is saved; the state is shown from the edit on.
    wait_for(lambda: {ok, bad, cancelled, missing} <= set(finished()), 30, what="every run's run_finished line")
    for rid in (ok, bad, cancelled, missing):
        assert finished().count(rid) == 1, (rid, finished())


def _proof_like() -> object:
    from hypothesis import strategies as st

    step = st.one_of(st.integers(-3, 12), st.booleans(), st.floats(allow_nan=True), st.text(max_size=4), st.none())
    checkpoint = st.one_of(
        st.sampled_from(
            [
                "output/checkpoint-3",
                "output/checkpoint-03",
                "/etc",
                "../../etc",
                "output/../output/checkpoint-3",
                "output/checkpoint-3/",
                "output//checkpoint-3",
                "output/link-3",
                "output/checkpoint-7",
            ]
        ),
        st.text(max_size=30),
    )
    return st.fixed_dictionaries({"checkpoint": checkpoint, "step": step}, optional={"reason": st.text(max_size=12)})


def test_arbitrary_bytes_in_a_runs_files_never_crash_the_daemon_or_pass_a_bad_proof(daemon: DaemonProc) -> None:
    import os

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    blob = st.one_of(st.binary(max_size=2000), _proof_like().map(lambda v: json.dumps(v).encode()))

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(proof=blob, request=st.binary(max_size=300), metrics=st.binary(max_size=3000), layout=st.integers(0, 3))
    def one_run(proof: bytes, request: bytes, metrics: bytes, layout: int) -> None:
        rid = daemon.call("start", command=["sleep", "60"])["id"]
        rd = daemon.state_dir / "jobs" / rid
        wait_for(lambda: daemon.record(rid)["state"] == "running", 20, 0.05, "the run to start")
        (rd / "output").mkdir(exist_ok=True)
        if layout == 1:
            (rd / "output" / "checkpoint-3").mkdir()
        elif layout == 2:
            os.symlink("/", rd / "output" / "checkpoint-3")
        elif layout == 3:
            os.symlink(rd / "output", rd / "output" / "checkpoint-3")
        (rd / "metrics.jsonl").write_bytes(metrics)
        (rd / "snapshot.request").write_bytes(request)
        (rd / "snapshot.json").write_bytes(proof)
        time.sleep(0.4)  # a poll (0.2 s) has read it all
        record = daemon.record(rid)
        snap = record["snapshot"]
        if snap is not None:
            assert snap["checkpoint"] == f"output/checkpoint-{snap['step']}"
            path = rd / snap["checkpoint"]
            assert path.is_dir() and not path.is_symlink() and layout == 1, (snap, layout)
        daemon.call("cancel", id=rid)
        final = daemon.wait_state(rid, "stopped", "cancelled", "failed", "succeeded", timeout=30)
        if final["snapshot"] is not None:
            assert layout == 1 and final["state"] == "stopped"

    one_run()
    assert daemon.proc.poll() is None
    started = time.monotonic()
    out = daemon.cli("train", "list", timeout=10)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 5, "list is slow after the fuzzing"
