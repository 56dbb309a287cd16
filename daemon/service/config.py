"""obd's configuration: TOML file, then `OBD_*` variables, then flags.

Unknown keys are errors (a typo must not silently fall back to a default), and durations are
seconds or strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, field_validator, model_validator

from daemon.common.paths import default_config_path, default_socket, default_state_dir

# The target models live below the daemon (the executors read them); importable from here too.
from executors.config import (
    AnyTarget,
    Duration,
    Interval,
    LocalTarget,
    LongTimeout,
    Margin,
    RunpodTarget,
    SshTarget,
    StrictModel,
    Target,
    Timeout,
    parse_duration,
)
from executors.kinds import kinds


class ConfigError(Exception):
    pass


class DaemonSection(StrictModel):
    state_dir: Path | None = None
    socket: Path | None = None
    socket_mode: int = Field(default=0o600, ge=0o600, le=0o777)  # no setuid/setgid/sticky bit
    socket_group: str | None = None  # members of this group may use the socket (mode 0660)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    poll_interval: Interval = 1.0  # how often a local target is polled
    remote_poll_interval: Interval = 3.0  # how often an SSH or pod target is polled
    probe_timeout: Timeout = 20.0  # a read of a target that takes longer is abandoned
    # On a target that reports what happens (the local one: inotify, pidfd), every run is read
    # again this often as a safety net; in between, only the runs something happened to.
    sweep_interval: Interval = 30.0
    metrics_listen: str | None = (
        None  # HOST:PORT for Prometheus' /metrics (daemon/service/prometheus.py); off unless set
    )

    @field_validator("metrics_listen")
    @classmethod
    def _listen_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen(value)
        return value


def parse_listen(value: str) -> tuple[str, int]:
    """(host, port) from `HOST:PORT` or `[IPv6]:PORT`, as `metrics_listen` takes them."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([A-Za-z0-9.-]+):(\d{1,5})", value.strip())
    if not match:
        raise ValueError(f'{value!r} is not HOST:PORT (e.g. "127.0.0.1:9464" or "[::1]:9464")')
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range: use 1 to 65535")
    return host, port


class StopSection(StrictModel):
    proof_timeout: LongTimeout = 1800.0
    end_timeout: LongTimeout = 600.0
    request_poll: Interval = 30.0
    cancel_grace: Margin = 10.0


class LimitsSection(StrictModel):
    """How far ahead of a chain's limit obd asks for its snapshot (docs/limits.md): the run's last
    measured save (request to proof), never less than `save_floor`, plus `margin`."""

    save_floor: Margin = 60.0
    margin: Margin = 30.0


class PolicySection(StrictModel):
    """What each user of a shared daemon may ask (docs/security.md): how many runs they may have
    queued, and the highest `--priority` they may give. Root, the daemon's own user and the members
    of `admin_group` are not limited."""

    admin_group: str | None = None  # its members may give any priority and queue any number of runs
    max_queued_runs_per_user: int = Field(default=1000, ge=1, le=10_000_000)
    max_priority: int = Field(default=0, ge=0, le=100)  # for every user not named below (any lower one too)
    max_priority_users: dict[str, int] = Field(default_factory=dict)  # user name -> their highest
    max_priority_groups: dict[str, int] = Field(default_factory=dict)  # group name -> its members' highest
    # Which targets a user may use (start, resume --target, move --to, placement, overflow): a target
    # named in neither table is every member's; one named in either is only for the users listed
    # for it and the members of the groups listed for it (root and admin_group: every target).
    target_users: dict[str, list[str]] = Field(default_factory=dict)  # target -> user names
    target_groups: dict[str, list[str]] = Field(default_factory=dict)  # target -> group names

    @field_validator("max_priority_users", "max_priority_groups")
    @classmethod
    def _priorities(cls, value: dict[str, int]) -> dict[str, int]:
        for name, limit in value.items():
            if not 0 <= limit <= 100:
                raise ValueError(f"{name} = {limit}: the highest priority a user may give is 0 to 100")
        return value


RetryCause = Literal["exit", "lost", "launch", "preempted", "deadline", "cost"]
RETRY_CAUSES: tuple[RetryCause, ...] = get_args(RetryCause)


class RetrySection(StrictModel):
    """Automatic recovery of runs started with `--retry N` (or a target's `retry`)."""

    backoff: Timeout = 10.0  # before the second attempt; doubled for each one after
    max_backoff: LongTimeout = 600.0
    # What a retry can help with: a non-zero exit, a lost job, a failed launch, a preemption
    # (a `preempted` snapshot, a pod stopped outside obd), a `deadline` snapshot (a pod's
    # max_hours, Slurm's time limit), a `cost` snapshot (a pod's max_cost_usd: the next attempt
    # continues on a new pod; the chain's own budget is --max-cost-usd, docs/placement.md).
    on: list[RetryCause] = Field(default_factory=lambda: list(RETRY_CAUSES))


NotifyEvent = Literal[
    "failed",
    "stopped",
    "succeeded",
    "cancelled",
    "queued",
    "started",
    "snapshot",
    "cost_warning",
    "preempted",
    "bad_checkpoint",
]
NOTIFY_EVENTS: tuple[str, ...] = get_args(NotifyEvent)
FINAL_EVENTS: tuple[NotifyEvent, ...] = ("failed", "stopped", "succeeded", "cancelled")  # `on` by default
_NOTIFY_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class NotifyEntry(StrictModel):
    """One `[[notify]]` entry: where the events of runs go (a command, a webhook, or both).

    What it delivered is kept under `key`: its `name`, else a digest of where it delivers, so
    reordering the entries or changing `on` or `timeout` never delivers an event twice.
    """

    name: str | None = None
    command: list[str] | None = None  # run with the event's JSON on stdin
    url: str | None = None  # POSTed the event's JSON
    on: list[NotifyEvent] = Field(default_factory=lambda: list(FINAL_EVENTS))
    timeout: Timeout = 10.0  # one attempt: a command's whole run, or a webhook's answer
    retries: int = Field(default=3, ge=0, le=20)  # attempts after the first
    backoff: Margin = 2.0  # before the first retry; doubled before each one after
    owners: list[str] | None = None  # only the runs of these users (names)
    targets: list[str] | None = None  # only the runs on these targets
    env: list[str] = Field(default_factory=list)  # names from the daemon's environment the command gets

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not _NOTIFY_NAME_RE.match(value):
            raise ValueError(
                "a name is letters, digits, '-', '_' and '.' (at most 64), starting with a letter or digit"
            )
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not value[0]):
            raise ValueError("a command is a non-empty list: the program, then its arguments")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        parts = urlsplit(value)
        try:
            port_ok = parts.port is None or 1 <= parts.port <= 65535
        except ValueError:
            port_ok = False
        if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
            raise ValueError("a url is http://HOST[:PORT]/PATH or https://HOST[:PORT]/PATH")
        return value

    @field_validator("on")
    @classmethod
    def _on(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError(f"name at least one event: {', '.join(NOTIFY_EVENTS)}")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: list[str]) -> list[str]:
        for name in value:
            if not _ENV_NAME_RE.match(name) or name.startswith("OBD_"):
                raise ValueError(f"{name!r} is not a variable name a command may be given (OBD_* names are obd's)")
        return value

    @model_validator(mode="after")
    def _somewhere(self) -> NotifyEntry:
        if not self.command and not self.url:
            raise ValueError('a [[notify]] entry needs `command = [...]` or `url = "..."` (or both)')
        return self

    @property
    def key(self) -> str:
        if self.name:
            return self.name
        where = repr((self.url, self.command)).encode()
        return "h-" + hashlib.sha256(where).hexdigest()[:12]

    @property
    def label(self) -> str:
        """How logs and metrics name it: never the url's path or query (where a webhook keeps its secret)."""
        if self.name:
            return self.name
        if self.url:
            parts = urlsplit(self.url)
            return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]} ({self.key})"
        assert self.command is not None
        return f"{os.path.basename(self.command[0])} ({self.key})"


class PoolSection(StrictModel):
    """`[pools.NAME]`: targets a run may be placed on, in order of preference (docs/placement.md);
    `--target NAME` is the same as `--target` with the list."""

    targets: list[str] = Field(min_length=1, max_length=100)

    @field_validator("targets")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("name each target once")
        return value


class Config(StrictModel):
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    stop: StopSection = Field(default_factory=StopSection)
    retry: RetrySection = Field(default_factory=RetrySection)
    limits: LimitsSection = Field(default_factory=LimitsSection)
    policy: PolicySection = Field(default_factory=PolicySection)
    targets: dict[str, Target] = Field(default_factory=dict)
    pools: dict[str, PoolSection] = Field(default_factory=dict)  # `[pools.NAME]` (docs/placement.md)
    notify: list[NotifyEntry] = Field(default_factory=list)  # `[[notify]]` entries (daemon/service/notify.py)

    @field_validator("notify")
    @classmethod
    def _distinct_notify(cls, entries: list[NotifyEntry]) -> list[NotifyEntry]:
        keys = [e.key for e in entries]
        for key in keys:
            if keys.count(key) > 1:
                raise ValueError(
                    f"two entries deliver to the same place or share the name {key!r}: give each a distinct `name`"
                )
        return entries

    @model_validator(mode="after")
    def _local_is_local(self) -> Config:
        local = self.targets.get("local")
        if local is not None and local.kind != "local":
            raise ValueError(
                f'[targets.local] has kind = "{local.kind}": the name `local` is this machine; '
                "give that target another name"
            )
        return self

    @model_validator(mode="after")
    def _policy_names_targets(self) -> Config:
        known = {"local", *self.targets}
        for table in ("target_users", "target_groups"):
            unknown = sorted(set(getattr(self.policy, table)) - known)
            if unknown:
                raise ValueError(
                    f"[policy] {table}: no target {', '.join(unknown)}; the targets are: {', '.join(sorted(known))}"
                )
        return self

    @model_validator(mode="after")
    def _placements_name_targets(self) -> Config:
        known = {"local", *self.targets}
        names = ", ".join(sorted(known))
        for name, pool in self.pools.items():
            if name in known:
                raise ValueError(f"[pools.{name}]: {name} is also a target's name: give the pool another name")
            if "," in name:
                raise ValueError(f"[pools.{name}]: a pool's name holds no ',' (--target a,b lists targets)")
            unknown = [t for t in pool.targets if t not in known]
            if unknown:
                raise ValueError(f"[pools.{name}]: no target {', '.join(unknown)}; the targets are: {names}")
        for name, target in self.targets.items():
            if target.overflow is None:
                continue
            if target.overflow not in known:
                raise ValueError(
                    f"[targets.{name}] overflow = {target.overflow!r}: no such target; the targets are: {names}"
                )
            seen: list[str] = [name]
            at: str | None = target.overflow
            while at is not None:
                if at in seen:
                    loop = " -> ".join([*seen, at])
                    raise ValueError(f"[targets.{name}] overflow: the overflows go round ({loop}); break the loop")
                seen.append(at)
                at = self.target(at).overflow
        return self

    def target(self, name: str) -> AnyTarget:
        if name in self.targets:
            return self.targets[name]
        if name == "local":
            return LocalTarget()
        known = ", ".join(sorted({"local", *self.targets})) or "local"
        raise ConfigError(f"unknown target {name!r}; the targets are: {known} (`obd targets list`)")


__all__ = [
    "Config",
    "ConfigError",
    "DaemonSection",
    "Duration",
    "LocalTarget",
    "NotifyEntry",
    "PolicySection",
    "PoolSection",
    "RunpodTarget",
    "SshTarget",
    "StopSection",
    "Target",
    "load_config",
    "parse_duration",
    "parse_listen",
]


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "tuple", "none"})


def _key_path(loc: tuple[int | str, ...]) -> str:
    """Where a configuration error is, as the file spells it: pydantic's tags for the member of
    a union it tried (a target's kind, `list[str]`, `int`, `function-after[...]`) left out."""
    parts = [str(p) for p in loc]
    if len(parts) >= 3 and parts[0] == "targets" and parts[2] in kinds():  # the registry's, a new kind's too
        del parts[2]
    return ".".join(p for p in parts if not ("[" in p or p in _TYPE_TAGS or p.startswith("function-")))


def _format_validation(error: ValidationError, source: str) -> str:
    """One line per key at fault, each of its complaints once (a union's members joined by `or`)."""
    found: dict[str, list[str]] = {}
    for item in error.errors():
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling against the README's configuration section)"
        said = found.setdefault(_key_path(item["loc"]), [])
        if msg not in said:
            said.append(msg)
    lines = [f"{source}: invalid configuration"]
    lines += [f"  {where}: {'; or '.join(msgs)}" for where, msgs in found.items()]
    return "\n".join(lines)


_ENV_KEYS = {
    "OBD_PROOF_TIMEOUT": ("stop", "proof_timeout"),
    "OBD_END_TIMEOUT": ("stop", "end_timeout"),
    "OBD_REQUEST_POLL": ("stop", "request_poll"),
    "OBD_CANCEL_GRACE": ("stop", "cancel_grace"),
    "OBD_POLL_INTERVAL": ("daemon", "poll_interval"),
}


def load_config(
    path: Path | None = None,
    *,
    state_dir: Path | None = None,
    socket: Path | None = None,
    environ: dict[str, str] | None = None,
) -> Config:
    """Read the config file (if any), apply `OBD_*` variables and flags, fill the defaults."""
    environ = dict(os.environ if environ is None else environ)
    explicit = path is not None or "OBD_CONFIG" in environ
    path = Path(path or default_config_path())
    raw: dict[str, Any] = {}
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from exc
        except OSError as exc:
            raise ConfigError(f"{path}: cannot be read: {exc}") from exc
    elif explicit:
        raise ConfigError(f"{path}: no such config file")
    for var, (section, key) in _ENV_KEYS.items():
        if var in environ:
            raw.setdefault(section, {})[key] = environ[var]
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, str(path))) from exc
    d = config.daemon
    d.state_dir = Path(state_dir or environ.get("OBD_STATE_DIR") or d.state_dir or default_state_dir())
    explicit_state = bool(state_dir or environ.get("OBD_STATE_DIR") or raw.get("daemon", {}).get("state_dir"))
    d.socket = Path(
        socket or environ.get("OBD_SOCKET") or d.socket or default_socket(d.state_dir if explicit_state else None)
    )
    return config
