"""Default locations of the state directory, the socket and the config file (standard library only).

Kept apart from `daemon.config` so the `obd` client finds the socket without importing pydantic.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path


def default_config_path() -> Path:
    if os.environ.get("OBD_CONFIG"):
        return Path(os.environ["OBD_CONFIG"])
    if os.geteuid() == 0:
        return Path("/etc/obd/config.toml")
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(base) / "obd" / "config.toml"


def default_state_dir() -> Path:
    if os.environ.get("OBD_STATE_DIR"):
        return Path(os.environ["OBD_STATE_DIR"])
    if os.geteuid() == 0:
        return Path("/var/lib/obd")
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(base) / "obd"


def default_socket(state_dir: Path | None = None) -> Path:
    if os.environ.get("OBD_SOCKET"):
        return Path(os.environ["OBD_SOCKET"])
    if state_dir is not None or os.environ.get("OBD_STATE_DIR"):
        return Path(state_dir or default_state_dir()) / "obd.sock"
    if os.geteuid() == 0:
        return Path("/run/obd/obd.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "obd" / "obd.sock"
    return default_state_dir() / "obd.sock"


def client_socket(flag: str | None, config: str | None = None, state_dir: str | None = None) -> Path:
    """The socket the client talks to, found as the daemon picks it: --socket, OBD_SOCKET, the
    config's socket, then STATE_DIR/obd.sock for --state-dir, OBD_STATE_DIR or the config's state_dir."""
    if flag:
        return Path(flag)
    if os.environ.get("OBD_SOCKET"):
        return Path(os.environ["OBD_SOCKET"])
    path = Path(config) if config else default_config_path()
    section: dict = {}
    try:
        raw = tomllib.loads(path.read_text())
        section = raw.get("daemon", {}) if isinstance(raw.get("daemon", {}), dict) else {}
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        # Said, not ignored: a socket set in a broken config would otherwise be silently missed.
        sys.stderr.write(f"obd: warning: {path} cannot be read ({exc}); looking for the daemon's default socket\n")
    if section.get("socket"):
        return Path(section["socket"])
    state = state_dir or os.environ.get("OBD_STATE_DIR") or section.get("state_dir")
    if state:
        return default_socket(Path(state))
    return default_socket()
