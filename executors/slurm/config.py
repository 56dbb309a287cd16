"""What a `[targets.NAME]` section of `kind = "slurm"` (a Slurm cluster) holds: `SlurmTarget` and its
`SlurmLogin`, with what sbatch's options and time limits allow."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from executors.config_base import Interval, Margin, PricedTarget, StrictModel, Timeout

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


class SlurmTarget(PricedTarget):
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


__all__ = [
    "SBATCH_IDENTITY_OPTIONS",
    "SBATCH_OWN_OPTIONS",
    "SlurmLogin",
    "SlurmTarget",
    "sbatch_identity_option",
    "slurm_time_seconds",
]
