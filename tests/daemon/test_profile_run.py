"""`obd train start --profile` under the daemon: the runner's wrapper, collection, `obd train metrics`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.conftest import REPO, DaemonProc

WORKLOAD = str(REPO / "workloads" / "train_qwen_lora.py")


def test_a_profiled_cpu_run_gets_run_metrics_that_say_where_each_number_came_from(daemon: DaemonProc) -> None:
    out = daemon.cli("train", "start", "--profile", "--", sys.executable, WORKLOAD, "--tiny", "--max_steps", "8")
    rid = out.stdout.strip()
    record = daemon.wait_state(rid, "succeeded", "failed", timeout=180)
    assert record["state"] == "succeeded", record["message"]
    metrics = json.loads(daemon.cli("train", "metrics", rid, "--json").stdout)
    assert metrics["runner_kind"] == "live"
    assert metrics["steps"] >= 7
    assert metrics["tokens_per_sec"] and metrics["tokens_per_sec"] > 0
    assert (
        metrics["top_kernels"]
        and abs(sum(k["pct_time"] for k in metrics["top_kernels"]) + metrics.get("other_kernels_pct", 0) - 100) < 0.5
    )
    assert metrics["mfu_pct"] is None and metrics["hbm_peak_gb"] is None  # no GPU here: never a made-up number
    assert any("rocprofv3 not found" in w for w in metrics["warnings"])
    human = daemon.cli("train", "metrics", rid).stdout
    assert "runner_kind: live" in human and "Waste budget" in human
    parsed = daemon.cli("profile", "parse", str(Path(record["remote_dir"]) / "profile"), "--json")
    assert parsed.returncode == 0, parsed.stderr
    assert json.loads(parsed.stdout)["top_kernels"]


def test_metrics_of_a_run_that_was_not_profiled_say_so(daemon: DaemonProc) -> None:
    rid = daemon.cli("train", "start", "--", "true").stdout.strip()
    daemon.wait_state(rid, "succeeded")
    out = daemon.cli("train", "metrics", rid)
    assert out.returncode == 0 and "not started with --profile" in out.stdout
