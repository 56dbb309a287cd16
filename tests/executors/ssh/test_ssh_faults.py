"""Faults of an SSH target: unreachable hosts, host keys, wrong keys, bad workdirs, full disks,
and sshd dying under a running job."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import anyio
import pytest

from executors.base import ExecutorError, JobState, TargetUnreachable
from executors.check import check_target
from executors.ssh import AuthError, HostKeyError, SshExecutor, WorkdirError
from tests.executors.ssh.helpers import job, make_target, wait_file, wait_state
from tests.sshd import SshServer, _children, free_port, write_key_pair


async def test_a_closed_port_raises_target_unreachable_fast_and_backs_off(own_sshd: SshServer, workdir: Path) -> None:
    port = free_port()
    ex = SshExecutor("gone", make_target(own_sshd, workdir, port=port), backoff_base=5)
    started = time.monotonic()
    with pytest.raises(TargetUnreachable, match=rf"127\.0\.0\.1:{port}.*refused"):
        await ex.probe([(None, str(workdir / "r"))])
    assert time.monotonic() - started < 2
    assert ex.unreachable_since is not None
    connects = ex.connects
    with pytest.raises(TargetUnreachable, match="next attempt in"):
        await ex.read_from(str(workdir / "x"), 0, 10)
    assert ex.connects == connects  # within the backoff, no new attempt


async def test_a_host_that_never_speaks_ssh_times_out_after_connect_timeout(own_sshd: SshServer, workdir: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(5)
    try:
        ex = SshExecutor("mute", make_target(own_sshd, workdir, port=listener.getsockname()[1], connect_timeout=1))
        started = time.monotonic()
        with pytest.raises(TargetUnreachable, match="cannot reach"):
            await ex.connect()
        assert time.monotonic() - started < 3
    finally:
        listener.close()


async def test_a_changed_host_key_is_refused_with_the_command_that_fixes_it(own_sshd: SshServer, workdir: Path) -> None:
    own_sshd.rotate_host_key()
    own_sshd.restart()
    ex = SshExecutor("box", make_target(own_sshd, workdir))
    with pytest.raises(HostKeyError) as caught:
        await ex.connect()
    message = str(caught.value)
    assert "CHANGED" in message
    fix = f"ssh-keygen -R '[127.0.0.1]:{own_sshd.port}' -f {own_sshd.known_hosts}"
    assert fix in message
    assert not workdir.exists()
    subprocess.run(fix, shell=True, check=True, capture_output=True)  # the fix works as printed
    own_sshd.write_known_hosts()
    ex2 = SshExecutor("box", make_target(own_sshd, workdir))
    await ex2.connect()
    await ex2.aclose()


async def test_an_unknown_host_is_refused_by_default_and_trusted_on_first_use_when_allowed(
    own_sshd: SshServer, workdir: Path, tmp_path: Path
) -> None:
    known = tmp_path / "fresh" / "known_hosts"
    ex = SshExecutor("new", make_target(own_sshd, workdir, known_hosts=known))
    with pytest.raises(HostKeyError, match=r"is not in .*accept_unknown_host = true in \[targets.new\]"):
        await ex.connect()
    tofu = SshExecutor("new", make_target(own_sshd, workdir, known_hosts=known, accept_unknown_host=True))
    await tofu.connect()
    assert tofu.host_key_status == "accepted"
    assert known.read_text().split() == [f"[127.0.0.1]:{own_sshd.port}", *own_sshd.host_key_line.split()[:2]]
    await tofu.aclose()
    later = SshExecutor("new", make_target(own_sshd, workdir, known_hosts=known))
    await later.connect()
    assert later.host_key_status == "known"
    await later.aclose()


async def test_a_pinned_host_key_replaces_known_hosts_and_a_different_key_is_refused(
    own_sshd: SshServer, workdir: Path, tmp_path: Path
) -> None:
    nowhere = tmp_path / "no_known_hosts"
    ex = SshExecutor("pod", make_target(own_sshd, workdir, known_hosts=nowhere), host_key=own_sshd.host_key_line)
    await ex.connect()
    assert ex.host_key_status == "pinned"
    await ex.aclose()
    other = write_key_pair(tmp_path / "other_key")
    bad = SshExecutor("pod", make_target(own_sshd, workdir, known_hosts=nowhere), host_key=other)
    with pytest.raises(HostKeyError, match="not the key pinned"):
        await bad.connect()
    assert not nowhere.exists()


async def test_a_wrong_key_is_refused_with_a_clear_message(own_sshd: SshServer, workdir: Path, tmp_path: Path) -> None:
    write_key_pair(tmp_path / "stranger")
    ex = SshExecutor("box", make_target(own_sshd, workdir, identity_file=tmp_path / "stranger"))
    with pytest.raises(AuthError, match=r"permission denied.*authorized_keys.*ssh-copy-id"):
        await ex.connect()
    missing = SshExecutor("box", make_target(own_sshd, workdir, identity_file=tmp_path / "nope"))
    with pytest.raises(ExecutorError, match="cannot be read"):
        await missing.connect()


async def test_a_workdir_that_cannot_be_created_is_a_clear_error(shared_sshd: SshServer, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    ex = SshExecutor("box", make_target(shared_sshd, blocker / "obd"))
    with pytest.raises(
        WorkdirError, match=r"workdir .* cannot be created .*Not a directory.*Set workdir in \[targets.box\]"
    ):
        await ex.connect()
    checks = {c["check"]: c for c in await check_target(ex)}
    assert checks["reachable"]["ok"] and not checks["workdir writable"]["ok"]
    assert checks["python found"]["detail"].startswith("not checked")


@pytest.fixture
def tiny_disk(tmp_path: Path) -> object:
    """A 256 KiB tmpfs, standing for a remote disk that fills up (needs root and mount)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True, text=True, check=False
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here to fill a disk ({r.stderr.strip()}); run as root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_a_full_disk_fails_put_file_and_leaves_the_old_file_intact(
    shared_sshd: SshServer, tiny_disk: Path
) -> None:
    ex = SshExecutor("box", make_target(shared_sshd, tiny_disk / "wd"))
    try:
        path = tiny_disk / "wd" / "run" / "snapshot.request"
        await ex.put_file(str(path), b"requested")
        with pytest.raises(ExecutorError, match=r"could not write .*intact.*df -h"):
            await ex.put_file(str(path), os.urandom(1 << 20))
        assert path.read_bytes() == b"requested"
        assert sorted(p.name for p in path.parent.iterdir()) == ["snapshot.request"]  # no temporary left
        await ex.put_file(str(path), b"disk")  # and the executor still works
        assert path.read_bytes() == b"disk"
    finally:
        await ex.aclose()


async def test_a_job_survives_the_connection_closing_and_sshd_being_killed_and_restarted(
    own_executor: SshExecutor, own_sshd: SshServer, workdir: Path
) -> None:
    ex = own_executor
    run = workdir / "long"
    gate = run / "gate"
    handle = await ex.spawn(job(run, f"echo started; while [ ! -e {gate} ]; do sleep 0.05; done; echo done"))
    await wait_file(run / "job.log")
    await ex.aclose()  # the daemon going away closes the connection
    assert (await ex.status(handle, str(run))).state == JobState.running  # and a new one picks up
    connects = ex.connects
    own_sshd.kill()  # sshd and every connection it served
    started = time.monotonic()
    with pytest.raises(TargetUnreachable):
        await ex.status(handle, str(run))
    assert time.monotonic() - started < 2
    os.killpg(handle.pid, 0)  # the job runs on
    own_sshd.start()
    with anyio.fail_after(10):
        while True:
            try:
                status = await ex.status(handle, str(run))
                break
            except TargetUnreachable:
                await anyio.sleep(0.1)
    assert status.state == JobState.running
    assert ex.connects > connects and ex.unreachable_since is None
    gate.touch()
    assert (await wait_state(ex, handle, str(run))).exit_code == 0
    assert await ex.read_from(str(run / "job.log"), 0, 100) == b"started\ndone\n"


async def test_concurrent_callers_share_one_reconnect_attempt(own_sshd: SshServer, workdir: Path) -> None:
    ex = SshExecutor("box", make_target(own_sshd, workdir), backoff_base=1.0, backoff_cap=1.0)
    await ex.connect()
    own_sshd.kill()
    with anyio.fail_after(5):  # let the client notice, so no caller retries on the dead connection
        while ex.connection.session is not None and ex.connection.session.alive:
            await anyio.sleep(0.02)
    connects = ex.connects
    errors: list[BaseException] = []

    async def call() -> None:
        try:
            await ex.read_from(str(workdir / "x"), 0, 10)
        except TargetUnreachable as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(call)
    assert len(errors) == 20
    assert ex.connects - connects == 1
    own_sshd.start()
    await anyio.sleep(1.05)  # past the backoff
    results: list[bytes] = []

    async def ok() -> None:
        results.append(await ex.read_from(str(workdir / ".obd" / "check-none"), 0, 10))

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(ok)
    assert results == [b""] * 20
    assert ex.connects - connects == 2
    await ex.aclose()


async def test_an_operation_that_hangs_is_abandoned_and_reported_unreachable(
    own_sshd: SshServer, workdir: Path
) -> None:
    ex = SshExecutor("box", make_target(own_sshd, workdir))
    await ex.connect()  # with the usual timeout: setting the workdir up may take over 1 s on a loaded machine
    ex.connection.op_timeout = 1
    pid = own_sshd.pid
    assert pid is not None
    stopped = [pid, *_children(pid)]
    for p in stopped:  # freeze sshd and its sessions: the host stops answering, the TCP stays up
        os.kill(p, 19)
    try:
        started = time.monotonic()
        with pytest.raises(TargetUnreachable, match="did not answer"):
            await ex.probe([(None, str(workdir))])
        assert time.monotonic() - started < 10  # abandoned after about op_timeout, not the usual 60 s
    finally:
        for p in stopped:
            os.kill(p, 18)
        await ex.aclose()
