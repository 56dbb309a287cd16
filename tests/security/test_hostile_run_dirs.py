"""What a run's owner (or its job) leaves in the run directory never breaks `status`, `prune` or
retention under the root service (issue 33 items 4 and 5): a trainer_state.json nested 200,000
deep, a directory of a checkpoint its owner made mode 0 or read-only, one of another user's.

Root only: a root daemon shared by throwaway users (tests/users.py); the daemon removes a
checkpoint with its owner's rights, so what the owner could not remove is refused and said.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG
from tests.users import Box, User

pytestmark = users.needs_root_and_users
accounts = users.accounts

CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\n'


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield users.shared_daemon(make_daemon, short_tmp, accounts, CONFIG, own_python=True)


def as_user(user: User, script: str, *args: str) -> None:
    """`sh -c SCRIPT` run by `user` (what they may do to their own run directory)."""
    done = subprocess.run(
        ["sh", "-c", script, "sh", *args], user=user.uid, group=user.gid, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def ended_run(box: Box, *opts: str) -> tuple[str, Path]:
    rid = box.start(box.alice, "true", opts=opts)
    return rid, Path(box.daemon.wait_state(rid, "succeeded")["remote_dir"])


CHECKPOINT = 'mkdir -p "$1" && head -c 1000 /dev/zero > "$1/model.safetensors" && printf \'{"global_step": %s}\' "$2" > "$1/trainer_state.json"'


def checkpoint(user: User, run_dir: Path, step: int) -> Path:
    path = run_dir / "output" / f"checkpoint-{step}"
    as_user(user, CHECKPOINT, str(path), str(step))
    return path


def test_a_checkpoint_holding_a_mode_0_or_a_read_only_directory_is_pruned_whole_and_the_record_says_so(
    box: Box,
) -> None:
    rid, run_dir = ended_run(box)
    locked, read_only, newest = (checkpoint(box.alice, run_dir, step) for step in (1, 2, 3))
    as_user(box.alice, 'mkdir "$1/d" && echo x > "$1/d/f" && chmod 0 "$1/d"', str(locked))
    as_user(box.alice, 'mkdir "$1/d" && echo x > "$1/d/f" && chmod 555 "$1/d"', str(read_only))
    out = box.obd(box.alice, "train", "prune", rid, "--keep", "1", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["errors"] == [] and [r["name"] for r in answer["removed"]] == ["checkpoint-1", "checkpoint-2"]
    assert os.listdir(run_dir / "output") == [newest.name]  # nothing half-removed left behind
    assert box.daemon.record(rid)["retention"]["pruned"] == ["checkpoint-1", "checkpoint-2"]


def test_a_checkpoint_its_owner_cannot_empty_is_refused_whole_said_and_not_recorded_as_pruned(box: Box) -> None:
    rid, run_dir = ended_run(box)
    odd, _ = checkpoint(box.alice, run_dir, 1), checkpoint(box.alice, run_dir, 2)
    (odd / "roots").mkdir()  # another user's directory in it (root's), which its owner cannot empty
    (odd / "roots" / "f").write_bytes(b"r")
    out = box.obd(box.alice, "train", "prune", rid, "--keep", "1", "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["removed"] == []
    assert len(answer["errors"]) == 1 and "checkpoint-1/roots is a directory of uid 0" in answer["errors"][0]
    assert sorted(os.listdir(run_dir / "output")) == ["checkpoint-1", "checkpoint-2"]  # untouched, nothing renamed
    assert (odd / "trainer_state.json").exists() and box.daemon.record(rid)["retention"]["pruned"] == []


def test_a_trainer_state_nested_200000_deep_leaves_status_and_prune_working_and_is_logged_once(box: Box) -> None:
    rid, run_dir = ended_run(box, "--keep-checkpoints", "1")
    deep, _, newest = (checkpoint(box.alice, run_dir, step) for step in (1, 2, 3))
    as_user(box.alice, "python3 -c \"print('[' * 200000 + ']' * 200000)\" > \"$1/trainer_state.json\"", str(newest))
    nested = "python3 -c \"print('{\\\"a\\\":' * 100000 + '1' + '}' * 100000)\" > \"$1/trainer_state.json\""
    as_user(box.alice, nested, str(deep))
    for _ in range(3):
        out = box.obd(box.alice, "train", "prune", rid, "--keep", "1", "--json")
        assert out.returncode == 0, out.stderr
        status = box.obd(box.alice, "train", "status", rid, "--json")
        assert status.returncode == 0, status.stderr
    shown = {c["name"]: c["complete"] for c in json.loads(status.stdout)["checkpoints"]["checkpoints"]}
    assert shown == {
        "checkpoint-2": True,
        "checkpoint-3": False,
    }  # 1 (incomplete, older) pruned; 3 may be being written
    assert box.daemon.record(rid)["retention"]["pruned"] == ["checkpoint-1"]
    log = box.daemon.log_path.read_text()
    assert log.count("checkpoint_state_unreadable") == 2, log[-3000:]  # once per checkpoint, not per call
    assert "RecursionError" not in log and "Traceback" not in log
