"""The reconcile with several Runpod targets and with a create whose outcome is not known yet.

Issue 11.10: pods are matched to the target (and workdir) they were made for. Issue 11.9: a run
recorded mid-create is not declared "never created" while its create may still make a pod.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from executors.runpod import PodInfo, PodPhase
from tests.executors.runpod.conftest import Saves
from tests.fakes.runpod_api import FakeRunpod


def write_outputs(workdir: Path, run_id: str) -> str:
    """Outputs put straight into the pod's run directory (the pod's disk is this machine's)."""
    remote_dir = workdir / run_id
    (remote_dir / "output").mkdir(parents=True)
    (remote_dir / "output" / "adapter.bin").write_bytes(b"w" * 1000)
    (remote_dir / "exit_code").write_text("0\n")
    return str(remote_dir)


async def test_two_runpod_targets_never_take_each_others_live_pods_for_orphans(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    a = make_driver(name="a")
    b = make_driver(name="b", workdir=str(tmp_path / "other-pod"))
    in_a = await a.create("r1", saves)
    in_b = await b.create("r2", saves)
    seen_by_a = await a.reconcile({"r1": in_a})
    seen_by_b = await b.reconcile({"r2": in_b})
    assert [(f.kind, f.run_id) for f in seen_by_a] == [("matched", "r1")]
    assert [(f.kind, f.run_id) for f in seen_by_b] == [("matched", "r2")]
    pods = {p["id"]: p["env"] for p in fake.live_pods()}
    assert "OBD_TARGET=a" in pods[in_a.pod_id] and "OBD_TARGET=b" in pods[in_b.pod_id]


async def test_an_orphan_is_found_under_the_workdir_its_pod_was_made_with(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    made = make_driver(name="a")
    await made.create("r1", saves)
    remote_dir = write_outputs(Path(made.target.workdir), "r1")
    # Later: the daemon's state is gone (a new machine, same install id) and the target's
    # workdir was changed in the config. The pod's tags still say where its run directory is.
    state = tmp_path / "new-state"
    (state / "runpod").mkdir(parents=True)
    shutil.copy(made.state_dir / "runpod" / "owner", state / "runpod" / "owner")
    later = make_driver(name="a", state_dir=state, workdir=str(tmp_path / "moved"))
    [orphan] = await later.reconcile({})
    assert orphan.kind == "orphan" and orphan.remote_dir == remote_dir
    assert orphan.target_info is not None
    ok, message = await later.finish("r1", orphan.remote_dir, orphan.target_info, tmp_path / "back")
    assert ok, message
    assert (tmp_path / "back" / "output" / "adapter.bin").read_bytes() == b"w" * 1000
    assert fake.live_pods() == []


async def test_a_pod_made_before_pods_were_tagged_with_their_target_goes_to_one_target_only(
    make_driver, fake: FakeRunpod
) -> None:
    a, b = make_driver(name="a"), make_driver(name="b")
    old = fake.add_foreign_pod("obd-r9", {"OBD_RUN_ID": "r9", "OBD_OWNER": a.owner})  # no OBD_TARGET
    taken = await a.reconcile({}, take_untagged=True)
    left = await b.reconcile({}, take_untagged=False)
    assert [(f.kind, f.pod_id) for f in taken] == [("orphan", old)]
    assert left == []


async def test_a_run_recorded_mid_create_is_looked_at_again_until_its_create_could_have_answered(
    make_driver, fake: FakeRunpod
) -> None:
    driver = make_driver()
    now = time.time()
    mid_create = PodInfo(
        target="pods", run_id="r1", pod_name="obd-r1", phase=PodPhase.creating, requested_at=now, create_sent_at=now
    )
    [finding] = await driver.reconcile({"r1": mid_create})
    assert finding.kind == "creating" and finding.look_again_at is not None
    assert now < finding.look_again_at <= now + driver.create_window
    long_ago = mid_create.model_copy(update={"create_sent_at": now - driver.create_window - 1})
    [finding] = await driver.reconcile({"r1": long_ago})
    assert finding.kind == "not_created"
    # A record of an earlier obd has only the time the create was decided.
    earlier = PodInfo.from_record({"run_id": "r1", "pod_name": "obd-r1", "phase": "creating", "requested_at": now})
    [finding] = await driver.reconcile({"r1": earlier})
    assert finding.kind == "creating"
