"""Every published rocprofv3 layout parses to the same numbers (fixtures in tests/runner/fixtures)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from runner import rocprof
from runner.assemble import parse_run
from runner.cli import profile_parse_main
from runner.discover import find_profile_files
from runner.hardware import gfx_name, peak_from_agent
from tests.runner.runner_fixture_numbers import BUSY_NS_PER_STEP, GEMM_SHARE, KERNEL_NS_PER_STEP, STEPS


def read_trace(*paths: Path) -> rocprof.KernelTrace:
    trace = rocprof.KernelTrace()
    for path in paths:
        rocprof.read_kernel_trace(path, trace)
    trace.finish()
    return trace


def assert_standard_trace(trace: rocprof.KernelTrace) -> None:
    assert trace.dispatches == 7 * STEPS
    assert trace.kernel_ns == KERNEL_NS_PER_STEP * STEPS
    assert list(trace.busy_ns.values()) == [BUSY_NS_PER_STEP * STEPS]
    assert len(trace.kernels) == 5
    assert trace.bad_rows == 0 and trace.csv_errors == 0 and not trace.warnings


LAYOUTS = {
    "rocm62/gpuhost/4021_kernel_trace.csv": "rocprofv3 (no Stream/Thread/Dispatch ids)",
    "rocm63/gpuhost/4022_kernel_trace.csv": "rocprofv3 (Thread_Id, Dispatch_Id)",
    "stream/gpuhost/4023_kernel_trace.csv": "rocprofv3 (Stream_Id, Thread_Id, Dispatch_Id)",
    "rocm7/gpuhost/4024_kernel_trace.csv": "rocprofv3 (Stream_Id, Thread_Id, Dispatch_Id)",
    "rocpd/kernel_trace.csv": "rocpd convert (Guid column)",
}


@pytest.mark.parametrize("relative", sorted(LAYOUTS))
def test_each_published_kernel_trace_layout_gives_the_same_totals(fixtures, relative):
    trace = read_trace(fixtures / relative)
    assert_standard_trace(trace)
    assert trace.layouts == [LAYOUTS[relative]]


def test_the_rocm_6_2_layout_without_thread_or_dispatch_ids_is_read(fixtures):
    header = (fixtures / "rocm62/gpuhost/4021_kernel_trace.csv").read_text().splitlines()[0]
    assert "Thread_Id" not in header and "Dispatch_Id" not in header and "Stream_Id" not in header
    assert_standard_trace(read_trace(fixtures / "rocm62/gpuhost/4021_kernel_trace.csv"))


def test_the_rocm_7_layout_with_agent_names_and_rows_out_of_order_merges_busy_time_exactly(fixtures):
    trace = read_trace(fixtures / "rocm7/gpuhost/4024_kernel_trace.csv")
    assert list(trace.busy_ns) == ["Agent 4"]
    assert_standard_trace(trace)


def test_rocpd_convert_output_with_a_leading_guid_column_is_read(fixtures):
    path = fixtures / "rocpd/kernel_trace.csv"
    assert path.read_text().startswith('"Guid","Kind"')
    assert_standard_trace(read_trace(path))


def test_column_names_match_whatever_their_case_and_separators(tmp_path, fixtures):
    text = (fixtures / "rocpd/kernel_trace.csv").read_text().splitlines()
    mixed = (
        text[0]
        .replace("Kernel_Name", "KERNEL_NAME")
        .replace("Start_Timestamp", "start_timestamp")
        .replace("End_Timestamp", "End Timestamp")
        .replace("Guid", "GUID")
        .replace("Kind", "kind")
    )
    path = tmp_path / "mixed_kernel_trace.csv"
    path.write_text("\n".join([mixed, *text[1:]]) + "\n")
    assert_standard_trace(read_trace(path))


def test_kernel_names_are_kept_whole_with_their_commas_quotes_and_templates(fixtures):
    spec = importlib.util.spec_from_file_location("regenerate", fixtures / "regenerate.py")
    assert spec is not None and spec.loader is not None
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    written = {source.GEMM_BF16, source.NCCL, source.FMHA, source.ELEMENTWISE, source.SGEMM}
    for relative in LAYOUTS:
        assert set(read_trace(fixtures / relative).kernels) == written, relative


def test_a_trace_split_over_several_process_files_adds_up(fixtures):
    trace = read_trace(
        fixtures / "rocm62/gpuhost/4021_kernel_trace.csv", fixtures / "rocm63/gpuhost/4022_kernel_trace.csv"
    )
    assert trace.dispatches == 2 * 7 * STEPS
    assert trace.busy_ns == {"2": BUSY_NS_PER_STEP * STEPS, "4": BUSY_NS_PER_STEP * STEPS}


def test_kernel_stats_give_the_same_shares_as_the_trace(fixtures):
    warnings: list[str] = []
    stats = rocprof.read_kernel_stats(fixtures / "rocm7/gpuhost/4024_kernel_stats.csv", warnings)
    trace = read_trace(fixtures / "rocm7/gpuhost/4024_kernel_trace.csv")
    assert not warnings
    assert stats == trace.totals()


def test_a_directory_with_kernel_stats_only_still_lists_top_kernels_and_says_busy_time_is_unknown(fixtures):
    metrics = parse_run(fixtures / "stats_only", None)
    assert metrics.top_kernels[0].pct_time == pytest.approx(GEMM_SHARE)
    assert metrics.gpu_busy_s is None and metrics.waste_budget.useful_gpu is None
    assert any("no kernel trace" in w for w in metrics.warnings)


def test_agent_info_gives_the_gpu_and_its_bf16_peak_from_compute_units_and_clock(fixtures):
    agents = rocprof.read_agent_info(fixtures / "rocm7/gpuhost/4024_agent_info.csv", [])
    assert len(agents) == 1  # the CPU agent is left out
    gpu = agents[0]
    assert (gpu.name, gpu.product, gpu.cu_count, gpu.max_clock_mhz, gpu.gfx_target_version) == (
        "gfx942",
        "AMD Instinct MI300X",
        304,
        2100.0,
        90402,
    )
    assert gfx_name(gpu.gfx_target_version) == "gfx942" and gfx_name(90010) == "gfx90a"
    peak = peak_from_agent(gpu.name, gpu.cu_count, gpu.max_clock_mhz)
    assert peak is not None and peak.tflops == pytest.approx(1307.4, abs=0.1)


def test_the_default_host_pid_layout_is_found_under_the_output_directory(fixtures):
    files = find_profile_files(fixtures / "rocm7")
    assert [files.label(p) for p in files.kernel_traces] == ["gpuhost/4024_kernel_trace.csv"]
    assert [files.label(p) for p in files.agent_infos] == ["gpuhost/4024_agent_info.csv"]
    assert [files.label(p) for p in files.kernel_stats] == ["gpuhost/4024_kernel_stats.csv"]


def test_profile_parse_reads_the_default_layout_directory(fixtures, capsys):
    assert profile_parse_main([str(fixtures / "rocm7"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["profiler"] == "rocprofv3"
    assert metrics["dispatch_count"] == 28
    assert metrics["gpu_name"] == "AMD Instinct MI300X"
    assert metrics["attention_kernel_loaded"] is True


def test_profile_parse_reads_a_run_directory_in_the_dash_o_name_layout(fixtures, capsys):
    assert profile_parse_main([str(fixtures / "run_o_name"), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["files"][0] == "rocprof/run1_kernel_trace.csv"
    assert metrics["steps"] == STEPS
    assert metrics["step_time_s"] == pytest.approx(0.001, rel=1e-3)
    assert metrics["tokens_per_sec"] == pytest.approx(1536 / 0.003, rel=1e-3)
    assert metrics["gpu_busy_s"] == pytest.approx(BUSY_NS_PER_STEP * STEPS / 1e9)
    assert metrics["top_kernels"][0]["pct_time"] == pytest.approx(GEMM_SHARE)
    # MFU = tokens/s x (4N + 2T) / peak
    flops = 4 * 494032768 + 2 * 4399104
    assert metrics["mfu_pct"] == pytest.approx(100 * (1536 / 0.003) * flops / 1307.4e12, rel=1e-3)
    for field in ("steps", "step_time_s", "tokens_per_sec", "mfu_pct", "hbm_peak_gb", "gpu_util_pct", "top_kernels"):
        assert metrics["sources"][field], field


def test_the_waste_budget_of_a_traced_run_adds_up_to_the_step_time(fixtures):
    metrics = parse_run(fixtures / "run_o_name" / "profile", fixtures / "run_o_name" / "metrics.jsonl")
    budget = metrics.waste_budget
    assert budget.known_total() == pytest.approx(metrics.step_time_s, rel=1e-9)
    busy = BUSY_NS_PER_STEP / 1e9
    kernel = KERNEL_NS_PER_STEP / 1e9
    assert budget.comm_excess == pytest.approx(busy * 30e-6 / kernel)
    assert budget.precision_path == pytest.approx(busy * 20e-6 / kernel)
    assert budget.kernel_shape == pytest.approx(busy * 15e-6 / kernel)
    assert budget.useful_gpu == pytest.approx(busy * 150e-6 / kernel)
    assert budget.data_wait is None  # only torch.profiler measures it
    assert "estimate" in metrics.sources["waste_budget.memory_headroom"]
