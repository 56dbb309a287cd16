"""The run-directory contract as the plugin implements it: request parsing, proof, metrics lines, SIGTERM flag."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.trainer_plugin.conftest import REPO
from trainer_plugin.plugin import runtime
from trainer_plugin.plugin.metrics_file import MetricsWriter
from trainer_plugin.plugin.runtime import REASONS, RunEnv


def env_for(root: Path) -> RunEnv:
    return RunEnv.from_environ({"OBD_RUN_DIR": str(root)})


@pytest.mark.parametrize("word", REASONS)
def test_each_reason_word_of_the_spec_is_read_as_itself(tmp_path: Path, word: str) -> None:
    request = tmp_path / "snapshot.request"
    request.write_text(word + "\n")
    assert runtime.read_request(str(request)) == word


def test_a_missing_empty_or_blank_request_file_is_no_request(tmp_path: Path) -> None:
    request = tmp_path / "snapshot.request"
    assert runtime.read_request(str(request)) is None
    request.write_bytes(b"")
    assert runtime.read_request(str(request)) is None
    request.write_bytes(b" \n\t")
    assert runtime.read_request(str(request)) is None


@pytest.mark.parametrize("content", [b"please stop", b"DEADLINE", b"\xff\xfe", b"deadline cost"])
def test_any_other_non_empty_content_is_a_plain_requested(tmp_path: Path, content: bytes) -> None:
    request = tmp_path / "snapshot.request"
    request.write_bytes(content)
    assert runtime.read_request(str(request)) == "requested"


@given(st.binary(max_size=300))
def test_parsing_never_fails_and_agrees_with_the_daemon_on_every_content(data: bytes) -> None:
    from daemon.service.models import normalise_reason

    assert runtime.parse_request(data) == normalise_reason(data.decode("utf-8", "replace"))
    assert runtime.parse_request(data) in (None, *REASONS)


def test_a_fifo_in_place_of_the_request_is_no_request_and_never_blocks_the_step(tmp_path: Path) -> None:
    request = tmp_path / "snapshot.request"
    os.mkfifo(request)
    # Opening a FIFO with no writer would block; read_request must answer at once.
    result: list[str | None] = []
    reader = threading.Thread(target=lambda: result.append(runtime.read_request(str(request))), daemon=True)
    reader.start()
    reader.join(5)
    assert not reader.is_alive() and result == [None]


def test_reason_codes_round_trip_for_every_reason_and_zero_means_none() -> None:
    for word in REASONS:
        assert runtime.reason_from_code(runtime.reason_code(word)) == word
    assert runtime.reason_code(None) == 0 and runtime.reason_from_code(0) is None


def test_the_environment_defaults_every_path_inside_the_run_directory(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    assert env.active
    assert env.output_dir == str(tmp_path / "output")
    assert env.request_path == str(tmp_path / "snapshot.request")
    assert env.proof_path == str(tmp_path / "snapshot.json")
    assert env.metrics_path == str(tmp_path / "metrics.jsonl")
    assert not RunEnv.from_environ({}).active


def test_a_proof_names_exactly_output_checkpoint_step_and_is_valid_json(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    checkpoint = tmp_path / "output" / "checkpoint-7"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    proof = runtime.write_proof(env, 7, "disk", required=("trainer_state.json",))
    on_disk = json.loads((tmp_path / "snapshot.json").read_text())
    assert on_disk == proof
    assert set(on_disk) == {"checkpoint", "step", "time", "reason"}
    assert on_disk["checkpoint"] == "output/checkpoint-7" and on_disk["step"] == 7 and on_disk["reason"] == "disk"
    assert isinstance(on_disk["time"], float)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def test_no_proof_is_written_for_a_missing_or_incomplete_checkpoint(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    with pytest.raises(runtime.IncompleteCheckpoint):
        runtime.write_proof(env, 3, "requested")
    (tmp_path / "output" / "checkpoint-3").mkdir(parents=True)
    with pytest.raises(runtime.IncompleteCheckpoint):
        runtime.write_proof(env, 3, "requested", required=("trainer_state.json",))
    assert not (tmp_path / "snapshot.json").exists()


def test_an_unknown_reason_is_proven_as_requested(tmp_path: Path) -> None:
    (tmp_path / "output" / "checkpoint-1").mkdir(parents=True)
    assert runtime.write_proof(env_for(tmp_path), 1, "because")["reason"] == "requested"


def test_metrics_lines_are_valid_json_with_non_finite_numbers_as_null(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    writer.write("begin", max_steps=3, snapshots=True)
    writer.write("log", step=1, loss=math.nan, grad_norm=math.inf, learning_rate=-math.inf, epoch=torch.tensor(0.5))
    writer.write("log", step=2, loss=torch.tensor(float("nan")), nested={"a": [1.0, math.nan]})
    writer.close()
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # strict JSON: NaN would not parse back as null
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert records[0]["event"] == "begin" and isinstance(records[0]["time"], float)
    assert records[1]["loss"] is None and records[1]["grad_norm"] is None and records[1]["learning_rate"] is None
    assert records[1]["epoch"] == 0.5
    assert records[2]["loss"] is None and records[2]["nested"] == {"a": [1.0, None]}


def test_a_metrics_writer_without_a_path_writes_nothing(tmp_path: Path) -> None:
    writer = MetricsWriter(None)
    writer.write("begin", max_steps=1)
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_sigterm_only_sets_a_flag_while_installed_and_is_redelivered_if_never_handled() -> None:
    # In a child process: the redelivered SIGTERM must end it with the default action.
    code = (
        f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from trainer_plugin.plugin.runtime import SigtermFlag\n"
        "flag = SigtermFlag(); flag.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('alive', flag.pending, flush=True)\n"
        "flag.restore()\n"
        "print('not reached', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert out.stdout.split("\n")[0] == "alive True"
    assert "not reached" not in out.stdout
    assert out.returncode == -signal.SIGTERM


def test_a_consumed_sigterm_is_not_redelivered() -> None:
    code = (
        f"import os, signal, sys; sys.path.insert(0, {str(REPO)!r})\n"
        "from trainer_plugin.plugin.runtime import SigtermFlag\n"
        "flag = SigtermFlag(); flag.install()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "assert flag.consume() and not flag.consume()\n"
        "flag.restore()\n"
        "print('exited normally', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "exited normally"


def test_a_metrics_file_that_cannot_be_written_never_raises_into_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = MetricsWriter(str(tmp_path / "missing-dir" / "metrics.jsonl"))
    writer.write("begin", max_steps=1)
    writer.write("log", step=1)
    assert writer.path is None
    assert capsys.readouterr().err.count("cannot write") == 1


USUAL = {"loss": 1.0, "learning_rate": 0.1, "grad_norm": 1.0, "epoch": 0.5}


def logged_steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def test_a_step_log_that_waits_is_in_the_file_within_2_s_with_no_later_write(tmp_path: Path) -> None:
    import time

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    try:
        now = time.monotonic()
        writer.write_soon(now, 1, 10, dict(USUAL))  # the first: written at once
        writer.write_soon(now + 0.001, 2, 20, dict(USUAL))  # waits for a batch, then nothing comes
        assert logged_steps(path) == [1]
        deadline = time.monotonic() + 2.0
        while logged_steps(path) != [1, 2] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert logged_steps(path) == [1, 2]
    finally:
        writer.close()


def test_step_logs_appended_while_the_late_writer_writes_are_neither_lost_nor_doubled(tmp_path: Path) -> None:
    import time

    path = tmp_path / "metrics.jsonl"
    writer = MetricsWriter(str(path))
    steps = 3000
    try:
        # Logged as fast as a loop can: the late writer's thread takes batches from the list's
        # front while this thread appends to its end.
        for step in range(1, steps + 1):
            writer.write_soon(time.monotonic(), step, step, dict(USUAL))
            if step % 300 == 0:
                time.sleep(0.3)  # some batches are the thread's to write
    finally:
        writer.close()
    assert logged_steps(path) == list(range(1, steps + 1))


def test_a_child_forked_while_step_logs_wait_never_writes_them_a_second_time(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    # A DataLoader worker, or a script's own fork, that ends by the interpreter's usual exit
    # (atexit handlers included): only the parent writes the job's metrics.
    code = f"""
import os, sys, time
from trainer_plugin.plugin.metrics_file import MetricsWriter
writer = MetricsWriter({str(path)!r})
usual = {USUAL!r}
now = time.monotonic()
writer.write_soon(now, 1, 10, dict(usual))
writer.write_soon(now, 2, 20, dict(usual))
pid = os.fork()
if pid == 0:
    sys.exit(0)
os.waitpid(pid, 0)
writer.close()
print("done")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr
    assert logged_steps(path) == [1, 2]
