"""Live RunMetrics on the GPU: a run under `obd train start --profile`, and what the profiler itself costs.

What the tests prove:
- the metrics of a profiled run on CUDA are measured, not canned: runner_kind `live`, tokens/s,
  MFU against the GPU's dense bf16 peak, peak HBM, GPU utilisation sampled through NVML
  (nvidia-smi), the top CUDA kernels and whether a fused attention kernel ran, each with the
  sentence in `sources` that says where it came from;
- the profiler's own slowdown, as two ratios: the profiled run's step time over an unprofiled
  twin's (same command, same GPU, one after the other), and inside the profiled run the steps in
  the profiler's window over the steps outside it.
"""

from __future__ import annotations

import itertools
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from runner import steps
from tests.gpu import harness

pytestmark = pytest.mark.gpu
CHECK = "live RunMetrics"
STEPS = 120
# The fields the check needs, each with its source.
MEASURED = ("tokens_per_sec", "mfu_pct", "hbm_peak_gb", "gpu_util_pct", "top_kernels", "attention_kernel_loaded")


@dataclass
class Profiled:
    profiled: dict[str, Any]
    twin: dict[str, Any]
    metrics: dict[str, Any]


@pytest.fixture(scope="module")
def profiled(gpu_daemon: Any) -> Profiled:
    """One LoRA run under --profile and its unprofiled twin, both waited for; the profiled run's RunMetrics."""
    argv = harness.workload_argv("lora", STEPS)
    profiled = harness.wait_final(gpu_daemon, harness.start_run(gpu_daemon, argv, "--profile", "--name", "profiled"))
    assert profiled["state"] == "succeeded", f"{profiled['message']}\n{harness.job_log_tail(profiled)}"
    twin = harness.wait_final(gpu_daemon, harness.start_run(gpu_daemon, argv, "--name", "unprofiled"))
    assert twin["state"] == "succeeded", f"{twin['message']}\n{harness.job_log_tail(twin)}"
    out = gpu_daemon.cli("train", "metrics", profiled["id"], "--json")
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    metrics: dict[str, Any] = answer.get("metrics") or answer
    artifacts = harness.artifacts_dir()
    if artifacts is not None:
        (artifacts / "run-metrics.json").write_text(json.dumps(metrics, indent=1))
    return Profiled(profiled, twin, metrics)


def _figure(metrics: dict[str, Any], field: str) -> str:
    value = metrics.get(field)
    if field == "top_kernels":
        top = value[0] if value else {}
        return f"{len(value or [])} kernels; first: {top.get('name', '')[:80]} ({top.get('pct_time', 0):.1f} %)"
    if field == "attention_kernel_loaded":
        return f"{value} ({', '.join(metrics.get('attention_kernels') or [])[:120]})"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def test_a_profiled_run_on_the_gpu_gets_live_metrics_each_with_its_source(profiled: Profiled) -> None:
    metrics = profiled.metrics
    assert metrics["runner_kind"] == "live" and metrics["profiler"] == "torch.profiler", metrics.get("warnings")
    sources = metrics["sources"]
    assert not any("fake" in text.lower() for text in sources.values()), sources
    assert metrics["tokens_per_sec"] and metrics["tokens_per_sec"] > 0
    assert metrics["top_kernels"] and "tokens_per_sec" in sources and "top_kernels" in sources
    units = {"tokens_per_sec": "tokens/s", "mfu_pct": "%", "hbm_peak_gb": "GB", "gpu_util_pct": "%"}
    if harness.DRY_RUN:
        harness.record(
            CHECK, "tokens_per_sec", _figure(metrics, "tokens_per_sec"), "tokens/s", sources["tokens_per_sec"]
        )
        return
    assert metrics["device_kind"] in ("cuda", "rocm"), metrics
    for field in MEASURED:
        harness.record(CHECK, field, _figure(metrics, field), units.get(field, ""), sources.get(field, "NO SOURCE"))
    harness.record(CHECK, "peak_tflops", metrics.get("peak_tflops"), "TFLOP/s", sources.get("peak_tflops", "NO SOURCE"))
    missing = [field for field in MEASURED if metrics.get(field) in (None, []) or field not in sources]
    assert not missing, f"no measured value or no source for {missing}; warnings: {metrics.get('warnings')}"
    assert metrics["mfu_pct"] > 0 and metrics["hbm_peak_gb"] > 0 and 0 <= metrics["gpu_util_pct"] <= 100
    gpu_name = metrics.get("gpu_name") or ""
    if "H200" in gpu_name:
        assert "H200" in sources["peak_tflops"], sources["peak_tflops"]  # the H200's dense bf16 peak, by name
    assert "GPU kernels" in sources["top_kernels"], sources["top_kernels"]
    assert "nvidia-smi" in sources["gpu_util_pct"] or "amd-smi" in sources["gpu_util_pct"], sources["gpu_util_pct"]
    assert metrics["attention_kernel_loaded"] is True, (metrics["attention_kernels"], metrics["top_kernels"])


def _step_time(record: dict[str, Any]) -> float | None:
    """A run's mean step time from its metrics.jsonl, measured the way RunMetrics measures it (runner/steps.py)."""
    return steps.pace(steps.read_metrics_jsonl(Path(record["remote_dir"]) / "metrics.jsonl")).step_time_s


def _window_ratio(record: dict[str, Any]) -> tuple[float, int, int] | None:
    """Mean period of the profiled steps over that of the steps the profiler did not touch, from torch_profile.json."""
    path = Path(record["remote_dir"]) / "profile" / "torch_profile.json"
    data = json.loads(path.read_text())
    window = set(data["window"]["profiled_steps"])
    records = data["step_records"]
    periods: dict[int, float] = {}
    for here, after in itertools.pairwise(records):
        if here.get("seconds") is not None and after.get("wait_before_s") is not None:
            periods[here["step"]] = here["seconds"] + after["wait_before_s"]
    inside = [p for s, p in periods.items() if s in window]
    # Steps next to the window pay for the profiler's start and stop: neither inside nor clean.
    outside = [p for s, p in periods.items() if all(abs(s - w) > 2 for w in window)]
    if not inside or not outside:
        return None
    return statistics.mean(inside) / statistics.mean(outside), len(inside), len(outside)


def test_the_profilers_own_slowdown_is_measured_as_a_ratio(profiled: Profiled) -> None:
    with_profiler, without = _step_time(profiled.profiled), _step_time(profiled.twin)
    assert with_profiler and without, (with_profiler, without)
    harness.record(
        CHECK,
        "profiler slowdown, whole run",
        round(with_profiler / without, 4),
        "x",
        f"mean step time of the --profile run ({with_profiler * 1e3:.2f} ms) over its unprofiled twin's "
        f"({without * 1e3:.2f} ms), {STEPS} steps each, from metrics.jsonl (runner/steps.py)",
    )
    window = _window_ratio(profiled.profiled)
    assert window is not None, "torch_profile.json holds no profiled window"
    ratio, inside, outside = window
    harness.record(
        CHECK,
        "profiler slowdown, profiled steps",
        round(ratio, 3),
        "x",
        f"torch_profile.json: mean period of the {inside} steps in the profiler's window over {outside} "
        "steps away from it (the window's kernel table is built in its last step)",
    )
