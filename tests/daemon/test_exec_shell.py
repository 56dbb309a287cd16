"""`obd train exec RUN -- COMMAND` and `obd train shell RUN` (issue 27, item 3): a command where
the run's job runs, as its user, in its run directory, with its GPUs; its output streamed and its
exit status obd's. Against a real daemon, a real job, and (for the shell) a real pseudo-terminal.

The root service's users are tests/security/test_exec_as_user.py's; the SSH target's and the
Slurm cluster's are at the end of this file.
"""

from __future__ import annotations

import json
import os
import pty
import select
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, kill_job_groups, wait_for
from tests.ptys import converse

TWO_GPUS = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]
PROBE = "id -un; pwd; echo $CUDA_VISIBLE_DEVICES; echo $OBD_RUN_ID"


def start_running(d: DaemonProc, *extra: str, command: list[str] = SLEEPER) -> dict:
    out = d.cli("train", "start", *extra, "--", *command)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    return d.wait_state(run_id, "running")


@pytest.fixture
def gpu_daemon(make_daemon) -> Iterator[DaemonProc]:
    d = make_daemon(TWO_GPUS)
    # A home of its own: a shell is a login shell, and this machine's dotfiles are not the test's.
    (d.root / "home").mkdir()
    d.env["HOME"] = str(d.root / "home")
    d.start()
    yield d


def test_exec_prints_the_runs_user_its_run_directory_and_its_gpus(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon, "--gpus", "1")
    out = gpu_daemon.cli("train", "exec", record["id"], "--", "sh", "-c", PROBE)
    assert out.returncode == 0, out.stderr
    user, cwd, gpus, run_id = out.stdout.splitlines()
    assert user == subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    assert Path(cwd) == Path(record["remote_dir"])
    assert gpus == ",".join(record["gpus"]) and len(record["gpus"]) == 1
    assert run_id == record["id"]
    umask = gpu_daemon.cli("train", "exec", record["id"], "--", "sh", "-c", "umask")
    assert umask.stdout.strip() == "0077"  # what it writes is the user's alone


def test_the_commands_exit_status_is_obds_and_its_stderr_stays_stderr(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    out = gpu_daemon.cli("train", "exec", record["id"], "--", "sh", "-c", "echo to-out; echo to-err >&2; exit 7")
    assert out.returncode == 7
    assert out.stdout == "to-out\n"
    assert out.stderr == "to-err\n"


def test_stdin_reaches_the_command_and_its_end_ends_it(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "train", "exec", record["id"], "--", "sh", "-c", "wc -l; exit 0"],
        env=gpu_daemon.env,
        input="a\nb\nc\n",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "3"


def test_output_comes_as_it_is_written_not_when_the_command_ends(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "train", "exec", record["id"], "--", "sh", "-c", "echo first; sleep 30"],
        env=gpu_daemon.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no output within 20 s of a command that printed at once"
        assert proc.stdout.readline() == b"first\n"
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    # The client went away: the daemon ends the command (its sleep is gone soon after).
    wait_for(lambda: not sleeping_in(record["remote_dir"]), 15, 0.2, "the command of a gone client to end")


def test_a_daemon_that_stops_ends_the_commands_it_runs_in_runs(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "train", "exec", record["id"], "--", "sleep", "30"],
        env=gpu_daemon.env,
        stdin=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        wait_for(lambda: sleeping_in(record["remote_dir"]), 15, 0.1, "the command to run")
        gpu_daemon.stop()
        assert not sleeping_in(record["remote_dir"])
        assert proc.wait(15) != 0  # the client says the daemon went before the command ended
    finally:
        proc.kill()
        proc.wait()


def sleeping_in(run_dir: str) -> int:
    """How many `sleep 30` whose working directory is the run directory run."""
    found = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if os.readlink(f"/proc/{pid}/cwd") == run_dir and cmdline == b"sleep\x0030\x00":
                found += 1
        except OSError:
            continue
    return found


def test_the_python_api_runs_a_command_in_a_run_sync_and_async(gpu_daemon: DaemonProc) -> None:
    import anyio

    import obd

    record = start_running(gpu_daemon, "--gpus", "1")
    script = "pwd; echo $CUDA_VISIBLE_DEVICES; echo to-err >&2; cat; exit 7"
    with obd.Client(socket=gpu_daemon.socket) as client:
        run = client.run(record["id"])
        done = run.exec(["sh", "-c", script], input=b"from-stdin\n")
        assert done.exit_code == 7 and done.stderr == b"to-err\n"
        cwd, gpus, given = done.stdout.decode().splitlines()
        assert (Path(cwd), gpus, given) == (Path(record["remote_dir"]), ",".join(record["gpus"]), "from-stdin")
        with pytest.raises(obd.ObdError, match="over its timeout of 1 s"):
            run.exec("sleep 60", timeout=1)
        ended = client.start(["true"], gpus=0)
        ended.wait()
        with pytest.raises(obd.RequestFailed, match="has ended"):
            ended.exec("true")

    async def in_async() -> obd.ExecResult:
        async with obd.AsyncClient(socket=gpu_daemon.socket) as aclient:
            arun = await aclient.run(record["id"])
            with pytest.raises(obd.ObdError, match="over its timeout"):
                await arun.exec("sleep 60", timeout=1)
            return await arun.exec(["sh", "-c", "echo async-$((40+2)); exit 4"])

    assert anyio.run(in_async) == obd.ExecResult(4, b"async-42\n", b"")
    # The commands the timeouts hung up on were ended there.
    wait_for(lambda: "sleep 60" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout, 20)


def test_a_run_that_is_not_running_is_refused_with_what_to_do(gpu_daemon: DaemonProc) -> None:
    out = gpu_daemon.cli("train", "start", "--", "true")
    run_id = out.stdout.strip()
    gpu_daemon.wait_state(run_id, "succeeded")
    refused = gpu_daemon.cli("train", "exec", run_id, "--", "true")
    assert refused.returncode == 1
    assert f"run {run_id} has ended (succeeded)" in refused.stderr
    assert "obd train outputs" in refused.stderr

    held = start_running(gpu_daemon, "--gpus", "2")
    queued = gpu_daemon.cli("train", "start", "--gpus", "1", "--", *SLEEPER).stdout.strip()
    assert gpu_daemon.wait_state(queued, "queued")
    refused = gpu_daemon.cli("train", "exec", queued, "--", "true")
    assert refused.returncode == 1
    assert "has not started" in refused.stderr
    assert held["state"] == "running"


def test_a_command_word_with_a_nul_byte_is_refused_as_bad_usage(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(gpu_daemon.socket))
        request = {"op": "exec", "id": record["id"], "command": ["printf", "a\0b"]}
        sock.sendall(json.dumps(request).encode() + b"\n")
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["ok"] is False and answer["kind"] == "usage"
    assert "NUL" in answer["error"]


def test_exec_without_a_command_is_a_usage_error(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    out = gpu_daemon.cli("train", "exec", record["id"])
    assert out.returncode == 2
    assert "give the command to run after --" in out.stderr


def drive(
    d: DaemonProc, args: list[str], typed: bytes, timeout: float = 30, resize: tuple[int, int] | None = None
) -> tuple[int, bytes]:
    """`obd ARGS` on a pseudo-terminal of this test's, `typed` typed into it once a prompt shows
    (or after 3 s), the terminal first resized to `resize` (rows, cols) if given; its exit status
    and everything it showed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: obd on the terminal
        os.chdir(REPO)
        os.execve(sys.executable, [sys.executable, "-m", "daemon.cli", *args], {**d.env, "TERM": "xterm"})
    return converse(pid, fd, typed, timeout, resize)


def test_a_shell_follows_the_size_of_the_callers_terminal(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon)
    code, shown = drive(gpu_daemon, ["train", "shell", record["id"]], b"stty size; exit 0\r", resize=(41, 103))
    assert code == 0, shown
    assert b"41 103" in shown


def test_a_shell_on_a_terminal_runs_what_is_typed_and_its_exit_status_is_obds(gpu_daemon: DaemonProc) -> None:
    record = start_running(gpu_daemon, "--gpus", "1")
    code, shown = drive(gpu_daemon, ["train", "shell", record["id"]], b"echo hi-$((40+2)); tty; pwd; exit 3\r")
    assert code == 3, shown
    assert b"hi-42" in shown
    assert b"/dev/pts/" in shown  # a real terminal there
    assert record["remote_dir"].encode() in shown


# --- the SSH target: the same, over the executor's connection to a real sshd on loopback -------


@pytest.fixture
def ssh_box(make_daemon, short_tmp: Path) -> Iterator[DaemonProc]:
    from tests.daemon.test_ssh_target import ssh_config
    from tests.sshd import running_sshd

    for server in running_sshd():
        workdir = short_tmp / "remote"
        d = make_daemon(ssh_config(server, workdir))
        d.start()
        yield d
        kill_job_groups(workdir.glob("*/job.pid"))


def test_exec_over_ssh_runs_in_the_run_directory_with_the_jobs_gpus_and_passes_the_exit_status(
    ssh_box: DaemonProc,
) -> None:
    job = 'echo "${CUDA_VISIBLE_DEVICES-unset}" > job-gpus; sleep 120'
    record = start_running(ssh_box, "--target", "box", command=["sh", "-c", job])
    probe = 'id -un; pwd; echo "${CUDA_VISIBLE_DEVICES-unset}"; echo $OBD_RUN_ID; cat job-gpus'
    out = ssh_box.cli("train", "exec", record["id"], "--", "sh", "-c", probe)
    assert out.returncode == 0, out.stderr
    user, cwd, gpus, run_id, job_gpus = out.stdout.splitlines()
    assert user == subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()  # the login's
    assert cwd == record["remote_dir"]
    assert gpus == job_gpus  # what the job got (an SSH target's GPUs are the host's own)
    assert run_id == record["id"]
    # Every word reaches the command as it was given: quoted for the remote shell, not read by it.
    odd = 'it\'s $HOME; `rm -rf x` "q"'
    echoed = ssh_box.cli("train", "exec", record["id"], "--", "printf", "%s|", odd, "b c")
    assert echoed.stdout == f"{odd}|b c|"
    failed = ssh_box.cli("train", "exec", record["id"], "--", "sh", "-c", "echo oops >&2; exit 7")
    assert failed.returncode == 7
    assert failed.stderr.endswith("oops\n")  # after whatever the login's dotfiles say there


def test_at_most_four_commands_at_once_hold_channels_of_an_ssh_targets_connection(ssh_box: DaemonProc) -> None:
    record = start_running(ssh_box, "--target", "box", command=["sleep", "120"])
    argv = [sys.executable, "-m", "daemon.cli", "train", "exec", record["id"], "--", "sleep", "30"]
    held = [subprocess.Popen(argv, env=ssh_box.env, stdin=subprocess.DEVNULL, cwd=REPO) for _ in range(4)]
    try:
        wait_for(lambda: sleeping_in(record["remote_dir"]) >= 4, 20, 0.1, "four commands to run")
        fifth = ssh_box.cli("train", "exec", record["id"], "--", "true")
        assert fifth.returncode == 1
        assert "4 commands or shells are already open on target box" in fifth.stderr
    finally:
        for proc in held:
            proc.kill()
            proc.wait()
    # The clients went: their commands are ended there (SIGHUP over SSH), and their channels freed.
    wait_for(lambda: sleeping_in(record["remote_dir"]) == 0, 20, 0.2, "the commands of gone clients to end")
    assert ssh_box.cli("train", "exec", record["id"], "--", "true").returncode == 0


def assert_a_real_terminal(d: DaemonProc, run_id: str) -> None:
    """`exec -t RUN -- sh` is on a terminal there, follows the caller's size, and passes its exit status back."""
    code, shown = drive(
        d, ["train", "exec", "-t", run_id, "--", "sh"], b"tty; stty size; echo hi-$((40+2)); exit 3\r", resize=(41, 103)
    )
    assert code == 3, shown
    assert b"hi-42" in shown and b"/dev/pts/" in shown
    assert b"41 103" in shown  # the size followed the caller's terminal


def test_a_terminal_over_ssh_is_a_real_one_and_its_exit_status_is_obds(ssh_box: DaemonProc) -> None:
    record = start_running(ssh_box, "--target", "box", command=["sleep", "120"])
    assert_a_real_terminal(ssh_box, record["id"])


def test_a_shell_over_ssh_is_the_logins_shell_on_a_terminal_in_the_run_directory(ssh_box: DaemonProc) -> None:
    record = start_running(ssh_box, "--target", "box", command=["sleep", "120"])
    typed = b"echo hi-$((40+2)) in $(pwd); exit 3\r"
    code, shown = drive(ssh_box, ["train", "shell", record["id"]], typed)
    assert code == 3, shown
    assert f"hi-42 in {record['remote_dir']}".encode() in shown


# --- the Slurm cluster: a step beside the run's job (srun --jobid --overlap) -------------------


@pytest.fixture
def hpc(make_daemon, short_tmp: Path) -> Iterator[DaemonProc]:
    from tests.daemon.test_slurm_target import slurm_config

    cluster = pytest.importorskip("tests.executors.slurm.conftest")
    from tests.executors.slurm.cluster import SHARED, missing_reason

    if reason := missing_reason():
        pytest.skip(reason)
    assert cluster is not None
    slurm = SHARED.acquire()
    try:
        d = make_daemon(slurm_config(short_tmp / "shared"))
        d.env.update(slurm.env)
        (d.root / "home").mkdir()
        d.env["HOME"] = str(d.root / "home")  # a login shell's dotfiles: the test's, not this machine's
        d.start()
        yield d
        d.stop()
        slurm.run("scancel", "--user=root", check=False)
        wait_for(lambda: not slurm.stepds(), 30, 0.2, "the cluster's jobs to end")
    finally:
        SHARED.release()


def running_on_slurm(d: DaemonProc) -> dict:
    """A run whose job Slurm started (not only submitted: a pending job is `queued`)."""
    record = start_running(d, "--target", "hpc", command=["sh", "-c", 'touch "$OBD_RUN_DIR/started"; exec sleep 120'])
    wait_for(lambda: (Path(record["remote_dir"]) / "started").exists(), 60, 0.2, "the Slurm job to start")
    return d.wait_state(record["id"], "running")


def test_exec_on_slurm_runs_as_a_step_of_the_runs_job_in_its_run_directory(hpc: DaemonProc) -> None:
    record = running_on_slurm(hpc)
    job_id = record["job"]["host"].removeprefix("slurm job ")
    probe = "id -un; pwd; echo $SLURM_JOB_ID; echo $SLURM_STEP_ID; echo $OBD_RUN_ID"
    out = hpc.cli("train", "exec", record["id"], "--", "sh", "-c", probe)
    assert out.returncode == 0, out.stderr
    user, cwd, slurm_job, step, run_id = out.stdout.splitlines()
    assert user == "root"  # the run's user: this daemon's (the users' case: tests/security)
    assert cwd == record["remote_dir"]
    assert slurm_job == job_id and step.isdigit()  # a step of the run's own job, beside its batch step
    assert run_id == record["id"]
    failed = hpc.cli("train", "exec", record["id"], "--", "sh", "-c", "echo oops >&2; exit 7")
    assert failed.returncode == 7
    # srun may add its own report of the failed task (as it does for any srun), before or after.
    assert [line for line in failed.stderr.splitlines() if not line.startswith("srun: ")] == ["oops"], failed.stderr
    assert hpc.record(record["id"])["state"] == "running"  # the job itself goes on


def test_a_terminal_on_slurm_is_srun_pty_and_its_exit_status_is_obds(hpc: DaemonProc) -> None:
    record = running_on_slurm(hpc)
    assert_a_real_terminal(hpc, record["id"])


def test_a_shell_on_slurm_is_a_login_shell_in_a_step_of_the_runs_job(hpc: DaemonProc) -> None:
    record = running_on_slurm(hpc)
    typed = b"echo hi-$((40+2)) job-$SLURM_JOB_ID in $(pwd); exit 3\r"
    code, shown = drive(hpc, ["train", "shell", record["id"]], typed)
    assert code == 3, shown
    job_id = record["job"]["host"].removeprefix("slurm job ")
    assert f"hi-42 job-{job_id} in {record['remote_dir']}".encode() in shown


# --- a Runpod pod: over the pod's SSH connection (a loopback fake of the API, a real sshd as the pod)


@pytest.fixture
def pods_box(make_daemon, short_tmp: Path) -> Iterator[DaemonProc]:
    from tests.daemon.pods import KEY, make_pods_daemon
    from tests.executors.runpod.conftest import kill_jobs
    from tests.fakes.runpod_api import FakeRunpod
    from tests.sshd import running_sshd

    for server in running_sshd():
        fake = FakeRunpod(api_keys=(KEY,)).start()
        fake.ssh_endpoint = (server.host, server.port)
        try:
            yield make_pods_daemon(make_daemon, fake, server, short_tmp)
        finally:
            kill_jobs(short_tmp / "pod")
            fake.stop()


def test_exec_on_a_pod_runs_in_the_run_directory_over_its_ssh_and_never_carries_the_account_key(
    pods_box: DaemonProc,
) -> None:
    from tests.daemon.pods import KEY

    record = start_running(pods_box, "--target", "pods", command=["sleep", "120"])
    out = pods_box.cli("train", "exec", record["id"], "--", "sh", "-c", 'pwd; echo "$OBD_RUN_ID"; exit 7')
    assert out.returncode == 7, out.stderr
    assert out.stdout.splitlines() == [record["remote_dir"], record["id"]]
    refused = pods_box.cli("train", "exec", record["id"], "--", "echo", KEY)
    assert refused.returncode == 1
    assert "refusing to send the Runpod account's API key" in refused.stderr
