"""Run files (issue 27, docs/run-file.md): `obd train start -f run.toml [--set K=V]... [FLAGS] [-- CMD]`,
`--dry-run`, and `obd train status RUN --as-file`, against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tomllib
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from daemon.cli import runfile
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
# Two GPUs to ask for by id, and a price where runs have cost budgets, so one can be set here.
PRICE = "price_per_gpu_hour = 2.0\n" if "max_cost_usd" in runfile.schema() else ""
CONFIG = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n' + PRICE
SECRET = {"RUNFILE_SECRET": "s3cret-value"}


@pytest.fixture
def box(make_daemon) -> DaemonProc:
    d = make_daemon(CONFIG)
    d.start()
    return d


def obd(
    d: DaemonProc, *args: str, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`obd ARGS...` as the daemon's user, run in `cwd` (a run file's relative paths are the shell's)."""
    return subprocess.run(
        [sys.executable, "-m", "daemon.cli", *args],
        env={**d.env, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def started(out: Any) -> str:
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def stopped_source(d: DaemonProc) -> tuple[str, int]:
    """A run that stopped with a snapshot, for `resume_from` and `after`: its id and its step."""
    rid = started(obd(d, "train", "start", "--gpus", "0", "--", sys.executable, FAKE, "snapshot"))
    wait_for(lambda: (d.record(rid)["progress"]["step"] or 0) >= 3 and d.record(rid)["snapshots"], 60, 0.1, "steps")
    out = obd(d, "train", "stop", rid, "--wait")
    assert out.returncode == 0, out.stderr
    return rid, d.record(rid)["snapshot"]["step"]


def every_key(source: str, step: int) -> dict[str, str]:
    """A TOML line for every key a run file may hold (but `command`: `script` and `args` stand for
    it here, and the printed run file has it). A key added to `obd train start` fails the test
    that uses this until it has a line here, and round-trips."""
    week = datetime.fromtimestamp(time.time() + 7 * 86400).replace(microsecond=0).isoformat()
    return {
        "script": json.dumps(FAKE),
        "args": '["snapshot"]',
        "target": '"local"',
        "name": '"every-key"',
        "cwd": '"."',  # the file's directory
        "env": '{ RUNFILE_A = "1" }',
        "secrets": '["RUNFILE_SECRET"]',
        "env_clear": "true",
        "output_to": '"out"',
        "resume_from": json.dumps(source),
        "checkpoint": str(step),
        "gpus": '["1"]',
        "priority": "7",
        "preemptible": "false",
        "retry": "2",
        "keep_checkpoints": "3",
        "time_limit": '"2h"',
        "deadline": json.dumps(week),
        "max_gpu_hours": "10",
        "max_cost_usd": "5",
        "after": f'["{source}"]',
        "after_any": "true",
        "profile": "true",
        "snapshot_on_sigterm": "true",
    }


# How each key shows in a record, where that is not a field of its own name (at the top of the
# record or in one of its parts, as `limits`).
RECORD_FIELD = {
    "command": "command",
    "script": "command",
    "args": "command",
    "env": "env_names",
    "secrets": "secret_names",
    "gpus": "gpus_wanted",
    "retry": "retries",
    "resume_from": "resumed_from",
    "checkpoint": "resume_checkpoint",
}


def as_started(record: dict[str, Any], key: str) -> Any:
    """What the record keeps of one key, in a form two equal starts share (a checkpoint by its
    name: a record names it so before the launch, by its path after)."""
    name = RECORD_FIELD.get(key, key)
    parts = [record, *(v for v in record.values() if isinstance(v, dict))]
    holder = next((p for p in parts if name in p), None)
    assert holder is not None, f"the record keeps nothing of the run file's key {key!r} (as {name!r})"
    value = holder[name]
    if key == "checkpoint":
        return str(value).rstrip("/").rsplit("/", 1)[-1]
    if key == "after":
        return [(dep["run"], sorted(dep["states"])) for dep in value]
    return value


def test_a_run_file_with_every_key_round_trips_through_status_as_file(box: DaemonProc, short_tmp: Path) -> None:
    source, step = stopped_source(box)
    keys = runfile.schema()
    lines = {k: v for k, v in every_key(source, step).items() if k in keys}
    assert sorted(set(keys) - set(lines) - {"command", "grid"}) == [], "keys of the run file this test does not set"
    project = short_tmp / "project"
    project.mkdir()
    (project / "run.toml").write_text("".join(f"{k} = {v}\n" for k, v in lines.items()))
    first = started(obd(box, "train", "start", "-f", str(project / "run.toml"), env=SECRET))

    printed = obd(box, "train", "status", first, "--as-file")
    assert printed.returncode == 0, printed.stderr
    assert "env values are not kept in run records" in printed.stdout and '# RUNFILE_A = "..."' in printed.stdout
    as_file = tomllib.loads(printed.stdout)
    assert as_file["command"] == ["python", FAKE, "snapshot"] and "env" not in as_file
    (project / "again.toml").write_text(printed.stdout)
    # The env values a record does not keep are given again, as its comment says.
    second = started(
        obd(box, "train", "start", "-f", str(project / "again.toml"), "--set", "env.RUNFILE_A=1", env=SECRET)
    )

    a, b = box.record(first), box.record(second)
    for key in [*(k for k in keys if k != "grid"), "script", "args"]:  # a grid is a sweep's (tested below)
        assert as_started(a, key) == as_started(b, key), key
    assert (a["cwd"], a["gpus_wanted"], a["priority"], a["retries"]) == (str(project), ["1"], 7, 2)
    assert (a["env_names"], a["secret_names"], a["resumed_from"]) == (["RUNFILE_A"], ["RUNFILE_SECRET"], source)
    assert a["preemption"]["preemptible"] is False and a["profile"] and a["snapshot_on_sigterm"] and a["env_clear"]
    assert a["output_to"] == "out" and a["name"] == "every-key"
    for rid in (first, second):
        obd(box, "train", "cancel", rid)


def test_a_run_file_by_command_round_trips_and_prints_only_what_was_given(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "plain.toml").write_text(
        '# a plain run\ncommand = "sh -c \'sleep 30\'"\nname = "plain"\n\n[env]\nMODE = "fast"\n'
    )
    rid = started(obd(box, "train", "start", "-f", str(short_tmp / "plain.toml")))
    printed = obd(box, "train", "status", rid, "--as-file").stdout
    values = tomllib.loads(printed)
    assert values == {
        "command": ["sh", "-c", "sleep 30"],
        "target": "local",
        "name": "plain",
        "retry": 0,
        "cwd": values["cwd"],
    }
    assert values["cwd"] == str(REPO)  # where `obd train start` ran (the tests' client runs in the repository)
    assert "fast" not in printed, "an env value is printed only when it is given, never from a record"
    obd(box, "train", "cancel", rid)


# --- errors: the file, the line and the key ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('command = ["true"]\n\ngpu = 2\n', "run.toml:3: gpu: unknown key (did you mean gpus?)"),
        ('command = ["true"]\noutput-to = "x"\n', "run.toml:2: output-to: unknown key (did you mean output_to?)"),
        ('command = ["true"]\n[envs]\nA = "1"\n', "run.toml:2: envs: unknown key (did you mean env?)"),
        (
            'command = ["true"]\nname = "x"\npriority = "high"\n',
            "run.toml:3: priority: expected a whole number, not 'high'",
        ),
        (
            'command = ["true"]\npriority = 500\n',
            "run.toml:2: priority: expected a whole number from -100 to 100, not 500",
        ),
        ('command = ["true"]\nprofile = "yes"\n', 'run.toml:2: profile: expected true or false, not "yes" (a string)'),
        ('command = ["true"]\nname = 3\n', "run.toml:2: name: expected a string, not 3 (a number)"),
        ('command = ["true"]\ngpus = true\n', "run.toml:2: gpus: expected a number of GPUs (2)"),
        (
            'command = ["true"]\n\n[env]\nA = "1"\nB = true\n',
            'run.toml:5: env.B: expected a string (quote it: B = "...")',
        ),
        ('command = ["true"]\nargs = ["--lr",\n  2e-4]\n', "run.toml:2: args[1]: expected a string (quote it)"),
        (
            'command = ["true"]\nsecrets = "HF_TOKEN"\n',
            'run.toml:2: secrets: expected a list of strings, e.g. secrets = ["..."]',
        ),
        (
            'name = """\nprofile = 1\n"""\nprofile = 1\ncommand = ["true"]\n',
            "run.toml:4: profile: expected true or false",
        ),
        ('command = ["true"]\nscript = "t.py"\n', "run.toml:2: script: give command or script, not both"),
        ('command = ["true"\n', "run.toml: not valid TOML: "),
    ],
)
def test_an_unknown_key_or_a_wrong_value_is_a_usage_error_naming_the_line_and_the_key(
    box: DaemonProc, short_tmp: Path, text: str, said: str
) -> None:
    (short_tmp / "run.toml").write_text(text)
    out = obd(box, "train", "start", "-f", "run.toml", cwd=short_tmp)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"obd: {said}"), out.stderr
    assert box.call("list", all=True) == [], "nothing was started"


def test_every_error_of_a_run_file_is_said_at_once_with_its_line_and_key(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text(
        'command = ["true"]\nscript = "t.py"\ngpu = 2\npriority = 500\nprofile = "yes"\n\n[env]\nA = "1"\nB = true\n'
    )
    out = obd(box, "train", "start", "-f", "run.toml", "--set", "retry=many", cwd=short_tmp)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0] == "obd: run.toml: 6 errors, each to fix:"
    assert [line.split(": ")[:2] for line in lines[1:]] == [
        ["  run.toml:3", "gpu"],
        ["  run.toml:4", "priority"],
        ["  run.toml:5", "profile"],
        ["  run.toml:9", "env.B"],
        ["  --set retry=many", "retry"],
        ["  run.toml:2", "script"],
    ]
    assert "did you mean gpus?" in lines[1] and "from -100 to 100, not 500" in lines[2]
    assert box.call("list", all=True) == [], "nothing was started"


def test_a_run_file_nested_50000_deep_is_refused_with_its_line_not_a_traceback(
    box: DaemonProc, short_tmp: Path
) -> None:
    deep = "[" * 50_000 + "]" * 50_000
    (short_tmp / "run.toml").write_text(f'command = ["true"]\n# [[[[ in a comment\nargs = {deep}\n')
    out = obd(box, "train", "start", "-f", "run.toml", cwd=short_tmp)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("obd: run.toml:3: arrays or tables nested more than 64 deep"), out.stderr
    tables = "x = " + "{a = " * 50_000 + "1" + "}" * 50_000
    (short_tmp / "tables.toml").write_text(f'command = ["true"]\n{tables}\n')
    out = obd(box, "train", "start", "-f", "tables.toml", cwd=short_tmp)
    assert out.returncode == 2 and out.stderr.startswith("obd: tables.toml:2: arrays or tables nested"), out.stderr
    out = obd(box, "train", "start", "--set", f"args={deep}", "--", "true")
    assert out.returncode == 2 and out.stderr.startswith("obd: --set args=...: arrays or tables nested"), out.stderr
    assert box.call("list", all=True) == [], "nothing was started"
    # Brackets in strings and comments are not nesting.
    brackets = "[" * 100
    (short_tmp / "fine.toml").write_text(
        f'command = ["echo", "{brackets}"]  # {brackets}\nname = """\n{brackets}\n"""\nargs = [\'{brackets}\']\n'
    )
    out = obd(box, "train", "start", "-f", "fine.toml", "--dry-run", cwd=short_tmp)
    assert out.returncode == 0, out.stderr


def test_a_wrong_set_is_named_as_it_was_given(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text('command = ["true"]\n')
    out = obd(box, "train", "start", "-f", "run.toml", "--set", "priority=high", cwd=short_tmp)
    assert out.returncode == 2 and out.stderr.startswith("obd: --set priority=high: priority: expected a whole number")
    out = obd(box, "train", "start", "-f", "run.toml", "--set", "gpu=2", cwd=short_tmp)
    assert out.returncode == 2 and "--set gpu=2: gpu: unknown key (did you mean gpus?)" in out.stderr


# --- what overrides what ---------------------------------------------------------------------------

FILE = """\
command = ["python", "from_file.py"]
name = "from-file"
priority = 1
gpus = 2
retry = 1
secrets = ["RUNFILE_SECRET"]

[env]
A = "file"
B = "file"
C = "file"
"""


def test_set_overrides_the_file_and_flags_override_both(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text(FILE)
    argv = [
        "train", "start", "-f", "run.toml",
        "--set", "priority=5", "--set", "env.B=set", "--set", "env.C=set", "--set", "retry=3", "--set", "name=from-set",
        "--priority", "9", "--name", "from-flag", "--env", "C=flag", "--gpus", "0,1",
    ]  # fmt: skip
    resolved = obd(box, *argv, "--dry-run", "--json", cwd=short_tmp, env=SECRET)
    assert resolved.returncode == 0, resolved.stderr
    assert json.loads(resolved.stdout) == {
        "command": ["python", "from_file.py"],
        "target": "local",
        "name": "from-flag",
        "env": {"A": "file", "B": "set", "C": "flag"},
        "secrets": ["RUNFILE_SECRET"],
        "gpus": "0,1",
        "priority": 9,
        "retry": 3,
    }
    # A command after -- replaces the file's; the run started is the one printed.
    rid = started(obd(box, *argv, "--", "sh", "-c", "sleep 30", cwd=short_tmp, env=SECRET))
    record = box.record(rid)
    assert (record["name"], record["priority"], record["retries"], record["gpus_wanted"]) == (
        "from-flag",
        9,
        3,
        ["0", "1"],
    )
    assert (record["command"], record["env_names"]) == (["sh", "-c", "sleep 30"], ["A", "B", "C"])
    assert record["cwd"] == str(short_tmp)
    obd(box, "train", "cancel", rid)


def test_a_relative_cwd_in_a_file_is_the_files_directory_and_on_the_command_line_the_shells(
    box: DaemonProc, short_tmp: Path
) -> None:
    (short_tmp / "sub").mkdir()
    (short_tmp / "sub" / "run.toml").write_text('command = ["true"]\ncwd = "."\n')
    from_file = json.loads(
        obd(box, "train", "start", "-f", "sub/run.toml", "--dry-run", "--json", cwd=short_tmp).stdout
    )
    assert from_file["cwd"] == str(short_tmp / "sub")
    flag = obd(box, "train", "start", "-f", "sub/run.toml", "--cwd", ".", "--dry-run", "--json", cwd=short_tmp)
    assert json.loads(flag.stdout)["cwd"] == str(short_tmp)


# --- --dry-run ----------------------------------------------------------------------------------------


def test_dry_run_prints_the_resolved_run_as_a_run_file_and_starts_nothing(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text('script = "train.py"\nargs = ["--lr", "2e-4"]\ngpus = ["1"]\n[env]\nX = "1"\n')
    out = obd(box, "train", "start", "-f", "run.toml", "--set", "preemptible=false", "--dry-run", cwd=short_tmp)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# the run `obd train start` would start (--dry-run: nothing was started)")
    assert tomllib.loads(out.stdout) == {
        "command": ["python", "train.py", "--lr", "2e-4"],
        "target": "local",
        "env": {"X": "1"},
        "gpus": ["1"],
        "preemptible": False,
    }
    # The printed run is a run file: started from, it is the same run.
    (short_tmp / "printed.toml").write_text(out.stdout)
    again = obd(box, "train", "start", "-f", "printed.toml", "--dry-run", cwd=short_tmp)
    assert tomllib.loads(again.stdout) == tomllib.loads(out.stdout)
    assert box.call("list", all=True) == []


def test_dry_run_needs_no_daemon(short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text('command = "python train.py"\n')
    env = {**os.environ, "OBD_SOCKET": str(short_tmp / "none.sock"), "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "daemon.cli", "train", "start", "-f", "run.toml", "--dry-run", "--json"],
        cwd=short_tmp, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"command": ["python", "train.py"], "target": "local"}


def test_a_dry_run_naming_a_secret_that_is_not_set_fails_as_the_start_would(box: DaemonProc, short_tmp: Path) -> None:
    (short_tmp / "run.toml").write_text('command = ["true"]\nsecrets = ["RUNFILE_NOT_SET_ANYWHERE"]\n')
    out = obd(box, "train", "start", "-f", "run.toml", "--dry-run", cwd=short_tmp)
    assert out.returncode == 2 and "$RUNFILE_NOT_SET_ANYWHERE is not set" in out.stderr


# --- the document ----------------------------------------------------------------------------------


def test_the_run_file_document_describes_every_key() -> None:
    doc = (REPO / "docs" / "run-file.md").read_text()
    missing = [key for key in runfile.schema() if f"| `{key}` |" not in doc]
    assert missing == [], f"keys docs/run-file.md's table does not describe: {missing}"


def test_key_lines_finds_keys_in_tables_dotted_and_quoted_and_skips_multiline_strings() -> None:
    text = 'a = 1\nb.c = 2\n"d e" = """\nf = 3\n"""\n[env]\nG = "x"\n[[list]]\nh = 1\n'
    assert runfile.key_lines(text) == {
        ("a",): 1,
        ("b", "c"): 2,
        ("d e",): 3,
        ("env",): 6,
        ("env", "G"): 7,
        ("list",): 8,
        ("list", "h"): 9,
    }


# --- sweeps in a run file -------------------------------------------------------------------------

SWEEP_FILE = """\
command = ["sh", "-c", "sleep 30", "--", "lr={lr}", "bs={bs}"]
name = "grid"
gpus = 1
priority = 3

[grid]
lr = ["1e-4", "2e-4"]
bs = [8, 16]
"""


def test_a_sweep_file_dry_runs_as_a_sweep_and_sets_and_grid_flags_go_over_its_grid(short_tmp: Path) -> None:
    (short_tmp / "sweep.toml").write_text(SWEEP_FILE)
    env = {**os.environ, "OBD_SOCKET": str(short_tmp / "none.sock"), "PYTHONPATH": str(REPO)}

    def obd_here(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "daemon.cli", *args],
            cwd=short_tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    out = obd_here("train", "sweep", "-f", "sweep.toml", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("# the sweep `obd train sweep` would start (--dry-run: nothing was started)")
    assert tomllib.loads(out.stdout)["grid"] == {"lr": ["1e-4", "2e-4"], "bs": ["8", "16"]}
    over = obd_here(
        "train", "sweep", "-f", "sweep.toml", "--set", "grid.bs=[32]", "--grid", "lr=3e-4", "--dry-run", "--json"
    )
    assert over.returncode == 0, over.stderr
    assert json.loads(over.stdout)["grid"] == {"lr": ["3e-4"], "bs": ["32"]}
    # A run file with a grid is a sweep: `start` refuses it, saying what to run.
    start = obd_here("train", "start", "-f", "sweep.toml", "--dry-run")
    assert start.returncode == 2 and "obd train sweep -f sweep.toml" in start.stderr
    # A wrong value in the grid is named by its line and key.
    (short_tmp / "bad.toml").write_text('command = ["true"]\n\n[grid]\nlr = ["1e-4", true]\n')
    bad = obd_here("train", "sweep", "-f", "bad.toml", "--dry-run")
    assert bad.returncode == 2 and "bad.toml:4: grid.lr[1]: expected a string or a number" in bad.stderr, bad.stderr
    none = obd_here("train", "sweep", "--", "true")
    assert none.returncode == 2 and "no grid" in none.stderr


def members(box: DaemonProc, sweep: str) -> list[dict[str, Any]]:
    """The first run of each member of a sweep, as its record."""
    return [box.record(m["runs"][0]) for m in box.call("status", id=sweep)["members"]]


def test_a_sweep_from_a_run_file_queues_its_runs_and_round_trips_through_status_as_file(
    box: DaemonProc, short_tmp: Path
) -> None:
    (short_tmp / "sweep.toml").write_text(SWEEP_FILE)
    sweep = started(obd(box, "train", "sweep", "-f", "sweep.toml", cwd=short_tmp))
    runs = members(box, sweep)
    assert sorted(tuple(r["command"][-2:]) for r in runs) == [
        ("lr=1e-4", "bs=16"), ("lr=1e-4", "bs=8"), ("lr=2e-4", "bs=16"), ("lr=2e-4", "bs=8"),
    ]  # fmt: skip
    assert {r["name"] for r in runs} == {"grid-1", "grid-2", "grid-3", "grid-4"}

    printed = obd(box, "train", "status", sweep, "--as-file", cwd=short_tmp)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith(f"# sweep {sweep}, as a run file: `obd train sweep -f FILE`")
    as_file = tomllib.loads(printed.stdout)
    wanted = tomllib.loads(SWEEP_FILE)
    assert as_file["command"] == wanted["command"] and as_file["name"] == "grid"
    assert as_file["grid"] == {"lr": ["1e-4", "2e-4"], "bs": ["8", "16"]}
    assert (as_file["gpus"], as_file["priority"]) == (1, 3)
    (short_tmp / "again.toml").write_text(printed.stdout)
    again = started(obd(box, "train", "sweep", "-f", "again.toml", cwd=short_tmp))
    twins = members(box, again)
    assert sorted(r["command"] for r in twins) == sorted(r["command"] for r in runs)
    assert {(r["priority"], r["gpus_wanted"]) for r in twins} == {(3, 1)}

    # The Python API takes the same grid, as a keyword or from the file.
    import obd as api

    with api.Client(socket=box.socket) as client:
        third = client.sweep(["sh", "-c", "sleep 30", "--", "{lr}"], grid={"lr": ["1e-4", 2e-4]}, gpus=1, name="api")
        assert len(third.run_ids) == 2 and third.name == "api"
        assert sorted(client.run(rid).status().record["command"][-1] for rid in third.run_ids) == ["0.0002", "1e-4"]
        with pytest.raises(api.BadRequest, match="a grid makes a sweep"):
            client.start(file=short_tmp / "sweep.toml")
    for ref in (sweep, again, third.id):
        assert obd(box, "train", "cancel", ref).returncode == 0
