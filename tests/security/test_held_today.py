"""Attacks that already failed before issue 22, kept here so they keep failing: a proof that is a
link or a FIFO, another user over the raw socket, and escape sequences a job writes.

Root only: a root daemon shared by two throwaway users (tests/users.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

from tests import users
from tests.conftest import wait_for
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts, box = users.accounts, users.box


def test_a_proof_that_is_a_fifo_or_a_link_proves_nothing_and_holds_no_one_up(box: Box) -> None:
    alice = box.alice
    job = (
        'cd "$OBD_RUN_DIR"; mkdir -p output/checkpoint-3 elsewhere; '
        'printf \'{"checkpoint": "output/checkpoint-3", "step": 3, "time": 1, "reason": "requested"}\' > elsewhere/p; '
        "mkfifo snapshot.json; sleep 2; rm snapshot.json; ln -s elsewhere/p snapshot.json; sleep 2"
    )
    rid = box.start(alice, "sh", "-c", job)
    rd = Path(box.daemon.wait_state(rid, "running")["remote_dir"])
    wait_for(lambda: (rd / "snapshot.json").exists() or (rd / "snapshot.json").is_symlink(), 20, 0.05, "the FIFO")
    began = time.monotonic()
    assert box.daemon.record(rid)["state"] == "running"  # answered while a FIFO sits where the proof goes
    assert time.monotonic() - began < 5
    final = box.daemon.wait_state(rid, "succeeded", "failed", "stopped", timeout=60)
    assert final["state"] == "failed" and final["snapshot"] is None, final["message"]
    assert "invalid snapshot proof" in final["message"]


_RAW = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
f = sock.makefile("rwb")
for request in json.loads(sys.argv[2]):
    f.write(json.dumps(request).encode() + b"\\n"); f.flush()
    print(f.readline().decode().strip(), flush=True)
"""


def test_another_user_gets_nothing_of_a_run_over_the_raw_socket(box: Box) -> None:
    marker = "alice-private-" + uuid.uuid4().hex
    rid = box.start(box.alice, "sh", "-c", f"echo {marker}; sleep 60")
    box.daemon.wait_state(rid, "running")
    requests = [
        {"op": "status", "id": rid},
        {"op": "read", "id": rid, "file": "log", "offset": 0},
        {"op": "outputs", "id": rid},
        {"op": "stop", "id": rid, "reason": "requested"},
        {"op": "cancel", "id": rid},
        {"op": "list", "all": True},
    ]
    out = subprocess.run(
        [f"{box.venv}/bin/python", "-S", "-c", _RAW, str(box.daemon.socket), json.dumps(requests)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        user=box.bob.uid,
        group=box.bob.gid,
        extra_groups=[os.getgrouplist(box.bob.name, box.bob.gid)[-1]],
    )
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == len(requests), out.stderr
    assert marker not in out.stdout  # `list --all` shows other users' runs as squeue does: never their contents
    for request, answer in zip(requests[:-1], answers[:-1], strict=True):
        assert not answer.get("ok", True) or "error" in answer, (request, answer)
    assert box.daemon.record(rid)["state"] == "running"  # bob's stop and cancel did nothing
    box.obd(box.alice, "train", "cancel", rid, "--wait")


def test_escape_sequences_a_job_writes_reach_roots_terminal_only_as_text(box: Box) -> None:
    evil = r"\033]0;owned\007\033[2J\033[31mfake-ok"
    rid = box.start(box.alice, "sh", "-c", f"printf '{evil}\\n'; exit 3")
    box.daemon.wait_state(rid, "failed")
    for args in (("status", rid), ("list", "--all")):
        out = box.daemon.cli("train", *args)  # root reads alice's run
        assert "\x1b" not in out.stdout + out.stderr and "\x07" not in out.stdout, args
    # The job's words reach root as text; its terminal controls are left out of the quoted lines.
    assert "last lines: fake-ok" in box.daemon.cli("train", "status", rid).stdout
