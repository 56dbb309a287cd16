"""The local executor on its own: its events, how it hands a job its environment, its files."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import anyio
import pytest

from executors.base import JobSpec
from executors.local import DirWatch, LocalExecutor
from trainer_plugin.tools import jobctl


async def _paths(watch: DirWatch, timeout: float = 5.0) -> set[str]:
    seen: set[str] = set()
    with anyio.move_on_after(timeout):
        seen |= await watch.paths()
    return seen


async def test_events_name_the_run_directory_and_the_file_and_metrics_growth_is_one(tmp_path: Path) -> None:
    watch = DirWatch()
    if not watch.available:
        pytest.skip("no inotify here")
    a, b = tmp_path / "run-a", tmp_path / "run-b"
    a.mkdir()
    b.mkdir()
    (b / "metrics.jsonl").write_text('{"event": "begin"}\n')
    watch.add(str(a))
    watch.add(str(b))
    jobctl.atomic_write(str(a / "snapshot.request"), b"requested\n")
    assert f"{a}/snapshot.request" in await _paths(watch)
    with open(b / "metrics.jsonl", "a") as f:  # an append, as the plugin writes: no close-write of a new file
        f.write('{"event": "log", "step": 1}\n')
        f.flush()
        assert str(b / "metrics.jsonl") in await _paths(watch)
    watch.remove(str(b))
    with open(b / "metrics.jsonl", "a") as f:
        f.write('{"event": "log", "step": 2}\n')
    assert str(b / "metrics.jsonl") not in await _paths(watch, 0.3)


async def test_a_job_gets_its_spec_and_values_on_stdin_never_in_a_file_and_a_clean_environment(tmp_path: Path) -> None:
    executor = LocalExecutor("local", tmp_path)
    rd = tmp_path / "run-1"
    out = tmp_path / "env.json"
    spec = JobSpec(
        run_id="run-1",
        remote_dir=str(rd),
        command=[sys.executable, "-c", f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"],
        env={"VISIBLE": "v4lue"},
        secrets={"TOKEN": "s3cret"},
        base_env={"PATH": "/usr/bin:/bin", "MINE": "from-the-caller"},
    )
    os.environ["DAEMON_ONLY"] = "daemon-value"
    try:
        handle = await executor.spawn(spec)
        with anyio.fail_after(30):
            while (await executor.status(handle, str(rd))).state.value == "running":
                await anyio.sleep(0.05)
    finally:
        del os.environ["DAEMON_ONLY"]
    env = json.loads(out.read_text())
    assert env["VISIBLE"] == "v4lue" and env["TOKEN"] == "s3cret" and env["MINE"] == "from-the-caller"
    assert "DAEMON_ONLY" not in env  # the daemon's environment does not reach the job
    assert env["PYTHONPATH"].split(":")[0] == str(rd / "plugin")
    assert not (rd / "job.json").exists()  # a file the user could rewrite before a root wrapper read it
    for path in rd.rglob("*"):
        if path.is_file():
            assert b"v4lue" not in path.read_bytes() and b"s3cret" not in path.read_bytes(), path
    assert stat.S_IMODE(rd.stat().st_mode) == 0o700


def test_a_run_directory_under_a_new_workdir_is_private_and_its_new_parents_passable_under_the_daemons_umask(
    tmp_path: Path,
) -> None:
    """The daemon runs with umask 077; a second local target's workdir made for its first run
    must still let the run's user reach their own directory (0711 parents, a 0700 run directory)."""
    from executors.local import private_dir

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    old = os.umask(0o077)
    try:
        private_dir(tmp_path / "srv" / "obd" / "jobs2" / "20261205-000000-aaaaaa")
        private_dir(mine / "run")
    finally:
        os.umask(old)
    for made in ("srv", "srv/obd", "srv/obd/jobs2"):
        assert stat.S_IMODE((tmp_path / made).stat().st_mode) == 0o711, made
    assert stat.S_IMODE((tmp_path / "srv/obd/jobs2/20261205-000000-aaaaaa").stat().st_mode) == 0o700
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700  # a directory that was there is left as it was
