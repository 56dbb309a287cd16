"""Runpod targets under the real daemon: a loopback fake of the API, a real sshd as the pod."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.service.store import RunStore
from tests.conftest import DaemonProc, wait_for
from tests.daemon import pods
from tests.daemon.pods import KEY, make_pods_daemon
from tests.executors.runpod.conftest import kill_jobs
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

PY = sys.executable
pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures
FAKE_JOB = str(Path(__file__).with_name("fake_plugin_job.py"))


@pytest.fixture
def pods(make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path) -> Iterator[DaemonProc]:
    yield make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    kill_jobs(short_tmp / "pod")


def start(d: DaemonProc, *command: str) -> str:
    out = d.cli("train", "start", "--target", "pods", "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def known_pod_ids(d: DaemonProc) -> set[str]:
    records, _ = RunStore(d.state_dir).load_all()
    return {r.target_info.get("pod_id") for r in records.values() if r.target_info.get("pod_id")}


def assert_pod_lines_name_the_run(d: DaemonProc, pod_id: str, rid: str) -> None:
    """Every daemon log line about the run's pod carries the run's id, so `grep RUN_ID` finds them all."""
    lines = [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
    about = [x for x in lines if x.get("pod_id") == pod_id]
    assert about, "no log line names the pod"
    assert [x["event"] for x in about if x.get("run_id") != rid] == []


def test_a_run_on_a_pod_retrieves_verified_outputs_then_terminates_the_pod(pods: DaemonProc, fake: FakeRunpod) -> None:
    rid = start(
        pods, "sh", "-c", "mkdir -p $OBD_OUTPUT_DIR && echo weights > $OBD_OUTPUT_DIR/adapter.bin; echo trained"
    )
    record = pods.wait_state(rid, "succeeded", "failed", timeout=90)
    assert record["state"] == "succeeded", record["message"]
    pod_id = record["target_info"]["pod_id"]
    assert "sha256 verified" in record["message"] and f"pod {pod_id} terminated" in record["message"]
    assert fake.live_pods() == []
    local = pods.state_dir / "runs" / rid / "retrieved"
    assert (local / "output" / "adapter.bin").read_text() == "weights\n"
    assert (local / "job.log").read_text().strip() == "trained"
    created = fake.creates[0]
    assert any(
        e.get("key") == "OBD_RUN_ID" and e.get("value") == rid for e in created.get("env", [])
    ) or rid in json.dumps(created)
    assert KEY not in pods.log_path.read_text()  # the API key never reaches the daemon's log
    assert_pod_lines_name_the_run(pods, pod_id, rid)
    assert KEY not in (pods.state_dir / "runs" / rid / "run.json").read_text()


def test_status_shows_the_pod_its_rate_and_the_spend_so_far(pods: DaemonProc) -> None:
    rid = start(pods, "sleep", "30")
    wait_for(lambda: pods.record(rid)["state"] == "running", 60, what="the job to run on the pod")
    record = pods.record(rid)
    assert record["pod"]["pod_id"] == record["target_info"]["pod_id"]
    assert record["pod"]["cost_per_hr"] == pytest.approx(0.69)
    assert record["pod"]["spend_usd"] >= 0
    text = pods.cli("train", "status", rid).stdout
    pod_line = next(line for line in text.splitlines() if line.startswith("pod "))
    assert record["target_info"]["pod_id"] in pod_line and "RUNNING" in pod_line
    assert "$0.69/h" in pod_line and "spent so far" in pod_line
    pods.cli("train", "cancel", rid, "--wait")


def test_the_cost_cap_asks_for_a_snapshot_and_the_run_ends_stopped(make_daemon, fake, pod_sshd, short_tmp) -> None:
    # $0.69/h and a $0.001 cap: the cap is ~5 s after the pod starts; the snapshot is asked ahead of it.
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, "max_cost_usd = 0.001\nsnapshot_margin = 3\n")
    try:
        rid = start(
            d,
            PY,
            FAKE_JOB,
            "proof=" + json.dumps({"checkpoint": "output/checkpoint-STEP", "step": "STEP"}).replace('"STEP"}', "STEP}"),
        )
        record = d.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=90)
        assert record["state"] == "stopped", record["message"]
        assert record["stop"]["reason"] == "cost"
        assert fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def test_the_daemon_asks_for_the_cost_snapshot_itself_when_the_pods_watchdog_is_gone(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    import os
    import signal

    from trainer_plugin.tools import jobctl

    # $0.69/h and a $0.002 cap: the cap is ~10 s after the pod starts, the request ~3 s ahead of it.
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, "max_cost_usd = 0.002\nsnapshot_margin = 3\n")
    try:
        rid = start(
            d,
            PY,
            FAKE_JOB,
            "proof=" + json.dumps({"checkpoint": "output/checkpoint-STEP", "step": "STEP"}).replace('"STEP"}', "STEP}"),
        )
        record = d.wait_state(rid, "running", timeout=60)
        watchdog = Path(record["remote_dir"]) / "watchdog"
        os.killpg(int(jobctl.read_handle(str(watchdog))["pid"]), signal.SIGKILL)  # only the daemon is left to ask
        record = d.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=90)
        assert record["state"] == "stopped" and record["stop"]["reason"] == "cost", record["message"]
        log = (watchdog.parent / "watchdog.log").read_text() if (watchdog.parent / "watchdog.log").exists() else ""
        assert "snapshot_requested" not in log  # the request was the daemon's
        assert fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_terminated_from_outside_fails_its_run_with_that_reason(pods: DaemonProc, fake: FakeRunpod) -> None:
    rid = start(pods, "sleep", "60")
    record = pods.wait_state(rid, "running", timeout=60)
    fake.terminate_from_outside(record["target_info"]["pod_id"])
    record = pods.wait_state(rid, "failed", timeout=30)
    assert "no longer exists" in record["message"]


def test_a_cancel_while_the_pod_boots_ends_the_run_at_once_and_terminates_the_pod(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    fake.ready_after = 10**6  # the pod never shows a public SSH port
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, boot_grace=3600)
    rid = start(d, "sleep", "60")
    pod = wait_for(lambda: fake.live_pods(), 30, 0.1, "the pod to be created")[0]
    out = d.cli("train", "cancel", rid, "--wait", "--json", timeout=60)  # not an hour of boot grace
    assert out.returncode == 0, out.stderr
    record = d.record(rid)
    assert record["state"] == "cancelled" and "before the job started" in record["message"], record["message"]
    assert record["target_info"]["pod_id"] == pod["id"] and record["job"] is None
    assert fake.live_pods() == []


def test_no_capacity_for_any_gpu_type_fails_clearly_and_creates_nothing(pods: DaemonProc, fake: FakeRunpod) -> None:
    fake.set_capacity("NVIDIA GeForce RTX 4090", 0)
    rid = start(pods, "true")
    record = pods.wait_state(rid, "failed", timeout=60)
    assert "launch failed" in record["message"]
    assert fake.live_pods() == []


def test_a_daemon_killed_while_creating_pods_leaves_no_pod_it_does_not_know(pods: DaemonProc, fake: FakeRunpod) -> None:
    c = pods.client()
    ids = [c.call("start", command=["sleep", "20"], target="pods")["id"] for _ in range(3)]
    c.close()
    time.sleep(0.4)
    pods.kill()
    live = {p["id"] for p in fake.live_pods()}
    assert live <= known_pod_ids(pods)  # every pod was recorded before its create call answered
    pods.start()
    for rid in ids:
        pods.wait_state(rid, "running", "failed", timeout=60)
    assert {p["id"] for p in fake.live_pods()} <= known_pod_ids(pods)
    for rid in ids:
        pods.cli("train", "cancel", rid, "--wait")
    wait_for(lambda: fake.live_pods() == [], 60, what="every pod to be terminated")


def test_a_pod_obd_created_that_no_run_knows_is_emptied_and_terminated_at_start(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    state = short_tmp / "state"
    (state / "runpod").mkdir(parents=True)
    (state / "runpod" / "owner").write_text("ownerfortest0001\n")
    # A pod of this obd install whose run record is gone, and a pod of someone else's.
    orphan = fake.add_foreign_pod(
        "obd-20260101-000000-0rphan", {"OBD_RUN_ID": "20260101-000000-0rphan", "OBD_OWNER": "ownerfortest0001"}
    )
    foreign = fake.add_foreign_pod("someone-elses-pod", {})
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    try:
        try:
            wait_for(
                lambda: orphan not in {p["id"] for p in fake.live_pods()}, 60, what="the orphan pod to be terminated"
            )
        except AssertionError:
            raise AssertionError(d.log_path.read_text()[-3000:]) from None
        assert foreign in {p["id"] for p in fake.live_pods()}  # never touched
        assert "pod_orphan" in d.log_path.read_text()
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_made_by_a_create_whose_answer_was_lost_in_a_crash_is_found_and_ended(
    pods: DaemonProc, fake: FakeRunpod
) -> None:
    fake.inject("timeout", "podFindAndDeployOnDemand", delay=20)  # the pod is made; its id never comes back
    rid = start(pods, "sleep", "5")
    wait_for(lambda: fake.live_pods(), 20, what="the pod to exist")
    time.sleep(0.3)
    pods.kill()
    on_disk = json.loads((pods.state_dir / "runs" / rid / "run.json").read_text())["target_info"]
    assert on_disk["pod_id"] is None and on_disk["phase"] == "creating"  # recorded before the create
    fake.ready_after = 0  # the API already lists the pod with its public port
    pods.start()
    record = pods.wait_state(rid, "failed", "succeeded", timeout=60)
    assert record["target_info"]["pod_id"] and record["target_info"]["host_key"]  # adopted, then pinned
    wait_for(lambda: fake.live_pods() == [], 30, what="the adopted pod to be ended")


def test_the_cost_cap_holds_when_the_pods_ssh_and_watchdog_are_gone(make_daemon, fake, pod_sshd, short_tmp) -> None:
    import os
    import signal

    from trainer_plugin.tools import jobctl

    d = make_pods_daemon(
        make_daemon, fake, pod_sshd, short_tmp, "max_cost_usd = 0.002\nsnapshot_margin = 1\nlease_ttl = 3\n"
    )
    try:
        rid = start(d, "sleep", "120")
        record = d.wait_state(rid, "running", timeout=60)
        os.killpg(int(jobctl.read_handle(record["remote_dir"] + "/watchdog")["pid"]), signal.SIGKILL)
        pod_sshd.stop()  # the pod cannot be reached; the API still answers
        record = d.wait_state(rid, "failed", timeout=60)
        assert "cost cap" in record["message"] and "terminated" in record["message"]
        assert fake.live_pods() == []
    finally:
        pod_sshd.start()
        kill_jobs(short_tmp / "pod")


def stop_pod_from_outside(fake: FakeRunpod, pod_id: str, workdir: Path) -> None:
    """A stop from the console (or a spot interruption): the container ends with every process in
    it, the pod's port goes away, the volume (the workdir here) stays."""
    fake.stop_from_outside(pod_id)
    kill_jobs(workdir)


WRITES_A_CHECKPOINT = (
    "mkdir -p $OBD_OUTPUT_DIR/checkpoint-2 && echo weights > $OBD_OUTPUT_DIR/checkpoint-2/adapter.bin && sleep 120"
)


def test_a_pod_stopped_outside_obd_is_started_again_to_retrieve_the_outputs_then_ended(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    fake.relay_ssh = True
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    try:
        rid = start(d, "sh", "-c", WRITES_A_CHECKPOINT)
        record = d.wait_state(rid, "running", timeout=60)
        pod_id, first_port = record["target_info"]["pod_id"], record["target_info"]["ssh_port"]
        wait_for(
            lambda: (Path(record["remote_dir"]) / "output/checkpoint-2/adapter.bin").exists(), 30, what="the checkpoint"
        )
        stop_pod_from_outside(fake, pod_id, short_tmp / "pod")
        record = d.wait_state(rid, "failed", "succeeded", timeout=90)
        assert record["state"] == "failed"
        assert "stopped outside obd (EXITED), which killed the job" in record["message"], record["message"]
        assert "sha256 verified" in record["message"] and f"pod {pod_id} terminated" in record["message"]
        assert record["target_info"]["ssh_port"] != first_port  # reached again on the resumed pod's new port
        local = d.state_dir / "runs" / rid / "retrieved"
        assert (local / "output" / "checkpoint-2" / "adapter.bin").read_text() == "weights\n"
        assert "podResume" in fake.ops() and fake.live_pods() == []
        assert_pod_lines_name_the_run(d, pod_id, rid)
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_stopped_pod_with_no_gpu_free_is_kept_with_its_outputs_and_retrieve_gets_them_later(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    fake.relay_ssh = True
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    try:
        rid = start(d, "sh", "-c", WRITES_A_CHECKPOINT)
        record = d.wait_state(rid, "running", timeout=60)
        pod_id = record["target_info"]["pod_id"]
        wait_for(
            lambda: (Path(record["remote_dir"]) / "output/checkpoint-2/adapter.bin").exists(), 30, what="the checkpoint"
        )
        fake.set_capacity("NVIDIA GeForce RTX 4090", 0)  # the pod's machine has no GPU free any more
        stop_pod_from_outside(fake, pod_id, short_tmp / "pod")
        record = d.wait_state(rid, "failed", timeout=60)
        assert "could not be started again" in record["message"] and "not enough free GPUs" in record["message"]
        assert f"obd pods rm {pod_id}" in record["message"]
        # The pod is kept stopped, not terminated: its volume holds the checkpoint.
        assert [(p["id"], p["desiredStatus"]) for p in fake.live_pods()] == [(pod_id, "EXITED")]
        fake.set_capacity("NVIDIA GeForce RTX 4090", 1)
        out = d.cli("pods", "retrieve", rid)
        assert out.returncode == 0, out.stderr
        assert "sha256 verified" in out.stdout and f"pod {pod_id} terminated" in out.stdout
        local = d.state_dir / "runs" / rid / "retrieved"
        assert (local / "output" / "checkpoint-2" / "adapter.bin").read_text() == "weights\n"
        assert fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def log_events(d: DaemonProc) -> list[dict]:
    return [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]


def test_a_pod_whose_create_completes_after_a_restart_is_found_soon_and_ended(
    pods: DaemonProc, fake: FakeRunpod
) -> None:
    # The create is sent, then the daemon dies; Runpod makes the pod 6 s later, after the restart.
    fake.inject("late", "podFindAndDeployOnDemand", delay=6)
    rid = start(pods, "sleep", "30")
    wait_for(lambda: "podFindAndDeployOnDemand" in fake.arrived, 20, 0.05, "the create call to be sent")
    pods.kill()
    assert fake.live_pods() == []  # not made yet
    pods.start()
    pod = wait_for(fake.live_pods, 20, 0.1, "the late create to make its pod")[0]
    record = pods.wait_state(rid, "failed", "succeeded", "cancelled", timeout=60)
    assert record["target_info"]["pod_id"] == pod["id"]  # found by its tag, not taken for "never created"
    assert "before the pod was created" not in record["message"], record["message"]
    # Ended at once, not after the 5-minute reconcile.
    wait_for(lambda: fake.live_pods() == [], 30, 0.2, "the late pod to be ended")


def test_status_of_a_pod_run_shows_the_pod_without_asking_the_api_each_time(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, api_poll_interval=20)
    try:
        rid = start(d, "sleep", "60")
        d.wait_state(rid, "running", timeout=60)
        wait_for(lambda: d.record(rid).get("pod", {}).get("state") == "RUNNING", 30, what="the pod's state")
        before = fake.ops().count("pod")
        for _ in range(8):
            pod = d.record(rid)["pod"]
            assert pod["state"] == "RUNNING" and pod["spend_usd"] is not None
        assert fake.ops().count("pod") - before <= 1  # the follow's own look, at most
        d.cli("train", "cancel", rid, "--wait")
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_being_ended_is_not_probed_so_no_unreachable_target_is_reported(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    fake.relay_ssh = True  # a terminated pod's SSH port closes, as on Runpod
    fake.inject("timeout", "podTerminate", delay=3)  # the pod is gone at once; the answer takes 3 s
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    try:
        rid = start(d, "sh", "-c", "mkdir -p $OBD_OUTPUT_DIR && echo w > $OBD_OUTPUT_DIR/adapter.bin")
        record = d.wait_state(rid, "succeeded", "failed", timeout=90)
        assert record["state"] == "succeeded", record["message"]
        assert "terminated" in record["message"]
        assert [e for e in log_events(d) if e.get("event") == "target_unreachable"] == []
        assert not any("unreachable" in h["reason"] for h in record["history"])
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_launch_that_fails_after_the_pod_was_made_ends_the_pod_before_the_run_is_failed(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    # The pod is made and answers SSH, but its workdir cannot be created: the job never starts.
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, workdir=Path("/proc/obd-no-such-dir"))
    rid = start(d, "true")
    record = d.wait_state(rid, "failed", timeout=60)
    assert fake.live_pods() == []  # already ended when the run was recorded failed
    assert "cannot be created" in record["message"] and "was terminated" in record["message"], record["message"]
    assert len(fake.terminated) == 1


RESUMES_OR_CHECKPOINTS = (
    'if [ -n "$OBD_RESUME_FROM" ]; then cat "$OBD_RESUME_FROM/adapter_model.safetensors"; '
    'echo "resumed from $OBD_RESUME_FROM"; exit 0; fi; '
    "mkdir -p $OBD_OUTPUT_DIR/checkpoint-2 && echo '{\"global_step\": 2}' > $OBD_OUTPUT_DIR/checkpoint-2/trainer_state.json "
    "&& echo weights > $OBD_OUTPUT_DIR/checkpoint-2/adapter_model.safetensors && sleep 120"
)


def test_a_run_whose_pod_was_stopped_comes_back_on_a_new_pod_with_the_retrieved_checkpoint(
    make_daemon, fake, pod_sshd, short_tmp
) -> None:
    fake.relay_ssh = True
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, extra='retry = 1\n[retry]\nbackoff = "0.5s"\n')
    try:
        rid = start(d, "sh", "-c", RESUMES_OR_CHECKPOINTS)
        record = d.wait_state(rid, "running", timeout=60)
        first_pod = record["target_info"]["pod_id"]
        wait_for(lambda: (Path(record["remote_dir"]) / "output/checkpoint-2/adapter_model.safetensors").exists(), 30)
        stop_pod_from_outside(fake, first_pod, short_tmp / "pod")
        first = d.wait_state(rid, "failed", timeout=90)
        assert "stopped outside obd" in first["message"]
        second_id = wait_for(lambda: d.record(rid)["retried_by"], 60, 0.2, "the next attempt")
        second = d.wait_state(second_id, "succeeded", "failed", timeout=120)
        assert second["state"] == "succeeded", second["message"]
        assert second["target_info"]["pod_id"] != first_pod  # a new pod
        assert second["resume_checkpoint"].endswith("/resume/checkpoint-2")  # the retrieved copy, sent to it
        log = d.cli("train", "logs", second_id).stdout
        assert "weights" in log and "resumed from" in log
        assert fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_run_on_a_daemon_without_the_key_fails_saying_the_daemon_needs_it_and_how(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path
) -> None:
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    d.stop()
    del d.env["RUNPOD_API_KEY"]
    d.env["HOME"] = str(short_tmp)  # no ~/.runpod/config.toml for the daemon either
    d.start()
    out = d.cli("train", "start", "--target", "pods", "--", "true", env={"RUNPOD_API_KEY": KEY})
    assert out.returncode == 0, out.stderr
    record = d.wait_state(out.stdout.strip(), "failed", "succeeded", timeout=60)
    message = record["message"]
    # The client's shell had the key: the message names the daemon's environment and how to fill it.
    assert record["state"] == "failed" and "no Runpod API key" in message, message
    assert "the daemon calls the Runpod API with the key in its own environment" in message
    assert "/etc/obd/env" in message and "systemctl restart obd" in message
    assert fake.live_pods() == [] and KEY not in message


def pod_line(d: DaemonProc, rid: str) -> str:
    text = d.cli("train", "status", rid).stdout
    return next(line for line in text.splitlines() if line.startswith("pod "))


def test_an_ended_pod_runs_status_says_its_pod_was_terminated_when_and_why_and_outputs_work_from_home(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path
) -> None:
    fake.relay_ssh = True  # a terminated pod's SSH port closes, as on Runpod: nothing can reach it after
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    try:
        saved = start(d, "sh", "-c", "mkdir -p $OBD_OUTPUT_DIR && echo weights > $OBD_OUTPUT_DIR/adapter.bin")
        bare = start(d, "sh", "-c", "echo trained, saved nothing")
        for rid in (saved, bare):
            record = d.wait_state(rid, "succeeded", "failed", timeout=90)
            assert record["state"] == "succeeded", record["message"]
            info = record["target_info"]
            assert info["end"] == "terminated" and info["ended_at"] >= info["started_at"]
            line = pod_line(d, rid)
            assert line.startswith(f"pod       {info['pod_id']}  terminated at 20"), line
            assert "after the run ended, its outputs retrieved and verified first" in line
            assert "ready" not in line and "spent in all" in line
        assert fake.live_pods() == []
        # Outputs come from what the daemon retrieved: the pods' ports are closed.
        out = d.cli("train", "outputs", saved, "--to", str(short_tmp / "got"), timeout=30)
        assert out.returncode == 0, out.stderr
        assert (short_tmp / "got" / "adapter.bin").read_text() == "weights\n"
        out = d.cli("train", "outputs", bare, "--to", str(short_tmp / "none"), timeout=30)
        assert out.returncode == 1
        assert f"run {bare} (succeeded) wrote no output/" in out.stderr and "$OBD_OUTPUT_DIR" in out.stderr
        assert f"obd train logs {bare}" in out.stderr and "could not bring" not in out.stderr
        assert not (short_tmp / "none").exists()
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_run_whose_pod_went_says_gone_when_and_why_and_its_outputs_went_with_it(
    pods: DaemonProc, fake: FakeRunpod, short_tmp: Path
) -> None:
    rid = start(pods, "sleep", "60")
    pod_id = pods.wait_state(rid, "running", timeout=60)["target_info"]["pod_id"]
    fake.terminate_from_outside(pod_id)
    record = pods.wait_state(rid, "failed", timeout=30)
    assert record["target_info"]["end"] == "gone"
    line = pod_line(pods, rid)
    assert line.startswith(f"pod       {pod_id}  gone (found at 20"), line
    assert "terminated outside obd, or reclaimed by Runpod" in line and "ready" not in line
    out = pods.cli("train", "outputs", rid, "--to", str(short_tmp / "got"), timeout=30)
    assert out.returncode == 1
    assert f"its pod {pod_id} was found gone at 20" in out.stderr and "went with it" in out.stderr
    assert not (short_tmp / "got").exists()
