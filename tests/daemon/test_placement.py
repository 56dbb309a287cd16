"""Placement over several targets and overflow (issue 36 items 3 and 4, docs/placement.md), through
the real daemon: `--target a,b` (and a pool, and the Python API's list) starts on the first target
whose GPUs are free, waits while all are held and starts on the first that frees; a retry whose
target is down goes to the next; a run paused by a drain continues on its target's overflow target
after the wait, from its snapshot carried to a real sshd, its later losses an uninterrupted run's
bitwise; a placement naming what the config lacks is refused saying what to give.

Two targets of the local kind with distinct names and fake GPU ids stand for two boxes (as
test_preemption.py's config gives GPU ids without a GPU)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.service.config import ConfigError, load_config
from tests.conftest import FAST_CONFIG, DaemonProc, kill_job_groups, wait_for
from tests.daemon import pods
from tests.executors.runpod.conftest import kill_jobs
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer, free_port, running_sshd

pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures

SLEEP = ("sh", "-c", "sleep 300")
FAKE_JOB = str(Path(__file__).with_name("fake_plugin_job.py"))  # speaks the snapshot protocol, a step each 0.05 s
FAST_RETRY = '\n[retry]\nbackoff = "0.2s"\n'


def two_boxes(short_tmp: Path, extra: str = "") -> str:
    """`local` and `spare`, one GPU id each, and the pool `gpus` of both."""
    return (
        FAST_CONFIG
        + FAST_RETRY
        + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
        + f'\n[targets.spare]\nkind = "local"\ngpus = ["0"]\nworkdir = "{short_tmp / "spare"}"\n'
        + '\n[pools.gpus]\ntargets = ["local", "spare"]\n'
        + extra
    )


def start(d: DaemonProc, *args: str) -> str:
    out = d.cli("train", "start", *args)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def status(d: DaemonProc, rid: str) -> str:
    out = d.cli("train", "status", rid)
    assert out.returncode == 0, out.stderr
    return out.stdout


def notes(record: dict) -> str:
    return "\n".join(h["reason"] for h in record["history"])


@pytest.fixture
def boxes(make_daemon, short_tmp: Path) -> DaemonProc:
    d = make_daemon(two_boxes(short_tmp))
    d.start()
    return d


def test_a_run_of_two_targets_starts_on_the_second_when_the_firsts_gpus_are_all_held(
    boxes: DaemonProc, monkeypatch: pytest.MonkeyPatch
) -> None:
    import obd

    d = boxes
    blocker = start(d, "--", *SLEEP)
    d.wait_state(blocker, "running")

    for name in ("OBD_SOCKET", "OBD_CONFIG", "OBD_STATE_DIR"):
        monkeypatch.setenv(name, d.env[name])
    with obd.Client() as client:  # the Python API takes the run file's list
        placed = client.start(["sh", "-c", "echo placed"], target=["local", "spare"])
    done = d.wait_state(placed.id, "succeeded", "failed")
    assert done["state"] == "succeeded", done["message"]
    assert done["target"] == "spare" and done["gpus"] == ["0"]
    assert done["placement"]["targets"] == ["local", "spare"]
    said = f"placed on spare: local's 1 GPU all held (by {blocker})"
    assert said in status(d, placed.id)  # where, and why
    assert said in notes(done)
    assert d.record(blocker)["state"] == "running"  # nothing was paused for it
    again = d.cli("train", "status", placed.id, "--as-file")
    assert 'target = "local,spare"' in again.stdout, again.stdout  # started again, it is placed again

    first = start(d, "--target", "spare,local", "--", "sh", "-c", "echo first")  # its first choice is free
    done = d.wait_state(first, "succeeded", "failed")
    assert done["target"] == "spare" and "placed on spare: the first of spare,local" in status(d, first)
    d.call("cancel", id=blocker)


def test_a_run_of_a_pool_waits_while_every_target_is_full_and_starts_on_the_first_that_frees(
    boxes: DaemonProc,
) -> None:
    d = boxes
    here = start(d, "--", *SLEEP)
    there = start(d, "--target", "spare", "--", *SLEEP)
    for rid in (here, there):
        d.wait_state(rid, "running")

    waiting = start(d, "--target", "gpus", "--", "sh", "-c", "echo freed")
    record = wait_for(lambda: "spare's" in (r := d.record(waiting))["message"] and r, 30, 0.1, "its message")
    assert record["state"] == "queued" and record["target"] == "local"
    message = record["message"]
    assert f"local's 1 GPU all held (by {here})" in message and f"spare's 1 GPU all held (by {there})" in message
    assert "waiting for one of gpus" in message

    listed = d.cli("targets", "list").stdout
    assert "pools gpus" in listed, listed

    d.call("cancel", id=there)  # the second frees first: it starts there
    done = d.wait_state(waiting, "succeeded", "failed")
    assert done["state"] == "succeeded", done["message"]
    assert done["target"] == "spare"
    assert f"placed on spare: local's 1 GPU all held (by {here})" in status(d, waiting)
    d.call("cancel", id=here)


def test_a_retry_whose_target_is_down_goes_to_the_next_target(make_daemon, short_tmp: Path) -> None:
    closed = free_port()  # nothing listens there: the host is down
    down = (
        f'\n[targets.down]\nkind = "ssh"\nhost = "127.0.0.1"\nport = {closed}\nconnect_timeout = 2\n'
        f'accept_unknown_host = true\nknown_hosts = "{short_tmp / "known_hosts"}"\n'
    )
    d = make_daemon(two_boxes(short_tmp, down))
    d.start()
    rid = start(d, "--target", "down,local", "--retry", "1", "--", "sh", "-c", "echo here")
    failed = d.wait_state(rid, "failed", "succeeded", timeout=60)
    assert failed["target"] == "down" and failed["message"].startswith("launch failed"), failed["message"]
    retried = wait_for(lambda: d.record(rid)["retried_by"], 60, 0.1, "the retry")
    done = d.wait_state(retried, "succeeded", "failed", timeout=60)
    assert done["state"] == "succeeded", done["message"]
    assert done["target"] == "local" and done["attempt"] == 2
    assert done["placement"]["targets"] == ["local", "down"]  # the target that was down, last


def overflowing_boxes(short_tmp: Path) -> str:
    """`local` (GPU 0) whose waiting runs overflow to `spare` (GPU 1) after a second."""
    return (
        FAST_CONFIG
        + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\nmin_runtime = "1s"\noverflow = "spare"\n'
        + 'overflow_after = "1s"\n'
        + f'\n[targets.spare]\nkind = "local"\ngpus = ["1"]\nworkdir = "{short_tmp / "spare"}"\n'
    )


def test_a_run_queued_longer_than_its_targets_overflow_wait_starts_on_the_overflow_target(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(overflowing_boxes(short_tmp))
    d.start()
    blocker = start(d, "--", *SLEEP)
    d.wait_state(blocker, "running")
    rid = start(d, "--", "sh", "-c", "echo overflowed")
    done = d.wait_state(rid, "succeeded", "failed")
    assert done["state"] == "succeeded", done["message"]
    assert done["target"] == "spare" and done["gpus"] == ["1"]
    assert done["history"][0]["state"] == "queued"  # it waited on local first
    said = f"placed on spare, the overflow of local after 1s waiting: local's 1 GPU all held (by {blocker})"
    assert said in status(d, rid)
    d.call("cancel", id=blocker)


def test_a_run_paused_by_a_preemption_continues_on_the_overflow_target_from_its_snapshot(
    make_daemon, short_tmp: Path
) -> None:
    d = make_daemon(overflowing_boxes(short_tmp))
    d.start()
    victim = start(d, "--", sys.executable, FAKE_JOB, "snapshot")
    wait_for(lambda: (r := d.record(victim))["state"] == "running" and r["snapshots"], 30, 0.05, "the victim")
    wait_for(lambda: (d.record(victim)["progress"].get("step") or 0) > 30, 30, 0.05, "a second of steps")
    urgent = start(d, "--gpus", "device=0", "--priority", "5", "--", *SLEEP)  # GPU 0 only: never on spare

    paused = wait_for(lambda: (r := d.record(victim))["retried_by"] and r, 60, 0.1, "the victim paused")
    assert paused["state"] == "stopped" and paused["snapshot"]["reason"] == "preempted", paused["message"]
    step = paused["snapshot"]["step"]
    again = wait_for(lambda: (r := d.record(paused["retried_by"]))["state"] == "running" and r, 60, 0.1)
    assert again["target"] == "spare" and again["gpus"] == ["1"] and again["resumed_from"] == victim
    assert again["chain"] == victim and again["preemption"]["paused"]["by"] == urgent
    assert f"checkpoint-{step} of {victim} carried from target local to spare" in notes(again)
    assert f"placed on spare, the overflow of local after 1s waiting: local's 1 GPU all held (by {urgent})" in (
        status(d, again["id"])
    )
    job_log = Path(again["remote_dir"]) / "job.log"
    wait_for(lambda: f"resumed from step {step}" in job_log.read_text(), 30, 0.1, "the resume's first line")
    for run in (urgent, again["id"]):
        d.call("cancel", id=run)


def test_a_placement_naming_what_the_config_lacks_is_refused_saying_what_to_give(
    boxes: DaemonProc, short_tmp: Path
) -> None:
    d = boxes
    out = d.cli("train", "start", "--target", "local,nope", "--", "true")
    assert out.returncode == 2, out.stdout + out.stderr
    said = out.stderr
    assert "unknown target or pool 'nope'" in said and "the targets are: local, spare" in said, said
    assert "the pools: gpus" in said and "--target a,b" in said and "obd targets list" in said, said
    assert d.call("list", all=True) == []  # nothing was made

    bad = short_tmp / "bad.toml"
    for text, expected in (
        (two_boxes(short_tmp, '\n[pools.more]\ntargets = ["local", "box"]\n'), "[pools.more]: no target box"),
        (two_boxes(short_tmp, '\n[pools.spare]\ntargets = ["local"]\n'), "spare is also a target's name"),
        (two_boxes(short_tmp).replace('gpus = ["0"]\n', 'gpus = ["0"]\noverflow = "elsewhere"\n', 1), "no such"),
        (
            two_boxes(short_tmp)
            .replace('gpus = ["0"]\n', 'gpus = ["0"]\noverflow = "spare"\n', 1)
            .replace('workdir = "', 'overflow = "local"\nworkdir = "', 1),
            "the overflows go round (local -> spare -> local)",
        ),
    ):
        bad.write_text(text)
        with pytest.raises(ConfigError) as refused:
            load_config(bad, environ={})
        assert expected in str(refused.value)


# --- overflow: a drained target's paused run continues on its overflow target -------------------


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


@pytest.fixture
def overflowing(make_daemon, sshd: SshServer, short_tmp: Path) -> Iterator[DaemonProc]:
    """This machine (`local`, two GPU ids) whose runs overflow to an SSH host (`box`) after 2 s."""
    pytest.importorskip("transformers")
    from tests.daemon.test_resume_elsewhere import ssh_target

    config = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\noverflow = "box"\n'
    config += 'overflow_after = "2s"\n' + ssh_target("box", sshd, short_tmp / "box", sys.executable)
    d = make_daemon(config)
    d.start()
    yield d
    kill_job_groups((short_tmp / "box").glob("*/job.pid"))


def test_a_drained_targets_paused_run_continues_on_its_overflow_target_after_the_wait_bitwise(
    overflowing: DaemonProc, short_tmp: Path
) -> None:
    from tests.daemon.test_resume_elsewhere import steps, trainer

    d = overflowing
    assert "overflow to box after 2s" in d.cli("targets", "list").stdout
    project = short_tmp / "project"
    project.mkdir()
    whole = d.wait_state(start(d, "--cwd", str(project), "--", *trainer()), "succeeded", "failed", timeout=300)
    assert whole["state"] == "succeeded", whole["message"]
    reference = steps(whole)

    rid = start(d, "--cwd", str(project), "--", *trainer("--hold-at", "4"))
    wait_for(lambda: (d.record(rid)["progress"].get("step") or 0) >= 4, 180, 0.1, "step 4")
    out = d.cli("targets", "drain", "local", "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    paused = wait_for(lambda: (r := d.record(rid))["retried_by"] and r, 60, 0.1, "the paused run requeued")
    assert paused["state"] == "stopped" and paused["snapshot"]["step"] == 5, paused["message"]

    after = paused["retried_by"]
    done = d.wait_state(after, "succeeded", "failed", timeout=300)
    assert done["state"] == "succeeded", done["message"]
    assert done["target"] == "box" and done["chain"] == rid and done["resumed_from"] == rid
    assert done["preemption"]["paused"]["why"] == "target local drained"
    said = status(d, after)
    assert "placed on box, the overflow of local after 2s waiting: local is drained" in said, said
    assert f"checkpoint-5 of {rid} carried from target local to box" in notes(done)

    later = steps(done)
    assert min(later) == 6 and max(later) == max(reference)  # none twice, none skipped
    assert later == {s: reference[s] for s in later}  # bitwise: losses and grad norms
    assert done["trackers"] == d.record(rid)["trackers"]  # one chain, one curve
    d.cli("targets", "undrain", "local")


# --- a pod at its cap continues on a new pod ------------------------------------------------------


def test_a_pod_run_at_its_cost_cap_with_a_retry_left_continues_on_a_new_pod_from_its_snapshot(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path
) -> None:
    # $0.69/h and a $0.002 cap: the pod's cost snapshot is asked ~8 s after it starts.
    cap = 'max_cost_usd = 0.002\nsnapshot_margin = 3\nretry = 1\n[retry]\nbackoff = "0.5s"\n'
    d = pods.make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, cap)
    try:
        rid = start(d, "--target", "pods", "--", sys.executable, FAKE_JOB, "snapshot")
        first = d.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=120)
        assert first["state"] == "stopped" and first["snapshot"]["reason"] == "cost", first["message"]
        step = first["snapshot"]["step"]

        second_id = wait_for(lambda: d.record(rid)["retried_by"], 60, 0.2, "the attempt on a new pod")
        second = d.wait_state(second_id, "stopped", "failed", "cancelled", "succeeded", timeout=120)
        assert second["state"] == "stopped" and second["snapshot"]["reason"] == "cost", second["message"]
        assert second["attempt"] == 2 and second["chain"] == rid and second["target"] == "pods"
        assert second["target_info"]["pod_id"] != first["target_info"]["pod_id"]  # a new pod
        assert second["resume_checkpoint"].endswith(f"/resume/checkpoint-{step}")  # carried to it
        assert f"checkpoint-{step} of {rid} carried from target pods to pods" in notes(second)
        assert f"retrying (cost): attempt 2 of 2 is {second_id}" in notes(d.record(rid))
        assert f"resumed from step {step}" in d.cli("train", "logs", second_id).stdout
        assert second["snapshot"]["step"] > step  # it trained on there
        assert fake.live_pods() == []
        assert d.record(second_id)["retried_by"] is None  # no retry left: the chain ends stopped
    finally:
        kill_jobs(short_tmp / "pod")
