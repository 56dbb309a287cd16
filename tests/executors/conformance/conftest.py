"""Every kind of target, ready for the conformance tests: an executor, a run directory, and a way to
make a job of a kind-neutral `Plan`.

The `kind` fixture yields a `Kind` for each of: the in-memory executor (tests/fakes/memory_executor.py),
this machine, an SSH host (a real sshd on loopback), a Slurm cluster (the real test cluster of
tests/executors/slurm/), a Runpod pod (the loopback fake of the API, whose pods are the sshd) and a
real two-node Ray cluster (tests/ray_cluster.py: its start takes about a minute, so the Ray variants
are `slow`; the executor reaches its Jobs API through a forwarded loopback port).
The expensive parts (the sshd, the fake API, the clusters) are shared by the whole module; each test
gets its own workdir, run id and executor, and nothing of its run is left when it ends.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from executors.base import Executor, JobHandle, JobSpec, JobState
from executors.kinds import Capability, kind_named
from tests.conftest import REPO, kill_job_groups
from tests.executors.slurm.cluster import Cluster, missing_reason
from tests.executors.slurm.conftest import slurm_cluster  # noqa: F401 - the session's one cluster, shared
from tests.fakes import memory_executor as mem
from tests.ray_cluster import RayCluster, ray_cluster  # noqa: F401 - the module's Ray cluster, started when asked for
from tests.ray_cluster import missing_reason as ray_missing_reason
from tests.sshd import SshServer, sshd_skip_reason

PLUGIN = REPO / "trainer_plugin"
RUNPOD_KEY = "conformance-key"

# What the suite holds every kind to. A kind that lacks one names it in `Kind.lacks`, with why, and
# the tests of it are skipped saying so (never passed without running).
CAPABILITIES = ("launch", "probe", "follow", "cancel", "checkpoints", "carry", "exec", "reconcile")
# Those a registered kind may lack, as the registry names them (executors/kinds.py); the others are
# the Executor protocol's core, which every kind implements.
OPTIONAL = {"exec": Capability.EXEC, "carry": Capability.CARRIES_FILES}
# Registered kinds not run here yet, and why (each new kind is added to MAKERS below, or here).
NOT_YET: dict[str, str] = {}
SLOW = {"ray"}  # kinds whose target takes a minute to start: their variants run with `-m slow`


@dataclass(frozen=True)
class Plan:
    """What a conformance job does, said once and written for each kind: a shell script on a real
    target, steps on the in-memory one. Paths are relative to the run directory."""

    prints: str = ""  # to its stdout (job.log)
    writes: tuple[tuple[str, str], ...] = ()  # files and their text, each written whole, in order
    copies: tuple[tuple[str, str], ...] = ()  # (from, to): a file carried in, copied to one carried out
    gate: str | None = None  # then waits until this file exists
    forever: bool = False  # then runs until it is cancelled
    exit_code: int = 0

    def shell(self, run_dir: str) -> str:
        def at(rel: str) -> str:
            return shlex.quote(f"{run_dir}/{rel}")

        lines = ["set -e"]
        if self.prints:
            lines.append(f"printf %s {shlex.quote(self.prints)}")
        for rel, text in self.writes:
            tmp = at(rel + ".part")
            lines.append(f'mkdir -p "$(dirname {at(rel)})"; printf %s {shlex.quote(text)} > {tmp}; mv {tmp} {at(rel)}')
        for src, dst in self.copies:
            lines.append(f'mkdir -p "$(dirname {at(dst)})"; cp {at(src)} {at(dst)}')
        if self.gate:
            lines.append(f"while [ ! -e {at(self.gate)} ]; do sleep 0.05; done")
        if self.forever:
            lines.append("while :; do sleep 0.2; done")
        lines.append(f"exit {self.exit_code}")
        return "\n".join(lines)

    def steps(self) -> list[mem.Step]:
        steps: list[mem.Step] = []
        if self.prints:
            steps.append(mem.do(lambda job: job.print(self.prints)))
        steps += [mem.do(_writer(rel, text)) for rel, text in self.writes]
        steps += [mem.do(_copier(src, dst)) for src, dst in self.copies]
        if self.gate:
            steps.append(mem.until(lambda job: job.exists(self.gate or "")))
        if self.forever:
            steps.append(mem.until(lambda job: False))
        steps.append(mem.exit_with(self.exit_code))
        return steps


def _writer(rel: str, text: str) -> Callable[[mem.MemoryJob], None]:
    return lambda job: job.write(rel, text)


def _copier(src: str, dst: str) -> Callable[[mem.MemoryJob], None]:
    return lambda job: job.write(dst, job.read(src) or b"")


@dataclass
class Kind:
    """One kind of target, as the tests use it: its executor and the test's one run on it."""

    name: str
    executor: Executor
    run_id: str
    run_dir: str
    job_command: Callable[[Plan], list[str]]
    exec_command: Callable[[int], list[str]]  # prints its working directory and $CONFORMANCE, exits with the code
    new_executor: Callable[[], Awaitable[Executor]]  # another instance, as a restarted daemon makes it
    gone: Callable[[JobHandle], bool]  # nothing of the job runs any more
    prepare: Callable[[Kind], Awaitable[None]] | None = None  # what the daemon puts in the run directory first
    lacks: dict[str, str] = field(default_factory=dict)
    spawned: list[JobHandle] = field(default_factory=list)
    executors: list[Executor] = field(default_factory=list)

    def require(self, capability: str) -> None:
        """Skip the test, saying why, where this kind lacks the capability."""
        assert capability in CAPABILITIES, capability
        if capability in self.lacks:
            pytest.skip(f"{self.name} targets lack {capability}: {self.lacks[capability]}")

    async def spawn(self, plan: Plan, executor: Executor | None = None) -> tuple[JobSpec, JobHandle]:
        """Start the test's run with this plan, as the daemon's launch does: its directory, then the job."""
        ex = executor or self.executor
        await ex.make_run_dir(self.run_dir, None)
        if self.prepare is not None:
            await self.prepare(self)
        spec = JobSpec(
            run_id=self.run_id, remote_dir=self.run_dir, command=self.job_command(plan), env={"OBD_RUN_ID": self.run_id}
        )
        handle = await ex.spawn(spec)
        self.spawned.append(handle)
        return spec, handle

    async def restarted(self) -> Executor:
        """The executor a restarted daemon makes for this target (the first one is closed by then)."""
        ex = await self.new_executor()
        self.executors.append(ex)
        return ex

    async def close(self) -> None:
        """End what the test left: its job cancelled, its executors closed."""
        for handle in self.spawned:
            with contextlib.suppress(Exception):
                await (self.executors or [self.executor])[-1].cancel(handle, self.run_dir, 0.5)
        for ex in {id(e): e for e in [self.executor, *self.executors]}.values():
            with contextlib.suppress(Exception):
                await ex.aclose()


def shell_exec(code: int) -> list[str]:
    return ["sh", "-c", f'pwd; printf "%s\\n" "$CONFORMANCE"; exit {code}']


def process_gone(handle: JobHandle) -> bool:
    from trainer_plugin.tools import jobctl

    ids = handle.model_dump()
    return not jobctl.handle_alive(ids) and not jobctl.group_alive(ids)


# --- module-wide: what is expensive to start --------------------------------------------------------


@pytest.fixture(scope="module")
def conformance_sshd() -> Iterator[SshServer]:
    """One sshd for the module: the SSH host, and every pod's port 22."""
    reason = sshd_skip_reason()
    if reason:
        pytest.skip(reason)
    with SshServer() as server:
        yield server


@pytest.fixture(scope="module")
def runpod_api(conformance_sshd: SshServer) -> Iterator[Any]:
    """The fake Runpod API for the module, the SDK pointed at it, its pods' SSH the module's sshd."""
    import runpod

    from tests.fakes.runpod_api import FakeRunpod

    server = FakeRunpod(api_keys=(RUNPOD_KEY,)).start()
    server.ssh_endpoint = (conformance_sshd.host, conformance_sshd.port)
    saved = runpod.api_key
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RUNPOD_API_BASE_URL", server.url)
        patch.setenv("RUNPOD_API_KEY", RUNPOD_KEY)
        yield server
    server.stop()
    runpod.api_key = saved


# --- one per kind ------------------------------------------------------------------------------------


def _run_id() -> str:
    return f"conf-{uuid.uuid4().hex[:10]}"


async def _memory(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    world = mem.MemoryWorld()
    world.programs["conformance-plan"] = lambda job: Plan(**_plan_fields(job.spec.command[1])).steps()

    async def exec_command(cmd: mem.MemoryCommand) -> int:
        await cmd.io.write("out", f"{cmd.cwd}\n{cmd.env.get('CONFORMANCE', '')}\n".encode())
        return int(cmd.argv[1])

    world.commands["conformance-exec"] = exec_command
    run_id = _run_id()

    async def restart() -> Executor:
        return mem.MemoryExecutor("mem", world)

    def gone(handle: JobHandle) -> bool:
        job = world.job(handle)
        return job is None or job.state != JobState.running

    return Kind(
        name="memory",
        executor=mem.MemoryExecutor("mem", world),
        run_id=run_id,
        run_dir=f"/memory/obd/{run_id}",
        job_command=lambda plan: ["conformance-plan", json.dumps(plan.__dict__)],
        exec_command=lambda code: ["conformance-exec", str(code)],
        new_executor=restart,
        gone=gone,
    )


def _plan_fields(text: str) -> dict[str, Any]:
    raw = json.loads(text)
    for key in ("writes", "copies"):
        raw[key] = tuple(tuple(pair) for pair in raw[key])
    return raw


async def _local(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    from executors.local import LocalExecutor

    def make() -> LocalExecutor:
        return LocalExecutor("local", tmp_path / "wd", facts=tmp_path / "facts")

    run_id = _run_id()

    async def restart() -> Executor:
        return make()

    return Kind(
        name="local",
        executor=make(),
        run_id=run_id,
        run_dir=str(tmp_path / "wd" / run_id),
        job_command=lambda plan: ["sh", "-c", plan.shell(str(tmp_path / "wd" / run_id))],
        exec_command=shell_exec,
        new_executor=restart,
        gone=process_gone,
    )


async def _ssh(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    from executors.ssh import SshExecutor
    from tests.executors.ssh.helpers import make_target

    server: SshServer = request.getfixturevalue("conformance_sshd")
    workdir = tmp_path / "wd"
    run_id = _run_id()

    async def restart() -> Executor:
        return SshExecutor("box", make_target(server, workdir))

    return Kind(
        name="ssh",
        executor=SshExecutor("box", make_target(server, workdir)),
        run_id=run_id,
        run_dir=str(workdir / run_id),
        job_command=lambda plan: ["sh", "-c", plan.shell(str(workdir / run_id))],
        exec_command=shell_exec,
        new_executor=restart,
        gone=process_gone,
    )


def _wrapped(name: str, make: Callable[[], Executor], workdir: Path) -> Kind:
    """A kind whose jobs run obd's job wrapper from the run's `plugin/` (copied there first, as the
    daemon's launch does), the run directory on a workdir this machine shares with the nodes."""
    from tests.executors.slurm.conftest import run_processes

    run_id = _run_id()

    async def prepare(kind: Kind) -> None:
        await kind.executor.upload(PLUGIN, f"{kind.run_dir}/plugin/trainer_plugin")

    async def restart() -> Executor:
        return make()

    return Kind(
        name=name,
        executor=make(),
        run_id=run_id,
        run_dir=str(workdir / run_id),
        job_command=lambda plan: ["sh", "-c", plan.shell(str(workdir / run_id))],
        exec_command=shell_exec,
        new_executor=restart,
        gone=lambda handle: not run_processes(run_id),
        prepare=prepare,
    )


async def _slurm(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    from executors.config import SlurmTarget
    from executors.slurm import SlurmExecutor

    cluster: Cluster = request.getfixturevalue("slurm_cluster")
    request.getfixturevalue("monkeypatch").setenv("SLURM_CONF", str(cluster.conf))
    workdir = tmp_path / "work"
    target = SlurmTarget.model_validate({"kind": "slurm", "workdir": str(workdir), "venv": sys.prefix})
    return _wrapped("slurm", lambda: SlurmExecutor("hpc", target, settle=0), workdir)


async def _runpod(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    from executors.config import RunpodTarget
    from executors.runpod import PodInfo, RunpodDriver
    from tests.executors.runpod.conftest import fast_api

    server: SshServer = request.getfixturevalue("conformance_sshd")
    fake = request.getfixturevalue("runpod_api")
    fake.container_env_dir = tmp_path / "containers"
    workdir = tmp_path / "pod"
    workdir.mkdir()
    target = RunpodTarget(
        kind="runpod",
        gpu_type="NVIDIA GeForce RTX 4090",
        identity_file=server.identity_file,
        workdir=str(workdir),
        python=sys.executable,
        boot_grace=5.0,
    )

    def driver() -> RunpodDriver:
        return RunpodDriver(
            "pods",
            target,
            tmp_path / "state",
            api=fast_api(),
            ssh_user=server.user,
            poll_interval=0.05,
            settle=0.05,
            ssh_probe_timeout=2.0,
            watchdog_interval=0.1,
            container_environ=str(fake.container_env_dir / "{pod_id}.environ"),
        )

    saved: list[PodInfo] = []

    async def save(info: PodInfo) -> None:
        saved.append(info.model_copy())

    run_id = _run_id()
    first = driver()
    info = await first.create(run_id, save)  # a pod per run: the test's run gets its own

    async def restart() -> Executor:
        # A restarted daemon has its pod's record (the last one saved) and a driver of its own.
        return driver().executor(PodInfo.from_record(saved[-1].model_dump()))

    kind = Kind(
        name="runpod",
        executor=first.executor(info),
        run_id=run_id,
        run_dir=first.ctx.remote_dir(info, run_id),
        job_command=lambda plan: ["sh", "-c", plan.shell(first.ctx.remote_dir(info, run_id))],
        exec_command=shell_exec,
        new_executor=restart,
        gone=process_gone,
    )

    async def end_pod() -> None:
        with contextlib.suppress(Exception):
            await first.terminate(info.pod_id or "", run_id)

    request.node.stash[_POD_END] = end_pod
    return kind


async def _ray(request: pytest.FixtureRequest, tmp_path: Path) -> Kind:
    from executors.config import RayTarget
    from executors.ray import RayExecutor

    cluster: RayCluster = request.getfixturevalue("ray_cluster")
    workdir = tmp_path / "wd"
    fields = {"address": cluster.jobs_api_here(), "workdir": str(workdir), "python": sys.executable}
    target = RayTarget.model_validate({"kind": "ray", **fields, "num_cpus": 1, "stop_wait": 5})
    return _wrapped("ray", lambda: RayExecutor("ray", target), workdir)


_POD_END = pytest.StashKey[Callable[[], Awaitable[None]]]()
MAKERS: dict[str, Callable[[pytest.FixtureRequest, Path], Awaitable[Kind]]] = {
    "memory": _memory,
    "local": _local,
    "ssh": _ssh,
    "slurm": _slurm,
    "runpod": _runpod,
    "ray": _ray,
}


def registered_lacks(name: str) -> dict[str, str]:
    """What the registry says the kind cannot do, of what this suite tests."""
    kind = kind_named(name)
    return {
        test: f"its registered capabilities (executors/kinds.py) do not include {flag.value}"
        for test, flag in OPTIONAL.items()
        if not kind.has(flag)
    }


def _skip_reason(name: str) -> str | None:
    if name in ("ssh", "runpod"):
        return sshd_skip_reason()
    if name == "slurm":
        return missing_reason()
    if name == "ray":
        return ray_missing_reason()
    return None


@pytest.fixture(params=[pytest.param(name, marks=pytest.mark.slow) if name in SLOW else name for name in MAKERS])
async def kind(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Kind]:
    """A ready kind of target with the test's run on it; what the test leaves is ended after it."""
    reason = _skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    made = await MAKERS[request.param](request, tmp_path)
    if made.name != "memory":  # a test fake, not a registered kind: it has every capability
        made.lacks.update(registered_lacks(made.name))
    try:
        yield made
    finally:
        await made.close()
        if _POD_END in request.node.stash:
            await request.node.stash[_POD_END]()
        kill_job_groups(Path(made.run_dir).parent.glob("*/job.pid") if made.name != "memory" else [])
