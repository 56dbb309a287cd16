"""Every profiler CSV goes through one row loop (`csvstream.read_table`): the same header
matching, the same handling of a cut-off last row and the same warnings, whichever parser reads it."""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path

import pytest

from runner import amdsmi, csvstream, rocprof, torchprof


def trace_names(path: Path) -> tuple[set[str], list[str]]:
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(path, trace)
    trace.finish()
    return set(trace.kernels), trace.warnings


def stats_names(path: Path) -> tuple[set[str], list[str]]:
    warnings: list[str] = []
    return set(rocprof.read_kernel_stats(path, warnings)), warnings


def agent_names(path: Path) -> tuple[set[str], list[str]]:
    warnings: list[str] = []
    return {agent.name for agent in rocprof.read_agent_info(path, warnings)}, warnings


def torch_names(path: Path) -> tuple[set[str], list[str]]:
    kernels = torchprof.read_torch_kernels(path)
    return set(kernels.gpu) | set(kernels.cpu), kernels.warnings


def monitor_gpus(path: Path) -> tuple[set[str], list[str]]:
    telemetry = amdsmi.Telemetry()
    amdsmi.read_monitor_csv(path, telemetry)
    return set(telemetry.gpus), telemetry.warnings


# Each reader with a header, one complete row (whose key it keeps) and a second row that a job
# killed mid-write left without its line break.
READERS: dict[str, tuple[Callable[[Path], tuple[set[str], list[str]]], str, str, str, str]] = {
    "kernel trace": (
        trace_names,
        '"Kind","Agent_Id","Kernel_Name","Start_Timestamp","End_Timestamp"\n',
        '"KERNEL_DISPATCH",1,"gemm",100,200\n',
        '"KERNEL_DISPATCH",1,"softmax",300,40',
        "gemm",
    ),
    "kernel stats": (stats_names, '"Name","Calls","TotalDurationNs"\n', '"gemm",2,1000\n', '"softmax",4,40', "gemm"),
    "agent info": (
        agent_names,
        '"Node_Id","Agent_Type","Name","Cu_Count"\n',
        '1,"GPU","gfx942",304\n',
        '2,"GPU","gfx9',
        "gfx942",
    ),
    "torch kernels": (torch_names, "name,calls,total_us,device\n", "gemm,3,30,gpu\n", "softmax,2,1", "gemm"),
    "amd-smi monitor": (monitor_gpus, "gpu,gfx,vram_used,vram_total\n", "0,50,2.0,191.5\n", "1,97,6", "0"),
}


@pytest.mark.parametrize("kind", READERS)
def test_every_profiler_csv_drops_a_last_row_cut_mid_way_and_says_so_in_the_same_words(tmp_path, kind):
    read, header, row, cut, key = READERS[kind]
    path = tmp_path / "cut.csv"
    path.write_text(header + row + cut)
    kept, warnings = read(path)
    assert kept == {key}
    assert warnings == [
        "cut.csv: the file does not end with a newline, so its last row may be cut off; that row was dropped"
    ]


@pytest.mark.parametrize("kind", READERS)
def test_every_profiler_csv_keeps_its_last_row_when_the_file_ends_with_a_newline(tmp_path, kind):
    read, header, row, _, key = READERS[kind]
    path = tmp_path / "whole.csv"
    path.write_text(header + row)
    assert read(path) == ({key}, [])


@pytest.mark.parametrize("kind", READERS)
def test_every_profiler_csv_that_cannot_be_opened_gives_a_warning_not_an_exception(tmp_path, kind):
    read = READERS[kind][0]
    path = tmp_path / "a_directory.csv"
    path.mkdir()
    kept, warnings = read(path)
    assert kept == set()
    assert len(warnings) == 1 and warnings[0].startswith("a_directory.csv: could not be read (")


@pytest.mark.parametrize("kind", READERS)
def test_every_profiler_csv_without_its_header_is_skipped_with_a_warning(tmp_path, kind):
    read, _, row, _, _ = READERS[kind]
    path = tmp_path / "headless.csv"
    path.write_text("some tool's banner\n" + row)
    kept, warnings = read(path)
    assert kept == set()
    assert len(warnings) == 1 and warnings[0].startswith("headless.csv: no ") and "file skipped" in warnings[0]


@pytest.mark.parametrize("kind", ["kernel stats", "torch kernels"])
def test_a_row_shorter_than_its_header_is_skipped_and_counted_not_read_as_zero_calls(tmp_path, kind):
    read, header, row, _, key = READERS[kind]
    path = tmp_path / "short.csv"
    path.write_text(header + row + '"lonely"\n')
    kept, warnings = read(path)
    assert kept == {key}
    assert warnings == ["short.csv: 1 unreadable rows skipped"]


@pytest.fixture
def field_limit_of_16(monkeypatch):
    """csv's field limit lowered to 16 characters, so a long field is a line csv cannot read."""
    monkeypatch.setattr(csvstream, "FIELD_LIMIT", 16)
    previous = csv.field_size_limit(16)
    yield
    csv.field_size_limit(previous)


def test_a_file_with_more_unreadable_lines_than_the_limit_is_given_up_on_and_says_so(tmp_path, field_limit_of_16):
    path = tmp_path / "1_kernel_stats.csv"
    too_long = f'"{"x" * 40}",1,1\n'
    path.write_text('"Name","Calls","TotalDurationNs"\n"gemm",2,1000\n' + too_long * (csvstream.MAX_CSV_ERRORS + 5))
    warnings: list[str] = []
    assert rocprof.read_kernel_stats(path, warnings) == {"gemm": (2, 1000.0)}
    assert warnings == [
        f"1_kernel_stats.csv: {csvstream.MAX_CSV_ERRORS + 1} unreadable rows skipped",
        "1_kernel_stats.csv: too many malformed lines; read stopped early",
    ]
