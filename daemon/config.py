"""obd's configuration: TOML file, then `OBD_*` variables, then flags.

Unknown keys are errors (a typo must not silently fall back to a default), and durations are
seconds or strings with a unit (`90s`, `30m`, `2h`).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from daemon.paths import default_config_path, default_socket, default_state_dir

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


class StopSection(StrictModel):
    proof_timeout: LongTimeout = 1800.0
    end_timeout: LongTimeout = 600.0
    request_poll: Interval = 30.0
    cancel_grace: Margin = 10.0


class Config(StrictModel):
    daemon: DaemonSection = Field(default_factory=DaemonSection)
    stop: StopSection = Field(default_factory=StopSection)
    targets: dict[str, Target] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _local_is_local(self) -> Config:
        local = self.targets.get("local")
        if local is not None and local.kind != "local":
            raise ValueError(
                f'[targets.local] has kind = "{local.kind}": the name `local` is this machine; '
                "give that target another name"
            )
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
    "RunpodTarget",
    "SshTarget",
    "StopSection",
    "Target",
    "load_config",
    "parse_duration",
]


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
