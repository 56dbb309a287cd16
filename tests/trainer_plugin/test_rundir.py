"""The run directory's contract (trainer_plugin/rundir.py): the proof rule, the probe's view of a
hostile run directory, the ways jobctl and the watchdog find rundir.py on a target, and proof that
the daemon and the plugin read and write the same files the same way.

The probe runs as targets run it, `python3 jobctl.py probe` beside a copy of rundir.py, on run
directories made of real links, FIFOs and devices.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.service.models import RunRecord, Snapshot
from daemon.service.stop import apply_probe, final_state, judge_proof
from executors.base import JobState, JobStatus, RunProbe
from tests.trainer_plugin.conftest import REPO
from trainer_plugin import rundir
from trainer_plugin.plugin import metrics_file, runtime
from trainer_plugin.rundir import InvalidProof, Proof, parse_proof
from trainer_plugin.tools import jobctl

PY = sys.executable
PLUGIN_SRC = REPO / "trainer_plugin"


def source(name: str) -> Path:
    """A file of the package by its bare name: the contract at its top, a tool in tools/."""
    return PLUGIN_SRC / name if name == "rundir.py" else PLUGIN_SRC / "tools" / name


def proof(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


# --- parse_proof: bytes in, a proof or why it is invalid out ---------------------------------------

VALID = [
    pytest.param(
        proof(checkpoint="output/checkpoint-5", step=5, time=1.5, reason="cost"),
        Proof("output/checkpoint-5", 5, "cost", 1.5),
        id="the-plugins-own-proof",
    ),
    pytest.param(
        proof(checkpoint="output/checkpoint-0", step=0),
        Proof("output/checkpoint-0", 0, "requested", None),
        id="step-zero-with-no-time-or-reason",
    ),
    pytest.param(
        proof(checkpoint="output/checkpoint-7", step=7, reason="banana"),
        Proof("output/checkpoint-7", 7, "requested", None),
        id="an-unknown-reason-is-requested",
    ),
    pytest.param(
        proof(checkpoint="output/checkpoint-7", step=7, reason=["cost"]),
        Proof("output/checkpoint-7", 7, "requested", None),
        id="a-reason-that-is-no-string-is-requested",
    ),
    pytest.param(
        b'{"checkpoint": "output/checkpoint-7", "step": 7, "time": NaN}',
        Proof("output/checkpoint-7", 7, "requested", None),
        id="a-time-that-is-not-finite-is-none",
    ),
    pytest.param(
        proof(checkpoint="output/checkpoint-7", step=7, time=True),
        Proof("output/checkpoint-7", 7, "requested", None),
        id="a-bool-time-is-none",
    ),
]


@pytest.mark.parametrize("data, expected", VALID)
def test_a_proof_of_exactly_output_checkpoint_of_its_own_step_is_valid(data: bytes, expected: Proof) -> None:
    assert parse_proof(data) == expected


INVALID = [
    pytest.param(
        proof(checkpoint="output/checkpoint-5/../../../etc", step=5), "other than output/checkpoint-5", id="traversal"
    ),
    pytest.param(
        proof(checkpoint="output/../output/checkpoint-5", step=5), "other than", id="traversal-back-to-the-same-place"
    ),
    pytest.param(proof(checkpoint="/etc/passwd", step=5), "other than", id="absolute-path"),
    pytest.param(
        proof(checkpoint="/tmp/run/output/checkpoint-5", step=5), "other than", id="absolute-path-to-the-right-place"
    ),
    pytest.param(proof(checkpoint="./output/checkpoint-5", step=5), "other than", id="dot-slash"),
    pytest.param(proof(checkpoint="output//checkpoint-5", step=5), "other than", id="double-slash"),
    pytest.param(proof(checkpoint="output/checkpoint-5/", step=5), "other than", id="trailing-slash"),
    pytest.param(proof(checkpoint="output/checkpoint-6", step=5), "other than", id="another-step"),
    pytest.param(proof(checkpoint="output/checkpoint-05", step=5), "other than", id="leading-zero"),
    pytest.param(proof(checkpoint="output/checkpoint-\u0665", step=5), "other than", id="a-non-ascii-digit"),
    pytest.param(proof(checkpoint={"path": "output/checkpoint-5"}, step=5), "other than", id="nested-json-checkpoint"),
    pytest.param(proof(step=5), "other than", id="no-checkpoint"),
    pytest.param(proof(checkpoint="output/checkpoint-1", step=True), "no valid step", id="bool-step"),
    pytest.param(proof(checkpoint="output/checkpoint-5", step="5"), "no valid step", id="string-step"),
    pytest.param(proof(checkpoint="output/checkpoint-5", step=5.0), "no valid step", id="float-step"),
    pytest.param(proof(checkpoint="output/checkpoint--1", step=-1), "no valid step", id="negative-step"),
    pytest.param(proof(checkpoint="output/checkpoint-5"), "no valid step", id="no-step"),
    pytest.param(
        b'{"checkpoint": "output/checkpoint-5", "step": ' + b"9" * 5000 + b"}",
        "not valid JSON",
        id="a-step-of-5000-digits",
    ),
    pytest.param(
        proof(checkpoint="output/checkpoint-5", step=5, pad="x" * rundir.PROOF_LIMIT), "larger than 64 KiB", id="huge"
    ),
    pytest.param(b'{"checkpoint": "output/checkpoint-5", "step": 5, "reason": "\xff"}', "not UTF-8", id="not-utf8"),
    pytest.param(b"[" * 60_000, "not valid JSON", id="nested-60000-deep"),
    pytest.param(b"", "not valid JSON", id="empty"),
    pytest.param(b"not json at all", "not valid JSON", id="not-json"),
    pytest.param(b'["output/checkpoint-5", 5]', "not a JSON object", id="an-array"),
    pytest.param(b"null", "not a JSON object", id="null"),
]


@pytest.mark.parametrize("data, why", INVALID)
def test_any_other_proof_is_invalid_and_says_why(data: bytes, why: str) -> None:
    result = parse_proof(data)
    assert isinstance(result, InvalidProof)
    assert why in result.why and rundir.SNAPSHOT_PROOF in result.why


def test_a_proof_of_exactly_64_kib_is_read_and_one_byte_more_is_not() -> None:
    head = proof(checkpoint="output/checkpoint-5", step=5, pad="")
    exact = head[:-2] + b"x" * (rundir.PROOF_LIMIT - len(head)) + b'"}'
    assert len(exact) == rundir.PROOF_LIMIT
    assert isinstance(parse_proof(exact), Proof)
    assert isinstance(parse_proof(exact[:-2] + b'x"}'), InvalidProof)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=300),
        st.dictionaries(
            st.sampled_from(["checkpoint", "step", "reason", "time"]),
            st.one_of(st.integers(-3, 10**6), st.text(max_size=40), st.booleans(), st.none(), st.floats()),
        ),
    )
)
def test_a_proof_never_names_a_path_outside_the_run(raw: bytes | dict[str, Any]) -> None:
    data = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    result = parse_proof(data)
    if isinstance(result, Proof):
        assert result.checkpoint == f"output/checkpoint-{result.step}" and result.step >= 0
        assert rundir.checkpoint_step(result.checkpoint.split("/", 1)[1]) == result.step
        assert result.reason in rundir.REASONS


# --- the probe of a hostile run directory, as targets run it --------------------------------------


@pytest.fixture
def tools(tmp_path: Path) -> Path:
    """jobctl.py, rundir.py and contain.py alone in a directory, as obd installs them on an SSH host."""
    directory = tmp_path / "tools"
    directory.mkdir()
    for name in ("jobctl.py", "rundir.py", "contain.py"):
        shutil.copy2(source(name), directory / name)
    return directory


def probe(tools: Path, run_dir: Path) -> RunProbe:
    """`python3 jobctl.py probe` beside rundir.py; a probe that blocked would fail the test at the timeout."""
    items = json.dumps([{"dir": str(run_dir), "handle": None}])
    out = subprocess.run(
        [PY, str(tools / "jobctl.py"), "probe"], input=items, capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    return RunProbe.model_validate(json.loads(out.stdout)[0])


def make_run(root: Path) -> Path:
    run = root / "run"
    (run / "output").mkdir(parents=True)
    (run / "exit_code").write_text("0\n")
    return run


def test_the_probe_lists_only_real_checkpoint_directories(tools: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "output" / "checkpoint-1").mkdir()
    (run / "inside").mkdir()
    os.symlink("/", run / "output" / "checkpoint-5")  # `ln -s / output/checkpoint-5`
    os.symlink("../inside", run / "output" / "checkpoint-6")  # a link to a directory inside the run
    os.symlink(str(tmp_path), run / "output" / "checkpoint-7")  # a link out of the run
    (run / "output" / "checkpoint-8").write_text("a file")
    os.mkfifo(run / "output" / "checkpoint-9")
    assert probe(tools, run).checkpoints == ["checkpoint-1"]


def test_no_checkpoint_counts_when_output_itself_is_a_link(tools: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "checkpoint-3").mkdir(parents=True)
    (run / "output").rmdir()
    os.symlink(elsewhere, run / "output")
    assert probe(tools, run).checkpoints == []


def linked_checkpoint_out(run: Path, root: Path) -> None:
    os.symlink("/", run / "output" / "checkpoint-5")


def linked_checkpoint_in(run: Path, root: Path) -> None:
    (run / "inside").mkdir()
    os.symlink("../inside", run / "output" / "checkpoint-5")


def linked_output(run: Path, root: Path) -> None:
    (root / "elsewhere" / "checkpoint-5").mkdir(parents=True)
    (run / "output").rmdir()
    os.symlink(root / "elsewhere", run / "output")


def missing_checkpoint(run: Path, root: Path) -> None:
    pass


@pytest.mark.parametrize("plant", [linked_checkpoint_out, linked_checkpoint_in, linked_output, missing_checkpoint])
def test_a_proof_naming_a_checkpoint_that_is_not_a_real_directory_is_invalid_and_no_path_of_it_is_used(
    tools: Path, tmp_path: Path, plant: Any
) -> None:
    run = make_run(tmp_path)
    plant(run, tmp_path)
    (run / "snapshot.json").write_bytes(proof(checkpoint="output/checkpoint-5", step=5, reason="requested"))
    seen = probe(tools, run)
    why = judge_proof(seen)
    assert isinstance(why, str) and "output/checkpoint-5" in why and "not a real directory" in why
    record = ended_run(seen)
    assert record.snapshot is None and record.stop.invalid_proof == why
    decision = final_state(record, seen.status, seen.checkpoints)
    assert decision.state.value == "failed" and "invalid snapshot proof" in decision.message
    assert not decision.snapshot_stands


def snapshot_fifo(run: Path, root: Path) -> None:
    os.mkfifo(run / "snapshot.json")


def snapshot_dir(run: Path, root: Path) -> None:
    (run / "snapshot.json").mkdir()


def snapshot_link_to_a_valid_proof(run: Path, root: Path) -> None:
    (run / "output" / "checkpoint-5").mkdir()
    (root / "proof.json").write_bytes(proof(checkpoint="output/checkpoint-5", step=5))
    os.symlink(root / "proof.json", run / "snapshot.json")


def snapshot_dev_zero(run: Path, root: Path) -> None:
    os.symlink("/dev/zero", run / "snapshot.json")


@pytest.mark.parametrize(
    "plant, kind",
    [
        (snapshot_fifo, "a FIFO"),
        (snapshot_dir, "a directory"),
        (snapshot_link_to_a_valid_proof, "a symbolic link"),
        (snapshot_dev_zero, "a symbolic link"),
    ],
)
def test_a_snapshot_json_that_is_not_a_regular_file_is_an_invalid_proof_saying_what_it_is(
    tools: Path, tmp_path: Path, plant: Any, kind: str
) -> None:
    run = make_run(tmp_path)
    plant(run, tmp_path)
    seen = probe(tools, run)
    assert seen.proof is None and seen.proof_not_regular == kind
    record = ended_run(seen)
    assert record.snapshot is None
    assert record.stop.invalid_proof == f"snapshot.json is {kind}, not a regular file"
    decision = final_state(record, seen.status, seen.checkpoints)
    assert decision.state.value == "failed" and kind in decision.message


def test_a_device_named_snapshot_json_is_never_read(tools: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path)
    try:
        os.mknod(run / "snapshot.json", 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero's numbers
    except PermissionError:
        pytest.skip("making a device needs CAP_MKNOD")
    seen = probe(tools, run)
    assert seen.proof is None and seen.proof_not_regular == "a character device"


def test_a_proof_that_is_not_utf8_arrives_at_the_daemon_as_an_invalid_proof(tools: Path, tmp_path: Path) -> None:
    run = make_run(tmp_path)
    (run / "output" / "checkpoint-5").mkdir()
    (run / "snapshot.json").write_bytes(b'{"checkpoint": "output/checkpoint-5", "step": 5, "reason": "\xff\xfe"}')
    why = judge_proof(probe(tools, run))
    assert isinstance(why, str) and "not valid JSON" in why


def ended_run(seen: RunProbe) -> RunRecord:
    record = RunRecord(id="r1", command=["x"], state="running", snapshots=True)
    record.stop.requested_at = 1.0
    apply_probe(record, seen, 2.0, StopTimes())
    return record


class StopTimes:
    proof_timeout = 1800.0
    end_timeout = 600.0


# --- how jobctl and the watchdog find rundir.py on a target -----------------------------------------


def test_the_watchdog_as_a_script_beside_jobctl_and_rundir_lists_the_outputs(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    for name in ("jobctl.py", "rundir.py", "contain.py", "watchdog.py"):
        shutil.copy2(source(name), plugin / name)
    run = make_run(tmp_path)
    out = subprocess.run(
        [PY, str(plugin / "watchdog.py"), "manifest", str(run)], capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stderr
    assert [f["path"] for f in json.loads(out.stdout)["files"]] == ["exit_code"]


def fed_on_stdin(run: Path, *names: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-", "manifest", str(run), *names],
        input=source("watchdog.py").read_text(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd="/",
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )


def test_the_watchdog_fed_on_stdin_uses_the_runs_own_copy_of_the_contract(tmp_path: Path) -> None:
    run = make_run(tmp_path / "workdir")
    package = run / "plugin" / "trainer_plugin"
    (package / "tools").mkdir(parents=True)
    shutil.copy2(source("rundir.py"), package / "rundir.py")
    for name in ("jobctl.py", "contain.py"):
        shutil.copy2(source(name), package / "tools" / name)
    (run / "job.log").write_text("hello\n")
    out = fed_on_stdin(run)
    assert out.returncode == 0, out.stderr
    assert sorted(f["path"] for f in json.loads(out.stdout)["files"]) == ["exit_code", "job.log"]


def test_the_watchdog_fed_on_stdin_uses_a_copy_laid_out_by_the_previous_release(tmp_path: Path) -> None:
    """A pod started before the tools had a folder of their own: its run's copy is flat in plugin/trainer_plugin/."""
    run = make_run(tmp_path / "workdir")
    package = run / "plugin" / "trainer_plugin"
    package.mkdir(parents=True)
    for name in ("jobctl.py", "rundir.py", "contain.py"):
        shutil.copy2(source(name), package / name)
    (run / "job.log").write_text("hello\n")
    out = fed_on_stdin(run)
    assert out.returncode == 0, out.stderr
    assert sorted(f["path"] for f in json.loads(out.stdout)["files"]) == ["exit_code", "job.log"]


def test_the_watchdog_fed_on_stdin_uses_the_tools_obd_installed_over_ssh(tmp_path: Path, tools: Path) -> None:
    workdir = tmp_path / "workdir"
    run = make_run(workdir)
    (workdir / ".obd").mkdir()
    tools.rename(workdir / ".obd" / "tools-0123456789ab")
    out = fed_on_stdin(run)
    assert out.returncode == 0, out.stderr
    assert [f["path"] for f in json.loads(out.stdout)["files"]] == ["exit_code"]


def test_the_watchdog_fed_on_stdin_with_no_contract_anywhere_says_so_and_lists_the_paths_it_is_given(
    tmp_path: Path,
) -> None:
    run = make_run(tmp_path / "workdir")
    out = fed_on_stdin(run)
    assert out.returncode == 2
    assert "cannot list the outputs" in out.stderr and "rundir.py" in out.stderr
    listed = fed_on_stdin(run, "exit_code", "job.log")  # the paths given: nothing else is needed
    assert listed.returncode == 0, listed.stderr
    assert [f["path"] for f in json.loads(listed.stdout)["files"]] == ["exit_code"]


# --- the daemon and the plugin agree ---------------------------------------------------------------


def plugin_env(run: Path) -> runtime.RunEnv:
    """The plugin's view of the run from the environment the daemon gives the job."""
    from daemon.service.launch import job_env

    record = RunRecord(id="r1", command=["x"])
    return runtime.RunEnv.from_environ(job_env(record, str(run)))


def test_the_files_the_daemon_points_the_job_at_are_the_ones_its_probe_reads(tmp_path: Path) -> None:
    run = tmp_path / "run"
    env = plugin_env(run)
    assert env.output_dir == str(run / rundir.OUTPUT)
    assert env.request_path == str(run / rundir.SNAPSHOT_REQUEST)
    assert env.proof_path == str(run / rundir.SNAPSHOT_PROOF)
    assert env.metrics_path == str(run / rundir.METRICS)
    # With only OBD_RUN_DIR set, the plugin finds the same files by itself.
    alone = runtime.RunEnv.from_environ({"OBD_RUN_DIR": str(run)})
    assert (alone.output_dir, alone.request_path, alone.proof_path, alone.metrics_path) == (
        env.output_dir,
        env.request_path,
        env.proof_path,
        env.metrics_path,
    )


def test_what_the_plugin_writes_is_what_the_daemons_probe_reads_and_a_valid_proof(tools: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    env = plugin_env(run)
    writer = metrics_file.MetricsWriter(env.metrics_path)
    writer.write("begin", max_steps=10, snapshots=True, version=runtime.VERSION)
    writer.write("log", step=3, loss=0.5)
    writer.close()
    runtime.write_request(env, "cost")
    os.makedirs(os.path.join(str(env.output_dir), "checkpoint-3"))
    written = runtime.write_proof(env, 3, "cost")
    seen = probe(tools, run)
    assert seen.begin is not None and seen.begin.snapshots is True and seen.last_log is not None
    assert seen.checkpoints == ["checkpoint-3"]
    snapshot = judge_proof(seen)
    assert snapshot == Snapshot(checkpoint=written["checkpoint"], step=3, reason="cost", time=written["time"])
    record = RunRecord(id="r1", command=["x"], state="running")
    apply_probe(record, seen, 100.0, StopTimes())
    assert record.snapshots and record.stop.reason == "cost" and record.snapshot == snapshot


@pytest.mark.parametrize("asked", [*rundir.REASONS, "banana", " disk \n", "DEADLINE"])
def test_the_request_obd_writes_is_the_reason_the_plugin_and_the_daemon_read(
    tools: Path, tmp_path: Path, asked: str
) -> None:
    run = make_run(tmp_path)
    (run / rundir.SNAPSHOT_REQUEST).write_bytes(rundir.request_bytes(asked))
    expected = rundir.normalise_reason(asked)
    assert runtime.read_request(str(run / rundir.SNAPSHOT_REQUEST)) == expected
    record = RunRecord(id="r1", command=["x"], state="running")
    apply_probe(record, probe(tools, run), 5.0, StopTimes())
    assert record.stop.reason == expected and record.stop.requested_at == 5.0


@pytest.mark.parametrize("content", [b"", b"  \n", b"cost", b"\xff\xfe", b"x" * 1000])
def test_a_hand_written_request_means_the_same_to_the_plugin_and_the_daemon(
    tools: Path, tmp_path: Path, content: bytes
) -> None:
    run = make_run(tmp_path)
    (run / rundir.SNAPSHOT_REQUEST).write_bytes(content)
    record = RunRecord(id="r1", command=["x"], state="running")
    apply_probe(record, probe(tools, run), 5.0, StopTimes())
    assert runtime.read_request(str(run / rundir.SNAPSHOT_REQUEST)) == record.stop.reason


def test_jobctl_keeps_the_file_helpers_it_is_known_for(tmp_path: Path) -> None:
    path = str(tmp_path / "f")
    jobctl.atomic_write(path, b"data")
    assert jobctl.read_regular(path, 10) == b"data" and jobctl.PROOF_LIMIT == rundir.PROOF_LIMIT


def test_a_run_id_is_a_plain_name_never_a_path() -> None:
    assert rundir.is_run_id("20260101-000000-abcdef") and rundir.is_run_id("a.b_c-d")
    for bad in ("", ".", "..", "../x", "a/b", "-x", ".hidden", "x\n", "a" * 65, "é", None, 5):
        assert not rundir.is_run_id(bad), bad


def test_a_finished_run_keeps_showing_a_snapshot_only_while_its_checkpoint_is_there() -> None:
    record = RunRecord(id="r1", command=["x"], state="running")
    record.snapshot = Snapshot(checkpoint="output/checkpoint-4", step=4)
    exited = JobStatus(state=JobState.exited, exit_code=0)
    assert final_state(record, exited, ["checkpoint-4"]).snapshot_stands
    assert not final_state(record, exited, ["checkpoint-40"]).snapshot_stands


# --- RunPaths and FactPaths: each file of the contract, at one path ---------------------------------

RUN = "/work/runs/r1"
RUN_FILES = [
    ("job_spec", "job.json"),
    ("job_log", "job.log"),
    ("job_pid", "job.pid"),
    ("exit_code", "exit_code"),
    ("cancelling", "cancelling"),
    ("cancelled", "cancelled"),
    ("output", "output"),
    ("request", "snapshot.request"),
    ("proof", "snapshot.json"),
    ("metrics", "metrics.jsonl"),
    ("profile", "profile"),
    ("plugin", "plugin"),
    ("sources", "src"),
    ("resume", "resume"),
    ("watchdog_config", "watchdog.json"),
    ("watchdog_log", "watchdog.log"),
    ("watchdog_lock", "watchdog.lock"),
    ("watchdog_job", "watchdog"),
    ("lease", "lease"),
    ("retrieved", "retrieved"),
    ("slurm_submit", "slurm.json"),
    ("slurm_launch", "slurm_launch.json"),
    ("slurm_script", "slurm_batch.sh"),
]


@pytest.mark.parametrize(("attribute", "name"), RUN_FILES, ids=[a for a, _ in RUN_FILES])
def test_each_file_of_a_run_directory_is_at_its_one_path(attribute: str, name: str) -> None:
    assert getattr(rundir.RunPaths(RUN), attribute) == f"{RUN}/{name}"


def test_every_path_a_run_paths_has_is_in_the_table() -> None:
    properties = {n for n, v in vars(rundir.RunPaths).items() if isinstance(v, property)} - {
        "run_dir"
    }  # the directory itself
    assert properties == {a for a, _ in RUN_FILES}


RUN_ENTRIES = [
    pytest.param(lambda p: p.checkpoint(5), "output/checkpoint-5", id="checkpoint"),
    pytest.param(lambda p: p.checkpoint(0), "output/checkpoint-0", id="checkpoint-of-step-zero"),
    pytest.param(lambda p: p.in_output("checkpoint-7"), "output/checkpoint-7", id="in-output"),
    pytest.param(lambda p: p.in_resume("checkpoint-7"), "resume/checkpoint-7", id="in-resume"),
    pytest.param(lambda p: p.tool("watchdog.py"), "plugin/trainer_plugin/tools/watchdog.py", id="tool"),
    pytest.param(lambda p: p.package_file("rundir.py"), "plugin/trainer_plugin/rundir.py", id="package-file"),
    pytest.param(lambda p: p.file(rundir.CANCELLED), "cancelled", id="file-by-name"),
]


@pytest.mark.parametrize(("path_of", "relpath"), RUN_ENTRIES)
def test_each_entry_in_a_run_directory_is_at_its_one_path(path_of: Any, relpath: str) -> None:
    assert path_of(rundir.RunPaths(RUN)) == f"{RUN}/{relpath}"


def test_a_checkpoints_path_is_the_one_a_valid_proof_names() -> None:
    paths = rundir.RunPaths(RUN)
    assert paths.checkpoint(12) == f"{RUN}/{rundir.checkpoint_relpath(12)}" == paths.in_output("checkpoint-12")


@pytest.mark.parametrize(
    ("run_dir", "job_log"),
    [
        pytest.param(RUN, f"{RUN}/job.log", id="a-target-path"),
        pytest.param(RUN + "/", f"{RUN}/job.log", id="a-trailing-slash-adds-no-empty-part"),
        pytest.param(Path(RUN), f"{RUN}/job.log", id="a-local-Path"),
        pytest.param("runs/r1", "runs/r1/job.log", id="a-relative-path-stays-relative"),
        pytest.param("~/obd/r1", "~/obd/r1/job.log", id="nothing-is-expanded"),
    ],
)
def test_run_paths_are_plain_posix_joins_of_the_run_directory(run_dir: str | Path, job_log: str) -> None:
    paths = rundir.RunPaths(run_dir)
    assert paths.job_log == job_log and isinstance(paths.job_log, str)


FACT_FILES = [
    ("handle", "handle.json"),
    ("exit_code", "exit_code"),
    ("cancelling", "cancelling"),
    ("cancelled", "cancelled"),
]


@pytest.mark.parametrize(("attribute", "name"), FACT_FILES, ids=[a for a, _ in FACT_FILES])
def test_each_file_of_a_facts_directory_is_at_its_one_path(attribute: str, name: str) -> None:
    assert getattr(rundir.FactPaths("/var/lib/obd/facts/r1"), attribute) == f"/var/lib/obd/facts/r1/{name}"


@pytest.mark.parametrize("mark", ["exit_code", "cancelling", "cancelled"])
def test_the_job_wrappers_end_marks_are_in_the_facts_directory_where_there_is_one(mark: str) -> None:
    assert getattr(jobctl.end_marks(RUN, "/facts/r1"), mark) == f"/facts/r1/{mark}"
    assert getattr(jobctl.end_marks(RUN, None), mark) == f"{RUN}/{mark}"
