"""`obd pods list | rm | retrieve` (daemon/service/pods_admin.py), straight through the driver (no daemon)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import anyio
import pytest

from daemon.service.config import Config
from daemon.service.pods_admin import format_pods, pods_main
from tests.executors.runpod.conftest import Saves, fast_api
from tests.fakes.runpod_api import FakeRunpod


def config_for(driver, state_dir: Path) -> Config:
    config = Config.model_validate({"targets": {"pods": driver.target.model_dump()}})
    config.daemon.state_dir = state_dir
    return config


def cli(config: Config, driver, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = pods_main(list(argv), config, out=out, err=err, api=fast_api(), ssh_user=driver.ssh_user)
    return code, out.getvalue(), err.getvalue()


def test_pods_list_shows_only_the_pods_this_obd_created_with_rate_and_spend(
    make_driver, fake: FakeRunpod, tmp_path: Path
) -> None:
    driver = make_driver()
    info = anyio.run(driver.create, "r1", Saves(fake))
    fake.add_foreign_pod("obd-other", {"OBD_OWNER": "someone-else", "OBD_RUN_ID": "x"})
    fake.add_foreign_pod("notebook")
    config = config_for(driver, tmp_path / "state")
    code, out, err = cli(config, driver, "list")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["POD", "RUN", "STATE", "GPU", "$/H", "SPEND", "$", "UP", "SSH"]
    assert len(lines) == 2 and info.pod_id in lines[1] and "r1" in lines[1] and "0.69" in lines[1]
    code, out, _ = cli(config, driver, "list", "--json")
    [pod] = json.loads(out)
    assert pod["pod_id"] == info.pod_id and pod["run_id"] == "r1" and pod["spend_usd"] is not None


def test_pods_rm_terminates_one_of_obd_s_pods_and_refuses_anyone_else_s(
    make_driver, fake: FakeRunpod, tmp_path: Path
) -> None:
    driver = make_driver()
    info = anyio.run(driver.create, "r1", Saves(fake))
    other = fake.add_foreign_pod("notebook")
    config = config_for(driver, tmp_path / "state")
    code, _, err = cli(config, driver, "rm", other)
    assert code == 1 and "not created by this obd install" in err and "--force" in err
    assert other in {p["id"] for p in fake.live_pods()}
    code, out, _ = cli(config, driver, "rm", info.pod_id)
    assert code == 0 and "terminated" in out
    assert {p["id"] for p in fake.live_pods()} == {other}
    code, _, err = cli(config, driver, "rm", info.pod_id)
    assert code == 1 and "does not exist" in err


def test_pods_retrieve_fetches_a_run_s_outputs_after_a_failed_finish(
    make_driver, fake: FakeRunpod, tmp_path: Path
) -> None:
    driver = make_driver()
    info = anyio.run(driver.create, "r1", Saves(fake))
    remote = Path(driver.target.workdir) / "r1"
    (remote / "output").mkdir(parents=True)
    (remote / "output" / "adapter.bin").write_bytes(b"w" * 1000)
    broken = info.model_copy(update={"ssh_port": 1})
    ok, message = anyio.run(driver.finish, "r1", str(remote), broken, tmp_path / "out")
    assert not ok and "obd pods retrieve r1" in message
    driver.book.put("r1", target_info=info)  # the daemon's record keeps the right port
    code, _, err = cli(config_for(driver, tmp_path / "state"), driver, "retrieve", "r1")
    assert code == 0, err
    assert (tmp_path / "out" / "output" / "adapter.bin").read_bytes() == b"w" * 1000
    assert fake.live_pods() == []


def test_pods_usage_errors_exit_2_and_api_errors_exit_1(
    make_driver, fake: FakeRunpod, tmp_path: Path, monkeypatch
) -> None:
    driver = make_driver()
    config = config_for(driver, tmp_path / "state")
    assert cli(config, driver, "frobnicate")[0] == 2
    assert cli(config, driver, "--target", "nope", "list")[0] == 2
    monkeypatch.setenv("RUNPOD_API_KEY", "sekrit-123")
    code, _, err = cli(config, driver, "list")
    assert code == 1 and "refused the API key" in err and "sekrit-123" not in err


def test_the_pods_table_says_so_when_there_are_none() -> None:
    assert format_pods([], 0) == "no pods created by this obd install"


def test_pods_list_without_a_key_in_its_shell_says_it_needs_the_key_there_not_in_the_daemons(
    make_driver, fake: FakeRunpod, tmp_path: Path, monkeypatch
) -> None:
    driver = make_driver()
    config = config_for(driver, tmp_path / "state")
    monkeypatch.delenv("RUNPOD_API_KEY")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.runpod/config.toml either
    code, out, err = cli(config, driver, "list")
    assert code == 1 and out == ""
    assert err.startswith("obd pods: no Runpod API key: ")
    # It names this process, how to give it the key, and how to use the service's key as root.
    assert "`obd pods` calls the Runpod API itself, from this shell, not through the daemon" in err
    assert "export RUNPOD_API_KEY=" in err and "runpod config" in err
    assert "sudo sh -c 'set -a; . /etc/obd/env; exec obd pods list'" in err
    assert "in the daemon's environment" not in err and "systemctl restart" not in err


def test_a_key_the_api_refuses_in_obd_pods_is_said_to_be_this_shells(fake: FakeRunpod) -> None:
    from executors.runpod.api import CLIENT_KEY_HELP, DAEMON_KEY_HELP, AuthError, RunpodApi

    api = fast_api(api_key="not-the-key")
    api.key_help = CLIENT_KEY_HELP
    with pytest.raises(AuthError) as caught:
        anyio.run(api.list_pods)
    message = str(caught.value)
    assert "refused the API key" in message and "from this shell, not through the daemon" in message
    assert "not-the-key" not in message
    assert RunpodApi().key_help == DAEMON_KEY_HELP  # the daemon's calls name the daemon's environment
