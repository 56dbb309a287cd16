"""Curves that continue (issue 26 item 7; docs/trackers.md): every attempt of a chain, and every run
resumed from it, logs to one experiment-tracker run: one W&B run id, one MLflow run once a job
opened one, one TensorBoard directory; never in place of a value the user set.

The rules first (daemon/service/trackers.py, trainer_plugin/plugin/trackers.py), then real jobs under a real
daemon: a job that prints what it got, over a retry; and a user's Trainer script with
report_to=["wandb", "mlflow", "tensorboard"] (W&B offline, MLflow on a file store), stopped and
resumed twice.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from daemon.service.models import RunRecord, Trackers
from daemon.service.trackers import chain_tensorboard_dir, continued, learn, tracker_env, wandb_run_id
from executors.base import BeginLine
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from trainer_plugin.plugin.trackers import continue_in_args

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
NAMES = (
    "WANDB_RUN_ID",
    "WANDB_RESUME",
    "MLFLOW_RUN_ID",
    "TENSORBOARD_LOGGING_DIR",
    "OBD_TRACKER_DIR",
    "OBD_TRACKER_NAME",
)
# A job that prints the tracker variables it got, then fails (so --retry makes another attempt).
SHOW = (
    f"import json, os, sys; print('TRACKERS ' + json.dumps({{k: os.environ.get(k) for k in {NAMES!r}}})); sys.exit(3)"
)
WANDB_ID = re.compile(r"[a-z0-9_-]{1,64}")


# --- the rules -----------------------------------------------------------------------------------


def run(rid: str = "20261204-224628-a1b2c3", target: str = "local", **trackers: Any) -> RunRecord:
    record = RunRecord(id=rid, target=target)
    record.trackers = Trackers(root=trackers.pop("root", rid), target=trackers.pop("at", target), **trackers)
    return record


@pytest.mark.parametrize(
    "root", ["20261204-224628-a1b2c3", "A Run/With#Odd?Chars%:", "x" * 100, "20250101-000000-ABCDEF"]
)
def test_the_wandb_run_id_is_made_from_the_chain_s_first_attempt_and_is_valid_for_wandb(root: str) -> None:
    made = wandb_run_id(root)
    assert WANDB_ID.fullmatch(made), made
    assert made == wandb_run_id(root)  # the same for every attempt
    assert made != wandb_run_id(root + "x") or len(root) > 60


def test_a_new_run_is_its_own_root_and_a_retry_or_a_resume_continues_its_source_s() -> None:
    first = RunRecord(id="r1", target="gpu")
    first.trackers = continued(first, None)
    assert (first.trackers.root, first.trackers.target) == ("r1", "gpu")
    first.trackers.tensorboard_dir, first.trackers.mlflow_run_id = "/w/r1/output/runs/r1", "abc123"
    second = RunRecord(id="r2", target="gpu", chain="r1", attempt=2)
    second.trackers = continued(second, first)
    assert second.trackers == first.trackers and second.trackers is not first.trackers
    # A source made before obd kept tracker runs: rooted at its chain's first attempt.
    old = RunRecord(id="r9", chain="r7", target="gpu")
    assert continued(RunRecord(id="r10"), old) == Trackers(root="r7", target="gpu")


@pytest.mark.parametrize(
    ("user_set", "mlflow", "board", "expected"),
    [
        # Nothing set by the user: W&B continues by id, TensorBoard in one directory.
        (
            set(),
            None,
            "/w/r1/output/runs/r1",
            {
                "WANDB_RUN_ID": "obd-r1",
                "WANDB_RESUME": "allow",
                "TENSORBOARD_LOGGING_DIR": "/w/r1/output/runs/r1",
                "OBD_TRACKER_DIR": "/w/r1/output/runs/r1",
                "OBD_TRACKER_NAME": "obd-r1",
            },
        ),
        # An MLflow run an earlier attempt opened is handed on; none is made up before.
        (set(), "0123abcd", None, {"WANDB_RUN_ID": "obd-r1", "WANDB_RESUME": "allow", "MLFLOW_RUN_ID": "0123abcd"}),
        # The user's own values stay: their id (and how it resumes is theirs), their directory, their MLflow run.
        (
            {"WANDB_RUN_ID", "TENSORBOARD_LOGGING_DIR", "MLFLOW_RUN_ID"},
            "0123abcd",
            "/w/r1/output/runs/r1",
            {},
        ),
        ({"WANDB_RESUME"}, None, None, {"WANDB_RUN_ID": "obd-r1"}),
    ],
)
def test_each_attempt_gets_the_chain_s_tracker_variables_but_never_in_place_of_the_user_s(
    user_set: set[str], mlflow: str | None, board: str | None, expected: dict[str, str]
) -> None:
    record = run("r2", root="r1", mlflow_run_id=mlflow)
    env = tracker_env(record, user_set, board)
    env.pop("OBD_TRACKER_NAME") if "OBD_TRACKER_NAME" not in expected else None
    assert env == expected


def test_the_tensorboard_directory_is_the_first_attempt_s_and_only_where_later_attempts_can_write_it() -> None:
    first = run("r1")
    assert chain_tensorboard_dir(first, "/w/r1", shares_machine=True) == "/w/r1/output/runs/r1"
    later = run("r2", root="r1", tensorboard_dir="/w/r1/output/runs/r1")
    assert chain_tensorboard_dir(later, "/w/r2", shares_machine=True) == "/w/r1/output/runs/r1"
    # A pod per attempt, or a resume on another target: each attempt's own (the Trainer's default).
    assert chain_tensorboard_dir(run("p1"), "/w/p1", shares_machine=False) is None
    assert chain_tensorboard_dir(run("r3", root="r1", at="other"), "/w/r3", shares_machine=True) is None
    # A root whose directory was never fixed (a record from before): none is made up later.
    assert chain_tensorboard_dir(run("r4", root="r1"), "/w/r4", shares_machine=True) is None


def test_the_mlflow_run_a_job_opened_is_kept_once_and_only_if_it_looks_like_one() -> None:
    record = run("r1")
    assert learn(record, BeginLine(mlflow_run_id="../../etc")) is False
    assert learn(record, BeginLine()) is False
    assert learn(record, BeginLine(mlflow_run_id="9f1c2d3e4b5a69788796a5b4c3d2e1f0")) is True
    assert record.trackers is not None and record.trackers.mlflow_run_id == "9f1c2d3e4b5a69788796a5b4c3d2e1f0"
    assert learn(record, BeginLine(mlflow_run_id="another")) is False  # the first one seen stays


def test_the_plugin_sets_logging_dir_and_run_name_only_where_the_script_left_the_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OBD_TRACKER_DIR", "/w/r1/output/runs/r1")
    monkeypatch.setenv("OBD_TRACKER_NAME", "obd-r1")
    defaults = SimpleNamespace(logging_dir="mine/runs/Dec04_22-46-28_host", run_name=None)
    continue_in_args(defaults, "mine")
    assert (defaults.logging_dir, defaults.run_name) == ("/w/r1/output/runs/r1", "obd-r1")
    old_defaults = SimpleNamespace(logging_dir=None, run_name="mine")  # older transformers: run_name = output_dir
    continue_in_args(old_defaults, "mine")
    assert (old_defaults.logging_dir, old_defaults.run_name) == ("/w/r1/output/runs/r1", "obd-r1")
    chosen = SimpleNamespace(logging_dir="/data/tb/exp7", run_name="exp7")
    continue_in_args(chosen, "mine")
    assert (chosen.logging_dir, chosen.run_name) == ("/data/tb/exp7", "exp7")
    v5 = SimpleNamespace(run_name=None)  # transformers 5 has no logging_dir: TENSORBOARD_LOGGING_DIR serves
    continue_in_args(v5, "mine")
    assert not hasattr(v5, "logging_dir") and v5.run_name == "obd-r1"


# --- real jobs -----------------------------------------------------------------------------------


def shown(record: dict[str, Any]) -> dict[str, str | None]:
    text = (Path(record["remote_dir"]) / "job.log").read_text()
    line = next(x for x in text.splitlines() if x.startswith("TRACKERS "))
    return json.loads(line.removeprefix("TRACKERS "))


def test_every_attempt_of_a_retried_chain_gets_the_same_tracker_run_and_the_user_s_values_stay(
    make_daemon, short_tmp: Path
) -> None:
    d: DaemonProc = make_daemon(FAST_CONFIG + '\n[retry]\nbackoff = "0.2s"\n')
    d.start()
    out = d.cli("train", "start", "--cwd", str(short_tmp), "--retry", "1", "--", PY, "-c", SHOW)
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    first = d.wait_state(rid, "failed", timeout=60)
    second_id = wait_for(lambda: d.record(rid).get("retried_by"), timeout=30, what="the retry")
    second = d.wait_state(second_id, "failed", timeout=60)
    one, two = shown(first), shown(second)
    board = f"{first['remote_dir']}/output/runs/{rid}"
    assert (
        one
        == two
        == {
            "WANDB_RUN_ID": f"obd-{rid}",
            "WANDB_RESUME": "allow",
            "MLFLOW_RUN_ID": None,  # no job opened an MLflow run: none is made up
            "TENSORBOARD_LOGGING_DIR": board,
            "OBD_TRACKER_DIR": board,
            "OBD_TRACKER_NAME": f"obd-{rid}",
        }
    )
    assert second["trackers"]["root"] == rid

    # A user's own values: from --env, and from the caller's environment on a local target.
    env = {**d.env, "TENSORBOARD_LOGGING_DIR": "/tmp/my-board"}
    out = d.cli("train", "start", "--env", "WANDB_RUN_ID=my-run", "--", PY, "-c", SHOW, env=env)
    assert out.returncode == 0, out.stderr
    mine = shown(d.wait_state(out.stdout.strip(), "failed", timeout=60))
    assert mine["WANDB_RUN_ID"] == "my-run" and mine["WANDB_RESUME"] is None
    assert mine["TENSORBOARD_LOGGING_DIR"] == "/tmp/my-board" and mine["OBD_TRACKER_DIR"] is None


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return [event.step for event in acc.Scalars(tag)]


def stop_when_past(d: DaemonProc, rid: str, step: int) -> dict[str, Any]:
    wait_for(lambda: (d.record(rid)["progress"]["step"] or 0) >= step, timeout=120, what=f"{rid} past step {step}")
    out = d.cli("train", "stop", rid, "--wait")
    assert out.returncode == 0, out.stderr
    record = d.wait_state(rid, "stopped", "failed", "succeeded", "cancelled", timeout=120)
    assert record["state"] == "stopped", record["message"]
    return record


def test_a_trainer_reporting_to_wandb_mlflow_and_tensorboard_stopped_and_resumed_twice_keeps_one_run_each(
    make_daemon, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no MLflow server to start
    d: DaemonProc = make_daemon(FAST_CONFIG)
    d.start()
    wandb_dir, store = short_tmp / "wandb-home", short_tmp / "mlruns"
    wandb_dir.mkdir()
    env = {
        **d.env,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wandb_dir),
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": "obd-test",
        "WANDB_CONFIG_DIR": str(wandb_dir / "config"),
        "WANDB_CACHE_DIR": str(wandb_dir / "cache"),
        "MLFLOW_TRACKING_URI": f"file://{store}",
        "MLFLOW_ALLOW_FILE_STORE": "true",
    }
    # The same command every time (MLflow keeps the first attempt's parameters, and refuses changed ones).
    script = [PY, PLAIN, "--output_dir", "mine", "--report_to", "wandb,mlflow,tensorboard"]
    script += ["--step-sleep", "0.1", "--max_steps", "80"]
    out = d.cli("train", "start", "--cwd", str(short_tmp), "--", *script, env=env)
    assert out.returncode == 0, out.stderr
    rid = out.stdout.strip()
    records = [stop_when_past(d, rid, 3)]
    opened = records[0]["trackers"]["mlflow_run_id"]
    assert opened  # the daemon kept the MLflow run the first attempt's Trainer opened
    for last in (False, True):
        out = d.cli("train", "resume", records[-1]["id"], "--", *script, env=env)
        assert out.returncode == 0, out.stderr
        nid = out.stdout.strip()
        if last:
            final = d.wait_state(nid, "succeeded", "failed", "stopped", "cancelled", timeout=180)
            assert final["state"] == "succeeded", final["message"]
            records.append(final)
        else:
            records.append(stop_when_past(d, nid, records[-1]["snapshot"]["step"] + 3))
    assert records[-1]["progress"]["step"] == 80

    # Each attempt's job said which runs its Trainer logged to: the chain's, every time.
    for record in records:
        begin = json.loads((Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()[0])
        assert (begin["wandb_run_id"], begin["mlflow_run_id"]) == (f"obd-{rid}", opened)
        assert record["trackers"]["root"] == rid

    # One W&B run: every attempt's offline run directory carries the chain's id.
    runs = sorted(p.name for p in (wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 3 and all(name.endswith(f"-obd-{rid}") for name in runs), runs

    # One MLflow run, its loss logged at every step once.
    client = mlflow.tracking.MlflowClient(tracking_uri=f"file://{store}")
    found = [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert found == [opened]
    assert [m.step for m in client.get_metric_history(opened, "loss")] == list(range(1, 81))

    # One TensorBoard directory, in the first attempt's output/, whose steps go on where they stopped.
    board = Path(records[0]["remote_dir"]) / "output" / "runs" / rid
    assert len(list(board.glob("events.out.tfevents.*"))) == 3
    for record in records[1:]:
        assert not (Path(record["remote_dir"]) / "output" / "runs").exists()
    assert tensorboard_steps(board, "train/loss") == list(range(1, 81))
