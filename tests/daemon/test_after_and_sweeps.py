"""Runs that wait for runs (`--after`) and sweeps (`obd train sweep`), issue 26 items 3 and 4:
the rules as tables (daemon/service/after.py, daemon/service/sweeps.py), then real daemons and jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.service.after import ChainEnd, Verdict, cycle, decide, env_name, parse_after, waited_for
from daemon.service.api import ApiError, GridAxis
from daemon.service.models import DependenciesPart, Dependency, RunRecord, RunState, SweepTag
from daemon.service.sweeps import STOPPED_QUEUED, combinations, fold_best, gate, substitute, sweep_env
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for

PY = sys.executable
PLUGIN_JOB = str(REPO / "tests" / "daemon" / "fake_plugin_job.py")
CHAIN_JOB = str(REPO / "tests" / "daemon" / "fake_chain_job.py")
TWO_GPUS = FAST_CONFIG + '\n[retry]\nbackoff = "0.5s"\n\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'


# --- the rules, as tables -------------------------------------------------------------------------


def dep(run: str = "a", states: tuple[str, ...] = ("succeeded", "stopped"), name: str | None = None) -> Dependency:
    return Dependency(run=run, given=run, name=name, states=list(states))


def end(state: str, over: bool = True, latest: str = "a", message: str = "") -> ChainEnd:
    return ChainEnd(f"run {latest}", latest, state, over, message)


@pytest.mark.parametrize(
    ("waits", "after_any", "action", "said"),
    [
        # still running, queued, or between two attempts of a retry: wait, naming it
        ([(dep(), end("running", over=False))], False, "wait", "waiting for run a (running)"),
        ([(dep(), end("queued", over=False))], False, "wait", "waiting for run a (queued)"),
        ([(dep(), end("failed", over=False))], False, "wait", "another attempt is to come"),
        # ended as asked: start
        ([(dep(), end("succeeded"))], False, "start", "run a ended succeeded"),
        ([(dep(), end("stopped"))], False, "start", "run a ended stopped"),
        ([(dep(states=("failed",)), end("failed"))], False, "start", "run a ended failed"),
        # ended otherwise: cancelled at once, saying which and why, even while another still runs
        (
            [(dep(), end("failed", message="exit 3"))],
            False,
            "cancel",
            "run a ended failed, not succeeded or stopped: exit 3",
        ),
        ([(dep(), end("cancelled"))], False, "cancel", "ended cancelled"),
        (
            [(dep("b"), end("running", over=False, latest="b")), (dep(), end("failed"))],
            False,
            "cancel",
            "run a ended failed",
        ),
        ([(dep(), None)], False, "cancel", "missing or unreadable"),
        # --after-any: wait for every end, then start whatever they were
        ([(dep(), end("failed"))], True, "start", "(--after-any): run a ended failed"),
        ([(dep("b"), end("running", over=False, latest="b")), (dep(), end("failed"))], True, "wait", "run b (running)"),
        # a later attempt of the chain named by its id
        ([(dep(), end("failed", latest="a2"))], False, "cancel", "(attempt a2) ended failed"),
    ],
)
def test_a_waiting_run_waits_starts_or_is_cancelled_by_the_ends_of_the_runs_it_waits_for(
    waits: list[tuple[Dependency, ChainEnd | None]], after_any: bool, action: str, said: str
) -> None:
    verdict = decide(waits, after_any)
    assert verdict.action == action and said in verdict.why, verdict


def test_a_cancelled_waiting_run_says_what_to_do_next() -> None:
    verdict = decide([(dep(), end("failed"))], False)
    assert verdict.why.startswith("cancelled while queued: run a ended failed") and "--after-any" in verdict.why


@pytest.mark.parametrize(
    ("text", "ref", "states"),
    [
        ("sft", "sft", ["succeeded", "stopped"]),
        ("sft:failed", "sft", ["failed"]),
        ("sft:succeeded,failed", "sft", ["succeeded", "failed"]),
        ("20250501-142233-4f2a9c:stopped", "20250501-142233-4f2a9c", ["stopped"]),
        ("a:b:cancelled", "a:b", ["cancelled"]),
    ],
)
def test_after_reads_a_run_and_the_states_it_may_end_in(text: str, ref: str, states: list[str]) -> None:
    assert parse_after(text) == (ref, states)


@pytest.mark.parametrize("text", ["sft:", "sft:running", "sft:suceeded", ":failed", ""])
def test_after_refuses_a_state_a_run_does_not_end_in_or_no_run(text: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_after(text)
    assert info.value.kind == "usage"


@pytest.mark.parametrize(
    ("own", "waits", "graph", "loop"),
    [
        ("new", ["a"], {"a": ["b"], "b": []}, None),  # a new run never closes a loop: nothing waits for it
        ("new", ["a", "b"], {"a": ["b"], "b": ["c"]}, None),  # a diamond is no loop
        ("x", ["a"], {"a": ["b"], "b": ["x"]}, ["x", "a", "b", "x"]),  # a record saying otherwise is found
        ("x", ["x"], {}, ["x", "x"]),  # waiting for itself
        ("x", ["a"], {"a": ["a"]}, None),  # a loop elsewhere is not this run's
    ],
)
def test_a_loop_of_waits_through_the_run_is_found(
    own: str, waits: list[str], graph: dict[str, list[str]], loop: list[str] | None
) -> None:
    assert cycle(own, waits, lambda chain: graph.get(chain, [])) == loop


@pytest.mark.parametrize(
    ("name", "var"), [("sft", "OBD_AFTER_SFT_OUTPUT"), ("pre-train.v2", "OBD_AFTER_PRE_TRAIN_V2_OUTPUT"), ("ü", None)]
)
def test_a_named_run_s_output_variable_is_its_name_sanitized(name: str, var: str | None) -> None:
    assert env_name(name) == var


def test_retries_and_resumes_of_a_waiting_run_are_told_the_same_outputs() -> None:
    first = RunRecord(id="b", dependencies=DependenciesPart(after=[dep()]))
    retry = RunRecord(id="b2", chain="b", attempt=2)
    resumed = RunRecord(id="c", resumed_from="b2")
    records = {r.id: r for r in (first, retry, resumed)}
    assert [d.run for d in waited_for(records, retry)] == ["a"]
    assert [d.run for d in waited_for(records, resumed)] == ["a"]
    assert waited_for(records, RunRecord(id="z")) == []


def test_a_grid_makes_every_combination_first_axis_slowest() -> None:
    grid = [GridAxis(name="lr", values=["1e-4", "2e-4"]), GridAxis(name="seed", values=["1", "2"])]
    assert combinations(grid) == [
        {"lr": "1e-4", "seed": "1"},
        {"lr": "1e-4", "seed": "2"},
        {"lr": "2e-4", "seed": "1"},
        {"lr": "2e-4", "seed": "2"},
    ]


@pytest.mark.parametrize(
    "grid",
    [
        [GridAxis(name="1lr", values=["1"])],  # not an identifier
        [GridAxis(name="lr", values=["1"]), GridAxis(name="LR", values=["2"])],  # the same variable
        [GridAxis(name="lr", values=["1", "1"])],  # a value twice
        [GridAxis(name="lr", values=[""])],  # an empty value
        [GridAxis(name=f"g{i}", values=[str(v) for v in range(10)]) for i in range(4)],  # 10,000 runs
    ],
)
def test_a_grid_that_cannot_be_a_sweep_is_refused(grid: list[GridAxis]) -> None:
    with pytest.raises(ApiError) as info:
        combinations(grid)
    assert info.value.kind == "usage"


def test_values_go_where_their_names_are_and_other_braces_stay() -> None:
    command = ["python", "t.py", "--lr={lr}", "{seed}", "{other}", "sh -c 'echo {}'"]
    assert substitute(command, {"lr": "1e-4", "seed": "7"}) == [
        "python",
        "t.py",
        "--lr=1e-4",
        "7",
        "{other}",
        "sh -c 'echo {}'",
    ]


def test_a_member_s_environment_has_its_values_upper_case() -> None:
    record = RunRecord(id="r", sweep=SweepTag(id="sweep-1", name="s", index=2, size=4, values={"lr": "1e-4"}))
    assert sweep_env(record) == {"OBD_SWEEP_LR": "1e-4", "OBD_SWEEP_ID": "sweep-1", "OBD_SWEEP_INDEX": "2"}
    assert sweep_env(RunRecord(id="r")) == {}


@pytest.mark.parametrize(
    ("made", "created", "action"),
    [
        (4, 50.0, None),  # every member saved
        (2, 150.0, "wait"),  # being made by this daemon
        (2, 50.0, "cancel"),  # made by a daemon killed before the last member was saved
    ],
)
def test_a_member_leaves_the_queue_only_once_its_whole_sweep_is_saved(
    made: int, created: float, action: str | None
) -> None:
    record = RunRecord(id="r", created=created, sweep=SweepTag(id="sweep-1", name="s", index=1, size=4))
    verdict: Verdict | None = gate(record, made, started=100.0)
    assert (verdict.action if verdict else None) == action
    if action == "cancel":
        assert verdict is not None and "2 of its 4 runs saved" in verdict.why


def test_the_best_loss_is_the_lowest_finite_loss_logged() -> None:
    lines = [
        {"event": "begin", "max_steps": 10},
        {"event": "log", "step": 1, "loss": 2.0},
        {"event": "log", "step": 2, "loss": 0.5},
        {"event": "log", "step": 3, "loss": None},
        {"event": "log", "step": 4, "loss": True},
        {"event": "log", "step": 5},
        {"event": "log", "step": 6, "loss": 0.7},
    ]
    data = "\n".join(json.dumps(x) for x in lines).encode() + b"\nnot json\n" + b'{"event": "log", "loss": "0.1"}'
    assert fold_best(data, (None, None)) == (0.5, 2)
    assert fold_best(b'{"event": "log", "step": 9, "loss": 0.25}', (0.5, 2)) == (0.25, 9)


# --- with a daemon: --after -----------------------------------------------------------------------


@pytest.fixture
def box(make_daemon) -> DaemonProc:
    d = make_daemon(TWO_GPUS)
    d.start()
    return d


def start(d: DaemonProc, *args: str, action: str = "start") -> str:
    out = d.cli("train", action, *args)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def gated_job(gate_file: Path, code: int = 0) -> tuple[str, ...]:
    """A job that runs until `gate_file` exists, writes a file into its output/, then exits `code`."""
    script = f'while [ ! -e "{gate_file}" ]; do sleep 0.05; done; mkdir -p "$OBD_OUTPUT_DIR"; echo made-by-$OBD_RUN_ID > "$OBD_OUTPUT_DIR/model.txt"; exit {code}'
    return ("--", "sh", "-c", script)


def ledger_job(ledger: Path) -> tuple[str, ...]:
    return ("--", "sh", "-c", f'echo "$OBD_RUN_ID" >> "{ledger}"')


def test_a_run_after_another_waits_queued_and_starts_only_once_that_one_succeeded(
    box: DaemonProc, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    first = start(box, "--gpus", "0", "--name", "prep", *gated_job(tmp_path / "go"))
    box.wait_state(first, "running")
    waiting = start(box, "--gpus", "0", "--after", "prep", *ledger_job(ledger))
    record = wait_for(lambda: (r := box.record(waiting)) and "(running)" in r["message"] and r, 10, 0.1, "its message")
    assert record["state"] == "queued" and record["message"] == "waiting for run prep (running)"
    assert record["dependencies"]["after"] == [
        {"run": first, "given": "prep", "name": "prep", "states": ["succeeded", "stopped"]}
    ]
    assert "waiting for run prep" in box.cli("train", "status", waiting).stdout
    assert "waiting for run prep" in box.cli("train", "list").stdout
    # Another run, started after it and waiting for nothing, is not held up behind it.
    free = start(box, "--gpus", "0", *ledger_job(ledger))
    box.wait_state(free, "succeeded")
    assert box.record(waiting)["state"] == "queued"
    (tmp_path / "go").touch()
    box.wait_state(first, "succeeded")
    done = box.wait_state(waiting, "succeeded", timeout=20)
    assert ledger.read_text().split() == [free, waiting]
    assert any("its wait is over: run prep ended succeeded" in h["reason"] for h in done["history"])
    started = next(h["time"] for h in done["history"] if h["state"] == "running")
    ended = next(h["time"] for h in box.record(first)["history"] if h["state"] == "succeeded")
    assert started >= ended


def test_a_run_after_one_that_failed_is_cancelled_saying_which_and_why(box: DaemonProc, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    first = start(box, "--gpus", "0", "--name", "prep", *gated_job(tmp_path / "go", code=3))
    waiting = start(box, "--gpus", "0", "--after", first, *ledger_job(ledger))
    (tmp_path / "go").touch()
    box.wait_state(first, "failed")
    record = box.wait_state(waiting, "cancelled", timeout=20)
    assert record["message"].startswith("cancelled while queued: run prep ended failed, not succeeded or stopped")
    assert "exit 3" in record["message"] and "--after-any" in record["message"]
    assert record["job"] is None and not ledger.exists()
    out = box.cli("train", "logs", waiting, "--follow")
    assert out.returncode == 3  # a script that chains on it sees a cancelled run


def test_a_run_after_any_starts_whatever_the_end_and_a_run_may_wait_for_a_failure(
    box: DaemonProc, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger"
    first = start(box, "--gpus", "0", *gated_job(tmp_path / "go", code=3))
    anyway = start(box, "--gpus", "0", "--after", first, "--after-any", *ledger_job(ledger))
    on_failure = start(box, "--gpus", "0", "--after", f"{first}:failed", *ledger_job(ledger))
    on_success = start(box, "--gpus", "0", "--after", f"{first}:succeeded", *ledger_job(ledger))
    (tmp_path / "go").touch()
    box.wait_state(anyway, "succeeded", timeout=20)
    box.wait_state(on_failure, "succeeded", timeout=20)
    assert box.wait_state(on_success, "cancelled", timeout=20)["message"].startswith("cancelled while queued")
    assert sorted(ledger.read_text().split()) == sorted([anyway, on_failure])
    assert any("(--after-any)" in h["reason"] for h in box.record(anyway)["history"])


def test_a_run_waits_through_the_retries_of_the_run_it_waits_for(box: DaemonProc, tmp_path: Path) -> None:
    ledger, chain = tmp_path / "ledger", tmp_path / "chain"
    first = start(box, "--gpus", "0", "--retry", "1", "--", PY, CHAIN_JOB, str(chain), "sleep=0.5,exit=3", "exit=0")
    waiting = start(box, "--gpus", "0", "--after", first, *ledger_job(ledger))
    second = wait_for(lambda: box.record(first)["retried_by"], 20, 0.1, "the retry")
    assert box.record(waiting)["state"] == "queued"  # the first attempt's failure did not end its chain
    box.wait_state(second, "succeeded", timeout=20)
    box.wait_state(waiting, "succeeded", timeout=20)
    assert any(f"run {first}" in h["reason"] and "succeeded" in h["reason"] for h in box.record(waiting)["history"])


def test_a_wait_that_could_be_a_loop_is_refused_saying_so(box: DaemonProc) -> None:
    prev = start(box, "--gpus", "0", "--name", "sft", "--", "true")
    out = box.cli("train", "start", "--name", "sft", "--after", "sft", "--", "true")
    assert out.returncode == 2 and "would wait for itself" in out.stderr and "by its id" in out.stderr
    out = box.cli("train", "start", "--after", prev, "--after", "sft:failed", "--", "true")
    assert out.returncode == 2 and "name the same run" in out.stderr
    out = box.cli("train", "start", "--after", "nosuch", "--", "true")
    assert out.returncode == 1 and "--after nosuch: no run" in out.stderr
    out = box.cli("train", "start", "--after", "sft:running", "--", "true")
    assert out.returncode == 2 and "not a state a run ends in" in out.stderr
    # `last` is read once, at start: the run before this one, never this one.
    chained = start(box, "--gpus", "0", "--after", "last", "--", "true")
    assert box.record(chained)["dependencies"]["after"][0]["run"] == prev
    box.wait_state(chained, "succeeded", timeout=20)


def test_the_job_is_told_where_the_outputs_of_the_runs_it_waited_for_are(box: DaemonProc, tmp_path: Path) -> None:
    first = start(box, "--gpus", "0", "--name", "pre-train", *gated_job(tmp_path / "go"))
    other = start(box, "--gpus", "0", *gated_job(tmp_path / "go"))
    script = 'echo "1=$OBD_AFTER_1_OUTPUT 2=$OBD_AFTER_2_OUTPUT named=$OBD_AFTER_PRE_TRAIN_OUTPUT"; cat "$OBD_AFTER_1_OUTPUT/model.txt"'
    waiting = start(box, "--gpus", "0", "--after", "pre-train", "--after", other, "--", "sh", "-c", script)
    (tmp_path / "go").touch()
    done = box.wait_state(waiting, "succeeded", timeout=20)
    log = box.cli("train", "logs", waiting).stdout
    out1, out2 = (Path(box.record(r)["remote_dir"]) / "output" for r in (first, other))
    assert f"1={out1} 2={out2} named={out1}" in log
    assert f"made-by-{first}" in log
    assert done["dependencies"]["after"][0]["name"] == "pre-train"


def test_a_wait_survives_a_daemon_sigkill_and_so_does_an_end_seen_after_it(box: DaemonProc, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger"
    good = start(box, "--gpus", "0", *gated_job(tmp_path / "go"))
    bad = start(box, "--gpus", "0", *gated_job(tmp_path / "go-bad", code=4))
    after_good = start(box, "--gpus", "0", "--after", good, *ledger_job(ledger))
    after_bad = start(box, "--gpus", "0", "--after", bad, *ledger_job(ledger))
    for rid in (good, bad):
        box.wait_state(rid, "running")
    box.kill()
    box.start()
    for rid in (after_good, after_bad):
        assert box.record(rid)["state"] == "queued"
    box.kill()
    # Both end while no daemon runs: the next one finds their ends and decides from the records.
    (tmp_path / "go").touch()
    (tmp_path / "go-bad").touch()
    facts = [box.state_dir / "facts" / rid / "exit_code" for rid in (good, bad)]
    wait_for(lambda: all(f.exists() for f in facts), 20, 0.05, "both jobs to end")
    box.start()
    box.wait_state(good, "succeeded")
    box.wait_state(bad, "failed")
    box.wait_state(after_good, "succeeded", timeout=20)
    assert "run " + bad in box.wait_state(after_bad, "cancelled", timeout=20)["message"]
    box.kill()  # and the cancel is kept
    box.start()
    assert box.record(after_bad)["state"] == "cancelled"
    assert ledger.read_text().split() == [after_good]


# --- with a daemon: sweeps ------------------------------------------------------------------------


def running_at_once(records: list[dict[str, Any]]) -> int:
    """The most members whose jobs ran at the same time, from their histories."""
    spans = []
    for r in records:
        started = next(h["time"] for h in r["history"] if h["state"] == "running")
        ended = next(h["time"] for h in r["history"] if h["state"] in ("succeeded", "failed", "cancelled", "stopped"))
        spans.append((started, ended))
    return max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)


def test_a_sweep_queues_a_run_per_combination_and_runs_them_in_gpu_sized_batches(box: DaemonProc) -> None:
    script = 'echo "lr={lr} seed={seed} env=$OBD_SWEEP_LR/$OBD_SWEEP_SEED gpus=$CUDA_VISIBLE_DEVICES"; sleep 1'
    out = box.cli(
        "train",
        "sweep",
        "--name",
        "grid",
        "--gpus",
        "1",
        "--grid",
        "lr=1e-4,2e-4",
        "--grid",
        "seed=1,2",
        "--",
        "sh",
        "-c",
        script,
    )
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.strip()
    assert sweep.startswith("sweep-") and "4 runs queued" in out.stderr
    members = json.loads(box.cli("train", "list", "--sweep", sweep, "--json").stdout)
    assert [m["name"] for m in members] == ["grid-1", "grid-2", "grid-3", "grid-4"]
    assert [m["values"] for m in members] == [
        {"lr": "1e-4", "seed": "1"},
        {"lr": "1e-4", "seed": "2"},
        {"lr": "2e-4", "seed": "1"},
        {"lr": "2e-4", "seed": "2"},
    ]
    assert members[2]["command"][2].startswith('echo "lr=2e-4 seed=1 env=$OBD_SWEEP_LR')
    assert all(m["sweep"] == sweep for m in members)
    ends = [box.wait_state(m["id"], "succeeded", timeout=30) for m in members]
    assert all(len(r["gpus"]) == 1 for r in ends)
    assert running_at_once(ends) == 2  # two GPUs: two at a time, never more
    logs = [box.cli("train", "logs", m["id"]).stdout for m in members]
    assert f"lr=1e-4 seed=2 env=1e-4/2 gpus={ends[1]['gpus'][0]}" in logs[1]
    assert f"lr=2e-4 seed=2 env=2e-4/2 gpus={ends[3]['gpus'][0]}" in logs[3]
    text = box.cli("train", "status", "grid").stdout  # by its name, too
    assert text.splitlines()[0] == f"sweep {sweep} (grid): 4 runs: 4 succeeded"
    header = text.splitlines()[1].split()
    assert header == ["#", "ID", "NAME", "lr", "seed", "STATE", "STEP", "LOSS", "BEST", "MESSAGE"]


def test_a_sweep_refused_for_one_run_makes_none(box: DaemonProc) -> None:
    out = box.cli("train", "sweep", "--gpus", "3", "--grid", "lr=1,2", "--", "echo", "{lr}")
    assert out.returncode == 2 and "only 2 GPUs" in out.stderr
    out = box.cli("train", "sweep", "--grid", "lr=1,1", "--", "echo", "{lr}")
    assert out.returncode == 2 and "--grid lr: give each value once" in out.stderr
    out = box.cli("train", "sweep", "--grid", "lr", "--", "echo", "{lr}")
    assert out.returncode == 2 and "expected NAME=V1,V2" in out.stderr
    assert json.loads(box.cli("train", "list", "--all", "--json").stdout) == []


def test_a_sweep_s_table_stop_resume_and_cancel_act_on_every_member(box: DaemonProc) -> None:
    out = box.cli(
        "train",
        "sweep",
        "--gpus",
        "1",
        "--grid",
        "lr=1,2",
        "--grid",
        "seed=1,2",
        "--",
        PY,
        PLUGIN_JOB,
        "snapshot",
        "{lr}",
        "{seed}",
    )
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.strip()

    def members() -> list[dict[str, Any]]:
        return json.loads(box.cli("train", "list", "--sweep", sweep, "--json").stdout)

    wait_for(
        lambda: sum(m["state"] == "running" and (m["progress"]["step"] or 0) > 3 for m in members()) == 2,
        30,
        0.2,
        "two members training",
    )
    running = [m["id"] for m in members() if m["state"] == "running"]
    queued = [m["id"] for m in members() if m["state"] == "queued"]
    assert len(running) == 2 and len(queued) == 2
    rows = [line for line in box.cli("train", "list").stdout.splitlines()[1:] if line.strip()]
    assert len(rows) == 3  # one row for the two queued members, as squeue folds a job array
    folded = next(line for line in rows if line.startswith(sweep))
    assert f"2 members queued: obd train list --sweep {sweep}" in folded and " queued " in folded
    assert sorted(line.split()[0] for line in rows if line is not folded) == sorted(running)
    expanded = box.cli("train", "list", "--expand").stdout.splitlines()[1:]
    assert sorted(line.split()[0] for line in expanded if line.strip()) == sorted(running + queued)
    assert len(json.loads(box.cli("train", "list", "--json").stdout)) == 4  # scripts: each run
    table = box.cli("train", "status", sweep).stdout
    assert "2 queued, 2 running" in table.splitlines()[0]
    out = box.cli("train", "stop", sweep, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    after = {m["id"]: m for m in members()}
    for rid in running:  # each stopped at a step boundary with a verified snapshot
        record = box.record(rid)
        assert record["state"] == "stopped" and record["snapshot"]["reason"] == "requested"
        best = after[rid]["best_loss"]
        assert (
            best == pytest.approx(1.0 / after[rid]["best_step"])
            and after[rid]["best_step"] >= record["snapshot"]["step"] - 1
        )
    for rid in queued:  # taken out of the queue: nothing of the sweep starts after its stop
        assert box.record(rid)["message"] == STOPPED_QUEUED
        assert box.record(rid)["job"] is None
    lines = box.cli("train", "list", "--sweep", sweep).stdout.splitlines()
    assert "2 cancelled, 2 stopped" in lines[0] and any("stopped" in line and " @" in line for line in lines[2:])
    # resume: the stopped from their snapshots, the others from the start; all in the sweep again
    out = box.cli("train", "resume", "--json", sweep)
    assert out.returncode == 0, out.stderr
    resumed = json.loads(out.stdout)["runs"]
    assert len(resumed) == 4 and all(r["sweep"]["id"] == sweep for r in resumed)
    assert sorted(r["resumed_from"] or "-" for r in resumed) == sorted([*running, "-", "-"])
    wait_for(lambda: sum(m["state"] == "running" for m in members()) == 2, 30, 0.2, "two members running again")
    assert sorted(m["id"] for m in members()) == sorted(r["id"] for r in resumed)
    out = box.cli("train", "cancel", sweep, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert all(m["state"] == "cancelled" for m in members())
    assert RunState.cancelled.value in box.cli("train", "status", sweep).stdout
