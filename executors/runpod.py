"""The Runpod pod driver: create a pod for a run, reach it over SSH, retrieve, terminate.

A pod is created for one run, named `obd-<run id>` and tagged with the env `OBD_RUN_ID` and
`OBD_OWNER` (a stable id of this obd install, kept in the state directory), so obd can always
tell its pods from anyone else's. The daemon persists what `create` passes to `save` before
each step that could leave a pod behind: the pod's name before the create call, its id as soon
as it is known. The job itself runs through the SSH executor on the pod's public port 22,
with the host key pinned on the first connection to the freshly created pod.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path, PurePosixPath
from typing import Any

import anyio
import structlog

from daemon.config import RunpodTarget, SshTarget
from executors.base import Executor, ExecutorError, JobHandle, JobSpec
from executors.runpod_api import (
    AuthError,
    NoCapacity,
    Pod,
    RunpodApi,
    RunpodApiError,
    TransientError,
    UnknownGpu,
    resolve_api_key,
)

log = structlog.get_logger("obd.runpod")

POD_PREFIX = "obd-"
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PLUGIN_DIR = Path(__file__).resolve().parent.parent / "trainer_plugin"
_NO_ANSWER = object()
Save = Callable[[dict[str, Any]], Awaitable[None]]


async def _keep(_info: dict[str, Any]) -> None:
    """A Save for callers whose record lives only in the driver's book (which `_save` writes)."""


class PodGone(ExecutorError):
    """The pod no longer exists: terminated outside obd, or reclaimed by Runpod."""


# --- the owner id and the driver's own book of pods ------------------------------------------


def owner_id(state_dir: Path) -> str:
    """A stable random id of this obd install, created once in `state_dir/runpod/owner`."""
    path = Path(state_dir) / "runpod" / "owner"
    try:
        value = path.read_text().strip()
        if value:
            return value
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    candidate = secrets.token_hex(8)
    tmp = path.with_name(f".owner.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(candidate + "\n")
    try:
        os.link(tmp, path)  # first writer wins; a concurrent one reads the winner's id
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()


class PodBook:
    """What the driver knows of each of its pods, one JSON file per run, for `obd pods`."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "runpod" / "pods"

    def put(self, run_id: str, **fields: Any) -> dict[str, Any]:
        if not RUN_ID_RE.match(run_id):
            raise ExecutorError(f"invalid run id {run_id!r}; see `obd train list`")
        entry = {**(self.get(run_id) or {}), **fields}
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{run_id}.json.{secrets.token_hex(4)}"
        tmp.write_text(json.dumps(entry, sort_keys=True, default=str))
        os.replace(tmp, self.dir / f"{run_id}.json")
        return entry

    def get(self, run_id: str) -> dict[str, Any] | None:
        if not RUN_ID_RE.match(run_id):
            return None
        try:
            return json.loads((self.dir / f"{run_id}.json").read_text())
        except (OSError, ValueError):
            return None

    def all(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path in sorted(self.dir.glob("*.json")):
            try:
                out[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out


# --- pure helpers ------------------------------------------------------------------------------


def gpu_types(target: RunpodTarget) -> list[str]:
    return [target.gpu_type] if isinstance(target.gpu_type, str) else list(target.gpu_type)


def spend(target_info: dict[str, Any], now: float) -> float | None:
    """Dollars spent on the pod so far: hourly rate × hours since it was created."""
    rate, started = target_info.get("cost_per_hr"), target_info.get("started_at")
    if not rate or started is None:
        return None
    return round(float(rate) * max(0.0, now - float(started)) / 3600.0, 4)


def _ssh_address(target_info: dict[str, Any], user: str) -> str | None:
    if not target_info.get("ssh_host"):
        return None
    return f"{target_info.get('ssh_user', user)}@{target_info['ssh_host']}:{target_info.get('ssh_port')}"


def snapshot_margin(margin: float, span: float) -> float:
    """How long ahead of a cap to ask for the snapshot: `margin`, at most a quarter of the span."""
    return max(0.0, min(margin, span / 4.0))


def lease_bytes(now: float, ttl: float) -> bytes:
    """The content of `<remote_dir>/lease`: the unix time until which the daemon is in charge."""
    return f"{now + ttl:.3f}\n".encode()


def safe_relpath(rel: str) -> PurePosixPath | None:
    """A manifest path as a relative path inside the run directory, or None if it is not one."""
    path = PurePosixPath(rel)
    if path.is_absolute() or not path.parts or any(p in ("..", ".", "") for p in path.parts):
        return None
    return path


def sha256_local(path: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


# --- the driver ----------------------------------------------------------------------------------


class RunpodDriver:
    """Everything the daemon does with pods of one `[targets.NAME] kind = "runpod"`."""

    def __init__(
        self,
        name: str,
        target: RunpodTarget,
        state_dir: Path,
        *,
        api: RunpodApi | None = None,
        ssh_user: str = "root",
        poll_interval: float = 5.0,
        cap_margin: float = 900.0,
        create_retries: int = 3,
        settle: float = 2.0,
        ssh_probe_timeout: float = 10.0,
        watchdog_interval: float = 30.0,
        describe_timeout: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.target = target
        self.state_dir = Path(state_dir)
        self.api = api or RunpodApi()
        self.ssh_user = ssh_user
        self.poll_interval = poll_interval
        self.cap_margin = cap_margin
        self.create_retries = create_retries
        self.settle = settle
        self.ssh_probe_timeout = ssh_probe_timeout
        self.watchdog_interval = watchdog_interval
        self.describe_timeout = describe_timeout
        self.clock = clock
        self.book = PodBook(self.state_dir)
        self._owner: str | None = None

    @property
    def owner(self) -> str:
        if self._owner is None:
            self._owner = owner_id(self.state_dir)
        return self._owner

    def pod_name(self, run_id: str) -> str:
        if not RUN_ID_RE.match(run_id):
            raise ExecutorError(f"invalid run id {run_id!r} for a pod name; see `obd train list`")
        return POD_PREFIX + run_id

    def is_ours(self, pod: Pod) -> bool:
        return pod.name.startswith(POD_PREFIX) and pod.env.get("OBD_OWNER") == self.owner

    # --- create ---------------------------------------------------------------------------------

    async def plan(self) -> list[tuple[str, float | None]]:
        """The GPU types to try, in order, with their hourly rate; refuses a cost cap without a rate."""
        t = self.target
        plan: list[tuple[str, float | None]] = []
        unknown: list[str] = []
        for gpu in gpu_types(t):
            try:
                rate = await self.api.gpu_rate(gpu, t.gpu_count, t.cloud_type)
            except UnknownGpu:
                unknown.append(gpu)
                continue
            if t.max_cost_usd is not None and rate is None:
                log.warning("runpod.no_rate", target=self.name, gpu_type=gpu, cloud_type=t.cloud_type)
                unknown.append(gpu)
                continue
            plan.append((gpu, rate))
        if not plan:
            if t.max_cost_usd is not None:
                raise ExecutorError(
                    f"target {self.name!r} has max_cost_usd = {t.max_cost_usd} but no hourly rate is known for "
                    f"{', '.join(unknown)} ({t.cloud_type} cloud), so the cap could not be enforced: nothing was "
                    "created. Pick a gpu_type with a listed price "
                    "(`python -c 'import runpod; print(runpod.get_gpus())'`) or remove max_cost_usd"
                )
            raise ExecutorError(
                f"none of the GPU types of target {self.name!r} exists: {', '.join(unknown)}; nothing was created. "
                "Fix gpu_type in the config (`python -c 'import runpod; print(runpod.get_gpus())'` lists them)"
            )
        return plan

    def pod_env(self, run_id: str) -> dict[str, str]:
        """The env tags of the pod, and the SSH public key Runpod images authorise (PUBLIC_KEY)."""
        env = {"OBD_RUN_ID": run_id, "OBD_OWNER": self.owner}
        key = self.target.identity_file
        if key is not None:
            pub = Path(str(Path(key).expanduser()) + ".pub")
            try:
                env["PUBLIC_KEY"] = pub.read_text().strip()
            except OSError:
                pass
        return env

    async def create(self, run_id: str, save: Save) -> dict[str, Any]:
        """Create the run's pod and wait until it answers SSH; `save` is awaited before each risky step."""
        name = self.pod_name(run_id)
        plan = await self.plan()  # may refuse: nothing recorded, nothing created
        info: dict[str, Any] = {
            "kind": "runpod",
            "target": self.name,
            "run_id": run_id,
            "pod_name": name,
            "pod_id": None,
            "owner": self.owner,
            "phase": "creating",
            "gpu_types": [g for g, _ in plan],
            "requested_at": self.clock(),
        }
        await self._save(save, info)
        # A cancel waits for the create's answer, so that a pod made is always recorded (and then
        # terminated by the boot wait's clean-up) rather than left for the reconcile to find.
        with anyio.CancelScope(shield=True):
            try:
                pod, gpu, rate, started_at = await self._create_pod(run_id, name, plan)
            except ExecutorError as exc:
                info.update(phase="create_failed", error=str(exc))
                await self._save(save, info)
                raise
            info.update(
                pod_id=pod.id,
                phase="booting",
                gpu_type=gpu,
                cost_per_hr=pod.cost_per_hr or rate,
                started_at=started_at,
                max_hours=self.target.max_hours,
                max_cost_usd=self.target.max_cost_usd,
            )
            await self._save(save, info)
        log.info(
            "runpod.created",
            target=self.name,
            run_id=run_id,
            pod_id=pod.id,
            gpu_type=gpu,
            cost_per_hr=info["cost_per_hr"],
        )
        info = await self._until_ready(info, save, started_at, self.target.boot_grace)
        log.info("runpod.ready", target=self.name, run_id=run_id, pod_id=pod.id, ssh=f"{info['ssh_host']}:{info['ssh_port']}")
        return dict(info)

    async def resume(self, target_info: dict[str, Any], save: Save) -> dict[str, Any]:
        """Carry on with a pod whose boot the daemon did not see through (a restart, an adoption).

        Waits for its SSH port for what is left of boot_grace (counted from the pod's start) and pins
        the host key; a pod that never becomes ready is terminated, as in `create`.
        """
        info = dict(target_info)
        if info.get("phase") == "ready" and info.get("host_key"):
            return info
        if not info.get("pod_id"):
            raise ExecutorError(f"run {info.get('run_id')} has no pod to resume; start the run again")
        pod = await self._get_pod_soft(info["pod_id"])
        if pod is not None and pod.desired_status == "EXITED":
            return await self.restart_stopped(info, save)  # never terminate a volume that holds outputs
        left = float(info.get("started_at") or self.clock()) + self.target.boot_grace - self.clock()
        return await self._until_ready(info, save, float(info.get("started_at") or 0), max(left, 0.0))

    async def _until_ready(self, info: dict[str, Any], save: Save, started_at: float, grace: float) -> dict[str, Any]:
        """Wait for the pod's SSH within `grace`, pin its host key and save it ready; a pod that
        never gets there is terminated (`_abandon_boot`) and the error raised."""
        try:
            host, port, key, rate = await self._wait_ssh(info["pod_id"], started_at, grace)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._abandon_boot(info, save, exc)
            raise
        info.update(phase="ready", ssh_host=host, ssh_port=port, ssh_user=self.ssh_user, host_key=key)
        if rate:
            info["cost_per_hr"] = rate
        await self._save(save, info)
        return info

    async def restart_stopped(self, target_info: dict[str, Any], save: Save) -> dict[str, Any]:
        """Start a stopped (EXITED) pod again, to reach the outputs on its volume.

        A stop (the console's Stop button, a spot interruption, a low balance) ends the container
        and the job in it but keeps the volume, where the run directory lives. The new container
        has a new SSH port and host key, pinned again: the pod is the same one by its id. A pod that
        does not get ready within boot_grace is stopped again, not terminated, so the outputs stay.
        """
        info = dict(target_info)
        pod_id = info["pod_id"]
        pod = await self.api.get_pod(pod_id)
        if pod is None:
            raise PodGone(f"pod {pod_id} no longer exists (terminated outside obd, or reclaimed by Runpod)")
        if pod.desired_status != "EXITED":
            return info
        await self.api.resume_pod(pod_id, pod.gpu_count or self.target.gpu_count)
        started = self.clock()
        info.update(phase="booting", ssh_host=None, ssh_port=None, host_key=None, restarted_at=started)
        await self._save(save, info)
        log.warning("runpod.restarted_stopped_pod", target=self.name, run_id=info.get("run_id"), pod_id=pod_id)
        try:
            host, port, key, rate = await self._wait_ssh(pod_id, started, self.target.boot_grace)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                try:
                    with anyio.fail_after(120):
                        await self.api.stop_pod(pod_id)
                    info.update(phase="stopped", error=str(exc) or type(exc).__name__)
                except (RunpodApiError, TimeoutError) as stop_exc:
                    info.update(phase="booting", error=f"{exc}; stopping it again failed too: {stop_exc}")
                    log.error("runpod.restart_stop_failed", run_id=info.get("run_id"), pod_id=pod_id, error=str(stop_exc))
                with anyio.move_on_after(30):
                    await self._save(save, info)
            raise
        info.update(phase="ready", ssh_host=host, ssh_port=port, ssh_user=self.ssh_user, host_key=key, error=None)
        if rate:
            info["cost_per_hr"] = rate
        await self._save(save, info)
        return info

    async def _save(self, save: Save, info: dict[str, Any]) -> None:
        await save(dict(info))
        self.book.put(info["run_id"], target_info=dict(info))

    async def _create_pod(
        self, run_id: str, name: str, plan: list[tuple[str, float | None]]
    ) -> tuple[Pod, str, float | None, float]:
        """Try each GPU type; after any failure that may have created a pod, look it up by its tag first."""
        t = self.target
        refused: list[str] = []
        first_try: float | None = None
        for gpu, rate in plan:
            failures = 0
            while True:
                found = await self._find_tagged(run_id, name)
                if found:
                    log.warning("runpod.adopted_ambiguous_create", run_id=run_id, pod_id=found.id)
                    return found, gpu, rate, first_try or self.clock()
                started = self.clock()
                first_try = first_try or started
                try:
                    raw = await self.api.create_pod(
                        name=name,
                        image_name=t.image,
                        gpu_type_id=gpu,
                        cloud_type=t.cloud_type,
                        gpu_count=t.gpu_count,
                        volume_in_gb=0 if t.network_volume_id else t.volume_gb,
                        container_disk_in_gb=t.container_disk_gb,
                        network_volume_id=t.network_volume_id,
                        volume_mount_path="/workspace",
                        ports="22/tcp",
                        support_public_ip=True,
                        start_ssh=True,
                        env=self.pod_env(run_id),
                    )
                except (NoCapacity, UnknownGpu) as exc:
                    refused.append(f"{gpu}: {exc}")
                    log.info("runpod.no_capacity", run_id=run_id, gpu_type=gpu)
                    break
                except TransientError as exc:
                    failures += 1
                    log.warning(
                        "runpod.create_ambiguous", run_id=run_id, gpu_type=gpu, error=str(exc), attempt=failures
                    )
                    if failures > self.create_retries:
                        await anyio.sleep(self.settle)
                        found = await self._find_tagged(run_id, name)
                        if found:
                            return found, gpu, rate, first_try
                        raise ExecutorError(
                            f"could not create pod {name}: the Runpod API kept failing ({exc}); no pod with that name "
                            "exists now. Retry later (`obd train start` again)"
                        ) from exc
                    await anyio.sleep(self.settle * failures)
                    continue
                pod = await self._get_pod_soft(str(raw["id"])) or Pod(id=str(raw["id"]), name=name)
                return pod, gpu, rate, started
        raise ExecutorError(
            f"no capacity on Runpod for any GPU type of target {self.name!r} ({t.cloud_type} cloud): "
            f"{'; '.join(refused)}. Nothing was created and nothing is billed. Retry later, add GPU types to "
            'gpu_type, or set cloud_type = "ALL"'
        )

    async def _find_tagged(self, run_id: str, name: str) -> Pod | None:
        """The pod of this run, by name and env tags; extra copies (a duplicate create) are terminated."""
        try:
            pods = await self.api.list_pods()
        except RunpodApiError as exc:
            raise ExecutorError(
                f"could not check whether pod {name} already exists ({exc}); nothing more was created. "
                "See `obd pods list` and remove any leftover with `obd pods rm POD_ID`"
            ) from exc
        mine = [p for p in pods if p.name == name and self.is_ours(p) and p.env.get("OBD_RUN_ID") == run_id]
        for extra in mine[1:]:
            try:
                await self.api.terminate(extra.id)
                log.warning("runpod.duplicate_terminated", run_id=run_id, pod_id=extra.id)
            except RunpodApiError as exc:  # it carries the run's tag: reconcile reports it as an orphan
                log.error("runpod.duplicate_terminate_failed", run_id=run_id, pod_id=extra.id, error=str(exc))
        return mine[0] if mine else None

    async def _get_pod_soft(self, pod_id: str) -> Pod | None:
        try:
            return await self.api.get_pod(pod_id)
        except TransientError:
            return None

    async def _wait_ssh(
        self, pod_id: str, started_at: float, grace: float | None = None
    ) -> tuple[str, int, str, float | None]:
        """Poll until the pod has a public port 22 that answers SSH; pin its host key (TOFU)."""
        deadline = anyio.current_time() + (self.target.boot_grace if grace is None else grace)
        last = "the API reported no public port 22 yet"
        while True:
            try:
                pod = await self.api.get_pod(pod_id)
            except TransientError as exc:
                pod, last = None, str(exc)
            else:
                if pod is None:
                    raise PodGone(f"pod {pod_id} disappeared while it was booting (terminated outside obd?)")
                if pod.desired_status in ("EXITED", "TERMINATED"):
                    raise PodGone(f"pod {pod_id} stopped while booting (status {pod.desired_status})")
                if pod.ssh_host and pod.ssh_port:
                    key = await self._host_key(pod.ssh_host, pod.ssh_port)
                    if key:
                        return pod.ssh_host, pod.ssh_port, key, pod.cost_per_hr
                    last = f"{pod.ssh_host}:{pod.ssh_port} does not answer SSH yet"
            if anyio.current_time() >= deadline:
                raise ExecutorError(
                    f"pod {pod_id} got no working public SSH port within boot_grace ({self.target.boot_grace:.0f}s): "
                    f"{last}. The image must run sshd (Runpod's images do, with start_ssh); "
                    "raise boot_grace for a slow image"
                )
            await anyio.sleep(self.poll_interval)

    async def _host_key(self, host: str, port: int) -> str | None:
        """The host key line `alg base64` the SSH server presents, or None when it does not answer."""
        import asyncssh

        try:
            with anyio.fail_after(self.ssh_probe_timeout):
                key = await asyncssh.get_server_host_key(host, port, config=None)
        except (OSError, TimeoutError, asyncssh.Error):
            return None
        if key is None:
            return None
        return " ".join(key.export_public_key().decode().split()[:2])

    async def _abandon_boot(self, info: dict[str, Any], save: Save, exc: BaseException) -> None:
        """A pod that never became usable: terminate it, and record whether that worked."""
        pod_id = info["pod_id"]
        try:
            with anyio.fail_after(120):
                await self.api.terminate(pod_id)
            info.update(phase="terminated", error=str(exc) or type(exc).__name__)
            log.warning("runpod.boot_failed_terminated", run_id=info.get("run_id"), pod_id=pod_id, error=str(exc))
        except (RunpodApiError, TimeoutError) as term_exc:
            info.update(phase="terminate_failed", error=f"{exc}; terminating it failed too: {term_exc}")
            log.error("runpod.boot_failed_terminate_failed", run_id=info.get("run_id"), pod_id=pod_id, error=str(term_exc))
            if isinstance(exc, ExecutorError):
                exc.args = (f"{exc}; terminating pod {pod_id} failed ({term_exc}): run `obd pods rm {pod_id}`",)
        else:
            if isinstance(exc, ExecutorError) and "terminated" not in str(exc):
                exc.args = (f"{exc}; pod {pod_id} was terminated",)
        try:
            await self._save(save, info)
        except Exception as save_exc:  # the pod is already settled; the error above is what matters
            log.error("runpod.save_failed", run_id=info.get("run_id"), pod_id=pod_id, error=str(save_exc))

    # --- the executor and the watchdog --------------------------------------------------------

    def ssh_target(self, target_info: dict[str, Any]) -> SshTarget:
        t = self.target
        return SshTarget(
            kind="ssh",
            host=target_info["ssh_host"],
            port=int(target_info["ssh_port"]),
            user=target_info.get("ssh_user") or self.ssh_user,
            identity_file=t.identity_file,
            workdir=t.workdir,
            python=t.python,
            secrets=list(t.secrets),
        )

    def executor(self, target_info: dict[str, Any]) -> Executor:
        """An SSH executor to the pod, with its host key pinned (never known_hosts, never TOFU again)."""
        from executors.ssh import SshExecutor

        if not target_info.get("host_key"):
            raise ExecutorError(f"pod {target_info.get('pod_id')} has no pinned host key yet; it never became ready")
        return SshExecutor(self.name, self.ssh_target(target_info), host_key=target_info["host_key"])

    def watchdog_config(self, remote_dir: str, target_info: dict[str, Any]) -> dict[str, Any]:
        """The settings written to `<remote_dir>/watchdog.json` (no secret in it)."""
        t = self.target
        return {
            "run_dir": remote_dir,
            "pod_id": target_info.get("pod_id"),
            "started_at": target_info.get("started_at"),
            "cost_per_hr": target_info.get("cost_per_hr"),
            "max_hours": t.max_hours,
            "max_cost_usd": t.max_cost_usd,
            "disk_path": remote_dir,
            "disk_min_free_gb": t.disk_min_free_gb,
            "disk_max_used_pct": t.disk_max_used_pct,
            "boot_grace": t.boot_grace,
            "abandon_grace": t.abandon_grace,
            "snapshot_margin": self.cap_margin,
            "interval": self.watchdog_interval,
            "api_base_url": os.environ.get("RUNPOD_API_BASE_URL"),
        }

    def watchdog_command(self, remote_dir: str, target_info: dict[str, Any]) -> list[str]:
        """argv of the watchdog on the pod (no secret: the key arrives through jobctl's stdin)."""
        return [
            self.target.python,
            f"{remote_dir}/plugin/trainer_plugin/watchdog.py",
            "run",
            "--config",
            f"{remote_dir}/watchdog.json",
        ]

    async def install_tools(self, executor: Executor, remote_dir: str) -> None:
        """Put the watchdog (and the jobctl it imports) into the run's plugin dir, idempotently."""
        for name in ("jobctl.py", "watchdog.py"):
            await executor.put_file(f"{remote_dir}/plugin/trainer_plugin/{name}", (PLUGIN_DIR / name).read_bytes())

    async def start_watchdog(self, executor: Executor, remote_dir: str, target_info: dict[str, Any]) -> JobHandle:
        """Write the watchdog's config and start it detached (jobctl: setsid), the key on stdin."""
        key = resolve_api_key()
        if not key:
            raise AuthError("no Runpod API key for the pod watchdog: set RUNPOD_API_KEY or run `runpod config`")
        await self.install_tools(executor, remote_dir)
        config = self.watchdog_config(remote_dir, target_info)
        await executor.put_file(f"{remote_dir}/watchdog.json", json.dumps(config, indent=1).encode())
        env = {"RUNPOD_API_BASE_URL": config["api_base_url"]} if config["api_base_url"] else {}
        job = JobSpec(
            run_id=f"{target_info.get('run_id', 'run')}-watchdog",
            remote_dir=f"{remote_dir}/watchdog",
            command=self.watchdog_command(remote_dir, target_info),
            cwd=remote_dir,
            env=env,
            secrets={"RUNPOD_API_KEY": key},
        )
        handle = await executor.spawn(job)
        log.info("runpod.watchdog_started", run_id=target_info.get("run_id"), pod_id=target_info.get("pod_id"), remote_dir=remote_dir, pid=handle.pid)
        return handle

    async def renew_lease(self, executor: Executor, remote_dir: str, ttl: float) -> None:
        """Tell the watchdog the daemon is in charge for the next `ttl` seconds."""
        await executor.put_file(f"{remote_dir}/lease", lease_bytes(self.clock(), ttl))

    # --- status and caps ------------------------------------------------------------------------

    async def describe(self, target_info: dict[str, Any]) -> dict[str, Any]:
        """The pod's state, hourly rate and spend so far, for `obd train status` (never raises)."""
        now = self.clock()
        out: dict[str, Any] = {
            "pod_id": target_info.get("pod_id"),
            "pod_name": target_info.get("pod_name"),
            "gpu_type": target_info.get("gpu_type"),
            "cost_per_hr": target_info.get("cost_per_hr"),
            "started_at": target_info.get("started_at"),
            "max_hours": target_info.get("max_hours", self.target.max_hours),
            "max_cost_usd": target_info.get("max_cost_usd", self.target.max_cost_usd),
            "ssh": _ssh_address(target_info, self.ssh_user),
        }
        pod_id = target_info.get("pod_id")
        if not pod_id:
            out.update(state=target_info.get("phase", "creating"), spend_usd=None)
            return out
        pod: Any = _NO_ANSWER
        try:
            with anyio.move_on_after(self.describe_timeout):
                pod = await self.api.get_pod(pod_id)
        except RunpodApiError as exc:
            out.update(state="unknown", error=str(exc), spend_usd=spend(target_info, now))
            return out
        if pod is _NO_ANSWER:
            out.update(
                state="unknown", error="the Runpod API did not answer in time", spend_usd=spend(target_info, now)
            )
            return out
        if pod is None:
            out.update(state="gone", spend_usd=spend(target_info, now))
            return out
        if pod.cost_per_hr:
            out["cost_per_hr"] = pod.cost_per_hr
        out.update(
            state=pod.desired_status or "unknown",
            uptime_s=pod.uptime_seconds,
            spend_usd=spend({**target_info, "cost_per_hr": out["cost_per_hr"]}, now),
        )
        return out

    def _cap_points(self, target_info: dict[str, Any]) -> dict[str, float]:
        """Unix times at which each cap is reached, for the caps that apply."""
        points: dict[str, float] = {}
        started = target_info.get("started_at")
        if started is None:
            return points
        max_hours = target_info.get("max_hours", self.target.max_hours)
        if max_hours is not None:
            points["deadline"] = float(started) + float(max_hours) * 3600.0
        max_cost, rate = target_info.get("max_cost_usd", self.target.max_cost_usd), target_info.get("cost_per_hr")
        if max_cost is not None and rate:
            points["cost"] = float(started) + float(max_cost) / float(rate) * 3600.0
        return points

    async def check_caps(self, target_info: dict[str, Any], now: float) -> str | None:
        """`deadline` or `cost` once that cap is less than the snapshot margin away, else None.

        The margin is `cap_margin`, but never more than a quarter of the way from the pod's start
        to the cap, so a short cap does not ask for a snapshot at once.
        """
        started = float(target_info.get("started_at") or 0)
        for reason, at in sorted(self._cap_points(target_info).items(), key=lambda kv: kv[1]):
            if now >= at - snapshot_margin(self.cap_margin, at - started):
                return reason
        return None

    async def cap_reached(self, target_info: dict[str, Any], now: float) -> str | None:
        """`deadline` or `cost` once the cap itself is passed (the job must stop now), else None."""
        for reason, at in sorted(self._cap_points(target_info).items(), key=lambda kv: kv[1]):
            if now >= at:
                return reason
        return None

    # --- finish ------------------------------------------------------------------------------------

    async def finish(
        self, run_id: str, remote_dir: str, target_info: dict[str, Any], local_dir: Path
    ) -> tuple[bool, str]:
        """Retrieve and verify the outputs, then terminate the pod (unless keep_pod).

        Returns (outputs safe locally, message). A failed retrieval leaves the pod up and says how
        to retry; a pod that is gone is reported as such (its outputs are lost).
        """
        pod_id = target_info.get("pod_id")
        self.book.put(run_id, target_info=dict(target_info), remote_dir=remote_dir, local_dir=str(local_dir))
        retry = f"retry with `obd pods retrieve {run_id}`, or give up and remove it with `obd pods rm {pod_id}`"
        if not pod_id:
            return False, "no pod was created for this run"
        try:
            pod = await self.api.get_pod(pod_id)
        except RunpodApiError as exc:
            return False, f"could not look up pod {pod_id} ({exc}); the pod is left as it is: {retry}"
        if pod is None:
            self.book.put(run_id, finished=self.clock(), pod_gone=True)
            return False, f"pod {pod_id} no longer exists (terminated outside obd?): the outputs on it are lost"
        if pod.desired_status == "EXITED":
            try:
                target_info = await self.restart_stopped(target_info, _keep)
            except (ExecutorError, RunpodApiError) as exc:
                return False, (
                    f"pod {pod_id} is stopped (EXITED) and could not be started again to copy its outputs: {exc}. "
                    f"They stay on its volume, which is billed while the pod exists: {retry}"
                )
        try:
            target_info = await self.pin_host_key(target_info)
            count, size = await self.retrieve(remote_dir, target_info, Path(local_dir))
        except ExecutorError as exc:
            rate = pod.cost_per_hr or target_info.get("cost_per_hr")
            cost = f" (it costs ${rate:.2f}/h)" if rate else ""
            log.error("runpod.retrieve_failed", run_id=run_id, pod_id=pod_id, error=str(exc))
            return False, (
                f"retrieving the outputs of pod {pod_id} failed: {exc}. The pod is left up{cost}: {retry}. "
                f"Its watchdog deletes it once abandon_grace ({self.target.abandon_grace:.0f}s) has passed since the "
                "job ended and no daemon holds its lease"
            )
        done = f"retrieved {count} files ({size / 1e6:.1f} MB) into {local_dir}, sha256 verified"
        self.book.put(run_id, retrieved=self.clock())
        if self.target.keep_pod:
            await self._mark_retrieved(target_info, remote_dir)
            return True, f"{done}; pod {pod_id} kept (keep_pod): remove it with `obd pods rm {pod_id}`"
        try:
            await self.terminate(pod_id, run_id)
        except RunpodApiError as exc:
            return True, (
                f"{done}; but terminating pod {pod_id} failed ({exc}): run `obd pods rm {pod_id}` "
                f"(its watchdog deletes it after abandon_grace otherwise)"
            )
        self.book.put(run_id, finished=self.clock(), terminated=True)
        return True, f"{done}; pod {pod_id} terminated"

    async def _mark_retrieved(self, target_info: dict[str, Any], remote_dir: str) -> None:
        ex = self.executor(target_info)
        try:
            await ex.put_file(f"{remote_dir}/retrieved", f"{self.clock():.3f}\n".encode())
        except ExecutorError as exc:
            log.warning("runpod.retrieved_marker_failed", run_id=target_info.get("run_id"), remote_dir=remote_dir, error=str(exc))
        finally:
            await ex.aclose()

    async def retrieve(self, remote_dir: str, target_info: dict[str, Any], local_dir: Path) -> tuple[int, int]:
        """Download every output file and check its size and sha256 against the pod's own; (files, bytes)."""
        ex = self.executor(target_info)
        try:
            manifest = await self.remote_manifest(ex, remote_dir)
            entries = manifest.get("files") or []
            local_dir.mkdir(parents=True, exist_ok=True)
            total = 0
            for entry in entries:
                total += await self._fetch_verified(ex, remote_dir, entry, local_dir)
            (local_dir / "retrieved.json").write_text(json.dumps({**manifest, "time": self.clock()}, indent=1))
            return len(entries), total
        finally:
            await ex.aclose()

    async def remote_manifest(self, ex: Executor, remote_dir: str) -> dict[str, Any]:
        """Sizes and sha256 of the outputs, computed on the pod by the watchdog script (one round trip)."""
        run_command = getattr(ex, "run_command", None)
        if run_command is None:
            raise ExecutorError("the pod executor cannot run commands; the outputs cannot be verified")
        python = await ex.python_command() if hasattr(ex, "python_command") else self.target.python
        # The script comes on stdin: the listing depends on nothing being installed on the pod.
        source = (PLUGIN_DIR / "watchdog.py").read_bytes()
        code, out, err = await run_command([python, "-", "manifest", remote_dir], stdin=source, timeout=1800)
        if code != 0:
            raise ExecutorError(
                f"listing the outputs on the pod failed (exit {code}): {err.decode(errors='replace')[-300:]}"
            )
        try:
            manifest = json.loads(out)
        except ValueError as exc:
            raise ExecutorError("the pod's output listing is not JSON") from exc
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
            raise ExecutorError("the pod's output listing has no file list")
        return manifest

    async def _fetch_verified(self, ex: Executor, remote_dir: str, entry: dict[str, Any], local_dir: Path) -> int:
        rel = safe_relpath(str(entry.get("path", "")))
        if rel is None:
            raise ExecutorError(f"the pod listed an output outside the run directory: {entry.get('path')!r}")
        local = local_dir.joinpath(*rel.parts)
        want = (int(entry["size"]), str(entry["sha256"]))
        got: tuple[int, str] | None = None
        for _attempt in range(2):
            await ex.download(f"{remote_dir}/{rel}", local)
            try:
                got = await anyio.to_thread.run_sync(sha256_local, local)
            except OSError:
                got = None
            if got == want:
                return want[0]
        raise ExecutorError(
            f"{rel} does not match the pod's copy after 2 tries (pod: {want[0]} bytes sha256 {want[1][:12]}, "
            f"here: {got[0] if got else 'missing'}{' sha256 ' + got[1][:12] if got else ''})"
        )

    # --- pods: list, terminate, reconcile -----------------------------------------------------

    async def terminate(self, pod_id: str, run_id: str | None = None) -> None:
        """Terminate a pod (a pod already gone counts as terminated)."""
        await self.api.terminate(pod_id)
        log.info("runpod.terminated", target=self.name, run_id=run_id, pod_id=pod_id)

    async def list_pods(self) -> list[dict[str, Any]]:
        """The pods this obd install created, with their state, rate and spend."""
        now = self.clock()
        book = {e.get("target_info", {}).get("pod_id"): e for e in self.book.all().values()}
        out = []
        for pod in await self.api.list_pods():
            if not self.is_ours(pod):
                continue
            started = (book.get(pod.id) or {}).get("target_info", {}).get("started_at")
            if started is None and pod.uptime_seconds is not None:
                started = now - float(pod.uptime_seconds)
            out.append(
                {
                    "pod_id": pod.id,
                    "pod_name": pod.name,
                    "run_id": pod.env.get("OBD_RUN_ID"),
                    "state": pod.desired_status,
                    "gpu_type": pod.gpu_display_name,
                    "gpu_count": pod.gpu_count,
                    "cost_per_hr": pod.cost_per_hr,
                    "started_at": started,
                    "spend_usd": spend({"cost_per_hr": pod.cost_per_hr, "started_at": started}, now),
                    "ssh": f"{pod.ssh_host}:{pod.ssh_port}" if pod.ssh_host else None,
                }
            )
        return out

    async def reconcile(self, known: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
        """Match obd's pods with the live runs (`known`: run id → target_info).

        One item per finding, `kind` being: `matched` (pod and run agree), `adopted` (the run's
        record had no pod id yet: the daemon stores `target_info`), `orphan` (a pod with no live
        run: the daemon retrieves its outputs into the run's directory and terminates it), `gone`
        (the run's pod no longer exists: the run is failed with `reason`), `not_created` (the run
        was recorded before a create that never happened: failed with `reason`).
        """
        pods = [p for p in await self.api.list_pods() if self.is_ours(p)]
        by_id = {p.id: p for p in pods}
        claimed: set[str] = set()
        out: list[dict[str, Any]] = []
        for run_id, info in known.items():
            pod_id = info.get("pod_id")
            if pod_id and pod_id in by_id:
                claimed.add(pod_id)
                out.append(
                    {"kind": "matched", "run_id": run_id, "pod_id": pod_id, "state": by_id[pod_id].desired_status}
                )
                continue
            if pod_id:
                out.append({
                    "kind": "gone", "run_id": run_id, "pod_id": pod_id,
                    "reason": f"pod {pod_id} no longer exists (terminated outside obd, or reclaimed by Runpod); "
                    "the outputs on it are lost",
                })  # fmt: skip
                continue
            tagged = [p for p in pods if p.env.get("OBD_RUN_ID") == run_id and p.id not in claimed]
            if tagged:
                pod = tagged[0]
                claimed.add(pod.id)
                out.append(
                    {
                        "kind": "adopted",
                        "run_id": run_id,
                        "pod_id": pod.id,
                        "target_info": self._info_from_pod(pod, info),
                    }
                )
                continue
            out.append({
                "kind": "not_created", "run_id": run_id, "pod_id": None,
                "reason": "obd stopped before the pod was created (no pod carries this run's tag); start the run again",
            })  # fmt: skip
        for pod in pods:
            if pod.id in claimed:
                continue
            run_id = pod.env.get("OBD_RUN_ID") or ""
            booked = (self.book.get(run_id) or {}).get("target_info") if RUN_ID_RE.match(run_id) else None
            info = booked if booked and booked.get("pod_id") == pod.id else self._info_from_pod(pod, {})
            out.append({
                "kind": "orphan", "run_id": run_id or None, "pod_id": pod.id, "pod_name": pod.name,
                "remote_dir": f"{self.target.workdir.rstrip('/')}/{run_id}" if run_id else None,
                "target_info": info,
                "reason": f"pod {pod.id} ({pod.name}) has no live run in obd",
            })  # fmt: skip
        for item in out:
            if item["kind"] != "matched":
                log.warning("runpod.reconcile", **{k: v for k, v in item.items() if k != "target_info"})
        return out

    def _info_from_pod(self, pod: Pod, base: dict[str, Any]) -> dict[str, Any]:
        """A target_info for a pod found by its tag (its host key is pinned by `pin_host_key`)."""
        run_id = pod.env.get("OBD_RUN_ID")
        started = base.get("started_at") or (self.clock() - float(pod.uptime_seconds or 0))
        return {
            **base,
            "kind": "runpod",
            "target": self.name,
            "run_id": run_id,
            "pod_name": pod.name,
            "pod_id": pod.id,
            "owner": self.owner,
            # Ready only once its host key is pinned: `resume` waits for SSH and pins it.
            "phase": "ready" if pod.ssh_host and base.get("host_key") else "booting",
            "gpu_type": pod.gpu_display_name,
            "cost_per_hr": pod.cost_per_hr or base.get("cost_per_hr"),
            "started_at": started,
            "ssh_host": pod.ssh_host,
            "ssh_port": pod.ssh_port,
            "ssh_user": self.ssh_user,
            "host_key": base.get("host_key"),
            "max_hours": self.target.max_hours,
            "max_cost_usd": self.target.max_cost_usd,
        }

    async def pin_host_key(self, target_info: dict[str, Any]) -> dict[str, Any]:
        """Fill in the host key of an adopted pod that has none (first use of that pod by obd)."""
        if target_info.get("host_key") or not target_info.get("ssh_host"):
            return target_info
        key = await self._host_key(target_info["ssh_host"], int(target_info["ssh_port"]))
        if key is None:
            raise ExecutorError(
                f"pod {target_info.get('pod_id')} does not answer SSH at "
                f"{target_info['ssh_host']}:{target_info['ssh_port']}"
            )
        return {**target_info, "host_key": key}
