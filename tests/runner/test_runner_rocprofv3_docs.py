"""Real rocprofv3 output: the sample files of ROCm's rocprofiler-sdk documentation (issue 34, item 21).

The samples (MIT, AMD; see fixtures/rocprofv3_docs/README.md) come in two layouts: 2024
(integer Agent_Id, a counter collection without timestamps, files ending with a blank line) and
2025 (ROCm 7: "Agent N", Stream_Id, a counter collection with each dispatch's timestamps). The
expected numbers are computed here from the files with the csv module, not by the parsers.
"""

from __future__ import annotations

import csv
import shutil
from collections import Counter
from pathlib import Path

import pytest

from runner import rocprof
from runner.assemble import parse_run
from runner.discover import find_profile_files
from runner.format import format_metrics

DOCS = Path(__file__).resolve().parent / "fixtures" / "rocprofv3_docs"
OLD, NEW = DOCS / "rocprofiler-sdk-2024", DOCS / "rocm-systems-2025"


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as stream:
        return [row for row in csv.DictReader(stream) if any(row.values())]


def union_ns(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, -1
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def expected_trace(path: Path) -> tuple[Counter[str], int, int]:
    """Calls per kernel, summed duration and busy time (one agent in every sample) of a kernel trace."""
    data = rows(path)
    calls = Counter(row["Kernel_Name"] for row in data)
    spans = [(int(row["Start_Timestamp"]), int(row["End_Timestamp"])) for row in data]
    return calls, sum(e - s for s, e in spans), union_ns(spans)


@pytest.mark.parametrize("sample", [OLD, NEW], ids=["2024", "2025"])
def test_each_documented_kernel_trace_gives_its_calls_time_and_busy_time_with_no_unreadable_row(sample):
    calls, kernel_ns, busy_ns = expected_trace(sample / "kernel_trace.csv")
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(sample / "kernel_trace.csv", trace)
    trace.finish()
    assert {name: n for name, (n, _) in trace.kernels.items()} == dict(calls)
    assert trace.kernel_ns == kernel_ns and list(trace.busy_ns.values()) == [busy_ns]
    assert trace.bad_rows == 0 and trace.csv_errors == 0 and trace.warnings == []


def test_the_2024_files_end_with_a_blank_line_which_is_not_counted_as_an_unreadable_row():
    for name in ("kernel_trace.csv", "counter_collection.csv"):
        assert (OLD / name).read_bytes().endswith(b"\n\n"), name
    metrics = parse_run(OLD)
    assert not [w for w in metrics.warnings if "unreadable" in w], metrics.warnings


def test_the_2024_sample_directory_reads_its_trace_and_its_counters():
    metrics = parse_run(OLD)
    counters = rows(OLD / "counter_collection.csv")
    assert metrics.profiler == "rocprofv3" and metrics.dispatch_count == len(rows(OLD / "kernel_trace.csv"))
    assert metrics.counters == {"SQ_WAVES": sum(float(row["Counter_Value"]) for row in counters)}
    assert "7 dispatches" in metrics.sources["counters"]
    assert "counter_collection.csv" in metrics.files and "kernel_trace.csv" in metrics.files
    text = format_metrics(metrics.model_dump())
    assert "Counters (rocprofv3 counter collection" in text and "SQ_WAVES" in text and "114,688" in text


def test_the_2025_counter_collection_without_a_final_newline_drops_only_its_possibly_cut_last_row(tmp_path):
    # The documentation's copy lacks the final newline rocprofv3 writes: its last row could be cut
    # (a timestamp's last digits), so it is dropped with the warning any such file gets.
    collection = rocprof.CounterCollection()
    rocprof.read_counter_collection(NEW / "counter_collection.csv", collection)
    everything = rows(NEW / "counter_collection.csv")
    assert collection.dispatches == len(everything) - 1
    assert collection.warnings == [
        "counter_collection.csv: the file does not end with a newline, so its last row may be cut off; "
        "that row was dropped"
    ]
    whole = tmp_path / "counter_collection.csv"
    whole.write_bytes((NEW / "counter_collection.csv").read_bytes() + b"\n")
    collection = rocprof.CounterCollection()
    rocprof.read_counter_collection(whole, collection)
    assert collection.dispatches == len(everything) and collection.warnings == []
    assert collection.counters == {"SQ_WAVES": sum(float(row["Counter_Value"]) for row in everything)}


def test_a_2025_counter_collection_alone_gives_the_kernel_times_of_its_dispatches(tmp_path):
    profile = tmp_path / "profile" / "gpuhost"
    profile.mkdir(parents=True)
    path = profile / "834304_counter_collection.csv"
    path.write_bytes((NEW / "counter_collection.csv").read_bytes() + b"\n")
    calls, kernel_ns, busy_ns = expected_trace(path)
    metrics = parse_run(tmp_path / "profile")
    assert metrics.profiler == "rocprofv3" and metrics.dispatch_count == sum(calls.values())
    assert {k.name: k.calls for k in metrics.top_kernels} == dict(calls)
    assert metrics.kernel_time_s == pytest.approx(kernel_ns / 1e9)
    assert metrics.gpu_busy_s == pytest.approx(busy_ns / 1e9)
    assert metrics.sources["top_kernels"].startswith("rocprofv3 1 counter collection file(s), 4 dispatches")


def test_a_2024_counter_collection_alone_names_its_kernels_and_says_their_times_are_unknown(tmp_path):
    shutil.copy(OLD / "counter_collection.csv", tmp_path / "19396_counter_collection.csv")
    metrics = parse_run(tmp_path)
    assert metrics.profiler == "rocprofv3"
    assert metrics.dispatch_count == 7 and metrics.kernel_count == 3
    assert metrics.kernel_time_s is None and metrics.gpu_busy_s is None and metrics.top_kernels == []
    assert any("without timestamps" in w and "--kernel-trace" in w for w in metrics.warnings), metrics.warnings


def test_the_2025_sample_directory_reads_the_trace_and_counters_and_no_other_csv_as_a_trace():
    files = find_profile_files(NEW)
    assert [p.name for p in files.kernel_traces] == ["kernel_trace.csv"]
    assert [p.name for p in files.counter_collections] == ["counter_collection.csv"]
    metrics = parse_run(NEW)
    calls, kernel_ns, busy_ns = expected_trace(NEW / "kernel_trace.csv")
    # The trace is the kernel-time source; the counter collection's dispatches are not added again.
    assert metrics.dispatch_count == sum(calls.values())
    assert metrics.kernel_time_s == pytest.approx(kernel_ns / 1e9)
    assert metrics.gpu_busy_s == pytest.approx(busy_ns / 1e9)
    assert (
        metrics.gpu_count == 1
        and "layout: rocprofv3 (Stream_Id, Thread_Id, Dispatch_Id)" in metrics.sources["top_kernels"]
    )
    assert set(metrics.counters) == {"SQ_WAVES"}


def test_a_trace_of_truncated_kernel_names_and_a_rocpd_convert_api_trace_are_read_for_what_they_are():
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(NEW / "kernel_trace_truncated.csv", trace)
    trace.finish()
    assert set(trace.kernels) == {"addition_kernel", "divide_kernel", "multiply_kernel", "subtract_kernel"}
    assert trace.bad_rows == 0
    # `rocpd convert`'s HIP API trace (a leading Guid column) has no kernel columns: skipped, saying so.
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(NEW / "rocpd-to-csv.csv", trace)
    assert trace.dispatches == 0 and trace.warnings == [
        "rocpd-to-csv.csv: no kernel-trace header (Kernel_Name, Start_Timestamp, End_Timestamp) found; file skipped"
    ]
