"""A pod's life: created for one run, waited for until it answers SSH, started again after a stop,
ended.

Whatever could leave a pod behind is preceded by a `save` of the run's `PodInfo`: its name
before each create call, its id as soon as it is known. A pod that never becomes ready is
terminated (a stopped one only stopped again, so its volume keeps the outputs). Host keys are
pinned on first contact with a freshly made pod.
"""

from __future__ import annotations

import contextlib
import importlib
from pathlib import Path

import anyio
import anyio.to_thread
import structlog

from executors.base import ExecutorError
from executors.runpod.api import NoCapacity, Pod, RunpodApiError, TransientError, UnknownGpu
from executors.runpod.context import TAG_OWNER, TAG_RUN, TAG_TARGET, TAG_WORKDIR, PodContext, Save
from executors.runpod.info import PodInfo, PodObservation, PodPhase

log = structlog.get_logger("obd.runpod")


class PodGone(ExecutorError):
    """The pod no longer exists: terminated outside obd, or reclaimed by Runpod."""


class PodLifecycle:
    """Creates, readies, restarts, observes and ends the pods of one target."""

    def __init__(
        self,
        ctx: PodContext,
        *,
        poll_interval: float = 5.0,
        create_retries: int = 3,
        settle: float = 2.0,
        ssh_probe_timeout: float = 10.0,
        describe_timeout: float = 10.0,
    ) -> None:
        self.ctx = ctx
        self.poll_interval = poll_interval
        self.create_retries = create_retries
        self.settle = settle
        self.ssh_probe_timeout = ssh_probe_timeout
        self.describe_timeout = describe_timeout

    @property
    def create_window(self) -> float:
        """How long after a create call was sent a pod it made may still appear: the call's own
        deadline, and time for Runpod to list the pod."""
        return self.ctx.api.call_timeout + 30.0

    # --- create ---------------------------------------------------------------------------------

    async def plan(self) -> list[tuple[str, float | None]]:
        """The GPU types to try, in order, with their hourly rate; refuses a cost cap without a rate."""
        t, name = self.ctx.target, self.ctx.name
        plan: list[tuple[str, float | None]] = []
        unknown: list[str] = []
        for gpu in t.gpu_types():
            try:
                rate = await self.ctx.api.gpu_rate(gpu, t.gpu_count, t.cloud_type)
            except UnknownGpu:
                unknown.append(gpu)
                continue
            if t.max_cost_usd is not None and rate is None:
                log.warning("runpod.no_rate", target=name, gpu_type=gpu, cloud_type=t.cloud_type)
                unknown.append(gpu)
                continue
            plan.append((gpu, rate))
        if not plan:
            if t.max_cost_usd is not None:
                raise ExecutorError(
                    f"target {name!r} has max_cost_usd = {t.max_cost_usd} but no hourly rate is known for "
                    f"{', '.join(unknown)} ({t.cloud_type} cloud), so the cap could not be enforced: nothing was "
                    "created. Pick a gpu_type with a listed price "
                    "(`python -c 'import runpod; print(runpod.get_gpus())'`) or remove max_cost_usd"
                )
            raise ExecutorError(
                f"none of the GPU types of target {name!r} exists: {', '.join(unknown)}; nothing was created. "
                "Fix gpu_type in the config (`python -c 'import runpod; print(runpod.get_gpus())'` lists them)"
            )
        return plan

    def pod_env(self, run_id: str) -> dict[str, str]:
        """The env tags of the pod (run, install, target, workdir), and the SSH public key Runpod
        images authorise (PUBLIC_KEY)."""
        t = self.ctx.target
        env = {TAG_RUN: run_id, TAG_OWNER: self.ctx.owner, TAG_TARGET: self.ctx.name, TAG_WORKDIR: t.workdir}
        if t.identity_file is not None:
            pub = Path(str(Path(t.identity_file).expanduser()) + ".pub")
            with contextlib.suppress(OSError):  # no public key beside it: the image's own keys apply
                env["PUBLIC_KEY"] = pub.read_text().strip()
        return env

    async def create(self, run_id: str, save: Save) -> PodInfo:
        """Create the run's pod and wait until it answers SSH; `save` is awaited before each risky step."""
        ctx = self.ctx
        name = ctx.pod_name(run_id)
        plan = await self.plan()  # may refuse: nothing recorded, nothing created
        info = PodInfo(
            target=ctx.name,
            run_id=run_id,
            pod_name=name,
            owner=ctx.owner,
            phase=PodPhase.creating,
            gpu_types=[g for g, _ in plan],
            requested_at=ctx.clock(),
            workdir=ctx.target.workdir,
        )
        await self.save(save, info)
        # A cancel waits for the create's answer, so that a pod made is always recorded (and then
        # terminated by the boot wait's clean-up) rather than left for the reconcile to find.
        with anyio.CancelScope(shield=True):
            try:
                pod, gpu, rate, started_at = await self._create_pod(info, save, plan)
            except ExecutorError as exc:
                info = info.model_copy(update={"phase": PodPhase.create_failed, "error": str(exc)})
                await self.save(save, info)
                raise
            info = info.model_copy(
                update={
                    "pod_id": pod.id,
                    "phase": PodPhase.booting,
                    "gpu_type": gpu,
                    "cost_per_hr": pod.cost_per_hr or rate,
                    "started_at": started_at,
                    "max_hours": ctx.target.max_hours,
                    "max_cost_usd": ctx.target.max_cost_usd,
                }
            )
            await self.save(save, info)
        log.info(
            "runpod.created", target=ctx.name, run_id=run_id, pod_id=pod.id, gpu_type=gpu, cost_per_hr=info.cost_per_hr
        )
        info = await self._until_ready(info, save, started_at, ctx.target.boot_grace)
        log.info("runpod.ready", target=ctx.name, run_id=run_id, pod_id=pod.id, ssh=f"{info.ssh_host}:{info.ssh_port}")
        return info

    async def resume(self, info: PodInfo, save: Save) -> PodInfo:
        """Carry on with a pod whose boot the daemon did not see through (a restart, an adoption).

        Waits for its SSH port for what is left of boot_grace (counted from the pod's start) and pins
        the host key; a pod that never becomes ready is terminated, as in `create`.
        """
        if info.is_ready:
            return info
        if not info.pod_id:
            raise ExecutorError(f"run {info.run_id} has no pod to resume; start the run again")
        pod = await self._get_pod_soft(info.pod_id)
        if pod is not None and pod.desired_status == "EXITED":
            return await self.restart_stopped(info, save)  # never terminate a volume that holds outputs
        started = info.started_at if info.started_at is not None else self.ctx.clock()
        left = started + self.ctx.target.boot_grace - self.ctx.clock()
        return await self._until_ready(info, save, float(info.started_at or 0), max(left, 0.0))

    async def _until_ready(self, info: PodInfo, save: Save, started_at: float, grace: float) -> PodInfo:
        """Wait for the pod's SSH within `grace`, pin its host key and save it ready; a pod that
        never gets there is terminated (`_abandon_boot`) and the error raised."""
        assert info.pod_id is not None
        try:
            host, port, key, rate = await self._wait_ssh(info.pod_id, started_at, grace)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._abandon_boot(info, save, exc)
            raise
        update: dict[str, object] = {
            "phase": PodPhase.ready,
            "ssh_host": host,
            "ssh_port": port,
            "ssh_user": self.ctx.ssh_user,
            "host_key": key,
        }
        if rate:
            update["cost_per_hr"] = rate
        info = info.model_copy(update=update)
        await self.save(save, info)
        return info

    async def restart_stopped(self, info: PodInfo, save: Save) -> PodInfo:
        """Start a stopped (EXITED) pod again, to reach the outputs on its volume.

        A stop (the console's Stop button, a spot interruption, a low balance) ends the container
        and the job in it but keeps the volume, where the run directory lives. The new container
        has a new SSH port and host key, pinned again: the pod is the same one by its id. A pod that
        does not get ready within boot_grace is stopped again, not terminated, so the outputs stay.
        """
        ctx = self.ctx
        pod_id = info.pod_id
        if not pod_id:
            raise ExecutorError(f"run {info.run_id} has no pod to start again")
        pod = await ctx.api.get_pod(pod_id)
        if pod is None:
            raise PodGone(f"pod {pod_id} no longer exists (terminated outside obd, or reclaimed by Runpod)")
        if pod.desired_status != "EXITED":
            return info
        await ctx.api.resume_pod(pod_id, pod.gpu_count or ctx.target.gpu_count)
        started = ctx.clock()
        info = info.model_copy(
            update={
                "phase": PodPhase.booting,
                "ssh_host": None,
                "ssh_port": None,
                "host_key": None,
                "restarted_at": started,
            }
        )
        await self.save(save, info)
        log.warning("runpod.restarted_stopped_pod", target=ctx.name, run_id=info.run_id, pod_id=pod_id)
        try:
            host, port, key, rate = await self._wait_ssh(pod_id, started, ctx.target.boot_grace)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                why = str(exc) or type(exc).__name__
                try:
                    with anyio.fail_after(120):
                        await ctx.api.stop_pod(pod_id)
                    info = info.model_copy(update={"phase": PodPhase.stopped, "error": why})
                except (RunpodApiError, TimeoutError) as stop_exc:
                    info = info.model_copy(
                        update={"phase": PodPhase.booting, "error": f"{why}; stopping it again failed too: {stop_exc}"}
                    )
                    log.error("runpod.restart_stop_failed", run_id=info.run_id, pod_id=pod_id, error=str(stop_exc))
                with anyio.move_on_after(30):
                    await self.save(save, info)
            raise
        update: dict[str, object] = {
            "phase": PodPhase.ready,
            "ssh_host": host,
            "ssh_port": port,
            "ssh_user": ctx.ssh_user,
            "host_key": key,
            "error": None,
        }
        if rate:
            update["cost_per_hr"] = rate
        info = info.model_copy(update=update)
        await self.save(save, info)
        return info

    async def save(self, save: Save, info: PodInfo) -> None:
        """The caller's record first (it must hold before anything else happens), then the book."""
        await save(info.model_copy())
        self.ctx.book.put(info.run_id, target_info=info)

    async def _create_pod(
        self, info: PodInfo, save: Save, plan: list[tuple[str, float | None]]
    ) -> tuple[Pod, str, float | None, float]:
        """Try each GPU type; after any failure that may have created a pod, look it up by its tag first.

        The time of each create call is saved before it is sent, so a daemon that dies meanwhile
        knows, on restart, until when the pod it may have made can still appear.
        """
        ctx, t = self.ctx, self.ctx.target
        run_id, name = info.run_id, info.pod_name
        refused: list[str] = []
        first_try: float | None = None
        for gpu, rate in plan:
            failures = 0
            while True:
                found = await self._find_tagged(run_id, name)
                if found:
                    log.warning("runpod.adopted_ambiguous_create", run_id=run_id, pod_id=found.id)
                    return found, gpu, rate, first_try or ctx.clock()
                started = ctx.clock()
                first_try = first_try or started
                info = info.model_copy(update={"create_sent_at": started})
                await self.save(save, info)
                try:
                    raw = await ctx.api.create_pod(
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
            f"no capacity on Runpod for any GPU type of target {ctx.name!r} ({t.cloud_type} cloud): "
            f"{'; '.join(refused)}. Nothing was created and nothing is billed. Retry later, add GPU types to "
            'gpu_type, or set cloud_type = "ALL"'
        )

    async def _find_tagged(self, run_id: str, name: str) -> Pod | None:
        """The pod of this run, by name and env tags; extra copies (a duplicate create) are terminated."""
        try:
            pods = await self.ctx.api.list_pods()
        except RunpodApiError as exc:
            raise ExecutorError(
                f"could not check whether pod {name} already exists ({exc}); nothing more was created. "
                "See `obd pods list` and remove any leftover with `obd pods rm POD_ID`"
            ) from exc
        mine = [p for p in pods if p.name == name and self.ctx.is_ours(p) and p.env.get(TAG_RUN) == run_id]
        for extra in mine[1:]:
            try:
                await self.ctx.api.terminate(extra.id)
                log.warning("runpod.duplicate_terminated", run_id=run_id, pod_id=extra.id)
            except RunpodApiError as exc:  # it carries the run's tag: reconcile reports it as an orphan
                log.error("runpod.duplicate_terminate_failed", run_id=run_id, pod_id=extra.id, error=str(exc))
        return mine[0] if mine else None

    async def _get_pod_soft(self, pod_id: str) -> Pod | None:
        try:
            return await self.ctx.api.get_pod(pod_id)
        except TransientError:
            return None

    async def _wait_ssh(self, pod_id: str, started_at: float, grace: float) -> tuple[str, int, str, float | None]:
        """Poll until the pod has a public port 22 that answers SSH; pin its host key (TOFU)."""
        deadline = anyio.current_time() + grace
        last = "the API reported no public port 22 yet"
        while True:
            try:
                pod = await self.ctx.api.get_pod(pod_id)
            except TransientError as exc:
                pod, last = None, str(exc)
            else:
                if pod is None:
                    raise PodGone(f"pod {pod_id} disappeared while it was booting (terminated outside obd?)")
                if pod.desired_status in ("EXITED", "TERMINATED"):
                    raise PodGone(f"pod {pod_id} stopped while booting (status {pod.desired_status})")
                if pod.ssh_host and pod.ssh_port:
                    key = await self.host_key(pod.ssh_host, pod.ssh_port)
                    if key:
                        return pod.ssh_host, pod.ssh_port, key, pod.cost_per_hr
                    last = f"{pod.ssh_host}:{pod.ssh_port} does not answer SSH yet"
            if anyio.current_time() >= deadline:
                raise ExecutorError(
                    f"pod {pod_id} got no working public SSH port within boot_grace "
                    f"({self.ctx.target.boot_grace:.0f}s): {last}. The image must run sshd (Runpod's images do, "
                    "with start_ssh); raise boot_grace for a slow image"
                )
            await anyio.sleep(self.poll_interval)

    async def host_key(self, host: str, port: int) -> str | None:
        """The host key line `alg base64` the SSH server presents, or None when it does not answer."""
        # asyncssh (a quarter of a second to import) when a pod is first reached, off the event loop.
        asyncssh = await anyio.to_thread.run_sync(importlib.import_module, "asyncssh")
        try:
            with anyio.fail_after(self.ssh_probe_timeout):
                key = await asyncssh.get_server_host_key(host, port, config=None)
        except (OSError, TimeoutError, asyncssh.Error):
            return None
        if key is None:
            return None
        return " ".join(key.export_public_key().decode().split()[:2])

    async def _abandon_boot(self, info: PodInfo, save: Save, exc: BaseException) -> None:
        """A pod that never became usable: terminate it, and record whether that worked."""
        pod_id = info.pod_id
        assert pod_id is not None
        why = str(exc) or type(exc).__name__
        try:
            with anyio.fail_after(120):
                await self.ctx.api.terminate(pod_id)
            info = info.model_copy(update={"phase": PodPhase.terminated, "error": why})
            log.warning("runpod.boot_failed_terminated", run_id=info.run_id, pod_id=pod_id, error=str(exc))
        except (RunpodApiError, TimeoutError) as term_exc:
            info = info.model_copy(
                update={"phase": PodPhase.terminate_failed, "error": f"{why}; terminating it failed too: {term_exc}"}
            )
            log.error("runpod.boot_failed_terminate_failed", run_id=info.run_id, pod_id=pod_id, error=str(term_exc))
            if isinstance(exc, ExecutorError):
                exc.args = (f"{exc}; terminating pod {pod_id} failed ({term_exc}): run `obd pods rm {pod_id}`",)
        else:
            if isinstance(exc, ExecutorError) and "terminated" not in str(exc):
                exc.args = (f"{exc}; pod {pod_id} was terminated",)
        try:
            await self.save(save, info)
        except Exception as save_exc:  # the pod is already settled; the error above is what matters
            log.error("runpod.save_failed", run_id=info.run_id, pod_id=pod_id, error=str(save_exc))

    # --- reaching it, watching it, ending it ------------------------------------------------------

    async def pin_host_key(self, info: PodInfo) -> PodInfo:
        """Fill in the host key of an adopted pod that has none (first use of that pod by obd)."""
        if info.host_key or not info.ssh_host or not info.ssh_port:
            return info
        key = await self.host_key(info.ssh_host, int(info.ssh_port))
        if key is None:
            raise ExecutorError(f"pod {info.pod_id} does not answer SSH at {info.ssh_host}:{info.ssh_port}")
        return info.model_copy(update={"host_key": key})

    async def observe(self, info: PodInfo) -> PodObservation:
        """What the API says of the pod now (never raises): its state, or `gone`, or `unknown` and why."""
        now = self.ctx.clock()
        if not info.pod_id:
            return PodObservation(state=info.phase.value, at=now)
        try:
            with anyio.fail_after(self.describe_timeout):
                pod = await self.ctx.api.get_pod(info.pod_id)
        except TimeoutError:
            return PodObservation(state="unknown", at=now, error="the Runpod API did not answer in time")
        except RunpodApiError as exc:
            return PodObservation(state="unknown", at=now, error=str(exc))
        if pod is None:
            return PodObservation(state="gone", at=now)
        return PodObservation(
            state=pod.desired_status or "unknown", at=now, cost_per_hr=pod.cost_per_hr, uptime_s=pod.uptime_seconds
        )

    async def terminate(self, pod_id: str, run_id: str | None = None) -> None:
        """Terminate a pod (a pod already gone counts as terminated)."""
        await self.ctx.api.terminate(pod_id)
        log.info("runpod.terminated", target=self.ctx.name, run_id=run_id, pod_id=pod_id)
