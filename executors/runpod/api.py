"""A thin async wrapper over the `runpod` SDK: key lookup, input checks, retries, typed pods.

The SDK's calls block (requests), so each runs in a worker thread under a deadline of our own.
The SDK pastes strings into GraphQL text unescaped, so every string obd sends is either
checked to be plain (ids, names, images) or escaped here (env values) before it gets there.
The SDK only reports a 401 itself; a 429 or 5xx shows up as a non-JSON body, a JSON body
without `data`, or an `errors` message, and all of those are retried with backoff.
"""

from __future__ import annotations

import importlib.util
import os
import re
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import structlog
from pydantic import BaseModel, Field

from executors.base import ExecutorError
from executors.retry import Backoff, retrying

log = structlog.get_logger("obd.runpod.api")
# The runpod SDK is an extra: a Runpod target without it says how to get it.
SDK_MISSING = (
    "the runpod SDK is not installed in obd's environment: run `pip install 'obd-train[runpod]'` with the "
    "pip of the venv obd runs from (e.g. /opt/obd/bin/pip), then restart the daemon (`systemctl restart obd`)"
)
T = TypeVar("T")

# Which process needs the key, and how to give it to that process. The daemon's API calls (pods
# of runs) use the daemon's environment; `obd pods` calls the API from the shell it runs in.
DAEMON_KEY_HELP = (
    "the daemon calls the Runpod API with the key in its own environment, not the one of the shell you "
    "run obd from: under the systemd service put a line `RUNPOD_API_KEY=...` in /etc/obd/env (mode 0600) "
    "and run `sudo systemctl restart obd`; for a daemon of your own, in ~/.config/obd/env (the user unit's) "
    "or in the shell you start `obd daemon` from; or store it with `runpod config` as the daemon's user. "
    "obd never reads it from its own config or a command line"
)
CLIENT_KEY_HELP = (
    "`obd pods` calls the Runpod API itself, from this shell, not through the daemon, so the key must be "
    "in this shell: `export RUNPOD_API_KEY=...` (or store it with `runpod config` as this user) and run it "
    "again; where the service keeps the key in /etc/obd/env, as root: "
    "`sudo sh -c 'set -a; . /etc/obd/env; exec obd pods list'` (or rm, retrieve). "
    "obd never reads it from its own config or a command line"
)
KEY_HELP = DAEMON_KEY_HELP
NO_CAPACITY_RE = re.compile(
    r"no longer any instances available|no instances? available|not enough capacity|not enough free gpus", re.I
)
TRANSIENT_RE = re.compile(
    r"too many requests|rate.?limit|internal server error|service unavailable|bad gateway|"
    r"gateway time-?out|temporarily|timed? ?out|try again later|upstream",
    re.I,
)
AUTH_RE = re.compile(r"unauthori[sz]ed|invalid api key|api key is invalid|forbidden", re.I)
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
ENV_VALUE_LIMIT = 32 * 1024
_PLAIN_BAD = re.compile(r'["\\\x00-\x1f\x7f]')
_SDK_LOCK = threading.Lock()  # the SDK keeps its key in a module global


def sdk() -> Any:
    """The runpod SDK, or an error that says how to install it (it is an extra)."""
    if importlib.util.find_spec("runpod") is None:
        raise RunpodApiError(SDK_MISSING)
    import runpod

    return runpod


def sdk_call(name: str) -> Callable[..., Any]:
    """The SDK's function `name`, looked up when it is called: in the worker thread that makes the
    call, so that the SDK's first import (over a second: it brings aiohttp, boto3...) never runs on
    the daemon's event loop, which meanwhile opens the control socket and answers it."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(sdk(), name)(*args, **kwargs)

    call.__name__ = name
    return call


class RunpodApiError(ExecutorError):
    """The Runpod API refused or failed a call; the message says what to do next."""


class AuthError(RunpodApiError):
    """No API key, or the API rejected it."""


class NoCapacity(RunpodApiError):
    """No machine of that GPU type is free right now."""


class UnknownGpu(RunpodApiError):
    """The GPU type id is not one Runpod knows."""


class TransientError(RunpodApiError):
    """429, 5xx, a timeout or a dropped connection: the call may be retried (it may have happened)."""


class Pod(BaseModel):
    """The fields of a pod obd uses, read from what the SDK's pod queries return."""

    id: str
    name: str = ""
    desired_status: str = ""
    cost_per_hr: float | None = None
    env: dict[str, str] = Field(default_factory=dict)
    gpu_count: int | None = None
    gpu_display_name: str | None = None
    image_name: str | None = None
    uptime_seconds: float | None = None
    last_status_change: str | None = None
    ssh_host: str | None = None
    ssh_port: int | None = None

    @classmethod
    def from_api(cls, raw: dict[str, Any]) -> Pod:
        """Build from a `pod`/`myself.pods` item; tolerant of nulls and of env as list or map."""
        host, port = _public_ssh(raw.get("runtime"))
        machine = raw.get("machine") or {}
        rate = raw.get("costPerHr")
        return cls(
            id=str(raw["id"]),
            name=raw.get("name") or "",
            desired_status=raw.get("desiredStatus") or "",
            cost_per_hr=float(rate) if isinstance(rate, (int, float)) and rate > 0 else None,
            env=parse_env(raw.get("env")),
            gpu_count=raw.get("gpuCount"),
            gpu_display_name=machine.get("gpuDisplayName") if isinstance(machine, dict) else None,
            image_name=raw.get("imageName"),
            uptime_seconds=raw.get("uptimeSeconds"),
            last_status_change=raw.get("lastStatusChange"),
            ssh_host=host,
            ssh_port=port,
        )


def _public_ssh(runtime: Any) -> tuple[str | None, int | None]:
    """The public ip and port mapped to the pod's port 22, when Runpod reports one."""
    if not isinstance(runtime, dict):
        return None, None
    for port in runtime.get("ports") or []:
        if not isinstance(port, dict):
            continue
        if port.get("privatePort") == 22 and port.get("isIpPublic") and port.get("publicPort") and port.get("ip"):
            return str(port["ip"]), int(port["publicPort"])
    return None, None


def parse_env(raw: Any) -> dict[str, str]:
    """A pod's env as a dict: the API gives `["K=V", ...]` (older answers: `[{key, value}]`)."""
    out: dict[str, str] = {}
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    for item in raw or []:
        if isinstance(item, str) and "=" in item:
            key, value = item.split("=", 1)
            out[key] = value
        elif isinstance(item, dict) and "key" in item:
            out[str(item["key"])] = str(item.get("value", ""))
    return out


# --- what may reach GraphQL --------------------------------------------------------------


def gql_escape(value: str) -> str:
    """The body of a GraphQL string literal for `value` (quotes, backslashes, controls escaped)."""
    out = []
    for ch in value:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def check_plain(what: str, value: str) -> str:
    """Refuse an id, name or image that would change the GraphQL text the SDK builds."""
    if not isinstance(value, str) or not value or _PLAIN_BAD.search(value) or len(value) > 512:
        raise RunpodApiError(
            f"refusing {what} {value!r}: it must be non-empty plain text without quotes, backslashes "
            "or control characters; fix it in the target's section of the obd config"
        )
    return value


def escape_env(env: dict[str, str]) -> dict[str, str]:
    """Env for the SDK's create call: names checked, values escaped for its unescaped template."""
    out: dict[str, str] = {}
    for key, value in env.items():
        if not ENV_KEY_RE.match(key):
            raise RunpodApiError(f"refusing pod env name {key!r}: names are letters, digits and '_'")
        if not isinstance(value, str) or len(value) > ENV_VALUE_LIMIT or "\x00" in value:
            raise RunpodApiError(f"refusing pod env {key}: the value must be text under 32 KiB without NUL bytes")
        out[key] = gql_escape(value)
    return out


# --- the key ------------------------------------------------------------------------------


def resolve_api_key(environ: dict[str, str] | None = None) -> str | None:
    """The key from RUNPOD_API_KEY, else from the SDK's own credentials file; never logged."""
    env = os.environ if environ is None else environ
    key = (env.get("RUNPOD_API_KEY") or "").strip()
    if key:
        return key
    try:
        from runpod.cli.groups.config.functions import get_credentials

        creds = get_credentials("default")
    except Exception:  # a broken file is the same as none: the error below says what to do
        return None
    key = str((creds or {}).get("api_key") or "").strip()
    return key or None


# --- classification -------------------------------------------------------------------------


def classify(exc: BaseException, what: str, key_help: str = DAEMON_KEY_HELP) -> RunpodApiError:
    """Turn whatever the SDK raised into one of our errors, with a message that says what next
    (`key_help`: where the process that made the call gets its key)."""
    if isinstance(exc, RunpodApiError):
        return exc
    import requests
    from runpod import error as rp_error

    if isinstance(exc, rp_error.AuthenticationError):
        return AuthError(f"the Runpod API refused the API key ({what}): {key_help}")
    if isinstance(exc, rp_error.QueryError):
        message = str(exc.message or exc)
        if NO_CAPACITY_RE.search(message):
            return NoCapacity(f"no capacity ({what}): {message}")
        if AUTH_RE.search(message):
            return AuthError(f"the Runpod API refused the API key ({what}): {message}; {key_help}")
        if TRANSIENT_RE.search(message):
            return TransientError(f"the Runpod API failed ({what}): {message}")
        return RunpodApiError(f"the Runpod API refused {what}: {message}")
    if isinstance(exc, requests.exceptions.JSONDecodeError):
        return TransientError(f"the Runpod API answered {what} with a non-JSON body (HTTP 429 or 5xx)")
    if isinstance(exc, (requests.exceptions.Timeout, TimeoutError)):
        return TransientError(f"the Runpod API did not answer {what} in time")
    if isinstance(exc, requests.exceptions.RequestException):
        return TransientError(f"could not reach the Runpod API ({what}): {type(exc).__name__}")
    if isinstance(exc, (KeyError, TypeError)):
        return TransientError(f"the Runpod API answered {what} without data (HTTP 429 or 5xx?)")
    if isinstance(exc, ValueError) and "No GPU found" in str(exc):
        return UnknownGpu(
            f"unknown GPU type ({what}); list the valid ids with `python -c 'import runpod; print(runpod.get_gpus())'`"
        )
    return RunpodApiError(f"the Runpod API call {what} failed: {type(exc).__name__}: {exc}")


# --- the client --------------------------------------------------------------------------------


class RunpodApi:
    """Pods through the SDK, with retries on 429/5xx/timeouts and a deadline on every call."""

    def __init__(
        self,
        *,
        api_key: str | None = None,
        call_timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 1.0,
        backoff_max: float = 30.0,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
    ) -> None:
        self._api_key = api_key
        # Said when the key is missing or refused: where this process gets it (the daemon's by default).
        self.key_help = DAEMON_KEY_HELP
        self.call_timeout = call_timeout
        self.retries = retries
        self.backoff = backoff
        self.backoff_max = backoff_max
        self._sleep = sleep

    def account_key(self) -> str | None:
        """The account's key these calls use (never to be sent anywhere but the API), if there is one."""
        return self._api_key or resolve_api_key()

    def _key(self) -> str:
        key = self.account_key()
        if not key:
            if importlib.util.find_spec("runpod") is None:  # no SDK: installing it comes first
                raise RunpodApiError(SDK_MISSING)
            raise AuthError(f"no Runpod API key: {self.key_help}")
        return key

    async def _once(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """One SDK call in a thread, under our deadline; its exceptions classified."""
        key = self._key()

        def call() -> T:
            runpod = sdk()  # in the worker thread: its first import never holds up the event loop

            with _SDK_LOCK:
                runpod.api_key = key
            return fn(*args, **kwargs)

        try:
            with anyio.fail_after(self.call_timeout):
                return await anyio.to_thread.run_sync(call, abandon_on_cancel=True)
        except TimeoutError as exc:
            raise TransientError(f"the Runpod API did not answer {what} within {self.call_timeout:g}s") from exc
        except Exception as exc:
            err = classify(exc, what, self.key_help)
            err.args = tuple(redact(str(a), key) for a in err.args)  # whatever the SDK put in, never the key
            raise err from exc

    async def _retrying(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """An idempotent call, retried with exponential backoff and jitter on transient errors."""

        def note(attempt: int, exc: BaseException, wait: float) -> None:
            log.warning("runpod_api_retry", call=what, attempt=attempt, error=str(exc), retry_in=round(wait, 3))

        try:
            return await retrying(
                lambda: self._once(what, fn, *args, **kwargs),
                transient=(TransientError,),
                retries=self.retries,
                backoff=Backoff(self.backoff, self.backoff_max, jitter=True),
                sleep=self._sleep,
                on_retry=note,
            )
        except TransientError as exc:
            raise TransientError(
                f"{exc} (gave up after {self.retries + 1} tries); check https://uptime.runpod.io and retry"
            ) from exc

    async def get_pod(self, pod_id: str) -> Pod | None:
        """The pod, or None when it no longer exists (terminated)."""
        check_plain("pod id", pod_id)
        raw = await self._retrying(f"get_pod({pod_id})", sdk_call("get_pod"), pod_id)
        return Pod.from_api(raw) if raw else None

    async def list_pods(self) -> list[Pod]:
        """Every pod of the account (obd filters its own by name and env tag)."""
        raw = await self._retrying("get_pods", sdk_call("get_pods"))
        return [Pod.from_api(p) for p in raw or [] if isinstance(p, dict) and p.get("id")]

    async def gpu_rate(self, gpu_id: str, gpu_count: int, cloud_type: str) -> float | None:
        """The hourly rate of `gpu_count` GPUs of that type in that cloud, None when unknown."""
        check_plain("GPU type", gpu_id)
        raw = await self._retrying(f"get_gpu({gpu_id})", sdk_call("get_gpu"), gpu_id, gpu_count)
        return rate_from_gpu(raw, gpu_count, cloud_type)

    async def create_pod(self, **kwargs: Any) -> dict:
        """One create call, never retried here: a transient failure may have created the pod."""
        for field in ("name", "image_name", "gpu_type_id", "network_volume_id"):
            if kwargs.get(field) is not None:
                check_plain(field.replace("_", " "), kwargs[field])
        kwargs["env"] = escape_env(kwargs.get("env") or {})
        raw = await self._once(f"create_pod({kwargs.get('gpu_type_id')})", sdk_call("create_pod"), **kwargs)
        if not isinstance(raw, dict) or not raw.get("id"):
            raise TransientError("the Runpod API answered create_pod without a pod id")
        return raw

    async def resume_pod(self, pod_id: str, gpu_count: int) -> None:
        """Start a stopped (EXITED) pod again with `gpu_count` GPUs; NoCapacity when its host has none free."""
        check_plain("pod id", pod_id)
        await self._retrying(f"resume_pod({pod_id})", sdk_call("resume_pod"), pod_id, gpu_count)

    async def stop_pod(self, pod_id: str) -> None:
        """Stop the pod: its GPUs are released, its volume (and the outputs on it) is kept."""
        check_plain("pod id", pod_id)
        await self._retrying(f"stop_pod({pod_id})", sdk_call("stop_pod"), pod_id)

    async def terminate(self, pod_id: str) -> None:
        """Terminate the pod; a pod already gone counts as terminated."""
        check_plain("pod id", pod_id)
        try:
            await self._retrying(f"terminate_pod({pod_id})", sdk_call("terminate_pod"), pod_id)
        except AuthError:
            raise
        except RunpodApiError:
            if await self.get_pod(pod_id) is None:
                return
            raise
        # The SDK does not read the mutation's answer: one with no data (an upstream error
        # answered 200) looks like success. Only a pod that is gone, or on its way, is terminated.
        pod = await self.get_pod(pod_id)
        if pod is not None and pod.desired_status != "TERMINATED":
            raise TransientError(
                f"the Runpod API answered the terminate of pod {pod_id} but the pod is still there "
                f"({pod.desired_status or 'no status'}); `obd pods rm {pod_id}` tries again"
            )


def rate_from_gpu(raw: dict | None, gpu_count: int, cloud_type: str) -> float | None:
    """Hourly rate from a `gpuTypes` item: per-GPU price × count; for ALL the dearer cloud."""
    if not raw:
        return None
    prices: list[float] = []
    if cloud_type in ("SECURE", "ALL") and isinstance(raw.get("securePrice"), (int, float)):
        prices.append(float(raw["securePrice"]))
    if cloud_type in ("COMMUNITY", "ALL") and isinstance(raw.get("communityPrice"), (int, float)):
        prices.append(float(raw["communityPrice"]))
    prices = [p for p in prices if p > 0]
    if not prices:
        lowest = (raw.get("lowestPrice") or {}).get("uninterruptablePrice")
        if isinstance(lowest, (int, float)) and lowest > 0:
            return float(lowest) * gpu_count
        return None
    return max(prices) * gpu_count


def redact(text: str, key: str | None) -> str:
    """`text` with the API key cut out, for anything that may reach a log or a message."""
    return text.replace(key, "<redacted>") if key else text


__all__ = [
    "CLIENT_KEY_HELP",
    "DAEMON_KEY_HELP",
    "AuthError",
    "NoCapacity",
    "Pod",
    "RunpodApi",
    "RunpodApiError",
    "TransientError",
    "UnknownGpu",
    "check_plain",
    "escape_env",
    "gql_escape",
    "parse_env",
    "rate_from_gpu",
    "resolve_api_key",
]
