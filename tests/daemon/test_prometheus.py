"""The Prometheus exporter under the real daemon: a scrape parses with Prometheus' own parser and
its numbers are the ones `obd train list` and `status` show."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from daemon.service.config import ConfigError, load_config
from daemon.service.prometheus import Family, exposition, histogram
from tests.conftest import FAST_CONFIG, REPO, DaemonProc, wait_for
from tests.daemon import pods
from tests.daemon.pods import make_pods_daemon
from tests.executors.runpod.conftest import kill_jobs
from tests.fakes.runpod_api import FakeRunpod
from tests.sshd import SshServer, free_port

PY = sys.executable
pod_sshd, fake = pods.pod_sshd, pods.fake  # the fixtures
FAKE = str(Path(__file__).with_name("fake_plugin_job.py"))
PROOF_JOB = "proof=" + json.dumps({"checkpoint": "output/checkpoint-STEP", "step": "STEP"}).replace('"STEP"}', "STEP}")
STOP_CONFIG = FAST_CONFIG.replace('proof_timeout = "60s"', 'proof_timeout = "3s"').replace(
    'end_timeout = "30s"', 'end_timeout = "2s"'
)
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def with_metrics(config: str, port: int) -> str:
    return config.replace("[daemon]\n", f'[daemon]\nmetrics_listen = "127.0.0.1:{port}"\n', 1)


def scrape(port: int, path: str = "/metrics") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return answer.headers["Content-Type"], answer.read().decode()


def samples(text: str) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and each family's type, through Prometheus' own parser."""
    out: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out, types


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, frozenset(labels.items()))]


def start(d: DaemonProc, *command: str, opts: tuple[str, ...] = ()) -> str:
    out = d.cli("train", "start", *opts, "--", *command)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def announced(d: DaemonProc, rid: str) -> None:
    wait_for(lambda: d.record(rid)["snapshots"], 60, what=f"run {rid} to announce snapshots")


def proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_scrape_parses_and_its_numbers_match_the_run_list_and_the_records(make_daemon) -> None:
    port = free_port()
    # One GPU, so a second run that wants it waits in the queue.
    config = with_metrics(STOP_CONFIG, port) + '\n[targets.local]\nkind = "local"\ngpus = ["0"]\n'
    d = make_daemon(config)
    d.start()
    ok = start(d, "true")
    d.wait_state(ok, "succeeded")
    bad = start(d, PY, "-c", "import sys; sys.exit(3)")
    d.wait_state(bad, "failed")
    for mode, code in ((PROOF_JOB, 0), ("ignore", 3), ("hang-after", 0)):
        rid = start(d, PY, FAKE, mode)
        announced(d, rid)
        out = d.cli("train", "stop", rid, "--wait")
        assert out.returncode == code, out.stdout + out.stderr
    holder = start(d, "sleep", "60")
    d.wait_state(holder, "running")
    waiting = start(d, "sleep", "60")
    d.wait_state(waiting, "queued")

    pid = d.call("ping")["pid"]
    cpu_before = proc_cpu_seconds(pid)
    content_type, text = scrape(port)
    cpu_after = proc_cpu_seconds(pid)
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    listed = json.loads(d.cli("train", "list", "--all", "--json").stdout)
    records = [d.record(r["id"]) for r in listed]
    found, types = samples(text)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"

    # Runs by state and target, and the queue: as `obd train list --all` counts them.
    counts = Counter((r["state"], r["target"]) for r in listed)
    runs = {dict(k[1])["state"]: v for k, v in found.items() if k[0] == "obd_runs" and dict(k[1])["target"] == "local"}
    assert runs == {s: counts[(s, "local")] for s in runs}
    assert sum(runs.values()) == len(listed) == 7
    assert set(runs) >= {"queued", "preparing", "running", "stopped", "succeeded", "failed", "cancelled"}
    assert value(found, "obd_queue_length") == sum(r["state"] == "queued" for r in listed) == 1
    assert types["obd_runs"] == "gauge" and types["obd_snapshot_latency_seconds"] == "histogram"

    # Stops that fell back to a cancel, by how they ended: the records' `stop.cancel_by`.
    fell_back = Counter(r["state"] for r in records if r["stop"]["cancel_by"] == "fallback")
    assert fell_back == {"cancelled": 1, "stopped": 1}
    for outcome in ("cancelled", "stopped", "failed", "succeeded"):
        assert value(found, "obd_stop_fallbacks_total", outcome=outcome) == fell_back[outcome]
    assert types["obd_stop_fallbacks"] == "counter"

    # Snapshot latency: request to proof, per run that has both.
    latencies = [
        r["stop"]["proof_at"] - r["stop"]["requested_at"] for r in records if r["snapshot"] and r["stop"]["proof_at"]
    ]
    assert len(latencies) == 2
    assert value(found, "obd_snapshot_latency_seconds_count") == 2
    assert value(found, "obd_snapshot_latency_seconds_sum") == pytest.approx(sum(latencies))
    for (name, labels), n in found.items():
        if name == "obd_snapshot_latency_seconds_bucket":
            le = float(dict(labels)["le"])
            assert n == sum(v <= le for v in latencies)

    # The follow of the target with a running job, and the daemon's own process.
    assert value(found, "obd_follow_lag_seconds", target="local") >= 0
    assert cpu_before - 0.02 <= value(found, "process_cpu_seconds_total") <= cpu_after + 0.02
    assert abs(value(found, "process_open_fds") - fds) <= 4
    with open(f"/proc/{pid}/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(value(found, "process_resident_memory_bytes") - rss) < 32 * 2**20
    # Every metric the sample Grafana dashboard asks for is one the daemon exports.
    dashboard = (REPO / "docs" / "grafana-dashboard.json").read_text()
    exported = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    asked = set(
        re.findall(
            r"\b(?:obd|process)_[a-z_]+", json.dumps([p.get("targets") for p in json.loads(dashboard)["panels"]])
        )
    )
    assert asked and {n for n in asked if n not in exported and n.removesuffix("_bucket") not in exported} == set()
    for rid in (holder, waiting):
        d.call("cancel", id=rid)


def test_a_live_pod_is_counted_with_its_rate_and_spend_until_it_is_ended(
    make_daemon, fake: FakeRunpod, pod_sshd: SshServer, short_tmp: Path
) -> None:
    port = free_port()
    original = make_daemon

    def make(config: str) -> DaemonProc:
        return original(with_metrics(config, port))

    d = make_pods_daemon(make, fake, pod_sshd, short_tmp)
    try:
        out = d.cli("train", "start", "--target", "pods", "--", "sleep", "60")
        assert out.returncode == 0, out.stderr
        rid = out.stdout.strip()
        d.wait_state(rid, "running", timeout=60)
        before = d.record(rid)["pod"]["spend_usd"]
        found, _ = samples(scrape(port)[1])
        after = d.record(rid)["pod"]["spend_usd"]
        pod_id = d.record(rid)["target_info"]["pod_id"]
        labels = {"target": "pods", "run_id": rid, "pod_id": pod_id}
        assert value(found, "obd_pods_alive", target="pods") == 1
        assert value(found, "obd_pod_cost_per_hour_dollars", **labels) == pytest.approx(0.69)
        assert before <= value(found, "obd_pod_spend_dollars", **labels) <= after
        assert value(found, "obd_runs", state="running", target="pods") == 1

        assert d.cli("train", "cancel", rid, "--wait").returncode == 0
        wait_for(lambda: fake.live_pods() == [], 60, what="the pod to be terminated")
        found, _ = samples(scrape(port)[1])
        assert value(found, "obd_pods_alive", target="pods") == 0
        assert not [k for k in found if k[0] == "obd_pod_spend_dollars"]
        assert value(found, "obd_runs", state="cancelled", target="pods") == 1
    finally:
        kill_jobs(short_tmp / "pod")


def test_other_pages_and_methods_are_refused_and_a_busy_address_leaves_the_daemon_running(make_daemon) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        d = make_daemon(with_metrics(FAST_CONFIG, taken))
        d.start()  # ready: the runs matter more than the metrics
        assert start(d, "true")
        lines = [json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
        [failed] = [x for x in lines if x.get("event") == "metrics_listen_failed"]
        assert failed["address"] == f"127.0.0.1:{taken}" and "metrics_listen" in failed["hint"]
    d.stop()

    port = free_port()
    d.write_config(with_metrics(FAST_CONFIG, port))
    d.start()
    with pytest.raises(urllib.error.HTTPError) as missing:
        scrape(port, "/secrets")
    assert missing.value.code == 404
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x", method="POST")
    with pytest.raises(urllib.error.HTTPError) as posted:
        urllib.request.urlopen(request, timeout=10)
    assert posted.value.code == 405
    assert "obd_runs" in scrape(port)[1]


@pytest.mark.parametrize("address", ["9464", "localhost", "127.0.0.1:0", "127.0.0.1:70000", "[::1:9464", "a b:1"])
def test_a_bad_metrics_address_is_refused_naming_the_key(tmp_path: Path, address: str) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[daemon]\nmetrics_listen = "{address}"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "daemon.metrics_listen" in str(info.value)


def test_the_exposition_escapes_labels_and_help_so_the_parser_reads_back_the_values() -> None:
    fam = Family("obd_test", "gauge", "help with a \\ backslash and a\nnewline")
    weird = 'a "quoted" \\ back\nslash'
    fam.add(2.5, target=weird)
    fam.add(float("inf"), target="inf")
    hist = Family("obd_hist_seconds", "histogram", "a histogram")
    histogram(hist, [0.5, 2.0, 7.0], (1.0, 5.0))
    found, _ = samples(exposition([fam, hist]))
    assert value(found, "obd_test", target=weird) == 2.5
    assert value(found, "obd_test", target="inf") == float("inf")
    buckets: dict[str, Any] = {dict(k[1])["le"]: v for k, v in found.items() if k[0] == "obd_hist_seconds_bucket"}
    assert buckets == {"1.0": 1, "5.0": 2, "+Inf": 3}
    assert value(found, "obd_hist_seconds_sum") == 9.5 and value(found, "obd_hist_seconds_count") == 3
