"""The shared box holds under one careless or hostile member (issue 33, items 1 and 2).

Root only: a root daemon shared by two throwaway users (tests/users.py). One member cannot freeze
the daemon for the others (a sweep of 1,000 cancelled while another user is answered), cannot
queue without bound (`[policy] max_queued_runs_per_user`), and cannot preempt everyone with
`--priority 100` (`[policy] max_priority`, per user and per group; root unlimited).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG
from tests.users import Box, User

pytestmark = users.needs_root_and_users
accounts = users.accounts

ONE_GPU = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'

# A client loop run as a user (their venv has only the client's modules): ping until the stop
# file appears, one line per answer.
PINGS = r"""
import sys, time
from pathlib import Path
from daemon.cli.client import Client
client = Client(Path(sys.argv[1]), timeout=600)
stop = Path(sys.argv[2])
while not stop.exists():
    client.call("ping")
    print("pong", flush=True)
    time.sleep(0.02)
"""


def _shared(make_daemon, short_tmp: Path, accounts, policy: str) -> Box:  # type: ignore[no-untyped-def]
    return users.shared_daemon(make_daemon, short_tmp, accounts, ONE_GPU + "\n[policy]\n" + policy)


def _hold_the_gpu(box: Box, user: User) -> str:
    """A run of `user` holding the one GPU, so that every run asking for it waits queued."""
    rid = box.start(user, "sleep", "600", opts=("--gpus", "1"))
    box.daemon.wait_state(rid, "running")
    return rid


def _members(box: Box, user: User, sweep: str) -> list[dict]:
    out = box.obd(user, "train", "list", "--sweep", sweep, "--json", timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


# --- queued runs: a cap per user --------------------------------------------------------------


@pytest.fixture
def capped(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield _shared(make_daemon, short_tmp, accounts, "max_queued_runs_per_user = 5\n")


def test_a_member_over_the_cap_of_queued_runs_is_refused_saying_the_cap_and_what_to_do(capped: Box) -> None:
    box, alice, bob = capped, capped.alice, capped.bob
    blocker = _hold_the_gpu(box, bob)
    out = box.obd(alice, "train", "sweep", "--gpus", "1", "--grid", "a=1,2,3,4,5", "--", "sleep", "{a}")
    assert out.returncode == 0, out.stderr  # five queued: the cap, not over it

    one_more = box.obd(alice, "train", "start", "--gpus", "1", "--", "true")
    assert one_more.returncode != 0
    said = one_more.stderr
    assert "5 runs queued" in said and "cap of 5 queued runs per user" in said, said
    assert "max_queued_runs_per_user" in said and "[policy]" in said, said  # where it is set, and by whom
    assert "administrator" in said and "obd train cancel" in said, said  # and what to do
    sweep = box.obd(alice, "train", "sweep", "--gpus", "1", "--grid", "a=6,7", "--", "sleep", "{a}")
    assert sweep.returncode != 0 and "its 2 runs would make 7" in sweep.stderr, sweep.stderr

    # Another member's queue is their own; root is not capped.
    assert box.obd(bob, "train", "start", "--gpus", "1", "--", "true").returncode == 0
    assert box.obd(bob, "train", "start", "--gpus", "1", "--", "true").returncode == 0
    for _ in range(6):
        assert box.daemon.call("start", command=["true"], gpus="1").get("state") == "queued"

    # What the message says to do works: cancelled, they make room again.
    sweep_id = out.stdout.strip()
    assert box.obd(alice, "train", "cancel", sweep_id, timeout=120).returncode == 0
    assert box.obd(alice, "train", "start", "--gpus", "1", "--", "true").returncode == 0
    box.obd(bob, "train", "cancel", blocker)


# --- one member's thousand runs hold no one up ---------------------------------------------------


@pytest.fixture
def plenty(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    yield _shared(make_daemon, short_tmp, accounts, "max_queued_runs_per_user = 2000\n")


def test_a_sweep_of_1000_is_cancelled_whole_while_another_members_pings_are_answered(
    plenty: Box, short_tmp: Path
) -> None:
    box, alice, bob = plenty, plenty.alice, plenty.bob
    blocker = _hold_the_gpu(box, bob)
    grid = "a=" + ",".join(str(i) for i in range(1000))
    made = box.obd(alice, "train", "sweep", "--gpus", "1", "--grid", grid, "--", "sleep", "{a}", timeout=300)
    assert made.returncode == 0, made.stderr
    sweep = made.stdout.strip()
    # Each member's list is their own runs, however many the other queued.
    listed = {u.name: box.obd(u, "train", "list", "--json", timeout=120) for u in (alice, bob)}
    assert [r["id"] for r in json.loads(listed[bob.name].stdout)] == [blocker], listed[bob.name].stderr
    assert len([r for r in json.loads(listed[alice.name].stdout) if r["sweep"] == sweep]) == 1000

    stop = short_tmp / "stop-pings"
    pinger = subprocess.Popen(  # type: ignore[call-overload]
        [f"{box.venv}/bin/python", "-c", PINGS, str(box.daemon.socket), str(stop)],
        env=box.env(bob),
        cwd=bob.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **box._as(bob),
    )
    answered_during: list[int] = []
    pongs: list[str] = []
    reader = threading.Thread(target=lambda: pongs.extend(pinger.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    try:
        first = len(pongs)
        cancel = box.obd(alice, "train", "cancel", sweep, "--json", timeout=600)
        answered_during.append(len(pongs) - first)
    finally:
        stop.touch()
        pinger.wait(60)
        reader.join(10)
    assert cancel.returncode == 0, cancel.stderr
    members = _members(box, alice, sweep)
    assert len(members) == 1000 and {m["state"] for m in members} == {"cancelled"}
    assert pinger.returncode == 0, pinger.stderr
    assert answered_during[0] > 0, "no ping of the other member was answered while the cancel ran"
    # ... and the other member's own run was never touched.
    assert box.daemon.record(blocker)["state"] == "running"
    box.obd(bob, "train", "cancel", blocker)


# --- priorities: the box's policy ----------------------------------------------------------------


@pytest.fixture
def ranked(make_daemon, short_tmp: Path, accounts) -> Iterator[Box]:
    bob = accounts[1]
    yield _shared(make_daemon, short_tmp, accounts, f"max_priority_users = {{ {bob.name} = 5 }}\n")


def test_a_member_may_not_give_a_priority_above_the_limit_the_admin_configured(ranked: Box, short_tmp: Path) -> None:
    box, alice, bob = ranked, ranked.alice, ranked.bob
    victim = _hold_the_gpu(box, bob)

    out = box.obd(alice, "train", "start", "--priority", "100", "--gpus", "1", "--", "true")
    assert out.returncode != 0
    said = out.stderr
    assert "--priority 100 refused" in said and "at most 0" in said, said
    assert "[policy]" in said and "max_priority" in said and "administrator" in said, said
    assert "--priority 0 or lower" in said, said
    assert box.daemon.record(victim)["state"] == "running"  # nothing was paused for it

    sweep = box.obd(alice, "train", "sweep", "--priority", "1", "--grid", "a=1,2", "--gpus", "1", "--", "true")
    assert sweep.returncode != 0 and "obd train sweep with --priority 1 refused" in sweep.stderr, sweep.stderr

    run_file = alice.home / "urgent.toml"
    run_file.write_text('command = ["true"]\ngpus = 1\npriority = 50\n')
    subprocess.run(["chown", f"{alice.uid}:{alice.gid}", str(run_file)], check=True)
    from_file = box.obd(alice, "train", "start", "-f", str(run_file))
    assert from_file.returncode != 0 and "--priority 50 refused" in from_file.stderr, from_file.stderr

    # Lower than the default is anyone's; a user the admin named gets their own limit.
    assert box.obd(alice, "train", "start", "--priority", "-5", "--gpus", "1", "--", "true").returncode == 0
    assert box.obd(bob, "train", "start", "--priority", "5", "--gpus", "1", "--", "true").returncode == 0
    over = box.obd(bob, "train", "start", "--priority", "6", "--gpus", "1", "--", "true")
    assert over.returncode != 0 and "at most 5" in over.stderr, over.stderr

    # Root is not limited.
    root = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "train", "start", "--priority", "100", "--gpus", "1", "--", "true"],
        env=box.daemon.env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=short_tmp,
    )
    assert root.returncode == 0, root.stderr
    box.obd(bob, "train", "cancel", victim)
