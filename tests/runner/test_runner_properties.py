"""Properties: kernel percentages add up to 100, the waste budget adds up to the step time, busy <= sum."""

from __future__ import annotations

import csv
import io
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runner import rocprof
from runner.kernels import kernel_shares
from runner.waste import BudgetInputs, waste_budget

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=60)
totals = st.dictionaries(names, st.tuples(st.integers(1, 10_000), st.floats(1.0, 1e12)), min_size=1, max_size=60)


@given(totals, st.integers(0, 20))
def test_kernel_percentages_and_the_rest_add_up_to_100(table, top_n):
    top, other = kernel_shares(table, top_n)
    assert len(top) == min(top_n, len(table))
    assert sum(k.pct_time for k in top) + other == pytest.approx(100.0, abs=1e-6)
    assert all(a.pct_time >= b.pct_time for a, b in itertools.pairwise(top))


@given(
    st.floats(0.001, 100),
    st.floats(0.0, 200),
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 1),
    st.floats(0, 1),
    st.one_of(st.none(), st.floats(0, 100)),
    st.one_of(st.none(), st.floats(0, 192)),
)
def test_the_seven_buckets_add_up_to_the_step_time(step, busy, useful, comm, precision, shape, wait, hbm_peak):
    budget = waste_budget(
        BudgetInputs(
            step_time_s=step,
            busy_s=busy,
            category_ns={"useful": useful, "comm": comm, "precision": precision, "shape": shape},
            data_wait_s=wait,
            hbm_peak_gb=hbm_peak,
            hbm_total_gb=192.0,
        )
    ).budget
    if useful + comm + precision + shape > 0:
        assert budget.known_total() == pytest.approx(step, rel=1e-9, abs=1e-12)
    for field in (
        "useful_gpu",
        "data_wait",
        "host_gap",
        "comm_excess",
        "memory_headroom",
        "precision_path",
        "kernel_shape",
    ):
        value = getattr(budget, field)
        assert value is None or value >= -1e-12


intervals = st.lists(st.tuples(st.integers(0, 10_000_000), st.integers(1, 500_000)), min_size=1, max_size=300)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(intervals, st.randoms())
def test_busy_time_is_the_exact_union_of_intervals_in_any_order_within_the_window(tmp_path, spans, rng):
    rows = [(s, s + d) for s, d in spans]
    rng.shuffle(rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["Kind", "Agent_Id", "Kernel_Name", "Start_Timestamp", "End_Timestamp"])
    writer.writerows(["KERNEL_DISPATCH", 1, f"k{i % 7}", s, e] for i, (s, e) in enumerate(rows))
    path = tmp_path / "prop_kernel_trace.csv"
    path.write_text(buffer.getvalue())
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(path, trace)
    trace.finish()
    expected, end = 0, -1
    for s, e in sorted(rows):
        if s > end:
            expected += e - s
            end = e
        elif e > end:
            expected += e - end
            end = e
    assert trace.busy_ns["1"] == expected
    assert trace.kernel_ns == sum(e - s for s, e in rows) >= expected


def test_busy_time_stays_bounded_when_rows_arrive_later_than_the_merge_window(tmp_path, monkeypatch):
    monkeypatch.setattr(rocprof, "MERGE_WINDOW", 4)
    rows = [(i * 100, i * 100 + 50) for i in range(20)]
    late = rows[2:] + rows[:2]  # two intervals arrive after the window that held them was merged
    path = tmp_path / "late_kernel_trace.csv"
    path.write_text("Kernel_Name,Start_Timestamp,End_Timestamp\n" + "".join(f"k,{s},{e}\n" for s, e in late))
    trace = rocprof.KernelTrace()
    rocprof.read_kernel_trace(path, trace)
    trace.finish()
    assert trace.late == 2
    assert trace.busy_ns[""] <= trace.kernel_ns == 20 * 50
    assert any("out of order" in w for w in trace.warnings)


cells = st.one_of(
    st.integers(-(10**18), 10**18).map(str),
    st.sampled_from(["N/A", "nan", "", "inf", "KERNEL_DISPATCH", '"', '""', "Agent 2", "1e309", "-0"]),
    st.text(max_size=12),
)
lines = st.lists(st.lists(cells, max_size=8).map(",".join), max_size=25)
TRACE_HEADER = '"Kind","Agent_Id","Queue_Id","Kernel_Name","Start_Timestamp","End_Timestamp"'
MONITOR_HEADER = "gpu,power_usage,gfx,vram_used,vram_total"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=40, deadline=None)
@given(lines, lines, st.lists(st.text(max_size=40), max_size=10), st.booleans())
def test_arbitrary_garbage_in_every_input_never_crashes_the_parsers(tmp_path_factory, trace, monitor, jsonl, headers):
    from runner.assemble import parse_run

    root = tmp_path_factory.mktemp("garbage")
    profile = root / "profile"
    (profile / "host").mkdir(parents=True)
    (profile / "host" / "1_kernel_trace.csv").write_text("\n".join(([TRACE_HEADER] if headers else []) + trace))
    (profile / "host" / "1_kernel_stats.csv").write_text("\n".join(trace))
    (profile / "host" / "1_agent_info.csv").write_text(
        "\n".join((["Agent_Type,Name,Cu_Count"] if headers else []) + monitor)
    )
    (profile / "amdsmi_monitor.csv").write_text("\n".join(([MONITOR_HEADER] if headers else []) + monitor))
    (profile / "amdsmi_metric.jsonl").write_text("\n".join(jsonl))
    (profile / "torch_profile.json").write_text("".join(jsonl))
    (profile / "runner.json").write_text("".join(jsonl))
    (root / "metrics.jsonl").write_text("\n".join(jsonl))
    metrics = parse_run(profile, root / "metrics.jsonl")
    assert not [w for w in metrics.warnings if "internal error" in w]
    assert sum(k.pct_time for k in metrics.top_kernels) + metrics.other_kernels_pct in (0, pytest.approx(100))
