"""Under the root service a user's run is every process it started (issue 33 item 3): their job's
daemonized (`setsid`, double-forked) process and their `obd train exec RUN -- sleep 300` end with
the run's cancel, and the next run on the same GPU (another user's) starts only after.

Root only: a root daemon shared by two throwaway users (tests/users.py).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, wait_for
from tests.executors.local.test_containment import alive
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts = users.accounts

CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
JOB = "cd \"$OBD_RUN_DIR\"; setsid sh -c 'sleep 300 & echo $! > daemonized.pid' < /dev/null > /dev/null 2>&1; sleep 300"


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield users.shared_daemon(make_daemon, short_tmp, accounts, CONFIG, own_python=True)


def test_a_users_exec_and_daemonized_processes_end_with_the_cancel_before_the_gpu_goes_to_another_user(
    box: Box,
) -> None:
    rid = box.start(box.alice, "sh", "-c", JOB, opts=("--gpus", "1"))
    record = box.daemon.wait_state(rid, "running")
    run_dir = Path(record["remote_dir"])
    client = subprocess.Popen(  # type: ignore[call-overload]
        [
            f"{box.venv}/bin/python",
            "-m",
            "daemon.cli",
            "train",
            "exec",
            rid,
            "--",
            "sh",
            "-c",
            "echo $$ > exec.pid; exec sleep 300",
        ],
        env=box.env(box.alice),
        cwd=box.alice.home,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **box._as(box.alice),
    )

    def pid_in(name: str) -> int:
        path = run_dir / name
        return int(wait_for(lambda: path.is_file() and path.read_text().strip(), 30, 0.05, f"{name} written"))

    pids = pid_in("daemonized.pid"), pid_in("exec.pid")
    assert all(alive(p) for p in pids)
    check = " ".join(
        f'if [ -e /proc/{p} ] && [ "$(cut -d" " -f3 /proc/{p}/stat)" != Z ]; then echo alive; else echo gone; fi;'
        for p in pids
    )
    bobs = box.start(box.bob, "sh", "-c", check, opts=("--gpus", "1"))
    assert box.daemon.record(bobs)["state"] == "queued"
    out = box.obd(box.alice, "train", "cancel", rid)
    assert out.returncode == 0, out.stderr
    box.daemon.wait_state(rid, "cancelled")
    assert not any(alive(p) for p in pids)
    client.communicate(timeout=60)  # alice's session ended with her run
    done = box.daemon.wait_state(bobs, "succeeded", "failed", timeout=90)
    assert done["state"] == "succeeded", done["message"]
    assert (Path(done["remote_dir"]) / "job.log").read_text().split() == ["gone", "gone"]
