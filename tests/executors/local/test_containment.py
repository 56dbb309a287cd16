"""A local run is every process it started (issue 33 item 3): a daemonized (`setsid`, double-forked)
process of its job and a command of an `obd train exec` session end with the run, whether it is
cancelled or its job ends by itself, and the run's GPU is handed to the next run only once they
are gone. Both ways obd contains a run are tried: its cgroup v2 (where the daemon can make one:
root here), and the identity fallback (`OBD_RUN_ID` among its user's processes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.service.records import Records
from executors.containment import find_base
from tests.conftest import FAST_CONFIG, DaemonProc, wait_for
from trainer_plugin.tools import contain

CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
# The job: a grandchild in a session of its own (setsid, then a double fork), its pid in a file;
# then it waits for `go` (or forever).
DAEMONIZE = (
    "cd \"$OBD_RUN_DIR\"; setsid sh -c 'sleep 300 & echo $! > daemonized.pid' < /dev/null > /dev/null 2>&1; "
    "while [ ! -e go ]; do sleep 0.1; done"
)
# An exec'd command that ignores TERM (it lingers until KILL), its pid in a file.
LINGER = "trap '' TERM; echo $$ > exec.pid; while :; do sleep 0.2; done"  # run in the run directory


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(params=["cgroup", "identity"])
def daemon(request: pytest.FixtureRequest, make_daemon) -> Iterator[DaemonProc]:
    d = make_daemon(CONFIG)
    if request.param == "identity":
        d.env["OBD_NO_CGROUP"] = "1"
    elif os.geteuid() != 0 or find_base() is None:
        pytest.skip("no cgroup v2 this process may write here")
    d.start()
    d.mode = request.param  # type: ignore[attr-defined]
    yield d


def running_with_leftovers(d: DaemonProc) -> tuple[dict, int, int, subprocess.Popen[str]]:
    """A run whose job daemonized a `sleep`, and an `obd train exec` session holding a command
    that ignores TERM: the record, both pids and the session's client."""
    out = d.cli("train", "start", "--gpus", "1", "--", "sh", "-c", DAEMONIZE)
    assert out.returncode == 0, out.stderr
    record = d.wait_state(out.stdout.strip(), "running")
    assert record["gpus"] == ["0"], record
    run_dir = Path(record["remote_dir"])
    client = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "train", "exec", record["id"], "--", "sh", "-c", LINGER],
        env=d.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def pid_in(name: str) -> int:
        path = run_dir / name
        return int(wait_for(lambda: path.is_file() and path.read_text().strip(), 30, 0.05, f"{name} written"))

    daemonized, execd = pid_in("daemonized.pid"), pid_in("exec.pid")
    assert alive(daemonized) and alive(execd)
    if getattr(d, "mode", "") == "cgroup":  # each is in the run's cgroup
        for pid in (daemonized, execd):
            assert Path(f"/proc/{pid}/cgroup").read_text().strip().endswith(f"/obd-runs/{record['id']}")
    return record, daemonized, execd, client


def test_a_cancel_ends_a_daemonized_process_of_the_job_and_an_exec_sessions_command(daemon: DaemonProc) -> None:
    record, daemonized, execd, client = running_with_leftovers(daemon)
    out = daemon.cli("train", "cancel", record["id"])
    assert out.returncode == 0, out.stderr
    daemon.wait_state(record["id"], "cancelled")
    assert not alive(daemonized) and not alive(execd)  # gone by the time the run is over
    client.communicate(timeout=60)  # the session ended with its run
    assert client.returncode != 0


def test_a_run_that_ends_by_itself_leaves_no_process_of_its_job_or_its_exec_sessions(daemon: DaemonProc) -> None:
    record, daemonized, execd, client = running_with_leftovers(daemon)
    (Path(record["remote_dir"]) / "go").touch()
    assert daemon.wait_state(record["id"], "succeeded", "failed")["state"] == "succeeded"
    assert not alive(daemonized) and not alive(execd)
    client.communicate(timeout=60)
    if daemon.mode == "cgroup":  # type: ignore[attr-defined]
        assert not os.path.exists(os.path.join(find_base() or "", record["id"]))  # removed once empty


def test_the_next_run_on_the_gpu_starts_only_once_the_last_process_of_the_previous_holder_is_gone(
    daemon: DaemonProc,
) -> None:
    record, daemonized, execd, client = running_with_leftovers(daemon)
    # The next run asks for the same GPU: it waits, then says whether the leftovers were alive.
    check = " ".join(
        f'if [ -e /proc/{pid} ] && [ "$(cut -d" " -f3 /proc/{pid}/stat)" != Z ]; then echo alive; else echo gone; fi;'
        for pid in (daemonized, execd)
    )
    out = daemon.cli("train", "start", "--gpus", "1", "--", "sh", "-c", check)
    assert out.returncode == 0, out.stderr
    nxt = out.stdout.strip()
    assert daemon.record(nxt)["state"] == "queued"
    assert daemon.cli("train", "cancel", record["id"]).returncode == 0
    done = daemon.wait_state(nxt, "succeeded", "failed", timeout=90)
    assert done["state"] == "succeeded", done["message"]
    assert (Path(done["remote_dir"]) / "job.log").read_text().split() == ["gone", "gone"]
    client.communicate(timeout=60)


@pytest.mark.parametrize(
    ("environ", "run"),
    [
        (b"PATH=/bin\0OBD_RUN_ID=r1\0", "r1"),
        (b"OBD_RUN_ID=r1\0OBD_RUN_ID=r2\0", "r1"),  # the first, as getenv reads it
        (b"OBD_RUN_ID=r1\0OBD_EVENT=started\0OBD_EVENT_ID=r1:1:started\0", None),  # the daemon's hook
        (b"OBD_RUN_IDX=r1\0XOBD_RUN_ID=r1\0", None),
        (b"", None),
    ],
    ids=["its-id", "the-first-of-two", "a-notify-command", "a-name-only-alike", "none"],
)
def test_a_process_is_a_runs_by_its_obd_run_id_unless_it_is_a_notify_command(environ: bytes, run: str | None) -> None:
    assert contain.identity(environ) == run


# A notify command about a run's start: its pid noted, it waits for `release`, then says it ran.
HOOK = (
    'echo $$ >> "$1/$OBD_RUN_ID.pids"; touch "$1/$OBD_RUN_ID.hooked"; while [ ! -e "$1/release" ]; do sleep 0.1; done; '
    'echo "$OBD_EVENT_ID" >> "$1/$OBD_RUN_ID.delivered"'
)


@pytest.mark.parametrize("mode", ["cgroup", "identity"])
def test_a_notify_command_about_a_run_is_not_ended_with_the_run_and_holds_no_gpu(
    make_daemon, short_tmp: Path, mode: str
) -> None:
    """The daemon's hook carries the run's OBD_RUN_ID (its documented variables), but is the
    daemon's: the run's end leaves it running, it is delivered once, and the GPU is free."""
    hook = ["sh", "-c", HOOK, "hook", str(short_tmp)]
    d = make_daemon(CONFIG + f'\n[[notify]]\nname = "cmd"\ncommand = {json.dumps(hook)}\non = ["started"]\n')
    if mode == "identity":
        d.env["OBD_NO_CGROUP"] = "1"
    elif os.geteuid() != 0 or find_base() is None:
        pytest.skip("no cgroup v2 this process may write here")
    d.start()
    # The job ends as soon as the hook about its start is running.
    job = f'while [ ! -e "{short_tmp}/$OBD_RUN_ID.hooked" ]; do sleep 0.1; done'
    out = d.cli("train", "start", "--gpus", "1", "--", "sh", "-c", job)
    assert out.returncode == 0, out.stderr
    first = d.wait_state(out.stdout.strip(), "succeeded", "failed")
    assert first["state"] == "succeeded", first["message"]
    pids = short_tmp / f"{first['id']}.pids"
    [pid] = [int(x) for x in pids.read_text().split()]
    assert alive(pid)  # the run's end (and its sweep of what it left) did not take it
    out = d.cli("train", "start", "--gpus", "1", "--", "true")
    assert out.returncode == 0, out.stderr
    second = d.wait_state(out.stdout.strip(), "succeeded", "failed", timeout=60)
    assert second["state"] == "succeeded" and second["gpus"] == ["0"], second
    assert alive(pid)  # the GPU was handed on while the hook still ran
    (short_tmp / "release").touch()
    marks = d.state_dir / "runs" / first["id"] / "notify.json"
    wait_for(lambda: marks.is_file() and json.loads(marks.read_text())["next"].get("cmd"), 60, what="delivery marked")
    [delivered] = (short_tmp / f"{first['id']}.delivered").read_text().split()
    assert delivered.startswith(f"{first['id']}:") and delivered.endswith(":started")
    assert len(pids.read_text().split()) == 1  # delivered at the first attempt


async def test_an_ended_runs_gpu_stays_held_while_a_process_carrying_its_identity_lives() -> None:
    """The GPU queue's own check, for what the wrapper could not end in time (GONE_WAIT): a run
    that ended (here while the inventory was looking at it as a running run's) is still named as
    its devices' holder while one of its processes lives, and the queue is woken once it is gone."""
    import anyio

    from daemon.service.gpus import Inventory
    from daemon.service.models import RunRecord, RunState
    from executors.containment import Containment
    from executors.gpus import Gpu

    class Target:
        def executor(self, record: RunRecord) -> Containment:
            return Containment(None)  # identity only: the run's OBD_RUN_ID among its user's processes

    woken = anyio.Event()

    class Host:
        started = True
        targets = type("T", (), {"get": staticmethod(lambda name: Target())})()

        def __init__(self, tg: anyio.abc.TaskGroup) -> None:
            self.start_soon = tg.start_soon
            self.records = Records({"run-x": run})

    run = RunRecord(id="run-x", state=RunState.running, target="local", gpus=["0"])

    straggler = subprocess.Popen(["sleep", "300"], env={**os.environ, "OBD_RUN_ID": "run-x"})
    try:
        async with anyio.create_task_group() as tg:
            inventory = Inventory(Host(tg))  # type: ignore[arg-type]
            inventory._by_target["local"] = [Gpu(id="0", vendor="nvidia", name="test")]
            inventory.wake = woken.set
            assert inventory.held("local") == {"0": "run-x"}  # running
            run.transition(RunState.cancelled, "cancelled")
            assert inventory.held("local") == {"0": "run-x"}  # ended, but a process of it lives
            straggler.kill()
            straggler.wait()
            with anyio.fail_after(30):
                await woken.wait()
            assert inventory.held("local") == {}
    finally:
        straggler.kill()
        straggler.wait()


async def test_an_ended_runs_gpu_stays_held_while_nvidia_smi_lists_a_process_of_its_user_on_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the vendor's tool lists compute processes, a device of an ended run is free only once
    none of its user's is listed on it (a stand-in nvidia-smi here: this machine has no GPU)."""
    import anyio

    from daemon.service.gpus import Inventory
    from daemon.service.models import RunRecord, RunState
    from executors.containment import Containment
    from executors.gpus import Gpu

    apps = tmp_path / "apps.csv"
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f'#!/bin/sh\n[ "$1" = --query-compute-apps=gpu_uuid,pid ] && cat {apps}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    holder = subprocess.Popen(["sleep", "300"])  # no OBD_RUN_ID: only the tool sees it on the device
    apps.write_text(f"GPU-0000-test, {holder.pid}\n")
    woken = anyio.Event()

    class Target:
        def executor(self, record: RunRecord) -> Containment:
            return Containment(None)

    class Host:
        started = True
        targets = type("T", (), {"get": staticmethod(lambda name: Target())})()

        def __init__(self, tg: anyio.abc.TaskGroup) -> None:
            self.start_soon = tg.start_soon
            self.records = Records({"run-y": RunRecord(id="run-y", state=RunState.failed, target="local", gpus=["0"])})

    try:
        async with anyio.create_task_group() as tg:
            inventory = Inventory(Host(tg))  # type: ignore[arg-type]
            inventory._by_target["local"] = [Gpu(id="0", vendor="nvidia", name="test", uuid="GPU-0000-test")]
            inventory.wake = woken.set
            assert inventory.held("local") == {"0": "run-y"}
            holder.kill()
            holder.wait()
            apps.write_text("")
            with anyio.fail_after(30):
                await woken.wait()
            assert inventory.held("local") == {}
    finally:
        holder.kill()
        holder.wait()
