"""The `obd` command as people use it: exit codes, help, completion, usage errors, the list, `--wait`.

Every test runs the installed `obd` command (the console script of the venv) against a real
daemon, with real jobs, in a pipe or on a real pseudo-terminal where that is what changes.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
OBD = Path(sys.executable).with_name("obd")
# A job that speaks the snapshot protocol: it announces the plugin, logs a step every 0.2 s and,
# on a request, writes its checkpoint and proof after PROOF_DELAY s and exits LINGER s later.
SNAPSHOT_JOB = r"""
import json, os, sys, time
env = os.environ
delay, linger = float(sys.argv[1]), float(sys.argv[2])
def metric(**line):
    with open(env["OBD_METRICS_FILE"], "a") as f:
        f.write(json.dumps(line) + "\n")
metric(event="begin", time=time.time(), max_steps=1000, snapshots=True, version="test")
for step in range(1, 100000):
    time.sleep(0.2)
    print(f"step {step}", flush=True)
    metric(event="log", step=step, loss=1.0 / step, time=time.time())
    if os.path.exists(env["OBD_SNAPSHOT_REQUEST"]):
        time.sleep(delay)
        checkpoint = os.path.join(env["OBD_RUN_DIR"], "output", f"checkpoint-{step}")
        os.makedirs(checkpoint)
        with open(os.path.join(checkpoint, "model.bin"), "wb") as f:
            f.write(b"w" * 2_500_000)
        proof = {"checkpoint": f"output/checkpoint-{step}", "step": step, "time": time.time(), "reason": "requested"}
        with open(env["OBD_SNAPSHOT_FILE"] + ".tmp", "w") as f:
            json.dump(proof, f)
        os.replace(env["OBD_SNAPSHOT_FILE"] + ".tmp", env["OBD_SNAPSHOT_FILE"])
        print("proof written", flush=True)
        time.sleep(linger)
        sys.exit(0)
"""
HEAVY = {"structlog", "pydantic", "anyio", "torch", "matplotlib", "numpy", "asyncssh", "runpod", "transformers"}


def obd(
    d: DaemonProc, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """The installed `obd` command, talking to `d`."""
    return subprocess.run(
        [str(OBD), *args], env={**d.env, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = obd(d, "train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def snapshot_job(d: DaemonProc, tmp: Path, delay: float = 0.0, linger: float = 0.0, name: str | None = None) -> str:
    script = tmp / "snapshot_job.py"
    script.write_text(SNAPSHOT_JOB)
    rid = start(d, PY, str(script), str(delay), str(linger), opts=("--name", name) if name else ())
    wait_for(
        lambda: (r := d.record(rid))["snapshots"] and (r["progress"]["step"] or 0) >= 1, 60, 0.1, "the job's first step"
    )
    return rid


@pytest.fixture
def fast(make_daemon) -> DaemonProc:
    d = make_daemon(FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "4s"'))
    d.start()
    return d


def on_terminal(
    argv: list[str], env: dict[str, str], until: float, stdin_signal: int | None = None
) -> tuple[int, str, str]:
    """Run `argv` with its stderr (and, with `stdout_tty`, its stdout) on a pseudo-terminal; return
    (exit code, what the terminal showed, stdout)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=slave, cwd=REPO)
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + until
    while proc.poll() is None and time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                shown += os.read(master, 65536)
            except OSError:
                break
    if proc.poll() is None and stdin_signal is not None:
        proc.send_signal(stdin_signal)
    out, _ = proc.communicate(timeout=60)
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if not ready:
            break
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return proc.returncode, shown.decode(errors="replace"), out.decode(errors="replace")


# --- exit codes that tell the truth ------------------------------------------------------------


def test_logs_follow_exits_with_the_code_of_the_state_the_run_ended_in(fast: DaemonProc, short_tmp: Path) -> None:
    ok = start(fast, "sh", "-c", "echo fine")
    assert obd(fast, "train", "logs", ok, "--follow").returncode == 0

    bad = start(fast, "sh", "-c", "echo broken; exit 3")
    out = obd(fast, "train", "logs", bad, "--follow")
    assert out.returncode == 6 and out.stdout == "broken\n"
    assert f"obd: {bad}: failed: exit 3" in out.stderr  # the job's own exit code, said once

    slow = start(fast, "sleep", "60")
    follow = subprocess.Popen(
        [str(OBD), "train", "logs", slow, "-f"], env=fast.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    fast.wait_state(slow, "running")
    assert obd(fast, "train", "cancel", slow).returncode == 0
    assert follow.wait(30) == 3  # cancelled

    snap = snapshot_job(fast, short_tmp)
    follow = subprocess.Popen(
        [str(OBD), "train", "logs", snap, "-f"], env=fast.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert obd(fast, "train", "stop", snap, "--wait").returncode == 0  # stopped with its snapshot
    assert follow.wait(30) == 5  # stopped: resumable, not finished
    assert b"proof written" in follow.communicate()[0]


def test_cancel_wait_exits_0_once_cancelled_and_a_run_that_ended_first_is_refused_as_stop_refuses_it(
    fast: DaemonProc,
) -> None:
    slow = start(fast, "sleep", "60")
    fast.wait_state(slow, "running")
    out = obd(fast, "train", "cancel", slow, "--wait")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{slow}: cancelled by the user"  # the state said once

    done = start(fast, "true")
    fast.wait_state(done, "succeeded")
    failed = start(fast, "false")
    fast.wait_state(failed, "failed")
    for rid, state in ((done, "succeeded"), (failed, "failed"), (slow, "cancelled")):
        stop = obd(fast, "train", "stop", rid)
        assert stop.returncode == 1 and f"run {rid} already ended ({state})" in stop.stderr
        for wait in ((), ("--wait",)):
            out = obd(fast, "train", "cancel", rid, *wait)
            assert (out.returncode, out.stdout, out.stderr.splitlines()) == (1, "", stop.stderr.splitlines())


def test_logs_follow_waits_out_a_daemon_restart_and_goes_on_where_it_was(fast: DaemonProc) -> None:
    rid = start(fast, "sh", "-c", "for i in $(seq 1 40); do echo line $i; sleep 0.15; done")
    follow = subprocess.Popen(
        [str(OBD), "train", "logs", rid, "--follow"],
        env=fast.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = Path(fast.wait_state(rid, "running")["remote_dir"]) / "job.log"
    wait_for(lambda: log.exists() and "line 5" in log.read_text(), 30, 0.05, "line 5")
    fast.stop()  # SIGTERM: the daemon goes, the job runs on
    time.sleep(1.5)
    fast.start()
    out, err = follow.communicate(timeout=90)
    assert follow.returncode == 0, err
    assert out.splitlines() == [f"line {i}" for i in range(1, 41)]  # nothing lost, nothing twice
    assert "lost the daemon" in err and "the daemon answers again" in err


def test_stop_wait_waits_out_a_daemon_restart(fast: DaemonProc, short_tmp: Path) -> None:
    rid = snapshot_job(fast, short_tmp, delay=3.0)
    wait = subprocess.Popen(
        [str(OBD), "train", "stop", rid, "--wait", "--json"],
        env=fast.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    noted = "snapshot requested (requested) by `obd train stop`"
    wait_for(lambda: any(h["reason"] == noted for h in fast.record(rid)["history"]), 30, 0.05, "the request")
    time.sleep(0.5)  # its answer on its way: the client now waits
    fast.stop()
    fast.start()
    out, err = wait.communicate(timeout=90)
    assert wait.returncode == 0, err
    record = json.loads(out)
    assert record["state"] == "stopped" and record["snapshot"]["checkpoint"].startswith("output/checkpoint-")


def test_the_exit_codes_in_obd_help_are_the_readmes(fast: DaemonProc) -> None:
    help_codes = re.findall(r"^  (\d+)\s{2,}(.+)$", obd(fast, "--help").stdout, re.M)
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| exit code |") :].split("\n\n")[0]
    readme_codes = re.findall(r"^\| `(\d+)` \|", table, re.M)
    assert [code for code, _ in help_codes] == readme_codes
    assert {"0", "2", "3", "4", "5", "6", "69", "141"} <= set(readme_codes)


# --- help on everything -------------------------------------------------------------------------


def _walk(parser: Any, path: str = "obd") -> Iterator[tuple[str, Any]]:
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {pseudo.dest: pseudo.help for pseudo in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", helps.get(name)
                yield from _walk(sub, f"{path} {name}")
        else:
            yield f"{path} {'/'.join(action.option_strings) or action.metavar or action.dest}", action.help


def test_every_command_and_every_flag_has_a_one_line_help() -> None:
    from daemon.cli.main import _parser
    from daemon.service.pods_admin import build_parser

    found = list(_walk(_parser()))
    assert len(found) > 100
    missing = [where for where, text in found if not text or text == "==SUPPRESS=="]
    assert missing == []
    # `obd pods` parses its own options (daemon/service/pods_admin.py): its commands have help too.
    assert all(text for where, text in _walk(build_parser(), "obd pods") if where.count(" ") == 2 and "-" not in where)


@pytest.mark.parametrize("command", [(), ("train",), ("train", "start"), ("train", "list"), ("train", "stop")])
def test_help_reads_on_an_80_column_terminal(fast: DaemonProc, command: tuple[str, ...]) -> None:
    out = obd(fast, *command, "--help", env={"COLUMNS": "80"})
    assert out.returncode == 0
    long = [line for line in out.stdout.splitlines() if len(line) > 80]
    assert long == []
    assert "rest" not in out.stdout.split()


def test_start_stop_and_resume_show_examples_and_profile_parse_names_its_directory(fast: DaemonProc) -> None:
    for action in ("start", "stop", "resume"):
        text = obd(fast, "train", action, "--help").stdout
        assert "examples:" in text and f"obd train {action} " in text.split("examples:")[1]
    assert "DIR" in obd(fast, "profile", "parse", "--help").stdout


def test_version_names_obd_and_the_plugin_the_jobs_run(fast: DaemonProc) -> None:
    from trainer_plugin.plugin.runtime import VERSION

    out = obd(fast, "--version")
    assert out.returncode == 0
    assert re.match(r"^obd \d+\.\d+\.\d+ \(package obd-train\)$", out.stdout.splitlines()[0])
    assert f"trainer_plugin {VERSION}" in out.stdout


# --- shell completion ---------------------------------------------------------------------------


def test_the_completion_scripts_are_generated_from_the_parsers_and_printed_by_obd_completion(fast: DaemonProc) -> None:
    check = subprocess.run([PY, "scripts/make_completions.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for shell, name in (("bash", "obd.bash"), ("zsh", "_obd"), ("fish", "obd.fish")):
        out = obd(fast, "completion", shell)
        assert out.returncode == 0 and out.stdout == (REPO / "daemon" / "cli" / "completions" / name).read_text()
    assert obd(fast, "completion", "tcsh").returncode == 2


def _shell_env(d: DaemonProc) -> dict[str, str]:
    return {**d.env, "PATH": f"{OBD.parent}:{os.environ['PATH']}"}


def test_bash_completes_commands_flags_choices_and_run_names(fast: DaemonProc) -> None:
    rid = start(fast, "true", opts=("--name", "sft-base"))
    fast.wait_state(rid, "succeeded")
    script = REPO / "daemon" / "cli" / "completions" / "obd.bash"
    probe = (
        f"source {script}\n"
        'c() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _obd; '
        'echo "${COMPREPLY[*]}"; }\n'
        "c obd train st\nc obd train start --ta\nc obd train list --state ru\nc obd train logs ''\n"
        "c obd --socket /x train stop sft-base --reason d\nc obd completion ''\n"
    )
    out = subprocess.run(["bash", "-c", probe], env=_shell_env(fast), capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["start", "stop", "status"]
    assert lines[1] == "--target"
    assert lines[2] == "running"
    assert {"last", rid, "sft-base"} <= set(lines[3].split())
    assert lines[4].split() == ["deadline", "disk"]
    assert lines[5].split() == ["bash", "zsh", "fish"]


@pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed here (apt-get install fish)")
def test_fish_completes_commands_with_their_help_and_a_jobs_own_command_after_the_double_dash(fast: DaemonProc) -> None:
    rid = start(fast, "true", opts=("--name", "sft-base"))
    fast.wait_state(rid, "succeeded")
    script = REPO / "daemon" / "cli" / "completions" / "obd.fish"

    def complete(line: str) -> list[str]:
        out = subprocess.run(
            ["fish", "--no-config", "-c", f"source {script}; complete -C {json.dumps(line)}"],
            env=_shell_env(fast),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stderr == ""
        return out.stdout.splitlines()

    assert [c.split("\t")[0] for c in complete("obd train st")] == ["start", "status", "stop"]
    assert "ask the run for a snapshot" in complete("obd train sto")[0]
    assert {"last", rid, "sft-base"} <= {c.split("\t")[0] for c in complete("obd train logs ")}
    assert [c.split("\t")[0] for c in complete("obd train list --state ru")] == ["running"]
    assert "sh" in [c.split("\t")[0] for c in complete("obd train start -- sh")]


@pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed here (apt-get install zsh)")
def test_zsh_completes_commands_with_their_help_and_hands_the_jobs_command_to_zsh(fast: DaemonProc) -> None:
    rid = start(fast, "true", opts=("--name", "sft-base"))
    fast.wait_state(rid, "succeeded")
    # What _obd would offer: zsh's completion functions replaced by ones that print their words.
    probe = (
        '_describe() { print -l -- "${(@P)4}" }\n'
        'compadd() { [[ $1 == -- ]] && shift; print -l -- "$@" }\n'
        '_files() { print -- "_files $*" }\n'
        '_normal() { print -- "_normal ${words[*]} $CURRENT" }\n'
        "compdef() { }\n"
        f"source {REPO / 'daemon' / 'cli' / 'completions' / '_obd'}\n"
        't() { words=("$@"); CURRENT=$#; PREFIX=${words[-1]}; _obd; print -- "--" }\n'
        "t obd train st\nt obd train logs ''\nt obd train start --cwd /tm\nt obd train start -- git chec\n"
    )
    out = subprocess.run(["zsh", "-f", "-c", probe], env=_shell_env(fast), capture_output=True, text=True, timeout=60)
    assert out.stderr == ""
    groups = [g.strip().splitlines() for g in out.stdout.split("--\n")]
    assert "stop:ask the run for a snapshot at the end of its step, then stop" in groups[0]
    assert {"last", rid, "sft-base"} <= set(groups[1])
    assert groups[2] == ["_files -/"]
    assert groups[3] == ["_normal git chec 2"]


# --- usage errors that say what to do -----------------------------------------------------------


def test_a_command_with_options_and_no_double_dash_is_refused_with_the_line_that_works(fast: DaemonProc) -> None:
    out = obd(fast, "train", "start", "--name", "x", "python", "train.py", "--lr", "2e-4")
    assert out.returncode == 2
    assert "obd train start --name x -- python train.py --lr 2e-4" in out.stderr
    assert obd(fast, "train", "list", "--json").stdout.strip() == "[]"  # nothing was started
    out = obd(fast, "train", "start", "sh", "-c", "echo hi")
    assert out.returncode == 2 and "obd train start -- sh -c 'echo hi'" in out.stderr


def test_errors_name_the_flag_not_the_field_behind_it(fast: DaemonProc) -> None:
    rid = start(fast, "true")
    out = obd(fast, "train", "logs", rid, "--tail", "-3")
    assert out.returncode == 2 and "--tail" in out.stderr and "tail_lines" not in out.stderr
    out = obd(fast, "train", "start", "--priority", "500", "--", "true")
    assert out.returncode == 2 and "--priority" in out.stderr and "-100 to 100" in out.stderr
    out = obd(fast, "train", "start", "--name", "a/b", "--", "true")  # refused by the daemon
    assert out.returncode == 2 and out.stderr.startswith("obd: --name may not hold '/'")
    out = obd(fast, "train", "list", "--since", "yesterday-ish")
    assert out.returncode == 2 and "--since" in out.stderr and "2h" in out.stderr


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("train", "status", "last"), 141),
        (("train", "list"), 141),
        (("train", "logs", "last"), 141),
        (("train", "status", "last", "--json"), 141),
        (("--help",), 0),  # argparse itself says nothing when its help cannot be written
    ],
)
def test_a_closed_pipe_ends_the_command_quietly(fast: DaemonProc, args: tuple[str, ...], code: int) -> None:
    rid = start(fast, "sh", "-c", "seq 1 20000")
    fast.wait_state(rid, "succeeded")
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write, as `| head -1` is soon after
    try:
        proc = subprocess.run(
            [str(OBD), *args], env=fast.env, stdout=write, stderr=subprocess.PIPE, text=True, timeout=60
        )
    finally:
        os.close(write)
    assert proc.returncode == code and proc.stderr == ""


def test_logs_json_is_one_object_a_line_with_its_offset_in_the_log(fast: DaemonProc) -> None:
    rid = start(fast, "sh", "-c", "echo first; printf 'été\\n'; printf 'no newline at the end'")
    fast.wait_state(rid, "succeeded")
    lines = [json.loads(line) for line in obd(fast, "train", "logs", rid, "--json").stdout.splitlines()]
    assert [line["text"] for line in lines] == ["first", "été", "no newline at the end"]
    log = (Path(fast.record(rid)["remote_dir"]) / "job.log").read_bytes()
    for line in lines:
        assert log[line["offset"] :].decode().startswith(line["text"])
    tail = [json.loads(line) for line in obd(fast, "train", "logs", rid, "--json", "--tail", "1").stdout.splitlines()]
    assert tail == lines[-1:]


def test_metrics_json_of_a_run_without_profile_says_so_and_profile_parse_of_nothing_fails(
    fast: DaemonProc, short_tmp: Path
) -> None:
    rid = start(fast, "true")
    fast.wait_state(rid, "succeeded")
    out = obd(fast, "train", "metrics", rid, "--json")
    reply = json.loads(out.stdout)
    assert reply["metrics"] is None and reply["profile"] is False and "--profile" in reply["message"]
    empty = short_tmp / "empty"
    empty.mkdir()
    out = obd(fast, "profile", "parse", str(empty))
    assert out.returncode == 1 and "found nothing to parse" in out.stderr


# --- a list that scales -------------------------------------------------------------------------


def _ids(d: DaemonProc, *args: str) -> list[str]:
    out = obd(d, "train", "list", "--json", *args)
    assert out.returncode == 0, out.stderr
    return [r["id"] for r in json.loads(out.stdout)]


def test_list_shows_active_runs_and_recent_ends_and_filters_by_state_target_name_time_and_count(
    fast: DaemonProc,
) -> None:
    ended = [start(fast, "true", opts=("--name", "sweep" if i % 2 else "base")) for i in range(12)]
    for rid in ended:
        fast.wait_state(rid, "succeeded")
    failed = start(fast, "false", opts=("--name", "base"))
    fast.wait_state(failed, "failed")
    running = start(fast, "sleep", "60")
    fast.wait_state(running, "running")

    default = _ids(fast)
    assert running in default and failed in default and len(default) == 11  # the active run and 10 ends
    assert set(_ids(fast, "--all")) == {*ended, failed, running}
    assert _ids(fast, "--state", "running") == [running]
    assert set(_ids(fast, "--state", "failed", "--state", "running")) == {failed, running}
    assert set(_ids(fast, "--name", "sweep")) == set(ended[1::2])
    assert _ids(fast, "--target", "elsewhere") == []
    assert len(_ids(fast, "--target", "local", "--all")) == 14
    assert _ids(fast, "--limit", "2") == [failed, running]
    assert set(_ids(fast, "--since", "1h", "--all")) == {*ended, failed, running}
    assert _ids(fast, "--since", "2999-01-01") == []
    assert obd(fast, "train", "cancel", running, "--wait").returncode == 0


def test_list_fits_the_terminal_and_shortens_a_long_message_in_its_middle(fast: DaemonProc) -> None:
    rid = start(
        fast,
        "sh",
        "-c",
        "echo 'the data file /data/shard-0042.jsonl is corrupt: line 17: ' $(seq 1 30) >&2; echo 'fix: obd-fix-it now' >&2; exit 3",
    )
    fast.wait_state(rid, "failed")
    narrow = obd(fast, "train", "list", env={"COLUMNS": "80"}).stdout.splitlines()
    assert all(len(line) <= 80 for line in narrow), narrow
    row = next(line for line in narrow if line.startswith(rid))
    assert "…" in row and row.endswith("obd-fix-it now")  # the end of the message survives
    assert row.split()[1] == "failed" or "failed" in row.split()[:4]
    piped = obd(fast, "train", "list").stdout  # not a terminal: every column, every message whole
    assert "line 17:  1 2 3" in piped and "OWNER" in piped and "STARTED" in piped


CLEAR = b"\x1b[H\x1b[2J"  # what starts each frame of `list --watch`


def watch_on_terminal(argv: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start `argv` with its stdout and stderr on a new pseudo-terminal; return it and the master side."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, env=env, stdout=slave, stderr=slave, cwd=REPO)
    os.close(slave)
    return proc, master


def read_terminal(
    master: int,
    proc: subprocess.Popen[bytes],
    timeout: float,
    what: str,
    until: Callable[[bytes], bool] | None = None,
) -> bytes:
    """Read what the terminal shows until `until(shown)` holds or, without `until`, the process exits."""
    shown = b""
    deadline = time.monotonic() + timeout
    while not (until(shown) if until is not None else proc.poll() is not None):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}; shown: {shown[-2000:]!r}"
        if select.select([master], [], [], 0.1)[0]:
            try:
                shown += os.read(master, 65536)
            except OSError:  # no process holds the terminal any more
                assert until is None, f"the terminal closed before {what}; shown: {shown[-2000:]!r}"
                proc.wait(timeout)
    return shown


def test_list_watch_redraws_every_second_on_a_terminal_and_refuses_a_pipe(fast: DaemonProc) -> None:
    rid = start(fast, "sleep", "30", opts=("--name", "watched"))
    fast.wait_state(rid, "running")
    proc, master = watch_on_terminal([str(OBD), "train", "list", "--watch"], fast.env)
    try:
        shown = read_terminal(
            master, proc, 120, "three frames showing the run", until=lambda s: s.count(CLEAR) >= 3 and b"watched" in s
        )
        proc.send_signal(signal.SIGINT)
        read_terminal(master, proc, 120, "the watch to end on Ctrl-C")
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert shown.count(CLEAR) >= 3 and b"watched" in shown  # redrawn every second
    piped = obd(fast, "train", "list", "--watch")
    assert piped.returncode == 2 and "--json" in piped.stderr
    obd(fast, "train", "cancel", rid)


def test_ctrl_c_ends_list_watch_while_the_daemon_is_slow_to_answer_even_when_started_with_sigint_ignored(
    short_tmp: Path,
) -> None:
    """A daemon that takes the `list` request and does not answer yet; the watch was started by a
    script that ignores SIGINT (as a script's background job does), which Python leaves ignored."""
    d = DaemonProc(short_tmp)  # its environment only: the socket is this test's
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(d.socket))
    server.listen()
    server.settimeout(120)
    ignoring = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', str(OBD), "train", "list", "--watch"]
    proc, master = watch_on_terminal(ignoring, d.env)
    conn = None
    try:
        conn, _ = server.accept()
        conn.settimeout(120)
        request = b""
        while b"\n" not in request:
            chunk = conn.recv(65536)
            assert chunk, "the watch closed its connection without a request"
            request += chunk
        assert json.loads(request)["op"] == "list"  # the watch now waits for the answer
        proc.send_signal(signal.SIGINT)
        read_terminal(master, proc, 120, "the watch to end on Ctrl-C")
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        if conn is not None:
            conn.close()
        server.close()


# --- feedback while waiting ---------------------------------------------------------------------


def test_stop_wait_shows_each_stage_on_a_terminal_and_nothing_extra_when_piped(
    fast: DaemonProc, short_tmp: Path
) -> None:
    rid = snapshot_job(fast, short_tmp, delay=1.5, linger=1.5)
    code, shown, out = on_terminal([str(OBD), "train", "stop", rid, "--wait"], fast.env, until=60)
    assert code == 0, shown
    stages = [line.split("\r\x1b[K")[-1] for line in shown.replace("\r\n", "\n").split("\n") if line.strip()]
    assert stages[0].startswith("snapshot request written")
    assert re.match(r"proof seen .*: checkpoint-\d+ \(2\.5 MB\) at step \d+; waiting for the job to exit", stages[1])
    assert "state     stopped" in out

    quiet = snapshot_job(fast, short_tmp, delay=1.0, linger=1.0)
    piped = obd(fast, "train", "stop", quiet, "--wait")
    assert piped.returncode == 0 and piped.stderr == ""


def test_cancel_wait_says_it_sent_term_and_waits_for_the_job(fast: DaemonProc) -> None:
    rid = start(
        fast,
        PY,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)",
    )
    fast.wait_state(rid, "running")
    time.sleep(0.5)
    code, shown, out = on_terminal([str(OBD), "train", "cancel", rid, "--wait"], fast.env, until=60)
    assert code == 0
    assert "cancel sent" in shown and "waiting for them to exit" in shown
    assert out.strip() == f"{rid}: cancelled by the user"


# --- a fast client ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("train", "list"),
        ("train", "list", "--json"),
        ("targets", "list"),
        ("train", "status", "last"),
        ("--version",),
        ("completion", "bash"),
    ],
)
def test_client_commands_import_no_heavy_library(fast: DaemonProc, args: tuple[str, ...]) -> None:
    rid = start(fast, "true")
    fast.wait_state(rid, "succeeded")
    out = subprocess.run(
        [PY, "-X", "importtime", "-m", "daemon.cli", *args], env=fast.env, cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "daemon" in imported
    assert imported.isdisjoint(HEAVY), imported & HEAVY


# --- the README's commands, as written ----------------------------------------------------------


def test_the_readmes_first_commands_run_as_written(fast: DaemonProc, short_tmp: Path) -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Using obd", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].split() for line in block.splitlines() if line.startswith("obd ")]
    assert commands[0][:2] == ["obd", "daemon"]  # the daemon is the test's
    # train.py: a job that snapshots when asked, in the directory the commands run in.
    (short_tmp / "train.py").write_text(SNAPSHOT_JOB.replace("float(sys.argv[1]), float(sys.argv[2])", "0.0, 0.0"))
    following: list[tuple[list[str], subprocess.Popen[bytes]]] = []
    for words in commands[1:]:
        argv = [str(OBD), *(PY if word == "python" else word for word in words[1:])]
        if "--follow" in argv:  # it follows until the run ends, which the next commands see to
            following.append((words, subprocess.Popen(argv, env=fast.env, cwd=short_tmp, stdout=subprocess.PIPE)))
            continue
        out = subprocess.run(argv, env=fast.env, cwd=short_tmp, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"{' '.join(words)}: exit {out.returncode}: {out.stderr}"
    for words, proc in following:
        assert proc.wait(60) in (0, 3, 5), " ".join(words)
    runs = json.loads(obd(fast, "train", "list", "--json").stdout)
    assert [r["name"] for r in runs] == ["sft", "sft-r2"]
    assert runs[0]["state"] == "stopped" and runs[1]["state"] == "cancelled"
    assert fast.record("sft-r2")["resumed_from"] == runs[0]["id"]
