"""The box's policy where two requests race and where a run is resumed (issue 33, items 1 and 2).

Root only: a root daemon shared by two throwaway users (tests/users.py). Two sweeps one member
sends at once never queue more than their cap between them (the cap's check and the queuing
are one step), and a resume keeps its run's priority only if whoever resumes may give it.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, wait_for
from tests.users import Box

pytestmark = users.needs_root_and_users
accounts = users.accounts

ONE_GPU = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
CAP = 300
MEMBERS = 200  # each sweep alone fits the cap; two do not

# Two sweeps sent by one user at the same moment, on two connections; one JSON line each: the
# sweep made, or the refusal.
TWO_SWEEPS = r"""
import json, os, sys, threading
from pathlib import Path
from daemon.cli.client import Client
from daemon.cli.client import RequestFailed
sock, members = Path(sys.argv[1]), int(sys.argv[2])
clients = [Client(sock, timeout=600) for _ in range(2)]
for c in clients:
    c.call("ping")  # both connected before either asks
ready = threading.Barrier(2)
out = [None, None]
def send(n):
    ready.wait()
    try:
        made = clients[n].call("sweep", command=["sleep", "600", "{a}"], gpus="1", client_cwd=os.getcwd(),
                               name=f"race{n}", grid=[{"name": "a", "values": [str(i) for i in range(members)]}])
        out[n] = {"made": made["sweep"], "size": made["size"]}
    except RequestFailed as exc:
        out[n] = {"refused": str(exc), "kind": exc.kind}
threads = [threading.Thread(target=send, args=(n,)) for n in range(2)]
for t in threads: t.start()
for t in threads: t.join()
for line in out: print(json.dumps(line))
"""


def _shared(make_daemon, short_tmp: Path, accounts, policy: str) -> Box:  # type: ignore[no-untyped-def]
    return users.shared_daemon(make_daemon, short_tmp, accounts, ONE_GPU + "\n[policy]\n" + policy)


@pytest.fixture
def capped(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield _shared(make_daemon, short_tmp, accounts, f"max_queued_runs_per_user = {CAP}\n")


def test_two_sweeps_one_member_sends_at_once_never_queue_more_than_the_cap_between_them(capped: Box) -> None:
    box, alice, bob = capped, capped.alice, capped.bob
    blocker = box.start(bob, "sleep", "600", opts=("--gpus", "1"))  # the GPU held: every member waits queued
    box.daemon.wait_state(blocker, "running")
    sent = subprocess.run(  # type: ignore[call-overload]
        [f"{box.venv}/bin/python", "-c", TWO_SWEEPS, str(box.daemon.socket), str(MEMBERS)],
        env=box.env(alice),
        cwd=alice.home,
        capture_output=True,
        text=True,
        timeout=600,
        **box._as(alice),
    )
    assert sent.returncode == 0, sent.stderr[-3000:]
    answers = [json.loads(line) for line in sent.stdout.splitlines()]
    made = [a for a in answers if "made" in a]
    refused = [a for a in answers if "refused" in a]
    queued = [r for r in box.daemon.call("list") if r["owner"] == alice.name and r["state"] == "queued"]
    assert len(queued) <= CAP, f"{len(queued)} of alice's runs queued, over her cap of {CAP}: {answers}"
    assert len(made) == 1 and made[0]["size"] == MEMBERS and len(queued) == MEMBERS, answers
    assert len(refused) == 1 and refused[0]["kind"] == "denied", answers
    said = refused[0]["refused"]
    assert f"has {MEMBERS} runs queued" in said and f"cap of {CAP} queued runs per user" in said, said
    assert box.obd(alice, "train", "cancel", made[0]["made"], timeout=300).returncode == 0
    box.obd(bob, "train", "cancel", blocker)


# --- a resume's priority -------------------------------------------------------------------------

# A job that leaves a complete checkpoint and fails: a run to resume.
CHECKPOINT_THEN_FAIL = (
    'mkdir -p "$OBD_OUTPUT_DIR/checkpoint-1" && echo \'{"global_step": 1}\' > "$OBD_OUTPUT_DIR/checkpoint-1/trainer_state.json"'
    ' && echo w > "$OBD_OUTPUT_DIR/checkpoint-1/adapter_model.safetensors"; exit 3'
)


@pytest.fixture
def ranked(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    bob = accounts[1]
    yield _shared(make_daemon, short_tmp, accounts, f"max_priority_users = {{ {bob.name} = 5 }}\n")


def _ended(box: Box, rid: str) -> dict:
    record = box.daemon.wait_state(rid, "failed", "succeeded", "cancelled", timeout=120)
    assert record["state"] == "failed", record["message"]
    wait_for(lambda: box.daemon.record(rid)["snapshot"] or _has_checkpoint(box, rid), 30, what="its checkpoint")
    return record


def _has_checkpoint(box: Box, rid: str) -> bool:
    return (Path(box.daemon.record(rid)["remote_dir"]) / "output" / "checkpoint-1" / "trainer_state.json").exists()


def test_a_resume_keeps_its_priority_only_while_the_member_may_give_it_else_says_the_limit_and_how(
    ranked: Box,
) -> None:
    box, alice, bob = ranked, ranked.alice, ranked.bob
    first = box.start(bob, "sh", "-c", CHECKPOINT_THEN_FAIL, opts=("--gpus", "0", "--priority", "5"))
    _ended(box, first)

    # Within bob's limit (5): a resume keeps the run's priority.
    out = box.obd(bob, "train", "resume", first)
    assert out.returncode == 0, out.stderr
    second = out.stdout.strip().splitlines()[-1].split()[0]
    assert box.daemon.record(second)["priority"] == 5
    _ended(box, second)

    # Above a member's limit, named or kept: refused, saying the limit.
    over = box.obd(bob, "train", "start", "--resume-from", second, "--priority", "6", "--gpus", "0", "--", "true")
    assert over.returncode != 0 and "--priority 6 refused" in over.stderr and "at most 5" in over.stderr, over.stderr

    # The administrator lowers the limit: the run's priority (5) is no longer bob's to give.
    config = box.daemon.config_path.read_text().replace(f"max_priority_users = {{ {bob.name} = 5 }}", "")
    box.daemon.write_config(config)
    box.daemon.stop()
    box.daemon.start()
    refused = box.obd(bob, "train", "resume", second)
    assert refused.returncode != 0
    said = refused.stderr
    assert f"obd train resume {second} refused" in said and "has priority 5" in said, said
    assert "at most 0" in said and "[policy]" in said and "administrator" in said, said
    how = f"obd train start --resume-from {second} --priority 0 --gpus 0 -- sh -c"
    assert how in said, said
    assert [r for r in box.daemon.call("list") if r.get("resumed_from") == second] == []  # nothing was made

    # What it says to do works: resumed at a priority bob may give.
    again = box.obd(bob, "train", "start", "--resume-from", second, "--priority", "0", "--gpus", "0", "--", "true")
    assert again.returncode == 0, again.stderr
    third = again.stdout.strip().splitlines()[-1].split()[0]
    assert box.daemon.record(third)["priority"] == 0 and box.daemon.record(third)["resumed_from"] == second

    # Root may resume it as it was (and alice, not its owner, may not touch it at all).
    assert box.obd(alice, "train", "resume", second).returncode != 0
    root = box.daemon.call("resume", id=second)
    assert root["priority"] == 5
