"""Default locations of the state directory, the socket and the config file (standard library only).

Kept apart from `daemon.service.config` so the `obd` client finds the socket without importing pydantic.
Worked out as strings (`*_str`), so that `obd train list` finds its socket without importing
pathlib, and reads the config with tomllib only when there is one; the `Path` functions are the
same answers, for the daemon.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing
if TYPE_CHECKING:
    from pathlib import Path


def default_config_path_str() -> str:
    if os.environ.get("OBD_CONFIG"):
        return os.environ["OBD_CONFIG"]
    if os.geteuid() == 0:
        return "/etc/obd/config.toml"
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(base, "obd", "config.toml")


def default_state_dir_str() -> str:
    if os.environ.get("OBD_STATE_DIR"):
        return os.environ["OBD_STATE_DIR"]
    if os.geteuid() == 0:
        return "/var/lib/obd"
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "obd")


def default_socket_str(state_dir: str | os.PathLike[str] | None = None) -> str:
    if os.environ.get("OBD_SOCKET"):
        return os.environ["OBD_SOCKET"]
    if state_dir is not None or os.environ.get("OBD_STATE_DIR"):
        return os.path.join(os.fspath(state_dir or default_state_dir_str()), "obd.sock")
    if os.geteuid() == 0:
        return "/run/obd/obd.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "obd", "obd.sock")
    return os.path.join(default_state_dir_str(), "obd.sock")


def client_socket_str(flag: str | None, config: str | None = None, state_dir: str | None = None) -> str:
    """The socket the client talks to, found as the daemon picks it: --socket, OBD_SOCKET, the
    config's socket, then STATE_DIR/obd.sock for --state-dir, OBD_STATE_DIR or the config's state_dir."""
    if flag:
        return flag
    if os.environ.get("OBD_SOCKET"):
        return os.environ["OBD_SOCKET"]
    path = config or default_config_path_str()
    section: dict = {}
    try:
        with open(path, "rb") as file:
            data = file.read()
        import tomllib  # only when there is a config to read

        raw = tomllib.loads(data.decode())
        section = raw.get("daemon", {}) if isinstance(raw.get("daemon", {}), dict) else {}
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        # Said, not ignored: a socket set in a broken config would otherwise be silently missed.
        sys.stderr.write(f"obd: warning: {path} cannot be read ({exc}); looking for the daemon's default socket\n")
    if section.get("socket"):
        return str(section["socket"])
    state = state_dir or os.environ.get("OBD_STATE_DIR") or section.get("state_dir")
    if state:
        return default_socket_str(str(state))
    return default_socket_str()


def default_config_path() -> Path:
    from pathlib import Path

    return Path(default_config_path_str())


def default_state_dir() -> Path:
    from pathlib import Path

    return Path(default_state_dir_str())


def default_socket(state_dir: Path | None = None) -> Path:
    from pathlib import Path

    return Path(default_socket_str(state_dir))


def client_socket(flag: str | None, config: str | None = None, state_dir: str | None = None) -> Path:
    """`client_socket_str`, as a Path."""
    from pathlib import Path

    return Path(client_socket_str(flag, config, state_dir))
