"""What a group member who is not root meets with the root-only commands of a shared daemon
(issue 34 item 24): an `obd:` message and exit 77, never a traceback.

Root only: the throwaway users and their client are tests/users.py's.
"""

from __future__ import annotations

import json

from tests import users
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts, box = users.accounts, users.box  # the fixtures, shared with the shared service's tests


def test_a_drain_or_undrain_by_a_user_who_is_not_root_is_denied_with_a_message_and_exit_77(box: Box) -> None:
    for action in ("drain", "undrain"):
        out = box.obd(box.bob, "targets", action, "local")
        assert out.returncode == 77, (action, out.returncode, out.stderr)
        assert out.stderr.startswith("obd: only root (or the daemon's own user) may drain a target"), out.stderr
        assert "Traceback" not in out.stderr and out.stdout == ""
    [local] = [t for t in json.loads(box.daemon.cli("targets", "list", "--json").stdout) if t["name"] == "local"]
    assert not local.get("drained")  # nothing bob asked reached it
