"""The pod watchdog's rules, each with an injected clock and a run directory on this machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from tests.fakes.runpod_api import FakeRunpod
from trainer_plugin.tools import watchdog
from trainer_plugin.tools.watchdog import Watchdog, manifest

HOUR = 3600.0
T0 = 1_700_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class World:
    """A run directory, a clock, a disk, and records of what the watchdog deleted and cancelled."""

    def __init__(self, run_dir: Path, **cfg: Any) -> None:
        self.run_dir = run_dir
        self.clock = Clock()
        self.deleted: list[str] = []
        self.cancelled: list[float] = []
        self.delete_error: Exception | None = None
        self.disk = SimpleNamespace(f_bavail=500 * 10**6, f_bfree=500 * 10**6, f_blocks=1000 * 10**6, f_frsize=1000)
        config = {"run_dir": str(run_dir), "pod_id": "pod1", "started_at": T0, "boot_grace": 600, "abandon_grace": 1800,
                  "snapshot_margin": 900, "kill_grace": 0}  # fmt: skip
        config.update(cfg)
        self.dog = Watchdog(
            config, clock=self.clock, statvfs=lambda p: self.disk, delete_pod=self._delete, cancel_job=self._cancel
        )

    def _delete(self, pod_id: str) -> None:
        if self.delete_error:
            raise self.delete_error
        self.deleted.append(pod_id)

    def _cancel(self, run_dir: str, grace: float) -> None:
        self.cancelled.append(self.clock.now)
        (Path(run_dir) / "cancelled").write_text("{}")

    def at(self, seconds: float) -> bool:
        """Move the clock to T0 + seconds and take one step."""
        self.clock.now = T0 + seconds
        return self.dog.step()

    def request(self) -> str | None:
        path = self.run_dir / "snapshot.request"
        return path.read_text().strip() if path.exists() else None

    def log(self) -> list[dict[str, Any]]:
        path = self.run_dir / "watchdog.log"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def events(self) -> list[tuple[str, str]]:
        return [(e["event"], e["reason"]) for e in self.log()]

    def start_job(self) -> None:
        """A job.pid naming this very process: alive, with the right start time."""
        from trainer_plugin.tools import jobctl

        me = os.getpid()
        handle = {"pid": me, "start_time": jobctl.process_start_time(me), "boot_id": jobctl.boot_id()}
        (self.run_dir / "job.pid").write_text(json.dumps(handle))

    def end_job(self, at: float, code: int = 0) -> None:
        path = self.run_dir / "exit_code"
        path.write_text(f"{code}\n")
        os.utime(path, (T0 + at, T0 + at))

    def lease(self, expiry: float, written_at: float | None = None) -> None:
        path = self.run_dir / "lease"
        path.write_text(f"{T0 + expiry:.3f}\n")
        mtime = T0 + (written_at if written_at is not None else expiry - 60)
        os.utime(path, (mtime, mtime))


@pytest.fixture
def world(tmp_path: Path):
    def make(**cfg: Any) -> World:
        return World(tmp_path, **cfg)

    return make


def test_the_deadline_request_is_written_ahead_of_max_hours(world) -> None:
    w = world(max_hours=2)
    w.start_job()
    assert not w.at(2 * HOUR - 901)
    assert w.request() is None
    w.at(2 * HOUR - 899)
    assert w.request() == "deadline"
    assert ("snapshot_requested", "deadline") in w.events()
    assert w.cancelled == []


def test_a_short_deadline_is_asked_for_a_quarter_of_the_way_before_it_not_at_once(world) -> None:
    w = world(max_hours=0.1)  # 6 minutes: the 15 min margin would ask at the start
    w.start_job()
    w.at(10)
    assert w.request() is None
    w.at(360 - 91)
    assert w.request() is None
    w.at(360 - 89)
    assert w.request() == "deadline"


def test_the_job_is_cancelled_at_the_deadline_when_no_daemon_holds_the_lease(world) -> None:
    w = world(max_hours=1)
    w.start_job()
    w.at(HOUR - 10)
    w.at(HOUR + 1)
    assert w.cancelled == [T0 + HOUR + 1]
    assert ("job_cancelled", "deadline") in w.events()


def test_a_fresh_daemon_lease_keeps_the_watchdog_off_the_deadline(world) -> None:
    w = world(max_hours=1)
    w.start_job()
    w.lease(expiry=HOUR + 120)
    w.at(HOUR + 60)
    assert w.request() is None and w.cancelled == []
    w.at(HOUR + 121)  # the lease ran out: the daemon is gone
    assert w.request() == "deadline"
    assert w.cancelled == [T0 + HOUR + 121]


def test_a_decision_left_to_the_daemon_under_its_lease_is_logged_once(world) -> None:
    w = world(max_hours=1, abandon_grace=60)
    w.start_job()
    w.lease(expiry=HOUR + 600)
    w.at(HOUR - 60)
    w.at(HOUR - 30)
    assert w.events() == [("left_to_the_daemon", "deadline")]
    assert w.log()[0]["lease_until"] == pytest.approx(T0 + HOUR + 600)
    w.end_job(at=HOUR)
    w.at(HOUR + 120)
    w.at(HOUR + 180)
    assert w.events() == [("left_to_the_daemon", "deadline"), ("left_to_the_daemon", "abandoned")]
    assert w.request() is None and w.cancelled == [] and w.deleted == []


def test_a_lease_whose_file_is_too_old_counts_as_stale_whatever_it_says(world) -> None:
    w = world(max_hours=1, lease_max_ttl=600)
    w.start_job()
    w.lease(expiry=100 * HOUR, written_at=0)  # a daemon clock far ahead, or a bogus lease
    w.at(HOUR - 60)
    assert w.request() == "deadline"


def test_the_cost_request_is_written_ahead_of_max_cost_from_the_rate_and_start(world) -> None:
    w = world(cost_per_hr=2.0, max_cost_usd=5.0)  # the cap is reached at 2.5 h
    w.start_job()
    w.at(2.5 * HOUR - 901)
    assert w.request() is None
    w.at(2.5 * HOUR - 899)
    assert w.request() == "cost"
    [line] = [e for e in w.log() if e["event"] == "snapshot_requested"]
    assert line["spend_usd"] == pytest.approx(2.0 * (2.5 * HOUR - 899) / HOUR, abs=1e-3)


def test_the_cost_request_is_written_even_under_a_fresh_lease_but_the_cancel_is_not(world) -> None:
    w = world(cost_per_hr=2.0, max_cost_usd=5.0)
    w.start_job()
    w.lease(expiry=10 * HOUR)
    w.at(2.5 * HOUR + 5)
    assert w.request() == "cost"
    assert w.cancelled == []


def test_the_disk_request_is_written_when_free_space_falls_under_the_threshold(world) -> None:
    w = world(disk_min_free_gb=100)
    w.start_job()
    w.at(10)
    assert w.request() is None
    w.disk.f_bavail = 90 * 10**6  # 90 GB free
    w.at(20)
    assert w.request() == "disk"
    [line] = [e for e in w.log() if e["event"] == "snapshot_requested"]
    assert line["free_gb"] == pytest.approx(90.0)


def test_the_disk_request_is_written_when_use_goes_over_the_percentage(world) -> None:
    w = world(disk_max_used_pct=80)
    w.start_job()
    w.disk.f_bavail = w.disk.f_bfree = 150 * 10**6  # 85 % used
    w.at(10)
    assert w.request() == "disk"


def test_an_existing_request_is_never_overwritten(world) -> None:
    w = world(max_hours=1)
    w.start_job()
    (w.run_dir / "snapshot.request").write_text("requested\n")
    w.at(HOUR - 60)
    assert w.request() == "requested"
    assert ("request_exists", "deadline") in w.events()


def test_the_pod_is_deleted_when_the_job_ended_and_nobody_retrieved_within_the_grace(world) -> None:
    w = world(abandon_grace=1800)
    w.start_job()
    w.at(100)
    w.end_job(at=200)
    assert not w.at(200 + 1799)
    assert w.deleted == []
    assert w.at(200 + 1801)
    assert w.deleted == ["pod1"]
    assert ("pod_deleted", "abandoned") in w.events()


def test_a_daemon_holding_the_lease_keeps_an_ended_job_s_pod_up(world) -> None:
    w = world(abandon_grace=60)
    w.start_job()
    w.end_job(at=10)
    w.lease(expiry=1000)
    assert not w.at(500)
    assert w.deleted == []


def test_the_watchdog_stands_down_once_the_outputs_were_retrieved(world) -> None:
    w = world(abandon_grace=60)
    w.start_job()
    w.end_job(at=10)
    (w.run_dir / "retrieved").write_text("1\n")
    assert w.at(5000)
    assert w.deleted == []
    assert ("retrieved", "") in w.events()


def test_the_pod_is_deleted_when_the_job_never_started_within_boot_grace(world) -> None:
    w = world(boot_grace=600)
    assert not w.at(599)
    assert w.at(601)
    assert w.deleted == ["pod1"]
    assert ("pod_deleted", "never_started") in w.events()


def test_a_failed_delete_is_logged_and_tried_again_at_the_next_step(world) -> None:
    w = world(boot_grace=10)
    w.delete_error = RuntimeError("HTTP 502")
    assert not w.at(11)
    assert not w.at(12)
    w.delete_error = None
    assert w.at(13)
    events = w.events()
    assert events.count(("delete_failed", "never_started")) == 2
    assert ("pod_deleted", "never_started") in events


def test_a_job_whose_wrapper_vanished_counts_as_ended_from_when_it_was_seen_gone(world) -> None:
    w = world(abandon_grace=100)
    (w.run_dir / "job.pid").write_text(json.dumps({"pid": 999999999, "start_time": 1}))
    assert not w.at(10)
    assert not w.at(109)
    assert w.at(111)
    assert w.deleted == ["pod1"]


def test_every_decision_is_one_json_line_and_is_not_repeated_at_every_step(world) -> None:
    w = world(max_hours=1)
    w.start_job()
    for t in range(0, 600, 60):
        w.at(HOUR - 600 + t)
    assert w.events().count(("snapshot_requested", "deadline")) == 1
    assert all({"time", "event", "reason"} <= set(e) for e in w.log())


def test_the_watchdog_deletes_the_pod_through_the_graphql_api_the_sdk_uses(fake: FakeRunpod) -> None:
    raw = fake.add_foreign_pod("obd-x")
    watchdog.delete_pod_http(fake.url, "test-key", raw)
    assert fake.live_pods() == []
    watchdog.delete_pod_http(fake.url, "test-key", raw)  # already gone: fine
    with pytest.raises(RuntimeError, match="HTTP 401"):
        watchdog.delete_pod_http(fake.url, "wrong", raw)
    fake.inject("502")
    with pytest.raises(RuntimeError, match="HTTP 502"):
        watchdog.delete_pod_http(fake.url, "test-key", raw)


def own_pod_watchdog(fake: FakeRunpod, pod_id: str, run_dir: Path, **cfg: Any) -> Watchdog:
    """A watchdog with no credential of its own, whose pod's environment is the fake's file for `pod_id`."""
    run_dir.mkdir(exist_ok=True)
    config = {"run_dir": str(run_dir), "pod_id": pod_id, "boot_grace": 0, "api_base_url": fake.url}
    config["container_environ"] = str(fake.container_environ(pod_id))
    return Watchdog({**config, **cfg}, environ={})


def events_of(run_dir: Path) -> list[tuple[str, str]]:
    lines = (run_dir / "watchdog.log").read_text().splitlines()
    return [(e["event"], e["reason"]) for e in map(json.loads, lines)]


def test_the_watchdog_ends_its_pod_with_the_pods_own_key_from_the_container_environment(
    fake: FakeRunpod, tmp_path: Path
) -> None:
    fake.container_env_dir = tmp_path / "containers"
    mine, other = fake.add_foreign_pod("obd-mine"), fake.add_foreign_pod("obd-other")
    dog = own_pod_watchdog(fake, mine, tmp_path / "run")
    assert dog.pod_key() == fake.pod_key(mine) != "test-key"
    assert dog.step()  # no job within boot_grace: the pod is ended
    assert [p["id"] for p in fake.live_pods()] == [other]
    assert ("pod_deleted", "never_started") in events_of(tmp_path / "run")


def test_a_pods_own_key_acts_on_its_own_pod_only(fake: FakeRunpod) -> None:
    from executors.runpod.api import AuthError
    from tests.executors.runpod.conftest import fast_api

    mine, other = fake.add_foreign_pod("obd-mine"), fake.add_foreign_pod("obd-other")
    key = fake.pod_key(mine)
    with pytest.raises(watchdog.Refused, match="Unauthorized"):
        watchdog.delete_pod_http(fake.url, key, other)
    api = fast_api(api_key=key)
    with pytest.raises(AuthError):
        anyio.run(api.list_pods)  # the account's pods: not this key's to see
    with pytest.raises(AuthError):
        anyio.run(api.get_pod, other)
    with pytest.raises(AuthError):
        anyio.run(partial(api.create_pod, name="obd-more", image_name="x", gpu_type_id="NVIDIA A40", cloud_type="ALL"))
    assert fake.creates == [] and {p["id"] for p in fake.live_pods()} == {mine, other}
    assert anyio.run(api.get_pod, mine).id == mine
    watchdog.pod_mutation(fake.url, key, "podStop", mine)
    watchdog.delete_pod_http(fake.url, key, mine)
    assert [p["id"] for p in fake.live_pods()] == [other]
    with pytest.raises(watchdog.Refused, match="HTTP 401"):  # the pod is gone, and its key with it
        watchdog.delete_pod_http(fake.url, key, other)


def test_where_the_pods_key_may_not_terminate_it_the_watchdog_stops_it(fake: FakeRunpod, tmp_path: Path) -> None:
    fake.container_env_dir = tmp_path / "containers"
    fake.pod_keys_may_terminate = False
    mine = fake.add_foreign_pod("obd-mine")
    assert own_pod_watchdog(fake, mine, tmp_path / "run").step()
    assert [(p["id"], p["desiredStatus"]) for p in fake.live_pods()] == [(mine, "EXITED")]  # the GPU is let go
    assert ("pod_stopped", "never_started") in events_of(tmp_path / "run")


def test_without_the_pods_own_key_the_watchdog_says_so_once_and_leaves_the_pod_to_the_daemon(
    fake: FakeRunpod, tmp_path: Path
) -> None:
    mine = fake.add_foreign_pod("obd-mine")  # no container environment written anywhere
    dog = own_pod_watchdog(fake, mine, tmp_path / "run", container_environ=str(tmp_path / "nowhere"))
    assert not dog.step() and not dog.step()
    assert [p["id"] for p in fake.live_pods()] == [mine]
    assert events_of(tmp_path / "run").count(("cannot_delete_pod", "never_started")) == 1
    assert "test-key" not in (tmp_path / "run" / "watchdog.log").read_text()


def test_the_container_environment_is_read_without_following_a_link(tmp_path: Path) -> None:
    (tmp_path / "real").write_bytes(b"RUNPOD_API_KEY=k\0RUNPOD_POD_ID=p\0junk\0")
    assert watchdog.read_environ(str(tmp_path / "real")) == {"RUNPOD_API_KEY": "k", "RUNPOD_POD_ID": "p"}
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert watchdog.read_environ(str(tmp_path / "link")) == {}
    assert watchdog.read_environ(str(tmp_path / "missing")) == {}


def test_a_second_watchdog_on_the_same_run_exits_at_once(tmp_path: Path) -> None:
    config = tmp_path / "watchdog.json"
    config.write_text(json.dumps({"run_dir": str(tmp_path), "pod_id": "p", "interval": 0.05, "boot_grace": 3600}))
    script = Path(watchdog.__file__)
    first = subprocess.Popen(
        [sys.executable, str(script), "run", "--config", str(config)], env={**os.environ, "RUNPOD_API_KEY": "k"}
    )
    try:
        deadline = time.monotonic() + 10
        while not (tmp_path / "watchdog.log").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        second = subprocess.run([sys.executable, str(script), "run", "--config", str(config)], timeout=10, check=False)
        assert second.returncode == 0
        events = [json.loads(line)["event"] for line in (tmp_path / "watchdog.log").read_text().splitlines()]
        assert events[:2] == ["start", "already_running"]
    finally:
        first.kill()
        first.wait()


def test_the_manifest_lists_regular_files_with_size_and_sha256_and_skips_links(tmp_path: Path) -> None:
    (tmp_path / "output" / "checkpoint-5").mkdir(parents=True)
    (tmp_path / "output" / "checkpoint-5" / "adapter.bin").write_bytes(b"weights")
    (tmp_path / "job.log").write_text("hello\n")
    (tmp_path / "output" / "escape").symlink_to("/etc/passwd")
    result = manifest(str(tmp_path), ["output", "job.log", "metrics.jsonl", "../etc"])
    paths = {f["path"]: f for f in result["files"]}
    assert set(paths) == {"output/checkpoint-5/adapter.bin", "job.log"}
    assert paths["job.log"]["size"] == 6
    import hashlib

    assert paths["output/checkpoint-5/adapter.bin"]["sha256"] == hashlib.sha256(b"weights").hexdigest()
    assert "output/escape" in result["skipped"] and "../etc" in result["skipped"]
    assert result["missing"] == ["metrics.jsonl"]


def test_the_watchdog_uses_only_the_standard_library() -> None:
    import ast

    tree = ast.parse(Path(watchdog.__file__).read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {
        n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0
    }
    assert modules <= set(sys.stdlib_module_names) | {"jobctl", "__future__"}
