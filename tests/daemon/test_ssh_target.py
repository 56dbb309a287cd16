"""The local target's scenarios on an SSH target, under the real daemon, against a real sshd."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, kill_job_groups, wait_for
from tests.sshd import SshServer, running_sshd

PY = sys.executable
FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")


def ssh_config(server: SshServer, workdir: Path, extra: str = "", proof_timeout: str = "4s") -> str:
    f = server.target_fields()
    return FAST_CONFIG.replace('proof_timeout = "60s"', f'proof_timeout = "{proof_timeout}"').replace(
        'end_timeout = "30s"', 'end_timeout = "3s"'
    ) + (
        f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
        f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
        f'workdir = "{workdir}"\npython = "{PY}"\nconnect_timeout = 3\nkeepalive = 3\n{extra}'
    )


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


@pytest.fixture
def box(make_daemon, sshd: SshServer, short_tmp: Path) -> DaemonProc:
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir))
    d.start()
    d.remote_workdir = workdir  # type: ignore[attr-defined]
    yield d
    kill_job_groups(workdir.glob("*/job.pid"))


@pytest.fixture
def lora_box(make_daemon, sshd: SshServer, short_tmp: Path) -> DaemonProc:
    """`box` with the usual proof timeout: a real Trainer's save may take seconds on a loaded machine."""
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir, proof_timeout="60s"))
    d.start()
    yield d
    kill_job_groups(workdir.glob("*/job.pid"))


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = (), env: dict | None = None) -> str:
    out = d.cli("train", "start", "--target", "box", *opts, "--", *command, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_job_on_an_ssh_target_runs_logs_and_succeeds(box: DaemonProc) -> None:
    rid = start(box, "sh", "-c", 'for i in 1 2 3; do echo ssh line $i; sleep 0.3; done; echo "cwd=$(pwd)"')
    out = box.cli("train", "logs", rid, "--follow", timeout=60)
    lines = out.stdout.splitlines()
    assert lines[:3] == ["ssh line 1", "ssh line 2", "ssh line 3"]
    record = box.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded" and record["target"] == "box"
    assert record["remote_dir"] == f"{box.remote_workdir}/{rid}"
    assert (Path(record["remote_dir"]) / "plugin" / "sitecustomize.py").exists()


def test_a_cancel_on_an_ssh_target_ends_the_job_and_list_shows_the_run(box: DaemonProc) -> None:
    from trainer_plugin.tools import jobctl

    rid = start(box, "sleep", "120")
    record = box.wait_state(rid, "running")
    handle = jobctl.read_handle(record["remote_dir"])
    assert handle is not None and jobctl.handle_alive(handle)
    listed = {r["id"]: r["state"] for r in json.loads(box.cli("train", "list", "--json").stdout)}
    assert listed[rid] == "running"
    out = box.cli("train", "cancel", rid, "--wait")
    assert out.returncode == 0, out.stderr
    assert box.record(rid)["state"] == "cancelled"
    assert not jobctl.handle_alive(handle)  # the job's process on the host is gone
    listed = {r["id"]: r["state"] for r in json.loads(box.cli("train", "list", "--json").stdout)}
    assert listed[rid] == "cancelled"


def test_targets_list_and_check_on_the_command_line(box: DaemonProc) -> None:
    listed = json.loads(box.cli("targets", "list", "--json").stdout)
    kinds = {r["name"]: r["kind"] for r in listed}
    assert kinds["box"] == "ssh" and kinds["local"] == "local"
    out = box.cli("targets", "check", "box", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    checks = {c["check"]: c["ok"] for c in json.loads(out.stdout)}
    assert checks and all(checks.values()), checks
    missing = box.cli("targets", "check", "nowhere")
    assert missing.returncode == 2 and "nowhere" in missing.stderr


def test_a_failing_job_on_an_ssh_target_is_failed_with_its_last_lines(box: DaemonProc) -> None:
    rid = start(box, "sh", "-c", "echo 'CUDA out of memory. Tried to allocate 2.00 GiB'; exit 1")
    record = box.wait_state(rid, "failed", "succeeded")
    assert record["exit_code"] == 1 and "ran out of memory" in record["message"]


def test_cwd_is_uploaded_without_git_venvs_and_caches(box: DaemonProc, short_tmp: Path) -> None:
    src = short_tmp / "project"
    (src / ".git").mkdir(parents=True)
    (src / ".git" / "HEAD").write_text("ref")
    (src / "env").mkdir()
    (src / "env" / "pyvenv.cfg").write_text("home = /usr")
    (src / "__pycache__").mkdir()
    (src / "pkg").mkdir()
    (src / "pkg" / "data.txt").write_text("payload")
    (src / "train.py").write_text("import os; print(sorted(os.listdir('.'))); print(open('pkg/data.txt').read())")
    rid = start(box, PY, "train.py", opts=("--cwd", str(src)))
    record = box.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    log = box.cli("train", "logs", rid).stdout.splitlines()
    assert log[0] == str(["pkg", "train.py"]) and log[1] == "payload"


def test_a_cwd_that_does_not_exist_here_is_refused_before_anything_is_sent(box: DaemonProc, short_tmp: Path) -> None:
    out = box.cli("train", "start", "--target", "box", "--cwd", str(short_tmp / "no-such-project"), "--", "true")
    assert out.returncode == 2 and "no-such-project: no such directory" in out.stderr
    assert box.cli("train", "list", "--json").stdout.strip() in ("[]", "")


def test_a_profiled_run_on_an_ssh_target_wraps_the_job_with_the_targets_python(box: DaemonProc) -> None:
    rid = start(box, "sh", "-c", "echo profiled", opts=("--profile",))
    record = box.wait_state(rid, "succeeded", "failed")
    assert record["state"] == "succeeded", record["message"]
    command = json.loads((Path(record["remote_dir"]) / "job.json").read_text())["command"]
    assert command[0] == PY and command[1].endswith("/plugin/wrap.py")  # the target's `python`, not python3


def test_a_stop_on_an_ssh_target_falls_back_to_cancel_when_no_proof_comes(box: DaemonProc) -> None:
    rid = start(box, PY, FAKE, "ignore")
    wait_for(lambda: box.record(rid)["snapshots"], 30, what="the plugin's begin line")
    out = box.cli("train", "stop", rid, "--wait")
    assert out.returncode == 3
    assert "no snapshot within 4 s" in box.record(rid)["message"]


def test_a_request_written_on_the_host_by_someone_else_is_seen_and_honoured(box: DaemonProc) -> None:
    rid = start(box, PY, FAKE, "hang-after")
    record = wait_for(lambda: (r := box.record(rid))["snapshots"] and r, 30, what="the plugin's begin line")
    (Path(record["remote_dir"]) / "snapshot.request").write_text("disk\n")
    record = box.wait_state(rid, "stopped", "failed", "cancelled", timeout=60)
    assert record["state"] == "stopped" and record["stop"]["reason"] == "disk"


def test_the_tiny_lora_run_snapshots_and_resumes_on_an_ssh_target(lora_box: DaemonProc) -> None:
    box = lora_box
    rid = start(box, PY, WORKLOAD, "--tiny", "--max_steps", "400")
    wait_for(lambda: (r := box.record(rid))["snapshots"] and (r["progress"]["step"] or 0) >= 2, 180, 0.2, "step 2")
    out = box.cli("train", "stop", rid, "--wait", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    snap = json.loads(out.stdout)["snapshot"]
    resumed = start(box, PY, WORKLOAD, "--tiny", "--max_steps", str(snap["step"] + 2), opts=("--resume-from", rid))
    final = box.wait_state(resumed, "succeeded", "failed", timeout=180)
    assert final["state"] == "succeeded", final["message"]
    assert final["resume_checkpoint"].endswith(f"{rid}/output/checkpoint-{snap['step']}")
    begin = json.loads((Path(final["remote_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
    assert begin["start_step"] == snap["step"]


def test_a_host_that_goes_away_mid_follow_leaves_the_run_running_and_it_is_picked_up_again(
    box: DaemonProc, sshd: SshServer
) -> None:
    rid = start(box, "sh", "-c", "sleep 3; echo done")
    box.wait_state(rid, "running")
    sshd.kill()
    since = wait_for(lambda: box.record(rid)["unreachable_since"], 30, 0.1, "the host to be seen unreachable")
    assert box.record(rid)["state"] == "running"
    assert "unreachable since" in box.cli("train", "status", rid).stdout
    time.sleep(3.5)  # the job ends while the host cannot be reached
    sshd.start()
    record = box.wait_state(rid, "succeeded", "failed", timeout=60)
    assert record["state"] == "succeeded" and record["unreachable_since"] is None
    assert since > 0


def test_logs_follow_waits_out_a_host_that_goes_away_and_goes_on_where_it_was(box: DaemonProc, sshd: SshServer) -> None:
    import subprocess

    rid = start(box, "sh", "-c", "for i in $(seq 1 40); do echo line $i; sleep 0.2; done")
    box.wait_state(rid, "running")
    follow = subprocess.Popen(
        [PY, "-m", "daemon.cli", "train", "logs", rid, "--follow"], env=box.env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(1.0)
        sshd.kill()
        time.sleep(3.0)  # reads fail while the host is away; the job writes on
        sshd.start()
        out, err = follow.communicate(timeout=90)
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    assert out.splitlines() == [f"line {i}" for i in range(1, 41)]  # nothing lost, nothing twice
    assert "waiting for the target" in err and "the target answers again" in err


CUT_AFTER_START = """#!{py}
# The target's `python`: the first `jobctl.py start` starts the job, then ends this SSH
# connection (its sshd process) before the handle is printed, as a network drop would.
import os, signal, subprocess, sys, time
REAL, SSHD, MARK = {py!r}, {sshd_pid}, {mark!r}
if sys.argv[2:3] == ["start"] and not os.path.exists(MARK):
    open(MARK, "w").close()
    subprocess.run([REAL, *sys.argv[1:]], stdout=subprocess.DEVNULL)
    pid = os.getpid()
    while pid > 1:
        with open(f"/proc/{{pid}}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        if parent == SSHD:
            os.kill(pid, signal.SIGKILL)
        pid = parent
    time.sleep(30)
os.execv(REAL, [REAL, *sys.argv[1:]])
"""


def test_a_start_whose_connection_drops_is_adopted_when_the_job_did_start(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    workdir = short_tmp / "remote"
    python = short_tmp / "python-cut"
    python.write_text(CUT_AFTER_START.format(py=PY, sshd_pid=sshd.pid, mark=str(short_tmp / "cut-once")))
    python.chmod(0o755)
    d = make_daemon(ssh_config(sshd, workdir).replace(f'python = "{PY}"', f'python = "{python}"'))
    d.start()
    try:
        rid = start(d, "sh", "-c", "sleep 2; echo the one job")
        record = d.wait_state(rid, "succeeded", "failed", timeout=90)
        assert record["state"] == "succeeded", record["message"]
        notes = " ".join(h["reason"] for h in record["history"])
        assert "the answer to the start was lost" in notes and "re-attached" in notes
        assert d.cli("train", "logs", rid).stdout == "the one job\n"  # started once, never twice
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


def test_an_unreachable_host_at_start_fails_the_run_clearly(make_daemon, short_tmp: Path) -> None:
    from tests.sshd import free_port

    d = make_daemon(
        FAST_CONFIG + f'\n[targets.gone]\nkind = "ssh"\nhost = "127.0.0.1"\nport = {free_port()}\nconnect_timeout = 2\n'
    )
    d.start()
    out = d.cli("train", "start", "--target", "gone", "--", "true")
    rid = out.stdout.strip()
    record = d.wait_state(rid, "failed", timeout=60)
    assert "launch failed" in record["message"] and "127.0.0.1" in record["message"]


def test_a_secret_reaches_the_job_but_no_command_line_on_either_side(box: DaemonProc, short_tmp: Path) -> None:
    secret = "s3cr3t-" + os.urandom(6).hex()
    out_file = short_tmp / "seen"
    script = f"import os, time; open({str(out_file)!r}, 'w').write(os.environ['HF_TOKEN']); time.sleep(3)"
    rid = start(box, PY, "-c", script, opts=("--secret", "HF_TOKEN"), env={"HF_TOKEN": secret})
    wait_for(out_file.exists, 30, what="the job to see its secret")
    assert out_file.read_text() == secret
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            assert secret.encode() not in cmdline.read_bytes(), cmdline
        except OSError:
            continue
    record = box.wait_state(rid, "succeeded", "failed")
    assert record["secret_names"] == ["HF_TOKEN"]
    assert secret not in json.dumps(record)
    assert secret not in box.log_path.read_text()
    assert secret not in (box.state_dir / "runs" / rid / "run.json").read_text()


def test_a_secret_the_target_lists_comes_from_the_daemons_environment(
    make_daemon, sshd: SshServer, short_tmp: Path
) -> None:
    secret = "hub-" + os.urandom(6).hex()
    workdir = short_tmp / "remote"
    d = make_daemon(ssh_config(sshd, workdir, 'secrets = ["HUB_TOKEN"]\n'))
    d.env["HUB_TOKEN"] = secret
    d.start()
    try:
        out_file = short_tmp / "seen"
        script = f"import os; open({str(out_file)!r}, 'w').write(os.environ['HUB_TOKEN'])"
        rid = start(d, PY, "-c", script)  # no --secret, and the client's environment lacks it
        record = d.wait_state(rid, "succeeded", "failed")
        assert record["state"] == "succeeded", record["message"]
        assert out_file.read_text() == secret and record["secret_names"] == ["HUB_TOKEN"]
        assert secret not in d.log_path.read_text() and secret not in json.dumps(record)
    finally:
        kill_job_groups(workdir.glob("*/job.pid"))


def test_a_secret_the_target_lists_but_nobody_has_refuses_the_start() -> None:
    from daemon.service.api import ApiError
    from daemon.service.launch import target_secrets

    with pytest.raises(ApiError, match=r"HUB_TOKEN.*systemctl edit obd") as err:
        target_secrets("box", ["HUB_TOKEN"], {}, {})
    assert err.value.kind == "usage"
    # The client's --secret wins over the daemon's environment.
    assert target_secrets("box", ["HUB_TOKEN"], {"HUB_TOKEN": "mine"}, {"HUB_TOKEN": "daemon's"}) == {
        "HUB_TOKEN": "mine"
    }
    assert target_secrets("box", ["A"], {"B": "b"}, {"A": "a"}) == {"A": "a", "B": "b"}


def test_a_run_stopped_on_this_machine_resumes_on_an_ssh_target_with_its_checkpoint_copied(box: DaemonProc) -> None:
    job = str(REPO / "tests" / "bench" / "custom_loop_job.py")
    local = box.cli("train", "start", "--", PY, job, "0.05").stdout.strip()
    wait_for(lambda: box.record(local)["snapshots"], 30, what="the plugin's begin line")
    assert box.cli("train", "stop", local, "--wait").returncode == 0
    snap = box.record(local)["snapshot"]
    script = "import os; p = os.environ['OBD_RESUME_FROM']; print(p); print(sorted(os.listdir(p)))"
    resumed = start(box, PY, "-c", script, opts=("--resume-from", local))
    record = box.wait_state(resumed, "succeeded", "failed", timeout=60)
    assert record["state"] == "succeeded", record["message"]
    path, files = box.cli("train", "logs", resumed).stdout.splitlines()[:2]
    assert path == f"{record['remote_dir']}/resume/checkpoint-{snap['step']}"
    assert files == str(["state.bin"])
