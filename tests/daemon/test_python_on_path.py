"""A target's `python` is the `python` and `python3` of its jobs (issue 23, item 6c): on the local
target and over SSH, a job's `python -c ...` runs the configured interpreter, with its venv."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from executors import python_shim
from tests.conftest import FAST_CONFIG, DaemonProc, kill_job_groups
from tests.daemon.test_ssh_target import ssh_config
from tests.sshd import SshServer, running_sshd

WHICH = "import sys; print(sys.executable); print(sys.prefix)"


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The configured interpreter: a venv's `bin/python` (a link to the base Python, which a link
    of ours to it would run without the venv)."""
    venv = tmp_path_factory.mktemp("target") / "some-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


def which_python(d: DaemonProc, *opts: str) -> tuple[str, dict]:
    """Run `python` and `python3` in a job; the log and the record."""
    command = f"python -c '{WHICH}' && python3 -c '{WHICH}'"
    out = d.cli("train", "start", *opts, "--", "sh", "-c", command)
    assert out.returncode == 0, out.stderr
    record = d.wait_state(out.stdout.strip(), "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    return d.cli("train", "logs", record["id"]).stdout, record


def test_a_local_targets_python_is_the_python_and_python3_its_jobs_run(make_daemon, venv_python: Path) -> None:
    d = make_daemon(FAST_CONFIG + f'\n[targets.local]\nkind = "local"\npython = "{venv_python}"\n')
    d.start()
    log, record = which_python(d)
    venv = str(venv_python.parent.parent)
    assert log.split() == [str(venv_python), venv, str(venv_python), venv]  # the interpreter, in its venv
    assert (Path(record["remote_dir"]) / python_shim.BIN / "python").exists()


def test_a_local_target_without_python_leaves_the_jobs_path_as_it_was(daemon: DaemonProc) -> None:
    log, record = which_python(daemon)
    assert not (Path(record["remote_dir"]) / python_shim.BIN).exists()
    found = subprocess.run(["python3", "-c", WHICH], capture_output=True, text=True, check=True, cwd="/")
    assert log.split()[2:] == found.stdout.split()  # what the caller's own PATH finds


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


def test_an_ssh_targets_python_is_the_python_and_python3_its_jobs_run(
    make_daemon, sshd: SshServer, short_tmp: Path, venv_python: Path
) -> None:
    workdir = short_tmp / "remote"
    config = ssh_config(sshd, workdir).replace(f'python = "{sys.executable}"', f'python = "{venv_python}"')
    assert f'python = "{venv_python}"' in config
    d = make_daemon(config)
    d.start()
    try:
        log, record = which_python(d, "--target", "box")
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))
    venv = str(venv_python.parent.parent)
    assert log.split() == [str(venv_python), venv, str(venv_python), venv]
    assert record["target"] == "box"


def test_a_python_given_by_name_is_looked_up_past_the_scripts_own_directory(tmp_path: Path) -> None:
    shims, elsewhere = tmp_path / "plugin" / "bin", tmp_path / "elsewhere"
    shims.mkdir(parents=True)
    elsewhere.mkdir()
    program = elsewhere / "python3.99"
    program.write_text('#!/bin/sh\necho "found $0 with $# arguments: $*"\n')
    program.chmod(0o755)
    for name in python_shim.NAMES:
        (shims / name).write_bytes(python_shim.looking_up("python3.99", str(shims)))
        (shims / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{elsewhere}:/usr/bin:/bin"}
    out = subprocess.run(["python", "a b", "c"], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == f"found {program} with 2 arguments: a b c"
    missing = subprocess.run(["python3"], env={**env, "PATH": f"{shims}:/usr/bin:/bin"}, capture_output=True, text=True)
    assert missing.returncode == 127 and "python3.99" in missing.stderr  # never itself, round and round


def test_a_path_with_quotes_and_dollars_is_run_as_it_is_written(tmp_path: Path) -> None:
    odd = tmp_path / "it's $HOME"
    odd.mkdir()
    program = odd / "py"
    program.write_text('#!/bin/sh\necho "ran $0: $*"\n')
    program.chmod(0o755)
    script = tmp_path / "python"
    script.write_bytes(python_shim.shim(str(program)))
    script.chmod(0o755)
    out = subprocess.run([str(script), "x"], capture_output=True, text=True)
    assert out.stdout.strip() == f"ran {program}: x"
