"""The Python API (issue 27 item 2, docs/python-api.md): `from obd import Client` and `AsyncClient`
drive a whole run of a real Trainer script against a real daemon (start, wait for running, stop
with a verified snapshot, resume, logs followed to the end, metrics, outputs copied), report the
command's errors as exceptions carrying the command's exit codes, and `import obd` stays light."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import obd
from daemon.cli.common import EXIT_ERROR, EXIT_UNREACHABLE, EXIT_USAGE
from tests.conftest import FAST_CONFIG, REPO, DaemonProc

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
STEPS = 10


@pytest.fixture
def box(make_daemon, monkeypatch: pytest.MonkeyPatch) -> DaemonProc:
    """A daemon of the test's own, found by `Client()` as the command finds it (OBD_SOCKET)."""
    d = make_daemon(FAST_CONFIG)
    d.start()
    for name in ("OBD_SOCKET", "OBD_CONFIG", "OBD_STATE_DIR"):
        monkeypatch.setenv(name, d.env[name])
    return d


def trainer(save_steps: int = 0) -> list[str]:
    """A plain Trainer script that knows nothing of obd: STEPS steps of 0.3 s, a save every `save_steps`."""
    return [
        PY,
        PLAIN,
        "--output_dir",
        "out",
        "--max_steps",
        str(STEPS),
        "--step-sleep",
        "0.3",
        "--save_steps",
        str(save_steps),
    ]


def cli(d: DaemonProc, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return d.cli(*args, env=env)


class Interrupted(Exception):
    """What a SIGALRM raises here, as Ctrl-C raises KeyboardInterrupt."""


@contextlib.contextmanager
def interrupted_after(seconds: float) -> Iterator[None]:
    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_stopped(stopped: obd.RunStatus) -> None:
    assert stopped.state == "stopped", stopped.message
    assert stopped.snapshot is not None and stopped.snapshot.step >= 2
    assert stopped.snapshot.checkpoint.endswith(f"checkpoint-{stopped.snapshot.step}")


def check_resumed(first: obd.RunStatus, done: obd.RunStatus, lines: list[str]) -> None:
    assert done.state == "succeeded", done.message
    assert done.resumed_from == first.id
    assert done.progress.step == STEPS
    assert f"train ended at step {STEPS} of {STEPS} (rank 0)" in lines  # the last line, followed to the end


def check_outputs(copied: obd.Outputs, to: Path, done: obd.RunStatus) -> None:
    assert copied.to == to.resolve() and copied.id == done.id and copied.files > 0 and copied.bytes > 0
    assert (to / f"checkpoint-{STEPS}" / "trainer_state.json").is_file()


def test_a_whole_trainer_run_through_the_sync_client(box: DaemonProc, short_tmp: Path) -> None:
    with obd.Client() as client:
        assert client.socket == box.socket
        run = client.start(trainer(save_steps=5), cwd=str(short_tmp), name="api-sync", profile=True)
        assert isinstance(run, obd.Run) and run.name == "api-sync"
        running = run.wait("running", timeout=120)
        assert running.state == "running" and running.id == run.id
        # The plugin announced itself and a step ended: a stop now can snapshot.
        status = run.status()
        while not (status.record.get("snapshots") and (status.progress.step or 0) >= 2):
            time.sleep(0.1)
            status = run.status()
        stopped = run.stop(wait=True, timeout=120)
        check_stopped(stopped)
        assert run.status().record["stop"]["asked_by"] == "obd's Python API"

        again = run.resume()
        assert again.id != run.id
        lines = list(again.logs(follow=True))  # until the run ended and its last line was read
        done = again.wait(timeout=120)
        check_resumed(stopped, done, lines)
        assert list(again.logs(tail=1)) == [lines[-1]]

        metrics = again.metrics()
        assert metrics is not None and metrics["steps"] >= 1  # a profiled run's RunMetrics once it ended

        to = short_tmp / "copied"
        check_outputs(again.outputs(to=to), to, done)
        step = stopped.snapshot.step  # the stopped run's snapshot, copied alone
        snap = run.outputs(to=short_tmp / "snapshot", checkpoint=step)
        assert snap.source.name == f"checkpoint-{step}" and (snap.to / "trainer_state.json").is_file()

        listed = {r.id: r for r in client.runs()}
        assert listed[run.id].state == "stopped" and listed[again.id].state == "succeeded"
        assert [r.id for r in client.runs(states="succeeded")] == [again.id]
        assert client.runs(name="no-such-name") == []
        assert client.run("api-sync").id == run.id and client.run(str(done.name)).id == again.id  # by name


def test_start_takes_a_run_file_and_options_over_it_as_the_command_does(
    box: DaemonProc, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("API_SECRET", "s3cret")
    runfile = short_tmp / "run.toml"
    runfile.write_text('name = "from-file"\ncommand = ["sh", "-c", "echo $A $B $API_SECRET"]\nenv = { A = "a" }\n')
    with obd.Client() as client:
        run = client.start(file=runfile, env={"B": "b"}, secrets=["API_SECRET"], name="over")
        done = run.wait(timeout=60)
        assert done.state == "succeeded" and done.name == "over"
        assert list(run.logs()) == ["a b s3cret"]
        assert done.record["secret_names"] == ["API_SECRET"] and "s3cret" not in json.dumps(done.record)

        runfile.write_text('name = "x"\ncomand = ["true"]\n')
        with pytest.raises(obd.BadRequest, match="comand") as typo:
            client.start(file=runfile)
        assert f"{runfile}:2: comand" in str(typo.value) and typo.value.exit_code == EXIT_USAGE


async def test_a_whole_trainer_run_through_the_async_client(box: DaemonProc, short_tmp: Path) -> None:
    async with obd.AsyncClient(socket=box.socket) as client:
        run = await client.start(trainer(save_steps=5), cwd=str(short_tmp), name="api-async")
        assert isinstance(run, obd.AsyncRun)
        await run.wait("running", timeout=120)
        status = await run.status()
        while not (status.record.get("snapshots") and (status.progress.step or 0) >= 2):
            await anyio.sleep(0.1)
            status = await run.status()
        stopped = await run.stop(wait=True, timeout=120)
        check_stopped(stopped)

        again = await run.resume()
        lines = [line async for line in again.logs(follow=True)]
        done = await again.wait(timeout=120)
        check_resumed(stopped, done, lines)
        assert await again.metrics() is None  # not profiled: no RunMetrics, as `obd train metrics` says

        to = short_tmp / "copied"
        check_outputs(await again.outputs(to=to), to, done)
        assert {r.id for r in await client.runs(all=True)} >= {run.id, again.id}


def test_errors_are_the_commands_exceptions_with_its_exit_codes(box: DaemonProc, short_tmp: Path) -> None:
    with obd.Client() as client:
        with pytest.raises(obd.NotFound) as missing:
            client.run("no-such-run").status()
        out = cli(box, "train", "status", "no-such-run")
        assert missing.value.exit_code == out.returncode != 0
        assert isinstance(missing.value, obd.ObdError) and missing.value.kind == "not_found"

        with pytest.raises(obd.BadRequest) as bad:
            client.start(["true"], gpus="many")
        assert (
            bad.value.exit_code == EXIT_USAGE == cli(box, "train", "start", "--gpus", "many", "--", "true").returncode
        )
        with pytest.raises(obd.BadRequest, match="no_such_option"):
            client.start(["true"], no_such_option=1)
        with pytest.raises(obd.BadRequest):
            client.runs(states="sleeping")

        quick = client.start(["sh", "-c", "echo hi"])
        with pytest.raises(obd.RunError) as ended:
            quick.wait("stopped", timeout=60)  # it succeeds instead: never stopped
        assert ended.value.status.state == "succeeded" and ended.value.exit_code == EXIT_ERROR

        slow = client.start(["sleep", "60"])
        with pytest.raises(obd.WaitTimeout) as late:
            slow.wait(timeout=0.5)
        assert late.value.status.state in ("preparing", "running") and isinstance(late.value, TimeoutError)
        # A wait interrupted in its long poll (Ctrl-C in a notebook) leaves no reply behind to be
        # read as the next call's.
        with pytest.raises(Interrupted), interrupted_after(0.5):
            slow.wait()
        assert quick.status().id == quick.id
        assert slow.cancel(wait=True, timeout=60).state == "cancelled"

    gone = short_tmp / "none.sock"
    with pytest.raises(obd.DaemonUnreachable) as unreachable:
        obd.Client(socket=gone).runs()
    out = cli(box, "train", "list", env={"OBD_SOCKET": str(gone)})
    assert unreachable.value.exit_code == EXIT_UNREACHABLE == out.returncode


async def test_the_async_client_raises_the_same_exceptions_and_serves_concurrent_tasks(
    box: DaemonProc, short_tmp: Path
) -> None:
    async with obd.AsyncClient() as client:
        with pytest.raises(obd.NotFound):
            await client.run("no-such-run")
        with pytest.raises(obd.BadRequest):
            await client.start(["true"], gpus="many")
        # Tasks sharing one client take turns on its connection: every answer is its own request's.
        runs = [await client.start(["sh", "-c", f"echo {i}"], name=f"echo-{i}") for i in range(4)]
        found: dict[str, str] = {}

        async def status(run: obd.AsyncRun) -> None:
            found[run.id] = (await run.wait(timeout=60)).name or ""

        async with anyio.create_task_group() as tasks:
            for run in runs:
                tasks.start_soon(status, run)
        assert found == {run.id: f"echo-{i}" for i, run in enumerate(runs)}

        # A wait's long poll does not hold up another task's call; a wait cancelled midway leaves
        # no reply behind to be read as the next call's.
        slow = await client.start(["sleep", "60"], name="slow")
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(slow.wait)
            await anyio.sleep(0.5)
            with anyio.fail_after(3):
                assert (await runs[0].status()).name == "echo-0"
            tasks.cancel_scope.cancel()
        with anyio.move_on_after(0.5):
            await slow.wait()
        assert (await runs[1].status()).name == "echo-1"
        assert (await slow.cancel(wait=True, timeout=60)).state == "cancelled"
    with pytest.raises(obd.DaemonUnreachable):
        await obd.AsyncClient(socket=short_tmp / "none.sock").runs()


def test_importing_obd_imports_no_torch_transformers_pydantic_or_anyio() -> None:
    out = subprocess.run(
        [PY, "-X", "importtime", "-c", "import obd"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "obd" in imported and "daemon.cli.sdk" in imported
    heavy = {m for m in imported if m.split(".")[0] in ("torch", "transformers", "pydantic", "anyio", "structlog")}
    assert heavy == set()
    # Asking for the async client is what brings anyio in.
    probe = (
        "import obd, sys; a = 'anyio' in sys.modules; obd.AsyncClient; print(json.dumps([a, 'anyio' in sys.modules]))"
    )
    found = subprocess.run([PY, "-c", "import json; " + probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(found.stdout) == [False, True]
