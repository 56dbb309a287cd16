"""The SSH executor to one pod (`PodExecutor`), which never carries the account's API key there.

Apart from the driver's context (context.py) because it is an SSH executor: importing it imports
asyncssh (a quarter of a second), which a daemon with a Runpod target needs only once a pod is
reached, never before its control socket answers.
"""

from __future__ import annotations

from collections.abc import Iterable

from executors.base import ExecIO, ExecSpec, ExecutorError, JobHandle, JobSpec
from executors.ssh import SshExecutor
from executors.ssh.config import SshTarget


class AccountKeyRefused(ExecutorError):
    """Something obd was about to send to a pod carries the account's API key."""


class PodExecutor(SshExecutor):
    """The SSH executor to one pod, refusing whatever would carry the account's API key there.

    Everything on a pod is the job's to read (it runs as root in the container), so the key that
    controls the account must never get there: not in a job's environment or secrets (a target's
    `secrets = ["RUNPOD_API_KEY"]`, a `--secret` or `--env` holding it), its command line, or a
    file obd writes. The pod has a key of its own, scoped to it, in its container's environment.
    """

    def __init__(self, name: str, target: SshTarget, *, host_key: str, pod_id: str, account_key: str | None) -> None:
        super().__init__(name, target, host_key=host_key)
        self.pod_id = pod_id
        self._account_key = account_key

    def refuse_account_key(self, what: str, values: Iterable[str]) -> None:
        """Raise `AccountKeyRefused` when any of `values` holds the account's key."""
        key = self._account_key
        if key and any(key in value for value in values):
            raise AccountKeyRefused(
                f"refusing to send the Runpod account's API key to pod {self.pod_id} ({what}): a job on a pod "
                "must never hold a credential of the account, with which it could spend past its caps or "
                "control other pods. Remove RUNPOD_API_KEY from the target's `secrets` and from the run's "
                "--secret and --env; the pod has a key of its own, scoped to it, in its container's environment"
            )

    async def spawn(self, job: JobSpec) -> JobHandle:
        self.refuse_account_key(f"the start of {job.run_id}", self._job_values(job))
        return await super().spawn(job)

    async def put_file(self, path: str, data: bytes) -> None:
        self.refuse_account_key(path, [data.decode("utf-8", "replace")])
        await super().put_file(path, data)

    async def exec_in_run(self, spec: ExecSpec, io: ExecIO) -> int:
        self.refuse_account_key(f"a command in {spec.run_id}", [*(spec.command or []), *spec.env.values()])
        return await super().exec_in_run(spec, io)

    @staticmethod
    def _job_values(job: JobSpec) -> list[str]:
        """Every string of the job obd would send to the pod."""
        values = [*job.command, job.cwd or ""]
        for env in (job.env, job.secrets, job.base_env or {}):
            values.extend(env.values())
        return values
