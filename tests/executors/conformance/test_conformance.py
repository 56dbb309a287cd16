"""The executor conformance suite: one set of tests every kind of target passes, as the daemon uses it.

Each test runs against every kind (tests/executors/conformance/conftest.py): the in-memory executor
(tests/fakes/memory_executor.py: a test fake, not a configurable kind, since the design card keeps
executors/ to the four real kinds), this machine, an SSH host on a real sshd, the real Slurm test
cluster, a Runpod pod (the fake API, a real sshd as the pod) and a real two-node Ray cluster (its
variants `slow`: `pytest -m slow tests/executors/conformance`). A kind that lacks a capability
says so in its `lacks`, and its test is skipped with that reason. Every wait is for a state the
target reports, polled as the daemon's follow polls it, or for an event.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio

from executors.base import ExecInput, ExecSpec, Executor, ExecutorError, JobHandle, JobState, RunProbe
from executors.kinds import kinds
from tests.executors.conformance.conftest import MAKERS, NOT_YET, Kind, Plan

T = TypeVar("T")
LIVE = (JobState.pending, JobState.running)
BEGIN = '{"event": "begin", "time": 1.0, "max_steps": 10, "start_step": 0}'
LOG = '{"event": "log", "time": 2.0, "step": 3, "loss": 1.5}'


async def until(probe: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str, timeout: float = 60) -> T:
    """Ask `probe` until `done` holds for its answer (as the follow polls); the answer."""
    last: T | None = None
    try:
        with anyio.fail_after(timeout):
            while True:
                last = await probe()
                if done(last):
                    return last
                await anyio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}") from None


async def read(ex: Executor, kind: Kind, handle: JobHandle | None = None) -> RunProbe:
    return (await ex.probe([(handle, kind.run_dir)]))[0]


async def running(ex: Executor, kind: Kind, handle: JobHandle) -> RunProbe:
    """The run once its job runs (a scheduler may hold it pending first)."""
    return await until(lambda: read(ex, kind, handle), lambda p: p.status.state == JobState.running, "the job to run")


async def ended(ex: Executor, kind: Kind, handle: JobHandle) -> RunProbe:
    return await until(lambda: read(ex, kind, handle), lambda p: p.status.state not in LIVE, "the job to end")


class Collected:
    """The caller of a command run in a run: collects its output, sends no input."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.err = bytearray()

    async def write(self, stream: str, data: bytes) -> None:
        (self.out if stream == "out" else self.err).extend(data)

    async def read(self) -> ExecInput | None:
        await anyio.sleep_forever()
        return None


async def test_a_launched_job_runs_to_its_exit_code_its_log_is_read_by_offset_and_a_late_cancel_changes_nothing(
    kind: Kind,
) -> None:
    kind.require("launch")
    ex = kind.executor
    _, handle = await kind.spawn(Plan(prints="hello from the job\n", exit_code=3))
    probe = await ended(ex, kind, handle)
    assert (probe.status.state, probe.status.exit_code) == (JobState.exited, 3)
    assert (await ex.status(handle, kind.run_dir)).exit_code == 3
    late = await ex.cancel(handle, kind.run_dir, 1.0)  # a job that ended is never signalled: the cancel reports
    assert (late.state, late.exit_code) == (JobState.exited, 3)
    assert (await read(ex, kind, handle)).status.state == JobState.exited
    log = f"{kind.run_dir}/job.log"
    assert (await ex.read_from(log, 0, 1 << 20)).endswith(b"hello from the job\n")
    size = probe.log_size
    assert await ex.read_from(log, size - 4, 3) == b"job"
    assert await ex.read_from(log, size, 100) == b""  # nothing is read twice
    assert await ex.read_from(f"{kind.run_dir}/missing.log", 0, 100) == b""


async def test_a_probe_reads_the_job_s_status_metrics_request_and_checkpoints_in_one_go(kind: Kind) -> None:
    kind.require("probe")
    ex = kind.executor
    plan = Plan(
        prints="training\n",
        # The checkpoint before the log line the probe waits for: a probe between the two (Slurm's
        # shared directory, a loaded machine) would see the line and not yet the checkpoint.
        writes=(("output/checkpoint-3/model.bin", "w" * 100), ("metrics.jsonl", f"{BEGIN}\n{LOG}\n")),
        gate="go",
        exit_code=0,
    )
    _, handle = await kind.spawn(plan)
    probe = await until(lambda: read(ex, kind, handle), lambda p: p.last_log is not None, "the job's first log line")
    assert probe.status.state == JobState.running
    assert probe.begin is not None and probe.begin.max_steps == 10
    assert probe.last_log is not None and (probe.last_log.step, probe.last_log.loss) == (3, 1.5)
    assert probe.checkpoints == ["checkpoint-3"]
    assert probe.request is None and probe.proof is None and not probe.ended
    assert probe.handle is not None and probe.handle["pid"] == handle.pid
    assert probe.metrics_size == len(BEGIN) + len(LOG) + 2
    await ex.put_file(f"{kind.run_dir}/snapshot.request", b"requested\n")  # `obd train stop`
    assert (await read(ex, kind, handle)).request == "requested\n"
    await ex.put_file(f"{kind.run_dir}/go", b"")
    probe = await ended(ex, kind, handle)
    assert (probe.status.state, probe.status.exit_code) == (JobState.exited, 0)


async def test_the_events_report_a_request_and_the_job_s_exit_as_they_happen(kind: Kind) -> None:
    kind.require("follow")
    ex = kind.executor
    _, handle = await kind.spawn(Plan(gate="go", exit_code=4))
    await running(ex, kind, handle)
    events = ex.events
    if events is None:  # polled: the probe test is this kind's follow
        await ex.put_file(f"{kind.run_dir}/go", b"")
        probe = await ended(ex, kind, handle)
        assert probe.status.exit_code == 4
        return
    events.watch(kind.run_dir)
    seen: set[str] = set()

    async def wait_for(name: str) -> None:
        with anyio.fail_after(60):
            while f"{kind.run_dir}/{name}" not in seen:
                seen.update(await events.changed_files())

    await ex.put_file(f"{kind.run_dir}/snapshot.request", b"requested\n")
    await wait_for("snapshot.request")
    await ex.put_file(f"{kind.run_dir}/go", b"")
    with anyio.fail_after(60):
        await events.wait_exit(handle)  # at once where the job is not on this machine (Slurm)
    await wait_for("exit_code")
    events.unwatch(kind.run_dir)
    probe = await read(ex, kind, handle)
    assert (probe.status.state, probe.status.exit_code) == (JobState.exited, 4)


async def test_a_cancel_ends_the_job_once_and_a_second_cancel_only_reports(kind: Kind) -> None:
    kind.require("cancel")
    ex = kind.executor
    _, handle = await kind.spawn(Plan(prints="started\n", forever=True))
    await until(lambda: read(ex, kind, handle), lambda p: p.log_size > 0, "the job to start")
    assert (await ex.cancel(handle, kind.run_dir, 1.0)).state == JobState.cancelled
    await until(lambda: anyio.to_thread.run_sync(kind.gone, handle), bool, "the job's processes to end")
    assert (await ex.status(handle, kind.run_dir)).state == JobState.cancelled
    assert (await ex.cancel(handle, kind.run_dir, 1.0)).state == JobState.cancelled
    assert (await read(ex, kind, handle)).status.state == JobState.cancelled


async def test_checkpoints_are_listed_with_their_sizes_and_one_is_removed_by_name_only(kind: Kind) -> None:
    kind.require("checkpoints")
    ex = kind.executor
    writes = (
        ("output/checkpoint-1/model.bin", "a" * 1000),
        ("output/checkpoint-2/model.bin", "b" * 2000),
        ("output/checkpoint-2/state/trainer_state.json", "{}"),
        ("output/notes.txt", "not a checkpoint"),
    )
    _, handle = await kind.spawn(Plan(writes=writes))
    await ended(ex, kind, handle)
    assert await ex.checkpoint_sizes(kind.run_dir) == {"checkpoint-1": 1000, "checkpoint-2": 2002}
    assert (await read(ex, kind, handle)).checkpoints == ["checkpoint-1", "checkpoint-2"]
    assert await ex.remove_checkpoint(kind.run_dir, "checkpoint-1") == 1000
    assert await ex.checkpoint_sizes(kind.run_dir) == {"checkpoint-2": 2002}
    assert (await read(ex, kind, handle)).checkpoints == ["checkpoint-2"]
    for name in ("notes.txt", "../output"):
        try:
            await ex.remove_checkpoint(kind.run_dir, name)
        except ExecutorError:
            pass
        else:
            raise AssertionError(f"{name!r} was removed as a checkpoint")
    assert await ex.read_from(f"{kind.run_dir}/output/notes.txt", 0, 100) == b"not a checkpoint"


async def test_a_file_carried_in_reaches_the_job_and_what_it_wrote_is_carried_out(kind: Kind, tmp_path: Path) -> None:
    kind.require("carry")
    ex = kind.executor
    local_in = tmp_path / "carried-in"
    (local_in / "sub").mkdir(parents=True)
    payload = bytes(range(256)) * 64
    (local_in / "sub" / "data.bin").write_bytes(payload)
    await ex.make_run_dir(kind.run_dir, None)
    await ex.upload(local_in, f"{kind.run_dir}/in")
    await ex.put_file(f"{kind.run_dir}/in/note.txt", b"put whole\n")
    assert await ex.read_from(f"{kind.run_dir}/in/note.txt", 0, 100) == b"put whole\n"
    _, handle = await kind.spawn(Plan(copies=(("in/sub/data.bin", "out/data.bin"), ("in/note.txt", "out/note.txt"))))
    probe = await ended(ex, kind, handle)
    assert probe.status.exit_code == 0
    local_out = tmp_path / "carried-out"
    await ex.download(f"{kind.run_dir}/out", local_out)
    assert (local_out / "data.bin").read_bytes() == payload
    assert (local_out / "note.txt").read_bytes() == b"put whole\n"


async def test_a_command_runs_in_the_run_directory_of_a_running_job_with_its_variables(kind: Kind) -> None:
    kind.require("exec")
    ex = kind.executor
    _, handle = await kind.spawn(Plan(forever=True))
    await running(ex, kind, handle)
    spec = ExecSpec(
        run_id=kind.run_id,
        remote_dir=kind.run_dir,
        command=kind.exec_command(7),
        env={"CONFORMANCE": "from exec"},
        job=handle,
    )
    io = Collected()
    with anyio.fail_after(60):
        code = await ex.exec_in_run(spec, io)
    assert code == 7, bytes(io.err)
    assert bytes(io.out).decode().splitlines() == [kind.run_dir, "from exec"], bytes(io.err)
    assert (await ex.cancel(handle, kind.run_dir, 1.0)).state == JobState.cancelled


async def test_a_new_executor_after_a_daemon_restart_finds_the_job_by_its_handle_and_follows_it_to_its_end(
    kind: Kind,
) -> None:
    kind.require("reconcile")
    first = kind.executor
    _, handle = await kind.spawn(Plan(gate="go", exit_code=5))
    await running(first, kind, handle)
    await first.aclose()  # the daemon is gone; its job is not
    ex = await kind.restarted()
    probe = await read(ex, kind, handle)
    assert probe.status.state == JobState.running
    assert probe.handle is not None and probe.handle["pid"] == handle.pid
    # A launch cut short before its handle was recorded: the run directory names the job.
    adopted = await read(ex, kind, None)
    assert adopted.handle is not None and adopted.handle["pid"] == handle.pid
    assert adopted.status.state == JobState.running
    await ex.put_file(f"{kind.run_dir}/go", b"")
    probe = await ended(ex, kind, handle)
    assert (probe.status.state, probe.status.exit_code) == (JobState.exited, 5)


def test_every_registered_kind_of_target_is_held_to_this_contract_or_says_why_not_yet() -> None:
    registered = set(kinds())
    assert registered - set(MAKERS) == set(NOT_YET), "a registered kind is missing from the conformance suite"
    assert set(NOT_YET) <= registered, "a kind named in NOT_YET is no longer registered"
