"""What a `[targets.NAME]` section holds: one pydantic model per kind of target, and durations.

These live below the daemon so the executors that serve a target read its settings without
importing `daemon/`; `daemon/service/config.py` builds the whole config from them. Unknown keys are
errors (a typo must not silently fall back to a default), and durations are seconds or
strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# A Runpod network volume id: the SDK pastes it unescaped into GraphQL, so nothing else gets through.
_NETWORK_VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `30m`, `2h`."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '30m', '2h'")
    if isinstance(value, (int, float)):
        if not math.isfinite(value):
            raise ValueError(f"a duration must be a finite number of seconds, not {value!r}")
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"bad duration {value!r}: use a number of seconds or a string like '90s', '30m', '2h'")


def _words(seconds: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


def between(lo: float, hi: float) -> AfterValidator:
    """A range check for a duration, whose error names the allowed range."""

    def check(value: float) -> float:
        if not lo <= value <= hi:
            raise ValueError(
                f"{_words(value) if math.isfinite(value) else value} is out of range: use {_words(lo)} to {_words(hi)}"
            )
        return value

    return AfterValidator(check)


HOUR, DAY = 3600.0, 86400.0
Duration = Annotated[float, BeforeValidator(parse_duration)]
# Durations with the range that makes sense for what they time (0, inf or 1e20 h never do).
Interval = Annotated[float, BeforeValidator(parse_duration), between(0.05, HOUR)]  # how often something is done
Timeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, DAY)]  # how long something may take
LongTimeout = Annotated[float, BeforeValidator(parse_duration), between(0.1, 30 * DAY)]
Margin = Annotated[float, BeforeValidator(parse_duration), between(0, DAY)]  # ahead of, or grace before, an act


class StrictModel(BaseModel):
    """A config section: unknown keys are refused, naming the key."""

    model_config = ConfigDict(extra="forbid")


class TargetBase(StrictModel):
    """What every kind of target says of where its waiting runs may go instead (docs/placement.md):
    a run queued on it longer than `overflow_after` (a run paused by a preemption or a drain
    included) continues on the target `overflow` names, once that one can start it."""

    overflow: str | None = Field(default=None, min_length=1)
    overflow_after: Margin = 600.0


class LocalTarget(TargetBase):
    kind: Literal["local"] = "local"
    workdir: Path | None = None  # default: <state_dir>/jobs
    python: str | None = None  # the interpreter that runs obd's job wrapper
    venv: str | None = None  # its bin/ leads every job's PATH
    # Names passed from the daemon's own environment to every job (the daemon's environment
    # reaches no job otherwise): plain values, and secrets (never logged).
    env: list[str] = Field(default_factory=list)
    secrets: list[str] = Field(default_factory=list)
    # The GPUs jobs are given: found with nvidia-smi/amd-smi when unset; a list of device ids;
    # or 0 for none. Each run gets the ones it asks for (--gpus), alone.
    gpus: list[str] | int | None = None
    gpu_vendor: Literal["nvidia", "amd"] | None = None
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    # Preemption (docs/preemption.md): a run is preemptible unless started with
    # --no-preemptible (or this says False); none is preempted before it ran min_runtime.
    preemptible: bool = True
    min_runtime: Margin = 600.0
    # What an hour of one GPU costs here, in US dollars: `--max-cost-usd` needs it (docs/limits.md).
    price_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("gpus")
    @classmethod
    def _gpu_ids(cls, value: list[str] | int | None) -> list[str] | int | None:
        if isinstance(value, int) and not 0 <= value <= 64:
            raise ValueError("gpus is a list of device ids, or a count from 0 to 64")
        distinct = isinstance(value, list) and len(set(value)) == len(value)
        if isinstance(value, list) and not (distinct and all(v and v.replace("-", "").isalnum() for v in value)):
            raise ValueError('gpus is a list of distinct device ids such as ["0", "1"]')
        return value


class SshTarget(TargetBase):
    kind: Literal["ssh"]
    host: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_unknown_host: bool = False
    workdir: str = "~/obd"
    python: str = "python3"
    venv: str | None = None
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    # A persistent `jobctl.py serve` on one channel for probes, starts and events (no shell per
    # poll); false: one remote command per operation, as before.
    helper: bool = True
    keepalive: Interval = 15.0
    connect_timeout: Timeout = 15.0
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment
    # The GPUs a job there uses, counted for `--max-gpu-hours` and a price (obd hands out none here).
    gpu_count: int | None = Field(default=None, ge=0, le=64)
    # What an hour of one GPU costs here, in US dollars: `--max-cost-usd` needs it (docs/limits.md).
    price_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)


class RunpodTarget(TargetBase):
    kind: Literal["runpod"]
    gpu_type: str | list[str] = "NVIDIA GeForce RTX 4090"
    gpu_count: int = Field(default=1, ge=1, le=64)
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    volume_gb: int = Field(default=50, ge=1, le=100_000)
    container_disk_gb: int = Field(default=50, ge=1, le=100_000)
    network_volume_id: str | None = None
    max_hours: float | None = Field(default=None, gt=0, le=24 * 365, allow_inf_nan=False)
    max_cost_usd: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    disk_min_free_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    disk_max_used_pct: float | None = Field(default=None, gt=0, le=100, allow_inf_nan=False)
    keep_pod: bool = False
    boot_grace: Timeout = 600.0
    abandon_grace: LongTimeout = 1800.0
    identity_file: Path | None = None
    ssh_user: str = "root"
    workdir: str = "/workspace/obd"
    python: str = "python3"
    secrets: list[str] = Field(default_factory=list)
    snapshot_margin: Margin = 900.0  # ask for the snapshot this long before a cap
    watchdog_interval: Interval = 30.0
    lease_ttl: Timeout = 300.0  # the daemon's lease the watchdog honours
    api_poll_interval: Interval = 5.0  # how often a booting pod is looked at

    @field_validator("network_volume_id")
    @classmethod
    def _network_volume_id_is_plain(cls, value: str | None) -> str | None:
        if value is not None and not _NETWORK_VOLUME_ID_RE.match(value):
            raise ValueError(
                f"network_volume_id {value!r} is not a Runpod network volume id: it is letters, digits, '-' and '_' "
                "only (no spaces, quotes or newlines); copy the id from the Storage page of the Runpod console"
            )
        return value

    @model_validator(mode="after")
    def _one_kind_of_volume(self) -> RunpodTarget:
        if self.network_volume_id is not None and "volume_gb" in self.model_fields_set:
            raise ValueError(
                "volume_gb and network_volume_id are both set: a pod gets either its own volume of volume_gb GB "
                "or the network volume network_volume_id, mounted at /workspace; remove one of the two keys"
            )
        return self

    def gpu_types(self) -> list[str]:
        """The GPU types to try, in the order given."""
        return [self.gpu_type] if isinstance(self.gpu_type, str) else list(self.gpu_type)


# A Slurm time limit as sbatch takes it: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS.
_SLURM_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# sbatch options obd sets itself for every job: a target may not set them again.
SBATCH_OWN_OPTIONS = (
    "--job-name", "-J", "--comment", "--output", "-o", "--error", "-e", "--open-mode", "--parsable",
    "--signal", "--chdir", "-D", "--wrap", "--export", "--nodes", "-N", "--ntasks-per-node", "--requeue",
    "--no-requeue",
)  # fmt: skip
# Options that would submit a job as someone else. sbatch (getopt_long) also takes a long option
# by any unambiguous prefix, so `--ui`/`--gi` are these too.
SBATCH_IDENTITY_OPTIONS = ("--uid", "--gid")


def sbatch_identity_option(name: str) -> str | None:
    """The identity option (`--uid`, `--gid`) that `name` spells, in full or as sbatch's prefix of it."""
    if len(name) < 4:
        return None
    return next((option for option in SBATCH_IDENTITY_OPTIONS if option.startswith(name)), None)


def slurm_time_seconds(value: str) -> int | None:
    """Seconds in a Slurm time limit (`2` is two minutes, `1-12` a day and a half); None for no limit."""
    text = value.strip()
    if text.upper() in ("INFINITE", "UNLIMITED"):
        return None
    match = _SLURM_TIME_RE.match(text)
    if not match:
        raise ValueError(
            f'time {value!r} is not a Slurm time limit: use minutes ("90"), "HH:MM:SS", "D-HH:MM" or "INFINITE"'
        )
    days, first, second, third = (int(g) if g is not None else None for g in match.groups())
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        return days * 86400 + (first or 0) * 3600 + (second or 0) * 60 + (third or 0)
    if third is not None:  # HH:MM:SS
        return (first or 0) * 3600 + (second or 0) * 60 + third
    if second is not None:  # MM:SS
        return (first or 0) * 60 + second
    return (first or 0) * 60  # minutes


class SlurmLogin(StrictModel):
    """The login node obd reaches over SSH to run sbatch, squeue and scancel (its SSH settings)."""

    host: str
    port: int = Field(default=22, ge=1, le=65535)
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_unknown_host: bool = False
    keepalive: Interval = 15.0
    connect_timeout: Timeout = 15.0


class SlurmTarget(TargetBase):
    """A Slurm cluster: jobs submitted with sbatch on this machine, or on `login` over SSH.

    `workdir` must be on the filesystem the compute nodes share with the submitting machine:
    run directories live there, and the job wrapper writes them from the nodes.
    """

    kind: Literal["slurm"]
    login: SlurmLogin | None = None  # None: sbatch works on the daemon's own machine
    workdir: str = "~/obd"
    python: str = "python3"  # on the compute nodes (and the login node), with torch for torchrun
    venv: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None  # the job's time limit, as sbatch --time takes it
    nodes: int = Field(default=1, ge=1, le=10_000)
    gpus_per_node: int | None = Field(default=None, ge=0, le=64)
    cpus_per_task: int | None = Field(default=None, ge=1, le=10_000)
    mem: str | None = None  # per node, as sbatch --mem takes it ("64G")
    constraint: str | None = None
    sbatch_options: list[str] = Field(default_factory=list)  # more sbatch options, one word each
    # How the command runs on each node: as given under srun, or torchrun with the c10d
    # rendezvous on the first node (--nnodes, --nproc-per-node set by obd).
    launcher: Literal["srun", "torchrun"] = "srun"
    nproc_per_node: int | None = Field(default=None, ge=1, le=1024)  # torchrun's; default gpus_per_node or 1
    signal_margin: Margin = 300.0  # ask for a `deadline` snapshot this long before the time limit
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    # What an hour of one GPU costs here, in US dollars: `--max-cost-usd` needs it (docs/limits.md).
    price_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("time")
    @classmethod
    def _time_is_slurm_time(cls, value: str | None) -> str | None:
        if value is not None:
            slurm_time_seconds(value)
        return value

    @field_validator("partition", "account", "qos", "mem", "constraint")
    @classmethod
    def _one_word(cls, value: str | None) -> str | None:
        if value is not None and (not value.strip() or any(c in value for c in "\n\0")):
            raise ValueError(f"{value!r} is not a value sbatch takes: one line, not empty")
        return value

    @field_validator("sbatch_options")
    @classmethod
    def _not_obds_own(cls, value: list[str]) -> list[str]:
        for option in value:
            name = option.split("=", 1)[0]
            if not option.startswith("-") or "\n" in option or "\0" in option:
                raise ValueError(f'sbatch_options: {option!r} is not an option (one word such as "--exclusive")')
            identity = sbatch_identity_option(name)
            if identity is not None:
                raise ValueError(
                    f"sbatch_options: {name} is not allowed: obd submits each user's job as that user (a root "
                    f"daemon runs sbatch as the run's owner), so no job may be submitted as another with {identity}; "
                    'remove it (docs/slurm.md, "Who submits")'
                )
            if name in SBATCH_OWN_OPTIONS:
                raise ValueError(
                    f"sbatch_options: {name} is set by obd for every job (job name, log, signals, nodes); "
                    "use the target's own keys (nodes, time, signal_margin) instead"
                )
        return value

    @model_validator(mode="after")
    def _margin_inside_the_limit(self) -> SlurmTarget:
        limit = slurm_time_seconds(self.time) if self.time else None
        if limit is not None and self.signal_margin > 0 and self.signal_margin >= limit:
            raise ValueError(
                f"signal_margin ({self.signal_margin:g}s) is not shorter than the time limit ({limit}s): the "
                "deadline snapshot would be asked for before the job starts; lower signal_margin or raise time"
            )
        if self.signal_margin > 65535:
            raise ValueError("signal_margin is at most 65535 s (18 h 12 min): Slurm's --signal takes no more")
        return self

    def time_limit(self) -> int | None:
        """The time limit in seconds, None when the partition's default applies or there is none."""
        return slurm_time_seconds(self.time) if self.time else None


class RayTarget(TargetBase):
    """A Ray cluster reached through its Jobs API (the dashboard's HTTP port, or KubeRay's service).

    Each run is one Ray job whose entrypoint is obd's job wrapper. `workdir` must be on a filesystem
    the daemon and every Ray node share (one machine, or a shared volume): run directories live
    there, and the wrapper writes them from the node the job runs on (docs/ray.md).
    """

    kind: Literal["ray"]
    address: str = "http://127.0.0.1:8265"  # the Jobs API (RAY_API_SERVER_ADDRESS)
    # Sent with every request (a proxy's own headers); values, not secrets.
    headers: dict[str, str] = Field(default_factory=dict)
    # The name of a variable of the daemon's environment whose value is sent as `Authorization:
    # Bearer <value>` (a secured cluster); never written in the config itself.
    token_env: str | None = None
    workdir: str = "~/obd"  # on the filesystem the Ray nodes share with the daemon
    python: str = "python3"  # the job's interpreter, looked up on the PATH the Ray node started with
    # What each run's job asks of the cluster (Ray's entrypoint_num_cpus/num_gpus/memory/resources).
    num_cpus: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    num_gpus: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    memory: int | None = Field(default=None, ge=0)  # bytes
    resources: dict[str, float] = Field(default_factory=dict)  # custom resources, such as {"node_a": 1}
    # A multi-node run (docs/ray.md): a placement group of `nodes` bundles, one a Ray node
    # (STRICT_SPREAD), each asking the resources above; the command runs on each node as given, or
    # under torchrun with its c10d rendezvous on the first bundle's node (`launcher`).
    nodes: int = Field(default=1, ge=1, le=1000)
    launcher: Literal["command", "torchrun"] = "command"
    nproc_per_node: int | None = Field(default=None, ge=1, le=1024)  # torchrun's; default num_gpus or 1
    # Ray's runtime_env for every job, in Ray's terms (pip, conda, env_vars, working_dir as a URI).
    runtime_env: dict[str, Any] = Field(default_factory=dict)
    # How long Ray waits after its SIGTERM before its SIGKILL when obd cancels a job (Ray's
    # RAY_JOB_STOP_WAIT_TIME_S, set for each job obd submits; Ray's own default is 3 s).
    stop_wait: Margin = 30.0
    request_timeout: Timeout = 30.0  # one Jobs API request
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment
    retry: int = Field(default=0, ge=0, le=100)  # the default of `obd train start --retry`
    # The default of `obd train start --keep-checkpoints` (docs/checkpoints.md); None: keep them all.
    keep_checkpoints: int | None = Field(default=None, ge=1, le=100000)
    # What an hour of one GPU costs here, in US dollars: `--max-cost-usd` needs it (docs/limits.md).
    price_per_gpu_hour: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    @field_validator("address")
    @classmethod
    def _http_address(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+/?$", value):
            raise ValueError(
                f"address {value!r} is not the Jobs API's address: use http://HOST:PORT (the dashboard port, "
                "8265 by default), as RAY_API_SERVER_ADDRESS takes it"
            )
        return value.rstrip("/")

    @field_validator("runtime_env")
    @classmethod
    def _runtime_env_in_rays_terms(cls, value: dict[str, Any]) -> dict[str, Any]:
        working_dir = value.get("working_dir")
        if working_dir is not None and (not isinstance(working_dir, str) or "://" not in working_dir):
            raise ValueError(
                "runtime_env.working_dir must be a URI Ray can fetch (gcs://, s3://, https://...zip): obd does not "
                "upload a local directory; a run works in the directory it was started from, on the shared "
                "filesystem (docs/ray.md)"
            )
        env_vars = value.get("env_vars", {})
        if not isinstance(env_vars, dict) or not all(isinstance(v, str) for v in env_vars.values()):
            raise ValueError("runtime_env.env_vars is a table of strings")
        return value

    @property
    def gpu_count(self) -> int | None:
        """The GPUs a run counts for `--max-gpu-hours` and a price: its `num_gpus`, rounded up."""
        return None if self.num_gpus is None else math.ceil(self.num_gpus)


AnyTarget = LocalTarget | SshTarget | RunpodTarget | SlurmTarget | RayTarget
Target = Annotated[AnyTarget, Field(discriminator="kind")]

__all__ = [
    "DAY",
    "HOUR",
    "AnyTarget",
    "Duration",
    "Interval",
    "LocalTarget",
    "LongTimeout",
    "Margin",
    "RayTarget",
    "RunpodTarget",
    "SlurmLogin",
    "SlurmTarget",
    "SshTarget",
    "StrictModel",
    "Target",
    "TargetBase",
    "Timeout",
    "parse_duration",
    "slurm_time_seconds",
]
