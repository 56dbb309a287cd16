"""A run on a pod, end to end against the fake API and a real sshd: job, watchdog, retrieval, reconcile."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import anyio
import pytest

from executors.base import JobSpec, JobState
from executors.runpod import PodInfo, RunpodDriver, sha256_local
from executors.runpod.retrieve import Retrieval
from tests.executors.runpod.conftest import Saves
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import free_port

JOB = r"""
import json, os, sys
d = os.environ["RUN_DIR"]
ck = os.path.join(d, "output", "checkpoint-3")
os.makedirs(ck, exist_ok=True)
with open(os.path.join(ck, "adapter_model.safetensors"), "wb") as f:
    f.write(os.urandom(300_000))
with open(os.path.join(d, "output", "adapter_config.json"), "w") as f:
    json.dump({"r": 8}, f)
with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"event": "begin", "snapshots": True}) + "\n")
with open(os.path.join(d, "snapshot.json"), "w") as f:
    json.dump({"checkpoint": "output/checkpoint-3", "step": 3, "time": 1, "reason": "requested"}, f)
os.symlink("/etc/passwd", os.path.join(d, "output", "not-mine"))
print("trained", flush=True)
"""


async def run_job(driver: RunpodDriver, info: PodInfo, run_id: str, command: list[str] | None = None) -> str:
    """Start a job on the pod through the driver's executor and wait for it to end; its remote dir."""
    remote_dir = f"{driver.target.workdir}/{run_id}"
    ex = driver.executor(info)
    try:
        job = JobSpec(
            run_id=run_id,
            remote_dir=remote_dir,
            command=command or [sys.executable, "-c", JOB],
            env={"RUN_DIR": remote_dir},
        )
        handle = await ex.spawn(job)
        if command is None:
            with anyio.fail_after(20):
                while (await ex.status(handle, remote_dir)).state == JobState.running:
                    await anyio.sleep(0.05)
    finally:
        await ex.aclose()
    return remote_dir


def write_outputs(driver: RunpodDriver, run_id: str) -> str:
    """Outputs put straight into the pod's run directory (the pod's disk is this machine's)."""
    remote_dir = Path(driver.target.workdir) / run_id
    (remote_dir / "output" / "checkpoint-1").mkdir(parents=True)
    (remote_dir / "output" / "checkpoint-1" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 400)
    (remote_dir / "job.log").write_text("done\n")
    (remote_dir / "exit_code").write_text("0\n")
    return str(remote_dir)


def cmdlines() -> list[str]:
    """Every process's command line on this machine (the pod's and obd's alike)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            out.append(entry.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


def tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


async def test_finish_retrieves_and_verifies_every_output_then_terminates_the_pod(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    remote_dir = await run_job(driver, info, "r1")
    local = tmp_path / "outputs"
    ok, message = await driver.finish("r1", remote_dir, info, local)
    assert ok, message
    assert "sha256 verified" in message and f"pod {info.pod_id} terminated" in message
    assert fake.live_pods() == []
    remote = tree(Path(remote_dir))
    got = tree(local)
    for name in ("output/checkpoint-3/adapter_model.safetensors", "output/adapter_config.json", "job.log",
                 "metrics.jsonl", "snapshot.json", "exit_code"):  # fmt: skip
        assert got[name] == remote[name]
    assert not (local / "output" / "not-mine").exists()  # a link on the pod is never followed
    assert "plugin/trainer_plugin/tools/watchdog.py" not in got  # obd's own files are not outputs
    assert json.loads((local / "retrieved.json").read_text())["files"]


async def test_keep_pod_leaves_the_pod_up_and_tells_its_watchdog_the_outputs_are_safe(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    driver = make_driver(keep_pod=True)
    info = await driver.create("r1", saves)
    remote_dir = write_outputs(driver, "r1")
    ok, message = await driver.finish("r1", remote_dir, info, tmp_path / "out")
    assert ok and "kept (keep_pod)" in message and f"obd pods rm {info.pod_id}" in message
    assert [p["id"] for p in fake.live_pods()] == [info.pod_id]
    assert (Path(remote_dir) / "retrieved").exists()


async def test_a_failed_retrieval_leaves_the_pod_up_and_says_how_to_retry(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    remote_dir = write_outputs(driver, "r1")
    unreachable = info.model_copy(update={"ssh_port": free_port()})
    ok, message = await driver.finish("r1", remote_dir, unreachable, tmp_path / "out")
    assert not ok
    assert "left up" in message and "obd pods retrieve r1" in message and f"obd pods rm {info.pod_id}" in message
    assert [p["id"] for p in fake.live_pods()] == [info.pod_id]


async def test_a_download_that_does_not_match_the_pod_s_sha256_fails_and_keeps_the_pod(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path, monkeypatch
) -> None:
    from executors.ssh import SshExecutor

    real = SshExecutor.download

    async def corrupting(self, remote_path: str, local: Path) -> None:
        await real(self, remote_path, local)
        if remote_path.endswith(".safetensors"):
            with open(local, "r+b") as f:
                f.write(b"\0\0\0\0")

    monkeypatch.setattr(SshExecutor, "download", corrupting)
    driver = make_driver()
    info = await driver.create("r1", saves)
    remote_dir = write_outputs(driver, "r1")
    ok, message = await driver.finish("r1", remote_dir, info, tmp_path / "out")
    assert not ok and "does not match the pod's copy" in message
    assert len(fake.live_pods()) == 1


async def test_outputs_listed_through_a_link_are_left_out_and_nothing_outside_the_run_is_copied(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path, monkeypatch
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    remote_dir = Path(write_outputs(driver, "r1"))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "private.key").write_text("not yours")
    (remote_dir / "output" / "linked").symlink_to(outside)
    (remote_dir / "output" / "key").symlink_to(outside / "private.key")
    size, digest = sha256_local(outside / "private.key")
    listed = Retrieval.remote_manifest

    async def careless_listing(self, ex, rd):  # a manifest naming what it should have skipped
        manifest = await listed(self, ex, rd)
        for path in ("output/linked/private.key", "output/key"):
            manifest["files"].append({"path": path, "size": size, "sha256": digest})
        return manifest

    monkeypatch.setattr(Retrieval, "remote_manifest", careless_listing)
    local = tmp_path / "out"
    ok, message = await driver.finish("r1", str(remote_dir), info, local)
    assert ok, message
    assert "left out 2" in message and "output/key" in message
    assert not any(p.name in ("private.key", "key") for p in local.rglob("*"))
    assert (local / "output" / "checkpoint-1" / "adapter_model.safetensors").exists()
    assert json.loads((local / "retrieved.json").read_text())["refused"] == ["output/linked/private.key", "output/key"]
    assert fake.live_pods() == []


async def test_a_pod_terminated_from_outside_mid_run_is_reported_gone_everywhere(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    remote_dir = await run_job(driver, info, "r1", command=[sys.executable, "-c", "import time; time.sleep(30)"])
    fake.terminate_from_outside(info.pod_id)
    assert (await driver.describe(info))["state"] == "gone"
    [finding] = await driver.reconcile({"r1": info})
    assert finding.kind == "gone" and "no longer exists" in (finding.reason or "")
    ok, message = await driver.finish("r1", remote_dir, info, tmp_path / "out")
    assert not ok and "no longer exists" in message and "lost" in message


async def test_describe_shows_the_pod_state_rate_and_spend_so_far(make_driver, fake: FakeRunpod, saves: Saves) -> None:
    driver = make_driver(max_cost_usd=5.0)
    info = await driver.create("r1", saves)
    info = info.model_copy(update={"started_at": time.time() - 1800})  # half an hour ago
    shown = await driver.describe(info)
    assert shown["state"] == "RUNNING" and shown["cost_per_hr"] == pytest.approx(0.69)
    assert shown["spend_usd"] == pytest.approx(0.345, abs=0.01)
    assert shown["max_cost_usd"] == 5.0 and shown["ssh"].endswith(f":{info.ssh_port}")


async def test_describe_answers_quickly_with_an_unknown_state_when_the_api_hangs(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    driver.describe_timeout = 0.3
    fake.inject("timeout", op="pod", times=5, delay=2.0)
    start = time.monotonic()
    shown = await driver.describe(info)
    assert shown["state"] == "unknown" and shown["spend_usd"] is not None
    assert time.monotonic() - start < 1.5


async def test_the_daemon_side_caps_say_deadline_or_cost_ahead_of_the_cap(make_driver, fake: FakeRunpod) -> None:
    driver = make_driver(max_hours=2.0, max_cost_usd=1.0)
    info = PodInfo(started_at=1000.0, cost_per_hr=1.0, max_hours=2.0, max_cost_usd=1.0)
    # cost reaches $1 at 1 h, before the 2 h deadline
    assert driver.check_caps(info, 1000.0 + 3600 - 901) is None
    assert driver.check_caps(info, 1000.0 + 3600 - 899) == "cost"
    assert driver.cap_reached(info, 1000.0 + 3599) is None
    assert driver.cap_reached(info, 1000.0 + 3601) == "cost"
    no_cost = info.model_copy(update={"max_cost_usd": None})
    assert driver.check_caps(no_cost, 1000.0 + 7200 - 899) == "deadline"
    assert driver.check_caps(no_cost.model_copy(update={"max_hours": None}), 10**12) is None


async def test_a_short_cap_is_not_asked_for_at_once(make_driver, fake: FakeRunpod) -> None:
    driver = make_driver()
    info = PodInfo(started_at=0.0, cost_per_hr=1.0, max_hours=0.2, max_cost_usd=None)  # a 12 min cap
    assert driver.check_caps(info, 60.0) is None
    assert driver.check_caps(info, 720.0 - 181) is None
    assert driver.check_caps(info, 720.0 - 179) == "deadline"


async def test_a_pod_whose_boot_the_daemon_did_not_see_through_is_resumed(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    booting = info.model_copy(update={"host_key": None, "ssh_host": None, "ssh_port": None, "phase": "booting"})
    resumed = await make_driver().resume(booting, saves)
    assert resumed.host_key == info.host_key and resumed.phase == "ready"
    assert saves.last == resumed


async def test_resuming_a_pod_past_its_boot_grace_terminates_it(make_driver, fake: FakeRunpod, saves: Saves) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    fake.ssh_endpoint = None
    for pod in fake.pods.values():
        pod["ssh"] = None
    stale = info.model_copy(update={"phase": "booting", "host_key": None, "started_at": time.time() - 3600})
    with pytest.raises(Exception, match="boot_grace"):
        await driver.resume(stale, saves)
    assert fake.live_pods() == [] and saves.last.phase == "terminated"


async def test_a_stopped_pod_found_on_resume_is_started_again_not_terminated(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver()
    info = await driver.create("r1", saves)
    fake.stop_from_outside(info.pod_id)
    booting = info.model_copy(
        update={"phase": "booting", "host_key": None, "started_at": time.time() - 3600}
    )  # long past boot_grace
    resumed = await driver.resume(booting, saves)
    assert resumed.phase == "ready" and resumed.host_key and saves.last == resumed
    assert [p["desiredStatus"] for p in fake.live_pods()] == ["RUNNING"] and "podResume" in fake.ops()


async def test_a_stopped_pod_that_never_gets_ready_again_is_stopped_again_keeping_its_volume(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver(boot_grace=1.0)
    info = await driver.create("r1", saves)
    fake.stop_from_outside(info.pod_id)
    fake.ssh_endpoint = None  # the new container never opens its SSH port
    with pytest.raises(Exception, match="boot_grace"):
        await driver.restart_stopped(info, saves)
    assert [p["desiredStatus"] for p in fake.live_pods()] == ["EXITED"]  # stopped, not terminated
    assert saves.last.phase == "stopped" and "boot_grace" in saves.last.error
    assert fake.ops()[-1] == "podStop"


async def test_reconcile_matches_runs_adopts_unsaved_ids_and_reports_orphans(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver()
    a = await driver.create("a", saves)
    b = await driver.create("b", saves)
    c = await driver.create("c", saves)
    fake.add_foreign_pod("obd-someone-else", {"OBD_RUN_ID": "x", "OBD_OWNER": "another-install"})
    fake.add_foreign_pod("my-notebook")
    known = {
        "a": a,  # matched
        "b": PodInfo(pod_name="obd-b"),  # crashed after the create, before saving its id
        "z": PodInfo(pod_name="obd-z"),  # crashed before the create call
    }
    found = {f.run_id: f for f in await driver.reconcile(known)}
    assert found["a"].kind == "matched"
    assert found["b"].kind == "adopted" and found["b"].pod_id == b.pod_id
    assert found["b"].target_info.ssh_port == b.ssh_port
    assert found["z"].kind == "not_created"
    assert found["c"].kind == "orphan" and found["c"].pod_id == c.pod_id
    assert found["c"].remote_dir.endswith("/c") and found["c"].target_info.host_key == c.host_key
    assert "x" not in found and len(found) == 4  # pods of others are never touched


async def test_an_orphan_found_by_reconcile_can_be_retrieved_and_terminated(
    make_driver, fake: FakeRunpod, saves: Saves, tmp_path: Path
) -> None:
    driver = make_driver()
    await driver.create("r1", saves)
    remote_dir = write_outputs(driver, "r1")
    fresh = make_driver(state_dir=tmp_path / "state")  # a restarted daemon: same state dir
    [orphan] = await fresh.reconcile({})
    assert orphan.kind == "orphan"
    ok, message = await fresh.finish("r1", orphan.remote_dir, orphan.target_info, tmp_path / "orphan")
    assert ok, message
    assert orphan.remote_dir == remote_dir and fake.live_pods() == []


async def test_the_watchdog_started_beside_the_job_deletes_a_pod_whose_job_never_started(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    from trainer_plugin.tools import jobctl

    driver = make_driver(boot_grace=1.0)
    info = await driver.create("r1", saves)
    remote_dir = f"{driver.target.workdir}/r1"
    ex = driver.executor(info)
    try:
        await driver.start_watchdog(ex, remote_dir, info)
    finally:
        await ex.aclose()
    assert not any("test-key" in line for line in cmdlines()), "the API key is on a command line"
    # The watchdog is given no key at all: it ends its pod with the pod's own (in the fake's
    # stand-in for the container's environment).
    pid = int(jobctl.read_handle(f"{remote_dir}/watchdog")["pid"])
    assert b"test-key" not in Path(f"/proc/{pid}/environ").read_bytes()
    with anyio.fail_after(15):
        while fake.live_pods():
            await anyio.sleep(0.1)
    events = [json.loads(line) for line in Path(remote_dir, "watchdog.log").read_text().splitlines()]
    assert [e["event"] for e in events][:1] == ["start"]
    assert ("pod_deleted", "never_started") in [(e["event"], e["reason"]) for e in events]
    config = json.loads(Path(remote_dir, "watchdog.json").read_text())
    assert "test-key" not in json.dumps(config) and "test-key" not in Path(remote_dir, "watchdog.log").read_text()


async def test_the_watchdog_stays_off_while_the_daemon_renews_its_lease(
    make_driver, fake: FakeRunpod, saves: Saves
) -> None:
    driver = make_driver(boot_grace=1.0)
    info = await driver.create("r1", saves)
    remote_dir = f"{driver.target.workdir}/r1"
    ex = driver.executor(info)
    try:
        await driver.renew_lease(ex, remote_dir, ttl=30.0)
        lease = float(Path(remote_dir, "lease").read_text())
        assert time.time() < lease <= time.time() + 30.0
        await driver.start_watchdog(ex, remote_dir, info)
        await anyio.sleep(1.5)
        assert len(fake.live_pods()) == 1  # past boot grace, but the daemon is in charge
        await driver.renew_lease(ex, remote_dir, ttl=-1.0)  # the daemon is gone: its lease lapsed
        with anyio.fail_after(15):
            while fake.live_pods():  # the lease lapses: the watchdog acts
                await anyio.sleep(0.1)
    finally:
        await ex.aclose()
