"""Creating a pod: records saved before the create, GPU types in order, ambiguity, boot faults."""

from __future__ import annotations

import pytest

from executors.base import ExecutorError
from executors.runpod import PodInfo, owner_id
from executors.runpod.api import AuthError
from tests.executors.runpod.conftest import Saves, fast_api
from tests.fakes.runpod_api import FakeRunpod, Gpu
from tests.sshd import SshServer

RTX, A40, H100 = "NVIDIA GeForce RTX 4090", "NVIDIA A40", "NVIDIA H100 80GB HBM3"


async def test_a_pod_is_created_tagged_and_reached_over_ssh_with_its_host_key_pinned(
    make_driver, fake: FakeRunpod, saves: Saves, pod_sshd: SshServer
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    [pod] = fake.live_pods()
    assert info.pod_id == pod["id"] and info.pod_name == "obd-r1" == pod["name"]
    assert "OBD_RUN_ID=r1" in pod["env"] and f"OBD_OWNER={driver.owner}" in pod["env"]
    assert any(e.startswith("PUBLIC_KEY=ssh-ed25519 ") for e in pod["env"])
    assert (info.ssh_host, info.ssh_port) == (pod_sshd.host, pod_sshd.port)
    assert info.host_key == " ".join(pod_sshd.host_key_line.split()[:2])
    assert info.cost_per_hr == pytest.approx(0.69) and info.gpu_type == RTX
    assert info.started_at <= info.requested_at + 5
    assert info.phase == "ready"


async def test_the_pod_name_is_saved_before_the_create_call_and_the_id_as_soon_as_known(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    info = await make_driver().create("r1", saves)
    first = saves.records[0]
    assert first.pod_id is None and first.pod_name == "obd-r1" and first.phase == "creating"
    assert saves.pods_at_save[0] == set()  # nothing existed yet when the name was saved
    booting = next(r for r in saves.records if r.phase == "booting")
    assert booting.pod_id == info.pod_id and booting.host_key is None
    assert saves.last == info


async def test_the_owner_id_is_stable_across_drivers_of_one_state_dir(tmp_path) -> None:
    assert owner_id(tmp_path) == owner_id(tmp_path)
    assert owner_id(tmp_path) != owner_id(tmp_path / "other")


async def test_gpu_types_are_tried_in_order_until_one_has_capacity(make_driver, fake: FakeRunpod, saves: Saves) -> None:
    fake.set_capacity(RTX, 0)
    info = await make_driver(gpu_type=[RTX, A40, H100]).create("r1", saves)
    assert info.gpu_type == A40
    assert [c["gpuTypeId"] for c in fake.creates] == [A40]
    assert len(fake.live_pods()) == 1


async def test_no_capacity_for_any_gpu_type_is_a_clear_error_and_nothing_is_created(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.set_capacity(RTX, 0)
    fake.set_capacity(A40, 0)
    with pytest.raises(ExecutorError, match=r"no capacity .* Nothing was created and nothing is billed"):
        await make_driver(gpu_type=[RTX, A40]).create("r1", saves)
    assert fake.live_pods() == [] and fake.creates == []
    assert fake.ops().count("podFindAndDeployOnDemand") == 2
    assert saves.last.phase == "create_failed"


async def test_a_create_that_times_out_but_happened_is_found_by_its_tag_and_not_duplicated(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.inject("timeout", op="podFindAndDeployOnDemand", delay=1.5)
    driver = make_driver(api=fast_api(call_timeout=0.4))
    info = await driver.create("r1", saves)
    assert len(fake.creates) == 1
    assert [p["id"] for p in fake.live_pods()] == [info.pod_id]


@pytest.mark.parametrize("kind", ["drop", "502", "429", "drop_before"])
async def test_a_create_that_failed_ambiguously_never_leaves_two_pods(
    make_driver, fake: FakeRunpod, saves: Saves, kind: str
) -> None:
    fake.inject(kind, op="podFindAndDeployOnDemand")
    info = await make_driver().create("r1", saves)
    assert [p["id"] for p in fake.live_pods()] == [info.pod_id]
    assert len(fake.creates) == 1


async def test_a_create_that_keeps_failing_gives_up_without_leaving_a_pod(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.inject("502", op="podFindAndDeployOnDemand", times=20)
    with pytest.raises(ExecutorError, match="kept failing"):
        await make_driver().create("r1", saves)
    assert fake.live_pods() == []


async def test_a_pod_that_never_gets_a_public_ssh_port_is_terminated_after_boot_grace(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.ssh_endpoint = None
    with pytest.raises(ExecutorError, match=r"no working public SSH port within boot_grace .* was terminated"):
        await make_driver(boot_grace=0.5).create("r1", saves)
    assert fake.live_pods() == [] and len(fake.terminated) == 1
    assert saves.last.phase == "terminated" and saves.last.pod_id in fake.terminated


async def test_a_public_port_where_no_sshd_answers_is_not_taken_for_a_ready_pod(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    from tests.sshd import free_port

    fake.ssh_endpoint = ("127.0.0.1", free_port())
    with pytest.raises(ExecutorError, match="does not answer SSH"):
        await make_driver(boot_grace=0.5).create("r1", saves)
    assert fake.live_pods() == []


async def test_a_pod_terminated_from_outside_while_booting_is_reported(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.ssh_endpoint = None
    fake.ready_after = 10**6

    async def save_and_kill(record: PodInfo) -> None:
        await saves(record)
        if record.phase == "booting":
            fake.terminate_from_outside(record.pod_id)

    with pytest.raises(ExecutorError, match="disappeared while it was booting"):
        await make_driver().create("r1", save_and_kill)
    assert fake.live_pods() == []


async def test_a_cost_cap_with_no_known_hourly_rate_is_refused_before_anything_is_created(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.add_gpu(Gpu("NVIDIA Mystery", secure_price=None, community_price=None))
    with pytest.raises(ExecutorError, match=r"max_cost_usd .* no hourly rate is known .* nothing was created"):
        await make_driver(gpu_type="NVIDIA Mystery", max_cost_usd=10).create("r1", saves)
    assert saves.records == [] and fake.creates == [] and "podFindAndDeployOnDemand" not in fake.ops()


async def test_a_cost_cap_skips_gpu_types_without_a_rate_and_uses_the_next(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    fake.add_gpu(Gpu("NVIDIA Mystery", secure_price=None, community_price=None))
    info = await make_driver(gpu_type=["NVIDIA Mystery", A40], max_cost_usd=10).create("r1", saves)
    assert info.gpu_type == A40 and info.cost_per_hr == pytest.approx(0.40)


async def test_a_bad_api_key_is_a_clear_error_before_anything_is_recorded(
    make_driver, fake: FakeRunpod, saves: Saves, monkeypatch
) -> None:
    monkeypatch.setenv("RUNPOD_API_KEY", "not-a-key")
    with pytest.raises(AuthError, match="refused the API key") as info:
        await make_driver().create("r1", saves)
    assert "not-a-key" not in str(info.value)
    assert saves.records == [] and fake.live_pods() == []


async def test_an_unknown_gpu_type_is_named_in_the_error(make_driver, fake: FakeRunpod, saves: Saves) -> None:
    with pytest.raises(ExecutorError, match="NVIDIA Nope"):
        await make_driver(gpu_type="NVIDIA Nope").create("r1", saves)
    assert fake.creates == []


async def test_an_invalid_run_id_never_reaches_the_api(make_driver, fake: FakeRunpod, saves: Saves) -> None:
    with pytest.raises(ExecutorError, match="invalid run id"):
        await make_driver().create('r1"} x', saves)
    assert fake.calls == []
