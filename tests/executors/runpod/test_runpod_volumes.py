"""A target's storage: a pod volume of `volume_gb`, or an existing network volume (`network_volume_id`).

What the fake receives is the GraphQL the runpod SDK builds, decoded by the fake's parser, so the
fields below are the ones the SDK's `podFindAndDeployOnDemand` mutation carries.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest
from pydantic import ValidationError

from daemon.service.config import ConfigError, RunpodTarget, load_config
from executors.base import ExecutorError
from tests.executors.runpod.conftest import Saves
from tests.fakes.runpod_api import FakeRunpod

VOLUME = "vol-eu"  # the fake account's network volume, in data center EU-RO-1


def write_config(tmp_path: Path, target: str) -> Path:
    path = tmp_path / "obd.toml"
    path.write_text('[targets.gpu]\nkind = "runpod"\n' + target)
    return path


async def test_a_network_volume_target_creates_its_pod_on_that_volume(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    info = await make_driver(network_volume_id=VOLUME).create("r1", saves)
    [create] = fake.creates
    assert create["networkVolumeId"] == VOLUME
    assert create["dataCenterId"] == "EU-RO-1"  # the pod is placed where the volume is
    assert create.get("volumeInGb", 0) == 0  # no pod volume is asked for (and billed) besides it
    [pod] = fake.live_pods()
    assert pod["id"] == info.pod_id and pod["networkVolumeId"] == VOLUME
    assert info.phase == "ready"


async def test_a_volume_gb_target_asks_for_a_pod_volume_of_that_size_and_no_network_volume(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    await make_driver(volume_gb=120).create("r1", saves)
    [create] = fake.creates
    assert create["volumeInGb"] == 120
    assert "networkVolumeId" not in create
    assert create["volumeMountPath"] == "/workspace"


async def test_a_target_that_names_no_volume_gets_a_pod_volume_of_the_default_size(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    await make_driver().create("r1", saves)
    [create] = fake.creates
    assert create["volumeInGb"] == RunpodTarget(kind="runpod").volume_gb == 50
    assert "networkVolumeId" not in create


async def test_with_a_network_volume_the_run_directory_is_on_the_volume_mounted_at_workspace(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    await make_driver(network_volume_id=VOLUME).create("r1", saves)
    [create] = fake.creates
    assert create["volumeMountPath"] == "/workspace"
    [pod] = fake.live_pods()
    assert pod["volumeMountPath"] == "/workspace"
    # The default workdir (where each run directory and its outputs live) is on that volume.
    default_workdir = PurePosixPath(RunpodTarget(kind="runpod", network_volume_id=VOLUME).workdir)
    assert default_workdir == PurePosixPath("/workspace/obd")
    assert default_workdir.is_relative_to(create["volumeMountPath"])


async def test_a_network_volume_the_account_does_not_have_fails_the_create_clearly_and_leaves_no_pod(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    with pytest.raises(ExecutorError, match=r"refused .*Network volume vol-gone was not found"):
        await make_driver(network_volume_id="vol-gone").create("r1", saves)
    assert fake.live_pods() == [] and fake.creates == []
    assert saves.last.phase == "create_failed" and "vol-gone" in saves.last.error


def test_a_network_volume_target_without_volume_gb_is_a_valid_config(tmp_path: Path) -> None:
    config = load_config(write_config(tmp_path, f'network_volume_id = "{VOLUME}"\n'), environ={})
    target = config.target("gpu")
    assert isinstance(target, RunpodTarget) and target.network_volume_id == VOLUME


def test_volume_gb_and_network_volume_id_together_are_a_config_error_naming_both_keys(
    tmp_path: Path, fake: FakeRunpod
) -> None:
    path = write_config(tmp_path, f'volume_gb = 50\nnetwork_volume_id = "{VOLUME}"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert "targets.gpu" in message
    assert "volume_gb and network_volume_id are both set" in message and "remove one" in message
    assert fake.calls == []


@pytest.mark.parametrize(
    "bad",
    ['vol"eu', "vol eu", "vol\neu", "vol\\eu", "", 'x", gpuCount: 8, name: "y'],
    ids=["quote", "space", "newline", "backslash", "empty", "graphql-injection"],
)
def test_a_malformed_network_volume_id_is_a_config_error_naming_the_key(
    tmp_path: Path, fake: FakeRunpod, bad: str
) -> None:
    path = write_config(tmp_path, f"network_volume_id = {json.dumps(bad)}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    message = str(caught.value)
    assert "targets.gpu.network_volume_id" in message
    assert "is not a Runpod network volume id" in message and "Runpod console" in message
    assert fake.calls == []


def test_a_bad_volume_config_never_gets_as_far_as_a_driver_or_the_api(make_driver, fake: FakeRunpod) -> None:
    with pytest.raises(ValidationError, match="network_volume_id"):
        make_driver(network_volume_id="vol eu")
    with pytest.raises(ValidationError, match="both set"):
        make_driver(network_volume_id=VOLUME, volume_gb=20)
    assert fake.calls == [] and fake.creates == []
