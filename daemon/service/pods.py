"""Pod targets as the daemon serves them: one pod per run, created, watched, capped, emptied, ended.

(A few lines over 600: a pod's life is one concern, and what a record keeps of its pod is already
apart, in daemon/service/pod_record.py.)

`RunpodDriver` (executors/runpod) knows the pods; `PodSupervision` decides when the daemon
calls it. It overrides the hooks of `daemon/targets.Supervision`, so the launch and the follow
treat a pod run like any other: it is followed through an SSH executor to its pod, with a lease
renewed and the caps checked before every probe; when its job ends, the outputs are retrieved
and verified before the pod is terminated. Everything Runpod-specific that the daemon does is
here. A run's pod is a `PodInfo`; the record keeps it as a plain dict (`target_info`), converted
here and nowhere else.

The caps hold from this side whatever the job does on its pod (it may kill or fake the watchdog,
its lease, even obd's tools there): no pod outlives its first cap by more than `abandon_grace`
(`end_by`). A job still running then, or outputs not home by then, and the pod is terminated
through the API, which nothing on the pod can reach: the account's key never goes there.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import structlog

from daemon.service.models import RunRecord, RunState
from daemon.service.pod_record import PodEnded, PodHost, end_from_book, keep_pod, mark_pod_end, outputs_lost, pod_info
from daemon.service.retention import holding
from daemon.service.targets import Supervision
from executors.base import Executor, ExecutorError, RunProbe
from executors.factory import make_pod_driver, makes_pods
from executors.runpod import Finding, PodEnd, PodInfo, PodObservation, PodPhase
from trainer_plugin.tools import jobctl

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from executors.config import RunpodTarget

log = structlog.get_logger("obd.pods")
POD_RECONCILE_INTERVAL = 300.0  # how often pods are matched with runs while the daemon runs
STATUS_CACHE_TTL = 60.0  # `status` shows the pod as the follow last saw it, if no older than this
GONE_WHY = "terminated outside obd, or reclaimed by Runpod; the outputs on it were lost"


class PodSupervision(Supervision):
    """A Runpod target: each run gets a pod of its own, followed on its own."""

    config: RunpodTarget
    daemon: PodHost
    reads_every_poll = True  # the lease and the caps ride on every read

    def __init__(self, daemon: PodHost, name: str, config: RunpodTarget) -> None:
        super().__init__(daemon, name, config)
        self.driver = make_pod_driver(name, config, daemon.state_dir)
        self._executors: dict[str, Executor] = {}
        self._checked: dict[str, float] = {}
        self._seen: dict[str, PodObservation] = {}  # each run's pod as the API last showed it
        self._looking_again = False  # a reconcile is due soon for a run recorded mid-create

    # --- the record's pod ------------------------------------------------------------------

    def _saver(self, record: RunRecord) -> Callable[[PodInfo], Awaitable[None]]:
        async def save(info: PodInfo) -> None:
            # Raises on a failed save: a pod is never created without a record of it on disk.
            async with self.daemon.lock(record.id):
                keep_pod(record, info)
                self.daemon.save(record)

        return save

    # --- executors -----------------------------------------------------------------------

    def executor_key(self, record: RunRecord) -> str:
        return f"{record.target}/{record.id}"  # a pod is one run's own machine

    def executor(self, record: RunRecord) -> Executor:
        if record.id not in self._executors:
            self._executors[record.id] = self.driver.executor(pod_info(record))
        return self._executors[record.id]

    def workdir(self, record: RunRecord) -> str:
        return str(self.config.workdir)

    def shares_filesystem(self, record: RunRecord) -> bool:
        return False

    def lease_ttl(self) -> float:
        return max(self.config.lease_ttl, 5 * self.daemon.config.daemon.remote_poll_interval)

    async def forget(self, record: RunRecord) -> None:
        executor = self._executors.pop(record.id, None)
        if executor is not None:
            with contextlib.suppress(Exception):
                await executor.aclose()

    async def aclose(self) -> None:
        for run_id in list(self._executors):
            executor = self._executors.pop(run_id)
            with contextlib.suppress(Exception):
                await executor.aclose()

    # --- launch --------------------------------------------------------------------------

    async def prepare(self, record: RunRecord) -> Executor:
        """Create the run's pod (its record saved before the create call), lease it, start its watchdog.

        A failure once the pod exists ends the pod before the launch is recorded failed, and says so.
        """
        self._refuse_account_key_secrets()
        info = await self.driver.create(record.id, self._saver(record))
        try:
            executor = self.driver.executor(info)
            self._executors[record.id] = executor
            workdir = await executor.resolve_workdir()
            remote_dir = f"{workdir.rstrip('/')}/{record.id}"
            await self.driver.renew_lease(executor, remote_dir, self.lease_ttl())
            await self.driver.start_watchdog(executor, remote_dir, info)
        except Exception as exc:
            why = str(exc) or "the pod did not answer in time"
            with anyio.CancelScope(shield=True):
                ended = await self._end_unused(record, info, why)
            raise ExecutorError(f"{why}; {ended}") from exc
        return executor

    def _refuse_account_key_secrets(self) -> None:
        """Refuse, before any pod is made, a target whose `secrets` would give its jobs the account's key
        (the pod's executor refuses to send it anyway; this says so before anything is billed)."""
        key = self.driver.ctx.account_key()
        names = [n for n in self.config.secrets if key and key in os.environ.get(n, "")]
        if names:
            raise ExecutorError(
                f"target {self.name!r} lists {', '.join(names)} in `secrets`, which holds the Runpod account's API "
                "key: a job on a pod must never get a credential of the account. Remove it from the target's "
                "`secrets`; nothing was created"
            )

    async def _end_unused(self, record: RunRecord, info: PodInfo, why: str) -> str:
        """Terminate a pod whose job never started (nothing on it to retrieve); what became of it."""
        await self.forget(record)
        pod_id = info.pod_id
        assert pod_id is not None
        try:
            with anyio.fail_after(120):
                await self.driver.terminate(pod_id, record.id)
        except (ExecutorError, TimeoutError) as exc:
            log.error("pod_terminate_failed", run_id=record.id, pod_id=pod_id, error=str(exc))
            return f"terminating pod {pod_id} failed too ({exc}): remove it with `obd pods rm {pod_id}`"
        async with self.daemon.editing(record):
            keep_pod(record, info.model_copy(update={"phase": PodPhase.terminated, "error": why}))
            mark_pod_end(record, PodEnd.terminated, f"its job never started: {why}")
        return f"pod {pod_id} was terminated"

    async def on_launch_failed(self, record: RunRecord) -> None:
        if not pod_info(record).pod_id:
            # The create may have made a pod after all (an ambiguous answer): look for it soon.
            self.daemon.start_soon(self._reconcile_soon)

    # --- the follow ----------------------------------------------------------------------

    async def ready(self, record: RunRecord) -> bool:
        """Make sure a pod run left by an earlier daemon has a ready, pinned pod; fail it if it cannot."""
        info = pod_info(record)
        if info.settled:
            await self.daemon.fail(record, f"its pod was never ready ({info.phase.value}: {info.error or 'no detail'})")
            return False
        if info.is_ready:
            return True
        if not info.pod_id:
            return False  # reconcile adopts it by its tag, or fails it as never created
        try:
            keep_pod(record, await self.driver.resume(info, self._saver(record)))
            return True
        except Exception as exc:
            if pod_info(record).settled:  # `resume` ended the pod
                await self.daemon.fail(record, f"its pod never became ready: {exc}")
            else:
                log.warning("pod_resume_deferred", run_id=record.id, error=str(exc))
            return False

    def _ending(self, record: RunRecord) -> bool:
        """Whether the run's pod is being emptied and ended (or was): no more probes for it."""
        return pod_info(record).ended or record.id in self.daemon.follow.finishing

    async def before_poll(self, record: RunRecord, executor: Executor) -> None:
        """Renew the pod's lease; enforce its caps from this side too (snapshot, then cancel).

        A pod whose end is under way is not probed again (its retrieval keeps the lease itself),
        so a terminated pod is never reported unreachable.
        """
        from daemon.service.stop import request_snapshot

        if self._ending(record):
            raise PodEnded(f"the pod of run {record.id} is being emptied and ended")
        if await self._end_overdue(record):
            raise PodEnded(f"the pod of run {record.id} was terminated past its cap")
        with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
            request, cancel = await self._tick(record, executor)
        if self._due_for_check(record) and await self._ended_outside(record):
            return
        if request and record.stop.requested_at is None and record.snapshots:
            await request_snapshot(self.daemon, record, request, "the pod's cap")
        if cancel and record.id not in self.daemon.follow.cancelling and not record.stop.fallback:
            await self.daemon.follow.fallback_cancel(record, cancel, f"cancelling: {cancel}")

    async def _tick(self, record: RunRecord, executor: Executor) -> tuple[str | None, str | None]:
        """Renew the lease and check the caps: (reason to request a snapshot, reason to cancel now)."""
        await self.driver.renew_lease(executor, record.remote_dir, self.lease_ttl())
        now = time.time()
        info = pod_info(record)
        reached = self.driver.cap_reached(info, now)
        if reached:
            return reached, f"the {reached} cap of pod {info.pod_id} was reached"
        return self.driver.check_caps(info, now), None

    async def _end_overdue(self, record: RunRecord) -> bool:
        """Terminate, through the API, the pod of a run whose job still runs `abandon_grace` after the
        pod's cap (the cancel at the cap did not end it, or the daemon was away); True when it did."""
        info = pod_info(record)
        end_by = self.driver.end_by(info)
        if end_by is None or not info.pod_id or time.time() < end_by or record.id in self.daemon.follow.cancelling:
            return False  # a cancel under way is given its time (TERM, grace, KILL)
        why = await self._terminate_overdue(record.id, info, "its job still ran")
        if why is None:
            return False  # the API did not answer: the next poll tries again
        async with self.daemon.editing(record):
            mark_pod_end(record, PodEnd.terminated, why)
        await self.daemon.fail(record, why)
        return True

    async def _terminate_overdue(self, run_id: str, info: PodInfo, what: str) -> str | None:
        """Terminate a pod past its cap + abandon_grace; the message saying so, or None if that failed."""
        assert info.pod_id is not None
        reason = self.driver.cap_reached(info, time.time()) or "cap"
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout * 3):
                await self.driver.terminate(info.pod_id, run_id)
        except Exception as exc:
            log.error("pod_overdue_terminate_failed", run_id=run_id, pod_id=info.pod_id, error=str(exc))
            return None
        with contextlib.suppress(ExecutorError):  # an orphan without a run id has no entry
            self.driver.book.put(run_id, finished=time.time(), terminated=True)
        log.error("pod_terminated_past_cap", run_id=run_id, pod_id=info.pod_id, reason=reason, what=what)
        return (
            f"the {reason} cap of pod {info.pod_id} passed more than abandon_grace "
            f"({self.config.abandon_grace:.0f}s) ago and {what}: the pod was terminated through the API "
            "and the outputs on it are lost"
        )

    async def _finish_in_time(
        self, run_id: str, remote_dir: str, info: PodInfo, local: Path, lease_ttl: float | None = None
    ) -> tuple[bool, str]:
        """`finish` (outputs home, then the pod ended), but never past the pod's `end_by`: by then a
        pod whose outputs are not home is terminated anyway (at once, or when `end_by` comes)."""
        end_by = self.driver.end_by(info)
        if end_by is None or not info.pod_id:
            with holding(run_id):  # no checkpoint of it is pruned while it comes home
                return await self.driver.finish(run_id, remote_dir, info, local, lease_ttl=lease_ttl)
        ok, message = False, "the outputs were not retrieved in time"
        with anyio.move_on_after(max(0.0, end_by - time.time())), holding(run_id):
            ok, message = await self.driver.finish(run_id, remote_dir, info, local, lease_ttl=lease_ttl)
        if ok:
            return ok, message
        if time.time() < end_by:
            self.daemon.start_soon(self._end_when_due, run_id, info, end_by)
            return (
                ok,
                f"{message}; obd terminates the pod at its cap + abandon_grace if its outputs are not home by then",
            )
        why = await self._terminate_overdue(run_id, info, f"its outputs could not be retrieved ({message})")
        return False, why or message

    async def _end_when_due(self, run_id: str, info: PodInfo, end_by: float) -> None:
        """At `end_by`, terminate the pod unless its outputs came home (or it ended) meanwhile."""
        await anyio.sleep(max(0.0, end_by - time.time()))
        entry = self.driver.book.get(run_id)
        if entry is not None and (entry.retrieved or entry.terminated or entry.pod_gone):
            return
        why = await self._terminate_overdue(run_id, info, "its outputs could not be retrieved by then")
        record = self.daemon.records.get(run_id)
        if why is not None and record is not None:
            async with self.daemon.editing(record):
                mark_pod_end(record, PodEnd.terminated, why)
                record.note(why)

    def _due_for_check(self, record: RunRecord) -> bool:
        """Whether to ask the API if the pod still exists (at most every api_poll_interval, 30 s tops)."""
        now = time.monotonic()
        if now - self._checked.get(record.id, 0.0) < min(30.0, self.config.api_poll_interval):
            return False
        self._checked[record.id] = now
        return True

    async def on_unreachable(self, record: RunRecord) -> bool:
        if record.id in self.daemon.follow.finishing:
            return True  # not probed on purpose (see before_poll): nothing to note
        if pod_info(record).ended:
            # Its pod was ended but the run's end was not recorded (the daemon stopped in between).
            await self._finish_without_pod(record)
            return True
        return await self._ended_outside(record) or await self._cap_on_unreachable(record)

    async def _finish_without_pod(self, record: RunRecord) -> None:
        """End a run whose pod is no more: from the local copy of its run directory if its outputs
        were retrieved and verified, else failed, saying the outputs are lost."""
        if self._retrieved_at(record):
            local = self.daemon.store.run_dir(record.id) / "retrieved"
            raw = await anyio.to_thread.run_sync(jobctl.probe_dir, str(local), None)
            await self.daemon.follow.apply(record, RunProbe.model_validate(raw))
            return
        pod_id = pod_info(record).pod_id
        await self.daemon.fail(record, f"pod {pod_id} was ended before the run's outputs were retrieved; they are lost")

    async def _cap_on_unreachable(self, record: RunRecord) -> bool:
        """A pod past its cap that cannot be reached for a lease's time is terminated: the cap holds
        even with the pod's SSH and watchdog gone (its outputs are then lost, and the run says so)."""
        info = pod_info(record)
        reason = self.driver.cap_reached(info, time.time())
        since = record.unreachable_since
        if not reason or not info.pod_id or since is None or time.time() - since < self.lease_ttl():
            return False
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
                await self.driver.terminate(info.pod_id, record.id)
        except Exception as exc:
            log.error("pod_cap_terminate_failed", run_id=record.id, error=str(exc))
            return False
        why = (
            f"the {reason} cap of pod {info.pod_id} passed while the pod could not be reached; "
            "the pod was terminated and the outputs on it are lost"
        )
        async with self.daemon.editing(record):
            mark_pod_end(record, PodEnd.terminated, why)
        await self.daemon.fail(record, why)
        log.error("pod_cap_terminated_unreachable", run_id=record.id, reason=reason)
        return True

    async def _observe(self, record: RunRecord) -> PodObservation:
        """Ask the API for the run's pod now, and remember the answer for `status`."""
        with anyio.fail_after(self.daemon.config.daemon.probe_timeout):
            seen = await self.driver.observe(pod_info(record))
        self._seen[record.id] = seen
        return seen

    async def _ended_outside(self, record: RunRecord) -> bool:
        """Whether the run's pod was terminated or stopped outside obd (the run is failed, or its
        stopped pod started again to recover its outputs), rather than merely slow to answer."""
        if record.id in self.daemon.follow.finishing:
            return False  # its finish retrieves the outputs and then ends the pod itself
        try:
            seen = await self._observe(record)
        except Exception:
            return False
        if seen.state == "EXITED":
            await self._restart_stopped(record)
            return True
        if seen.state != "gone":
            return False
        why = f"pod {pod_info(record).pod_id} no longer exists (terminated outside obd, or reclaimed)"
        async with self.daemon.editing(record):
            if not record.state.final:
                mark_pod_end(record, PodEnd.gone, GONE_WHY, seen.at)
        if await self.daemon.fail(record, why):
            log.error("pod_gone", run_id=record.id, reason=why)
        return True

    async def _restart_stopped(self, record: RunRecord) -> None:
        """A pod stopped outside obd ended its job, but its volume holds the run directory: start it
        again so the follow finds the job ended and retrieves the outputs, then ends the pod."""
        pod_id = pod_info(record).pod_id
        async with self.daemon.editing(record):
            if record.state.final:
                return
            info = pod_info(record)
            if not info.stopped_outside:
                keep_pod(record, info.model_copy(update={"stopped_outside": time.time()}))
                record.note(
                    f"pod {pod_id} was stopped outside obd (EXITED), which ended its job; "
                    "starting it again to recover the outputs on its volume"
                )
        await self.forget(record)
        grace = float(self.config.boot_grace)
        try:
            with anyio.fail_after(grace + 4 * self.daemon.config.daemon.probe_timeout):
                await self.driver.restart_stopped(pod_info(record), self._saver(record))
        except Exception as exc:
            log.error("pod_restart_failed", run_id=record.id, pod_id=pod_id, error=str(exc))
            await self.daemon.fail(
                record,
                f"pod {pod_id} was stopped outside obd (EXITED), which ended the job, and could not be started "
                f"again to copy the outputs on its volume: {exc}. obd tries again every few minutes and ends "
                f"the pod once its outputs are in the run's directory; `obd pods rm {pod_id}` removes it now, "
                "outputs and all",
            )
            return
        async with self.daemon.editing(record):
            record.note(f"pod {pod_id} started again; its job ended with the stop")

    def explain_lost(self, record: RunRecord, message: str) -> str:
        info = pod_info(record)
        if info.stopped_outside:
            return f"pod {info.pod_id} was stopped outside obd (EXITED), which killed the job; " + message
        return message

    async def describe(self, record: RunRecord) -> dict[str, Any]:
        """The pod for `status`: as the follow last saw it (no API call), or as the API says now if
        that is older than STATUS_CACHE_TTL; its spend is counted up to now either way."""
        info = pod_info(record)
        if not info.pod_id or info.end is not None:
            return {}  # none, or obd is done with it: the record says what became of it
        now = time.time()
        seen = self._seen.get(record.id)
        if seen is None or now - seen.at > STATUS_CACHE_TTL:
            try:
                seen = await self._observe(record)
            except Exception as exc:  # status answers whatever the API does
                seen = PodObservation(
                    state="unknown", at=now, error=str(exc) or "the Runpod API did not answer in time"
                )
        return {"pod": self.driver.view(info, seen, now)}

    # --- the end -------------------------------------------------------------------------

    def _retrieved_at(self, record: RunRecord) -> float | None:
        """When the run's outputs were retrieved and verified (the driver's book), if they were."""
        entry = self.driver.book.get(record.id)
        return entry.retrieved if entry is not None else None

    async def on_end(self, record: RunRecord) -> str:
        """Retrieve a pod run's outputs and terminate its pod, once; the message says how it went."""
        info = pod_info(record)
        if not info.pod_id or info.ended:
            return ""
        local = self.daemon.store.run_dir(record.id) / "retrieved"
        try:
            if self._retrieved_at(record):
                message = await self._end_retrieved(record, info.pod_id, local)
            else:
                ok, message = await self._finish_in_time(
                    record.id, record.remote_dir, info, local, lease_ttl=self.lease_ttl()
                )
                log.info("pod_finished", run_id=record.id, outputs_safe=ok, message=message)
        except Exception as exc:  # the record's final state must not wait on the pod
            message = f"the pod could not be emptied and ended: {exc} (see `obd pods list`)"
        mark_pod_end(
            record, *end_from_book(self.driver.book.get(record.id), self.config.keep_pod, info.pod_id, message)
        )
        self._seen.pop(record.id, None)
        await self.forget(record)
        return message

    async def _end_retrieved(self, record: RunRecord, pod_id: str, local: Path) -> str:
        """Terminate the pod of a run whose outputs are already home; what became of it."""
        try:
            await self.driver.terminate(pod_id, record.id)
        except Exception as exc:
            return f"outputs retrieved and verified into {local}; terminating pod {pod_id} failed ({exc}): `obd pods rm {pod_id}`"
        self.driver.book.put(record.id, finished=time.time(), terminated=True)
        return f"outputs retrieved and verified into {local}; pod {pod_id} ended"

    def outputs_lost(self, record: RunRecord) -> str | None:
        """Why an ended run's outputs can be read neither here nor on its pod (the pod ended before
        they were retrieved), or None: `obd train outputs` says so rather than reach for a dead pod."""
        return outputs_lost(record, self._retrieved_at(record))

    # --- reconcile -----------------------------------------------------------------------

    def _takes_untagged_pods(self) -> bool:
        """Pods made before they were tagged with their target go to one target: the first by name."""
        pod_targets = sorted(n for n, t in self.daemon.config.targets.items() if makes_pods(t))
        return not pod_targets or pod_targets[0] == self.name

    async def reconcile(self) -> None:
        """Match this target's pods with its runs; fail runs whose pod is gone, empty orphan pods."""
        launching = self.daemon.launcher.launching
        live = {
            r.id: pod_info(r)
            for r in self.daemon.records.values()
            if r.target == self.name and (r.state == RunState.preparing or r.has_job) and r.id not in launching
        }
        try:
            with anyio.fail_after(self.daemon.config.daemon.probe_timeout * 3):
                findings = await self.driver.reconcile(live, take_untagged=self._takes_untagged_pods())
        except Exception as exc:  # the API is down: decide nothing now, the follow retries
            log.warning("pod_reconcile_deferred", target=self.name, error=str(exc))
            return
        for item in findings:
            await self._apply_finding(item)

    async def _reconcile_soon(self, delay: float = 20.0) -> None:
        await anyio.sleep(delay)
        try:
            await self.reconcile()
        except Exception:
            log.exception("pod_reconcile_failed", target=self.name)

    def _look_again(self, until: float) -> None:
        """A run was recorded mid-create: reconcile again shortly (again and again while its
        create's outcome is unknown), rather than leave a late pod unowned for minutes."""
        if self._looking_again:
            return
        self._looking_again = True
        delay = min(max(1.0, self.config.api_poll_interval), 20.0, max(0.5, until - time.time()))

        async def again() -> None:
            await anyio.sleep(delay)
            self._looking_again = False
            try:
                await self.reconcile()
            except Exception:
                log.exception("pod_reconcile_failed", target=self.name)

        self.daemon.start_soon(again)

    async def periodically(self) -> None:
        """Match pods with runs now and then: a pod whose create looked failed is found and ended."""
        while True:
            await anyio.sleep(POD_RECONCILE_INTERVAL)
            try:
                await self.reconcile()
            except Exception:
                log.exception("pod_reconcile_failed", target=self.name)

    async def _apply_finding(self, item: Finding) -> None:
        daemon = self.daemon
        record = daemon.records.get(item.run_id or "")
        if record is not None and record.id in daemon.launcher.launching:
            return  # its launch is under way and decides
        if item.kind == "orphan" and record is not None and not record.state.final:
            return  # a live run's pod, not yet in its record
        if (
            item.kind == "gone"
            and record is not None
            and record.state == RunState.running
            and self._retrieved_at(record)
        ):
            async with daemon.editing(record):
                mark_pod_end(
                    record,
                    PodEnd.gone,
                    "terminated outside obd, or reclaimed by Runpod, after its outputs were retrieved and verified",
                )
            await self._finish_without_pod(record)  # its outputs came before the pod went
            return
        if item.kind == "orphan":
            log.warning("pod_orphan", target=self.name, pod_id=item.pod_id, run_id=item.run_id)
            daemon.start_soon(self._empty_orphan, item)
            return
        if item.kind == "creating" and item.look_again_at is not None:
            self._look_again(item.look_again_at)
            return
        if record is None:
            return
        if item.kind in ("gone", "not_created"):
            if item.kind == "gone" and not record.state.final and pod_info(record).pod_id:
                async with daemon.editing(record):
                    mark_pod_end(record, PodEnd.gone, GONE_WHY)
            await daemon.fail(record, item.reason or "its pod is gone")
        elif item.kind == "adopted" and item.target_info is not None:
            async with daemon.editing(record):
                keep_pod(record, item.target_info)
                record.note(f"pod {item.pod_id} found by its tag and adopted")

    async def _empty_orphan(self, item: Finding) -> None:
        """A pod of this target that no run knows: wait for its SSH, retrieve its outputs, terminate it.

        A pod that never answers within its boot grace is terminated by `resume`, and a stopped one
        is started again; one whose retrieval fails is left up and reported (its outputs come first).
        """
        daemon = self.daemon
        assert item.pod_id is not None and item.target_info is not None
        run_id = item.run_id or f"orphan-{item.pod_id}"

        async def keep(_info: PodInfo) -> None:
            return None

        record = daemon.records.get(run_id)
        end_by = self.driver.end_by(item.target_info)
        try:
            # Past its cap + abandon_grace a pod is not waited for: it is terminated below.
            with anyio.fail_after(max(0.0, end_by - time.time()) if end_by is not None else None):
                info = await self.driver.resume(item.target_info, keep)
            # A run that ended without its outputs (its pod was stopped, say) gets them in its own directory.
            local = daemon.store.run_dir(run_id) if record else daemon.state_dir / "orphans"
            local = local / "retrieved" if record else local / item.pod_id
            ok, message = await self._finish_in_time(run_id, item.remote_dir or "", info, local)
        except Exception as exc:
            ok, message = False, str(exc) or "its outputs had not been retrieved"
            if end_by is not None and time.time() >= end_by:
                message = await self._terminate_overdue(run_id, item.target_info, message) or message
        log.warning(
            "pod_orphan_finished",
            target=self.name,
            run_id=item.run_id,
            pod_id=item.pod_id,
            outputs_safe=ok,
            message=message,
        )
        if record is not None:
            async with daemon.editing(record):
                if pod_info(record).pod_id == item.pod_id:
                    mark_pod_end(
                        record,
                        *end_from_book(self.driver.book.get(record.id), self.config.keep_pod, item.pod_id, message),
                    )
                record.note(f"after the run ended, its pod {item.pod_id}: {message}")
