"""Configuration: TOML, OBD_* variables and flags; unknown keys and bad durations are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.service.config import ConfigError, load_config, parse_duration
from tests.conftest import DaemonProc


@pytest.mark.parametrize(
    "text, seconds",
    [(90, 90.0), (1.5, 1.5), ("90s", 90.0), ("30m", 1800.0), ("2h", 7200.0), ("250ms", 0.25), (" 10 ", 10.0)],
)
def test_durations_are_seconds_or_strings_with_a_unit(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["soon", "10x", "-5", True, -1, "", "1h30"])
def test_a_bad_duration_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(bad)


def test_the_defaults_follow_the_contract(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("")
    config = load_config(path, state_dir=tmp_path, environ={})
    assert config.stop.proof_timeout == 1800 and config.stop.end_timeout == 600
    assert config.stop.request_poll == 30 and config.stop.cancel_grace == 10
    assert config.daemon.socket == tmp_path / "obd.sock"


def test_a_config_file_is_read_and_overridden_by_variables_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[daemon]\nstate_dir = "/srv/obd"\nsocket = "/srv/obd.sock"\n'
        '[stop]\nproof_timeout = "5m"\nend_timeout = 30\n'
        '[targets.gpu1]\nkind = "ssh"\nhost = "gpu1.example"\nuser = "me"\n'
    )
    config = load_config(path, environ={"OBD_END_TIMEOUT": "2m"})
    assert config.stop.proof_timeout == 300 and config.stop.end_timeout == 120
    assert config.daemon.state_dir == Path("/srv/obd") and config.daemon.socket == Path("/srv/obd.sock")
    assert config.target("gpu1").kind == "ssh" and config.target("local").kind == "local"
    flagged = load_config(
        path, state_dir=tmp_path / "s", socket=tmp_path / "x.sock", environ={"OBD_STATE_DIR": "/nope"}
    )
    assert flagged.daemon.state_dir == tmp_path / "s" and flagged.daemon.socket == tmp_path / "x.sock"


@pytest.mark.parametrize(
    "text, named",
    [
        ("[stop]\nproof_timout = 10\n", "stop.proof_timout: unknown key"),
        ('[stop]\nproof_timeout = "soon"\n', "stop.proof_timeout"),
        ("[deamon]\n", "deamon: unknown key"),
        ('[targets.x]\nkind = "ftp"\n', "targets.x"),
        ('[targets.x]\nkind = "ssh"\n', "targets.x.host"),
        ("[stop\n", "not valid TOML"),
    ],
)
def test_a_bad_config_is_refused_naming_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert named in str(info.value)


def test_the_daemon_refuses_to_start_on_a_bad_config_with_exit_2(short_tmp: Path) -> None:
    d = DaemonProc(short_tmp, '[stop]\ncancel_grace = "ten seconds"\n')
    out = d.cli("daemon", timeout=30)
    assert out.returncode == 2
    assert "stop.cancel_grace" in out.stderr and "bad duration" in out.stderr


def test_a_missing_explicit_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.toml", environ={})


def test_obd_daemon_takes_its_flags_after_the_subcommand(short_tmp: Path) -> None:
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, wait_for

    cfg = short_tmp / "my.toml"
    cfg.write_text("[stop]\ncancel_grace = 1\n")
    sock = short_tmp / "flag.sock"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OBD_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "daemon.cli",
            "daemon",
            "--config",
            str(cfg),
            "--state-dir",
            str(short_tmp / "st"),
            "--socket",
            str(sock),
        ],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(sock.exists, 20, what="the socket named by --socket")
        assert (short_tmp / "st" / "runs").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_a_client_given_the_daemons_state_dir_finds_its_socket(short_tmp: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO, wait_for

    state = short_tmp / "st"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OBD_")}
    (short_tmp / "empty.toml").write_text("")
    env.update(PYTHONPATH=str(REPO), OBD_CONFIG=str(short_tmp / "empty.toml"), XDG_RUNTIME_DIR=str(short_tmp / "xdg"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "daemon.cli", "daemon", "--state-dir", str(state)],
        cwd=REPO,
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for((state / "obd.sock").exists, 20, what="the daemon's socket in its state dir")
        cli = [sys.executable, "-m", "daemon.cli"]
        found = subprocess.run(
            [*cli, "--state-dir", str(state), "train", "list"], cwd=REPO, env=env, capture_output=True, text=True
        )
        assert found.returncode == 0, found.stderr
        by_env = subprocess.run(
            [*cli, "train", "list"], cwd=REPO, env={**env, "OBD_STATE_DIR": str(state)}, capture_output=True, text=True
        )
        assert by_env.returncode == 0, by_env.stderr
        made = subprocess.run(
            [*cli, "--state-dir", str(state), "train", "start", "--name", "in-this-daemon", "--", "true"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
        )
        assert made.returncode == 0, made.stderr
        lost = subprocess.run([*cli, "train", "list", "--all"], cwd=REPO, env=env, capture_output=True, text=True)
        # Not this daemon: none at the default socket (it says how to start one), or the machine's own.
        assert "in-this-daemon" not in lost.stdout
        assert lost.returncode == 0 or (lost.returncode == 69 and "obd daemon" in lost.stderr), lost.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


import pytest as _pytest


@_pytest.mark.parametrize(
    ("section", "key", "value", "words"),
    [
        ("daemon", "poll_interval", "0", "out of range"),
        ("daemon", "poll_interval", "nan", "bad duration"),
        ("daemon", "probe_timeout", "inf", "bad duration"),
        ("stop", "cancel_grace", "inf", "bad duration"),
        ("stop", "proof_timeout", "99999999999999999999h", "out of range"),
        ("stop", "request_poll", "0s", "out of range"),
    ],
)
def test_durations_out_of_their_range_are_refused_naming_the_key_and_the_range(
    tmp_path, section: str, key: str, value: str, words: str
) -> None:
    from daemon.service.config import ConfigError, load_config

    path = tmp_path / "config.toml"
    path.write_text(f'[{section}]\n{key} = "{value}"\n')
    with _pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    text = str(err.value)
    assert f"{section}.{key}" in text and words in text, text
    if words == "out of range":
        assert " to " in text  # the allowed range is said


def test_nonsense_settings_are_refused(tmp_path) -> None:
    from daemon.service.config import ConfigError, load_config

    for body, words in (
        ("[daemon]\nsocket_mode = 0o7777\n", "daemon.socket_mode"),
        ('[targets.local]\nkind = "ssh"\nhost = "h"\n', "this machine"),
        ('[daemon]\nlog_level = "verbose"\n', "daemon.log_level"),
        ('[targets.box]\nkind = "ssh"\nhost = "h"\nport = 70000\n', "targets.box.port"),
        ('[targets.pods]\nkind = "runpod"\nmax_hours = -1\n', "max_hours"),
    ):
        path = tmp_path / "c.toml"
        path.write_text(body)
        with _pytest.raises(ConfigError) as err:
            load_config(path, environ={})
        assert words in str(err.value), (body, str(err.value))


def test_a_config_that_is_not_utf8_is_an_error_not_a_traceback(tmp_path) -> None:
    import subprocess
    import sys

    path = tmp_path / "config.toml"
    path.write_bytes(b'[daemon]\nlog_level = "\xff\xfe"\n')
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "daemon", "--config", str(path), "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "not UTF-8" in out.stderr and "Traceback" not in out.stderr


def test_a_client_whose_config_is_broken_says_so(tmp_path) -> None:
    import os
    import subprocess
    import sys

    path = tmp_path / "config.toml"
    path.write_text("[daemon\nsocket = ")
    env = {k: v for k, v in os.environ.items() if k not in ("OBD_SOCKET", "OBD_STATE_DIR")}
    # --state-dir after the config: the client still reads the config first, and never reaches a
    # daemon of the machine's at the default socket.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "daemon.cli",
            "--config",
            str(path),
            "--state-dir",
            str(tmp_path / "s"),
            "train",
            "list",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert "cannot be read" in out.stderr and str(path) in out.stderr
