"""A job on a pod can reach no credential of the account (issue 22, item 5).

Before, obd gave the pod watchdog the daemon's own Runpod API key, on its stdin: it sat in the
watchdog's environment, where a job on the pod (root in the same container) read it from
/proc/<pid>/environ and could then spend past the target's caps or control every pod of the
account. Now the account's key never goes to a pod: the watchdog gets no credential, ends its own
pod with the key Runpod scopes to that pod, and the caps hold from the daemon's side, through the
API, whatever the job does to the watchdog, its lease or the listing of its outputs.

The pod here is this machine reached through a throwaway sshd (tests/sshd.py) and the loopback
fake of Runpod's API: the pod's processes are those under the sshd's reaper (which stands for the
container's init), its disk the target's workdir. The account's key is `KEY`, the fake's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import DaemonProc, wait_for
from tests.daemon import pods
from tests.daemon.pods import KEY, make_pods_daemon
from tests.executors.runpod.conftest import kill_jobs
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures
PY = sys.executable
FAKE_JOB = str(Path(__file__).parent.parent / "daemon" / "fake_plugin_job.py")
RATE = 0.69  # $/h: what the fake bills an RTX 4090 in the secure cloud
CAP_USD = 0.002  # at RATE, the cost cap comes ~10.4 s after the pod was created
CAP_S = CAP_USD / RATE * 3600

# A hostile job: every process of its pod (the descendants of the pod's init, argv[1]) has its
# environment and command line read, every file under the pod's workdir is read, and all of it
# is written to argv[2], off the pod.
SCAN = r"""
import json, os, stat, sys

init, report = int(sys.argv[1]), sys.argv[2]
workdir = os.path.dirname(os.environ["OBD_RUN_DIR"])


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read(1 << 22).decode("utf-8", "replace")
    except OSError:
        return None


children = {}
for entry in os.listdir("/proc"):
    stat_line = read(f"/proc/{entry}/stat") if entry.isdigit() else None
    if stat_line:
        children.setdefault(int(stat_line[stat_line.rfind(")") + 2 :].split()[1]), []).append(int(entry))
found = {"processes": {}, "files": {}}
todo = [init]
while todo:
    for pid in children.get(todo.pop(), []):
        found["processes"][pid] = {name: read(f"/proc/{pid}/{name}") for name in ("environ", "cmdline")}
        todo.append(pid)
for where, _, names in os.walk(workdir):
    for name in names:
        path = os.path.join(where, name)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                found["files"][path] = read(path)
        except OSError:
            pass
with open(report + ".tmp", "w") as f:
    json.dump(found, f)
os.replace(report + ".tmp", report)
print("read", len(found["processes"]), "processes and", len(found["files"]), "files", flush=True)
"""

# A hostile job against the caps: it kills its pod's watchdog, keeps a lease that would hold any
# watchdog off for good, spoils (with "spoil") the code on the pod that lists its outputs, so
# that they can never be retrieved, and runs until it is killed.
HOSTILE = r"""
import os, signal, sys, time

rd = os.environ["OBD_RUN_DIR"]


def write(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        continue
    if b"watchdog.py" in command and rd.encode() in command and os.getpgid(int(entry)) != os.getpgrp():
        os.killpg(os.getpgid(int(entry)), signal.SIGKILL)
write(f"{rd}/watchdog-killed", "yes\n")
if "spoil" in sys.argv:
    write(f"{rd}/plugin/trainer_plugin/rundir.py", "raise SystemExit(3)\n")
os.makedirs(f"{rd}/output", exist_ok=True)
write(f"{rd}/output/adapter.bin", "weights\n")
print("watchdog killed; faking the lease", flush=True)
while True:
    write(f"{rd}/lease", f"{time.time() + 10**6:.3f}\n")
    time.sleep(0.2)
"""


@pytest.fixture
def job_dir(short_tmp: Path) -> Path:
    """The directory a run is started from (what obd uploads to the pod as its sources)."""
    path = short_tmp / "job"
    path.mkdir()
    return path


def start(d: DaemonProc, cwd: Path, *command: str, options: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", "--target", "pods", "--cwd", str(cwd), *options, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def watchdog_events(record: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(record["remote_dir"]) / "watchdog.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def watchdog_alive(remote_dir: str) -> bool:
    """Whether the run's watchdog process still runs."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"watchdog.py" in command and remote_dir.encode() in command:
            return True
    return False


def cap_at(record: dict[str, Any]) -> float:
    """Unix time of the pod's cost cap, as the daemon counts it (from just before the create call)."""
    return float(record["target_info"]["started_at"]) + CAP_S


@pytest.fixture
def pods_daemon(make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path) -> Iterator[DaemonProc]:
    yield make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp)
    kill_jobs(short_tmp / "pod")


def test_a_hostile_job_finds_no_account_key_in_any_process_or_file_of_its_pod(
    pods_daemon: DaemonProc, pod_sshd: SshServer, job_dir: Path, short_tmp: Path
) -> None:
    # The pod's sshd inherits the test runner's environment, which must not hold the key itself.
    assert KEY not in json.dumps(dict(os.environ))
    (job_dir / "job.py").write_text(SCAN)
    report = short_tmp / "found.json"
    rid = start(pods_daemon, job_dir, PY, "job.py", str(pod_sshd.reapers[-1].pid), str(report))
    record = pods_daemon.wait_state(rid, "succeeded", "failed", timeout=90)
    assert record["state"] == "succeeded", record["message"]
    text = report.read_text()
    found = json.loads(text)
    # It read what it went for: the running watchdog's environment and command line, its files.
    watchdogs = [p for p in found["processes"].values() if "watchdog.py" in (p["cmdline"] or "")]
    assert watchdogs and all(p["environ"] for p in watchdogs), "the scan never read the watchdog's environment"
    names = {Path(path).name for path in found["files"]}
    assert {"watchdog.json", "watchdog.log", "lease", "watchdog.py", "jobctl.py", "job.json"} <= names
    assert KEY not in text, "the account's API key is readable on the pod"


def test_the_watchdog_given_no_key_still_asks_for_snapshots_ahead_of_the_caps(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path, job_dir: Path
) -> None:
    extra = f"max_cost_usd = {CAP_USD}\nsnapshot_margin = 3\ndisk_max_used_pct = 0.001\n"
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, extra)
    try:
        rid = start(d, job_dir, PY, FAKE_JOB, "ignore")  # announces snapshots, never takes one
        record = d.wait_state(rid, "cancelled", "failed", "stopped", "succeeded", timeout=90)
        events = watchdog_events(record)
        # The disk rule is the watchdog's alone: its request came at once.
        assert ("snapshot_requested", "disk") in [(e["event"], e["reason"]) for e in events]
        # And it saw to the cost cap before the cap (the daemon may have written the request first).
        cost = [e for e in events if e["reason"] == "cost" and e["event"] in ("snapshot_requested", "request_exists")]
        assert cost and cost[0]["time"] < cap_at(record), events
        assert record["state"] == "cancelled" and "cost cap" in record["message"], record["message"]
        assert fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_job_that_kills_its_watchdog_and_spoils_its_outputs_is_stopped_at_the_cap_and_its_pod_ended(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path, job_dir: Path
) -> None:
    # Long enough for the daemon's cancel over SSH to land first on a loaded machine (at 0.5 s the
    # abandonment sometimes came first under CI's load: the run failed instead of cancelled).
    grace = 5
    extra = f"max_cost_usd = {CAP_USD}\nsnapshot_margin = 1\nabandon_grace = {grace}\n"
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, extra)
    try:
        (job_dir / "job.py").write_text(HOSTILE)
        rid = start(d, job_dir, PY, "job.py", "spoil")
        record = d.wait_state(rid, "running", timeout=60)
        pod_id = record["target_info"]["pod_id"]
        wait_for(lambda: (Path(record["remote_dir"]) / "watchdog-killed").exists(), 30, what="the watchdog's end")
        assert not watchdog_alive(record["remote_dir"])
        record = d.wait_state(rid, "cancelled", "failed", "stopped", "succeeded", timeout=60)
        # The daemon cancelled the job at the cap, whatever the lease on the pod said.
        assert record["state"] == "cancelled" and "cost cap" in record["message"], record["message"]
        # Its outputs could not come home, and the pod was ended all the same, abandon_grace after the cap.
        wait_for(lambda: pod_id in fake.terminated, 30, what="the pod to be terminated")

        def said() -> list[str]:
            now = d.record(rid)
            return [now["message"], *(h["reason"] for h in now["history"])]

        def told(lines: list[str]) -> bool:
            return any("could not be retrieved" in s and "terminated through the API" in s for s in lines)

        # The run's record says so once the daemon saw the termination's answer (a moment after the
        # fake API recorded it).
        wait_for(lambda: told(said()), 30, what="the run's record to say the pod was terminated")
        assert fake.terminated[pod_id]["terminated_at"] < cap_at(record) + grace + 20
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_pod_whose_job_killed_its_watchdog_while_the_daemon_was_away_is_ended_when_it_comes_back(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path, job_dir: Path
) -> None:
    extra = f"max_cost_usd = {CAP_USD}\nsnapshot_margin = 1\nabandon_grace = 1\n"
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, extra)
    try:
        (job_dir / "job.py").write_text(HOSTILE)
        rid = start(d, job_dir, PY, "job.py", "spoil")
        record = d.wait_state(rid, "running", timeout=60)
        pod_id = record["target_info"]["pod_id"]
        wait_for(lambda: (Path(record["remote_dir"]) / "watchdog-killed").exists(), 30, what="the watchdog's end")
        d.kill()  # nothing on the pod holds the cap now
        time.sleep(max(0.0, cap_at(record) + 1 + 0.5 - time.time()))
        assert [p["id"] for p in fake.live_pods()] == [pod_id]  # still billing, past its cap
        d.start()
        wait_for(lambda: pod_id in fake.terminated, 30, what="the daemon to end the pod past its cap")
        record = d.wait_state(rid, "failed", timeout=30)
        assert "its job still ran" in record["message"] and "terminated through the API" in record["message"]
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_target_whose_secrets_hold_the_account_key_is_refused_before_any_pod_is_made(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path, job_dir: Path
) -> None:
    d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, 'secrets = ["RUNPOD_API_KEY"]\n')
    try:
        rid = start(d, job_dir, "true")
        record = d.wait_state(rid, "failed", "succeeded", timeout=60)
        assert record["state"] == "failed", record["message"]
        assert "RUNPOD_API_KEY" in record["message"] and "Remove it from the target's `secrets`" in record["message"]
        assert fake.creates == [] and fake.live_pods() == []
    finally:
        kill_jobs(short_tmp / "pod")


def test_a_run_given_the_account_key_as_a_secret_never_starts_and_its_pod_is_ended(
    pods_daemon: DaemonProc, fake: FakeRunpod, job_dir: Path
) -> None:
    (job_dir / "job.py").write_text("import os\nprint(os.environ.get('RUNPOD_API_KEY'))\n")
    # The client sends the value of RUNPOD_API_KEY from its environment, which holds the account's key.
    rid = start(pods_daemon, job_dir, PY, "job.py", options=("--secret", "RUNPOD_API_KEY"))
    record = pods_daemon.wait_state(rid, "failed", "succeeded", timeout=60)
    assert record["state"] == "failed" and record["job"] is None, record["message"]
    assert "refusing to send the Runpod account's API key" in record["message"], record["message"]
    wait_for(lambda: fake.live_pods() == [], 30, what="the pod to be ended")
    assert not (Path(record["remote_dir"]) / "job.log").exists()
