"""The Python API (`from obd import Client`, docs/python-api.md) used by the users of a root
service: in a venv with none of the daemon's dependencies, as the `obd` command is; another
user's run is refused with `Denied`, whose exit code is the command's."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.users import Box

accounts = users.accounts
box = users.box
pytestmark = users.needs_root_and_users

SCRIPT = """
import json, sys
import obd
rid = sys.argv[1]
out = {}
with obd.Client() as client:
    try:
        client.run(rid).cancel()
        out["cancel"] = "done"
    except obd.ObdError as exc:
        out["cancel"] = [type(exc).__name__, exc.exit_code]
    out["mine"] = [r.id for r in client.runs(all=True)]
print(json.dumps(out))
"""


def as_user(b: Box, user: users.User, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [f"{b.venv}/bin/python", "-c", SCRIPT, *args],
        env=b.env(user),
        cwd=user.home,
        capture_output=True,
        text=True,
        timeout=60,
        **b._as(user),  # type: ignore[call-overload]
    )


@pytest.fixture
def alices_run(box: Box) -> Iterator[str]:
    rid = box.start(box.alice, "sleep", "300")
    box.daemon.wait_state(rid, "running")
    yield rid
    box.daemon.call("cancel", id=rid)


def test_another_users_run_is_refused_through_the_api_with_the_commands_exit_code(box: Box, alices_run: str) -> None:
    cli = box.obd(box.bob, "train", "cancel", alices_run)
    out = as_user(box, box.bob, alices_run)
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout)
    assert said["cancel"] == ["Denied", 77] and cli.returncode == 77, (said, cli.returncode, cli.stderr)
    assert box.daemon.record(alices_run)["state"] == "running"
    # Its owner may: the same call as alice ends it.
    mine = json.loads(as_user(box, box.alice, alices_run).stdout)
    assert mine["cancel"] == "done" and alices_run in mine["mine"]
    assert box.daemon.wait_state(alices_run, "cancelled")["state"] == "cancelled"


def test_the_api_needs_nothing_but_the_standard_library(box: Box) -> None:
    probe = "import obd, sys; bad = {'pydantic', 'anyio', 'torch', 'structlog'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run(
        [f"{box.venv}/bin/python", "-c", probe],
        env=box.env(box.alice),
        cwd=Path(box.alice.home),
        capture_output=True,
        text=True,
        timeout=60,
        **box._as(box.alice),  # type: ignore[call-overload]
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
