"""`obd targets check` on a Ray target whose Jobs API does not answer: said, with what to do (no
cluster needed; the checks of a live cluster are in tests/daemon/test_ray_target.py, slow)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

from tests.conftest import FAST_CONFIG, DaemonProc


def test_targets_check_of_a_ray_target_whose_jobs_api_does_not_answer_says_so_and_fails(
    make_daemon: Callable[..., DaemonProc], short_tmp: Path
) -> None:
    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = f'kind = "ray"\naddress = "http://127.0.0.1:{port}"\nworkdir = "{short_tmp / "shared"}"\n'
    d = make_daemon(FAST_CONFIG + f"\n[targets.gone]\n{target}")
    out = d.cli("targets", "check", "gone")
    said = out.stdout + out.stderr
    assert out.returncode != 0, said
    assert f"Ray's Jobs API at http://127.0.0.1:{port} did not answer" in said
    assert "ray status" in said  # what to run next
