"""The shared daemon under one member's load (issue 33, item 1); prints the figures.

    .venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/bench/bench_fairness.py

Root only (throwaway users, tests/users.py). A root daemon with one GPU by config; one member
(alice) queues `SWEEPS` sweeps of `MEMBERS` runs each (`sleep 600 --gpus 1`: the first takes the
GPU, the rest wait queued), then cancels one sweep. Meanwhile another member (bob) and root each
ping, list (as `obd train list` asks: its table, a sweep's queued members folded where the code
under test folds them), start a CPU-only run (`--gpus 0`) and list again as `--json` asks (each
run: root's is 5,000; received, not decoded, as the command prints it) in a loop, on their own
connections.

Printed: how long each sweep took to make and the cancel took (a cancel still going after
OBD_BENCH_CANCEL_BUDGET seconds, default 300, is cut short: then how many members it cancelled);
the others' answer times (p50, p99, max) while the sweeps were made and while the cancel ran, and,
for comparison, the same calls with no load: before the sweeps (nothing queued) and between the
sweeps and the cancel (every run queued, nothing asked: OBD_BENCH_QUIET seconds each); with
OBD_BENCH_CALLS=FILE, every call under the load is added to FILE (a JSON line each, with the tree),
so that rounds can be pooled. The goal (issue 33): the others answered within 100 ms p99, a
sweep of 1,000 made or cancelled in about a second. OBD_BENCH_SWEEPS and OBD_BENCH_MEMBERS change
the load (5 x 1,000 by default).

The state directory is made under /tmp, or under OBD_TEST_TMP: measure on the file system your
state directory lives on (a start's time under the load is mostly its fsyncs waiting on the
journal's commits, which the sweep's files fill).

To compare two versions, run it from each tree with the same Python, in turns, on the same box
(the figures of a shared 2-core box move by 2x from one minute to the next):

    git archive OLD | tar -x -C /tmp/before && cd /tmp/before && /path/to/.venv/bin/python -m pytest \
        -m bench -s -p no:cacheprovider tests/bench/bench_fairness.py   # then the same in this tree
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import users
from tests.conftest import FAST_CONFIG, REPO, wait_for
from tests.users import Box

pytestmark = [pytest.mark.bench, users.needs_root_and_users]
accounts = users.accounts

SWEEPS = int(os.environ.get("OBD_BENCH_SWEEPS", "5"))
MEMBERS = int(os.environ.get("OBD_BENCH_MEMBERS", "1000"))
CANCEL_BUDGET = float(os.environ.get("OBD_BENCH_CANCEL_BUDGET", "300"))
# Seconds the others call alone before the sweeps (nothing queued) and between the sweeps and the
# cancel (everything queued, nothing under way): what their calls cost without the member's load.
QUIET = float(os.environ.get("OBD_BENCH_QUIET", "4"))


def _folds() -> str:
    """`fold` where the code under test folds a sweep's queued members in `obd train list`'s table."""
    from daemon.service.api import ListRunsRequest

    return "fold" if "fold" in ListRunsRequest.model_fields else "each"


def _config() -> str:
    config = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
    try:
        from daemon.service.config import Config
    except ImportError:  # the code under test is a release before the client/service split
        from daemon.config import Config  # type: ignore[no-redef]

    if "policy" in Config.model_fields:  # the code under test has the cap: room for the whole load
        config += f"\n[policy]\nmax_queued_runs_per_user = {SWEEPS * MEMBERS + 10}\n"
    return config


# A client loop run as a user (their venv has only the client's modules): ping, list, start a
# CPU-only run, each timed, until the stop file appears; one JSON line per call on stdout.
OTHERS = r"""
import json, os, sys, time
from pathlib import Path
from daemon.cli.client import Client
sock, stop = Path(sys.argv[1]), Path(sys.argv[2])
client = Client(sock, timeout=600)
env = {"PATH": "/usr/bin:/bin"}
table = {"fold": True} if sys.argv[3] == "fold" else {}  # `obd train list` asks for its table
ops = [("ping", "ping", {}), ("list", "list", table), ("start", "start", {"command": ["true"], "gpus": "0",
       "environ": env, "client_cwd": os.getcwd()}), ("list --json", "list", {})]
raw = {"list --json"}  # printed as the daemon encoded it, never decoded (daemon/cli/main.py `_list`)
i = 0
while not stop.exists():
    label, op, params = ops[i % len(ops)]
    i += 1
    began = time.time()
    t = time.perf_counter()
    try:
        (client.call_raw if label in raw else client.call)(op, **params)
        ok = True
    except Exception as exc:
        ok = False
        print(json.dumps({"error": str(exc)[:200]}), file=sys.stderr, flush=True)
    print(json.dumps({"op": label, "at": began, "s": time.perf_counter() - t, "ok": ok}), flush=True)
    time.sleep(0.05)
"""

# The member's load: SWEEPS sweeps made, then the first cancelled; one JSON object on stdout.
SWEEPER = r"""
import json, os, sys, time
from pathlib import Path
from daemon.cli.client import Client
sock, sweeps, members, budget = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
quiet = float(sys.argv[5])
client = Client(sock, timeout=3600)
env = {"PATH": "/usr/bin:/bin"}
out = {"made": [], "sweeps": []}
out["idle_from"] = time.time()
time.sleep(quiet)  # the others alone: their answers with nothing queued
out["idle_to"] = out["made_from"] = time.time()
for n in range(sweeps):
    t = time.perf_counter()
    made = client.call("sweep", command=["sleep", "600", "{a}"], gpus="1", environ=env, client_cwd=os.getcwd(),
                       name=f"load{n}", grid=[{"name": "a", "values": [str(i) for i in range(members)]}])
    out["made"].append(time.perf_counter() - t)
    out["sweeps"].append(made["sweep"])
out["made_to"] = out["held_from"] = time.time()
time.sleep(quiet)  # the others with every run queued and nothing under way
out["held_to"] = out["cancel_from"] = time.time()
victim = out["sweeps"][-1]
canceller = Client(sock, timeout=budget)
t = time.perf_counter()
try:
    canceller.call("cancel", id=victim)
    out["cancel_done"] = True
except Exception as exc:
    out["cancel_done"] = False
    out["cancel_error"] = str(exc)[:300]
out["cancel_s"] = time.perf_counter() - t
out["cancel_to"] = time.time()
rows = Client(sock, timeout=3600).call("list", sweep=victim)
out["cancelled"] = sum(r["state"] == "cancelled" for r in rows)
out["members"] = len(rows)
print(json.dumps(out), flush=True)
"""


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] if ordered else float("nan")


def _line(calls: list[dict], lo: float, hi: float) -> str:
    times = [c["s"] for c in calls if lo <= c["at"] <= hi]
    failed = sum(1 for c in calls if lo <= c["at"] <= hi and not c["ok"])
    if not times:
        return "no calls"
    return (
        f"{len(times)} calls, p50 {pct(times, 50) * 1000:.1f} ms, p99 {pct(times, 99) * 1000:.1f} ms, "
        f"max {max(times) * 1000:.1f} ms, {failed} failed"
    )


@pytest.fixture
def steps_file(short_tmp: Path) -> Path:
    return short_tmp / "loop-steps.jsonl"


@pytest.fixture
def box(make_daemon, short_tmp: Path, accounts, steps_file: Path) -> Iterator[Box]:
    # The daemon's loop timed step by step (tests/bench/loop_steps), where the code under test can be.
    hook = REPO / "tests" / "bench" / "loop_steps"
    env = {"OBD_BENCH_STEPS": str(steps_file), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"} if hook.is_dir() else None
    yield users.shared_daemon(make_daemon, short_tmp, accounts, _config(), env=env)


def _loop_steps(steps_file: Path, loaded: list[tuple[float, float]]) -> list[str]:
    """What the daemon's event loop was held for while the load ran: its steps of 10 ms of CPU or
    more (the loop thread's own time: the box's other work does not count), and where the
    longest stopped."""
    if not steps_file.exists():
        return ["(the daemon's loop was not timed: this tree has no tests/bench/loop_steps)"]
    steps = [json.loads(line) for line in steps_file.read_text().splitlines() if line.strip()]
    held = [s for s in steps if s["cpu"] >= 0.010 and any(lo <= s["at"] <= hi for lo, hi in loaded)]
    seconds = sum(hi - lo for lo, hi in loaded)
    cpu = sorted(s["cpu"] * 1000 for s in held)
    lines = [
        f"daemon's event loop under the load ({seconds:.1f} s): {len(held)} steps of >= 10 ms of its CPU, "
        + (f"p50 {pct(cpu, 50):.1f} ms, max {cpu[-1]:.1f} ms, {sum(cpu):.0f} ms in all" if cpu else "none")
    ]
    places: dict[str, list[float]] = {}
    for s in held:
        places.setdefault(s["where"], []).append(s["cpu"] * 1000)
    for where, times in sorted(places.items(), key=lambda p: -sum(p[1]))[:5]:
        lines.append(f"  {len(times)} x, {sum(times):.0f} ms, max {max(times):.1f} ms: {where}")
    return lines


def test_others_are_answered_while_one_member_queues_and_cancels_thousands_of_runs(
    box: Box, short_tmp: Path, steps_file: Path
) -> None:
    stop = short_tmp / "stop"
    sock = str(box.daemon.socket)
    bob_env = box.env(box.bob)
    others = [
        subprocess.Popen(  # type: ignore[call-overload]
            [f"{box.venv}/bin/python", "-c", OTHERS, sock, str(stop), _folds()],
            env=bob_env,
            cwd=box.bob.home,
            stdout=subprocess.PIPE,
            text=True,
            **box._as(box.bob),
        ),
        subprocess.Popen(
            [sys.executable, "-c", OTHERS, sock, str(stop), _folds()],
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=short_tmp,
            stdout=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        sweeper = subprocess.run(  # type: ignore[call-overload]
            [f"{box.venv}/bin/python", "-c", SWEEPER, sock, str(SWEEPS), str(MEMBERS), str(CANCEL_BUDGET), str(QUIET)],
            env=box.env(box.alice),
            cwd=box.alice.home,
            capture_output=True,
            text=True,
            timeout=SWEEPS * MEMBERS + CANCEL_BUDGET + 600,
            **box._as(box.alice),
        )
    finally:
        stop.touch()
        outs = [p.communicate(timeout=600)[0] for p in others]
    assert sweeper.returncode == 0, sweeper.stderr[-3000:]
    load = json.loads(sweeper.stdout.strip().splitlines()[-1])
    bob_calls, root_calls = ([json.loads(x) for x in out.splitlines() if x.strip()] for out in outs)
    print()
    print(f"== fairness under load ({'old' if 'policy' not in _config() else 'this'} code, {REPO})")
    print(
        f"alice made {SWEEPS} sweeps of {MEMBERS}: "
        + ", ".join(f"{s:.2f} s" for s in load["made"])
        + f" (mean {sum(load['made']) / len(load['made']):.2f} s)"
    )
    done = "done" if load["cancel_done"] else f"cut short after {CANCEL_BUDGET:g} s ({load.get('cancel_error')})"
    print(
        f"alice's cancel of one sweep of {MEMBERS} (with {SWEEPS * MEMBERS} queued): {load['cancel_s']:.2f} s, {done}; "
        f"{load['cancelled']} of {load['members']} cancelled when it returned"
    )
    for who, calls in (("bob (member)", bob_calls), ("root", root_calls)):
        print(f"{who} before, nothing queued:     {_line(calls, load['idle_from'], load['idle_to'])}")
        print(f"{who} all queued, nothing asked:  {_line(calls, load['held_from'], load['held_to'])}")
        print(f"{who} while the sweeps were made: {_line(calls, load['made_from'], load['made_to'])}")
        print(f"{who} while the cancel ran:      {_line(calls, load['cancel_from'], load['cancel_to'])}")
    everyone = bob_calls + root_calls
    loaded = [(load["made_from"], load["made_to"]), (load["cancel_from"], load["cancel_to"])]

    def under_load(calls: list[dict]) -> list[dict]:
        return [c for c in calls if any(lo <= c["at"] <= hi for lo, hi in loaded)]

    print(f"others, all calls under the member's load: {_line(under_load(everyone), 0, float('inf'))}")
    # `list` is `obd train list`'s table (a sweep's queued members folded, where the code does);
    # `list --json` is each run: root's is every active run, 5,000 of them.
    for op in ("ping", "list", "start", "list --json"):
        for who, calls in (("bob", bob_calls), ("root", root_calls)):
            mine = [c for c in calls if c.get("op") == op]
            print(f"  {who} {op} under load: {_line(under_load(mine), 0, float('inf'))}")
            print(f"  {who} {op} all queued, nothing asked: {_line(mine, load['held_from'], load['held_to'])}")
    for line in _loop_steps(steps_file, loaded):
        print(line)
    if os.environ.get("OBD_BENCH_CALLS"):  # every call under the load, to pool rounds: one JSON line each
        with open(os.environ["OBD_BENCH_CALLS"], "a") as out:
            for who, calls in (("bob", bob_calls), ("root", root_calls)):
                for call in under_load(calls):
                    out.write(json.dumps({"tree": str(REPO), "who": who, **call}) + "\n")
    # Whatever the figures: the daemon still answers, and the cancel's members end cancelled.
    if load["cancel_done"]:
        assert load["cancelled"] == load["members"] == MEMBERS
    wait_for(box.daemon.ready, 600, 0.5, "the daemon to answer after the load")
