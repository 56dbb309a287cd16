"""PodInfo: records written by earlier obd versions load, and are saved back with the same keys."""

from __future__ import annotations

import json

import pytest

from daemon.service.models import RunRecord
from executors.runpod import PodInfo, PodPhase
from tests.executors.runpod.conftest import Saves
from tests.fakes.runpod_api import FakeRunpod

# `target_info` as obd saved it before PodInfo existed (captured from a create against the fake):
# recorded before the create call, once the pod's id was known, and once it answered SSH.
BEFORE_CREATE = {
    "kind": "runpod",
    "target": "pods",
    "run_id": "20260101-000000-abcdef",
    "pod_name": "obd-20260101-000000-abcdef",
    "pod_id": None,
    "owner": "0a474138aff823fd",
    "phase": "creating",
    "gpu_types": ["NVIDIA GeForce RTX 4090"],
    "requested_at": 1796292412.2824295,
}
BOOTING = {
    **BEFORE_CREATE,
    "pod_id": "8g17u92mo47v9s",
    "phase": "booting",
    "gpu_type": "NVIDIA GeForce RTX 4090",
    "cost_per_hr": 0.69,
    "started_at": 1796292412.2841716,
    "max_hours": None,
    "max_cost_usd": 4.0,
}
READY = {
    **BOOTING,
    "phase": "ready",
    "ssh_host": "127.0.0.1",
    "ssh_port": 54807,
    "ssh_user": "root",
    "host_key": "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICUexFoCf0j/E8c0pImgNgP7j3u/H6w+qLO76Wg9OOIW",
}
# What the daemon added at the end of a run whose pod was stopped outside obd.
ENDED = {**READY, "stopped_outside": 1796292500.5, "ended": True, "restarted_at": 1796292501.0, "error": None}


@pytest.mark.parametrize("old", [BEFORE_CREATE, BOOTING, READY, ENDED], ids=["creating", "booting", "ready", "ended"])
def test_a_target_info_saved_by_earlier_obd_loads_and_saves_back_with_the_same_values(old: dict) -> None:
    info = PodInfo.from_record(old)
    saved = info.to_record()
    assert {k: saved[k] for k in old} == old  # every key it had, with the same value
    assert json.loads(json.dumps(saved)) == saved  # plain JSON


def test_a_run_record_of_earlier_obd_with_a_ready_pod_gives_what_the_follow_needs() -> None:
    record = RunRecord.model_validate(
        {"id": "20260101-000000-abcdef", "state": "running", "target": "pods", "target_info": READY}
    )
    info = PodInfo.from_record(record.target_info)
    assert info.is_ready and not info.settled and info.phase is PodPhase.ready
    assert info.pod_id == "8g17u92mo47v9s" and info.ssh_address == "root@127.0.0.1:54807"
    assert info.spend(READY["started_at"] + 3600) == pytest.approx(0.69)
    assert PodInfo.from_record(record.target_info | {"phase": "terminated"}).settled


def test_a_record_with_no_pod_yet_is_neither_ready_nor_waiting_on_a_create() -> None:
    empty = PodInfo.from_record({})
    assert not empty.is_ready and empty.pod_id is None
    assert empty.create_answer_due(90) is None  # nothing says a create was ever sent
    assert PodInfo.from_record(BEFORE_CREATE).create_answer_due(90) == BEFORE_CREATE["requested_at"] + 90
    assert PodInfo.from_record(BOOTING).create_answer_due(90) is None  # its create answered


def test_unknown_keys_in_a_record_are_ignored_not_refused() -> None:
    assert PodInfo.from_record({**READY, "from_the_future": 1}).pod_id == READY["pod_id"]


async def test_a_ready_pod_recorded_by_earlier_obd_is_reached_with_its_pinned_key(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver()
    made = await driver.create("r1", saves)
    # The record as the earlier obd wrote it: the same keys, no workdir, no create time.
    old = {k: v for k, v in made.to_record().items() if k in READY}
    info = await driver.resume(PodInfo.from_record(old), saves)
    ex = driver.executor(info)
    try:
        assert await ex.resolve_workdir() == driver.target.workdir
    finally:
        await ex.aclose()
