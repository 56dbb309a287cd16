"""A host whose login scripts hang (issue 34 item 22), against a real sshd: the host answers and
takes the login, but a ~/.bashrc that waits keeps obd's setup command from finishing. The error
says so, and names the usual cause, instead of blaming the network."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from executors.base import TargetUnreachable
from executors.ssh import SshExecutor
from tests.executors.ssh.conftest import SKIP
from tests.executors.ssh.helpers import make_target
from tests.sshd import SshServer, _children


@pytest.fixture
def hanging_login() -> Iterator[SshServer]:
    """An sshd whose sessions read a ~/.bashrc that waits far longer than the test's timeout."""
    if SKIP:
        pytest.skip(SKIP)
    server = SshServer(bashrc="sleep 60")
    with server:
        yield server
        # The shell the dropped session left sleeping is the reaper's now, no longer sshd's: end it.
        reapers = [r.pid for r in server.reapers]
    for pid in [child for reaper in reapers for child in _children(reaper)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for reaper in server.reapers:
        reaper.wait(10)


async def test_a_login_script_that_hangs_is_named_as_the_usual_cause_not_the_network(
    hanging_login: SshServer, workdir: Path
) -> None:
    ex = SshExecutor("box", make_target(hanging_login, workdir), op_timeout=2, backoff_base=0.1, backoff_cap=0.5)
    try:
        with pytest.raises(TargetUnreachable) as caught:
            await ex.connection.ensure()
    finally:
        await ex.aclose()
    said = str(caught.value)
    assert "accepted the login" in said and "did not finish within 2 s" in said, said
    assert "login script that waits" in said and "~/.bashrc" in said, said
    assert f"ssh -p {hanging_login.port}" in said and "obd targets check box" in said, said
    assert "firewall" not in said and "no answer in time" not in said, said
    assert hanging_login.shells_started() >= 1  # the login was taken: a shell read the ~/.bashrc
