"""What the plugin does at every step: the request check at each step end and the metrics line of each Trainer log.

The step end with no request is one access() and the Trainer's usual log line is built by one
f-string; these tests hold both to what a user sees: a request written at any moment and by any
means is taken at the next step end, every line is strict JSON with non-finite numbers as null
(nested ones too), step logs close together are written together (at most LOG_BATCH_SECONDS
late, and always before a proof or the end), and tokens are counted exactly.
The callback itself runs in a child process (importing it patches transformers' Trainer).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.trainer_plugin.conftest import (
    PY,
    SCRIPTS,
    Job,
    RunDir,
    assert_exit_zero,
    read_jsonl,
    torchrun,
    wait_until,
)
from tests.trainer_plugin.test_distributed_trainer import final_steps
from trainer_plugin.plugin import metrics_file
from trainer_plugin.plugin.request_watch import REQUEST_RECHECK_SECONDS, RequestWatch

# A SnapshotCallback driven by hand through step ends, as the Trainer drives it. Between two
# step ends it sleeps STEP seconds (a real step releases the GIL in torch's ops, so the watch's
# thread runs) and runs the ACTIONS given as JSON ({"before_step": N, "do": ...}). WATCH is
# "inotify" (the default: the flag with a lookup every REQUEST_RECHECK_SECONDS), "flag-only"
# (no lookup for an hour: only the watch can see a request) or "lookup" (no inotify: one lookup
# at every step end). It prints, for each step end, whether the Trainer was told to save and
# stop, and the monotonic time each step end began and each action was done.
DRIVE_STEP_ENDS = """
import json, os, sys, threading, time
from transformers import TrainerControl, TrainerState, TrainingArguments
from trainer_plugin.plugin import callback as cb
from trainer_plugin.plugin.callback import SnapshotCallback
from trainer_plugin.plugin.runtime import RunEnv

run, actions, steps, step_seconds, watch = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
if watch == "lookup":
    cb.RequestWatch.start = staticmethod(lambda path: None)
elif watch == "flag-only":
    cb.REQUEST_RECHECK_SECONDS = 3600.0
request = os.path.join(run, "snapshot.request")
callback = SnapshotCallback(env=RunEnv.from_environ({"OBD_RUN_DIR": run}))
args = TrainingArguments(output_dir=run + "/output", report_to="none", use_cpu=True)
state, control = TrainerState(max_steps=1000), TrainerControl()
held, done = [], {}
def act(step):
    for action in actions:
        if action["before_step"] != step:
            continue
        if action["do"] == "rename":  # obd's way: a temporary file renamed into place
            with open(request + ".tmp", "w") as f:
                f.write(action["text"])
            os.replace(request + ".tmp", request)
        elif action["do"] == "echo":  # a person's way: echo TEXT > snapshot.request
            with open(request, "w") as f:
                f.write(action["text"])
        elif action["do"] == "touch":
            open(request, "w").close()
        elif action["do"] == "mkdir":
            os.mkdir(request)
        elif action["do"] == "hold-open":  # written, flushed and kept open: no event says so
            f = open(request, "w")
            f.write(action["text"])
            f.flush()
            held.append(f)
        done[step] = time.monotonic()

act(0)
callback.on_train_begin(args, state, control)
# The request's watch threads (the stop points' thread, interrupt.py, runs whatever the watch).
threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("obd-") and t.name != "obd-stop-points")
seen = []
for step in range(1, steps + 1):
    time.sleep(step_seconds)
    act(step)
    state.global_step = step
    began = time.monotonic()
    callback.on_step_end(args, state, control)
    seen.append([step, control.should_save, control.should_training_stop, began])
    if control.should_training_stop:
        break
try:
    callback.on_train_end(args, state, control)
except RuntimeError:  # a snapshot asked for and never saved (nothing saves here): expected
    pass
after = sorted(t.name for t in threading.enumerate() if t.name.startswith("obd-"))
print(json.dumps({"seen": seen, "pending": callback._pending, "done": done, "threads": threads, "after": after}))
"""


def drive_step_ends(
    run: RunDir, actions: list[dict[str, Any]], steps: int = 5, step_seconds: float = 0.002, watch: str = "inotify"
) -> dict[str, Any]:
    out = subprocess.run(
        [PY, "-c", DRIVE_STEP_ENDS, str(run.root), json.dumps(actions), str(steps), str(step_seconds), watch],
        env=run.env(obd=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def stops(result: dict[str, Any]) -> list[tuple[int, bool, bool]]:
    return [(step, save, stop) for step, save, stop, _began in result["seen"]]


def stop_step(result: dict[str, Any]) -> int:
    """The step whose end told the Trainer to save and stop (the last one driven)."""
    step, save, stop, _began = result["seen"][-1]
    assert save and stop, result
    return int(step)


def latest_step(result: dict[str, Any], written_before: int) -> int:
    """The first step end that began REQUEST_RECHECK_SECONDS after the action before `written_before`: the latest a request may be taken."""
    due = result["done"][str(written_before)] + REQUEST_RECHECK_SECONDS
    return next((step for step, _save, _stop, began in result["seen"] if began >= due), result["seen"][-1][0])


@pytest.mark.parametrize("how", ["rename", "echo"])
def test_without_inotify_a_request_written_between_two_steps_is_seen_at_the_next_step_end(
    run_dir: RunDir, how: str
) -> None:
    result = drive_step_ends(run_dir, [{"before_step": 3, "do": how, "text": "cost\n"}], watch="lookup")
    assert stops(result) == [(1, False, False), (2, False, False), (3, True, True)]
    assert result["pending"] == [3, "cost"]
    assert result["threads"] == []  # no watch: no thread


@pytest.mark.parametrize("how", ["rename", "echo"])
def test_the_watch_alone_sees_a_request_written_between_two_steps(run_dir: RunDir, how: str) -> None:
    # No lookup for an hour: only inotify's flag can make a step end read the request. It is
    # raised as soon as the watch's thread runs, which a real step lets it do at once.
    result = drive_step_ends(run_dir, [{"before_step": 3, "do": how, "text": "cost\n"}], steps=500, watch="flag-only")
    assert 3 <= stop_step(result) < 500
    assert result["pending"] == [stop_step(result), "cost"]
    assert result["threads"] == ["obd-request-watch"]
    assert result["after"] == []  # the thread ends with the training


@pytest.mark.parametrize("how", ["rename", "echo"])
def test_a_request_is_taken_at_the_latest_at_the_first_step_end_a_recheck_time_after_it_was_written(
    run_dir: RunDir, how: str
) -> None:
    result = drive_step_ends(run_dir, [{"before_step": 3, "do": how, "text": "cost\n"}], steps=500)
    assert 3 <= stop_step(result) <= latest_step(result, 3)
    assert result["pending"] == [stop_step(result), "cost"]


def test_a_request_no_event_tells_of_is_found_by_the_recheck(run_dir: RunDir) -> None:
    # Written and flushed into a file kept open, as a writer on another NFS client looks to this
    # kernel: inotify saw the empty file created, never its content. The recheck finds it.
    result = drive_step_ends(run_dir, [{"before_step": 3, "do": "hold-open", "text": "deadline"}], steps=500)
    assert 3 <= stop_step(result) <= latest_step(result, 3)
    assert result["pending"] == [stop_step(result), "deadline"]


@pytest.mark.parametrize("watch", ["inotify", "lookup"])
def test_an_empty_request_file_is_no_request_until_someone_writes_a_reason_into_it(run_dir: RunDir, watch: str) -> None:
    # The file is there from step 2 on, empty: a step end that looks must read what it holds.
    actions = [{"before_step": 2, "do": "touch"}, {"before_step": 4, "do": "echo", "text": "deadline"}]
    result = drive_step_ends(run_dir, actions, steps=500, watch=watch)
    if watch == "lookup":
        assert stop_step(result) == 4
    assert 4 <= stop_step(result) <= latest_step(result, 4)
    assert result["pending"] == [stop_step(result), "deadline"]


@pytest.mark.parametrize("watch", ["inotify", "lookup"])
def test_a_request_made_before_training_began_is_taken_at_the_first_step_end(run_dir: RunDir, watch: str) -> None:
    result = drive_step_ends(run_dir, [{"before_step": 0, "do": "rename", "text": "requested\n"}], watch=watch)
    assert stops(result) == [(1, True, True)]
    assert result["pending"] == [1, "requested"]


def test_a_directory_in_place_of_the_request_is_no_request_and_training_goes_on(run_dir: RunDir) -> None:
    result = drive_step_ends(run_dir, [{"before_step": 2, "do": "mkdir"}], steps=60)
    assert not any(stop for _step, _save, stop in stops(result))
    assert result["pending"] is None


def test_a_watch_whose_directory_is_gone_says_so_and_asks_for_a_look(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    watch = RequestWatch.start(str(run / "snapshot.request"))
    assert watch is not None
    watch.seen = False  # as a step end that looked
    run.rmdir()
    deadline = time.monotonic() + 10
    while watch.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not watch.alive
    assert watch.seen  # the step end looks, finds the queue dead, and looks up the name from then on
    watch.close()


# on_log as the Trainer calls it, once per logs dict given as JSON (NaN and Infinity allowed);
# "tensor" values become torch scalars and {"nested_tensor": x} a dict holding one.
DRIVE_LOGS = """
import json, math, sys
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments
from trainer_plugin.plugin.callback import SnapshotCallback
from trainer_plugin.plugin.runtime import RunEnv

def revive(value):
    if isinstance(value, dict) and set(value) == {"tensor"}:
        return torch.tensor(value["tensor"])
    if isinstance(value, dict):
        return {k: revive(v) for k, v in value.items()}
    if isinstance(value, list):
        return [revive(v) for v in value]
    return value

run, all_logs = sys.argv[1], json.loads(sys.argv[2])
callback = SnapshotCallback(env=RunEnv.from_environ({"OBD_RUN_DIR": run}))
args = TrainingArguments(output_dir=run + "/output", report_to="none", use_cpu=True)
state, control = TrainerState(max_steps=100), TrainerControl()
callback.on_train_begin(args, state, control)
for step, logs in enumerate(all_logs, start=1):
    state.global_step, state.num_input_tokens_seen = step, 10 * step
    callback.on_log(args, state, control, logs=revive(logs))
"""


def drive_logs(run: RunDir, all_logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = subprocess.run(
        [PY, "-c", DRIVE_LOGS, str(run.root), json.dumps(all_logs)],
        env=run.env(obd=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = run.metrics_path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    return [m for m in read_jsonl(run.metrics_path) if m["event"] != "begin"]


USUAL: dict[str, Any] = {"loss": 1.25, "grad_norm": 0.5, "learning_rate": 2e-4, "epoch": 0.25}


def test_the_trainers_usual_log_is_a_log_line_with_every_field_in_its_place(run_dir: RunDir) -> None:
    [line] = drive_logs(run_dir, [USUAL])
    assert list(line) == ["event", "time", "step", "loss", "learning_rate", "grad_norm", "epoch", "tokens"]
    assert line == {"event": "log", "time": line["time"], "step": 1, **USUAL, "tokens": 10}
    assert isinstance(line["time"], float)


def test_nan_and_infinite_values_of_a_trainer_log_become_null(run_dir: RunDir) -> None:
    logs: list[dict[str, Any]] = [
        {**USUAL, "loss": math.nan},
        {**USUAL, "grad_norm": math.inf},
        {**USUAL, "learning_rate": -math.inf, "epoch": {"tensor": math.nan}},
    ]
    lines = drive_logs(run_dir, logs)
    assert [(m["loss"], m["grad_norm"], m["learning_rate"], m["epoch"]) for m in lines] == [
        (None, 0.5, 2e-4, 0.25),
        (1.25, None, 2e-4, 0.25),
        (1.25, 0.5, None, None),
    ]


def test_a_nested_value_in_a_log_is_still_sanitised(run_dir: RunDir) -> None:
    logs = [
        {**USUAL, "per_layer": {"q": [1.0, math.nan], "k": {"tensor": 2.5}}},
        {"eval_loss": math.inf, "eval_parts": [{"tensor": [1.5]}, math.nan]},
    ]
    log, evaluation = drive_logs(run_dir, logs)
    assert log["per_layer"] == {"q": [1.0, None], "k": 2.5}
    assert (log["loss"], log["tokens"]) == (1.25, 10)
    assert evaluation["event"] == "metrics"
    assert evaluation["eval_loss"] is None and evaluation["eval_parts"] == [1.5, None]


def test_a_logged_key_named_event_or_time_never_replaces_the_lines_own(run_dir: RunDir) -> None:
    [line] = drive_logs(run_dir, [{**USUAL, "event": "mine", "time": "noon", "other": 3}])
    assert line["event"] == "log" and isinstance(line["time"], float)
    assert (line["loss"], line["other"]) == (1.25, 3)


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(
    st.floats(min_value=0, max_value=4e9),
    st.integers(min_value=0, max_value=10**12),
    st.integers(min_value=0, max_value=10**15),
    finite,
    finite,
    finite,
    finite,
)
def test_the_usual_log_line_is_byte_for_byte_what_the_general_encoder_writes(
    now: float, step: int, tokens: int, loss: float, rate: float, norm: float, epoch: float
) -> None:
    logs = {"loss": loss, "learning_rate": rate, "grad_norm": norm, "epoch": epoch}
    general = metrics_file.encode_line({"event": "log", "time": now, "step": step, **logs, "tokens": tokens})
    assert metrics_file.step_log_lines([(now, step, tokens, logs)], 0.0) == general


@pytest.mark.parametrize(
    "logs",
    [
        {**USUAL, "loss": math.nan},
        {**USUAL, "grad_norm": -math.inf},
        {**USUAL, "grad_norm": None},
        {**USUAL, "loss": True},
        {**USUAL, "loss": 1},
        {"loss": 1.0, "learning_rate": 1.0, "grad_norm": 1.0},
        {**USUAL, "extra": 1.0},
        {"loss": 1.0, "learning_rate": 1.0, "grad_norm": 1.0, "epochs": 1.0},
    ],
)
def test_any_other_log_is_written_as_the_general_encoder_writes_it(logs: dict[str, Any]) -> None:
    slots = {"event": "log", "time": 1.5, "step": 1, "loss": None, "learning_rate": None, "grad_norm": None}
    record = {**slots, "epoch": None, "tokens": 1, **logs}
    line = metrics_file.step_log_lines([(1.0, 1, 1, logs)], 0.5)
    assert line == metrics_file.encode_line(record)
    assert json.loads(line, parse_constant=reject) == {
        **record,
        **{k: v if v is None or math.isfinite(v) else None for k, v in logs.items()},
    }


def reject(constant: str) -> Any:
    raise AssertionError(f"{constant} is not strict JSON")


def test_a_numpy_float_in_the_usual_slots_is_written_as_a_plain_number() -> None:
    np = pytest.importorskip("numpy")
    logs = {**USUAL, "loss": np.float64(1.5), "grad_norm": np.float32(0.5)}
    line = json.loads(metrics_file.step_log_lines([(1.0, 1, 1, logs)], 0.0), parse_constant=reject)
    assert (line["loss"], line["grad_norm"]) == (1.5, 0.5)


# A job that logs one line and is killed at once (SIGKILL: no handler, no exit code of its own).
LOG_THEN_DIE = """
import os, signal, sys
from trainer_plugin.plugin.metrics_file import MetricsWriter, step_log_lines
writer = MetricsWriter(sys.argv[1])
writer.write("begin", max_steps=10, snapshots=True)
writer.write_line(step_log_lines([(1.0, 7, 70, {"loss": 0.5, "learning_rate": 0.1, "grad_norm": 1.0, "epoch": 1.0})], 0.0))
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_last_line_of_a_job_killed_right_after_logging_it_is_in_the_file(run_dir: RunDir) -> None:
    out = subprocess.run(
        [PY, "-c", LOG_THEN_DIE, str(run_dir.metrics_path)],
        env=run_dir.env(obd=False),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == -signal.SIGKILL, out.stderr
    lines = read_jsonl(run_dir.metrics_path)
    assert [m["event"] for m in lines] == ["begin", "log"]
    assert (lines[-1]["step"], lines[-1]["tokens"]) == (7, 70)


# The Trainer's step logs through a SnapshotCallback driven by hand, with LOG_BATCH_SECONDS at
# BATCH: what metrics.jsonl holds after each stage, then the end of the process as ARGV[2] says.
DRIVE_BATCH = """
import json, os, signal, sys, time
from transformers import TrainerControl, TrainerState, TrainingArguments
from trainer_plugin.plugin import callback as cb, runtime
from trainer_plugin.plugin.callback import SnapshotCallback
from trainer_plugin.plugin.runtime import RunEnv

runtime.LOG_BATCH_SECONDS = BATCH = 1.0
cb.RequestWatch.start = staticmethod(lambda path: None)  # a lookup at every step end: the request is seen at step 6
run, ending = sys.argv[1], sys.argv[2]
callback = SnapshotCallback(env=RunEnv.from_environ({"OBD_RUN_DIR": run}))
args = TrainingArguments(output_dir=run + "/output", report_to="none", use_cpu=True)
state, control = TrainerState(max_steps=100), TrainerControl()
callback.on_train_begin(args, state, control)
usual = {"loss": 1.0, "learning_rate": 0.1, "grad_norm": 1.0, "epoch": 0.5}

def steps_in_file():
    lines = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
    return [m["step"] for m in lines if m["event"] == "log"]

def step(n, log=True):
    state.global_step = n
    callback.on_step_end(args, state, control)
    if log or control.should_log:
        callback.on_log(args, state, control, logs=dict(usual))
        control.should_log = False

seen = {}
step(1)
seen["first"] = steps_in_file()
for n in (2, 3, 4):
    step(n)
seen["quick"] = steps_in_file()
time.sleep(BATCH + 0.2)
step(5, log=False)
seen["after_a_step_end_past_due"] = steps_in_file()
if ending == "snapshot":
    open(os.path.join(run, "snapshot.request"), "w").write("requested")
    step(6, log=False)
    seen["before_the_proof"] = steps_in_file()
    checkpoint = os.path.join(run, "output", "checkpoint-6")
    os.makedirs(checkpoint)
    open(os.path.join(checkpoint, "trainer_state.json"), "w").write("{}")
    callback.on_save(args, state, control)
    seen["with_the_proof"] = steps_in_file()
print(json.dumps(seen), flush=True)
step(7)
if ending == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
raise RuntimeError("the training script crashed")
"""


def drive_batch(run: RunDir, ending: str) -> tuple[dict[str, list[int]], list[int], subprocess.CompletedProcess[str]]:
    out = subprocess.run(
        [PY, "-c", DRIVE_BATCH, str(run.root), ending],
        env=run.env(obd=False),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.stdout.strip(), out.stderr[-3000:]
    final = [m["step"] for m in read_jsonl(run.metrics_path) if m["event"] == "log"]
    return json.loads(out.stdout), final, out


def test_step_logs_close_together_are_written_together_at_the_next_step_end_past_the_batch_time(
    run_dir: RunDir,
) -> None:
    seen, final, out = drive_batch(run_dir, "crash")
    assert seen["first"] == [1]  # the first log after a quiet spell is written at once
    assert seen["quick"] == [1]  # the next ones wait...
    assert seen["after_a_step_end_past_due"] == [1, 2, 3, 4]  # ...for a step end past the batch time
    # A script that dies of an exception keeps every line it logged, in order.
    assert "the training script crashed" in out.stderr and final == [1, 2, 3, 4, 7]


def test_the_snapshot_steps_log_line_is_in_the_file_before_its_proof(run_dir: RunDir) -> None:
    seen, _final, _out = drive_batch(run_dir, "snapshot")
    assert seen["before_the_proof"] == [1, 2, 3, 4]  # the snapshot step's log waits...
    assert seen["with_the_proof"] == [1, 2, 3, 4, 6]  # ...and is written before the proof
    assert json.loads((run_dir.root / "snapshot.json").read_text())["step"] == 6


def test_a_job_killed_outright_loses_at_most_the_batch_time_of_step_logs(run_dir: RunDir) -> None:
    seen, final, out = drive_batch(run_dir, "kill")
    assert out.returncode == -signal.SIGKILL
    assert final[: len(seen["after_a_step_end_past_due"])] == [1, 2, 3, 4]
    assert set(final) <= {1, 2, 3, 4, 7}


@pytest.mark.parametrize("trainer", ["stock", "own-tracker"])
def test_one_process_counts_each_steps_tokens_exactly_and_saves_the_count_with_the_snapshot(
    run_dir: RunDir, start_job: Callable[..., Job], tmp_path: Path, trainer: str
) -> None:
    argv = [PY, str(SCRIPTS / "plain_trainer.py"), "--output_dir", str(tmp_path / "mine"), "--report-hooks"]
    argv += ["--write-at", "3", "--write-file", f"{run_dir.request}=requested"]
    if trainer == "own-tracker":
        argv.append("--own-tracker")
    job = start_job(run_dir, argv, run_dir.env())
    assert_exit_zero(job, job.wait())
    # 4 samples of 8 features a step: counted in the Trainer's own call per micro-batch, which
    # leaves the model without hooks; a subclass with its own tracker gets a forward pre-hook.
    hooks = 0 if trainer == "stock" else 1
    assert f"forward pre-hooks on the model while training: {hooks}" in job.log_text()
    assert [(m["step"], m["tokens"]) for m in run_dir.logs()] == [(1, 32), (2, 64), (3, 96)]
    state = json.loads((run_dir.output / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["num_input_tokens_seen"] == 96


@pytest.mark.slow
def test_under_torchrun_a_request_written_from_outside_at_any_moment_stops_both_ranks_at_one_step(
    run_dir: RunDir, start_job: Callable[..., Job], tmp_path: Path
) -> None:
    argv = [*torchrun(tmp_path), str(SCRIPTS / "plain_trainer.py")]
    argv += ["--output_dir", str(tmp_path / "mine"), "--max_steps", "400", "--step-sleep", "0.02"]
    job = start_job(run_dir, argv, run_dir.env())
    wait_until(lambda: run_dir.last_step() >= 5, job, what="five logged steps")
    # Written from this process, by rename, while both ranks train: neither rank is told when.
    tmp = run_dir.root / "request.tmp"
    tmp.write_text("disk")
    os.replace(tmp, run_dir.request)
    assert_exit_zero(job, job.wait())
    proof = run_dir.proof()
    assert proof is not None and proof["reason"] == "disk" and 5 <= proof["step"] < 400
    step = proof["step"]
    assert final_steps(job.log_text()) == [(0, step), (1, step)]
    checkpoint = run_dir.output / f"checkpoint-{step}"
    assert (checkpoint / "rng_state_0.pth").is_file() and (checkpoint / "rng_state_1.pth").is_file()
    assert run_dir.last_step() == step
