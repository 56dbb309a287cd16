"""Notifications under the real daemon: a local webhook receiver and a hook command, every chosen
event once per transition and in order, across a SIGKILL and a restart, and hooks that hang or
fail holding up nothing else."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from daemon.service.config import ConfigError, load_config
from daemon.service.models import RunRecord, RunState
from daemon.service.notify import applies, events
from tests.conftest import FAST_CONFIG, DaemonProc, wait_for
from tests.daemon import pods
from tests.daemon.pods import KEY, make_pods_daemon
from tests.executors.runpod.conftest import kill_jobs
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer

PY = sys.executable
pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures
FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
PROOF_JOB = "proof=" + json.dumps({"checkpoint": "output/checkpoint-STEP", "step": "STEP"}).replace('"STEP"}', "STEP}")
ALL_EVENTS = '["queued", "started", "snapshot", "cost_warning", "stopped", "succeeded", "failed", "cancelled"]'
URL_SECRET = "url-token-5f2e9c"  # a webhook's secret, as Slack's are, in its path
# The hook command: appends what it was given (stdin, argv, the variables it sees) as one line.
RECORDER = """
import json, os, sys
body = sys.stdin.read()
line = json.dumps({"body": json.loads(body), "argv": sys.argv, "env": dict(os.environ)})
with open(sys.argv[1], "a") as f:
    f.write(line + "\\n")
"""


class Receiver:
    """A webhook on 127.0.0.1: keeps every POST in arrival order and answers as `mode` says:
    `ok` (200), `500`, or `hang` (answers nothing until `release` is set, then drops it)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.posts: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                post = {"body": body, "path": self.path, "headers": dict(self.headers), "answered": None}
                with receiver.lock:
                    receiver.posts.append(post)
                    mode = receiver.mode
                if mode == "hang":
                    receiver.release.wait(300)
                    return  # dropped: never answered
                code = 500 if mode == "500" else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()
                post["answered"] = code

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook/{URL_SECRET}"

    def acknowledged(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """The bodies answered 200 (delivered), in arrival order."""
        with self.lock:
            return [
                p["body"]
                for p in self.posts
                if p["answered"] == 200 and (run_id is None or p["body"]["run_id"] == run_id)
            ]

    def received(self, run_id: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            return [p["body"] for p in self.posts if run_id is None or p["body"]["run_id"] == run_id]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receivers() -> Iterator[list[Receiver]]:
    made: list[Receiver] = []
    yield made
    for r in made:
        r.close()


def receiver(made: list[Receiver], mode: str = "ok") -> Receiver:
    r = Receiver(mode)
    made.append(r)
    return r


def hook_lines(path: Path, run_id: str | None = None) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if run_id is None or x["body"]["run_id"] == run_id]


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = (), env: dict[str, str] | None = None) -> str:
    out = d.cli("train", "start", *opts, "--", *command, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def announced(d: DaemonProc, rid: str) -> None:
    wait_for(lambda: d.record(rid)["snapshots"], 60, what=f"run {rid} to announce snapshots")


def kinds(bodies: list[dict[str, Any]]) -> list[str]:
    return [b["event"] for b in bodies]


def notify_block(
    name: str, *, url: str | None = None, command: list[str] | None = None, on: str = ALL_EVENTS, extra: str = ""
) -> str:
    where = f"url = {json.dumps(url)}\n" if url else f"command = {json.dumps(command)}\n"
    return f'\n[[notify]]\nname = "{name}"\n{where}on = {on}\n{extra}\n'


def test_every_chosen_event_arrives_once_per_transition_in_order_at_a_webhook_and_a_command(
    make_daemon, receivers: list[Receiver], short_tmp: Path
) -> None:
    hook = receiver(receivers)
    recorder = short_tmp / "recorder.py"
    recorder.write_text(RECORDER)
    out = short_tmp / "hook.jsonl"
    # An attempt cut short by its timeout is tried again (deliveries are at least once): on a box
    # busy enough that the recorder takes 10 s, the attempt cut short may have written its line.
    config = (
        FAST_CONFIG
        + notify_block("web", url=hook.url, extra="timeout = 120")
        + notify_block(
            "cmd",
            command=[PY, str(recorder), str(out)],
            on='["started", "snapshot", "stopped", "succeeded", "failed", "cancelled"]',
            extra="timeout = 120",
        )
    )
    d = make_daemon(config)
    d.start()
    secret, value = "secret-value-8d1f0a", "env-value-77c3b2"
    ok = start(
        d,
        PY,
        "-c",
        "print('trained')",
        opts=("--name", "sft", "--secret", "TOKEN", "--env", f"VISIBLE={value}"),
        env={"TOKEN": secret},
    )
    bad = start(d, PY, "-c", "import sys; sys.exit(3)")
    snap = start(d, PY, FAKE, PROOF_JOB)
    gone = start(d, PY, FAKE, "no-plugin")
    announced(d, snap)
    assert d.cli("train", "stop", snap, "--wait").returncode == 0
    d.wait_state(gone, "running")
    assert d.cli("train", "cancel", gone, "--wait").returncode == 0
    expected = {
        ok: ["started", "succeeded"],
        bad: ["started", "failed"],
        snap: ["started", "snapshot", "stopped"],
        gone: ["started", "cancelled"],
    }
    for rid in expected:
        d.wait_state(rid, "succeeded", "failed", "stopped", "cancelled")
    total = sum(len(v) for v in expected.values())
    wait_for(
        lambda: len(hook.acknowledged()) >= total and len(hook_lines(out)) >= total, 30, what="every event delivered"
    )
    for rid, want in expected.items():
        assert kinds(hook.acknowledged(rid)) == want, rid
        assert kinds(hook.received(rid)) == want, rid  # nothing sent twice
        assert kinds([x["body"] for x in hook_lines(out, rid)]) == want, rid
    assert len(hook.received()) == len(hook_lines(out)) == total

    # Each event says which transition it is: its state, reason and time are the history's.
    for body in hook.acknowledged():
        record = d.record(body["run_id"])
        index = int(body["event_id"].split(":")[1])
        entry = record["history"][index]
        assert (body["state"], body["message"], body["time"]) == (entry["state"], entry["reason"], entry["time"])
        assert body["owner"] == record["owner"] and body["target"] == "local"
    [succeeded] = [b for b in hook.acknowledged(ok) if b["event"] == "succeeded"]
    assert succeeded["name"] == "sft" and succeeded["exit_code"] == 0 and succeeded["state"] == "succeeded"
    [stopped] = [b for b in hook.acknowledged(snap) if b["event"] == "stopped"]
    assert stopped["snapshot"] == d.record(snap)["snapshot"] and stopped["snapshot"]["checkpoint"].startswith(
        "output/checkpoint-"
    )
    # The command gets the same JSON on stdin, what it is in a few variables, and no secret anywhere.
    by_id = {b["event_id"]: b for b in hook.acknowledged()}
    for line in hook_lines(out):
        assert line["body"] == by_id[line["body"]["event_id"]]
        assert line["env"]["OBD_EVENT"] == line["body"]["event"] and line["env"]["OBD_RUN_ID"] == line["body"]["run_id"]
        assert line["argv"] == [str(recorder), str(out)]
        assert "TOKEN" not in line["env"]
    sent = json.dumps(hook.received()) + out.read_text()
    assert secret not in sent and value not in sent
    assert URL_SECRET not in d.log_path.read_text()  # the webhook's secret path is never logged


def test_a_daemon_killed_and_restarted_delivers_what_was_pending_in_order_and_nothing_twice(
    make_daemon, receivers: list[Receiver]
) -> None:
    hook = receiver(receivers)
    d = make_daemon(FAST_CONFIG + notify_block("web", url=hook.url, extra='timeout = "120s"'))
    d.start()
    first = start(d, PY, FAKE, PROOF_JOB)
    announced(d, first)
    wait_for(lambda: kinds(hook.acknowledged(first)) == ["started"], 30, what="the first run's start delivered")

    # The receiver now takes events but answers none: the second run's start is in flight when
    # the daemon is killed, so it was never delivered as far as the daemon knows.
    hook.mode = "hang"
    second = start(d, PY, FAKE, "no-plugin")
    wait_for(lambda: kinds(hook.received(second)) == ["started"], 30, what="the second run's start sent")
    d.kill()
    hook.release.set()

    # While the daemon is down, the first run takes a snapshot and ends.
    remote = Path(json.loads((d.state_dir / "runs" / first / "run.json").read_text())["remote_dir"])
    (remote / "snapshot.request").write_text("requested\n")
    wait_for((remote / "exit_code").exists, 60, what="the first job to end with its snapshot")

    hook.mode = "ok"
    d.start()
    d.wait_state(first, "stopped")
    assert d.cli("train", "cancel", second, "--wait").returncode == 0
    wait_for(lambda: kinds(hook.acknowledged(second))[-1:] == ["cancelled"], 30, what="the second run's end delivered")
    wait_for(lambda: kinds(hook.acknowledged(first))[-1:] == ["stopped"], 30, what="the first run's end delivered")
    assert kinds(hook.acknowledged(first)) == ["started", "snapshot", "stopped"]
    assert kinds(hook.acknowledged(second)) == ["started", "cancelled"]

    # Delivered before the kill: never again. In flight at the kill: once more, with the same id.
    assert kinds(hook.received(first)) == ["started", "snapshot", "stopped"]
    assert kinds(hook.received(second)) == ["started", "started", "cancelled"]
    assert hook.received(second)[0]["event_id"] == hook.received(second)[1]["event_id"]
    ids = [b["event_id"] for b in hook.acknowledged()]
    assert len(ids) == len(set(ids)) == 5


def test_a_run_waiting_for_gpus_is_notified_queued_then_started(make_daemon, receivers: list[Receiver]) -> None:
    hook = receiver(receivers)
    config = FAST_CONFIG + '\n[targets.local]\nkind = "local"\ngpus = ["0", "1"]\n' + notify_block("web", url=hook.url)
    d = make_daemon(config)
    d.start()
    holder = start(d, "sleep", "60", opts=("--gpus", "2"))
    d.wait_state(holder, "running")
    waiting = start(d, "sleep", "60", opts=("--gpus", "1"))
    d.wait_state(waiting, "queued")
    d.call("cancel", id=holder)
    d.wait_state(waiting, "running")
    d.call("cancel", id=waiting)
    d.wait_state(waiting, "cancelled")
    wait_for(lambda: kinds(hook.acknowledged(waiting))[-1:] == ["cancelled"], 30, what="the queued run's events")
    assert kinds(hook.received(waiting)) == ["queued", "started", "cancelled"]
    assert "GPU" in hook.received(waiting)[0]["message"]


def test_a_hook_that_hangs_or_answers_500_holds_up_no_run_and_no_other_hook(
    make_daemon, receivers: list[Receiver], short_tmp: Path
) -> None:
    hanging, failing, fine = receiver(receivers, "hang"), receiver(receivers, "500"), receiver(receivers)
    on = '["started", "succeeded", "failed"]'
    config = (
        FAST_CONFIG
        + notify_block("hangs", url=hanging.url, on=on, extra='timeout = "300s"')
        + notify_block("fails", url=failing.url, on=on, extra='retries = 2\nbackoff = "0.1s"')
        + notify_block("fine", url=fine.url, on=on)
    )
    d = make_daemon(config)
    d.start()
    runs = [start(d, PY, "-c", f"print({i})") for i in range(3)]
    runs.append(start(d, PY, "-c", "import sys; sys.exit(1)"))
    for rid in runs:
        d.wait_state(rid, "succeeded", "failed")
    wait_for(lambda: len(fine.acknowledged()) == 2 * len(runs), 30, what="the working hook to get every event")
    for rid in runs:
        assert kinds(fine.acknowledged(rid)) == ["started", d.record(rid)["state"]]

    # All of that happened while the hanging hook held every request it got: none was answered,
    # and it has not been given a second event of any run (each run's events wait their turn).
    assert hanging.received(), "the hanging hook was never called"
    assert all(p["answered"] is None for p in hanging.posts)
    assert sorted(b["run_id"] for b in hanging.received()) == sorted({b["run_id"] for b in hanging.received()})

    # The failing hook got each event 1 + retries times; each failure is logged once, with the reason.
    wait_for(lambda: len(failing.received()) == 3 * 2 * len(runs), 30, what="the failing hook's retries")
    for rid in runs:
        assert kinds(failing.received(rid)) == ["started"] * 3 + [d.record(rid)["state"]] * 3

    def failures() -> list[dict[str, Any]]:
        lines = [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
        return [x for x in lines if x.get("event") == "notify_failed"]

    wait_for(lambda: len(failures()) == 2 * len(runs), 30, what="one failure logged per event")
    assert {x["notify"] for x in failures()} == {"fails"}
    assert all(x["reason"] == "HTTP 500 Internal Server Error" and x["attempts"] == 3 for x in failures())
    assert len({x["event_id"] for x in failures()}) == 2 * len(runs)


def test_a_hook_command_that_fails_or_hangs_is_killed_retried_and_logged_once(make_daemon, short_tmp: Path) -> None:
    marker = short_tmp / "tries"
    script = f"import sys, time; open({str(marker)!r}, 'a').write('x'); print('boom: no route', file=sys.stderr); sys.exit(4)"
    hang = f"import time; open({str(marker)!r} + '.hang', 'a').write('x'); time.sleep(300)"
    config = (
        FAST_CONFIG
        + notify_block("fails", command=[PY, "-c", script], on='["succeeded"]', extra='retries = 1\nbackoff = "0.1s"')
        + notify_block("hangs", command=[PY, "-c", hang], on='["succeeded"]', extra='retries = 0\ntimeout = "1s"')
    )
    d = make_daemon(config)
    d.start()
    rid = start(d, "true")
    d.wait_state(rid, "succeeded")

    def failures() -> dict[str, dict[str, Any]]:
        lines = [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
        return {x["notify"]: x for x in lines if x.get("event") == "notify_failed"}

    wait_for(lambda: len(failures()) == 2, 30, what="both hooks to give up")
    assert failures()["fails"]["reason"] == "python3 exited with status 4; stderr: boom: no route".replace(
        "python3", Path(PY).name
    )
    assert failures()["hangs"]["reason"] == "no answer within 1 s"
    assert marker.read_text() == "xx" and Path(f"{marker}.hang").read_text() == "x"


def test_a_pods_cost_cap_is_a_cost_warning_with_the_pods_spend(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path, receivers: list[Receiver]
) -> None:
    hook = receiver(receivers)
    try:
        extra = "max_cost_usd = 0.001\nsnapshot_margin = 3\n" + notify_block(
            "web", url=hook.url, on='["started", "cost_warning", "snapshot", "stopped"]'
        )
        d = make_pods_daemon(make_daemon, fake, pod_sshd, short_tmp, extra)
        out = d.cli("train", "start", "--target", "pods", "--", PY, FAKE, PROOF_JOB)
        assert out.returncode == 0, out.stderr
        rid = out.stdout.strip()
        record = d.wait_state(rid, "stopped", "failed", "cancelled", "succeeded", timeout=90)
        assert record["state"] == "stopped", record["message"]
        wait_for(lambda: kinds(hook.acknowledged(rid))[-1:] == ["stopped"], 30, what="the run's events")
        bodies = hook.acknowledged(rid)
        assert kinds(bodies) == ["started", "cost_warning", "snapshot", "stopped"]
        warning = bodies[1]
        assert "(cost)" in warning["message"]
        pod = warning["pod"]
        assert pod["pod_id"] == record["target_info"]["pod_id"] and pod["cost_per_hr"] == pytest.approx(0.69)
        started_at = record["target_info"]["started_at"]
        assert pod["spend_usd"] == pytest.approx(0.69 * (warning["time"] - started_at) / 3600, abs=1e-4)
        assert KEY not in json.dumps(bodies)
    finally:
        kill_jobs(short_tmp / "pod")


# --- config and the rules, in process ------------------------------------------------------------


@pytest.mark.parametrize(
    "entry, why",
    [
        ('on = ["failed"]', "needs `command = [...]` or `url"),
        ('url = "ftp://example.org/x"', "a url is http://"),
        ('url = "http://example.org:99999/x"', "a url is http://"),
        ("command = []", "non-empty list"),
        ('command = ["x"]\non = ["exploded"]', "notify.0.on.0"),
        ('command = ["x"]\non = []', "at least one event"),
        ('command = ["x"]\nretries = -1', "notify.0.retries"),
        ('command = ["x"]\ntimeout = "0s"', "out of range"),
        ('command = ["x"]\nenv = ["OBD_RUN_ID"]', "OBD_* names are obd's"),
        ('command = ["x"]\nname = "../x"', "a name is letters"),
        ('command = ["x"]\nurls = "http://x"', "unknown key"),
        ('command = ["x"]\n[[notify]]\ncommand = ["x"]', "distinct `name`"),
    ],
)
def test_a_bad_notify_entry_is_refused_with_what_is_wrong(tmp_path: Path, entry: str, why: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f"[[notify]]\n{entry}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert why in str(info.value)
    assert str(path) in str(info.value)


def test_events_are_state_changes_proofs_and_cost_requests_and_filters_pick_runs() -> None:
    record = RunRecord(id="r1", owner="alice", target="gpu1")
    record.transition(RunState.preparing, "created", 1)
    record.transition(RunState.queued, "waiting for the scheduler: Resources", 2)
    record.transition(RunState.queued, "waiting for the scheduler: Priority", 3)  # same state: no event
    record.transition(RunState.running, "started (pid 4)", 4)
    record.note("snapshot requested (cost) by the pod's cap", 5)
    record.note("invalid snapshot proof: not JSON", 6)
    record.note("snapshot proof: output/checkpoint-3 at step 3 (cost)", 7)
    record.transition(RunState.stopped, "snapshot output/checkpoint-3 at step 3 (cost)", 8)
    got = [(e.index, e.kind, e.state) for e in events(record)]
    assert got == [
        (1, "queued", "queued"),
        (3, "started", "running"),
        (4, "cost_warning", "running"),
        (6, "snapshot", "running"),
        (7, "stopped", "stopped"),
    ]
    assert [e.index for e in events(record, 4)] == [4, 6, 7]
    assert [e.id for e in events(record, 7)] == ["r1:7:stopped"]

    from daemon.service.config import NotifyEntry

    assert applies(NotifyEntry(command=["x"]), record)
    assert applies(NotifyEntry(command=["x"], owners=["alice"], targets=["gpu1"]), record)
    assert not applies(NotifyEntry(command=["x"], owners=["bob"]), record)
    assert not applies(NotifyEntry(command=["x"], targets=["local"]), record)
    label = NotifyEntry(url=f"https://u:pw@hooks.example.org/services/{URL_SECRET}").label
    assert label.startswith("https://hooks.example.org (h-") and URL_SECRET not in label and "pw" not in label
