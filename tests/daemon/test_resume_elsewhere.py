"""`obd train resume RUN --target T` (issue 36 item 1), through the real daemon and a real sshd: a
run's checkpoint carried between this machine and an SSH host, every file's sha256 verified on
arrival, and a user's unchanged Trainer script continuing there bitwise (CPU, same world size).
A file that arrives changed fails the launch before the job starts, and the run stays resumable
where it was."""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import FAST_CONFIG, REPO, DaemonProc, kill_job_groups, wait_for
from tests.sshd import SshServer, running_sshd

pytest.importorskip("transformers")

PY = sys.executable
PLAIN = str(REPO / "tests" / "trainer_plugin" / "scripts" / "plain_trainer.py")
FAKE = str(REPO / "tests" / "daemon" / "fake_plugin_job.py")
STEPS = 12

# The Python of the target `flaky`: before the carry's check of what arrived runs (`python -c
# LISTING DIR EXCLUDED_JSON`, DIR in a run's resume/), it flips one bit of the first file there,
# as a bad disk or a transfer gone wrong would leave it; every other command is the real
# interpreter's (the progress count during the upload, `python -c ARRIVED DIR`, among them: a
# flip there too would be undone by the listing's).
CORRUPTING_PYTHON = """#!{py}
import os, sys
if len(sys.argv) == 5 and sys.argv[1] == "-c" and "/resume/" in sys.argv[3] and sys.argv[4].startswith("["):
    for name in sorted(os.listdir(sys.argv[3])):
        path = os.path.join(sys.argv[3], name)
        if os.path.isfile(path) and os.path.getsize(path):
            with open(path, "r+b") as f:
                first = f.read(1)
                f.seek(0)
                f.write(bytes([first[0] ^ 1]))
            break
os.execv({py!r}, [{py!r}, *sys.argv[1:]])
"""


def ssh_target(name: str, server: SshServer, workdir: Path, python: str) -> str:
    f = server.target_fields()
    return (
        f'\n[targets.{name}]\nkind = "ssh"\nhost = "{f["host"]}"\nport = {f["port"]}\nuser = "{f["user"]}"\n'
        f'identity_file = "{f["identity_file"]}"\nknown_hosts = "{f["known_hosts"]}"\n'
        f'workdir = "{workdir}"\npython = "{python}"\nconnect_timeout = 3\nkeepalive = 3\n'
    )


@pytest.fixture
def sshd() -> Iterator[SshServer]:
    yield from running_sshd()


@pytest.fixture
def two_places(make_daemon, sshd: SshServer, short_tmp: Path) -> Iterator[DaemonProc]:
    """A daemon with this machine (`local`, two GPU ids), an SSH host (`box`) and the same host
    whose Python corrupts what a carry brings (`flaky`)."""
    corrupting = short_tmp / "corrupting-python"
    corrupting.write_text(CORRUPTING_PYTHON.format(py=PY))
    corrupting.chmod(0o755)
    config = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n'  # ids, no GPU
    config += ssh_target("box", sshd, short_tmp / "box", PY)
    config += ssh_target("flaky", sshd, short_tmp / "flaky", str(corrupting))
    d = make_daemon(config)
    d.start()
    yield d
    for where in ("box", "flaky"):
        kill_job_groups((short_tmp / where).glob("*/job.pid"))


def trainer(*extra: str) -> list[str]:
    return [PY, PLAIN, "--output_dir", "mine", "--max_steps", str(STEPS), *extra]


def start(d: DaemonProc, cwd: Path, *extra: str) -> str:
    out = d.cli("train", "start", "--cwd", str(cwd), "--", *trainer(*extra))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def resume(d: DaemonProc, rid: str, *opts: str) -> str:
    out = d.cli("train", "resume", rid, *opts)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def stop_at_hold(d: DaemonProc, rid: str, hold: int) -> dict:
    """Stop a run that waits after step `hold` for a snapshot request (`--hold-at`): it trains one
    more step once asked, and its snapshot is at the end of that one."""
    wait_for(lambda: (d.record(rid)["progress"].get("step") or 0) >= hold, 180, 0.1, f"step {hold} of {rid}")
    out = d.cli("train", "stop", rid, "--wait", timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = d.record(rid)
    assert stopped["state"] == "stopped" and stopped["snapshot"]["step"] == hold + 1, stopped["message"]
    return stopped


def steps(record: dict) -> dict[int, tuple[float, float]]:
    lines = [json.loads(x) for x in (Path(record["remote_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: (x["loss"], x.get("grad_norm")) for x in lines if x.get("event") == "log" and "loss" in x}


def notes(record: dict) -> str:
    return "\n".join(h["reason"] for h in record["history"])


def hashes(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_a_run_resumed_on_an_ssh_host_and_back_here_trains_every_later_step_bitwise(
    two_places: DaemonProc, short_tmp: Path
) -> None:
    d = two_places
    project = short_tmp / "project"  # the job's directory: used here, uploaded to the host
    project.mkdir()
    whole = d.wait_state(start(d, project), "succeeded", "failed", timeout=300)
    assert whole["state"] == "succeeded", whole["message"]
    reference = steps(whole)

    first = stop_at_hold(d, start(d, project, "--hold-at", "4"), 4)  # here, stopped at step 5
    there_id = resume(d, first["id"], "--target", "box", "--", *trainer("--hold-at", "8"))
    there = d.record(there_id)
    assert there["target"] == "box" and there["resumed_from"] == first["id"]
    there = stop_at_hold(d, there_id, 8)  # on the host, from step 6 to step 9
    assert Path(there["remote_dir"], "src").is_dir()  # the local run's directory, uploaded for the host
    carried = notes(there)
    assert f"checkpoint-5 of {first['id']} carried from target local to box" in carried
    assert "sha256 verified on arrival" in carried

    back_id = resume(d, there_id, "--target", "local", "--", *trainer())  # and here again, to the end
    back = d.wait_state(back_id, "succeeded", "failed", timeout=300)
    assert back["state"] == "succeeded", back["message"]
    assert back["target"] == "local" and f"checkpoint-9 of {there_id} carried from target box to local" in notes(back)

    mid, last = steps(there), steps(back)
    assert min(mid) == 6 and max(mid) == 9 and min(last) == 10 and max(last) == STEPS  # none twice, none skipped
    assert mid == {s: reference[s] for s in mid}  # bitwise: losses and grad norms
    assert last == {s: reference[s] for s in last}
    # One chain: each resume continues its source's tracker run (one curve in plot and the web view).
    assert d.record(back_id)["trackers"] == d.record(first["id"])["trackers"]


def test_a_checkpoint_that_arrives_changed_fails_the_resume_before_the_job_starts_and_the_run_stays_resumable(
    two_places: DaemonProc, short_tmp: Path
) -> None:
    d = two_places
    project = short_tmp / "project"
    project.mkdir()
    source = stop_at_hold(d, start(d, project, "--hold-at", "2", "--max_steps", "4"), 2)
    checkpoint = Path(source["remote_dir"]) / "output" / "checkpoint-3"
    before = hashes(checkpoint)
    assert before

    refused = d.wait_state(resume(d, source["id"], "--target", "flaky"), "failed", "succeeded", timeout=120)
    assert refused["state"] == "failed", json.dumps(refused["history"], indent=1)
    message = refused["message"]
    assert message.startswith("launch failed: checkpoint-3 of run") and "did not arrive whole" in message, message
    assert "sha256 differs" in message and "so the job was not started" in message, message
    assert f"obd train resume {source['id']} --target" in message  # the next command
    assert refused.get("job") is None and not (Path(refused["remote_dir"]) / "job.pid").exists()

    assert hashes(checkpoint) == before  # nothing at the source was touched
    again_id = resume(d, source["id"], "--target", "box", "--", *trainer("--max_steps", "4"))
    again = d.wait_state(again_id, "succeeded", "failed", timeout=300)
    assert again["state"] == "succeeded", again["message"]
    assert min(steps(again)) == 4


def test_a_resume_with_another_gpu_count_through_the_python_api_resumes_and_says_what_changed(
    make_daemon, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import obd

    d = make_daemon(FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n')  # ids, no GPU
    d.start()
    for name in ("OBD_SOCKET", "OBD_CONFIG", "OBD_STATE_DIR"):
        monkeypatch.setenv(name, d.env[name])
    project = short_tmp / "project"
    project.mkdir()
    out = d.cli(
        "train", "start", "--gpus", "1", "--cwd", str(project), "--", *trainer("--hold-at", "2", "--max_steps", "4")
    )
    assert out.returncode == 0, out.stderr
    source = stop_at_hold(d, out.stdout.strip(), 2)
    assert len(source["gpus"]) == 1

    with obd.Client() as client:
        resumed = client.run(source["id"]).resume(gpus=2, command=trainer("--max_steps", "4"))
    back = d.wait_state(resumed.id, "succeeded", "failed", timeout=300)
    assert back["state"] == "succeeded", back["message"]
    assert back["target"] == "local" and sorted(back["gpus"]) == ["0", "1"]
    said = notes(back)
    assert f"with --gpus 2 where {source['id']} had 1" in said and "the data order and the effective batch" in said
    assert "carried" not in said  # the same target: the checkpoint is read where it is
    assert min(steps(back)) == 4


def test_a_sweep_resumed_on_another_target_continues_every_member_there(
    two_places: DaemonProc, short_tmp: Path
) -> None:
    d = two_places
    out = d.cli("train", "sweep", "--gpus", "1", "--grid", "lr=1,2,3", "--", PY, FAKE, "snapshot", "{lr}")
    assert out.returncode == 0, out.stderr
    sweep = out.stdout.strip()

    def members() -> list[dict]:
        return json.loads(d.cli("train", "list", "--sweep", sweep, "--json").stdout)

    wait_for(
        lambda: sum(m["state"] == "running" and (m["progress"]["step"] or 0) > 3 for m in members()) == 2,
        60,
        0.2,
        "two members training (two GPU ids), the third queued",
    )
    out = d.cli("train", "stop", sweep, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    stopped = sorted(m["id"] for m in members() if m["state"] == "stopped")
    assert len(stopped) == 2

    out = d.cli("train", "resume", "--json", sweep, "--target", "box")
    assert out.returncode == 0, out.stderr
    resumed = json.loads(out.stdout)["runs"]
    assert [r["target"] for r in resumed] == ["box"] * 3  # the one stopped in the queue starts again there too
    assert sorted(r["resumed_from"] for r in resumed if r["resumed_from"]) == stopped
    for r in resumed:
        if r["resumed_from"]:
            running = wait_for(lambda rid=r["id"]: (x := d.record(rid))["state"] == "running" and x, 60, 0.2)
            assert "carried from target local to box" in notes(running)
    out = d.cli("train", "cancel", sweep, "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
