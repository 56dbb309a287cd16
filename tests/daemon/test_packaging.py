"""The package as people install it: its name and extras, a fresh venv with no extras, the units, the docs.

The fresh venv is a real one (`python -m venv`, `pip install` of a copy of this tree), so what it
checks is what a user gets: the daemon and a local job with no runpod, torch or transformers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
UNIT = (REPO / "systemd" / "obd.service").read_text()
USER_UNIT = (REPO / "systemd" / "obd-user.service").read_text()


def test_the_distribution_is_obd_train_its_command_obd_and_runpod_an_extra() -> None:
    project = PYPROJECT["project"]
    assert project["name"] == "obd-train"
    assert project["scripts"] == {"obd": "daemon.cli:main"}
    core = {re.split(r"[<>=\[ ]", dep)[0] for dep in project["dependencies"]}
    assert core == {"pydantic", "anyio", "asyncssh", "structlog"}
    assert [d for d in project["optional-dependencies"]["runpod"] if d.startswith("runpod")]
    # The test environment still gets the SDK: the Runpod target's tests run it against a fake API.
    assert [d for d in project["optional-dependencies"]["test"] if d.startswith("runpod")]
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["daemon.cli"]
    assert {Path(p).name for p in data} == {p.name for p in (REPO / "daemon" / "cli" / "completions").iterdir()}


# --- a fresh venv, no extras -------------------------------------------------------------------


class FreshVenv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "venv" / "bin"

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.bin / "python"), "-c", code], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FreshVenv]:
    """`python -m venv` and `pip install .` (no extras) of a copy of this tree, as a user does."""
    root = tmp_path_factory.mktemp("fresh")
    source = root / "src"
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(".git", ".venv", "tests", "__pycache__", "*.egg-info", "build", ".pytest_cache"),
    )
    # The interpreter obd's own venv was made from, not that venv: its site-packages must not leak in.
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", str(root / "venv")], check=True, timeout=120)
    venv = FreshVenv(root)
    out = subprocess.run(
        [str(venv.bin / "pip"), "install", "-q", str(source)], capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        if re.search(
            r"No matching distribution|Could not find a version|connection|Network is unreachable",
            out.stdout + out.stderr,
            re.I,
        ):
            pytest.skip(f"pip cannot reach a package index here: {(out.stderr or out.stdout).strip()[-300:]}")
        raise AssertionError(f"pip install failed:\n{out.stdout}\n{out.stderr}")
    yield venv


def test_a_fresh_venv_without_extras_has_no_runpod_torch_nor_transformers_and_ships_its_files(fresh: FreshVenv) -> None:
    for module in ("runpod", "torch", "transformers", "matplotlib"):
        assert fresh.python(f"import {module}").returncode != 0, f"{module} was installed"
    version = subprocess.run([str(fresh.bin / "obd"), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("obd 0.1.0 (package obd-train)")
    completion = subprocess.run(
        [str(fresh.bin / "obd"), "completion", "zsh"], capture_output=True, text=True, timeout=60
    )
    assert completion.stdout.startswith("#compdef obd")
    prefix = fresh.root / "venv"
    assert (prefix / "share" / "doc" / "obd-train" / "README.md").read_text() == (REPO / "README.md").read_text()
    for unit in ("obd.service", "obd-user.service"):
        assert (prefix / "share" / "obd-train" / "systemd" / unit).read_text() == (REPO / "systemd" / unit).read_text()


def _fresh_daemon(fresh: FreshVenv, root: Path, config: str = FAST_CONFIG) -> DaemonProc:
    """A DaemonProc whose `obd` is the fresh venv's (and whose jobs see nothing of this repository)."""
    d = DaemonProc(root, config)
    d.env = {k: v for k, v in d.env.items() if k != "PYTHONPATH"}
    d.env["PATH"] = f"{fresh.bin}:{os.environ['PATH']}"
    return d


def _start_daemon(fresh: FreshVenv, d: DaemonProc) -> subprocess.Popen[bytes]:
    with open(d.log_path, "ab") as log:
        proc = subprocess.Popen([str(fresh.bin / "obd"), "daemon"], env=d.env, stdout=log, stderr=log, cwd=d.root)
    d.proc = proc
    wait_for(d.ready, 30, 0.1, "the fresh venv's daemon")
    return proc


def _obd(fresh: FreshVenv, d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(fresh.bin / "obd"), *args], env=d.env, capture_output=True, text=True, timeout=60, cwd=d.root
    )


def test_a_fresh_venv_without_extras_runs_the_daemon_and_a_local_job(fresh: FreshVenv, short_tmp: Path) -> None:
    d = _fresh_daemon(fresh, short_tmp)
    try:
        _start_daemon(fresh, d)
        out = _obd(fresh, d, "train", "start", "--name", "plain", "--", "sh", "-c", "echo ran without extras")
        assert out.returncode == 0, out.stderr
        rid = out.stdout.strip()
        follow = _obd(fresh, d, "train", "logs", rid, "--follow")
        assert follow.returncode == 0 and follow.stdout == "ran without extras\n"
        listed = json.loads(_obd(fresh, d, "train", "list", "--json").stdout)
        assert [(r["name"], r["state"]) for r in listed] == [("plain", "succeeded")]
    finally:
        d.stop()


def test_a_runpod_target_without_the_sdk_says_which_command_installs_it(fresh: FreshVenv, short_tmp: Path) -> None:
    config = FAST_CONFIG + '\n[targets.pods]\nkind = "runpod"\ngpu_type = ["NVIDIA A40"]\n'
    d = _fresh_daemon(fresh, short_tmp, config)
    try:
        _start_daemon(fresh, d)
        out = _obd(fresh, d, "train", "start", "--target", "pods", "--", "true")
        message = out.stderr
        if out.returncode == 0:
            rid = out.stdout.strip()
            wait_for(
                lambda: _obd(fresh, d, "train", "status", rid, "--json").stdout.count('"failed"'),
                30,
                0.2,
                "the run to fail",
            )
            message = json.loads(_obd(fresh, d, "train", "status", rid, "--json").stdout)["message"]
        assert "pip install 'obd-train[runpod]'" in message
    finally:
        d.stop()


# --- the plugin on an older training Python ----------------------------------------------------

CUSTOM_LOOP = """
import os
import time
from trainer_plugin import begin, checkpoint_dir, end, log_metrics, snapshot_requested, write_proof
begin(max_steps=10000)
for step in range(1, 10001):
    time.sleep(0.1)
    log_metrics(step, loss=1.0 / step)
    reason = snapshot_requested()
    if reason:
        path = checkpoint_dir(step)
        os.makedirs(path)
        open(path + "/weights.txt", "w").write(str(step))
        write_proof(step, path, reason=reason)
        break
end(step)
"""


def _python38() -> str | None:
    """A real Python 3.8 (pyenv's shims are not: they pick a version by directory)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in (*sorted(pyenv.glob("3.8.*/bin/python3.8")), shutil.which("python3.8")):
        if candidate and "shims" not in str(candidate) and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.mark.skipif(_python38() is None, reason="no Python 3.8 here to run a job with")
def test_the_plugin_snapshots_a_job_on_python_3_8(make_daemon, short_tmp: Path) -> None:
    d = make_daemon()
    d.start()
    script = short_tmp / "loop.py"
    script.write_text(CUSTOM_LOOP)
    out = d.cli("train", "start", "--", str(_python38()), str(script))
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    wait_for(lambda: (r := d.record(rid))["snapshots"] and r["progress"]["step"], 60, 0.1, "the 3.8 job's first step")
    stop = d.cli("train", "stop", rid, "--wait", "--json")
    assert stop.returncode == 0, stop.stdout + stop.stderr + d.cli("train", "logs", rid).stdout
    record = json.loads(stop.stdout)
    assert (
        record["state"] == "stopped"
        and record["snapshot"]["checkpoint"] == f"output/checkpoint-{record['snapshot']['step']}"
    )


# --- the units and the docs --------------------------------------------------------------------


def _keys(unit: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in unit.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def test_the_units_name_the_installed_readme_and_read_secrets_from_an_env_file() -> None:
    data_files = PYPROJECT["tool"]["setuptools"]["data-files"]
    assert "README.md" in data_files["share/doc/obd-train"]
    system, user = _keys(UNIT), _keys(USER_UNIT)
    assert system["Documentation"] == ["file:///opt/obd/share/doc/obd-train/README.md"]
    assert system["EnvironmentFile"] == ["-/etc/obd/env"]
    assert user["Documentation"] == ["file://%h/.local/share/obd/venv/share/doc/obd-train/README.md"]
    assert user["ExecStart"] == ["%h/.local/share/obd/venv/bin/obd daemon"]
    assert user["EnvironmentFile"] == ["-%h/.config/obd/env"]
    for unit in (system, user):
        assert unit["Type"] == ["notify"] and unit["KillMode"] == ["process"]
    assert user["WantedBy"] == ["default.target"] and "User" not in user
    readme = (REPO / "README.md").read_text()
    # What the README tells people to run is where the units and the package put things.
    assert "sudo python3 -m venv /opt/obd" in readme and "/etc/obd/env" in readme
    assert "python3 -m venv ~/.local/share/obd/venv" in readme and "systemctl --user" in readme
    assert "share/obd-train/systemd/obd.service" in readme and "share/obd-train/systemd/obd-user.service" in readme


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_reads_both_units_without_a_complaint(short_tmp: Path) -> None:
    for name in ("obd.service", "obd-user.service"):
        unit = short_tmp / name
        text = (REPO / "systemd" / name).read_text().replace("%h/.local/share/obd/venv/bin/obd", "/bin/true")
        unit.write_text(text.replace("/usr/local/bin/obd", "/bin/true"))
        out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
        complaints = [line for line in out.stderr.splitlines() if name in line]
        assert complaints == [], complaints


def test_the_readme_stands_alone_and_every_file_it_and_the_docs_name_exists() -> None:
    readme = (REPO / "README.md").read_text()
    assert "SPEC.md" not in readme and "../shared" not in readme
    # The contract's rules a user needs, in the README itself.
    for rule in (
        "`queued`",
        "`stopped`",
        "exactly `output/checkpoint-<step>`",
        "no symbolic link anywhere on",
        "proof_timeout",
        "end_timeout",
        "`snapshot.request`",
        "`metrics.jsonl`",
    ):
        assert rule in readme, rule
    where = readme.split("## Where things are", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for folder, rest in re.findall(r"^\| `([a-z_]+/)` \| (.*)$", where, re.M):
        named.add(folder)
        for name in re.findall(r"`([\w./-]+)`", rest):
            if name.endswith((".py", "/", ".service", ".sh")):
                # `ssh/` and `cli/main.py` are the folder's own; `scripts/make_completions.py` is the repository's.
                top = (REPO / name.split("/")[0]).is_dir() and "/" in name.rstrip("/")
                named.add(name if top else folder + name)
    missing = sorted(p for p in named if not (REPO / p).exists())
    assert len(named) > 20 and missing == [], missing
    for doc in ("docs/runpod.md", "README.md"):
        text = (REPO / doc).read_text()
        paths = set(re.findall(r"`((?:daemon|executors|trainer_plugin|runner|tests|scripts|systemd)/[\w./-]*)`", text))
        assert sorted(p for p in paths if not (REPO / p).exists()) == [], doc
