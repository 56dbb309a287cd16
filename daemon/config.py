"""obd's configuration: TOML file, then `OBD_*` variables, then flags.

Unknown keys are errors (a typo must not silently fall back to a default), and durations are
seconds or strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from daemon.paths import default_config_path, default_socket, default_state_dir

_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}
# A Runpod network volume id: the SDK pastes it unescaped into GraphQL, so nothing else gets through.
_NETWORK_VOLUME_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


class ConfigError(Exception):
    pass


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `90s`, `30m`, `2h`."""
    if isinstance(value, bool):
        raise ValueError("a duration is a number of seconds or a string like '90s', '30m', '2h'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError("a duration cannot be negative")
        return float(value)
    if isinstance(value, str):
        match = _DURATION_RE.match(value)
        if match:
            return float(match.group(1)) * _UNITS[match.group(2)]
    raise ValueError(f"bad duration {value!r}: use a number of seconds or a string like '90s', '30m', '2h'")


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DaemonSection(_Strict):
    state_dir: Path | None = None
    socket: Path | None = None
    socket_mode: int = 0o600
    socket_group: str | None = None  # members of this group may use the socket (mode 0660)
    log_level: str = "info"
    poll_interval: Duration = 1.0  # how often a local target is polled
    remote_poll_interval: Duration = 3.0  # how often an SSH or pod target is polled
    probe_timeout: Duration = 20.0  # a read of a target that takes longer is abandoned


class StopSection(_Strict):
    proof_timeout: Duration = 1800.0
    end_timeout: Duration = 600.0
    request_poll: Duration = 30.0
    cancel_grace: Duration = 10.0


class LocalTarget(_Strict):
    kind: Literal["local"] = "local"
    workdir: Path | None = None  # default: <state_dir>/runs
    python: str | None = None  # the interpreter that runs obd's job wrapper


class SshTarget(_Strict):
    kind: Literal["ssh"]
    host: str
    port: int = 22
    user: str | None = None
    identity_file: Path | None = None
    known_hosts: Path | None = None  # default ~/.ssh/known_hosts
    accept_unknown_host: bool = False
    workdir: str = "~/obd"
    python: str = "python3"
    venv: str | None = None
    keepalive: Duration = 15.0
    connect_timeout: Duration = 15.0
    secrets: list[str] = Field(default_factory=list)  # names read from the daemon's environment


class RunpodTarget(_Strict):
    kind: Literal["runpod"]
    gpu_type: str | list[str] = "NVIDIA GeForce RTX 4090"
    gpu_count: int = 1
    image: str = "runpod/pytorch:2.4.0-py3.11-cuda12.4.1-devel-ubuntu22.04"
    cloud_type: Literal["SECURE", "COMMUNITY", "ALL"] = "SECURE"
    volume_gb: int = 50
    container_disk_gb: int = 50
    network_volume_id: str | None = None
    max_hours: float | None = None
    max_cost_usd: float | None = None
    disk_min_free_gb: float | None = None
    disk_max_used_pct: float | None = None
    keep_pod: bool = False
    boot_grace: Duration = 600.0
    abandon_grace: Duration = 1800.0
    identity_file: Path | None = None
    ssh_user: str = "root"
    workdir: str = "/workspace/obd"
    python: str = "python3"
    secrets: list[str] = Field(default_factory=list)
    snapshot_margin: Duration = 900.0  # ask for the snapshot this long before a cap
    watchdog_interval: Duration = 30.0
    lease_ttl: Duration = 300.0  # the daemon's lease the watchdog honours
    api_poll_interval: Duration = 5.0  # how often a booting pod is looked at

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


Target = Annotated[LocalTarget | SshTarget | RunpodTarget, Field(discriminator="kind")]


class Config(_Strict):
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    stop: StopSection = Field(default_factory=StopSection)
    targets: dict[str, Target] = Field(default_factory=dict)

    def target(self, name: str) -> LocalTarget | SshTarget | RunpodTarget:
        if name in self.targets:
            return self.targets[name]
        if name == "local":
            return LocalTarget()
        known = ", ".join(sorted({"local", *self.targets})) or "local"
        raise ConfigError(f"unknown target {name!r}; the targets are: {known} (`obd targets list`)")


def _format_validation(error: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-"))
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            msg = "unknown key (check its spelling against the README's configuration section)"
        lines.append(f"  {where}: {msg}")
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
