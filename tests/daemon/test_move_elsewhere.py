"""`obd train move RUN --to T` (issue 36's "Done when") from an SSH host to this machine, and from
this machine to a Slurm cluster and to a pod, through the real daemon: a user's unchanged Trainer
script (tests/trainer_plugin/scripts/plain_trainer.py) snapshotted where it runs, its checkpoint
carried to T (this machine's run directory; a Slurm target's shared directory; a pod of the fake
Runpod API, whose SSH is a loopback sshd), every file's sha256 verified on arrival, and the
training continued there as the next run of the chain: its losses after the snapshot an
uninterrupted run's bitwise, one curve in `obd train plot` and the web view. The move from this
machine to an SSH host, and what a failed carry leaves, are tests/daemon/test_move.py's."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, DaemonProc, wait_for
from tests.daemon import pods
from tests.daemon.test_resume_elsewhere import (  # noqa: F401 - the fixture
    STEPS,
    notes,
    sshd,
    start,
    trainer,
    two_places,
)
from tests.daemon.test_slurm_target import jobs_named
from tests.executors.runpod.conftest import kill_jobs
from tests.executors.slurm.cluster import Cluster
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the shared fixture
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

pytest.importorskip("transformers")

pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures
LOCAL = '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'  # ids, no GPU
HOLD = 4  # the run waits after this step for the move's snapshot, which is at the end of the next


def losses(metrics: Path) -> dict[int, tuple[float, float]]:
    lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return {x["step"]: (x["loss"], x.get("grad_norm")) for x in lines if x.get("event") == "log" and "loss" in x}


def moved_bitwise(
    d: DaemonProc, project: Path, to: str, metrics_of=lambda r: Path(r["remote_dir"]), source: str = "local"
) -> dict:
    """An uninterrupted run here, then the same run started on `source` and moved to `to` at step
    HOLD + 1: the move exits 0, the run continues there as the next run of its chain, every later
    step's loss and gradient norm are the uninterrupted run's, and `plot` and the web view draw
    one curve of both. The new run's record."""
    whole = d.wait_state(start(d, project), "succeeded", "failed", timeout=300)
    assert whole["state"] == "succeeded", whole["message"]
    reference = losses(Path(whole["remote_dir"]) / "metrics.jsonl")
    assert sorted(reference) == list(range(1, STEPS + 1))

    out = d.cli("train", "start", "--target", source, "--cwd", str(project), "--", *trainer("--hold-at", str(HOLD)))
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()  # trains on past step HOLD only once a snapshot is asked
    wait_for(lambda: (d.record(rid)["progress"].get("step") or 0) >= HOLD, 180, 0.1, f"step {HOLD} of {rid}")
    out = d.cli("train", "move", rid, "--to", to, "--wait", timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr

    moved = d.record(rid)
    snap = HOLD + 1
    assert moved["state"] == "stopped" and moved["snapshot"]["step"] == snap, moved["message"]
    assert moved["target"] == source
    move = moved["move"]
    assert move["state"] == "done" and move["to"] == to, move
    assert (Path(moved["remote_dir"]) / "output" / f"checkpoint-{snap}").is_dir()  # nothing deleted there

    new = d.record(move["run"])
    assert new["target"] == to and new["resumed_from"] == rid
    said = notes(new)
    assert f"checkpoint-{snap} of {rid} carried from target {source} to {to}" in said, said
    assert "sha256 verified on arrival" in said and f"moved from run {rid} of target {source}" in said
    assert new["resume_checkpoint"].endswith(f"/resume/checkpoint-{snap}")  # the carried copy, not the source's
    assert f"resumed   from {rid}" in d.cli("train", "status", new["id"]).stdout

    new = d.wait_state(new["id"], "succeeded", "failed", timeout=300)
    assert new["state"] == "succeeded", new["message"]
    there = losses(metrics_of(new) / "metrics.jsonl")
    assert sorted(there) == list(range(snap + 1, STEPS + 1))  # none twice, none skipped
    assert there == {s: reference[s] for s in there}  # bitwise: losses and grad norms
    assert new["trackers"] == moved["trackers"]  # the tracker run continued

    # One chain: `plot` and the web view draw one curve, the source's steps then the new run's.
    out = d.cli("train", "plot", new["id"], "--json")
    assert out.returncode == 0, out.stderr
    [curve] = json.loads(out.stdout)
    assert curve["runs"] == [rid, new["id"]]
    assert [tuple(p) for p in curve["points"]] == [(s, reference[s][0]) for s in range(1, STEPS + 1)]
    assert [p[0] for p in curve["resumes"]] == [snap + 1]
    assert web_curve(d, new["id"])["points"] == curve["points"]
    return new


def web_curve(d: DaemonProc, rid: str) -> dict:
    """The curve a browser's page of the run opens with (the web view's feed)."""
    from daemon.cli.ui.feed import RunFeed
    from daemon.cli.ui.hub import Hub

    socket = Path(d.env["OBD_SOCKET"])
    feed = RunFeed(socket, rid, Hub(socket))
    try:
        for event in feed.events():
            assert event is not None and event[0] != "error", event
            if event[0] == "curve":
                assert event[1]["runs"][-1] == rid and not event[1]["note"], event[1]
                return json.loads(json.dumps(event[1]))  # as the browser gets it
        raise AssertionError("no curve")
    finally:
        feed.close()


# --- an SSH host -> local -------------------------------------------------------------------------


def test_a_run_moved_from_an_ssh_host_to_this_machine_continues_here_bitwise_as_one_chain(
    two_places: DaemonProc,  # noqa: F811 - the fixture
    short_tmp: Path,
) -> None:
    project = short_tmp / "project"  # uploaded to the host, used in place here
    project.mkdir()
    new = moved_bitwise(two_places, project, "local", source="box")
    assert not new["remote_dir"].startswith(str(short_tmp / "box"))


# --- local -> Slurm ------------------------------------------------------------------------------


@pytest.fixture
def here_and_slurm(make_daemon, slurm_cluster: Cluster, short_tmp: Path) -> Iterator[DaemonProc]:  # noqa: F811
    """This machine (`local`) and a Slurm cluster whose nodes see its files (`hpc`)."""
    config = FAST_CONFIG + LOCAL
    config += f'\n[targets.hpc]\nkind = "slurm"\nworkdir = "{short_tmp / "shared"}"\nvenv = "{sys.prefix}"\n'
    d = make_daemon(config)
    d.env.update(slurm_cluster.env)
    d.cluster = slurm_cluster
    d.start()
    yield d
    d.stop()
    slurm_cluster.run("scancel", "--user=root", check=False)
    wait_for(lambda: not slurm_cluster.stepds(), 30, 0.2, "the cluster's jobs to end")


def test_a_running_run_moved_to_a_slurm_cluster_continues_there_bitwise_as_one_chain(
    here_and_slurm: DaemonProc, short_tmp: Path
) -> None:
    project = short_tmp / "project"  # the job's directory, used in place on the cluster's nodes
    project.mkdir()
    d = here_and_slurm
    new = moved_bitwise(d, project, "hpc")
    assert new["remote_dir"].startswith(str(short_tmp / "shared"))
    assert [j["state"] for j in jobs_named(d.cluster, new["id"])] == ["COMPLETED"]  # type: ignore[attr-defined]


# --- local -> a pod ------------------------------------------------------------------------------


@pytest.fixture
def here_and_pods(make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path) -> Iterator[DaemonProc]:
    """This machine (`local`) and Runpod (`pods`: the fake API, each pod the loopback sshd)."""
    yield pods.make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, LOCAL)
    kill_jobs(short_tmp / "pod")


def test_a_running_run_moved_to_a_pod_continues_there_bitwise_as_one_chain(
    here_and_pods: DaemonProc, fake: FakeRunpod, short_tmp: Path
) -> None:
    d = here_and_pods
    project = short_tmp / "project"  # uploaded to the pod
    project.mkdir()
    retrieved = lambda r: d.state_dir / "runs" / r["id"] / "retrieved"  # noqa: E731 - the pod is gone
    new = moved_bitwise(d, project, "pods", metrics_of=retrieved)
    pod_id = new["target_info"]["pod_id"]
    assert "sha256 verified" in new["message"] and f"pod {pod_id} terminated" in new["message"], new["message"]
    assert fake.live_pods() == []  # its outputs brought home, then the pod ended
