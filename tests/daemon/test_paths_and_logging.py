"""Default locations (XDG for a user; /var/lib/obd, /etc/obd, /run/obd for root) and the daemon's log
(structlog: JSON lines when stderr is not a terminal, key=value text on one, the run id on every line
about a run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.common import paths
from daemon.service.config import load_config
from tests.conftest import REPO, DaemonProc, kill_leftover_jobs, wait_for

_VARS = ("OBD_STATE_DIR", "OBD_SOCKET", "OBD_CONFIG", "XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A clean environment: HOME is a temporary directory, no OBD_* or XDG_* variable is set."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in _VARS:
        monkeypatch.delenv(var, raising=False)
    return home


def as_uid(monkeypatch: pytest.MonkeyPatch, uid: int) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: uid)


def daemon_pick() -> tuple[Path, Path]:
    """The state directory and socket the daemon would use with these variables and no flags."""
    config = load_config(None, environ=dict(os.environ))
    assert config.daemon.state_dir is not None and config.daemon.socket is not None
    return config.daemon.state_dir, config.daemon.socket


# --- a user ------------------------------------------------------------------------------------


def test_a_user_daemon_keeps_its_state_and_config_where_xdg_says(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_uid(monkeypatch, 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xstate"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xconfig"))
    assert paths.default_state_dir() == tmp_path / "xstate" / "obd"
    assert paths.default_config_path() == tmp_path / "xconfig" / "obd" / "config.toml"
    assert daemon_pick()[0] == tmp_path / "xstate" / "obd"


def test_a_user_without_xdg_variables_gets_the_xdg_defaults_under_home(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_uid(monkeypatch, 1000)
    assert paths.default_state_dir() == home / ".local" / "state" / "obd"
    assert paths.default_config_path() == home / ".config" / "obd" / "config.toml"
    # No XDG_RUNTIME_DIR: the socket falls back to the state directory.
    assert paths.default_socket() == home / ".local" / "state" / "obd" / "obd.sock"
    assert daemon_pick() == (home / ".local" / "state" / "obd", home / ".local" / "state" / "obd" / "obd.sock")


def test_a_user_daemon_puts_its_socket_under_xdg_runtime_dir(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_uid(monkeypatch, 1000)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run-1000"))
    assert paths.default_socket() == tmp_path / "run-1000" / "obd" / "obd.sock"
    assert daemon_pick()[1] == tmp_path / "run-1000" / "obd" / "obd.sock"


def test_a_user_without_xdg_runtime_dir_gets_the_socket_in_the_xdg_state_dir(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_uid(monkeypatch, 1000)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xstate"))
    assert paths.default_socket() == tmp_path / "xstate" / "obd" / "obd.sock"
    assert daemon_pick()[1] == tmp_path / "xstate" / "obd" / "obd.sock"


def test_an_empty_xdg_variable_counts_as_unset(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    as_uid(monkeypatch, 1000)
    for var in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(var, "")
    assert paths.default_state_dir() == home / ".local" / "state" / "obd"
    assert paths.default_config_path() == home / ".config" / "obd" / "config.toml"
    assert paths.default_socket() == home / ".local" / "state" / "obd" / "obd.sock"


# --- root --------------------------------------------------------------------------------------


def test_root_uses_var_lib_etc_and_run_and_ignores_xdg(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_uid(monkeypatch, 0)
    for var in ("XDG_STATE_HOME", "XDG_CONFIG_HOME", "XDG_RUNTIME_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    assert paths.default_state_dir() == Path("/var/lib/obd")
    assert paths.default_config_path() == Path("/etc/obd/config.toml")
    assert paths.default_socket() == Path("/run/obd/obd.sock")
    if not Path("/etc/obd/config.toml").exists():  # a real config there may name other places
        assert daemon_pick() == (Path("/var/lib/obd"), Path("/run/obd/obd.sock"))
        assert paths.client_socket(None) == Path("/run/obd/obd.sock")


# --- OBD_* variables ---------------------------------------------------------------------------


@pytest.mark.parametrize("uid", [1000, 0], ids=["user", "root"])
def test_obd_variables_override_the_defaults(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uid: int
) -> None:
    as_uid(monkeypatch, uid)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("OBD_STATE_DIR", str(tmp_path / "s"))
    monkeypatch.setenv("OBD_CONFIG", str(tmp_path / "c.toml"))
    assert paths.default_state_dir() == tmp_path / "s"
    assert paths.default_config_path() == tmp_path / "c.toml"
    # OBD_STATE_DIR alone moves the socket with it, for root and for a user with XDG_RUNTIME_DIR.
    assert paths.default_socket() == tmp_path / "s" / "obd.sock"
    monkeypatch.setenv("OBD_SOCKET", str(tmp_path / "x.sock"))
    assert paths.default_socket() == tmp_path / "x.sock"
    (tmp_path / "c.toml").write_text("")
    assert daemon_pick() == (tmp_path / "s", tmp_path / "x.sock")
    assert paths.client_socket(None) == tmp_path / "x.sock"


# --- the client finds the daemon's socket --------------------------------------------------------


SCENARIOS = {
    "user-xdg-runtime": (1000, {"XDG_RUNTIME_DIR": "run", "XDG_STATE_HOME": "xs"}, None),
    "user-no-runtime": (1000, {"XDG_STATE_HOME": "xs"}, None),
    "user-nothing-set": (1000, {}, None),
    "user-obd-state-dir": (1000, {"XDG_RUNTIME_DIR": "run", "OBD_STATE_DIR": "s"}, None),
    "user-obd-socket": (1000, {"XDG_RUNTIME_DIR": "run", "OBD_SOCKET": "o.sock"}, None),
    "user-config-state-dir": (
        1000,
        {"XDG_RUNTIME_DIR": "run", "XDG_CONFIG_HOME": "xc"},
        '[daemon]\nstate_dir = "{t}/cs"\n',
    ),
    "user-config-socket": (1000, {"XDG_CONFIG_HOME": "xc"}, '[daemon]\nsocket = "{t}/cfg.sock"\n'),
    "root-obd-config-state-dir": (0, {"OBD_CONFIG": "rc.toml"}, '[daemon]\nstate_dir = "{t}/rs"\n'),
    "root-obd-state-dir": (0, {"OBD_STATE_DIR": "s"}, None),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_client_finds_the_socket_the_daemon_picks(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    uid, env, config = SCENARIOS[name]
    as_uid(monkeypatch, uid)
    for var, rel in env.items():
        monkeypatch.setenv(var, str(tmp_path / rel))
    if config is not None:
        path = paths.default_config_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config.format(t=tmp_path))
    _state, socket = daemon_pick()
    assert paths.client_socket(None) == socket
    # The expected places, spelled out, so a change on both sides at once is caught too.
    expected = {
        "user-xdg-runtime": tmp_path / "run" / "obd" / "obd.sock",
        "user-no-runtime": tmp_path / "xs" / "obd" / "obd.sock",
        "user-nothing-set": home / ".local" / "state" / "obd" / "obd.sock",
        "user-obd-state-dir": tmp_path / "s" / "obd.sock",
        "user-obd-socket": tmp_path / "o.sock",
        "user-config-state-dir": tmp_path / "cs" / "obd.sock",
        "user-config-socket": tmp_path / "cfg.sock",
        "root-obd-config-state-dir": tmp_path / "rs" / "obd.sock",
        "root-obd-state-dir": tmp_path / "s" / "obd.sock",
    }[name]
    assert socket == expected


# --- end to end: a user's daemon with only XDG variables -----------------------------------------

# The tests may run as root, where XDG is ignored by design; this launcher makes the daemon and the
# client processes see a user's euid, and nothing else changes (uid 0 is still let through the socket).
AS_USER = "import os, runpy, sys; os.geteuid = lambda: 1000; runpy.run_module('daemon.cli', run_name='__main__')"


def test_a_user_daemon_started_with_only_xdg_variables_is_reached_by_a_client_with_the_same_variables(
    short_tmp: Path,
) -> None:
    home = short_tmp / "h"
    home.mkdir()
    runtime = short_tmp / "r"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k not in _VARS}
    env.update(
        HOME=str(home),
        XDG_STATE_HOME=str(short_tmp / "st"),
        XDG_CONFIG_HOME=str(short_tmp / "cf"),
        XDG_RUNTIME_DIR=str(runtime),
        PYTHONPATH=str(REPO),
        OBD_NO_SCOPE="1",
    )
    socket = runtime / "obd" / "obd.sock"
    state = short_tmp / "st" / "obd"
    log = short_tmp / "daemon.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", AS_USER, "daemon"], env=env, stdout=out, stderr=out, cwd=REPO)
    try:

        def up() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"daemon exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            return socket.is_socket()

        wait_for(up, 20, 0.05, f"the socket at {socket}")
        assert state.is_dir()
        assert not (home / ".local").exists(), "nothing should land under HOME when XDG variables are set"
        listed = subprocess.run(
            [sys.executable, "-c", AS_USER, "train", "list", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        assert listed.returncode == 0, listed.stderr
        assert json.loads(listed.stdout) == []
        ready = [json.loads(line) for line in log.read_text().splitlines() if '"daemon_ready"' in line]
        assert ready and ready[0]["socket"] == str(socket)
    finally:
        proc.terminate()
        proc.wait(15)
        kill_leftover_jobs(state)


# --- logging -----------------------------------------------------------------------------------


@pytest.fixture
def logged_daemon(short_tmp: Path) -> Iterator[DaemonProc]:
    d = DaemonProc(short_tmp)
    d.start()  # stderr is the file daemon.log: not a terminal
    yield d
    d.stop()
    kill_leftover_jobs(d.state_dir)


def _start(d: DaemonProc, *command: str) -> str:
    out = d.cli("train", "start", "--", *command)
    assert out.returncode == 0, out.stderr
    run_id = out.stdout.strip()
    assert run_id and "\n" not in run_id
    return run_id


def test_the_daemon_logs_json_lines_with_the_run_id_on_every_line_about_a_run(logged_daemon: DaemonProc) -> None:
    d = logged_daemon
    ok = _start(d, "sh", "-c", "echo hello")
    bad = _start(d, "sh", "-c", "echo boom >&2; exit 3")
    cancelled = _start(d, "sleep", "30")
    d.wait_state(ok, "succeeded", timeout=20)
    d.wait_state(bad, "failed", timeout=20)
    d.wait_state(cancelled, "running", timeout=20)
    assert d.cli("train", "cancel", cancelled, "--wait").returncode == 0
    d.wait_state(cancelled, "cancelled", timeout=20)
    follow = d.cli("train", "logs", ok, "--follow", timeout=20)
    assert follow.returncode == 0 and "hello" in follow.stdout
    d.stop()  # every line written and flushed

    text = d.log_path.read_text()
    lines: list[dict[str, Any]] = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"daemon.log line {number} is not JSON: {line!r}") from None
        assert isinstance(entry, dict), line
        assert {"event", "level", "timestamp"} <= entry.keys(), line
        lines.append(entry)
    events = [e["event"] for e in lines]
    assert "daemon_ready" in events and "daemon_stopped" in events

    runs = {ok: "succeeded", bad: "failed", cancelled: "cancelled"}
    for run_id, final in runs.items():
        mine = [e for e in lines if e.get("run_id") == run_id]
        got = [e["event"] for e in mine]
        for expected in ("run_created", "run_started", "run_finished"):
            assert expected in got, f"no {expected} line for {run_id}: {got}"
        assert [e["state"] for e in mine if e["event"] == "run_finished"] == [final]
    assert any(e["event"] == "cancel_requested" and e.get("run_id") == cancelled for e in lines)
    failed = next(e for e in lines if e["event"] == "run_finished" and e.get("run_id") == bad)
    assert failed["exit_code"] == 3 and f"obd train logs {bad}" in failed["message"]

    # Any line that names a run (in a message, a path...) carries that run's id under `run_id`.
    for entry in lines:
        for run_id in runs:
            if run_id in json.dumps({k: v for k, v in entry.items() if k != "run_id"}):
                assert entry.get("run_id") == run_id, f"a line about {run_id} without its run_id: {entry}"


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_configured_for_a_terminal_the_log_is_key_value_text_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    import structlog

    from daemon.service.log import configure

    try:
        configure("info", json_output=False)
        structlog.get_logger("obd").info("run_started", run_id="r-123", pid=42)
        structlog.get_logger("obd").debug("too_quiet", run_id="r-123")
        err = ANSI.sub("", capsys.readouterr().err)
    finally:
        structlog.reset_defaults()
    assert err.count("\n") == 1, err
    assert "run_started" in err and "run_id=r-123" in err and "pid=42" in err and "info" in err
    with pytest.raises(ValueError):
        json.loads(err)


def _log_one_line(stderr: Any) -> None:
    code = (
        "import structlog; from daemon.service.log import configure; configure('info');"
        "structlog.get_logger('obd').info('run_started', run_id='r-9', pid=7)"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], stderr=stderr, cwd=REPO, env=env, timeout=60, check=True)


def test_the_log_format_follows_whether_stderr_is_a_terminal(tmp_path: Path) -> None:
    # Not a terminal: one JSON object per line.
    path = tmp_path / "err.log"
    with open(path, "wb") as f:
        _log_one_line(f)
    entry = json.loads(path.read_text())
    assert entry["event"] == "run_started" and entry["run_id"] == "r-9" and entry["level"] == "info"
    assert "timestamp" in entry

    # A terminal (a pty): key=value text.
    import pty

    master, slave = pty.openpty()
    try:
        _log_one_line(slave)
        os.close(slave)
        chunks = []
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO once the other side is closed and read empty
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(master)
    text = ANSI.sub("", b"".join(chunks).decode())
    assert "run_started" in text and "run_id=r-9" in text and "pid=7" in text
    assert not text.lstrip().startswith("{")


def test_library_chatter_is_kept_below_warning_and_rendered_like_obds_own_lines() -> None:
    import io
    import logging
    import sys

    from daemon.service.log import configure

    err = io.StringIO()
    old = sys.stderr
    sys.stderr = err
    try:
        configure("info", json_output=True)
        logging.basicConfig(level=logging.INFO)  # what importing the runpod SDK does: now a no-op
        logging.getLogger("asyncssh").info("Running remote command: secret shell script body")
        logging.getLogger("asyncssh").warning("connection lost")
        logging.getLogger("runpod").info("sdk chatter")
    finally:
        sys.stderr = old
        logging.getLogger().handlers.clear()
    lines = [json.loads(line) for line in err.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["connection lost"]
    assert lines[0]["level"] == "warning" and lines[0]["logger"] == "asyncssh"


def test_a_daemon_with_runpod_and_ssh_targets_logs_only_json_and_no_remote_script(make_daemon, short_tmp) -> None:
    from tests.conftest import FAST_CONFIG
    from tests.sshd import running_sshd

    for server in running_sshd():
        f = server.target_fields()
        config = FAST_CONFIG + (
            '\n[targets.pods]\nkind = "runpod"\n'
            f'\n[targets.box]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
            f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
            f'workdir = "{short_tmp / "remote"}"\npython = "{sys.executable}"\n'
        )
        d = make_daemon(config)
        d.env.update(RUNPOD_API_BASE_URL="http://127.0.0.1:9", RUNPOD_API_KEY="not-a-key")
        d.start(log_level="info")
        rid = d.call("start", command=["sh", "-c", "echo hello"], target="box")["id"]
        d.wait_state(rid, "succeeded")
        # The pod target is reconciled in the background (a remote never holds up the socket).
        wait_for(lambda d=d: "pod_reconcile" in d.log_path.read_text(), 60, what="the pod target's reconcile")
        d.stop()
    text = d.log_path.read_text()
    assert "pod_reconcile" in text  # the pod target was looked at (its SDK imported)
    events = [json.loads(line) for line in text.splitlines()]  # every line is JSON, the libraries' too
    assert not [e for e in events if e.get("logger") == "asyncssh" and e.get("level") in ("info", "debug")]
    assert "setsid" not in text and "jobctl" not in text  # no remote script body


def test_a_bad_log_level_is_a_usage_error_not_a_traceback(short_tmp) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "daemon", "--log-level", "verbose", "--state-dir", str(short_tmp)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr and "log-level" in out.stderr
