"""GPUs given by config, and the queue: runs wait for the devices they asked for (issue 13)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

TWO_GPUS = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'


@pytest.fixture
def box(make_daemon) -> DaemonProc:
    d = make_daemon(TWO_GPUS)
    d.start()
    return d


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def log(d: DaemonProc, rid: str) -> str:
    return d.cli("train", "logs", rid).stdout


SHOW = 'echo "cuda=$CUDA_VISIBLE_DEVICES hip=$HIP_VISIBLE_DEVICES"; echo "$OBD_RUN_ID" >> "$LEDGER"; sleep 60'


def test_runs_get_their_own_gpus_and_a_third_waits_until_one_is_free(box: DaemonProc, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    env_opt = ("--env", f"LEDGER={ledger}")
    a, b, c = (start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt)) for _ in range(3))
    for rid in (a, b):
        box.wait_state(rid, "running")
    wait_for(lambda: all("cuda=" in log(box, r) for r in (a, b)), 20, 0.1, "the jobs to print their devices")
    seen = sorted(log(box, r).split()[0] for r in (a, b))
    assert seen == ["cuda=0", "cuda=1"]  # each sees only its own device
    third = box.record(c)
    assert third["state"] == "queued" and third["queue"]["position"] == 1
    assert "1 GPU" in third["queue"]["waiting_for"] and "0 of 2 free" in third["queue"]["waiting_for"]
    text = box.cli("train", "status", c).stdout
    assert "queued" in text
    box.call("cancel", id=a)
    box.wait_state(a, "cancelled")
    started = box.wait_state(c, "running", timeout=10)
    assert started["gpus"] == box.record(a)["gpus"]  # it got the device that was freed
    ended_a = next(h["time"] for h in box.record(a)["history"] if h["state"] == "cancelled")
    left_queue = next(h["time"] for h in started["history"] if h["state"] == "preparing")
    assert left_queue >= ended_a
    for rid in (b, c):
        box.call("cancel", id=rid)


def test_a_run_that_wants_both_gpus_waits_for_both(box: DaemonProc, tmp_path: Path) -> None:
    env_opt = ("--env", f"LEDGER={tmp_path / 'ledger'}")
    one = start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt))
    box.wait_state(one, "running")
    both = start(box, "sh", "-c", SHOW, opts=("--gpus", "2", *env_opt))
    assert box.record(both)["state"] == "queued"
    box.call("cancel", id=one)
    record = box.wait_state(both, "running", timeout=10)
    assert sorted(record["gpus"]) == ["0", "1"]
    wait_for(lambda: "cuda=0,1" in log(box, both), 20, 0.1, "the job to print its devices")
    box.call("cancel", id=both)


def test_a_run_without_gpus_takes_all_and_explicit_devices_are_honoured(box: DaemonProc, tmp_path: Path) -> None:
    env_opt = ("--env", f"LEDGER={tmp_path / 'ledger'}")
    whole = start(box, "sh", "-c", SHOW, opts=env_opt)
    assert sorted(box.wait_state(whole, "running")["gpus"]) == ["0", "1"]
    box.call("cancel", id=whole)
    box.wait_state(whole, "cancelled")
    second = start(box, "sh", "-c", SHOW, opts=("--gpus", "device=1", *env_opt))
    assert box.wait_state(second, "running")["gpus"] == ["1"]
    none = start(box, "sh", "-c", 'echo "cuda=[$CUDA_VISIBLE_DEVICES]"', opts=("--gpus", "0"))
    box.wait_state(none, "succeeded")
    assert "cuda=[]" in log(box, none)  # no device, and it did not wait for one
    box.call("cancel", id=second)
    bad = box.cli("train", "start", "--gpus", "3", "--", "true")
    assert bad.returncode == 2 and "only 2 GPUs" in bad.stderr
    bad = box.cli("train", "start", "--gpus", "7,", "--", "true")
    assert bad.returncode == 2 and "no device 7" in bad.stderr


def test_cancelling_a_queued_run_never_starts_it(box: DaemonProc, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    env_opt = ("--env", f"LEDGER={ledger}")
    holder = start(box, "sh", "-c", SHOW, opts=env_opt)
    box.wait_state(holder, "running")
    waiting = start(box, "sh", "-c", SHOW, opts=env_opt)
    out = box.cli("train", "stop", waiting)
    assert out.returncode == 1 and "queued" in out.stderr and "cancel" in out.stderr
    assert box.cli("train", "cancel", waiting).returncode == 0
    assert box.wait_state(waiting, "cancelled")["message"] == "cancelled by the user while queued"
    box.call("cancel", id=holder)
    box.wait_state(holder, "cancelled")
    wait_for(lambda: ledger.exists(), 10, 0.1, "the holder's line")
    assert waiting not in ledger.read_text()
    assert box.record(waiting)["job"] is None


def test_priority_then_the_user_with_fewest_gpus_goes_first(box: DaemonProc, tmp_path: Path) -> None:
    env_opt = ("--env", f"LEDGER={tmp_path / 'ledger'}")
    holder = start(box, "sh", "-c", SHOW, opts=env_opt)
    box.wait_state(holder, "running")
    low = start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt))
    high = start(box, "sh", "-c", SHOW, opts=("--gpus", "1", "--priority", "5", *env_opt))
    assert box.record(high)["queue"]["position"] == 1 and box.record(low)["queue"]["position"] == 2
    box.call("cancel", id=holder)
    for rid in (high, low):
        box.wait_state(rid, "running", timeout=10)
        box.call("cancel", id=rid)


def test_a_daemon_killed_with_runs_queued_and_running_starts_each_queued_run_exactly_once(
    box: DaemonProc, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    env_opt = ("--env", f"LEDGER={ledger}")
    running = [start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt)) for _ in range(2)]
    queued = [start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt)) for _ in range(3)]
    for rid in running:
        box.wait_state(rid, "running")
    box.kill()
    box.start()
    assert all(box.record(r)["state"] == "queued" for r in queued)
    for rid in running + queued:  # end them one by one: each queued run starts as a device frees
        box.wait_state(rid, "running", timeout=20)
        box.call("cancel", id=rid)
        box.wait_state(rid, "cancelled")
    lines = ledger.read_text().split()
    assert sorted(lines) == sorted(running + queued)  # each started exactly once
    box.kill()  # and once more, with nothing queued: nothing starts again
    box.start()
    assert sorted(ledger.read_text().split()) == sorted(running + queued)
    assert json.loads(box.cli("train", "list", "--json").stdout)


def test_targets_list_shows_the_gpus_and_what_holds_each(box: DaemonProc, tmp_path: Path) -> None:
    rid = start(box, "sh", "-c", SHOW, opts=("--gpus", "1", "--env", f"LEDGER={tmp_path / 'l'}"))
    box.wait_state(rid, "running")
    rows = json.loads(box.cli("targets", "list", "--json").stdout)
    [local] = [r for r in rows if r["name"] == "local"]
    assert [(g["id"], g["held_by"]) for g in local["gpus"]] == [("0", rid), ("1", None)]
    text = box.cli("targets", "list").stdout
    assert f"0:{rid}" in text and "1:free" in text
    box.call("cancel", id=rid)


def test_a_queued_runs_message_names_only_the_runs_that_still_hold_its_gpus(box: DaemonProc, tmp_path: Path) -> None:
    env_opt = ("--env", f"LEDGER={tmp_path / 'ledger'}")
    first, second = (start(box, "sh", "-c", SHOW, opts=("--gpus", "1", *env_opt)) for _ in range(2))
    for rid in (first, second):
        box.wait_state(rid, "running")
    both = start(box, "sh", "-c", SHOW, opts=("--gpus", "2", *env_opt))
    queued = box.record(both)
    assert first in queued["message"] and second in queued["message"]
    box.call("cancel", id=first)
    box.wait_state(first, "cancelled")

    def message_now() -> str | None:
        message = box.record(both)["message"]
        return message if first not in message else None

    message = wait_for(message_now, 10, 0.1, "the queued run's message to drop the run that ended")
    assert message == f"waiting for 2 GPUs: 1 of 2 free (held by {second})"
    assert box.record(both)["queue"]["waiting_for"] == message
    history = box.record(both)["history"]
    assert [h["state"] for h in history] == ["queued"]  # the message moved on; no line per change
    box.call("cancel", id=second)
    box.wait_state(both, "running", timeout=10)
    box.call("cancel", id=both)


def test_a_retry_waiting_out_its_backoff_says_so_once_in_its_history_and_queue(make_daemon) -> None:
    d = make_daemon(FAST_CONFIG + '\n[retry]\nbackoff = "30s"\n')
    d.start()
    # A progress bar's last state, drawn with carriage returns and colours, then a failure.
    bar = r"printf '\033[32m 50%%|#####     | 5/10\r100%%|##########| 10/10\033[0m\n'; exit 3"
    first = start(d, "sh", "-c", bar, opts=("--retry", "1"))
    retry = wait_for(lambda: d.record(first)["retried_by"], 20, 0.1, "the next attempt")
    failed = d.record(first)
    assert failed["message"].endswith("; last lines: 100%|##########| 10/10"), failed["message"]
    assert any(h["reason"].startswith("retrying (exit 3): attempt 2 of 2 is ") for h in failed["history"])
    record = d.record(retry)
    assert record["state"] == "queued" and record["not_before"]
    [entry] = record["history"]  # one line: queued, why and until when; never a `preparing` it was not in
    assert entry["state"] == "queued"
    assert entry["reason"].startswith(f"attempt 2 of 2 after {first} ended (exit 3): waiting until ")
    assert entry["reason"].endswith("(backoff)")
    assert record["queue"]["waiting_for"].startswith("waiting until ")  # the backoff, not GPUs
    text = d.cli("train", "status", retry).stdout
    assert text.count("attempt 2 of 2") == 2, text  # the message and the one history line
    d.call("cancel", id=retry)
    d.wait_state(retry, "cancelled")


def test_the_readmes_gpu_queue_lines_run_as_written(make_daemon, short_tmp: Path) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("### The GPUs and the queue", 1)[1].split("\n## ", 1)[0]
    toml = section.split("```toml\n", 1)[1].split("```", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    d = make_daemon(FAST_CONFIG + "\n" + toml)
    d.start()
    for script in ("train.py", "tokenize.py", "eval.py"):
        (short_tmp / script).write_text("import time; time.sleep(60)\n")
    ids = []
    for line in block.splitlines():
        words = line.split("#")[0].split()
        argv = [sys.executable, "-m", "daemon.cli", *(sys.executable if w == "python" else w for w in words[1:])]
        out = subprocess.run(argv, env=d.env, cwd=short_tmp, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"{line}: exit {out.returncode}: {out.stderr}"
        if "train start" in line:
            ids.append(out.stdout.strip())
    any_two, these_two, cpu_only, urgent = ids
    assert len(d.wait_state(any_two, "running")["gpus"]) == 2
    assert d.wait_state(cpu_only, "running")["gpus"] == []  # no GPU, no wait
    assert len(d.wait_state(urgent, "running")["gpus"]) == 1  # ahead of the run queued before it
    waiting = d.record(these_two)
    assert waiting["state"] == "queued" and "waiting for GPUs 0,2" in waiting["message"]
    assert "1 queued" in out.stdout  # the last line: `obd targets list`
    for rid in ids:
        d.call("cancel", id=rid)
