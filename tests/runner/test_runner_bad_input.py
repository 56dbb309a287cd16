"""Bad input is parsed as far as it goes, with warnings: never a crash, never a made-up number."""

from __future__ import annotations

import json

import pytest

from runner import rocprof
from runner.assemble import parse_run
from runner.steps import pace, read_metrics_jsonl
from tests.runner.runner_fixture_numbers import STEPS


def fold(path) -> rocprof.KernelTrace:
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(path, trace)
    trace.finish()
    return trace


def test_a_trace_cut_off_in_the_middle_of_a_row_keeps_the_rows_before_it(tmp_path, fixtures):
    text = (fixtures / "stream/gpuhost/4023_kernel_trace.csv").read_text()
    cut = text[: text.index("\n", len(text) // 2) + 40]  # a partial last line
    path = tmp_path / "cut_kernel_trace.csv"
    path.write_text(cut)
    trace = fold(path)
    complete_rows = cut.count("\n") - 1
    assert trace.dispatches == complete_rows
    assert trace.bad_rows == 0  # the cut row is dropped as cut, not read
    assert any("does not end with a newline" in w and "dropped" in w for w in trace.warnings)


def test_a_quote_left_open_by_a_crash_does_not_swallow_or_crash(tmp_path, fixtures):
    lines = (fixtures / "rocm62/gpuhost/4021_kernel_trace.csv").read_text().splitlines()
    path = tmp_path / "open_kernel_trace.csv"
    path.write_text("\n".join(lines[:5]) + '\n"KERNEL_DISPATCH",2,1,11,"void broken<\x00\x00\x00')
    trace = fold(path)
    assert trace.dispatches == 4


def test_an_empty_file_and_a_header_only_file_give_no_kernels_and_a_warning_or_nothing(tmp_path, fixtures):
    empty = tmp_path / "empty_kernel_trace.csv"
    empty.write_text("")
    header = tmp_path / "header_kernel_trace.csv"
    header.write_text((fixtures / "rocm62/gpuhost/4021_kernel_trace.csv").read_text().splitlines()[0] + "\n")
    assert fold(empty).warnings and fold(empty).dispatches == 0
    assert fold(header).dispatches == 0 and not fold(header).warnings
    metrics = parse_run(tmp_path, None)
    assert metrics.top_kernels == [] and metrics.attention_kernel_loaded is None
    assert any("no kernel dispatches" in w for w in metrics.warnings)


def test_a_file_without_the_needed_columns_is_skipped_with_a_warning(tmp_path):
    path = tmp_path / "odd_kernel_trace.csv"
    path.write_text('"Kind","Agent_Id","Some_New_Column"\n"KERNEL_DISPATCH",2,7\n')
    trace = fold(path)
    assert trace.dispatches == 0
    assert "no kernel-trace header" in trace.warnings[0]


def test_unknown_extra_columns_are_ignored(tmp_path, fixtures):
    lines = (fixtures / "rocm62/gpuhost/4021_kernel_trace.csv").read_text().splitlines()
    path = tmp_path / "extra_kernel_trace.csv"
    path.write_text("\n".join([lines[0] + ',"Future_Column"'] + [line + ",42" for line in lines[1:]]) + "\n")
    assert fold(path).dispatches == 7 * STEPS


def test_na_nan_and_negative_timestamps_are_skipped_and_counted(tmp_path):
    path = tmp_path / "nan_kernel_trace.csv"
    path.write_text(
        '"Kind","Agent_Id","Kernel_Name","Start_Timestamp","End_Timestamp"\n'
        '"KERNEL_DISPATCH",1,"good",100,200\n'
        '"KERNEL_DISPATCH",1,"na",N/A,200\n'
        '"KERNEL_DISPATCH",1,"nan",nan,200\n'
        '"KERNEL_DISPATCH",1,"backwards",300,100\n'
        '"KERNEL_DISPATCH",1,"float",300.0,400.5\n'
    )
    trace = fold(path)
    assert set(trace.kernels) == {"good", "float"}
    assert trace.bad_rows == 3


def test_a_repeated_header_and_other_dispatch_kinds_are_not_counted_as_kernels(tmp_path, fixtures):
    text = (fixtures / "rocm62/gpuhost/4021_kernel_trace.csv").read_text()
    path = tmp_path / "twice_kernel_trace.csv"
    path.write_text(text + text.splitlines()[0] + "\n" + '"MEMORY_COPY",2,1,0,"copy",1,5,9,0,0,1,1,1,1,1,1\n')
    trace = fold(path)
    assert trace.dispatches == 7 * STEPS and trace.other_kinds == 1 and trace.bad_rows == 1


def test_binary_garbage_named_like_a_trace_does_not_crash(tmp_path):
    path = tmp_path / "garbage_kernel_trace.csv"
    path.write_bytes(bytes(range(256)) * 64)
    metrics = parse_run(tmp_path, None)
    assert metrics.top_kernels == []
    assert metrics.warnings


def test_an_unreadable_amd_smi_file_gives_no_hbm_numbers_and_says_so(tmp_path):
    (tmp_path / "amdsmi_monitor.csv").write_text("ERROR: amdgpu driver not loaded\n")
    metrics = parse_run(tmp_path, None)
    assert metrics.hbm_peak_gb is None and metrics.gpu_util_pct is None
    assert any("amdsmi_monitor.csv" in w for w in metrics.warnings)


def test_metrics_jsonl_with_broken_lines_nan_and_a_missing_end_still_gives_the_pace(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        json.dumps({"event": "begin", "time": 100.0, "max_steps": 10, "snapshots": True, "start_step": 0}),
        '{"event": "log", "time": 1',
        json.dumps({"event": "log", "time": 101.0, "step": 2, "loss": float("nan"), "tokens": 1000}),
        "not json at all",
        '{"event": "log", "time": NaN, "step": 3}',
        json.dumps({"event": "log", "time": 103.0, "step": 4, "loss": 1.0, "tokens": 3000}),
    ]
    path.write_text("\n".join(lines) + "\n")
    result = pace(read_metrics_jsonl(path))
    assert result.steps == 4
    assert result.step_time_s == pytest.approx(1.0)
    assert result.tokens_per_sec == pytest.approx(1000.0)
    assert any("3 unreadable lines" in w for w in result.warnings)


def test_metrics_jsonl_without_token_counts_leaves_tokens_per_second_unknown(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"event": "log", "time": 10.0 + s, "step": s}) + "\n" for s in (1, 2, 3)))
    result = pace(read_metrics_jsonl(path))
    assert result.step_time_s == pytest.approx(1.0)
    assert result.tokens_per_sec is None
    assert any("no token counts" in w for w in result.warnings)


def test_a_missing_profile_and_a_missing_metrics_file_give_empty_metrics_with_reasons(tmp_path):
    metrics = parse_run(tmp_path / "nowhere", tmp_path / "missing.jsonl")
    dumped = metrics.model_dump()
    for field in ("steps", "step_time_s", "tokens_per_sec", "mfu_pct", "hbm_peak_gb", "gpu_util_pct"):
        assert dumped[field] is None, field
    assert any("no profile directory" in w for w in metrics.warnings)
    assert any("metrics.jsonl is missing" in w for w in metrics.warnings)
    assert metrics.runner_kind == "live"


def test_kernel_stats_with_na_and_a_cut_off_row_keep_what_is_readable(tmp_path):
    path = tmp_path / "x_kernel_stats.csv"
    path.write_text(
        '"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"\n'
        '"a",2,100,50,50,40,60,10\n"b",1,N/A,N/A,N/A,N/A,N/A,N/A\n"c",1,100,100,50,60,140,2\n"d",1,100,100,50,1'
    )
    warnings: list[str] = []
    stats = rocprof.read_kernel_stats(path, warnings)
    # "d" is the last row of a file without a final newline: possibly cut, so dropped.
    assert stats == {"a": (2, 100.0), "c": (1, 100.0)}
    assert any("1 unreadable rows" in w for w in warnings)
    assert any("does not end with a newline" in w for w in warnings)


STATS_HEADER = '"Name","Calls","TotalDurationNs","AverageNs","Percentage","MinNs","MaxNs","StdDev"\n'


def test_a_kernel_stats_row_cut_short_at_the_end_of_the_file_is_dropped_with_a_warning_not_read_as_a_smaller_time(
    tmp_path,
):
    (tmp_path / "host").mkdir()
    path = tmp_path / "host" / "1_kernel_stats.csv"
    # rocprofv3 was killed while writing "b": 4 calls, 40... ns (4096? 40960?). Not a number to keep.
    path.write_text(STATS_HEADER + '"a",2,1000,500,50,400,600,10\n"b",4,40')
    warnings: list[str] = []
    assert rocprof.read_kernel_stats(path, warnings) == {"a": (2, 1000.0)}
    assert warnings == [
        f"{path.name}: the file does not end with a newline, so its last row may be cut off; that row was dropped"
    ]
    metrics = parse_run(tmp_path, None)
    assert [k.name for k in metrics.top_kernels] == ["a"]
    assert metrics.kernel_time_s == pytest.approx(1000 / 1e9)
    assert any("host/1_kernel_stats.csv: the file does not end with a newline" in w for w in metrics.warnings)


def test_the_same_kernel_stats_ending_with_a_newline_keep_every_row_and_warn_nothing(tmp_path):
    path = tmp_path / "1_kernel_stats.csv"
    path.write_text(STATS_HEADER + '"a",2,1000,500,50,400,600,10\n"b",4,40\n')
    warnings: list[str] = []
    assert rocprof.read_kernel_stats(path, warnings) == {"a": (2, 1000.0), "b": (4, 40.0)}
    assert warnings == []


def test_a_kernel_trace_whose_last_row_is_cut_after_its_timestamps_drops_that_row_too(tmp_path, fixtures):
    lines = (fixtures / "rocm7/gpuhost/4024_kernel_trace.csv").read_text().splitlines()
    last = lines[-1]
    cut = last[: last.rindex(",")]  # the Grid_Size_Z column lost: the timestamps still read as numbers
    path = tmp_path / "1_kernel_trace.csv"
    path.write_text("\n".join([*lines[:-1], cut]))
    trace = fold(path)
    assert trace.dispatches == len(lines) - 2  # every row but the header and the cut one
    assert trace.bad_rows == 0
    assert any("does not end with a newline" in w for w in trace.warnings)


def test_an_amd_smi_monitor_row_cut_mid_field_is_dropped_with_a_warning(tmp_path):
    from runner import amdsmi

    path = tmp_path / "amdsmi_monitor.csv"
    # The last sample was cut inside vram_used (61.5 GB? 615?): no sample is made of it.
    path.write_text("gpu,gfx,vram_used,vram_total\n0,50,2.0,191.5\n0,97,6")
    telemetry = amdsmi.Telemetry()
    amdsmi.read_monitor_csv(path, telemetry)
    gpu = telemetry.gpus["0"]
    assert telemetry.samples == 1
    assert gpu.vram_used_gb.count == 1 and gpu.vram_used_gb.high == pytest.approx(2.0)
    assert (gpu.gfx_pct.count, gpu.gfx_pct.high) == (1, 50)
    assert any("amdsmi_monitor.csv: the file does not end with a newline" in w for w in telemetry.warnings)


def test_a_torch_kernel_table_cut_at_its_last_row_keeps_the_complete_rows(tmp_path):
    from runner import torchprof

    path = tmp_path / "torch_kernels.csv"
    path.write_text("name,device,calls,total_us\ngemm,gpu,3,30\nsoftmax,gpu,2,1")
    table = torchprof.read_torch_kernels(path)
    assert table.gpu == {"gemm": (3, 30000.0)}
    assert any("does not end with a newline" in w for w in table.warnings)
