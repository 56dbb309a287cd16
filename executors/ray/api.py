"""Ray's Jobs API over HTTP, with the standard library's client (no Ray, no SDK in the daemon).

The endpoints (Ray 2.x, `ray/dashboard/modules/job/job_head.py`): `GET /api/version`,
`POST /api/jobs/` (submit), `GET /api/jobs/` (every job), `GET /api/jobs/{id}`,
`POST /api/jobs/{id}/stop`, `GET /api/jobs/{id}/logs`. Each call runs in a worker thread; a
cluster that does not answer is `TargetUnreachable` (its jobs may well run on), a refusal an
`ExecutorError` with what Ray said.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import anyio.to_thread

from executors.base import ExecutorError, TargetUnreachable


class NotFound(ExecutorError):
    """Ray does not know this job (never submitted, or forgotten with its cluster)."""


class JobsApi:
    """The Jobs API of one cluster: its address, the headers every request carries."""

    def __init__(self, address: str, headers: dict[str, str], timeout: float = 30.0) -> None:
        self.address = address.rstrip("/")
        self.headers = {"Content-Type": "application/json", **headers}
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.address + path, data=data, method=method, headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            said = exc.read().decode(errors="replace").strip()
            if exc.code == 404:
                raise NotFound(said or f"{path}: not found") from exc
            if exc.code in (401, 403):
                raise ExecutorError(
                    f"the Ray cluster at {self.address} refused obd ({exc.code}): set the target's token_env "
                    "(or headers) to what the cluster's proxy expects (docs/ray.md)"
                ) from exc
            last = said.splitlines()[-1] if said else exc.reason
            raise ExecutorError(
                f"Ray's Jobs API at {self.address} answered {exc.code} to {method} {path}: {last}"
            ) from exc
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TargetUnreachable(
                f"Ray's Jobs API at {self.address} did not answer ({reason}); jobs there keep running, and obd "
                "reads them again on the next poll (is the cluster up? `ray status` on its head node)"
            ) from exc
        try:
            return json.loads(text) if text else None
        except ValueError as exc:
            raise ExecutorError(
                f"Ray's Jobs API at {self.address} answered {path} with no JSON: {text[:200]!r}"
            ) from exc

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        # abandon_on_cancel: a request stuck on a dead cluster is left to its own timeout.
        return await anyio.to_thread.run_sync(self._call, method, path, body, abandon_on_cancel=True)

    async def version(self) -> dict[str, Any]:
        return dict(await self.call("GET", "/api/version") or {})

    async def submit(self, body: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.call("POST", "/api/jobs/", body) or {})

    async def job(self, submission_id: str) -> dict[str, Any] | None:
        """The job's details, or None where Ray does not know it."""
        try:
            return dict(await self.call("GET", f"/api/jobs/{submission_id}") or {})
        except NotFound:
            return None

    async def jobs(self) -> list[dict[str, Any]]:
        return [j for j in (await self.call("GET", "/api/jobs/") or []) if isinstance(j, dict)]

    async def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job (its SIGTERM, SIGKILL after RAY_JOB_STOP_WAIT_TIME_S); whether it was running."""
        try:
            answer = await self.call("POST", f"/api/jobs/{submission_id}/stop")
        except NotFound:
            return False
        return bool((answer or {}).get("stopped"))

    async def logs(self, submission_id: str) -> str:
        return str((await self.call("GET", f"/api/jobs/{submission_id}/logs") or {}).get("logs", ""))
