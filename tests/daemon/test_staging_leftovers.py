"""What a daemon killed while it staged the plugin into a run directory leaves (issue 34 item 23):
the temporary files of its copies (`plugin/.sitecustomize.py.tmp.PID.HEX`) and a half-made stage
in STATE_DIR/plugin-stage/ are removed when the next daemon starts, as the store's own leftovers
are; the plugin's real files, and a link planted in the run directory, are left alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tests.conftest import DaemonProc


def plant(path: Path, age: float = 3600.0) -> Path:
    """A file as a write cut short left it, older than the daemon that will start."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("half of it")
    then = time.time() - age
    os.utime(path, (then, then))
    return path


def test_a_daemon_killed_while_it_staged_the_plugin_leaves_nothing_once_the_next_one_started(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    out = daemon.cli("train", "start", "--", "sleep", "300")
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    record = daemon.wait_state(rid, "running")
    plugin = Path(record["remote_dir"]) / "plugin"
    daemon.kill()  # as in the middle of a copy into plugin/: its temporary files stay
    left = [
        plant(plugin / ".sitecustomize.py.tmp.4242.0a1b2c3d4e5f"),
        plant(plugin / "trainer_plugin" / "tools" / ".jobctl.py.tmp.4242.a1b2c3d4e5f6"),
    ]
    half_stage = daemon.state_dir / "plugin-stage" / "0123456789abcdef.tmp4242"
    plant(half_stage / "trainer_plugin" / "rundir.py")
    os.utime(half_stage, (time.time() - 3600, time.time() - 3600))
    outside = plant(tmp_path / ".secret.tmp.1.aaaaaaaaaaaa")  # reached only through a planted link
    os.symlink(tmp_path, plugin / "link")

    daemon.start()
    assert [p for p in left if p.exists()] == [] and not half_stage.exists()
    assert (plugin / "sitecustomize.py").is_file() and (plugin / "trainer_plugin" / "tools" / "jobctl.py").is_file()
    assert outside.exists()
    assert daemon.record(rid)["state"] == "running"  # the run itself is untouched
    daemon.call("cancel", id=rid)
    daemon.wait_state(rid, "cancelled")
