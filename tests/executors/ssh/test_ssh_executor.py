"""The SSH executor end to end against a real sshd on loopback (the "host" is this machine)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import anyio
import pytest

from executors import remote
from executors.base import ExecutorError, JobHandle, JobSpec, JobState, JobStatus
from executors.check import check_target
from executors.ssh import SshExecutor
from tests.executors.ssh.helpers import group_environs, job, make_target, wait_file, wait_state
from tests.sshd import SshServer


async def test_a_job_runs_to_its_exit_code_and_its_log_is_read_by_offset_with_nothing_read_twice(
    executor: SshExecutor, workdir: Path
) -> None:
    run = workdir / "r1"
    gate = run / "go"
    handle = await executor.spawn(
        job(
            run,
            f"echo one; while [ ! -e {gate} ]; do sleep 0.02; done; echo two; echo $OBD_X; exit 7",
            env={"OBD_X": "three"},
        )
    )
    assert handle.host == f"{executor.target.host}:{executor.target.port}"
    assert (await executor.status(handle, str(run))).state == JobState.running
    await wait_file(run / "job.log")
    with anyio.fail_after(5):
        while (run / "job.log").stat().st_size < 4:
            await anyio.sleep(0.02)
    first = await executor.read_from(str(run / "job.log"), 0, 1 << 20)
    assert first == b"one\n"
    assert await executor.read_from(str(run / "job.log"), len(first), 1 << 20) == b""
    gate.touch()
    status = await wait_state(executor, handle, str(run))
    assert status == JobStatus(state=JobState.exited, exit_code=7)
    rest = await executor.read_from(str(run / "job.log"), len(first), 1 << 20)
    assert rest == b"two\nthree\n"
    assert await executor.read_from(str(run / "job.log"), 4, 3) == b"two"
    assert await executor.read_from(str(run / "missing.log"), 0, 100) == b""
    spec = json.loads((run / "job.json").read_text())
    assert spec["pythonpath"] == [f"{run}/plugin"]


async def test_put_file_replaces_the_file_atomically_and_creates_its_directories(
    executor: SshExecutor, workdir: Path
) -> None:
    path = workdir / "deep" / "er" / "file.json"
    await executor.put_file(str(path), b"first")
    assert path.read_bytes() == b"first"
    inode = path.stat().st_ino
    await executor.put_file(str(path), b"second" * 10000)
    assert path.read_bytes() == b"second" * 10000
    assert path.stat().st_ino != inode  # a new file renamed over the old one, not rewritten in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["file.json"]  # no temporary left


async def test_upload_copies_a_tree_but_leaves_out_vcs_caches_and_virtual_environments(
    executor: SshExecutor, workdir: Path, tmp_path: Path
) -> None:
    src = tmp_path / "project"
    for rel in [
        "train.py",
        "pkg/mod.py",
        "data/a b.txt",
        "pkg/__pycache__/mod.pyc",
        ".git/HEAD",
        ".venv/bin/python",
        "venv/x",
        "env/pyvenv.cfg",
        "env/lib/x.py",
        "node_modules/m.js",
        ".pytest_cache/v",
        ".mypy_cache/c",
        "deep/a/b/c/d.txt",
    ]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(rel)
    (src / "train.py").chmod(0o755)
    (src / "link").symlink_to("train.py")
    dest = workdir / "run" / "cwd"
    await executor.upload(src, str(dest))
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if not p.is_dir())
    assert got == ["data/a b.txt", "deep/a/b/c/d.txt", "link", "pkg/mod.py", "train.py"]
    assert (dest / "pkg/mod.py").read_text() == "pkg/mod.py"
    assert os.readlink(dest / "link") == "train.py"
    assert (dest / "train.py").stat().st_mode & 0o777 == 0o755
    single = workdir / "one" / "file.py"
    await executor.upload(src / "train.py", str(single))
    assert single.read_text() == "train.py"


async def test_download_copies_a_file_and_a_tree_back(executor: SshExecutor, workdir: Path, tmp_path: Path) -> None:
    out = workdir / "run" / "output"
    for rel, data in {
        "checkpoint-2/model.bin": b"\0" * 300_000,
        "checkpoint-2/cfg.json": b"{}",
        "log.txt": b"x",
    }.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    (out / "latest").symlink_to("checkpoint-2")
    local = tmp_path / "back" / "output"
    await executor.download(str(out), local)
    assert (local / "checkpoint-2/model.bin").read_bytes() == b"\0" * 300_000
    assert (local / "checkpoint-2/cfg.json").read_bytes() == b"{}"
    assert os.readlink(local / "latest") == "checkpoint-2"
    await executor.download(str(out / "log.txt"), tmp_path / "single.txt")
    assert (tmp_path / "single.txt").read_bytes() == b"x"
    await executor.download(str(workdir / "nothing-here"), tmp_path / "absent")
    assert not (tmp_path / "absent").exists()


async def test_the_connection_moves_its_bytes_with_aes_gcm_which_a_server_with_default_ciphers_offers(
    executor: SshExecutor,
) -> None:
    # asyncssh's first choice, ChaCha20-Poly1305, moved half the bytes a second here
    # (tests/bench/bench_carry.py): uploads and a checkpoint's carry feel it.
    session = await executor.connection.ensure()
    assert session.conn.get_extra_info("send_cipher") == "aes128-gcm@openssh.com"
    assert session.conn.get_extra_info("recv_cipher") == "aes128-gcm@openssh.com"


async def test_cancel_kills_a_job_that_ignores_sigterm_after_the_grace_and_is_idempotent(
    executor: SshExecutor, workdir: Path
) -> None:
    run = workdir / "stubborn"
    ready = run / "ready"
    handle = await executor.spawn(job(run, f"trap '' TERM; touch {ready}; while :; do sleep 0.05; done"))
    await wait_file(ready)
    started = time.monotonic()
    status = await executor.cancel(handle, str(run), grace=0.5)
    took = time.monotonic() - started
    assert status.state == JobState.cancelled
    assert 0.5 <= took < 5
    assert json.loads((run / "cancelled").read_text())["killed"] is True
    with pytest.raises(ProcessLookupError):
        os.killpg(handle.pid, 0)
    again = await executor.cancel(handle, str(run), grace=0.5)
    assert again.state == JobState.cancelled
    assert (await executor.status(handle, str(run))).state == JobState.cancelled


async def test_cancel_never_signals_a_finished_job(executor: SshExecutor, workdir: Path) -> None:
    run = workdir / "done"
    handle = await executor.spawn(job(run, "exit 0"))
    assert await wait_state(executor, handle, str(run)) == JobStatus(state=JobState.exited, exit_code=0)
    status = await executor.cancel(handle, str(run), grace=0.1)
    assert status == JobStatus(state=JobState.exited, exit_code=0)
    assert not (run / "cancelling").exists()


async def test_probe_of_many_runs_costs_one_round_trip(executor: SshExecutor, workdir: Path) -> None:
    runs: list[tuple[JobHandle | None, str]] = [(None, str(workdir / f"many-{i}")) for i in range(12)]

    async def start(i: int) -> None:
        runs[i] = (await executor.spawn(job(workdir / f"many-{i}", "sleep 30" if i % 2 else "exit 3")), runs[i][1])

    async with anyio.create_task_group() as tg:  # concurrent spawns share the one connection
        for i in range(12):
            tg.start_soon(start, i)
    (workdir / "many-4" / "snapshot.request").write_text("disk")
    runs.append((None, str(workdir / "never-started")))
    await anyio.sleep(0.3)
    before = executor.round_trips
    probes = await executor.probe(runs)
    assert executor.round_trips - before == 1
    assert [p.remote_dir for p in probes] == [d for _, d in runs]
    states = [p.status.state for p in probes]
    assert states[:12] == [JobState.exited if i % 2 == 0 else JobState.running for i in range(12)]
    assert states[12] == JobState.lost
    assert probes[4].request == "disk"
    async with anyio.create_task_group() as tg:
        for handle, run in runs[1:12:2]:
            assert handle is not None
            tg.start_soon(executor.cancel, handle, run, 0.2)
    assert executor.connects == 1


async def test_hostile_paths_and_arguments_are_passed_through_literally(
    executor: SshExecutor, workdir: Path, tmp_path: Path
) -> None:
    canary = tmp_path / "pwned"
    nasty = f"run $(touch {canary}) `touch {canary}`; touch {canary} 'q' \"dq\" \\ & | > <"
    run = workdir / nasty
    args = [f"$(touch {canary})", "; rm -rf /", "it's", '"x"', "a b", "*", "$HOME", "\\n"]
    handle = await executor.spawn(
        JobSpec(
            run_id="nasty",
            remote_dir=str(run),
            command=[sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *args],
        )
    )
    status = await wait_state(executor, handle, str(run))
    assert status.exit_code == 0
    assert json.loads(await executor.read_from(str(run / "job.log"), 0, 10_000)) == args
    await executor.put_file(str(run / "x $(y).txt"), b"ok")
    assert (run / "x $(y).txt").read_bytes() == b"ok"
    await executor.cancel(handle, str(run), grace=0.1)
    assert not canary.exists()


async def test_secrets_reach_the_job_environment_but_no_command_line_and_no_log(
    executor: SshExecutor, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = "s3cr3t-" + os.urandom(8).hex()
    run = workdir / "secret"
    script = 'printf %s "$HF_TOKEN" | sha256sum > "$OBD_DIR/hash"; sleep 30'
    seen_in: list[str] = []
    done = False

    def scan() -> None:
        """Read every process's command line, over and over, until the job has started."""
        while True:
            last = done
            for pid in os.listdir("/proc"):
                if pid.isdigit():
                    try:
                        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                    except OSError:
                        continue
                    if secret.encode() in cmdline:
                        seen_in.append(cmdline.decode(errors="replace"))
            if last:
                return

    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, scan)
        handle = await executor.spawn(job(run, script, env={"OBD_DIR": str(run)}, secrets={"HF_TOKEN": secret}))
        await wait_file(run / "hash")
        done = True
    assert (run / "hash").read_text().split()[0] == hashlib.sha256(secret.encode()).hexdigest()
    assert seen_in == []
    assert any(f"HF_TOKEN={secret}".encode() in environ.split(b"\0") for environ in group_environs(handle.pid))
    for path in run.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    await executor.cancel(handle, str(run), grace=0.2)
    captured = capsys.readouterr()
    assert secret not in captured.out + captured.err


async def test_the_job_s_environment_reaches_it_through_stdin_never_through_job_json(
    executor: SshExecutor, workdir: Path
) -> None:
    run = workdir / "env"
    value = "v-" + os.urandom(6).hex()
    handle = await executor.spawn(
        job(run, 'printf %s "$MY_SETTING" > "$OBD_DIR/seen"', env={"MY_SETTING": value, "OBD_DIR": str(run)})
    )
    assert (await wait_state(executor, handle, str(run))).exit_code == 0
    assert (run / "seen").read_text() == value
    assert value.encode() not in (run / "job.json").read_bytes()


async def test_the_workdir_tilde_is_resolved_on_the_host(shared_sshd: SshServer) -> None:
    name = f"obd-test-{os.urandom(4).hex()}"
    ex = SshExecutor("home", make_target(shared_sshd, f"~/{name}"))
    try:
        resolved = await ex.resolve_workdir()
        assert resolved == str(Path.home() / name)
        assert ex.workdir == resolved
        assert (Path(remote.jobctl_remote_path(resolved))).is_file()
    finally:
        await ex.aclose()
        import shutil

        shutil.rmtree(Path.home() / name, ignore_errors=True)


async def test_the_job_tools_are_installed_once_under_their_content_hash(executor: SshExecutor, workdir: Path) -> None:
    await executor.connect()
    installed = list((workdir / ".obd").glob("tools-*"))
    assert [p.name for p in installed] == [f"tools-{remote.JOBCTL_HASH}"]
    for tool in remote.TOOL_FILES:
        assert (installed[0] / tool.name).read_bytes() == tool.read_bytes()
    await executor.aclose()
    await executor.connect()  # a second connection finds them there
    assert list((workdir / ".obd").glob("tools-*")) == installed


async def test_a_python_that_is_not_there_is_reported_with_what_to_set(shared_sshd: SshServer, workdir: Path) -> None:
    ex = SshExecutor("nopy", make_target(shared_sshd, workdir, python="/nonexistent/python3"))
    try:
        await ex.connect()  # the connection itself works
        with pytest.raises(ExecutorError, match=r"Python .*not found.*set `python` or `venv` in \[targets.nopy\]"):
            await ex.spawn(job(workdir / "r", "true"))
    finally:
        await ex.aclose()


async def test_a_venv_target_runs_the_job_with_the_venv_first_on_path(
    shared_sshd: SshServer, workdir: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "my venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    ex = SshExecutor("venv", make_target(shared_sshd, workdir, venv=str(venv)))
    try:
        run = workdir / "v"
        handle = await ex.spawn(job(run, 'echo "$PATH"'))
        await wait_state(ex, handle, str(run))
        assert (await ex.read_from(str(run / "job.log"), 0, 4096)).decode().startswith(f"{venv}/bin:")
    finally:
        await ex.aclose()


async def test_check_target_reports_each_check(executor: SshExecutor, workdir: Path) -> None:
    checks = {c["check"]: c for c in await check_target(executor)}
    assert list(checks) == [
        "reachable",
        "host key known",
        "workdir writable",
        "python found",
        "torch found",
        "free disk",
        "helper",
    ]
    for name in ["reachable", "host key known", "workdir writable", "python found", "free disk", "helper"]:
        assert checks[name]["ok"], checks[name]
    assert checks["python found"]["detail"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")
    assert "GB" in checks["free disk"]["detail"]
    assert checks["torch found"]["detail"]
