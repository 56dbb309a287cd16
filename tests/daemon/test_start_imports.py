"""What a command and the daemon's start import (issue 34 items 25 and 26).

`obd train list` imports only what listing needs, and a daemon with a Runpod target answers its
socket while the Runpod SDK is still being imported (its import takes over a second). The
figures are in tests/bench/bench_client_imports.py; these check the imports themselves.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable

# What `obd train list --json` has no use for: the daemon's libraries, the other commands'
# modules (rendering, sweeps, following, run files, the web view), and standard modules the
# interpreter does not load by itself that cost several milliseconds each.
NOT_FOR_LIST = (
    "pydantic",
    "anyio",
    "structlog",
    "torch",
    "runpod",
    "asyncssh",
    "daemon.cli.render",
    "daemon.cli.sweeps",
    "daemon.cli.follow",
    "daemon.cli.view",
    "daemon.cli.runfile",
    "daemon.cli.parser",
    "daemon.cli.client",
    "argparse",
    "json",
    "socket",
    "trainer_plugin",
    "typing",
    "pathlib",
    "tomllib",
    "datetime",
    "shutil",
)


def test_obd_train_list_json_imports_only_what_listing_needs(daemon: DaemonProc, short_tmp: Path) -> None:
    rid = daemon.call("start", command=["true"])["id"]
    daemon.wait_state(rid, "succeeded")
    out = short_tmp / "modules.json"
    code = (
        "import sys; from daemon.cli.main import main; rc = main(['train', 'list', '--all', '--json']); "
        f"loaded = sorted(sys.modules); import json; json.dump(loaded, open({str(out)!r}, 'w')); sys.exit(rc)"
    )
    # The socket found as a user's is, with no OBD_SOCKET: STATE_DIR/obd.sock (here a link to the
    # test daemon's), the config file looked for and absent.
    state = short_tmp / "client-state"
    state.mkdir()
    (state / "obd.sock").symlink_to(daemon.socket)
    env = {k: v for k, v in daemon.env.items() if k != "OBD_SOCKET"}
    env.update(OBD_STATE_DIR=str(state), OBD_CONFIG=str(short_tmp / "no-config.toml"))
    done = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in json.loads(done.stdout)] == [rid]
    # Interpreter start-up may load some of these on its own (site, an editable install's
    # finder): only what the command added counts.
    bare = subprocess.run(
        [PY, "-c", "import sys; loaded = sorted(sys.modules); import json; print(json.dumps(loaded))"],
        env=daemon.env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    before = set(json.loads(bare.stdout))
    added = set(json.loads(out.read_text())) - before
    loaded = sorted(m for m in added if any(m == name or m.startswith(name + ".") for name in NOT_FOR_LIST))
    assert loaded == [], f"obd train list --json imported {loaded}"


def test_every_train_action_gets_the_same_parse_from_its_own_parser_as_from_the_whole_one() -> None:
    from daemon.cli.parser import TRAIN_ACTIONS, _parser, command_parser, command_path

    whole = _parser()
    lines = [
        ["train", "list", "--all", "--state", "running", "--json"],
        ["--socket", "/tmp/x.sock", "train", "stop", "sft", "--reason", "deadline", "--wait"],
        ["--config=/tmp/c.toml", "train", "start", "--gpus", "2", "--retry", "1", "--", "python", "t.py"],
        ["train", "sweep", "--grid", "lr=1,2", "--name", "s"],
        ["train", "resume", "sft", "--checkpoint", "latest", "--time-limit", "3m"],
        ["train", "logs", "sft", "-f", "--tail", "3"],
        ["train", "plot", "a", "b", "--metric", "loss"],
        ["train", "exec", "-t", "sft"],
        ["targets", "check", "gpu1", "--json"],
        ["ui", "--port", "0"],
        ["daemon", "--log-level", "debug"],
        ["completion", "bash"],
    ]
    for argv in lines:
        path = command_path(argv)
        assert path, argv
        own = _parser(path)
        assert vars(own.parse_known_args(argv)[0]) == vars(whole.parse_known_args(argv)[0]), argv
    # Each action's help is the whole parser's, word for word (one that names no command: the whole).
    for action in TRAIN_ACTIONS:
        own = command_parser(_parser(("train", action)), ["train", action])
        assert own.format_help() == command_parser(whole, ["train", action]).format_help(), action
    assert command_path(["--help"]) == () and command_path(["train", "--help"]) == ("train",)
    assert command_path(["trian", "list"]) == ()


def test_the_list_json_shortcut_takes_only_command_lines_the_parser_reads_the_same() -> None:
    """`obd train list --json` is answered without the parser (daemon/cli/main.py's list_json_request):
    every command line it takes means, to the whole parser, the same list with the same socket
    options, and each of the others is left to the parser."""
    import itertools

    from daemon.cli.main import list_json_request
    from daemon.cli.parser import _parser

    whole = _parser()
    globals_ = [[], ["--socket", "/s"], ["--socket=/s"], ["--config", "c.toml", "--state-dir", "d"], ["--socket"]]
    tails = [
        ["--json"],
        ["--all", "--json"],
        ["--json", "--all"],
        ["--all"],
        [],
        ["--json", "--json"],
        ["--json", "--limit", "2"],
        ["--json", "-w"],
        ["--json", "--al"],
        ["--json", "x"],
    ]
    taken: list[list[str]] = []
    for head, heads2, tail in itertools.product(globals_, (["train", "list"], ["train", "status"], ["list"]), tails):
        argv = [*head, *heads2, *tail]
        found = list_json_request(argv)
        if found is None:
            continue  # left to the parser, whatever it makes of it
        args, unknown = whole.parse_known_args(argv)  # a shortcut taken: the parser reads it too
        assert not unknown and args.cmd == "train" and args.action == "list" and args.json, argv
        assert not (args.state or args.target or args.name or args.since or args.limit or args.watch), argv
        assert args.sweep is None, argv
        given, line = found
        assert json.loads(line) == {"op": "list", "all": args.all}, argv
        assert given.get("--socket") == args.socket and given.get("--config") == args.config, argv
        assert given.get("--state-dir") == args.state_dir, argv
        taken.append(argv)
    # The usual forms are taken: 4 ways to give the socket options, 3 orders of the flags.
    assert len(taken) == 12, taken


def test_a_runpod_target_is_set_up_without_importing_the_sdk_or_asyncssh(short_tmp: Path) -> None:
    """What the daemon imports for a Runpod target before its socket answers: the driver and its
    supervision, but neither the SDK (over a second) nor asyncssh (a quarter of one)."""
    code = f"""
import sys
from pathlib import Path
from executors.config import RunpodTarget
from executors.factory import make_pod_driver
import daemon.service.daemon, daemon.service.handlers, daemon.service.server, daemon.service.pods
target = RunpodTarget(kind="runpod", workdir="/workspace/obd")
make_pod_driver("pods", target, Path({str(short_tmp)!r}))
print(",".join(m for m in ("runpod", "asyncssh") if m in sys.modules))
"""
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO, env={**os.environ})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


FAKE_SDK = '''
"""A runpod SDK whose import does not finish until the test says so (the real one takes over a second)."""
import os

open(os.environ["FAKE_SDK_STARTED"], "w").close()
with open(os.environ["FAKE_SDK_GATE"]) as gate:  # a FIFO: blocks until the test writes to it
    gate.read()
api_key = None


def get_pods():
    return []
'''


def test_a_daemon_with_a_runpod_target_answers_while_the_runpod_sdk_is_still_being_imported(
    make_daemon, short_tmp: Path
) -> None:
    sdk = short_tmp / "fake-sdk" / "runpod"
    sdk.mkdir(parents=True)
    (sdk / "__init__.py").write_text(FAKE_SDK)
    started, gate = short_tmp / "sdk-started", short_tmp / "sdk-gate"
    os.mkfifo(gate)
    d = make_daemon(
        FAST_CONFIG + f'\n[targets.pods]\nkind = "runpod"\nworkdir = "{short_tmp}/pod"\napi_poll_interval = 0.2\n'
    )
    d.env.update(
        PYTHONPATH=f"{sdk.parent}{os.pathsep}{d.env['PYTHONPATH']}",
        RUNPOD_API_KEY="test-key",
        FAKE_SDK_STARTED=str(started),
        FAKE_SDK_GATE=str(gate),
    )
    try:
        d.start()  # the socket answers (within the fixture's wait)...
        wait_for(started.exists, 30, 0.05, "the daemon to begin importing the runpod SDK (its pods' reconcile)")
        # ...and goes on answering while the SDK's import is held.
        assert d.call("ping")["runs"] == 0
        assert [t["name"] for t in d.call("targets")] == ["local", "pods"]
    finally:
        _open_gate(gate)


def _open_gate(gate: Path) -> None:
    """Let the fake SDK's import finish (if it began), so the daemon ends as usual."""
    try:
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # no reader: the import never began
        return
    os.write(fd, b"go\n")
    os.close(fd)


def test_a_list_asked_again_shows_every_change_made_since(daemon: DaemonProc) -> None:
    """The daemon keeps its last `list` answers (sent as they were while no run changed): a run
    started, one that changed state, and another caller's question each get a fresh answer."""

    def states() -> dict[str, str]:
        return {r["id"]: r["state"] for r in daemon.call("list", all=True)}

    first = daemon.call("start", command=["sleep", "600"])["id"]
    daemon.wait_state(first, "running")
    assert states() == states() == {first: "running"}
    second = daemon.call("start", command=["true"])["id"]
    assert second in states()
    daemon.wait_state(second, "succeeded")
    assert states()[second] == "succeeded"
    daemon.call("cancel", id=first)
    daemon.wait_state(first, "cancelled")
    assert states() == {first: "cancelled", second: "succeeded"}
    assert [r["id"] for r in daemon.call("list", all=True, states=["succeeded"])] == [second]
    assert [r["id"] for r in daemon.call("list", all=True, limit=1)] == [second]
