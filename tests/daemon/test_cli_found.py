"""What a new user hit with the `obd` command (issue 34), each as they met it: the installed
command against a real daemon with real jobs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
OBD = Path(sys.executable).with_name("obd")
# A job that speaks the snapshot protocol: it announces the plugin, logs a step every 0.1 s and,
# on a request, writes a complete checkpoint and its proof (after argv[1] seconds) and exits 0.
SNAPSHOT_JOB = r"""
import json, os, sys, time
env = os.environ
def metric(**line):
    with open(env["OBD_METRICS_FILE"], "a") as f:
        f.write(json.dumps(line) + "\n")
metric(event="begin", time=time.time(), max_steps=1000, snapshots=True, version="test")
for step in range(1, 100000):
    time.sleep(0.1)
    print(f"step {step}", flush=True)
    metric(event="log", step=step, loss=1.0 / step, time=time.time())
    if os.path.exists(env["OBD_SNAPSHOT_REQUEST"]):
        time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0.0)  # a slow step: seconds to end it
        checkpoint = os.path.join(env["OBD_RUN_DIR"], "output", f"checkpoint-{step}")
        os.makedirs(checkpoint)
        with open(os.path.join(checkpoint, "model.safetensors"), "wb") as f:
            f.write(b"w" * 1000)
        with open(os.path.join(checkpoint, "trainer_state.json"), "w") as f:
            json.dump({"global_step": step}, f)
        proof = {"checkpoint": f"output/checkpoint-{step}", "step": step, "time": time.time(), "reason": "requested"}
        with open(env["OBD_SNAPSHOT_FILE"] + ".tmp", "w") as f:
            json.dump(proof, f)
        os.replace(env["OBD_SNAPSHOT_FILE"] + ".tmp", env["OBD_SNAPSHOT_FILE"])
        sys.exit(0)
"""


@pytest.fixture
def box(make_daemon) -> DaemonProc:
    d = make_daemon(FAST_CONFIG)
    d.start()
    return d


def obd(d: DaemonProc, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The installed `obd` command, talking to `d`."""
    return subprocess.run([str(OBD), *args], env=d.env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = obd(d, "train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def snapshot_job(d: DaemonProc, tmp: Path, *args: str) -> tuple[str, list[str]]:
    """A run of SNAPSHOT_JOB that announced the plugin and logged a step, and its command."""
    script = tmp / "snapshot_job.py"
    script.write_text(SNAPSHOT_JOB)
    command = [PY, str(script), *args]
    rid = start(d, *command)
    wait_for(lambda: (r := d.record(rid))["snapshots"] and (r["progress"]["step"] or 0) >= 1, 60, 0.1, "a step")
    return rid, command


def stopped_run(d: DaemonProc, tmp: Path) -> tuple[str, list[str]]:
    """A run stopped with a verified snapshot, and its command."""
    rid, command = snapshot_job(d, tmp)
    out = obd(d, "train", "stop", rid, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    return rid, command


# --- 1: options after the run id are resume's own -------------------------------------------


def test_options_after_the_run_id_of_a_resume_are_resumes_and_the_command_stays_the_runs(
    box: DaemonProc, short_tmp: Path
) -> None:
    rid, command = stopped_run(box, short_tmp)

    out = obd(box, "train", "resume", rid, "--checkpoint", "latest", "--json")
    assert out.returncode == 0, out.stderr
    by_checkpoint = json.loads(out.stdout)
    assert by_checkpoint["command"] == command
    assert by_checkpoint["resumed_from"] == rid and by_checkpoint["resume_checkpoint"]

    out = obd(box, "train", "resume", rid, "--time-limit", "3m", "--json")
    assert out.returncode == 0, out.stderr
    limited = json.loads(out.stdout)
    assert limited["command"] == command and limited["limits"]["time_limit"] == 180

    out = obd(box, "train", "resume", rid, "--retry", "1", "--json")
    assert out.returncode == 0, out.stderr
    retried = json.loads(out.stdout)
    assert retried["command"] == command and retried["retries"] == 1

    # A new command still goes after `--`; one without it is refused with the line that works.
    out = obd(box, "train", "resume", rid, "--retry", "1", "--json", "--", "sh", "-c", "echo new")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["command"] == ["sh", "-c", "echo new"]
    out = obd(box, "train", "resume", rid, "sh", "-c", "--flag")
    assert out.returncode == 2
    assert f"obd train resume {rid} -- sh -c --flag" in out.stderr

    for run in (by_checkpoint, limited, retried):
        obd(box, "train", "cancel", run["id"], "--wait")


# --- 10: what a start accepted and ignored ---------------------------------------------------


def test_an_abbreviated_option_is_refused_with_the_one_it_may_mean(box: DaemonProc) -> None:
    out = obd(box, "train", "start", "--gpu", "1", "--", "true")
    assert out.returncode == 2
    assert "unrecognized option --gpu; did you mean --gpus?" in out.stderr
    assert obd(box, "train", "list", "--all", "--json").stdout.strip() == "[]"  # nothing started
    out = obd(box, "train", "list", "--al")
    assert out.returncode == 2 and "did you mean --all?" in out.stderr


def test_a_checkpoint_without_resume_from_is_refused_saying_what_to_add(box: DaemonProc, short_tmp: Path) -> None:
    out = obd(box, "train", "start", "--checkpoint", "5", "--", "true")
    assert out.returncode == 2
    assert "--checkpoint 5 picks a checkpoint of the run given by --resume-from" in out.stderr
    assert "add --resume-from RUN" in out.stderr
    run_file = short_tmp / "run.toml"
    run_file.write_text('command = ["true"]\ncheckpoint = "latest"\n')
    out = obd(box, "train", "start", "-f", str(run_file))
    assert out.returncode == 2 and "add --resume-from RUN" in out.stderr
    assert obd(box, "train", "list", "--all", "--json").stdout.strip() == "[]"  # nothing started


def test_a_sweep_placeholder_that_names_no_grid_key_is_refused_with_the_grids_keys(box: DaemonProc) -> None:
    grid = ("--grid", "lr=1,2", "--grid", "seed=1,2")
    out = obd(box, "train", "sweep", *grid, "--", "echo", "--lr", "{lrr}", "--seed={seed}")
    assert out.returncode == 2
    assert "{lrr} names no key of the grid ({lr}, {seed})" in out.stderr
    assert obd(box, "train", "list", "--all", "--json").stdout.strip() == "[]"  # no sweep made
    # A shell's braces, and a script given whole, are the job's own.
    out = obd(box, "train", "sweep", *grid, "--", "sh", "-c", "echo ${HOME} {x} {lr}", "${seed}")
    assert out.returncode == 0, out.stderr
    obd(box, "train", "cancel", out.stdout.strip(), "--wait")


# --- 2: plot of a sweep ----------------------------------------------------------------------

# A job that logs a loss of LR/step for three steps, as the plugin would.
LOSS_JOB = r"""
import json, os, sys, time
lr = float(sys.argv[1])
with open(os.environ["OBD_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"event": "begin", "time": time.time(), "max_steps": 3}) + "\n")
    for step in (1, 2, 3):
        f.write(json.dumps({"event": "log", "step": step, "loss": lr / step, "time": time.time()}) + "\n")
"""


def test_plot_of_a_sweep_draws_each_member_and_refuses_a_metric_none_logged(box: DaemonProc, short_tmp: Path) -> None:
    script = short_tmp / "loss_job.py"
    script.write_text(LOSS_JOB)
    out = obd(box, "train", "sweep", "--name", "lrs", "--grid", "lr=1,2", "--", PY, str(script), "{lr}")
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.strip()
    members = json.loads(obd(box, "train", "list", "--sweep", sweep, "--json").stdout)
    for member in members:
        box.wait_state(member["id"], "succeeded")

    out = obd(box, "train", "plot", "lrs", "--json")
    assert out.returncode == 0, out.stderr
    curves = json.loads(out.stdout)
    assert [c["run_id"] for c in curves] == [m["id"] for m in members]
    assert [c["points"] for c in curves] == [[[1, 1.0], [2, 0.5], [3, 1 / 3]], [[1, 2.0], [2, 1.0], [3, 2 / 3]]]
    assert "lr=2" in curves[1]["label"]

    out = obd(box, "train", "plot", sweep, "--width", "80")
    assert out.returncode == 0, out.stderr
    assert all(m["id"] in out.stdout for m in members)  # each member in the chart's legend

    out = obd(box, "train", "plot", sweep, "--metric", "accuracy")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"sweep {sweep} (lrs): no member has 'accuracy' values to plot" in out.stderr


# --- 11: resume of a run that succeeded -------------------------------------------------------


# A job that saves a complete checkpoint at step 3 and ends well.
SAVES_AND_ENDS = r"""
import json, os
checkpoint = os.path.join(os.environ["OBD_RUN_DIR"], "output", "checkpoint-3")
os.makedirs(checkpoint, exist_ok=True)
with open(os.path.join(checkpoint, "model.safetensors"), "wb") as f:
    f.write(b"w" * 1000)
with open(os.path.join(checkpoint, "trainer_state.json"), "w") as f:
    json.dump({"global_step": 3}, f)
"""


# Its metrics: the plugin's `begin` with 10 steps to go, and a log line at step 3.
SHORT_OF_MAX = r"""import json, os, time
with open(os.environ["OBD_METRICS_FILE"], "a") as f:
    f.write(json.dumps({"event": "begin", "time": time.time(), "max_steps": 10}) + "\n")
    f.write(json.dumps({"event": "log", "step": 3, "loss": 1.0, "time": time.time()}) + "\n")
"""


def test_a_resume_of_a_run_that_succeeded_is_refused_unless_asked_again(box: DaemonProc) -> None:
    rid = start(box, PY, "-c", SAVES_AND_ENDS)
    box.wait_state(rid, "succeeded")
    out = obd(box, "train", "resume", rid)
    assert out.returncode == 1
    assert f"run {rid} already ended (succeeded)" in out.stderr
    assert f"obd train resume {rid} --again" in out.stderr
    assert [r["id"] for r in json.loads(obd(box, "train", "list", "--all", "--json").stdout)] == [rid]

    out = obd(box, "train", "resume", rid, "--again")
    assert out.returncode == 0, out.stderr
    again = box.wait_state(out.stdout.strip(), "succeeded")
    assert again["resumed_from"] == rid and again["resume_checkpoint"].endswith("checkpoint-3")

    # One that succeeded short of its max steps (transformers' own SIGTERM handler saved and ended it) resumes.
    short = start(box, PY, "-c", SAVES_AND_ENDS.replace("import json, os", SHORT_OF_MAX))
    assert box.wait_state(short, "succeeded")["progress"]["step"] == 3
    out = obd(box, "train", "resume", short)
    assert out.returncode == 0, out.stderr
    box.wait_state(out.stdout.strip(), "succeeded")


# --- 12: what cancel says ----------------------------------------------------------------------


def test_cancel_without_wait_says_the_cancel_was_asked_not_that_the_run_started(box: DaemonProc) -> None:
    rid = start(box, "sleep", "60")
    box.wait_state(rid, "running")
    out = obd(box, "train", "cancel", rid)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"{rid}: cancelling (TERM to its processes")
    assert "started" not in out.stdout
    box.wait_state(rid, "cancelled")


# --- 15: logs of a sweep -----------------------------------------------------------------------


def test_logs_of_a_sweep_lists_the_logs_command_of_each_member(box: DaemonProc) -> None:
    out = obd(box, "train", "sweep", "--name", "echoes", "--grid", "word=hi,ho", "--", "echo", "{word}")
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.strip()
    members = json.loads(obd(box, "train", "list", "--sweep", sweep, "--json").stdout)
    for member in members:
        box.wait_state(member["id"], "succeeded")
    for ref in (sweep, "echoes"):
        out = obd(box, "train", "logs", ref)
        assert out.returncode == 2 and out.stdout == ""
        lines = out.stderr.splitlines()
        assert lines[0] == f"obd: sweep {sweep} (echoes) has no log of its own: each of its 2 runs has one:"
        assert lines[1].startswith(f"  obd train logs {members[0]['id']}    # echoes-1 word=hi (succeeded)")
        assert lines[2].startswith(f"  obd train logs {members[1]['id']}    # echoes-2 word=ho (succeeded)")
    assert obd(box, "train", "logs", members[1]["id"]).stdout == "ho\n"  # the command it said, as said
    out = obd(box, "train", "logs", "nothing-of-that-name")
    assert out.returncode == 1 and "no run" in out.stderr


# --- 6: stop --wait on 80 columns --------------------------------------------------------------


def test_stop_wait_keeps_the_time_since_the_request_on_an_80_column_terminal(box: DaemonProc, short_tmp: Path) -> None:
    from tests.daemon.test_cli import on_terminal

    rid, _ = snapshot_job(box, short_tmp, "2.5")
    env = {**box.env, "COLUMNS": "80"}
    code, shown, out = on_terminal([str(OBD), "train", "stop", rid, "--wait"], env, until=60)
    assert code == 0, shown
    drawn = [part for line in shown.replace("\r\n", "\n").split("\n") for part in line.split("\r\x1b[K") if part]
    requests = [line for line in drawn if line.startswith("snapshot request written")]
    assert requests, shown
    for line in drawn:
        assert len(line) <= 79, line
    for line in requests:
        assert re.match(r"snapshot request written (\d+s ago )?\(requested\); waiting for", line), line
    assert any(re.search(r"written \d+s ago", line) for line in requests), requests  # the time since the request
    assert "state     stopped" in out


# --- 13: obd train shell keeps what was typed ahead --------------------------------------------


def test_a_shell_runs_what_was_typed_before_it_opened(make_daemon) -> None:
    import os
    import pty
    import select
    import time

    d = make_daemon(FAST_CONFIG)
    (d.root / "home").mkdir()
    d.env["HOME"] = str(d.root / "home")  # a login shell: this machine's dotfiles are not the test's
    d.start()
    rid = start(d, PY, "-c", "import time; time.sleep(120)")
    d.wait_state(rid, "running")
    master, slave = pty.openpty()
    os.write(master, b"echo typed-$((40+2)); exit 5\r")  # typed before obd even started
    proc = subprocess.Popen(
        [str(OBD), "train", "shell", rid],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env={**d.env, "TERM": "xterm"},
        cwd=REPO,
        start_new_session=True,
    )
    os.close(slave)
    shown = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            shown += chunk
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    code = proc.wait(30)
    os.close(master)
    assert b"typed-42" in shown, shown  # the shell ran it: the type-ahead was not flushed
    assert code == 5, shown
    obd(d, "train", "cancel", rid, "--wait")
