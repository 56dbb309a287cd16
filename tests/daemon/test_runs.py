"""A user's runs on this machine, end to end against a real daemon: start, status, logs, cancel, failures."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from tests.conftest import DaemonProc, wait_for
from trainer_plugin.tools import jobctl

PY = sys.executable


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_started_job_runs_detached_in_its_own_session_with_the_run_environment(daemon: DaemonProc) -> None:
    script = (
        "import os, json, time; "
        "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('OBD_') or k in ('PYTHONPATH', 'MY_VAR')}));"
        "print(json.dumps({'pgid': os.getpgid(0), 'sid': os.getsid(0), 'ppid': os.getppid()}), flush=True); time.sleep(30)"
    )
    rid = start(daemon, PY, "-c", script, opts=("--name", "detached", "--env", "MY_VAR=a b"))
    record = daemon.wait_state(rid, "running")
    rd = Path(record["remote_dir"])
    wait_for(lambda: (rd / "job.log").read_text().count("\n") >= 2, 20, what="the job's first lines")
    env_line, ids_line = (rd / "job.log").read_text().splitlines()[:2]
    env, ids = json.loads(env_line), json.loads(ids_line)
    handle = json.loads((rd / "job.pid").read_text())
    assert ids["pgid"] == ids["sid"] == handle["pid"]  # its own session and process group
    assert ids["ppid"] == handle["pid"] and handle["pid"] != daemon.proc.pid
    assert env["OBD_RUN_ID"] == rid and env["OBD_RUN_DIR"] == str(rd)
    assert env["OBD_OUTPUT_DIR"] == f"{rd}/output"
    assert env["OBD_SNAPSHOT_REQUEST"] == f"{rd}/snapshot.request"
    assert env["OBD_SNAPSHOT_FILE"] == f"{rd}/snapshot.json"
    assert env["OBD_METRICS_FILE"] == f"{rd}/metrics.jsonl"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == f"{rd}/plugin"
    assert env["MY_VAR"] == "a b"
    assert (rd / "plugin" / "trainer_plugin" / "tools" / "jobctl.py").exists()
    assert record["name"] == "detached" and record["target"] == "local"
    daemon.cli("train", "cancel", rid, "--wait")


def test_exit_0_is_succeeded_and_its_history_is_kept(daemon: DaemonProc) -> None:
    rid = start(daemon, "sh", "-c", "echo one; echo two")
    record = daemon.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded" and record["exit_code"] == 0
    assert [h["state"] for h in record["history"]] == ["preparing", "running", "succeeded"]
    out = daemon.cli("train", "status", rid, "--json")
    as_json = json.loads(out.stdout)
    for key in (
        "id",
        "state",
        "target",
        "remote_dir",
        "message",
        "snapshot",
        "resumed_from",
        "exit_code",
        "history",
        "progress",
    ):
        assert key in as_json
    listing = json.loads(daemon.cli("train", "list", "--json").stdout)
    assert [r["id"] for r in listing] == [rid]
    human = daemon.cli("train", "list").stdout
    assert rid in human and "succeeded" in human


def test_a_non_zero_exit_fails_naming_the_logs_and_quoting_the_last_lines(daemon: DaemonProc) -> None:
    rid = start(daemon, "sh", "-c", "echo starting; echo 'boom: the data file is corrupt' >&2; exit 3")
    record = daemon.wait_state(rid, "failed", "succeeded")
    assert record["state"] == "failed" and record["exit_code"] == 3
    assert f"obd train logs {rid}" in record["message"]
    assert "boom: the data file is corrupt" in record["message"]


def test_a_missing_python_module_gets_a_hint(daemon: DaemonProc) -> None:
    rid = start(daemon, PY, "-c", "import surely_not_a_module_obd")
    record = daemon.wait_state(rid, "failed", "succeeded")
    assert "install surely_not_a_module_obd" in record["message"]


def test_a_command_that_does_not_exist_fails_with_a_clear_message(daemon: DaemonProc) -> None:
    rid = start(daemon, "obd-no-such-command-xyz", "--flag")
    record = daemon.wait_state(rid, "failed", "succeeded")
    assert record["exit_code"] == 127
    assert "does not exist" in record["message"] or "not found" in record["message"]
    assert "obd-no-such-command-xyz" in record["message"]


def test_a_job_killed_by_sigkill_is_blamed_on_the_oom_killer_only_as_far_as_the_kernel_says(
    daemon: DaemonProc,
) -> None:
    rid = start(daemon, "sh", "-c", "kill -9 $$")
    record = daemon.wait_state(rid, "failed", "succeeded")
    assert record["exit_code"] == 128 + 9
    message = record["message"]
    assert "exit 137" in message and "killed by SIGKILL: " in message and "often" not in message
    # Here the kernel's log is read when it can be (no OOM kill in it: a kill -9), else "may be".
    readable = os.access("/dev/kmsg", os.R_OK)
    said = "not the kernel's OOM killer, as far as its log goes" if readable else "it may be the kernel's OOM killer"
    assert said in message, message


def test_logs_follow_streams_new_output_until_the_job_ends(daemon: DaemonProc) -> None:
    rid = start(daemon, "sh", "-c", "for i in 1 2 3 4 5; do echo line $i; sleep 0.3; done")
    out = daemon.cli("train", "logs", rid, "--follow", timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"line {i}" for i in range(1, 6)]
    assert daemon.record(rid)["state"] == "succeeded"


def test_logs_tail_shows_the_last_lines(daemon: DaemonProc) -> None:
    rid = start(daemon, "sh", "-c", "for i in $(seq 1 500); do echo line $i; done")
    daemon.wait_state(rid, "succeeded")
    out = daemon.cli("train", "logs", rid, "--tail", "3")
    assert out.stdout.splitlines() == ["line 498", "line 499", "line 500"]
    assert len(daemon.cli("train", "logs", rid).stdout.splitlines()) == 500


def test_cancel_terms_the_process_group_then_kills_what_ignores_it_after_the_grace(
    daemon: DaemonProc, short_tmp: Path
) -> None:
    marker = short_tmp / "child.pid"
    script = (
        "import os, signal, subprocess, sys, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"p = subprocess.Popen(['sleep', '300']); open({str(marker)!r}, 'w').write(str(p.pid)); "
        "print('ready', flush=True); time.sleep(300)"
    )
    rid = start(daemon, PY, "-c", script)
    daemon.wait_state(rid, "running")
    wait_for(marker.exists, 20, what="the job's child")
    child = int(marker.read_text())
    began = time.monotonic()
    out = daemon.cli("train", "cancel", rid, "--wait")
    took = time.monotonic() - began
    assert out.returncode == 0, out.stderr
    record = daemon.record(rid)
    assert record["state"] == "cancelled" and "by the user" in record["message"]
    assert took >= 1.5  # the grace (2 s in the test config) was given before KILL
    rd = Path(record["remote_dir"])
    assert json.loads((rd / "cancelled").read_text())["killed"] is True
    assert not os.path.exists(f"/proc/{child}") or open(f"/proc/{child}/stat").read().split()[2] == "Z"


def test_cancel_is_idempotent_and_never_signals_a_finished_job(daemon: DaemonProc) -> None:
    rid = start(daemon, "true")
    record = daemon.wait_state(rid, "succeeded")
    rd = Path(record["remote_dir"])
    out = daemon.cli("train", "cancel", rid)
    assert out.returncode == 1 and "already ended (succeeded)" in out.stderr  # as `stop` says it
    assert daemon.record(rid)["state"] == "succeeded"
    assert not (rd / "cancelling").exists()
    rid2 = start(daemon, "sleep", "60")
    daemon.wait_state(rid2, "running")
    first = daemon.cli("train", "cancel", rid2)
    second = daemon.cli("train", "cancel", rid2, "--wait")
    assert first.returncode == 0
    # The second waits for the first's cancel, or finds it done: never an error of its own.
    assert second.returncode == 0 or "already ended (cancelled)" in second.stderr, second.stderr
    assert daemon.record(rid2)["state"] == "cancelled"


def test_a_job_that_ends_on_term_within_the_grace_is_not_killed(daemon: DaemonProc) -> None:
    rid = start(daemon, "sleep", "60")
    record = daemon.wait_state(rid, "running")
    daemon.cli("train", "cancel", rid, "--wait")
    assert json.loads((Path(record["remote_dir"]) / "cancelled").read_text())["killed"] is False


def test_unknown_and_invalid_run_ids_are_refused_clearly(daemon: DaemonProc) -> None:
    out = daemon.cli("train", "status", "20990101-000000-abcdef")
    assert out.returncode == 1 and "no run" in out.stderr and "obd train list" in out.stderr
    for bad in ("../x", "/etc", "", "a/b", ".."):
        out = daemon.cli("train", "status", bad)
        assert out.returncode == 2, (bad, out.stderr)
        assert "invalid run id" in out.stderr


def test_without_a_daemon_the_client_exits_69_and_says_how_to_start_it(short_tmp: Path) -> None:
    d = DaemonProc(short_tmp)
    out = d.cli("train", "list")
    assert out.returncode == 69
    assert "obd daemon" in out.stderr and str(d.socket) in out.stderr


def test_bad_usage_exits_2(daemon: DaemonProc) -> None:
    assert daemon.cli("train", "start").returncode == 2
    assert daemon.cli("train", "start", "--env", "NOEQUALS", "--", "true").returncode == 2
    out = daemon.cli("train", "start", "--target", "nowhere", "--", "true")
    assert out.returncode == 2 and "unknown target" in out.stderr
    assert daemon.cli("train", "frobnicate").returncode == 2


def test_a_malformed_run_record_is_reported_by_position_and_the_others_are_served(daemon: DaemonProc) -> None:
    rid = start(daemon, "true")
    daemon.wait_state(rid, "succeeded")
    broken = daemon.state_dir / "runs" / "20200101-000000-bad000"
    broken.mkdir(parents=True)
    (broken / "run.json").write_text('{"id": "20200101-000000-bad000",\n "state": "running", "history": [\n')
    daemon.stop()
    daemon.start()
    runs = {r["id"]: r for r in daemon.call("list")}
    assert runs[rid]["state"] == "succeeded"
    assert runs["20200101-000000-bad000"]["state"] == "unreadable"
    assert "line 3" in runs["20200101-000000-bad000"]["message"]
    out = daemon.cli("train", "status", "20200101-000000-bad000")
    assert out.returncode == 1 and "malformed JSON at line 3" in out.stderr
    assert (broken / "run.json").read_text().endswith("[\n")  # left as it was


def test_the_client_does_not_import_torch_or_pydantic(daemon: DaemonProc) -> None:
    code = (
        "import sys; from daemon.cli.main import main; rc = main(['train', 'list', '--json']); "
        "bad = [m for m in ('torch', 'transformers', 'pydantic', 'anyio') if m in sys.modules]; "
        "sys.exit(10 if bad else rc)"
    )
    import subprocess

    out = subprocess.run([PY, "-c", code], env=daemon.env, capture_output=True, text=True, cwd=daemon.env["PYTHONPATH"])
    assert out.returncode == 0, out.stderr


def test_a_reused_pid_never_makes_a_dead_job_look_alive(short_tmp: Path) -> None:
    import subprocess

    other = subprocess.Popen(["sleep", "30"])
    try:
        real = jobctl.process_start_time(other.pid)
        assert jobctl.handle_alive({"pid": other.pid, "start_time": real, "boot_id": jobctl.boot_id()})
        # The same pid with another start time is another process: the job is gone.
        assert not jobctl.handle_alive({"pid": other.pid, "start_time": real - 1, "boot_id": jobctl.boot_id()})
        assert not jobctl.handle_alive({"pid": other.pid, "start_time": real, "boot_id": "another-boot"})
        rd = short_tmp / "run"
        rd.mkdir()
        (rd / "job.pid").write_text(json.dumps({"pid": other.pid, "start_time": real + 7}))
        assert jobctl.job_status(str(rd))["state"] == "lost"
    finally:
        other.kill()
        other.wait()


def test_a_job_whose_pid_was_reused_while_the_daemon_was_down_is_recorded_lost(daemon: DaemonProc) -> None:
    import subprocess

    rid = start(daemon, "sleep", "60")
    record = daemon.wait_state(rid, "running")
    rd = Path(record["remote_dir"])
    stored = daemon.state_dir / "runs" / rid / "run.json"
    # Saves are written off the event loop: wait for the one that holds the job's handle.
    wait_for(lambda: (json.loads(stored.read_text()).get("job") or {}).get("pid"), 30, 0.05, "the saved handle")
    daemon.kill()
    handle = json.loads((rd / "job.pid").read_text())
    os.killpg(handle["pid"], signal.SIGKILL)  # the job dies with its wrapper: no exit code
    impostor = subprocess.Popen(["sleep", "60"])  # a live process; its start time differs anyway
    try:
        data = json.loads(stored.read_text())
        data["job"]["pid"] = impostor.pid  # as if the kernel had handed the pid on
        stored.write_text(json.dumps(data))
        daemon.start()
        record = daemon.wait_state(rid, "failed")
        assert "lost" in record["message"]
    finally:
        impostor.kill()
        impostor.wait()


def test_logs_follow_on_a_terminal_shows_a_live_progress_line(daemon: DaemonProc) -> None:
    import pty
    import subprocess

    script = (
        "import json, os, time; f = open(os.environ['OBD_METRICS_FILE'], 'a'); "
        "f.write(json.dumps({'event': 'begin', 'time': time.time(), 'max_steps': 10, 'snapshots': True}) + '\\n'); f.flush(); "
        "[(f.write(json.dumps({'event': 'log', 'time': time.time(), 'step': s, 'loss': 1.5}) + '\\n'), f.flush(), time.sleep(0.3)) for s in range(1, 8)]; "
        "print('done', flush=True)"
    )
    rid = start(daemon, PY, "-c", script)
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [PY, "-m", "daemon.cli", "train", "logs", rid, "--follow"],
        env=daemon.env,
        stdout=follower,
        stderr=follower,
        cwd=daemon.env["PYTHONPATH"],
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(60) == 0
    os.close(leader)
    text = seen.decode(errors="replace")
    assert "/10 loss 1.5" in text and "[" in text  # the progress bar and line
    assert "done" in text


def test_processes_a_finished_job_left_behind_in_its_group_are_ended(daemon: DaemonProc, short_tmp: Path) -> None:
    marker = short_tmp / "stray.pid"
    rid = start(daemon, "sh", "-c", f"sleep 300 & echo $! > {marker}; exit 0")
    record = daemon.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded"
    stray = int(marker.read_text())
    wait_for(
        lambda: not os.path.exists(f"/proc/{stray}") or open(f"/proc/{stray}/stat").read().split()[2] == "Z",
        15,
        what="the stray sleep to be ended",
    )


def test_output_to_places_a_successful_runs_outputs_and_never_writes_into_a_full_directory(
    daemon: DaemonProc, tmp_path: Path
) -> None:
    job = 'mkdir -p "$OBD_OUTPUT_DIR/checkpoint-2" && echo w > "$OBD_OUTPUT_DIR/checkpoint-2/a.bin" && echo m > "$OBD_OUTPUT_DIR/model.bin"'
    dest = tmp_path / "placed"
    out = daemon.cli("train", "start", "--cwd", str(tmp_path), "--output-to", "placed", "--", "sh", "-c", job)
    rid = out.stdout.strip()
    daemon.wait_state(rid, "succeeded")
    assert (dest / "model.bin").read_text() == "m\n" and (dest / "checkpoint-2" / "a.bin").read_text() == "w\n"
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    out = daemon.cli("train", "start", "--cwd", str(tmp_path), "--output-to", "full", "--", "sh", "-c", job)
    rid = out.stdout.strip()
    daemon.wait_state(rid, "succeeded")
    assert sorted(p.name for p in full.iterdir()) == ["keep.txt"]
    assert "not placed" in daemon.cli("train", "logs", rid).stdout


def test_a_job_that_leaves_a_process_behind_is_reported_and_the_process_ended(daemon: DaemonProc) -> None:
    rid = daemon.call("start", command=["sh", "-c", "sleep 300 & echo started"])["id"]
    record = daemon.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded"
    assert "the job left 1 processes in its group" in record["message"], record["message"]
    pid = int(record["message"].split("pids ")[1].split(")")[0])
    wait_for(
        lambda: not os.path.exists(f"/proc/{pid}") or b"Z" in open(f"/proc/{pid}/stat", "rb").read().split(b")")[1][:3],
        10,
        0.1,
        "the stray to end",
    )
