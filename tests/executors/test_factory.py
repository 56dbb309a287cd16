"""What the factory makes of each kind of target, with the daemon's settings passed down."""

from __future__ import annotations

from pathlib import Path

from executors.config import LocalTarget, SshTarget
from executors.factory import make_executor
from executors.local import LocalExecutor
from executors.ssh import SshExecutor


def test_an_ssh_target_without_pushed_events_is_read_at_the_daemons_remote_poll_interval(tmp_path: Path) -> None:
    target = SshTarget(kind="ssh", host="gpu-box")
    executor = make_executor("box", target, tmp_path, remote_poll=1.5)
    assert isinstance(executor, SshExecutor)
    assert executor.events is not None and executor.events.poll_hint == 1.5
    quiet = make_executor("box", SshTarget(kind="ssh", host="gpu-box", helper=False), tmp_path, remote_poll=1.5)
    assert isinstance(quiet, SshExecutor) and quiet.events is None


def test_a_local_target_without_a_workdir_keeps_its_runs_under_the_state_directory(tmp_path: Path) -> None:
    executor = make_executor("local", LocalTarget(kind="local"), tmp_path)
    assert isinstance(executor, LocalExecutor)
    assert Path(executor.workdir) == tmp_path / "jobs"
