"""What a new user read wrong in `obd train status` and `stop --wait` (issue 34 items 5, 8, 9, 19),
each with a real daemon and real jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cli import render
from tests.conftest import FAST_CONFIG, DaemonProc, wait_for

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
