"""What a new user hit in their first hour with obd (issue 23, "the first hour"), one test each."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, DaemonProc, wait_for

PY = sys.executable


def _closed_pipe_run(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[bytes]:
    """`obd ARGS` writing into a pipe whose reader has gone (as `| head -c 100` leaves it)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [PY, "-m", "daemon.cli", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=d.env,
            cwd=REPO,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)


def test_every_printing_command_exits_141_into_a_closed_pipe(daemon: DaemonProc) -> None:
    job = (
        "import json, os\n"
        "with open(os.environ['OBD_METRICS_FILE'], 'w') as f:\n"
        "    for i in range(1, 5000):\n"
        "        f.write(json.dumps({'event': 'log', 'step': i, 'loss': 1.0 / i}) + '\\n')\n"
        "print('\\n'.join(map(str, range(20000))))\n"
    )
    rid = daemon.call("start", command=[PY, "-c", job])["id"]
    daemon.wait_state(rid, "succeeded")
    for args in (
        ("train", "plot", rid, "--json"),
        ("train", "list", "--all", "--json"),
        ("train", "logs", rid),
        ("train", "status", rid, "--json"),
        ("completion", "bash"),
    ):
        out = _closed_pipe_run(daemon, *args)
        assert out.returncode == 141, (args, out.returncode, out.stderr)
        assert b"Broken pipe" not in out.stderr and b"Traceback" not in out.stderr, args


def test_a_read_offset_past_what_a_file_can_hold_is_a_bad_request(daemon: DaemonProc) -> None:
    rid = daemon.call("start", command=["sh", "-c", "echo hi"])["id"]
    daemon.wait_state(rid, "succeeded")
    with socket.socket(socket.AF_UNIX) as sock:  # a request the CLI never sends
        sock.connect(str(daemon.socket))
        sock.sendall(json.dumps({"op": "read", "id": rid, "file": "log", "offset": 2**63}).encode() + b"\n")
        answer = json.loads(sock.makefile("rb").readline())
    assert answer["ok"] is False and answer["kind"] == "usage", answer
    assert answer["error"].startswith("bad request: offset"), answer
    assert "OverflowError" not in daemon.log_path.read_text()


def test_a_configuration_error_names_its_key_as_the_file_spells_it(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        '[targets.local]\nkind = "local"\ngpus = "x"\n\n[targets.gpu1]\nkind = "ssh"\nhost = "h"\nworkdir = 5\n'
    )
    out = subprocess.run(
        [PY, "-m", "daemon.cli", "daemon", "--config", str(config), "--state-dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert any(line.startswith("  targets.local.gpus: ") for line in lines), out.stderr
    assert any(line.startswith("  targets.gpu1.workdir: ") for line in lines), out.stderr
    assert "local.local" not in out.stderr and "list[str]" not in out.stderr
    assert sum(line.startswith("  targets.local.gpus") for line in lines) == 1  # once, its complaints joined


def test_the_demo_waits_for_its_daemon_without_a_word(short_tmp: Path, capfd: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("obd_demo", REPO / "scripts" / "demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    d = DaemonProc(short_tmp)
    d.start(wait=False)  # still starting when the demo begins to wait
    try:
        os.environ["OBD_SOCKET"], before = str(d.socket), os.environ.get("OBD_SOCKET")
        try:
            assert d.proc is not None
            demo.wait_ready(d.proc)
        finally:
            if before is None:
                del os.environ["OBD_SOCKET"]
            else:
                os.environ["OBD_SOCKET"] = before
        out, err = capfd.readouterr()
        assert out == "" and err == "", (out, err)
        wait_for(d.ready, 5)
    finally:
        d.stop()
