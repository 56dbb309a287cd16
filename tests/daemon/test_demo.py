"""The demo (scripts/demo.py) leaves nothing behind: not its directory, its daemon, or a job."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO, wait_for
from trainer_plugin.tools import jobctl


def load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("obd_demo", REPO / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def live_with_env(item: str) -> list[int]:
    """Live processes whose environment holds `item` (NAME=value)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if item.encode() in environ:
            found.append(int(entry))
    return found


def test_a_demo_that_fails_with_a_job_running_leaves_no_directory_daemon_or_job_behind(
    capfd: pytest.CaptureFixture[str],
) -> None:
    demo = load_demo()
    with pytest.raises(SystemExit, match="demo: something failed"), demo.demo_daemon() as root:
        run = demo.obd("train", "start", "--name", "left-running", "--", "sleep", "600", show=False).stdout.strip()
        wait_for(lambda: demo.record(run)["state"] == "running", 60, 0.2, "the job to run")
        handle = jobctl.read_handle(str(next((root / "state").glob("jobs/*/job.pid")).parent))
        daemons = live_with_env(f"OBD_STATE_DIR={root / 'state'}")
        assert handle is not None and jobctl.group_alive(handle) and daemons
        raise SystemExit("demo: something failed")
    assert not root.exists()
    assert not jobctl.group_alive(handle)
    assert not live_with_env(f"OBD_STATE_DIR={root / 'state'}")
    assert "the daemon's log ended with" in capfd.readouterr().err  # what to look at, the directory being gone
