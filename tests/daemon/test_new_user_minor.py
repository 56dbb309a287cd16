"""What a new user read wrong in `obd train status` and `stop --wait` (issue 34 items 5, 8, 9, 19),
each with a real daemon and real jobs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.cli import render
from tests.conftest import FAST_CONFIG, DaemonProc, kill_job_groups, wait_for
from tests.daemon.test_ssh_target import ssh_config
from tests.sshd import SshServer, running_sshd

TWO_GPUS = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv's `bin/python`: a symbolic link to the base Python it was made from."""
    venv = tmp_path_factory.mktemp("user") / "train-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    assert python.is_symlink() and python.resolve() != python
    return python


def start(d: DaemonProc, *argv: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *argv)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def status_text(d: DaemonProc, run_id: str) -> str:
    out = d.cli("train", "status", run_id)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_status_names_the_device_a_run_holds_and_says_cpu_only_for_a_run_that_asked_for_none(make_daemon) -> None:
    d = make_daemon(TWO_GPUS)
    d.start()
    on_zero = start(d, "sleep", "300", opts=("--gpus", "device=0"))
    cpu = start(d, "sleep", "300", opts=("--gpus", "0"))
    for rid in (on_zero, cpu):
        d.wait_state(rid, "running")
    lines = status_text(d, on_zero).splitlines()
    assert "gpu       device 0" in lines  # not `gpus 0`, which reads as "no GPU"
    assert "gpus      none (CPU only)" in status_text(d, cpu).splitlines()
    for rid in (on_zero, cpu):
        d.call("cancel", id=rid)


def test_status_says_devices_for_a_run_holding_several() -> None:
    assert render.gpus_text({"state": "running", "gpus": ["0", "1"]}) == "gpus      devices 0,1"
    assert render.gpus_text({"state": "queued", "gpus": [], "gpus_wanted": 2}) is None


def test_status_shows_the_venv_python_the_user_typed_not_the_base_python_it_links_to(
    daemon: DaemonProc, venv_python: Path
) -> None:
    rid = start(daemon, str(venv_python), "-c", "import time; time.sleep(300)")
    wait_for(lambda: (daemon.record(rid).get("job") or {}).get("executable"), what="the job's program recorded")
    text = status_text(daemon, rid)
    assert f"program {venv_python};" in text, text
    assert str(venv_python.resolve()) not in text
    daemon.call("cancel", id=rid)


# --- item 5: a stop of a job that cannot snapshot -------------------------------------------------

LONG_PROOF = FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "2h"')


def test_stop_wait_of_a_job_that_never_loads_the_plugin_says_so_at_once_and_exits_7(make_daemon) -> None:
    d = make_daemon(LONG_PROOF)  # under the old rule, --wait would sit out these 2 hours
    d.start()
    rid = start(d, "sleep", "600")
    d.wait_state(rid, "running")
    out = d.cli("train", "stop", rid, "--wait", timeout=90)
    assert out.returncode == 7, out.stdout + out.stderr  # documented: no snapshot can come, the job runs on
    assert "has not loaded obd's plugin" in out.stderr and f"obd train cancel {rid}" in out.stderr, out.stderr
    record = d.record(rid)
    assert record["state"] == "running" and record["stop"]["no_plugin"]  # the request stays; nothing ended
    assert d.cli("train", "cancel", rid, "--wait").returncode == 0


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def test_stop_wait_of_a_sleep_job_on_an_ssh_target_says_so_at_once_too(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    """The look at the job's processes is jobctl's, on the target: the same over SSH."""
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir, proof_timeout="2h"))
    d.start()
    try:
        rid = start(d, "sleep", "600", opts=("--target", "box"))
        d.wait_state(rid, "running")
        out = d.cli("train", "stop", rid, "--wait", timeout=90)
        assert out.returncode == 7, out.stdout + out.stderr
        assert f"obd train cancel {rid}" in out.stderr
        assert d.cli("train", "cancel", rid, "--wait").returncode == 0
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


@pytest.mark.parametrize(
    "command",
    [
        (sys.executable, "-c", "import time; time.sleep(600)"),  # a script still loading its model
        ("sh", "-c", f"sleep 600; {sys.executable} -c pass"),  # a shell script before its training step
    ],
    ids=["python", "shell"],
)
def test_a_stop_of_a_job_that_may_still_load_the_plugin_is_still_waited_for(
    daemon: DaemonProc, command: tuple[str, ...]
) -> None:
    rid = start(daemon, *command)
    daemon.wait_state(rid, "running")
    out = daemon.cli("train", "stop", rid, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stop"]["no_plugin"] is None  # the plugin may still take it at its first step
    daemon.call("cancel", id=rid)


# --- item 19: what the README warns of, where obd can see it ----------------------------------------


def test_status_warns_when_a_local_jobs_python_is_obds_own_from_its_venv_on_path(
    daemon: DaemonProc, venv_python: Path
) -> None:
    obd_bin = str(Path(sys.prefix) / "bin")  # obd's venv: the one this test's `obd` runs from
    assert sys.prefix != sys.base_prefix
    mine = start_with_path(daemon, f"{obd_bin}:/usr/bin:/bin")
    theirs = start_with_path(daemon, f"{venv_python.parent}:{obd_bin}:/usr/bin:/bin")
    text = status_text(daemon, mine)
    assert f"warning   the job's python is obd's own ({obd_bin}/python3)" in text, text
    assert "warning" not in status_text(daemon, theirs)  # the user's venv comes first: all is well


def start_with_path(d: DaemonProc, path: str) -> str:
    out = d.cli("train", "start", "--", "sh", "-c", "exec sleep 300", env={"PATH": path})
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    wait_for(lambda: (d.record(rid).get("job") or {}).get("python"), what="the job's python recorded")
    return rid


def test_status_says_only_the_trainers_output_dir_goes_to_obd_output_dir(daemon: DaemonProc, short_tmp: Path) -> None:
    """A script's own paths stay relative to its working directory; $OBD_OUTPUT_DIR is the run's output/."""
    script = "import os, pathlib; pathlib.Path('final').mkdir(); print(os.environ['OBD_OUTPUT_DIR'])"
    out = daemon.cli("train", "start", "--cwd", str(short_tmp), "--", sys.executable, "-c", script)
    assert out.returncode == 0, out.stderr
    record = daemon.wait_state(out.stdout.strip(), "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    output = f"{record['remote_dir']}/output"
    assert (short_tmp / "final").is_dir()  # not redirected: the README says so
    assert daemon.cli("train", "logs", record["id"]).stdout.strip() == output
    line = next(x for x in status_text(daemon, record["id"]).splitlines() if x.startswith("outputs"))
    assert line.startswith(f"outputs   {output}  ($OBD_OUTPUT_DIR; the Trainer's output_dir is put there"), line
