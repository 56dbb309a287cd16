"""Bringing a run's outputs home from its pod, each file checked by size and sha256, then ending the pod.

The pod lists its outputs with their sizes and hashes (the watchdog's `manifest`, fed on stdin,
one round trip); each listed file is downloaded and checked, twice at most. The manifest lists
no symbolic link; should it name one anyway (or a path through one), the download refuses it
(`LinkRefused`) and the file is left out with a note, so nothing outside the run directory is
ever copied. Only once every file is safe is the pod terminated.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path, PurePosixPath
from typing import Any

import anyio
import anyio.to_thread
import structlog

from executors.base import Executor, ExecutorError, LinkRefused
from executors.runpod.api import RunpodApiError
from executors.runpod.caps import lease_bytes
from executors.runpod.context import PodContext, keep_in_book
from executors.runpod.info import PodInfo
from executors.runpod.lifecycle import PodLifecycle
from trainer_plugin import rundir
from trainer_plugin.tools import jobctl

log = structlog.get_logger("obd.runpod")
WATCHDOG_SOURCE = Path(jobctl.__file__).resolve().with_name("watchdog.py")  # read, never imported here


def safe_relpath(rel: str) -> PurePosixPath | None:
    """A manifest path as a relative path inside the run directory, or None if it is not one."""
    path = PurePosixPath(rel)
    if path.is_absolute() or not path.parts or any(p in ("..", ".", "") for p in path.parts):
        return None
    return path


def sha256_local(path: Path) -> tuple[int, str]:
    """(size, sha256) of a local regular file, never through a link."""
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class Retrieval:
    """Retrieves and verifies a pod run's outputs, and ends the pod once they are safe."""

    def __init__(self, ctx: PodContext, lifecycle: PodLifecycle) -> None:
        self.ctx = ctx
        self.lifecycle = lifecycle

    async def finish(
        self, run_id: str, remote_dir: str, info: PodInfo, local_dir: Path, *, lease_ttl: float | None = None
    ) -> tuple[bool, str]:
        """Retrieve and verify the outputs, then terminate the pod (unless keep_pod).

        Returns (outputs safe locally, message). A failed retrieval leaves the pod up and says how
        to retry; a pod that is gone is reported as such (its outputs are lost). With `lease_ttl`,
        the daemon's lease is renewed while the files come, so the watchdog leaves the pod alone.
        """
        ctx = self.ctx
        pod_id = info.pod_id
        ctx.book.put(run_id, target_info=info, remote_dir=remote_dir, local_dir=str(local_dir))
        retry = f"retry with `obd pods retrieve {run_id}`, or give up and remove it with `obd pods rm {pod_id}`"
        if not pod_id:
            return False, "no pod was created for this run"
        try:
            pod = await ctx.api.get_pod(pod_id)
        except RunpodApiError as exc:
            return False, f"could not look up pod {pod_id} ({exc}); the pod is left as it is: {retry}"
        if pod is None:
            ctx.book.put(run_id, finished=ctx.clock(), pod_gone=True)
            return False, f"pod {pod_id} no longer exists (terminated outside obd?): the outputs on it are lost"
        if pod.desired_status == "EXITED":
            try:
                info = await self.lifecycle.restart_stopped(info, keep_in_book)
            except (ExecutorError, RunpodApiError) as exc:
                return False, (
                    f"pod {pod_id} is stopped (EXITED) and could not be started again to copy its outputs: {exc}. "
                    f"They stay on its volume, which is billed while the pod exists: {retry}"
                )
        try:
            info = await self.lifecycle.pin_host_key(info)
            count, size, refused = await self.retrieve(remote_dir, info, Path(local_dir), lease_ttl=lease_ttl)
        except ExecutorError as exc:
            rate = pod.cost_per_hr or info.cost_per_hr
            cost = f" (it costs ${rate:.2f}/h)" if rate else ""
            log.error("runpod.retrieve_failed", run_id=run_id, pod_id=pod_id, error=str(exc))
            return False, (
                f"retrieving the outputs of pod {pod_id} failed: {exc}. The pod is left up{cost}: {retry}. "
                f"Its watchdog deletes it once abandon_grace ({ctx.target.abandon_grace:.0f}s) has passed since the "
                "job ended and no daemon holds its lease"
            )
        done = f"retrieved {count} files ({size / 1e6:.1f} MB) into {local_dir}, sha256 verified"
        if refused:
            done += (
                f"; left out {len(refused)} listed as outputs that are symbolic links or reached through one "
                f"(obd never follows a link out of the run directory): {', '.join(refused[:5])}"
            )
        ctx.book.put(run_id, retrieved=ctx.clock())
        if ctx.target.keep_pod:
            await self._mark_retrieved(info, remote_dir)
            return True, f"{done}; pod {pod_id} kept (keep_pod): remove it with `obd pods rm {pod_id}`"
        try:
            await self.lifecycle.terminate(pod_id, run_id)
        except RunpodApiError as exc:
            return True, (
                f"{done}; but terminating pod {pod_id} failed ({exc}): run `obd pods rm {pod_id}` "
                f"(its watchdog deletes it after abandon_grace otherwise)"
            )
        ctx.book.put(run_id, finished=ctx.clock(), terminated=True)
        return True, f"{done}; pod {pod_id} terminated"

    async def _mark_retrieved(self, info: PodInfo, remote_dir: str) -> None:
        """Tell the pod's watchdog that the outputs are safe (a kept pod is then the user's)."""
        ex = self.ctx.executor(info)
        try:
            await ex.put_file(rundir.RunPaths(remote_dir).retrieved, f"{self.ctx.clock():.3f}\n".encode())
        except ExecutorError as exc:
            log.warning("runpod.retrieved_marker_failed", run_id=info.run_id, remote_dir=remote_dir, error=str(exc))
        finally:
            await ex.aclose()

    async def retrieve(
        self, remote_dir: str, info: PodInfo, local_dir: Path, *, lease_ttl: float | None = None
    ) -> tuple[int, int, list[str]]:
        """Download every listed output and check its size and sha256 against the pod's own.

        Returns (files retrieved, bytes, paths refused because of a symbolic link).
        """
        ex = self.ctx.executor(info)
        renewed = -float("inf")

        async def keep_lease() -> None:
            nonlocal renewed
            if lease_ttl is not None and self.ctx.clock() - renewed > lease_ttl / 3:
                await ex.put_file(rundir.RunPaths(remote_dir).lease, lease_bytes(self.ctx.clock(), lease_ttl))
                renewed = self.ctx.clock()

        try:
            await keep_lease()
            manifest = await self.remote_manifest(ex, remote_dir)
            local_dir.mkdir(parents=True, exist_ok=True)
            total, count = 0, 0
            refused: list[str] = []
            for entry in manifest["files"]:
                await keep_lease()
                try:
                    total += await self._fetch_verified(ex, remote_dir, entry, local_dir)
                    count += 1
                except LinkRefused as exc:
                    refused.append(str(entry.get("path")))
                    log.warning("runpod.output_refused", run_id=info.run_id, path=entry.get("path"), why=str(exc))
            record = {**manifest, "refused": refused, "time": self.ctx.clock()}
            (local_dir / "retrieved.json").write_text(json.dumps(record, indent=1))
            return count, total, refused
        finally:
            # Closed even when the daemon gives up on the retrieval (a pod past its cap's end).
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                await ex.aclose()

    async def remote_manifest(self, ex: Executor, remote_dir: str) -> dict[str, Any]:
        """Sizes and sha256 of the outputs, computed on the pod by the watchdog script (one round trip)."""
        python = await ex.python()
        # The script comes on stdin: the listing depends on nothing being installed on the pod.
        source = WATCHDOG_SOURCE.read_bytes()
        result = await ex.run_command([python, "-", "manifest", remote_dir], stdin=source, timeout=1800)
        if result.returncode != 0:
            raise ExecutorError(
                f"listing the outputs on the pod failed (exit {result.returncode}): "
                f"{result.stderr.decode(errors='replace')[-300:]}"
            )
        try:
            manifest = json.loads(result.stdout)
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
